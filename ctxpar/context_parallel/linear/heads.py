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
from ..kernels import expand_kv, reduce_kv_grad
from ..layouts import ulysses_arrival_positions
from ..ulysses import (HeadsToSeq, _heads_from_message, _heads_message,
                       _sequence_from_message, _sequence_message, ulysses_kv_heads)

__all__ = ["HeadsToSequence", "SequenceToHeads", "arrival_order", "head_slice",
           "heads_to_sequence", "sequence_to_heads", "ulysses_kv_heads"]


class SequenceToHeads(torch.autograd.Function):
    """xs[i] (B, s, h_i, D_i) -> (B, P*s, heads[i]/P, D_i), tokens ascending: one
    all-to-all per tensor (each in its own dtype), x expanded to heads[i] heads first
    (repeat_interleave: head j of the expansion is head j // (heads[i]/h_i))."""

    @staticmethod
    def forward(ctx, group, order, heads: Sequence[int], *xs):
        u = group_rank_and_size(group)[1]
        ctx.args, ctx.heads_in = (group, order, u), [x.shape[2] for x in xs]
        xs = [expand_kv(x, h) for x, h in zip(xs, heads)]
        recv = all_to_all((_heads_message(x, u) for x in xs), group, "fwd")
        return tuple(_sequence_from_message(r, order) for r in recv)

    @staticmethod
    def backward(ctx, *grads):
        group, order, u = ctx.args
        recv = all_to_all((_sequence_message(g, order, u) for g in grads), group, "bwd")
        dxs = [reduce_kv_grad(_heads_from_message(r), h).to(r.dtype)
               for r, h in zip(recv, ctx.heads_in)]
        return (None, None, None, *dxs)


def arrival_order(local_len: int, group, layout: str, device=None) -> Optional[torch.Tensor]:
    """Where each gathered token goes in ascending order (None: already ascending)."""
    u = group_rank_and_size(group)[1]
    arrival = ulysses_arrival_positions(u * local_len, u, layout, device)
    return None if arrival is None else torch.argsort(arrival)


def sequence_to_heads(xs, heads: Sequence[int], group, layout: str):
    """Each (B, s, h_i, D_i) or (B, s, h_i) of this rank's tokens -> the whole sequence of
    this rank's heads[i]/P heads (B, n, heads[i]/P[, D_i]), ascending."""
    order = arrival_order(xs[0].shape[1], group, layout, xs[0].device)
    flat = [x.dim() == 3 for x in xs]
    xs = [x.unsqueeze(-1) if f else x for x, f in zip(xs, flat)]
    out = SequenceToHeads.apply(group, order, tuple(heads), *xs)
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
        recv, = all_to_all([_sequence_message(x, order, u)], group, "fwd")
        gathered, _ = all_gather(final, group, "fwd")                  # (P, B, H/P, ...)
        return _heads_from_message(recv), gathered.movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, dout, dfinal):
        group, order, u = ctx.args
        recv, = all_to_all([_heads_message(dout, u)], group, "bwd")
        dfinal = dfinal.unflatten(1, (u, -1)).movedim(1, 0).contiguous()
        return (_sequence_from_message(recv, order), reduce_scatter(dfinal, group, "bwd"),
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


def head_slice(x: Optional[torch.Tensor], group, dim: int) -> Optional[torch.Tensor]:
    """This rank's H/P of the heads along `dim` (a view; None stays None)."""
    if x is None:
        return None
    rank, u = group_rank_and_size(group)
    h = x.shape[dim] // u
    return x.narrow(dim, rank * h, h)
