"""The pieces under the patterns: the block plan, the LSE merge, the kernels' adapters, the
ring on sub-groups and with no process group, and input checks on every rank.

Parity of every pattern (ring included) with one-process attention, bytes and FLOPs:
tests/test_context_parallel.py.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel.kernels import (FlashAttn4Backend, FlashAttnBackend, MathBackend,
                                             SdpaBackend)
from ctxpar.context_parallel import context_parallel_attention, ring_attention
from ctxpar.context_parallel.blocks import block_plan
from ctxpar.context_parallel.layouts import LAYOUTS, rank_positions, shard_sequence
from ctxpar.context_parallel.merge import merge_block_
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import (S_LOCAL, flash_attn_backward, flash_attn_forward_v26,
                                      global_inputs, reference_attention, tolerance)

EXACT = dict(atol=0, rtol=0)


@pytest.mark.quick
def test_single_rank_needs_no_process_group():
    assert not dist.is_initialized()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, h, 40, generator=gen, requires_grad=True) for h in (6, 3, 3))
    out, lse = ring_attention(q, k, v, causal=True, layout="striped", return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, True, 40 ** -0.5)
    torch.testing.assert_close(out, ref_out, **tolerance(torch.float32, ref_out))
    torch.testing.assert_close(lse, ref_lse, **tolerance(torch.float32, ref_lse))


def _subgroup_ring(rank, world):
    """Two CP rings inside a world of 4, [0, 2] and [1, 3]: the P2P peers must be the
    ring neighbours' *global* ranks. Each ring gets its own sequence."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # collective: all ranks
    group, cp_rank = groups[rank % 2], rank // 2
    q, k, v, dout = global_inputs(2 * S_LOCAL, 8, 2, 40, torch.float32)
    q = q + rank % 2  # a different problem per ring: a cross-ring message would show
    ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, group, causal=True, layout="zigzag", backend="math")
    out.backward(shard_sequence(dout, 1, group, "zigzag"))
    return cp_rank, out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.quick
def test_ring_on_subgroups_uses_global_peers():
    n = 2 * S_LOCAL
    for rank, (cp_rank, *got) in enumerate(run_distributed(_subgroup_ring, 4, timeout=60)):
        q, k, v, dout = global_inputs(n, 8, 2, 40, torch.float32)
        qr, kr, vr = ((q + rank % 2).requires_grad_(), k.requires_grad_(), v.requires_grad_())
        out, _ = reference_attention(qr, kr, vr, True, 40 ** -0.5)
        want = (out.detach(), *torch.autograd.grad(out, (qr, kr, vr), dout))
        pos = rank_positions(n, cp_rank, 2, "zigzag")
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b[:, pos], **tolerance(torch.float32, b),
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _ring_allocations(rank, world):
    from ctxpar.context_parallel.allocations import count_allocations
    group = dist.group.WORLD
    q, k, v, dout = global_inputs(2 * world * 8, 8, 2, 16, torch.float32)  # GQA 4:1
    ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
    with count_allocations() as fwd:
        out = ring_attention(ql, kl, vl, group, causal=True, layout="zigzag", backend="sdpa")
    dout = shard_sequence(dout, 1, group, "zigzag")
    with count_allocations() as bwd:
        out.backward(dout)
    # The backward's peak of live bytes, at shapes where the buffers dwarf the small ones.
    from ctxpar.testing.memory import LiveBytes
    q, k, v, dout = global_inputs(2 * world * 256, 8, 2, 16, torch.float32)
    ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, group, causal=True, layout="zigzag", backend="sdpa")
    dout = shard_sequence(dout, 1, group, "zigzag")
    live = LiveBytes()
    with live:
        out.backward(dout)
    return dict(fwd.ops), dict(bwd.ops), live.peak


def test_ring_step_copies_nothing_it_does_not_need():
    """Per ring call: no stack/cat/clone of K,V (the caller's k, v are sent as they are and
    blocks land in two alternating receive pairs), no GQA expansion (the CPU flash kernel
    takes Hkv heads), and in backward one contiguous lse per distinct row range (zigzag:
    the second half), not one per step; the backward's live peak is what the planner
    charges (ctxpar/plan/transients.attention_backward)."""
    from ctxpar.plan import counts, transients
    from ctxpar.plan.candidate import Candidate
    shapes = counts.RankShapes(N=1024, B=2, T=2048, d=128, h=8, hk=2, hd=16, f=1, V=1, L=1,
                               tp=1)
    predicted = transients.attention_backward(shapes, Candidate(1, 4, 1, 1), 4)
    for rank, (fwd, bwd, peak) in enumerate(run_distributed(_ring_allocations, 4,
                                                             timeout=120)):
        # The planner's term within 5% of the live peak: no step's block gradients kept
        # while the next step's are made.
        assert abs(predicted / peak - 1) < 0.05, (rank, predicted, peak)
        for ops in (fwd, bwd):
            for name in ("aten::stack", "aten::cat", "aten::repeat_interleave",
                         "aten::index_select"):
                assert name not in ops, (rank, name, ops)
        assert "aten::clone" not in fwd, (rank, fwd)
        assert bwd.get("aten::clone", 0) <= 1, (rank, bwd)
        assert fwd["aten::empty_like"] == 4 and bwd["aten::empty_like"] == 5, (rank, fwd, bwd)


def _grad_dtypes(rank, world):
    from ctxpar.testing.attention import ring_wire_dtype_runs
    return ring_wire_dtype_runs(*global_inputs(2 * world * 16, 8, 2, 16, torch.float32),
                                dist.group.WORLD)


def test_ring_grad_dtype_bf16_halves_the_gradient_bytes_within_bf16_rounding():
    P = 4
    for rank, res in enumerate(run_distributed(_grad_dtypes, P, timeout=120)):
        (out, dq, dk, dv, sent), (out16, dq16, dk16, dv16, sent16) = res["fp32"], res["bf16"]
        # Forward and dq never touch the travelling accumulator: bit-identical.
        assert torch.equal(out, out16) and torch.equal(dq, dq16), rank
        # dK,dV: each hop rounds the running sum to bf16 once (8 mantissa bits): at most P
        # roundings of 2^-9 relative each; 2e-2 of the largest entry bounds P=4 with margin.
        for a, b in ((dk16, dk), (dv16, dv)):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * b.abs().max().item())
            assert not torch.equal(a, b), "the bf16 wire rounded nothing?"
        kv = 2 * dk.numel() * 4  # one (k, v) block in fp32: what the ring forwards P-1 times
        assert sent == (P - 1) * kv + P * kv, (rank, sent)  # dK,dV in fp32 every hop
        assert sent16 == (P - 1) * kv + P * kv // 2, (rank, sent16)  # ... in bf16


# ------------------------------------------------------------------ pure pieces


def test_block_plan_covers_exactly_the_visible_pairs():
    """For every layout/P/rank: the union over the ring of the blocks (with the kernel's
    top-left causal mask) is exactly the causal mask by global position, no pair twice."""
    for layout, world in itertools.product(LAYOUTS, (1, 2, 3, 4)):
        S = 6
        n = world * S
        for rank in range(world):
            qpos = rank_positions(n, rank, world, layout)
            seen = torch.zeros(S, n, dtype=torch.int64)
            for src in range(world):
                blk = block_plan(layout, True, rank, src, S)
                if blk is None:
                    continue
                kpos = rank_positions(n, src, world, layout)
                L, T = blk.q1 - blk.q0, blk.k1 - blk.k0
                mask = torch.ones(L, T, dtype=torch.int64)
                if blk.causal:
                    assert L == T, (layout, blk)  # causal kernel only on square blocks
                    mask = mask.tril()
                seen[blk.q0:blk.q1].index_add_(1, kpos[blk.k0:blk.k1], mask)
            want = (torch.arange(n)[None, :] <= qpos[:, None]).long()
            torch.testing.assert_close(seen, want, **EXACT,
                                       msg=lambda m: f"{layout} P={world} r={rank}: {m}")


def test_merge_handles_empty_rows_without_nan():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 8, generator=gen)  # (B, L, H, D)
    lse_a, lse_b = torch.randn(1, 2, 4, generator=gen), torch.randn(1, 2, 4, generator=gen)
    out_b = torch.randn(1, 4, 2, 8, generator=gen)
    ninf = torch.full((1, 2, 4), float("-inf"))
    # Empty accumulator + block = block; block with no visible key (-inf) changes nothing;
    # both empty stays (0, -inf), no NaN.
    out, lse = torch.zeros_like(x), ninf.clone()
    merge_block_(out, lse, x, lse_a)
    torch.testing.assert_close((out, lse), (x, lse_a), **EXACT)
    merge_block_(out, lse, out_b, ninf)
    torch.testing.assert_close((out, lse), (x, lse_a), **EXACT)
    out, lse = torch.zeros_like(x), ninf.clone()
    merge_block_(out, lse, torch.zeros_like(x), ninf)
    torch.testing.assert_close((out, lse), (torch.zeros_like(x), ninf), **EXACT)
    # Two real blocks: the softmax-weighted average (ring-flash-attention's update_out_and_lse), fp32 rounding only.
    out, lse = x.clone(), lse_a.clone()
    merge_block_(out, lse, out_b, lse_b)
    wa = torch.exp(lse_a - torch.logaddexp(lse_a, lse_b)).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(out, wa * x + (1 - wa) * out_b, atol=1e-6, rtol=1e-6)


def test_fused_merge_equals_the_eager_merge():
    """The merge CUDA runs (torch.compile of the eager merge, one fused kernel) against the
    eager reference, compiled here for the CPU: rows with no key yet (-inf), fp32 and bf16
    blocks, a strided view of the accumulators (a zigzag half). Fusion reorders fp32 ops
    (sigmoid/lerp in registers), so equal to ~1 ulp: atol 1e-6 on values of order 1."""
    from ctxpar.context_parallel.merge import FusedMerge, merge_block_eager_
    fused = FusedMerge()  # what merge_block_ runs on CUDA, compiled here for the CPU
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(2, 16, 4, 8, generator=gen)
        lse = torch.randn(2, 4, 16, generator=gen)
        lse[:, :, :3] = float("-inf")  # rows that have seen nothing
        out[:, :3] = 0.0
        blk_out = torch.randn(2, 8, 4, 8, generator=gen).to(dtype)
        blk_lse = torch.randn(2, 4, 8, generator=gen)
        blk_lse[:, :, 0] = float("-inf")  # and a row the block leaves empty too
        want_out, want_lse = out.clone(), lse.clone()
        merge_block_eager_(want_out[:, :8], want_lse[:, :, :8], blk_out, blk_lse)
        fused(out[:, :8], lse[:, :, :8], blk_out, blk_lse)
        torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-6)
    assert fused.worked and not fused.disabled  # compiled, not the eager fallback


def _flash_v23(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    out, lse = MathBackend().forward(q, k, v, causal, softmax_scale)
    return out, q, k, v, out, lse, None, None  # <= 2.5 returns 8 values


@pytest.mark.parametrize("fwd", [_flash_v23, flash_attn_forward_v26])
def test_flash_attn_adapter_follows_the_signature(fwd):
    """The flash_attn backend's calling convention, with stand-ins for two flash-attn
    signatures (the real package needs CUDA); head_dim 40 exercises the padding to 48."""
    be = FlashAttnBackend(fwd, flash_attn_backward, device_types=("cpu",))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, h, 40, generator=gen) for h in (4, 2, 2, 4))
    ref = MathBackend()
    out, lse = be.forward(q, k, v, True, 0.2)
    r_out, r_lse = ref.forward(q, k, v, True, 0.2)
    torch.testing.assert_close((out, lse), (r_out, r_lse), **EXACT)  # same code underneath
    grads = be.backward(do, q, k, v, out, lse, True, 0.2)
    torch.testing.assert_close(grads, ref.backward(do, q, k, v, out, lse, True, 0.2),
                               atol=1e-6, rtol=1e-6)  # padded D: fp32 re-association only


def _fa4_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, pack_gqa=None):
    assert return_lse and q.stride(-1) == 1
    out, lse = MathBackend().forward(q, k, v, causal, softmax_scale)
    return out, lse, None, None  # 4.0.0.beta19 on: (out, lse, p, row_max)


def _fa4_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0):
    return MathBackend().backward(dout, q, k, v, out, lse, causal, softmax_scale)


def test_flash_attn4_adapter_follows_its_interface():
    """FlashAttention-4's calling convention (flash_attn.cute.interface: forward returns
    (out, lse, p, row_max) with return_lse since 4.0.0.beta19, backward takes (q, k, v,
    out, dout, lse) and returns the gradients at k's heads), with stand-ins; and the
    shapes it refuses. tests/cuda_dry_cases.py runs it on CUDA tensors."""
    be = FlashAttn4Backend(_fa4_fwd, _fa4_bwd, device_types=("cpu",))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, h, 64, generator=gen).to(torch.bfloat16)
                   for h in (4, 2, 2, 4))
    ref = MathBackend()
    out, lse = be.forward(q, k, v, True, 0.2)
    torch.testing.assert_close((out, lse), ref.forward(q, k, v, True, 0.2), **EXACT)
    grads = be.backward(do, q, k, v, out, lse, True, 0.2)
    torch.testing.assert_close(grads, ref.backward(do, q, k, v, out, lse, True, 0.2), **EXACT)
    assert be.available(q)
    assert be.why_not(q[..., :40]) == "head_dim 40 not in (64, 96, 128)"
    assert be.why_not(q.float()) == "needs fp16/bf16"


def test_auto_says_which_kernel_and_why_once(caplog):
    from ctxpar.context_parallel import kernels
    q = torch.zeros(1, 4, 2, 8)
    backend, reason = kernels.choose_auto(q)
    assert backend.name == "sdpa" and reason.startswith("flash_attn: needs cuda"), reason
    kernels._LOGGED.discard(("cpu", torch.float32))
    with caplog.at_level("INFO", logger="ctxpar"):
        for _ in range(3):
            kernels.get_backend("auto", q)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ctxpar")]
    assert lines == ["attention backend auto -> sdpa for cpu float32 (flash_attn: needs cuda)"]


def test_errors_name_custom_op_kernels():
    """flash-attn >= 2.7 wraps its kernels in torch.library custom ops (no __name__): an
    unknown signature must still fail with the op's qualified name."""
    from ctxpar.context_parallel.kernels import _call_by_signature, qualified_name

    @torch.library.custom_op("ctxpar_test::fake_fwd", mutates_args=())
    def fake_fwd(q: torch.Tensor, mystery: int) -> torch.Tensor:
        return q.clone()

    assert qualified_name(fake_fwd) == "ctxpar_test::fake_fwd"
    with pytest.raises(RuntimeError, match=r"ctxpar_test::fake_fwd requires \['mystery'\]"):
        _call_by_signature(fake_fwd, dict(q=torch.zeros(1)))


def test_sdpa_cuda_path_shapes_on_meta():
    """The CUDA branch of the sdpa backend cannot run here; on the meta device it checks the
    op signatures and our layout handling (padding, lse slice, GQA reduction)."""
    be = SdpaBackend()
    for dtype in (torch.bfloat16, torch.float32):  # flash kernel, efficient kernel
        q = torch.empty(2, 12, 8, 40, dtype=dtype, device="meta")
        k = torch.empty(2, 12, 2, 40, dtype=dtype, device="meta")
        out, lse = be.forward(q, k, k, True, 0.1)
        assert out.shape == q.shape and out.dtype == dtype, (dtype, out.shape)
        assert lse.shape == (2, 8, 12), (dtype, lse.shape)  # may be strided: backward copes
        dq, dk, dv = be.backward(out, q, k, k, out, lse, True, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape), dtype


# ------------------------------------------------------------------ bad inputs


def _bad_inputs(rank, world):
    t = lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype)  # noqa: E731
    good = t(1, 8, 4, 16)
    cases = {
        "3-D q": dict(q=t(8, 4, 16)),
        "batch": dict(k=t(2, 8, 4, 16), v=t(2, 8, 4, 16)),
        "local_seq q vs k": dict(k=t(1, 6, 4, 16), v=t(1, 6, 4, 16)),
        "head_dim": dict(k=t(1, 8, 4, 8), v=t(1, 8, 4, 8)),
        "k vs v": dict(v=t(1, 8, 2, 16)),
        "dtype": dict(k=t(1, 8, 4, 16, dtype=torch.bfloat16)),
        "integer": dict(q=good.long(), k=good.long(), v=good.long()),
        "device": dict(k=torch.empty(1, 8, 4, 16, device="meta")),
        "heads % kv_heads": dict(q=t(1, 8, 6, 16), k=t(1, 8, 4, 16), v=t(1, 8, 4, 16)),
        "layout": dict(layout="diagonal"),
        "backend": dict(backend="cudnn"),
        "zigzag odd local_seq": dict(q=t(1, 7, 4, 16), k=t(1, 7, 4, 16), v=t(1, 7, 4, 16),
                                     layout="zigzag"),
        "comm": dict(comm="p2p"),
        "heads % ulysses": dict(comm="ulysses"),  # 4 heads over 3 ranks
        "allgather dtype": dict(comm="allgather", v=t(1, 8, 4, 16, dtype=torch.bfloat16)),
    }
    msgs = {}
    for name, kw in cases.items():
        args = dict(q=good, k=good, v=good, causal=True, comm="ring")
        args.update(kw)
        try:
            context_parallel_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        except ValueError as e:
            msgs[name] = str(e)
    # Nothing was sent: good calls afterwards still pair up their messages.
    out = ring_attention(good, good, good, causal=True, layout="striped")
    out = context_parallel_attention(out, good, good, comm="allgather", causal=True)
    return msgs, out.shape


def test_bad_inputs_raise_on_every_rank():
    res = run_distributed(_bad_inputs, 3, timeout=60)
    msgs = [m for m, _ in res]
    assert len(msgs[0]) == 15, sorted(msgs[0])  # every case raised ValueError
    assert all(m == msgs[0] for m in msgs), msgs  # the same message on every rank
    assert "heads=6 is not a multiple of kv_heads=4" in msgs[0]["heads % kv_heads"]
    assert "'diagonal'" in msgs[0]["layout"] and "'cudnn'" in msgs[0]["backend"]
    assert "unknown comm 'p2p'" in msgs[0]["comm"]
    assert "heads=4 is not divisible by the Ulysses degree 3" in msgs[0]["heads % ulysses"]
    assert all(shape == (1, 8, 4, 16) for _, shape in res)
