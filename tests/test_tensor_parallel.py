"""Tensor-parallel ops and layers against their single-process maths.

Pure checks (tp=1, meta) run in-process; everything with a real split runs in ONE
spawned function on 2 gloo ranks (each spawn costs ~1 s of a 2-core budget).
Tolerances: fp32 throughout; a TP layer computes the same sums as the full layer but
in a different order (partial products all-reduced), so results agree to a few ulps:
rtol=1e-5, atol=1e-6 (fp32 epsilon is 1.2e-7; a 16-64 term dot product reordered).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.tensor_parallel import (
    ColumnParallelLinear,
    ReplicatedHeadLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from ctxpar.testing import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, reordered sums (module docstring)


@pytest.mark.quick
def test_cross_entropy_matches_torch_without_tp():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    target = torch.randint(0, 50, (3, 7))
    target[0, :4] = -100
    loss = vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.transpose(1, 2), target, reduction="none")
    torch.testing.assert_close(loss, ref, **TOL)
    assert torch.all(loss[0, :4] == 0)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, **TOL)
    assert torch.all(logits.grad[0, :4] == 0)  # ignored tokens: no gradient


def test_cross_entropy_all_ignored_is_zero_not_nan():
    logits = torch.randn(2, 5, 16, requires_grad=True)
    target = torch.full((2, 5), -100)
    loss = vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(2, 5)) and torch.equal(logits.grad, torch.zeros(2, 5, 16))


def test_layers_build_on_meta_with_megatron_attributes():
    from deepspeed.runtime.utils import is_model_parallel_parameter
    col = ColumnParallelLinear(64, 128, tp_group=None, device="meta")
    row = RowParallelLinear(128, 64, tp_group=None, device="meta")
    emb = VocabParallelEmbedding(1000, 64, tp_group=None, device="meta")
    rep = ReplicatedHeadLinear(64, 32, 1, tp_group=None, bias=False, device="meta")
    assert col.weight.is_meta and col.weight.shape == (128, 64)
    assert (col.weight.partition_dim, col.bias.partition_dim) == (0, 0)
    assert row.weight.partition_dim == 1 and emb.weight.partition_dim == 0
    for p in (col.weight, col.bias, row.weight, emb.weight):
        assert p.tensor_model_parallel and p.partition_stride == 1
        assert is_model_parallel_parameter(p)  # DeepSpeed counts it on every TP rank
    for p in (row.bias, rep.weight):  # replicated: counted once (TP rank 0) by DeepSpeed
        assert not is_model_parallel_parameter(p)


class _TwoLayer(nn.Module):
    """Every TP layer kind in one module, to test them together and the state-dict helpers."""

    def __init__(self, tp_group, n_kv_blocks):
        super().__init__()
        self.emb = VocabParallelEmbedding(32, 16, tp_group=tp_group)
        self.up = ColumnParallelLinear(16, 24, tp_group=tp_group)
        self.down = RowParallelLinear(24, 16, tp_group=tp_group)
        self.kv = ReplicatedHeadLinear(16, 8, n_kv_blocks, tp_group=tp_group)


def _tp_checks(rank, world):
    import torch.distributed as dist
    from deepspeed.runtime.utils import clip_grad_norm_
    from ctxpar import DeepSpeedMPU, init_parallel_state
    from ctxpar.tensor_parallel import (
        copy_to_tensor_model_parallel_region as f,
        gather_from_tensor_model_parallel_region as gather,
        gather_full_state_dict,
        load_full_state_dict_,
        reduce_from_tensor_model_parallel_region as g,
        scatter_to_tensor_model_parallel_region as scatter,
    )
    import deepspeed

    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    init_deepspeed_comm()  # DeepSpeed's comm wraps our process group
    # ...without JIT-loading the CPU shm op (a build, and a lock file a killed rank leaves).
    assert deepspeed.comm.comm.cdb.shm_comm_op is None
    state = init_parallel_state(tp=2)
    tp = state.tp_group
    torch.manual_seed(0)  # the same tensors on both ranks

    # f: identity forward, all-reduce backward; g: all-reduce forward, identity backward.
    x = torch.randn(4, 6, requires_grad=True)
    y = f(x, tp)
    assert torch.equal(y, x)
    (y * (rank + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))  # 1 + 2, exact
    x.grad = None
    y = g(x * (rank + 1), tp)
    torch.testing.assert_close(y, 3 * x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, float(rank + 1)))
    x.grad = None
    xs = scatter(x, tp)
    assert torch.equal(xs, x.chunk(2, dim=-1)[rank])
    w = torch.arange(24.0).view(4, 6)
    xg = gather(xs, tp)
    assert torch.equal(xg, x)
    (xg * w).sum().backward()  # gather bwd: this rank's slice; scatter bwd: all-gather
    torch.testing.assert_close(x.grad, w)

    for n_kv_blocks in (1, 2):  # MQA (both ranks share one head) and one head per rank
        full = {"emb.weight": torch.randn(32, 16), "up.weight": torch.randn(24, 16),
                "up.bias": torch.randn(24), "down.weight": torch.randn(16, 24),
                "down.bias": torch.randn(16), "kv.weight": torch.randn(8, 16),
                "kv.bias": torch.randn(8)}
        model = _TwoLayer(tp, n_kv_blocks)
        load_full_state_dict_(model, full, tp)
        tokens = torch.tensor([[0, 5, 16, 31, 15, 17]])  # rows on both vocab shards
        upstream = torch.randn(1, 6, 16)
        kv_upstream = torch.randn(2, 1, 6, 8 // n_kv_blocks)  # a different one per rank

        h = model.emb(tokens)
        out = model.down(F.gelu(model.up(h)))
        kv = model.kv(f(h, tp))
        ((out * upstream).sum() + (kv * kv_upstream[rank]).sum()).backward()

        ref = {k: v.clone().requires_grad_() for k, v in full.items()}
        rh = F.embedding(tokens, ref["emb.weight"])
        rout = F.linear(F.gelu(F.linear(rh, ref["up.weight"], ref["up.bias"])),
                        ref["down.weight"], ref["down.bias"])
        rkv = F.linear(rh, ref["kv.weight"], ref["kv.bias"])  # all heads; rank r used block r*n/2
        rkv_loss = sum((rkv.chunk(n_kv_blocks, -1)[r * n_kv_blocks // 2] * kv_upstream[r]).sum()
                       for r in range(2))
        ((rout * upstream).sum() + rkv_loss).backward()

        torch.testing.assert_close(out, rout, **TOL)
        torch.testing.assert_close(kv, rkv.chunk(n_kv_blocks, -1)[rank * n_kv_blocks // 2], **TOL)
        grads = gather_full_state_dict(model, tp, grads=True)
        for k in full:
            torch.testing.assert_close(grads[k], ref[k].grad, **TOL, msg=k)
        params = gather_full_state_dict(model, tp)
        assert all(torch.equal(params[k], full[k]) for k in full)

        # DeepSpeed's clipping norm with our mpu: split grads counted from every TP rank,
        # replicated ones (down.bias, kv.*) once -> the single-process norm.
        want = torch.linalg.vector_norm(torch.cat([ref[k].grad.flatten() for k in full]))
        got = clip_grad_norm_(list(model.parameters()), max_norm=1e9, mpu=DeepSpeedMPU(state))
        torch.testing.assert_close(torch.as_tensor(got).reshape(()), want, **TOL)

    # Column with gather_output, row with a replicated input: the plain linear.
    col = ColumnParallelLinear(16, 8, tp_group=tp, gather_output=True)
    row = RowParallelLinear(8, 16, tp_group=tp, input_is_parallel=False)
    wc, bc, wr, br = torch.randn(8, 16), torch.randn(8), torch.randn(16, 8), torch.randn(16)
    load_full_state_dict_(col, {"weight": wc, "bias": bc}, tp)
    load_full_state_dict_(row, {"weight": wr, "bias": br}, tp)
    x = torch.randn(3, 16)
    torch.testing.assert_close(row(col(x)), F.linear(F.linear(x, wc, bc), wr, br), **TOL)
    with pytest.raises(ValueError, match="full shape"):
        load_full_state_dict_(col, {"weight": wc[:4], "bias": bc}, tp)

    # Vocab-parallel cross entropy: each rank sees half the vocabulary.
    logits = torch.randn(2, 5, 32, requires_grad=True)
    target = torch.randint(0, 32, (2, 5))
    target[1] = -100  # a whole row ignored
    local = logits.detach().chunk(2, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp)
    ref = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    torch.testing.assert_close(loss, ref, **TOL)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(local.grad, logits.grad.chunk(2, -1)[rank], **TOL)
    dist.barrier()
    return True


@pytest.mark.quick
def test_tensor_parallel_layers_on_two_ranks():
    assert run_distributed(_tp_checks, 2, timeout=120) == [True, True]
