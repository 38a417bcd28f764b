"""The CUDA path on fake CUDA tensors (run by tests/test_cuda_dry.py in a fake-CUDA process).

Every case runs ctxpar's own code on device "cuda" under tests/cuda_dry.py's fake_cuda:
the real CUDA kernels' input rules are enforced (ContractError), a read of device data
on the host fails (HostSync), a CPU tensor in a CUDA op fails (DeviceMix); each case then
checks shapes, dtypes, which kernel ran with which causal flag and scale. Nothing is
computed, so the shapes are small and the cases many: each kernel's forward and backward
(sdpa's flash op for bf16/fp16, its memory-efficient op for fp32, flash-attn 2.5, 2.6 and
2.7+ and FlashAttention-4 through stand-ins with the real signatures), every CP pattern on
one rank and on 4 simulated ranks (comm.NoComm) in every layout, documents, windows, chunks
and sinks, head dims that need padding (60, 100), GQA and MQA, MLA's latent_attention (q, k
and v at different head dims) through every pattern, the GPT in bf16 under each
checkpointing mode, and the pipeline's blocks with documents.
"""
import dataclasses
import math
import os

import pytest
import torch

import cuda_dry as dry

# Not collected by `make test` (no test_ prefix): tests/test_cuda_dry.py checks the private
# APIs and runs this file in the fake-CUDA process. Run any other way, it fails loudly.
if dry.private_api_problem():
    raise RuntimeError(dry.private_api_problem())
if not os.environ.get("CTXPAR_FAKE_CUDA_LIBRARY"):
    raise RuntimeError("tests/cuda_dry_cases.py runs in the fake-CUDA process: "
                       "python tests/fake_cuda.py [-k EXPR], or tests/test_cuda_dry.py")

from ctxpar.context_parallel import (LAYOUTS, LOCAL, NoComm,  # noqa: E402
                                     context_parallel_attention, kernels, rank_positions)
from ctxpar.context_parallel.blocks import step_plan  # noqa: E402
from ctxpar.context_parallel.kernels import (FlashAttn4Backend, FlashAttnBackend,  # noqa: E402
                                             MathBackend, SdpaBackend, default_scale)
from models.options import ModelOptions

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SDPA_FLASH = ("aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_flash_attention_backward")
SDPA_MEFF = ("aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_efficient_attention_backward")
FA2 = ("ctxpar_dry::fa2_fwd", "ctxpar_dry::fa2_bwd")
FA27 = ("ctxpar_dry::_flash_attn_forward", "ctxpar_dry::_flash_attn_backward")
FA4 = ("ctxpar_dry::fa4_fwd", "ctxpar_dry::fa4_bwd")

# backend name -> (what ctxpar is given, dtype, the kernel ops it must reach, head dims)
BACKENDS = {
    "sdpa bf16": ("sdpa", BF16, SDPA_FLASH, (64, 60, 100)),
    "sdpa fp16": ("sdpa", FP16, SDPA_FLASH, (64, 60, 100)),
    "sdpa fp32": ("sdpa", FP32, SDPA_MEFF, (64, 60, 100)),
    "flash_attn 2.5": ("flash_attn", BF16, FA2, (64, 60, 100)),
    "flash_attn 2.6": ("flash_attn", BF16, FA2, (64, 60, 100)),
    "flash_attn 2.7+": ("flash_attn", BF16, FA27, (64, 60, 100)),
    "flash_attn4 beta19+": ("flash_attn4", BF16, FA4, (64, 96, 128)),
}
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def backend_object(label):
    """The ctxpar backend for a label: sdpa itself, or flash-attn's adapters over the
    stand-ins (tests/cuda_dry.py STANDINS) on CUDA."""
    if label.startswith("sdpa"):
        return SdpaBackend()
    fwd, bwd = dry.STANDINS[label]
    cls = FlashAttn4Backend if label.startswith("flash_attn4") else FlashAttnBackend
    return cls(fwd, bwd, device_types=("cuda",))


def use_backend(monkeypatch, label):
    """Make `label` what ctxpar's BACKENDS gives for its name; returns that name."""
    name = BACKENDS[label][0]
    if name != "sdpa":
        monkeypatch.setitem(kernels.BACKENDS, name, backend_object(label))
    return name


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def padded(d):
    return -(-d // 8) * 8


def check_grads(inputs, grads, dtype=None):
    """Each gradient has its input's shape, sits on CUDA, and is in `dtype` (default: its
    input's; a kernel may return fp32, which the patterns accumulate anyway)."""
    for x, g in zip(inputs, grads):
        want = (x.dtype,) if dtype is None else dtype
        assert g is not None and g.shape == x.shape and g.dtype in want, (
            tuple(x.shape), x.dtype, None if g is None else (tuple(g.shape), g.dtype))
        assert g.device.type == "cuda"


def check_clean(mode):
    """Nothing read back from the device, no CPU-only kernel reached."""
    assert mode.host_syncs == 0
    assert not [op for op in mode.ops if "_for_cpu" in op]


# ------------------------------------------------------------------ each kernel, each block


BLOCKS = [(16, 16, True), (16, 16, False), (8, 16, False), (16, 8, False)]  # (L, S, causal)


@pytest.mark.parametrize("label", list(BACKENDS))
def test_kernel_forward_backward(label, monkeypatch):
    """Every block shape the ring uses (square causal diagonal, square, zigzag's halves),
    MHA/GQA/MQA and head dims that need no padding and that do, forward then backward from
    the merged out/lse as the ring calls it: the kernel op each dtype reaches, the layout
    it gets (heads padded to 8s), its scale and causal flag, and what comes back."""
    _, dtype, (fwd_op, bwd_op), dims = BACKENDS[label]
    with dry.fake_cuda(monkeypatch) as mode:
        be = backend_object(label)
        for D in dims:
            for H, Hkv in HEADS:
                for L, S, causal in BLOCKS:
                    q, k, v = rand(2, L, H, D, dtype=dtype), *(rand(2, S, Hkv, D, dtype=dtype)
                                                               for _ in "kv")
                    start, scale = len(mode.kernels), default_scale(D) * 1.5
                    assert be.available(q), be.why_not(q)
                    out, lse = be.forward(q, k, v, causal, scale)
                    assert out.shape == q.shape and out.dtype == dtype
                    assert lse.shape == (2, H, L) and lse.dtype == FP32
                    grads = be.backward(rand(2, L, H, D, dtype=dtype), q, k, v, out,
                                        lse, causal, scale)
                    check_grads((q, k, v), grads, (dtype, FP32))
                    calls = mode.kernels[start:]
                    assert [c.op for c in calls] == [fwd_op, bwd_op], calls
                    assert all(c.scale == scale and c.causal == causal for c in calls), calls
                    dp = D if label.startswith("flash_attn4") else padded(D)
                    want = (2, H, L, dp) if label.startswith("sdpa") else (2, L, H, dp)
                    assert calls[0].q_shape == want, (calls[0].q_shape, want)
        check_clean(mode)


def test_sdpa_fp32_backward_gets_the_lse_padded_to_32_rows(monkeypatch):
    """The memory-efficient kernel's LSE is (B, H, ceil(L/32)*32); its backward reads it with
    8-aligned strides. L = 40 (not a multiple of 32 or 8): SdpaBackend pads what it
    kept (the merged, unpadded LSE) before the backward (ContractMode checks)."""
    with dry.fake_cuda(monkeypatch) as mode:
        q = rand(1, 40, 2, 64, dtype=FP32)
        out, lse = SdpaBackend().forward(q, q, q, False, 0.1)
        assert lse.shape == (1, 2, 40)
        SdpaBackend().backward(q, q, q, q, out, lse.contiguous(), False, 0.1)
        assert [c.op for c in mode.kernels] == list(SDPA_MEFF)


# ------------------------------------------------------------------ every CP pattern

PATTERNS = {"ring": 1, "allgather": 1, "ulysses": 4, "hybrid": 2}  # comm -> Ulysses degree
P, S_LOCAL = 4, 8  # simulated ranks, tokens per rank


def _groups(comm, rank, world):
    u = min(PATTERNS[comm], world)
    if comm == "hybrid":
        return dict(ulysses_group=NoComm(rank % u, u), ring_group=NoComm(rank // u, world // u))
    return dict(cp_group=NoComm(rank, world) if world > 1 else LOCAL)


def _planned_blocks(comm, layout, causal, rank, world):
    """The causal flag of every kernel call this rank's forward makes (blocks.step_plan):
    one per visible block for the ring and all-gather; one over the gathered sequence for
    Ulysses; the ring's plan over the Ulysses-gathered shards for hybrid."""
    u = min(PATTERNS[comm], world)
    if comm == "ulysses" or world == 1:
        return [causal]
    r, ranks, S = (rank // u, world // u, S_LOCAL * u) if comm == "hybrid" else (
        rank, world, S_LOCAL)
    return sorted(blk.causal for src in range(ranks)
                  for _, blk in step_plan(layout, causal, r, src, S, ranks))


def _run_pattern(mode, comm, layout, causal, world, rank, backend, dtype, heads, D,
                 cu_seqlens=None, batch=2):
    H, Hkv = heads
    q, k, v = (rand(batch, S_LOCAL, h, D, dtype=dtype).requires_grad_()
               for h in (H, Hkv, Hkv))
    start = len(mode.kernels)
    out, lse = context_parallel_attention(q, k, v, comm=comm, causal=causal, layout=layout,
                                          backend=backend, return_lse=True,
                                          cu_seqlens=cu_seqlens, **_groups(comm, rank, world))
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == "cuda"
    assert lse.shape == (batch, H, S_LOCAL) and lse.dtype == FP32
    grads = torch.autograd.grad(out, (q, k, v), rand(*out.shape, dtype=dtype))
    check_grads((q, k, v), grads)
    return mode.kernels[start:]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("comm", list(PATTERNS))
def test_pattern_one_rank_and_simulated_ranks(comm, layout, causal, monkeypatch):
    """The pattern alone (P = 1, one kernel call) and every rank of a simulated 4-rank
    group (NoComm: the rank's own K,V stand in for the others', the same schedule), bf16,
    GQA with head_dim 60 (padded to 64): the calls the block plan asks for, forward and
    backward, on the flash kernel, at the default scale."""
    with dry.fake_cuda(monkeypatch) as mode:
        for world in (1, P):
            for rank in range(world):
                calls = _run_pattern(mode, comm, layout, causal, world, rank, "sdpa", BF16,
                                     (4, 2), 60)
                fwd = sorted(c.causal for c in calls if c.op == SDPA_FLASH[0])
                bwd = sorted(c.causal for c in calls if c.op == SDPA_FLASH[1])
                want = _planned_blocks(comm, layout, causal, rank, world)
                assert fwd == want and bwd == want, (world, rank, fwd, bwd, want)
                assert {c.op for c in calls} <= set(SDPA_FLASH)
                assert all(c.scale == default_scale(60) for c in calls)
        check_clean(mode)


@pytest.mark.parametrize("label", [b for b in BACKENDS if b != "sdpa bf16"])
def test_ring_on_every_backend(label, monkeypatch):
    """The zigzag ring on 4 simulated ranks through each other backend (fp16, fp32's
    memory-efficient kernel with K,V expanded, flash-attn's adapters, FlashAttention-4),
    MQA: only that backend's kernels run."""
    name, dtype, ops, dims = BACKENDS[label]
    with dry.fake_cuda(monkeypatch) as mode:
        backend = use_backend(monkeypatch, label)
        for rank in range(P):
            calls = _run_pattern(mode, "ring", "zigzag", True, P, rank, backend, dtype,
                                 (4, 1), dims[-1])
            assert {c.op for c in calls} == set(ops), calls
            assert sorted(c.causal for c in calls if c.op == ops[0]) == _planned_blocks(
                "ring", "zigzag", True, rank, P)
        check_clean(mode)


# ------------------------------------------------------------------ documents


def _docs(n, samples=2):
    """Per-sample boundaries (host int32, as the loader gives them): documents of length 1
    at both ends, documents across ranks; the second sample's differ."""
    return [torch.tensor([0, 1, n // 2 + 1, n - 1, n], dtype=torch.int32),
            torch.tensor([0, n // 2 + 1, n], dtype=torch.int32)][:samples]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("comm", list(PATTERNS))
def test_documents(comm, layout, monkeypatch):
    """Packed documents (cu_seqlens on the host, as the loader gives them) on one rank and
    4 simulated ranks: the plan runs on the host, every document block is one of the
    kernel's dense or causal calls, nothing is read back from the device."""
    with dry.fake_cuda(monkeypatch) as mode:
        for world in (1, P):
            for rank in range(world):
                calls = _run_pattern(mode, comm, layout, True, world, rank, "sdpa", BF16,
                                     (4, 2), 60, cu_seqlens=_docs(S_LOCAL * world, 1),
                                     batch=1)
                assert {c.op for c in calls} <= set(SDPA_FLASH)
        check_clean(mode)


@pytest.mark.parametrize("comm,layout", [("ring", "contiguous"), ("allgather", "zigzag"),
                                         ("ulysses", "striped"), ("hybrid", "contiguous")])
def test_windows_chunks_and_sinks(comm, layout, monkeypatch):
    """AttentionMask's window (5: shorter than a rank's 8 tokens, the contiguous ring's and
    hybrid's halo), chunks of 6 (crossing shard edges) and per-head sinks on CUDA, one rank
    and 4 simulated ones, each comm in one layout (the plan is the host's, tested on CPU for
    all): the sinks' term and its gradient on the device, nothing read back; the sinks'
    gradient is (heads,) on CUDA."""
    from ctxpar.context_parallel import AttentionMask
    with dry.fake_cuda(monkeypatch) as mode:
        for world in (1, P):
            for rank in range(world):
                sinks = rand(4, dtype=FP32).requires_grad_()
                q, k, v = (rand(1, S_LOCAL, h, 64).requires_grad_() for h in (4, 2, 2))
                mask = AttentionMask(causal=True, sliding_window=5, chunk_size=6, sinks=sinks)
                out = context_parallel_attention(q, k, v, comm=comm, layout=layout,
                                                 backend="sdpa", mask=mask,
                                                 **_groups(comm, rank, world))
                assert out.shape == q.shape and out.dtype == BF16
                grads = torch.autograd.grad(out, (q, k, v, sinks), rand(*out.shape))
                check_grads((q, k, v, sinks), grads)
        check_clean(mode)


@pytest.mark.parametrize("label", ["sdpa bf16", "flash_attn 2.7+", "sdpa fp32"])
def test_masked_document_block_on_cuda(label, monkeypatch):
    """A document block no dense or causal call covers (scattered shards make them) gets
    an explicit mask, made on the host by the plan, which must reach the kernel on the
    device: sdpa's memory-efficient op as its attn_bias (fp32 and bf16), flash-attn's
    blocks the math kernel (it takes no mask)."""
    from ctxpar.context_parallel.blocks import QueryRows, backward_block, forward_block_
    from ctxpar.context_parallel.documents import doc_plan
    from ctxpar.context_parallel.merge import empty_accumulators
    n, dtype = 24, BACKENDS[label][1]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    shards = [perm[i::3].sort().values for i in range(3)]
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int64)
    plan = [(kp, blk) for kp in shards for blk in doc_plan(cu, shards[0], kp, True)]
    assert any(blk.mask is not None for _, blk in plan)  # the case this test is about
    with dry.fake_cuda(monkeypatch) as mode:
        kernel = backend_object(label)
        q, k, v = rand(1, 8, 4, 16, dtype=dtype), rand(1, 8, 2, 16, dtype=dtype), \
            rand(1, 8, 2, 16, dtype=dtype)
        out, lse = empty_accumulators(q)
        for _, blk in plan:
            forward_block_(kernel, q, k, v, blk, 0.25, out, lse)
        rows = QueryRows(rand(1, 8, 4, 16, dtype=dtype), q, out.to(dtype), lse)
        for _, blk in plan:
            qs, ks, grads = backward_block(kernel, rows, k, v, blk, 0.25)
            assert grads[0].device.type == "cuda"
        masked = sum(blk.mask is not None for _, blk in plan)
        if label.startswith("sdpa"):
            biased = [c for c in mode.kernels if c.masked]
            assert sorted(c.op for c in biased) == sorted(SDPA_MEFF * masked), biased
        else:
            assert mode.ops["aten::masked_fill"] > 0  # the math kernel's mask, on the device
            assert not any(c.masked for c in mode.kernels)
        check_clean(mode)


# ------------------------------------------------------------------ windows on each kernel

WINDOW_LABELS = ["flash_attn 2.5", "flash_attn 2.6", "flash_attn 2.7+", "flash_attn4 beta19+"]


def _refuse_math(monkeypatch):
    """The math kernel fails the case if any block reaches it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a block fell back to the math kernel")
    monkeypatch.setattr(MathBackend, "forward", refuse)
    monkeypatch.setattr(MathBackend, "backward", refuse)


def _query_positions(comm, layout, rank, world, n):
    """The global positions whose rows this rank's kernels compute: its own (ring,
    all-gather), its Ulysses group's (hybrid's ring ranks), every one (Ulysses)."""
    u = min(PATTERNS[comm], world)
    group = range(rank // u * u, rank // u * u + u)
    return torch.cat([rank_positions(n, r, world, layout, ulysses=u) for r in group])


@pytest.mark.parametrize("comm,layout,label", [
    (comm, layout, WINDOW_LABELS[(3 * ci + li) % len(WINDOW_LABELS)])
    for ci, comm in enumerate(PATTERNS) for li, layout in enumerate(LAYOUTS)])
def test_windows_reach_flash_attn_as_window_size(comm, layout, label, monkeypatch):
    """A sliding window on flash-attn 2 (each version's signature) and FlashAttention-4:
    one rank and 4 simulated ones, windows of 5 (the halo under contiguous and zigzag) and
    11 (longer than a rank's 8 tokens), every comm and layout, each on one of the four
    kernels in turn (each kernel meets three comms and every layout). No block falls back
    to the math kernel; the (query, key) pairs the kernels compute for the windows they
    get, read as the real kernels read them (cuda_dry.kernel_pairs), are exactly the
    mask's visible pairs of the rank's rows; each backward call repeats its forward's
    window."""
    from ctxpar.context_parallel import AttentionMask
    from ctxpar.context_parallel.mask import dense_mask
    _, dtype, ops, _ = BACKENDS[label]
    windowed = 0
    with dry.fake_cuda(monkeypatch) as mode:
        backend = use_backend(monkeypatch, label)
        _refuse_math(monkeypatch)
        for w in (5, 11):
            for world in (1, P):
                n = S_LOCAL * world
                for rank in range(world):
                    start = len(mode.kernels)
                    q, k, v = (rand(1, S_LOCAL, h, 64, dtype=dtype).requires_grad_()
                               for h in (4, 2, 2))
                    out = context_parallel_attention(
                        q, k, v, comm=comm, layout=layout, backend=backend,
                        mask=AttentionMask(causal=True, sliding_window=w),
                        **_groups(comm, rank, world))
                    check_grads((q, k, v), torch.autograd.grad(out, (q, k, v),
                                                               rand(*out.shape, dtype=dtype)))
                    calls = mode.kernels[start:]
                    fwd = sorted((c.causal, c.window, c.pairs) for c in calls if c.op == ops[0])
                    bwd = sorted((c.causal, c.window, c.pairs) for c in calls if c.op == ops[1])
                    assert {c.op for c in calls} <= set(ops) and fwd == bwd, (fwd, bwd)
                    rows = _query_positions(comm, layout, rank, world, n)
                    want = int(dense_mask(n, True, w)[rows].sum())
                    assert sum(p for _, _, p in fwd) == want, (w, world, rank, fwd, want)
                    windowed += sum(win != (-1, -1) for _, win, _ in fwd)
        assert windowed > 0
        check_clean(mode)


@pytest.mark.parametrize("comm", ["ring", "ulysses"])
@pytest.mark.parametrize("label", ["sdpa bf16", "sdpa fp32"])
def test_windows_on_sdpa_are_tiles_on_the_memory_efficient_op(label, comm, monkeypatch):
    """sdpa on CUDA has no window argument: a window's blocks come as tiles of 32 query
    rows, each with its (rows, <= rows + window - 1) mask as the memory-efficient op's
    attn_bias (never an (n, n) one: Ulysses' 256 gathered tokens included), unmasked
    pieces on the flash op in bf16; nothing reaches the math kernel."""
    from ctxpar.context_parallel import AttentionMask
    _, dtype, _, _ = BACKENDS[label]
    w, S = 5, 64
    with dry.fake_cuda(monkeypatch) as mode:
        _refuse_math(monkeypatch)
        for rank in range(P):
            q, k, v = (rand(1, S, h, 64, dtype=dtype).requires_grad_() for h in (4, 2, 2))
            out = context_parallel_attention(
                q, k, v, comm=comm, layout="contiguous", backend="sdpa",
                mask=AttentionMask(causal=True, sliding_window=w), **_groups(comm, rank, P))
            torch.autograd.grad(out, (q, k, v), rand(*out.shape, dtype=dtype))
        biased = [c for c in mode.kernels if c.masked]
        assert biased and {c.op for c in biased} == set(SDPA_MEFF)
        assert all(c.q_shape[2] <= 32 for c in biased), biased
        assert {c.op for c in mode.kernels} <= set(SDPA_FLASH) | set(SDPA_MEFF)
        check_clean(mode)


# ------------------------------------------------------------------ the GPT


def _gpt_config(head_dim=60):
    from ctxpar.config import ModelConfig
    return ModelConfig(vocab_size=64, seq_len=32, n_layers=2, d_model=2 * head_dim, n_heads=2,
                       n_kv_heads=1, ffn_hidden=64)


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("mode_name", ["none", "selective", "full", "every_n_layers"])
def test_gpt_bf16_forward_backward(mode_name, documents, monkeypatch):
    """The GPT in bf16 on CUDA (MQA, head_dim 60), forward to the loss and backward, under
    each activation checkpointing mode: a gradient for every parameter in its dtype, only
    the flash kernel (recomputed forwards under full checkpointing), no host sync."""
    from models.gpt import GPT
    cfg = _gpt_config()
    with dry.fake_cuda(monkeypatch) as mode:
        model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode_name, every_n_layers=2),
                    device="cuda", dtype=BF16)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device="cuda")
        loss = model(tokens, torch.arange(cfg.seq_len, device="cuda"), tokens.roll(-1, 1),
                     cu_seqlens=_docs(cfg.seq_len) if documents else None)
        assert loss.shape == () and loss.dtype == FP32
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == BF16 and p.grad.shape == p.shape, name
        assert {c.op for c in mode.kernels} == set(SDPA_FLASH)
        fwd = sum(c.op == SDPA_FLASH[0] for c in mode.kernels)
        bwd = sum(c.op == SDPA_FLASH[1] for c in mode.kernels)
        replays = {"none": 0, "selective": 0, "full": 2, "every_n_layers": 1}[mode_name]
        assert fwd == bwd + replays * bwd // cfg.n_layers, (fwd, bwd)
        check_clean(mode)


def test_pipeline_blocks_read_the_documents_once_per_micro_batch(monkeypatch):
    """A pipeline stage's blocks get the packed boundaries as a device tensor; the host needs
    them for the plan. One device-to-host copy per micro-batch and stage, not one per layer
    (the blocks share the tensor), and none in backward (recomputation reuses them)."""
    from ctxpar.context_parallel import ContextParallel
    from ctxpar.context_parallel.documents import pack_cu_seqlens
    from models.gpt_pipe import BlockPipe
    cfg = dataclasses.replace(_gpt_config(head_dim=64), n_layers=3)  # three blocks
    with dry.fake_cuda(monkeypatch) as mode:
        blocks = [BlockPipe(cfg, i, None, ContextParallel(), "auto", "full", 1, device="cuda",
                            dtype=BF16) for i in range(3)]
        outs = []
        for micro in range(2):
            docs = pack_cu_seqlens(_docs(cfg.seq_len), cfg.seq_len).to("cuda")
            x = (rand(2, cfg.seq_len, cfg.d_model).requires_grad_(),
                 torch.arange(cfg.seq_len, device="cuda"), docs)
            for blk in blocks:
                x = blk(x)
            outs.append(x[0])
            assert mode.host_syncs == micro + 1, mode.host_syncs
        torch.autograd.backward([o.float().sum() for o in outs])
        assert mode.host_syncs == 2


# ------------------------------------------------------------------ the rules themselves


def _violations():
    """(what, a call that breaks one rule) for each rule ContractMode adds to the meta
    kernels, which accept all of these."""
    f = torch.ops.aten
    q = lambda *s, dt=BF16: rand(*s, dtype=dt)  # noqa: E731
    lse = lambda: torch.empty(1, 2, 16, device="cuda")  # noqa: E731
    return {
        "fp32 into the flash op": lambda: f._scaled_dot_product_flash_attention(
            q(1, 2, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32)),
        "head_dim 60 into the flash op": lambda: f._scaled_dot_product_flash_attention(
            q(1, 2, 16, 60), q(1, 2, 16, 60), q(1, 2, 16, 60)),
        "head_dim 264 into the flash op": lambda: f._scaled_dot_product_flash_attention(
            q(1, 2, 16, 264), q(1, 2, 16, 264), q(1, 2, 16, 264)),
        "a strided last dim": lambda: f._scaled_dot_product_flash_attention(
            q(1, 2, 64, 16).transpose(2, 3), q(1, 2, 16, 64), q(1, 2, 16, 64)),
        "kv heads to the efficient op": lambda: f._scaled_dot_product_efficient_attention(
            q(1, 4, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32),
            None, True),
        "a strided lse into the flash backward": lambda: (
            f._scaled_dot_product_flash_attention_backward(
                q(1, 2, 16, 64), q(1, 2, 16, 64), q(1, 2, 16, 64), q(1, 2, 16, 64),
                q(1, 2, 16, 64), torch.empty(1, 16, 2, device="cuda").transpose(1, 2),
                None, None, 16, 16, 0.0, False, torch.empty(2, device="cuda",
                                                            dtype=torch.uint64),
                torch.empty((), device="cuda", dtype=torch.uint64))),
        "an unpadded lse into the efficient backward": lambda: (
            f._scaled_dot_product_efficient_attention_backward(
                q(1, 2, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32), q(1, 2, 16, 64, dt=FP32),
                q(1, 2, 16, 64, dt=FP32), None, q(1, 2, 16, 64, dt=FP32), lse(),
                torch.empty((), device="cuda", dtype=torch.int64),
                torch.empty((), device="cuda", dtype=torch.int64), 0.0,
                [True, True, True, False], False)),
        "the CPU kernel on CUDA tensors": lambda: (
            f._scaled_dot_product_flash_attention_for_cpu(q(1, 2, 16, 64), q(1, 2, 16, 64),
                                                          q(1, 2, 16, 64))),
        "a CPU tensor into a CUDA op": lambda: q(4, 4).masked_fill(
            torch.ones(4, 4, dtype=torch.bool), 0.0),
        "reading a device result on the host": lambda: q(4).sum().item(),
        "copying a device result to the host": lambda: q(4).exp().cpu(),
        "head_dim 36 into FlashAttention-4": lambda: torch.ops.ctxpar_dry.fa4_fwd(
            q(1, 16, 2, 36), q(1, 16, 2, 36), q(1, 16, 2, 36), 0.1, False, -1, -1),
        "a window side below -1 into flash-attn": lambda: torch.ops.ctxpar_dry.fa2_fwd(
            q(1, 16, 2, 64), q(1, 16, 2, 64), q(1, 16, 2, 64), 0.1, False, -2, 0),
        "an unaligned attn_bias into the efficient op": lambda: (
            f._scaled_dot_product_efficient_attention(
                q(1, 2, 16, 64), q(1, 2, 12, 64), q(1, 2, 12, 64),
                q(16, 12).expand(1, 2, 16, 12), True)),
    }


@pytest.mark.parametrize("what", list(_violations()))
def test_contract_mode_refuses_what_the_real_kernels_refuse(what, monkeypatch):
    with dry.fake_cuda(monkeypatch):
        with pytest.raises((dry.ContractError, dry.HostSync, dry.DeviceMix)):
            _violations()[what]()


def test_host_data_sent_to_the_device_reads_back_counted(monkeypatch):
    with dry.fake_cuda(monkeypatch) as mode:
        host = torch.tensor([0, 3, 8], dtype=torch.int32)
        assert host.to("cuda").cpu().tolist() == [0, 3, 8]
        assert mode.host_syncs == 1


def test_math_kernel_on_cuda(monkeypatch):
    """The reference kernel (the masked route's) on CUDA: fp32 math, results in q's dtype."""
    with dry.fake_cuda(monkeypatch) as mode:
        q = rand(2, 8, 4, 60)
        k = rand(2, 8, 1, 60)
        out, lse = MathBackend().forward(q, k, k, True, 0.1)
        assert out.dtype == BF16 and lse.shape == (2, 4, 8) and lse.dtype == FP32
        check_grads((q, k, k), MathBackend().backward(q, q, k, k, out, lse, True, 0.1), (FP32,))
        check_clean(mode)


def test_gpt_head_dim_padding_reaches_the_kernel(monkeypatch):
    """math.ceil(60 / 8) * 8: the flash op sees head_dim 64 from the GPT's 60."""
    from models.gpt import GPT
    cfg = _gpt_config()
    with dry.fake_cuda(monkeypatch) as mode:
        model = GPT(cfg, device="cuda", dtype=BF16)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="cuda")
        model(tokens, torch.arange(cfg.seq_len, device="cuda"))
        assert {c.q_shape[-1] for c in mode.kernels} == {math.ceil(60 / 8) * 8}


# ------------------------------------------------------------------ MLA: latent_attention


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("label", ["sdpa bf16", "sdpa fp32", "flash_attn 2.7+"])
@pytest.mark.parametrize("comm", list(PATTERNS))
def test_latent_attention(comm, label, documents, monkeypatch):
    """MLA (latent_attention) on one rank and 4 simulated ranks, zigzag: q, k at head dim
    24 and v at 16 reach kernels that want one head dim (the flash ops: v == k's shape)
    through kernels.PaddedHeadDims, only that backend's kernels run, and q, the latent and
    kv_b's weight get gradients of their shapes on CUDA, with no host sync."""
    from ctxpar.context_parallel import LatentDims, latent_attention
    dims = LatentDims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    _, dtype, ops, _ = BACKENDS[label]
    with dry.fake_cuda(monkeypatch) as mode:
        backend = use_backend(monkeypatch, label)
        for world in (1, P):
            for rank in range(world):
                q = rand(2, S_LOCAL, 4, dims.qk_head_dim, dtype=dtype).requires_grad_()
                latent = rand(2, S_LOCAL, dims.latent_dim, dtype=dtype).requires_grad_()
                weight = rand(4 * dims.kv_b_rows_per_head, dims.kv_lora_rank,
                              dtype=dtype).requires_grad_()
                start = len(mode.kernels)
                out = latent_attention(q, latent, weight, dims, comm=comm, causal=True,
                                       layout="zigzag", backend=backend,
                                       cu_seqlens=_docs(S_LOCAL * world) if documents
                                       else None, **_groups(comm, rank, world))
                assert out.shape == (2, S_LOCAL, 4, dims.v_head_dim) and out.dtype == dtype
                grads = torch.autograd.grad(out, (q, latent, weight),
                                            rand(*out.shape, dtype=dtype))
                check_grads((q, latent, weight), grads)
                calls = mode.kernels[start:]
                assert calls and {c.op for c in calls} <= set(ops), calls
        check_clean(mode)
