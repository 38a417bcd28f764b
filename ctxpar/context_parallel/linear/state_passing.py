"""CP by state passing: the state crosses ranks, not the sequence (LASP-2; fla's ``fla/ops/cp``).

A linear-attention or state-space layer's state after a segment of tokens is affine in
the state before it:

    S_out = M S_in + E        GDN: M (d_k, d_k) = the product of exp(g_t)(I - beta_t k_t k_t^T)
                              Mamba2: M = exp(sum of dt_t A), a scalar per head
                              E = the state the segment reaches from zero

so each rank summarises each of its segments as (M, E), the summaries are all-gathered
once in fp32 (bytes per rank (P-1) x segments x B x H x |M, E|, independent of n), and every
rank composes its predecessors' in sequence order to get its segments' initial states,
S_in(c+1) = M_c S_in(c) + E_c from the sequence's initial state S_in(0). contiguous gives
one segment per rank, zigzag two (chunks r and 2P-1-r: 2P summaries composed in order);
striped would cut n/P segments per rank, so it is refused (the heads strategy takes it).

Documents: a segment containing a document start has M = 0 (nothing before the start
reaches its end) and E = the state of its last document, so the composition restarts
there by itself; a document spanning several ranks is carried by each of their (M, E).

Backward: the same merge in reverse, by autograd through the fp32 composition, then a
reduce-scatter of the summaries' gradients (the same bytes as the all-gather), so it is
exact: each rank's dS_in reaches every predecessor's (M, E).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..comm import all_gather, group_rank_and_size, reduce_scatter

SEGMENTS = {"contiguous": 1, "zigzag": 2}  # layout -> segments per rank (state passing)
STATE_LAYOUTS = tuple(SEGMENTS)


def sequence_order(layout: str, world: int) -> List[Tuple[int, int]]:
    """[(rank, slot)] of every segment in sequence order: contiguous rank r's one segment
    is the r-th; zigzag rank r's slots 0 and 1 are chunks r and 2P-1-r."""
    if layout == "contiguous":
        return [(r, 0) for r in range(world)]
    return [(r, 0) for r in range(world)] + [(r, 1) for r in reversed(range(world))]


def to_segments(x: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, S, ...) -> (B*slots, S/slots, ...): row b*slots + s is slot s of sample b."""
    return x.unflatten(1, (slots, x.shape[1] // slots)).flatten(0, 1)


def from_segments(x: torch.Tensor, slots: int) -> torch.Tensor:
    """Inverse of to_segments."""
    return x.unflatten(0, (x.shape[0] // slots, slots)).flatten(1, 2)


def carries_state(positions: torch.Tensor, doc: Optional[torch.Tensor], batch: int,
                  slots: int) -> torch.Tensor:
    """(batch*slots,) bool, rows as to_segments: the segment's first token continues the
    state before it (the sequence's first token continues the initial state; a document
    start does not). positions (S,) this rank's global positions; doc (B, n) or None."""
    if doc is None:
        return torch.ones(batch * slots, dtype=torch.bool, device=positions.device)
    first = positions.view(slots, -1)[:, 0]                             # (slots,)
    prev = doc[:, (first - 1).clamp(min=0)]
    return ((first == 0) | (doc[:, first] == prev)).flatten()           # (B*slots,)


def _compose(gathered, initial, combine, rank: int, order):
    """(this rank's segments' initial states (slots, *state), the final state): the
    summaries folded in sequence order from the initial state."""
    s_in, S = {}, initial
    for r, slot in order:
        if r == rank:
            s_in[slot] = S
        S = combine(gathered[r, slot], S)
    return torch.stack([s_in[s] for s in sorted(s_in)]), S


class PassStates(torch.autograd.Function):
    """summary (slots, *shape) fp32, initial (*state) fp32 -> (s_in (slots, *state), final).

    One Function, so that its backward (a reduce-scatter) runs on every rank: every rank's
    output reads its s_in, while a rank's own loss may read no other rank's summary (rank
    0 of contiguous), which autograd would then never visit. Backward recomputes the
    composition with autograd (a few small matmuls per segment) to get the gradient of
    every gathered summary and of the initial state; the summaries' gradients are summed
    over the ranks and each rank keeps its own (reduce-scatter, bytes as the all-gather)."""

    @staticmethod
    def forward(ctx, summary, initial, combine, group, layout):
        rank, world = group_rank_and_size(group)
        gathered, _ = all_gather(summary, group, "fwd")                # (P, slots, ...)
        ctx.save_for_backward(gathered, initial)
        ctx.args = (combine, group, rank, sequence_order(layout, world))
        return _compose(gathered, initial, combine, rank, ctx.args[3])

    @staticmethod
    def backward(ctx, ds_in, dfinal):
        gathered, initial = ctx.saved_tensors
        combine, group, rank, order = ctx.args
        with torch.enable_grad():
            leaves = [gathered.detach().requires_grad_(), initial.detach().requires_grad_()]
            outs = _compose(*leaves, combine, rank, order)
            dgathered, dinitial = torch.autograd.grad(outs, leaves, (ds_in, dfinal))
        return reduce_scatter(dgathered, group, "bwd"), dinitial, None, None, None


def pass_states(summary: torch.Tensor, combine: Callable, initial: torch.Tensor, group,
                layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(initial states of this rank's segments (slots, *state) fp32, the sequence's final
    state (*state) fp32), differentiable (PassStates).

    summary (slots, *shape) fp32: this rank's (M, E) per segment, packed as the mixer
    packs them; combine(summary_c, S) = M_c S + E_c; initial (*state) fp32: the state
    before the sequence. One all-gather of the summaries, then the composition in
    sequence order (the final state costs the few segments after this rank's: always
    made, so every rank's backward is the same collective)."""
    return PassStates.apply(summary.contiguous(), initial, combine, group, layout)
