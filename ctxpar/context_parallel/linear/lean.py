"""The chunked linear kernels as autograd Functions that save their inputs, not their insides.

gated_delta_fp32 and ssd_fp32 under autograd keep every intra-chunk tensor for backward:
(C, C) decays and scores, the triangular solves' results, fp32 copies of q, k, v, the
state entering each chunk; some Hv (10 Dk + 3 Dv + 5 C) x 4 bytes a token for GDN, where
the inputs are Hv (2 Dk + Dv) x e. flash-linear-attention's chunk_gated_delta_rule saves
its inputs and recomputes the rest in backward; ChunkedScan does the same around the torch
kernels, whatever the recurrence:

    forward   under no_grad, the sequence in segments of `segment` tokens (a multiple of
              the chunk): each segment runs the unchanged kernel from the state the one
              before handed on; saved are the inputs (as given: their dtype, their
              storage) and the state entering every segment but the first (fp32)
    backward  segment by segment from the last: the kernel again on the segment's inputs
              from its saved entering state, with autograd, and torch.autograd.grad of
              (its outputs, its final state) against (their gradients, the state gradient
              carried from the segment after): the inputs' gradients and the entering
              state's, which goes on to the segment before

so the forward's working set and the backward's are one segment's, and the result is the
kernel's own (the same chunks from the same states: outputs, final state and gradients
to fp32 rounding; tests/test_linear_kernels.py). Documents: a segment whose first token
starts a document takes a zero state (its state gradient stops there), which is what the
kernel's masks do inside a chunk.

`run(*per_token, *params, state, docs) -> (out (B, L, ...), final state)` is any chunked
scan: per-token inputs are cut along dim 1, params (per-head A, D) are passed whole and
their gradients summed over segments. GDN's scalar gate g (B, T, Hv) and KDA's per-channel
gate (B, T, Hv, Dk) are both per-token inputs. `docs` is each token's document (B, T) or
an object holding it as `.device` with `.columns(a, b)` (kernels.LocalDocs: the GPU
libraries need the host copy too), cut to the segment's columns for `run`.

The same Function segments the GPU libraries' calls (gpu_kernels.py: fla's
chunk_gated_delta_rule and chunk_kda, mamba_ssm's mamba_chunk_scan_combined, each called
per segment with the entering state as initial_state and the final state asked for):
their backwards then hold one segment's tensors, not the rank's whole sequence's.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence

import torch

from .gated_delta import gated_delta_fp32
from .kda import kda_fp32
from .ssd import ssd_fp32

SEGMENT_CHUNKS = 32  # chunks per recompute segment: 2,048 tokens at chunk 64


def segment_tokens(chunk_size: int, chunks: int = SEGMENT_CHUNKS) -> int:
    return chunk_size * chunks


def _doc_ids(docs) -> Optional[torch.Tensor]:
    """(B, T) every token's document on the inputs' device, or None."""
    return docs if docs is None or isinstance(docs, torch.Tensor) else docs.device


def _columns(docs, a: int, b: int):
    """docs at tokens a..b-1 (module docstring: a tensor or a LocalDocs)."""
    if docs is None or isinstance(docs, torch.Tensor):
        return None if docs is None else docs[:, a:b]
    return docs.columns(a, b)


def _entering(state: Optional[torch.Tensor], docs, start: int):
    """The state a segment starting at token `start` > 0 takes: zero in the rows whose
    token `start` starts a document."""
    seq_idx = _doc_ids(docs)
    if seq_idx is None or state is None:
        return state
    keep = (seq_idx[:, start] == seq_idx[:, start - 1]).to(state.dtype)
    return state * keep.view(-1, *[1] * (state.dim() - 1))


class ChunkedScan(torch.autograd.Function):
    """(out (B, T, ...) as run gives it, final state fp32) of `run` over T tokens in
    segments (module docstring). Arguments: run, segment (tokens), n_per_token, docs (B, T)
    or a LocalDocs or None, initial state or None, then the per-token inputs and the
    params (None allowed)."""

    @staticmethod
    def forward(ctx, run, segment, n_per_token, seq_idx, initial, *args):
        xs, params = args[:n_per_token], args[n_per_token:]
        T = xs[0].shape[1]
        starts = list(range(0, T, segment)) or [0]
        out, states, S = None, [], initial
        for i, a in enumerate(starts):  # only the state crosses segments
            if i:
                S = _entering(S, seq_idx, a)
                states.append(S)
            seq = _columns(seq_idx, a, a + segment)
            o, S = run(*(x[:, a:a + segment] for x in xs), *params, S, seq)
            if len(starts) == 1:
                out = o
            else:  # written in place: the whole output exists once, never beside its pieces
                out = o.new_empty(o.shape[0], T, *o.shape[2:]) if out is None else out
                out[:, a:a + o.shape[1]] = o
        ctx.run, ctx.segment, ctx.n, ctx.starts = run, segment, n_per_token, starts
        ctx.seq_idx = seq_idx  # documents: no gradient, not an activation of this layer
        ctx.has_initial = initial is not None
        boundary = torch.stack(states) if states else None  # (segments - 1, *state) fp32
        ctx.save_for_backward(initial, boundary, *args)
        return out, S

    @staticmethod
    def backward(ctx, dout, dfinal):
        initial, boundary, *args = ctx.saved_tensors
        xs, params = args[:ctx.n], args[ctx.n:]
        seg, seq_idx = ctx.segment, ctx.seq_idx
        # the inputs' gradients, written segment by segment (never beside their pieces)
        dxs = [torch.empty_like(x) if x.requires_grad else None for x in xs]
        # the params' gradients summed over segments in fp32 (16-bit weights of a tiled
        # block: hundreds of tiles), cast to each param's dtype once
        dparams = [None if p is None else torch.zeros_like(p, dtype=torch.float32)
                   for p in params]
        dS = dfinal
        for i in reversed(range(len(ctx.starts))):
            a = ctx.starts[i]
            with torch.enable_grad():
                leaves = [x[:, a:a + seg].detach().requires_grad_(x.requires_grad)
                          for x in xs]
                ps = [None if p is None else p.detach().requires_grad_(p.requires_grad)
                      for p in params]
                S_in = initial if i == 0 else boundary[i - 1]
                S_leaf = None if S_in is None else S_in.detach().requires_grad_()
                seq = _columns(seq_idx, a, a + seg)
                o, S = ctx.run(*leaves, *ps, S_leaf, seq)
                wrt = [t for t in (*leaves, *ps, S_leaf) if t is not None and t.requires_grad]
                outs = [(t, d) for t, d in ((o, dout[:, a:a + o.shape[1]]), (S, dS))
                        if t.requires_grad]  # an output of no input's (an empty one) left out
                grads = iter(torch.autograd.grad([t for t, _ in outs], wrt,
                                                 [d for _, d in outs], allow_unused=True))
            for dx, x in zip(dxs, leaves):
                if x.requires_grad:
                    g = next(grads)
                    dx[:, a:a + x.shape[1]] = 0 if g is None else g
            for j, p in enumerate(ps):
                if p is not None and p.requires_grad:
                    g = next(grads)
                    if g is not None:
                        dparams[j] += g
            dS = next(grads) if S_leaf is not None else None
            if dS is None:
                dS = torch.zeros_like(S)
            if i:  # through the reset mask the entering state took
                dS = _entering(dS, seq_idx, a)
        dparams = [d.to(p.dtype) if p is not None and p.requires_grad else None
                   for d, p in zip(dparams, params)]
        dinit = dS if ctx.has_initial and initial.requires_grad else None
        return (None, None, None, None, dinit, *dxs, *dparams)


def chunked_scan(run: Callable, per_token: Sequence[torch.Tensor], params: Sequence,
                 initial: Optional[torch.Tensor], docs, segment: int):
    """(out, final state) of run over the tokens in segments, saving the inputs only
    (ChunkedScan)."""
    return ChunkedScan.apply(run, segment, len(per_token), docs, initial, *per_token,
                             *params)


def _delta_run(kernel, scale, chunk_size, l2norm, q, k, v, g, beta, state, seq_idx):
    return kernel(q, k, v, g, beta, scale, state, seq_idx, chunk_size, l2norm)


def _delta_lean(kernel, q, k, v, g, beta, scale, initial_state, seq_idx, chunk_size,
                use_qk_l2norm_in_kernel, segment_chunks):
    run = partial(_delta_run, kernel, scale, chunk_size, use_qk_l2norm_in_kernel)
    return chunked_scan(run, (q, k, v, g, beta), (), initial_state, seq_idx,
                        segment_tokens(chunk_size, segment_chunks))


def gated_delta_lean(q, k, v, g, beta, scale: float, initial_state, seq_idx, chunk_size: int,
                     use_qk_l2norm_in_kernel: bool = False,
                     segment_chunks: int = SEGMENT_CHUNKS):
    """gated_delta_fp32's interface and result, saving only q, k, v, g, beta, the initial
    state and the fp32 state entering each segment of `segment_chunks` chunks."""
    return _delta_lean(gated_delta_fp32, q, k, v, g, beta, scale, initial_state, seq_idx,
                       chunk_size, use_qk_l2norm_in_kernel, segment_chunks)


def kda_lean(q, k, v, g, beta, scale: float, initial_state, seq_idx, chunk_size: int,
             use_qk_l2norm_in_kernel: bool = False, segment_chunks: int = SEGMENT_CHUNKS):
    """kda_fp32's interface and result (g (B, T, Hv, Dk) per key channel), saving what
    gated_delta_lean saves."""
    return _delta_lean(kda_fp32, q, k, v, g, beta, scale, initial_state, seq_idx,
                       chunk_size, use_qk_l2norm_in_kernel, segment_chunks)


def _ssd_run(chunk_size, x, dt, B, C, A, D, state, seq_idx):
    return ssd_fp32(x, dt, A, B, C, D, state, seq_idx, chunk_size)


def ssd_lean(x, dt, A, B, C, D, initial_states, seq_idx, chunk_size: int,
             segment_chunks: int = SEGMENT_CHUNKS):
    """ssd_fp32's interface and result, saving only x, dt, A, B, C, D, the initial state
    and the fp32 state entering each segment."""
    return chunked_scan(partial(_ssd_run, chunk_size), (x, dt, B, C), (A, D), initial_states,
                        seq_idx, segment_tokens(chunk_size, segment_chunks))
