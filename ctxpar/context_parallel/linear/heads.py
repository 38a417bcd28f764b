"""CP by heads: all-to-all from sequence-sharded to head-sharded and back around the mixer.

Megatron-Core's default for Mamba and Gated DeltaNet under CP (DeepSpeed-Ulysses'
exchange, ulysses.py): each of the P ranks gives every other rank its tokens of that
rank's H/P heads, runs the mixer's kernel on the whole sequence of H/P heads from their
initial state, and sends every token's output home.

    x (B, T/P, H, D) --a2a--> (B, T, H/P, D) --kernel--> (B, T, H/P, Dv) --a2a--> (B, T/P, H, Dv)

Bytes: (P-1)/P of every input and the output each way, proportional to the local
sequence (comm.all_to_all). Any layout: the gathered tokens are put in ascending order
(layouts.ulysses_arrival_positions) and the output goes back in arrival order, as Ulysses
does. Needs H % P == 0 for the value heads (Mamba2's heads); key heads (GDN) and B/C
groups (Mamba2) that do not divide over P are replicated to lcm(heads, P) first and
their gradients summed back in fp32 (ulysses.ulysses_kv_heads). Per-head parameters and
initial states are sliced to this rank's heads (their gradient there; the CP gradient
reduction adds the other ranks'), final states all-gathered back to all heads with the
output's return (HeadsToSequence).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..comm import all_gather, all_to_all, group_rank_and_size, reduce_scatter
from ..ulysses import (HeadsToSeq, SeqToHeads, arrival_order, heads_from_message,
                       heads_message, sequence_from_message, sequence_message)


def sequence_to_heads(xs, heads: Sequence[int], group, layout: str):
    """Each (B, s, h_i, D_i) or (B, s, h_i) of this rank's tokens -> the whole sequence of
    this rank's heads[i]/P heads (B, n, heads[i]/P[, D_i]), ascending."""
    order = arrival_order(xs[0].shape[1], group, layout, xs[0].device)
    flat = [x.dim() == 3 for x in xs]
    xs = [x.unsqueeze(-1) if f else x for x, f in zip(xs, flat)]
    out = SeqToHeads.apply(group, order, tuple(heads), *xs)
    return [x.squeeze(-1) if f else x for x, f in zip(out, flat)]


class HeadsToSequence(torch.autograd.Function):
    """out (B, n, H/P, D) ascending, final (B, H/P, ...) -> this rank's tokens (B, n/P, H, D)
    and the final state of all heads (B, H, ...): one Function, so that every rank's
    backward makes both collectives (the all-to-all back, and the reduce-scatter of the
    final state's gradient, the sum of every rank's loss) whether or not its own loss
    reads the final state."""

    @staticmethod
    def forward(ctx, x, final, group, order):
        u = group_rank_and_size(group)[1]
        ctx.args = (group, order, u)
        recv, = all_to_all([sequence_message(x, order, u)], group, "fwd")
        gathered, _ = all_gather(final, group, "fwd")                  # (P, B, H/P, ...)
        return heads_from_message(recv), gathered.movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, dout, dfinal):
        group, order, u = ctx.args
        recv, = all_to_all([heads_message(dout, u)], group, "bwd")
        dfinal = dfinal.unflatten(1, (u, -1)).movedim(1, 0).contiguous()
        return (sequence_from_message(recv, order), reduce_scatter(dfinal, group, "bwd"),
                None, None)


def heads_to_sequence(x: torch.Tensor, group, layout: str,
                      final: Optional[torch.Tensor] = None):
    """(B, n, H/P, D), ascending -> (B, n/P, H, D) of this rank's tokens; with final
    (B, H/P, ...) of this rank's heads also the final state of all heads (B, H, ...)."""
    u = group_rank_and_size(group)[1]
    order = arrival_order(x.shape[1] // u, group, layout, x.device)
    if final is None:
        return HeadsToSeq.apply(x, group, order)
    return HeadsToSequence.apply(x, final, group, order)
