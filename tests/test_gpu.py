"""The CUDA paths (gpu marker: skipped without CUDA, run on a lent GPU).

CI never has a GPU; these are what a session with one runs first:
    .venv/bin/python -m pytest -q -m gpu tests/test_gpu.py
They check the per-block CUDA kernels (torch's flash / memory-efficient ops with LSE, and
Dao's flash-attn when installed) against the fp32 math backend, including the non-square
and causal-diagonal blocks the ring uses; every CP pattern's schedule on 4 simulated
ranks on CUDA against the same schedule on the CPU (merges, accumulators, layouts); the
fused LSE merge over many shapes; sliding windows (flash-attn's window calls, sdpa's masked
tiles on the memory-efficient op); and the GPT on CUDA in bf16. tests/test_cuda_dry.py
runs the same code paths on fake CUDA tensors in CI; tools/gpu_check.py runs this file.
"""
import pytest
import torch

from ctxpar.context_parallel.kernels import (FlashAttn4Backend, FlashAttnBackend, MathBackend,
                                             SdpaBackend)
from ctxpar import ring_attention
from ctxpar.testing.attention import reference_attention, tolerance
from models.options import ModelOptions

pytestmark = pytest.mark.gpu

CASES = [  # (L query rows, S key rows, causal): square diagonal, non-square (zigzag) blocks
    (128, 128, True), (128, 128, False), (64, 128, False), (128, 64, False)]
# GQA with head_dim 64; MQA with 100 and MHA with 60 (padded to 104 and 64 inside)
HEADS = [(8, 2, 64), (8, 1, 100), (4, 4, 60)]


def _inputs(L, S, H, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, L, H, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, S, Hkv, D, device="cuda", generator=g).to(dtype) for _ in "kv")
    return q, k, v, torch.randn(2, L, H, D, device="cuda", generator=g).to(dtype)


def _check_backend(backend, heads=HEADS) -> int:
    """Every case the backend can run against the math backend; returns how many ran (a
    test whose backend ran nothing must fail or skip, never pass)."""
    ref = MathBackend()
    scale = 0.125
    ran = 0
    for (L, S, causal), (H, Hkv, D), dtype in (
            (c, h, d) for c in CASES for h in heads for d in (torch.bfloat16, torch.float32)):
        if causal and L != S:
            continue  # the ring only uses the kernels' causal path on square blocks
        if not backend.available(torch.empty(1, 1, H, D, device="cuda", dtype=dtype)):
            continue
        ran += 1
        q, k, v, dout = _inputs(L, S, H, Hkv, D, dtype)
        out, lse = backend.forward(q, k, v, causal, scale)
        want_out, want_lse = ref.forward(q.float(), k.float(), v.float(), causal, scale)
        grads = backend.backward(dout, q, k, v, out, lse, causal, scale)
        want = ref.backward(dout.float(), q.float(), k.float(), v.float(), want_out,
                            want_lse, causal, scale)
        where = f"{backend.name} L={L} S={S} causal={causal} H={H}/{Hkv} D={D} {dtype}"
        assert out.shape == q.shape and lse.shape == (2, H, L), where
        assert lse.dtype == torch.float32, where  # the merge reads it strided or not
        # tolerance(): fp32 1e-5 (no TF32 in these kernels); bf16 2e-2 rel + 1% of max.
        torch.testing.assert_close(out.float(), want_out, **tolerance(dtype, want_out), msg=where)
        torch.testing.assert_close(lse, want_lse, **tolerance(dtype, want_lse), msg=where)
        for got, exp, name in zip(grads, want, ("dq", "dk", "dv")):
            assert got.shape == exp.shape, (where, name)
            torch.testing.assert_close(got.float(), exp, **tolerance(dtype, exp),
                                       msg=f"{where} {name}")
    return ran


def test_sdpa_cuda_blocks_match_math():
    assert _check_backend(SdpaBackend()) == 24  # 4 block shapes x 3 head configs x 2 dtypes


def _skip_unless_usable(backend):
    why = backend.why_not(torch.empty(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16))
    if why:  # e.g. a FlashAttention-4-only install: `import flash_attn` works, 2.x is absent
        pytest.skip(f"{backend.name}: {why}")


def test_flash_attn_blocks_match_math():
    backend = FlashAttnBackend()
    _skip_unless_usable(backend)
    assert _check_backend(backend) == 12  # bf16 only: 4 block shapes x 3 head configs


def test_flash_attn4_blocks_match_math():
    backend = FlashAttn4Backend()
    _skip_unless_usable(backend)
    # head_dim 64 and 128 only (its kernels' sizes): GQA 8/2 and MQA 8/1.
    assert _check_backend(backend, heads=[(8, 2, 64), (8, 1, 128)]) == 8


# (L, S, window): flash-attn window calls as the band plan makes them (bands.py): the
# causal window on a square block, its band against earlier keys, one with both sides set
WINDOW_CASES = [(128, 128, (36, 0)), (64, 128, (37, 0)), (96, 128, (20, 5)),
                (128, 128, (-1, 0))]


def _check_masked_blocks(backend, window_kw: bool, heads=HEADS) -> int:
    """Each WINDOW_CASES block against the math kernel with the same visible pairs: as
    `window=` (flash-attn, FlashAttention-4) or as the band's explicit `mask=` (sdpa: its
    memory-efficient op's attn_bias on CUDA); returns how many ran."""
    from ctxpar.context_parallel.bands import band_mask
    ref, scale, ran = MathBackend(), 0.125, 0
    for (L, S, window), (H, Hkv, D), dtype in ((c, h, d) for c in WINDOW_CASES for h in heads
                                               for d in (torch.bfloat16, torch.float32)):
        if not backend.available(torch.empty(1, 1, H, D, device="cuda", dtype=dtype)):
            continue
        ran += 1
        q, k, v, dout = _inputs(L, S, H, Hkv, D, dtype, seed=ran)
        kw = ({"window": window} if window_kw
              else {"mask": band_mask(L, S, window, device="cuda")})
        out, lse = backend.forward(q, k, v, False, scale, **kw)
        grads = backend.backward(dout, q, k, v, out, lse, False, scale, **kw)
        fq, fk, fv = q.float(), k.float(), v.float()
        want_out, want_lse = ref.forward(fq, fk, fv, False, scale, window=window)
        want = ref.backward(dout.float(), fq, fk, fv, want_out, want_lse, False, scale,
                            window=window)
        where = f"{backend.name} L={L} S={S} window={window} H={H}/{Hkv} D={D} {dtype}"
        torch.testing.assert_close(out.float(), want_out, **tolerance(dtype, want_out), msg=where)
        torch.testing.assert_close(lse, want_lse, **tolerance(dtype, want_lse), msg=where)
        for got, exp, name in zip(grads, want, ("dq", "dk", "dv")):
            torch.testing.assert_close(got.float(), exp, **tolerance(dtype, exp),
                                       msg=f"{where} {name}")
    return ran


def test_sdpa_cuda_masked_blocks_match_math():
    """A window's tile on CUDA: the memory-efficient op with the mask as attn_bias."""
    assert _check_masked_blocks(SdpaBackend(), window_kw=False) == 24


def test_flash_attn_window_blocks_match_math():
    backend = FlashAttnBackend()
    _skip_unless_usable(backend)
    assert _check_masked_blocks(backend, window_kw=True) == 12  # bf16 only


def test_flash_attn4_window_blocks_match_math():
    backend = FlashAttn4Backend()
    _skip_unless_usable(backend)
    assert _check_masked_blocks(backend, True, heads=[(8, 2, 64), (8, 1, 128)]) == 8


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_sliding_window_on_cuda_matches_the_dense_reference(backend, monkeypatch):
    """A window of 37 inside documents on one process (the whole sequence's plan, as
    Ulysses makes it), bf16, GQA: sdpa's masked tiles, flash-attn's window calls (the real
    kernels when usable, else its adapter over stand-ins on CUDA), against the fp32 dense
    mask on the CPU."""
    from ctxpar.context_parallel import AttentionMask, kernels
    from ctxpar.context_parallel.mask import dense_mask
    from ctxpar.testing.attention import FlashOnCpu
    if backend == "flash_attn" and not FlashAttnBackend().available(
            torch.empty(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)):
        monkeypatch.setitem(kernels.BACKENDS, "flash_attn", FlashOnCpu(("cuda",)))
    n, cu = 256, torch.tensor([0, 1, 40, 200, 256], dtype=torch.int32)
    q, k, v, dout = _inputs(n, n, 8, 2, 64, torch.bfloat16, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, backend=backend, return_lse=True, mask=AttentionMask(
        causal=True, sliding_window=37, cu_seqlens=cu))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = [x.detach().float().cpu().requires_grad_() for x in (q, k, v)]
    kr, vr = (x.repeat_interleave(4, dim=2) for x in ref[1:])  # GQA 8/2
    s = torch.einsum("blhd,bshd->bhls", ref[0], kr) * 64 ** -0.5
    s = s.masked_fill(~dense_mask(n, True, 37, cu), float("-inf"))  # each row sees itself
    want_out, want_lse = torch.einsum("bhls,bshd->blhd", s.softmax(-1), vr), s.logsumexp(-1)
    want = torch.autograd.grad(want_out, ref, dout.float().cpu())
    torch.testing.assert_close(out.float().cpu(), want_out.detach(),
                               **tolerance(torch.bfloat16, want_out))
    torch.testing.assert_close(lse.cpu(), want_lse, **tolerance(torch.bfloat16, want_lse))
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.float().cpu(), exp, **tolerance(torch.bfloat16, exp))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_ring_attention_one_rank_on_cuda_bf16(layout):
    # P = 1 against the true reference: the API, autograd Function and one kernel call
    # (no merge; the simulated-ranks test below runs the merges and accumulators).
    q, k, v, dout = _inputs(256, 256, 8, 2, 64, torch.bfloat16, seed=1)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, causal=True, layout=layout, return_lse=True)
    out.backward(dout)
    want_out, want_lse = reference_attention(q.detach().cpu(), k.detach().cpu(),
                                             v.detach().cpu(), True, 64 ** -0.5)
    torch.testing.assert_close(out.float().cpu(), want_out,
                               **tolerance(torch.bfloat16, want_out))
    torch.testing.assert_close(lse.cpu(), want_lse, **tolerance(torch.bfloat16, want_lse))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def _simulated_rank(comm, layout, rank, world, x, backend):
    """(out, lse, dq, dk, dv) of one rank of a simulated `world`-rank group (comm.NoComm:
    the rank's own K,V stand in for every other rank's, the schedule is the real one)."""
    from ctxpar.context_parallel import NoComm, context_parallel_attention
    u = {"ring": 1, "allgather": 1, "ulysses": world, "hybrid": 2}[comm]
    groups = dict(ulysses_group=NoComm(rank % u, u), ring_group=NoComm(rank // u, world // u)) \
        if comm == "hybrid" else dict(cp_group=NoComm(rank, world))
    q, k, v, dout = x
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention(q, k, v, comm=comm, causal=True, layout=layout,
                                          backend=backend, return_lse=True, **groups)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("comm", ["ring", "allgather", "ulysses", "hybrid"])
def test_every_pattern_on_simulated_ranks_matches_the_cpu(comm, layout):
    """Each rank of a 4-rank group, simulated on this one GPU (bf16, the CUDA kernels, the
    fused merge, fp32 accumulators, the layout's non-square and offset blocks), against
    the same schedule on the CPU in fp32 (its sdpa kernel). One GPU cannot hold the ranks'
    real exchange (NCCL refuses two ranks on one device); what differs from it is only
    whose K,V a block sees, which the CPU tests check on gloo."""
    world = 4
    for rank in range(world):
        x = _inputs(128, 128, 8, 2, 64, torch.bfloat16, seed=10 + rank)
        got = _simulated_rank(comm, layout, rank, world, x, "auto")
        want = _simulated_rank(comm, layout, rank, world,
                               [t.float().cpu() for t in x], "sdpa")
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert a.is_cuda and a.shape == b.shape, (comm, layout, rank, name)
            torch.testing.assert_close(a.float().cpu(), b, **tolerance(torch.bfloat16, b),
                                       msg=lambda m: f"{comm} {layout} rank {rank} {name}: {m}")


def test_fused_merge_over_many_shapes_stays_fused():
    """The merge CUDA compiles, over 16 shapes and dtypes in one process (more than dynamo's
    default recompile limit, 8): every result equals the eager merge, and the fused merge
    neither turned itself off nor failed (with fullgraph=True it stopped after ~8 and
    stayed eager for the rest of the process)."""
    from ctxpar.context_parallel.merge import FusedMerge, merge_block_eager_
    fused, gen = FusedMerge(), torch.Generator(device="cuda").manual_seed(0)
    for B, L, H, dtype in [(b, l, 8, d) for b in (1, 2) for l in (1, 64, 200, 333)
                           for d in (torch.bfloat16, torch.float32)]:
        out = torch.randn(B, 2 * L, H, 64, device="cuda", generator=gen)
        lse = torch.randn(B, H, 2 * L, device="cuda", generator=gen)
        blk = torch.randn(B, L, H, 64, device="cuda", generator=gen).to(dtype)
        blk_lse = torch.randn(B, H, L, device="cuda", generator=gen)
        want_out, want_lse = out.clone(), lse.clone()
        merge_block_eager_(want_out[:, L:], want_lse[:, :, L:], blk, blk_lse)
        fused(out[:, L:], lse[:, :, L:], blk, blk_lse)
        # one fused kernel reorders the fp32 ops: ~1 ulp on values of order 1
        torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-5)
    assert fused.worked and not fused.disabled and fused.failures == 0


@pytest.mark.parametrize("backend", ["sdpa", "flash_attn"])
def test_document_masking_on_cuda_matches_the_dense_reference(backend, monkeypatch):
    """Packed documents on CUDA (P = 1, the full block path): every document block one of
    the backend's dense or causal calls, against the fp32 dense-mask reference (bf16: the
    kernels' tolerance). Documents of length 1, one longer than half the sample, many.
    flash_attn: the real kernels when flash-attn 2 is usable, else its adapter over
    stand-ins on CUDA (ctxpar.testing.attention.FlashOnCpu), so this never skips: ctxpar's CUDA
    document path through a backend without masks runs either way."""
    from ctxpar.context_parallel import kernels
    from ctxpar.testing.attention import FlashOnCpu, masked_reference
    if backend == "flash_attn" and not FlashAttnBackend().available(
            torch.empty(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)):
        monkeypatch.setitem(kernels.BACKENDS, "flash_attn", FlashOnCpu(("cuda",)))
    n = 256
    cus = [torch.tensor([0, 1, 2, 40, 41, 200, 256], dtype=torch.int32),
           torch.tensor([0, 128, 129, 256], dtype=torch.int32)]
    q, k, v, dout = _inputs(n, n, 8, 2, 64, torch.bfloat16, seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, causal=True, backend=backend, return_lse=True,
                              cu_seqlens=cus)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = [x.detach().float().cpu().requires_grad_() for x in (q, k, v)]
    want_out, want_lse = masked_reference(*ref, cus, True, 64 ** -0.5)
    want = torch.autograd.grad(want_out, ref, dout.float().cpu())
    torch.testing.assert_close(out.float().cpu(), want_out.detach(),
                               **tolerance(torch.bfloat16, want_out))
    torch.testing.assert_close(lse.cpu(), want_lse, **tolerance(torch.bfloat16, want_lse))
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.float().cpu(), exp, **tolerance(torch.bfloat16, exp))


def test_gpt_bf16_cuda_matches_fp32_cpu():
    from ctxpar.config import ModelConfig
    from models.gpt import GPT

    cfg = ModelConfig(vocab_size=256, seq_len=128, n_layers=2, d_model=128, n_heads=4,
                      n_kv_heads=2)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    labels, pos = tokens.roll(-1, 1), torch.arange(128)
    cpu = GPT(cfg, options=ModelOptions(seed=3))
    gpu = GPT(cfg, options=ModelOptions(seed=3), device="cuda", dtype=torch.bfloat16)
    want = cpu(tokens, pos, labels) / labels.numel()
    got = gpu(tokens.cuda(), pos.cuda(), labels.cuda()) / labels.numel()
    got.backward()
    # bf16 weights and activations through 2 blocks: ~1% on a loss of ~5.5.
    torch.testing.assert_close(got.float().cpu(), want.detach(), rtol=2e-2, atol=0)
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
