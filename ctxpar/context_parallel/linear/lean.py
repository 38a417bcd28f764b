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

`run(*per_token, *params, state, seq_idx) -> (out (B, L, ...), final state)` is any chunked
scan: per-token inputs are cut along dim 1, params (per-head A, D) are passed whole and
their gradients summed over segments. GDN's scalar gate g (B, T, Hv) and KDA's per-channel
gate (B, T, Hv, Dk) are both per-token inputs: KDA's chunked kernel (kda.py) runs in
ChunkedScan as it is (kda_lean).
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


def _entering(state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], start: int):
    """The state a segment starting at token `start` > 0 takes: zero in the rows whose
    token `start` starts a document."""
    if seq_idx is None or state is None:
        return state
    keep = (seq_idx[:, start] == seq_idx[:, start - 1]).to(state.dtype)
    return state * keep.view(-1, *[1] * (state.dim() - 1))


class ChunkedScan(torch.autograd.Function):
    """(out (B, T, ...) fp32, final state fp32) of `run` over T tokens in segments (module
    docstring). Arguments: run, segment (tokens), n_per_token, seq_idx (B, T) or None,
    initial state or None, then the per-token inputs and the params (None allowed)."""

    @staticmethod
    def forward(ctx, run, segment, n_per_token, seq_idx, initial, *args):
        xs, params = args[:n_per_token], args[n_per_token:]
        T = xs[0].shape[1]
        starts = list(range(0, T, segment)) or [0]
        outs, states, S = [], [], initial
        for i, a in enumerate(starts):  # only the state crosses segments
            if i:
                S = _entering(S, seq_idx, a)
                states.append(S)
            seq = None if seq_idx is None else seq_idx[:, a:a + segment]
            o, S = run(*(x[:, a:a + segment] for x in xs), *params, S, seq)
            outs.append(o)
        ctx.run, ctx.segment, ctx.n, ctx.starts = run, segment, n_per_token, starts
        ctx.seq_idx = seq_idx  # documents: no gradient, not an activation of this layer
        ctx.has_initial = initial is not None
        boundary = torch.stack(states) if states else None  # (segments - 1, *state) fp32
        ctx.save_for_backward(initial, boundary, *args)
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], S

    @staticmethod
    def backward(ctx, dout, dfinal):
        initial, boundary, *args = ctx.saved_tensors
        xs, params = args[:ctx.n], args[ctx.n:]
        seg, seq_idx = ctx.segment, ctx.seq_idx
        pieces = [[] for _ in xs]
        dparams = [None if p is None else torch.zeros_like(p) for p in params]
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
                seq = None if seq_idx is None else seq_idx[:, a:a + seg]
                o, S = ctx.run(*leaves, *ps, S_leaf, seq)
                wrt = [t for t in (*leaves, *ps, S_leaf) if t is not None and t.requires_grad]
                grads = iter(torch.autograd.grad(
                    (o, S), wrt, (dout[:, a:a + o.shape[1]], dS), allow_unused=True))
            for piece, x in zip(pieces, leaves):
                g = next(grads) if x.requires_grad else None
                piece.append(torch.zeros_like(x) if g is None and x.requires_grad else g)
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
        dxs = [None if not x.requires_grad else
               (torch.cat(p[::-1], dim=1) if len(p) > 1 else p[0]) for x, p in zip(xs, pieces)]
        dparams = [d if p is not None and p.requires_grad else None
                   for d, p in zip(dparams, params)]
        dinit = dS if ctx.has_initial and initial.requires_grad else None
        return (None, None, None, None, dinit, *dxs, *dparams)


def chunked_scan(run: Callable, per_token: Sequence[torch.Tensor], params: Sequence,
                 initial: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor],
                 segment: int):
    """(out, final state) of run over the tokens in segments, saving the inputs only
    (ChunkedScan)."""
    return ChunkedScan.apply(run, segment, len(per_token), seq_idx, initial, *per_token,
                             *params)


def _gdn_run(scale, chunk_size, l2norm, q, k, v, g, beta, state, seq_idx):
    return gated_delta_fp32(q, k, v, g, beta, scale, state, seq_idx, chunk_size, l2norm)


def gated_delta_lean(q, k, v, g, beta, scale: float, initial_state, seq_idx, chunk_size: int,
                     use_qk_l2norm_in_kernel: bool = False,
                     segment_chunks: int = SEGMENT_CHUNKS):
    """gated_delta_fp32's interface and result, saving only q, k, v, g, beta, the initial
    state and the fp32 state entering each segment of `segment_chunks` chunks."""
    run = partial(_gdn_run, scale, chunk_size, use_qk_l2norm_in_kernel)
    return chunked_scan(run, (q, k, v, g, beta), (), initial_state, seq_idx,
                        segment_tokens(chunk_size, segment_chunks))


def _kda_run(scale, chunk_size, l2norm, q, k, v, g, beta, state, seq_idx):
    return kda_fp32(q, k, v, g, beta, scale, state, seq_idx, chunk_size, l2norm)


def kda_lean(q, k, v, g, beta, scale: float, initial_state, seq_idx, chunk_size: int,
             use_qk_l2norm_in_kernel: bool = False, segment_chunks: int = SEGMENT_CHUNKS):
    """kda_fp32's interface and result, saving only q, k, v, g (per key channel), beta, the
    initial state and the fp32 state entering each segment (gated_delta_lean's, KDA's
    kernel)."""
    run = partial(_kda_run, scale, chunk_size, use_qk_l2norm_in_kernel)
    return chunked_scan(run, (q, k, v, g, beta), (), initial_state, seq_idx,
                        segment_tokens(chunk_size, segment_chunks))


def _ssd_run(chunk_size, x, dt, B, C, A, D, state, seq_idx):
    return ssd_fp32(x, dt, A, B, C, D, state, seq_idx, chunk_size)


def ssd_lean(x, dt, A, B, C, D, initial_states, seq_idx, chunk_size: int,
             segment_chunks: int = SEGMENT_CHUNKS):
    """ssd_fp32's interface and result, saving only x, dt, A, B, C, D, the initial state
    and the fp32 state entering each segment."""
    return chunked_scan(partial(_ssd_run, chunk_size), (x, dt, B, C), (A, D), initial_states,
                        seq_idx, segment_tokens(chunk_size, segment_chunks))
