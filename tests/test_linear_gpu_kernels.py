"""The linear mixers' GPU kernel adapters (linear/gpu_kernels.py) against the torch kernels.

The adapters run here over CPU emulations of the three libraries (tests/helpers/
linear_libraries.py: the real signatures and semantics, one sequence or document at a
time in ctxpar's fp32 math), so what is checked is what ctxpar does around each library:
fla's rows flattened into cu_seqlens with each row's states at its first and last
document, mamba's seq_idx restarted at 0 per row, causal-conv1d's run sequence (halo
before every run of positions) and its seq_idx. Every strategy and layout on one process
and on every rank of a simulated 4-rank group (NoComm: the same schedule with the local
data standing in for the others', so the local kernel is the only difference), with
documents: outputs, final states and every gradient as the torch kernels' to fp32
rounding (linear_tolerance). The CUDA side (layouts, dtypes, no host sync) is the dry
run's (tests/cuda_dry_cases.py).
"""
import functools
import logging

import pytest
import torch

from ctxpar.context_parallel import LOCAL, NoComm
from ctxpar.context_parallel.linear import gpu_kernels, kernels
from ctxpar.context_parallel.linear.conv import run_plan
from ctxpar.context_parallel.linear.state_passing import SEGMENTS
from ctxpar.testing.linear import (documents, gdn_leaves, kda_leaves, linear_tolerance,
                                   run_case, ssd_leaves)
from helpers import linear_libraries as libs

N = 48
DIMS = {"gdn": (2, 4, 8, 6), "kda": (2, 4, 8, 6), "ssd": (4, 6, 4, 5)}  # conv channels 56 and 64: multiples of 8
CASES = [("state", "contiguous"), ("state", "zigzag"), ("heads", "zigzag"),
         ("heads", "striped")]


def counted(fn):
    """fn (its signature kept, as _call_by_signature reads it) counting its calls."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        call.calls += 1
        return fn(*args, **kwargs)
    call.calls = 0
    return call


@pytest.fixture
def emulated(monkeypatch):
    """kernels.KERNELS' GPU entries over the emulations, runnable on CPU in fp32 and bf16;
    .use(False) makes 'auto' pass them over (torch)."""
    impls = {"gated_delta": gpu_kernels.FlaGatedDelta(counted(libs.chunk_gated_delta_rule)),
             "kda": gpu_kernels.FlaKDA(counted(libs.chunk_kda)),
             "ssd": gpu_kernels.MambaSSD(counted(libs.mamba_chunk_scan_combined)),
             "conv": gpu_kernels.CausalConv1dKernel(counted(libs.causal_conv1d_fn))}
    for op, impl in impls.items():
        impl.dtypes = (torch.float32, torch.bfloat16)
        monkeypatch.setitem(kernels.KERNELS[op], impl.name, impl)

    class Switch:
        def use(self, on: bool):
            for impl in impls.values():
                impl.device_types = ("cpu",) if on else ("cuda",)

        def calls(self):
            return {op: impl._fn.calls for op, impl in impls.items()}
    return Switch()


def _leaves(mixer):
    leaves = {"gdn": gdn_leaves, "kda": kda_leaves, "ssd": ssd_leaves}[mixer]
    return leaves(N, DIMS[mixer], torch.float32)


@pytest.mark.parametrize("strategy,layout", [
    pytest.param(*CASES[1], marks=pytest.mark.quick), *CASES[:1], *CASES[2:]])
@pytest.mark.parametrize("mixer", ["gdn", "ssd"])
def test_gpu_adapters_match_the_torch_kernels(mixer, strategy, layout, emulated):
    leaves = _leaves(mixer)
    for world in (1, 4):
        for rank in range(world):
            group = LOCAL if world == 1 else NoComm(rank, world)
            run = lambda: run_case(mixer, leaves, DIMS[mixer], group, layout,  # noqa: E731
                                   strategy, documents(N))
            emulated.use(False)
            want = run()
            emulated.use(True)
            before = emulated.calls()
            got = run()
            ran = {op: n - before[op] for op, n in emulated.calls().items()}
            assert ran["conv"] >= 1 and ran["gated_delta" if mixer == "gdn" else "ssd"] >= 1
            # every tensor of this rank as the torch kernels give it: fp32 in another
            # order (per document, other chunks), so linear_tolerance's fp32 bound
            bad = [f"{k}: {(got[k] - want[k]).abs().max():.2e}" for k in want
                   if not torch.allclose(got[k], want[k], **linear_tolerance(
                       torch.float32, want[k]))]
            assert sorted(got) == sorted(want) and not bad, (world, rank, bad)


OP = {"gdn": "gated_delta", "kda": "kda", "ssd": "ssd"}
PER_HEAD = {"grad_A_log", "grad_dt_bias", "grad_D"}
# documents starting on segments' first tokens (24, 40; 44 on rank 3 of 4), mid-segment,
# one token long, at a rank's first token (12, 36)
ON_SEGMENTS = [torch.tensor([0, 5, 6, 24, 47, 48], dtype=torch.int32),
               torch.tensor([0, 12, 13, 36, 40, 44, 48], dtype=torch.int32)]


@pytest.mark.parametrize("mixer", [pytest.param("gdn", marks=pytest.mark.quick), "kda", "ssd"])
def test_libraries_called_per_segment_equal_one_call(mixer, emulated):
    """The libraries (fla's chunk_gated_delta_rule and chunk_kda, mamba_ssm's scan) called
    once per recompute segment of one chunk (8 tokens: 48 on one process, 12 or 48 on
    each of 4 ranks, 6 a segment under zigzag state passing: one call; lean.ChunkedScan:
    the entering state as initial_state, the documents cut per segment, a segment starting a document from a
    zero state, the segments recomputed last to first in backward) against one call over
    the rank's tokens, every strategy and layout on one process and on ranks 1 and 3 of 4,
    with documents (ON_SEGMENTS) and an initial state: outputs, final states and every gradient. Both
    sides run the same fp32 math (the emulations, chunks of 16 in fla's) cut at other
    places: differences of a few 1e-7 of the tensor's scale, 1e-6 of it is the bound (a
    state not carried or leaking into a document moves results by O(0.1)); the per-head
    parameters' gradients (A_log, dt_bias, D) are sums over every token that mostly cancel
    (5e-6 of their largest seen): 1e-5 for them."""
    leaves = _leaves(mixer)
    emulated.use(True)
    for strategy, layout in CASES:
        for world, rank in ((1, 0), (4, 1), (4, 3)):
            group = LOCAL if world == 1 else NoComm(rank, world)
            run = lambda chunks: run_case(  # noqa: E731
                mixer, leaves, DIMS[mixer], group, layout, strategy, ON_SEGMENTS, chunks)
            want = run(N)  # one segment: one call each way
            before = emulated.calls()[OP[mixer]]
            got = run(1)
            calls = emulated.calls()[OP[mixer]] - before
            tokens = N if strategy == "heads" else N // world  # the kernel's per row
            cut = tokens // SEGMENTS.get(layout, 1) if world > 1 and strategy == "state" \
                else tokens
            # each way once per segment; within one segment one call, its own backward
            assert calls == (2 * -(-cut // 8) if cut > 8 else 1), (strategy, layout, calls)
            tol = lambda k: 1e-5 if k in PER_HEAD else 1e-6  # noqa: E731
            bad = [f"{k}: {(got[k] - want[k]).abs().max():.2e}" for k in want
                   if not torch.allclose(got[k], want[k], rtol=tol(k),
                                         atol=tol(k) * max(1.0, want[k].abs().max().item()))]
            assert sorted(got) == sorted(want) and not bad, (strategy, layout, world, bad)


def test_flattened_documents_keep_each_rows_first_and_last():
    host = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3], [4, 5, 5, 5, 6, 6]])
    flat = gpu_kernels.flatten_documents(host)
    assert flat.cu.dtype == torch.int32
    assert flat.cu.tolist() == [0, 2, 5, 6, 12, 13, 16, 18]
    assert flat.first.tolist() == [0, 3, 4] and flat.last.tolist() == [2, 3, 6]


def test_run_plan_puts_each_run_after_its_predecessors():
    """zigzag over 16 tokens on 2 ranks, K = 4: rank 0 holds 0..3 (no predecessors: the
    kernel pads) and 12..15 (after 9..11 from the halo); rank 1's 4..7 and 8..11 are one
    run after 1..3; one process: the rows as they are."""
    zero = run_plan("zigzag", 16, 0, 2, 4)
    assert zero.positions.tolist() == [0, 1, 2, 3, 9, 10, 11, 12, 13, 14, 15]
    assert zero.keep.tolist() == [0, 1, 2, 3, 7, 8, 9, 10] and not zero.identity
    one = run_plan("zigzag", 16, 1, 2, 4)
    assert one.positions.tolist() == [1, 2, 3, *range(4, 12)]
    assert one.keep.tolist() == list(range(3, 11))
    striped = run_plan("striped", 8, 1, 2, 3)  # 1, 3, 5, 7: each after its two predecessors
    assert striped.positions.tolist() == [0, 1, 1, 2, 3, 3, 4, 5, 5, 6, 7]  # (-1 dropped)
    assert run_plan("contiguous", 16, 0, 1, 4).identity


def test_auto_picks_torch_on_cpu_and_says_why_once(caplog):
    kernels._LOGGED.clear()
    x = torch.zeros(1, 4, 2, 8)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        for _ in range(2):
            assert kernels.get_kernel("gated_delta", "auto", x, key_dim=8, value_dim=8).name \
                == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["linear kernel gated_delta auto -> torch for cpu float32 (fla: needs "
                     "cuda)"], lines


def test_a_named_kernel_that_cannot_run_is_an_error_naming_why():
    with pytest.raises(ValueError, match="causal_conv1d.*needs cuda"):
        kernels.get_kernel("conv", "causal_conv1d", torch.zeros(1, 4, 8), channels=8, width=4)
    with pytest.raises(ValueError, match="unknown ssd kernel 'fla'"):
        kernels.get_kernel("ssd", "fla", torch.zeros(1))


def test_shapes_the_libraries_refuse_fall_back_with_the_reason():
    fla, conv = gpu_kernels.FlaGatedDelta(lambda: None), gpu_kernels.CausalConv1dKernel(
        lambda: None, device_types=("cpu",))
    fla.device_types = ("cpu",)
    half = torch.zeros(1, dtype=torch.bfloat16)
    assert "odd head dims" in fla.why_not(half, key_dim=8, value_dim=7)
    assert "> 256" in fla.why_not(half, key_dim=512, value_dim=8)
    assert "needs float16/bfloat16" in fla.why_not(torch.zeros(1), key_dim=8, value_dim=8)
    assert "multiple of 8" in conv.why_not(half, channels=34, width=4)
    assert "outside 2..4" in conv.why_not(half, channels=32, width=5)
    assert conv.why_not(torch.zeros(1), channels=32, width=4) == ""  # fp32 conv is exact
