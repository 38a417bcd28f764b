"""The lean torch kernels (ctxpar/context_parallel/linear/lean.py) against today's kernels.

gated_delta_lean, kda_lean and ssd_lean run gated_delta_fp32, kda_fp32 and ssd_fp32
segment by segment, under
no_grad in forward and again with autograd in backward; they must give what the kernels
give under autograd: outputs, final states and every gradient (q, k, v, g, beta and the
initial state; x, dt, A, B, C, D and the initial state), with grouped heads, documents (one
starting on a segment's first token) and an initial state. Tolerance: the same fp32
operations on the same chunks, but the segments' gradients are summed per segment, and
the per-head parameters' (A, D) summed over segments: differences seen are ~1e-7 of the
tensor's scale, 1e-6 of it is the bound (a state not carried, or a document leaking across
a segment, moves results by O(0.1)). And what they save: the inputs and the fp32 states
between segments, nothing else.
"""
import pytest
import torch
import torch.nn.functional as F

from ctxpar.context_parallel.linear.gated_delta import gated_delta_fp32
from ctxpar.context_parallel.linear.kda import kda_fp32
from ctxpar.context_parallel.linear.lean import gated_delta_lean, kda_lean, ssd_lean
from ctxpar.context_parallel.linear.ssd import ssd_fp32
from ctxpar.testing.memory import saved_tensor_bytes

T, CHUNK = 45, 8
SEQ_IDX = torch.tensor([[0] * 16 + [1] * 20 + [2] * 9,   # a start on chunk 2's (segment's)
                        [0] * 13 + [1] + [2] * 31])     # first token; a one-token document


def close(got, want):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-6 * scale, rtol=1e-6)


def _gdn_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = [r(2, T, 2, 8), r(2, T, 2, 8), r(2, T, 4, 6), -F.softplus(r(2, T, 4)),
         torch.rand(2, T, 4, generator=gen)]
    return [x.to(dtype).requires_grad_() for x in t] + [r(2, 4, 8, 6).requires_grad_()]


def _ssd_inputs():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = [r(2, T, 4, 6), F.softplus(r(2, T, 4) - 1), -torch.rand(4, generator=gen) - 0.5,
         r(2, T, 2, 5), r(2, T, 2, 5), r(4), r(2, 4, 6, 5)]
    return [x.requires_grad_() for x in t]


def _all_grads(out, final, leaves):
    gen = torch.Generator().manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=gen)).sum() \
        + (final * torch.randn(final.shape, generator=gen)).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.quick
@pytest.mark.parametrize("segment_chunks", [1, 2, 32])
@pytest.mark.parametrize("docs", [False, True])
def test_lean_gated_delta_equals_the_autograd_kernel(segment_chunks, docs):
    """Hk 2 < Hv 4, l2norm in the kernel, an initial state, 45 tokens in chunks of 8: one
    segment a chunk, segments of two, one segment."""
    seq = SEQ_IDX if docs else None
    ref, ours = _gdn_inputs(), _gdn_inputs()
    o, f = gated_delta_fp32(*ref[:5], 0.35, ref[5], seq, CHUNK, True)
    lo, lf = gated_delta_lean(*ours[:5], 0.35, ours[5], seq, CHUNK, True, segment_chunks)
    close(lo, o)
    close(lf, f)
    for a, b in zip(_all_grads(lo, lf, ours), _all_grads(o, f, ref)):
        close(a, b)


@pytest.mark.parametrize("segment_chunks", [1, 2])
def test_lean_kda_equals_the_autograd_kernel(segment_chunks):
    """KDA's kernel (a log-decay per key channel, g (B, T, Hv, Dk)) in segments of one and
    two chunks, with documents and an initial state: outputs, final state and every
    gradient as kda_fp32 under autograd."""
    ref, ours = _gdn_inputs(), _gdn_inputs()
    gen = torch.Generator().manual_seed(2)
    g = -F.softplus(torch.randn(2, T, 4, 8, generator=gen))
    ref[3], ours[3] = g.clone().requires_grad_(), g.clone().requires_grad_()
    o, f = kda_fp32(*ref[:5], 0.35, ref[5], SEQ_IDX, CHUNK, True)
    lo, lf = kda_lean(*ours[:5], 0.35, ours[5], SEQ_IDX, CHUNK, True, segment_chunks)
    close(lo, o)
    close(lf, f)
    for a, b in zip(_all_grads(lo, lf, ours), _all_grads(o, f, ref)):
        close(a, b)


@pytest.mark.quick
@pytest.mark.parametrize("segment_chunks", [1, 2])
@pytest.mark.parametrize("docs", [False, True])
def test_lean_ssd_equals_the_autograd_kernel(segment_chunks, docs):
    """B/C in 2 groups of 4 heads, D, an initial state: x, dt, A, B, C, D and the state."""
    seq = SEQ_IDX if docs else None
    ref, ours = _ssd_inputs(), _ssd_inputs()
    y, f = ssd_fp32(*ref, seq, CHUNK)
    ly, lf = ssd_lean(*ours, seq, CHUNK, segment_chunks)
    close(ly, y)
    close(lf, f)
    for a, b in zip(_all_grads(ly, lf, ours), _all_grads(y, f, ref)):
        close(a, b)


def test_lean_gated_delta_in_bf16_gives_the_kernels_gradients_in_bf16():
    """bf16 inputs: the same fp32 math and the same casts, so the same bf16 gradients but
    for a rounding step where the fp32 values differ in their last bits (2^-8)."""
    ref, ours = _gdn_inputs(torch.bfloat16), _gdn_inputs(torch.bfloat16)
    o, f = gated_delta_fp32(*ref[:5], 0.35, ref[5], SEQ_IDX, CHUNK, True)
    lo, lf = gated_delta_lean(*ours[:5], 0.35, ours[5], SEQ_IDX, CHUNK, True, 2)
    close(lo, o)
    for a, b in zip(_all_grads(lo, lf, ours), _all_grads(o, f, ref)):
        assert a.dtype == b.dtype
        scale = max(1.0, b.float().abs().max().item())
        torch.testing.assert_close(a.float(), b.float(), atol=2 ** -8 * scale, rtol=2 ** -7)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_gated_delta_saves_its_inputs_and_the_states_between_segments(dtype):
    """One layer's kernel at 256 tokens in chunks of 16, segments of 4 chunks: what autograd
    saves is q, k, v (in their dtype), g, beta, the initial state and the 3 fp32 states
    entering segments 2-4, byte for byte; the autograd kernel saves 9x that at fp32 here."""
    B, n, Hk, Hv, Dk, Dv = 1, 256, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, h, d, generator=gen).to(dtype).requires_grad_()
               for h, d in ((Hk, Dk), (Hk, Dk), (Hv, Dv)))
    g = (-torch.rand(B, n, Hv, generator=gen)).requires_grad_()
    beta = torch.rand(B, n, Hv, generator=gen).to(dtype).requires_grad_()
    s0 = torch.zeros(B, Hv, Dk, Dv, requires_grad=True)
    inputs = (q, k, v, g, beta, s0)
    with saved_tensor_bytes([]) as seen:
        o, f = gated_delta_lean(q, k, v, g, beta, 0.25, s0, None, 16, True, 4)
    states = 3 * B * Hv * Dk * Dv * 4
    assert sum(seen.values()) == sum(x.nbytes for x in inputs) + states
    (o.float().sum() + f.sum()).backward()
    with saved_tensor_bytes([]) as today:
        gated_delta_fp32(q, k, v, g, beta, 0.25, s0, None, 16, True)
    assert sum(today.values()) > 5 * sum(seen.values())


def _norms():
    from models.gated_delta import LeanGatedNorm, gated_rmsnorm
    from models.mamba2 import LeanGroupedGatedNorm, grouped_gated_rmsnorm
    return {"gdn": (LeanGatedNorm.apply, gated_rmsnorm, ()),
            "mamba2": (LeanGroupedGatedNorm.apply, grouped_gated_rmsnorm, (2,))}


@pytest.mark.quick
@pytest.mark.parametrize("norm", ["gdn", "mamba2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_gated_norms_equal_autograd_and_save_x_z_w(norm, dtype):
    """models/gated_delta.py's LeanGatedNorm and models/mamba2.py's LeanGroupedGatedNorm
    (2 groups) against their functions under autograd: the same operations recomputed, so
    the output and the gradients of x, z and w are the same bits; they save x, z and w (in
    their dtype) where autograd keeps several fp32 copies."""
    lean, reference, groups = _norms()[norm]
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(2, 7, 3, 8, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(8, generator=gen)).to(dtype)
    ref, ours = ([t.clone().requires_grad_() for t in (x, z, w)] for _ in range(2))
    with saved_tensor_bytes([]) as seen:
        out = lean(*ours, *groups, 1e-6)
    assert sum(seen.values()) == sum(t.nbytes for t in ours)
    want = reference(*ref, *groups, 1e-6)
    dout = torch.randn(want.shape, generator=gen).to(dtype)
    assert torch.equal(out, want)
    for a, b in zip(torch.autograd.grad(out, ours, dout), torch.autograd.grad(want, ref, dout)):
        assert torch.equal(a, b)
