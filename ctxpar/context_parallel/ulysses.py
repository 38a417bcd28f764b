"""Ulysses attention (``comm="ulysses"``, DeepSpeed-Ulysses): trade the sequence split for a head split.

Each of the u ranks holds s = n/u tokens of every head. All-to-alls regroup q, k, v so
that each rank holds *all* n tokens of H/u heads; attention is then an ordinary local
problem (one fused kernel call, with LSE); an all-to-all sends every token's output back
to the rank that holds the token. Backward is the same in reverse (dout in, dq/dk/dv out)
around the local kernel's backward. Exact: nothing is merged.

    q (B, s, H, D) --a2a--> (B, n, H/u, D) --attention--> (B, n, H/u, D) --a2a--> (B, s, H, D)

- Heads: H % u == 0 (per TP rank; config checks it). K,V go at KV-head width; when Hkv
  does not divide over u, each kv head is replicated to Hkv' = lcm(Hkv, u) heads first
  (query group i of H/u heads then finds its kv heads among kv group i of Hkv'/u) and the
  replicas' gradients are summed back in fp32: exact, at (Hkv'/Hkv) x the K,V bytes.
- Token order: rank i holds the layout's shard i (layouts.py), so the gathered tokens
  arrive as shard 0, shard 1, ...; ``layouts.ulysses_arrival_positions`` says where each
  belongs, and the unpacking puts them in ascending order (one index_select) so that a
  plain causal kernel is exact; the output (and the backward's dq, dk, dv) goes back to
  arrival order as it is packed (one index_copy_).
- Messages: one all-to-all per tensor (q, k, v: three started together, each packed
  while the one before is in flight; comm.all_to_all), each of layout (u, s, B, h, D),
  piece i for/from rank i. A joint q|k|v message would save two calls but hand the
  kernel strided q, k, v, whose forward the CPU flash kernel runs ~1-2% slower (n = 8192,
  4 heads of 64, one thread); per tensor, the gathered side is whole and, at batch 1 in
  contiguous order, the message itself.
- Copies: at most one per tensor on each side of every all-to-all (the pack into, and the
  unpack out of, its message); on the gathered-sequence side none at all in contiguous
  order at batch 1.
- Hybrid (hybrid.py) runs exactly this inside each ring rank, with the ring over the
  gathered shards as the ``inner`` attention instead of one local kernel.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .comm import all_to_all, group_rank_and_size
from .kernels import expand_kv, reduce_kv_grad
from .layouts import ulysses_arrival_positions


def ulysses_kv_heads(kv_heads: int, ulysses: int) -> int:
    """KV heads sent per rank before the split: Hkv if u divides it, else lcm(Hkv, u)."""
    return kv_heads if kv_heads % ulysses == 0 else math.lcm(kv_heads, ulysses)


def head_shard(per_head: Optional[torch.Tensor], group, dim: int = 0) -> Optional[torch.Tensor]:
    """The H/u entries along `dim` of a per-head tensor (attention sinks, a mixer's per-head
    parameters or states) for the heads this rank holds between the all-to-alls: head
    group `rank` (heads_message's piece order). A view; None stays None."""
    if per_head is None:
        return None
    rank, u = group_rank_and_size(group)
    h = per_head.shape[dim] // u
    return per_head.narrow(dim, rank * h, h)


def heads_message(x: torch.Tensor, u: int) -> torch.Tensor:
    """(B, s, h, D) -> (u, s, B, h/u, D): piece i = head group i (one copy)."""
    return x.unflatten(2, (u, x.shape[2] // u)).permute(2, 1, 0, 3, 4).contiguous()


def sequence_from_message(recv: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """(u, s, B, w, D) from ranks 0..u-1 -> (B, u*s, w, D), tokens ascending.

    The message is already the whole sequence in arrival order (rank 0's tokens, rank
    1's, ...): a view in contiguous order (contiguous itself at batch 1), else one
    index_select into ascending order.
    """
    u, s, B, w, D = recv.shape
    x = recv.view(u * s, B, w, D)
    if order is not None:
        x = x.index_select(0, order)
    return x.transpose(0, 1)


def sequence_message(x: torch.Tensor, order: Optional[torch.Tensor], u: int) -> torch.Tensor:
    """(B, n, w, D), tokens ascending -> (u, n/u, B, w, D): piece i = rank i's tokens in the
    order that rank holds them. Ascending token j goes to arrival slot order[j] (index_copy_,
    the inverse of the index_select above); in contiguous order at batch 1 no copy at all."""
    B, n, w, D = x.shape
    x = x.transpose(0, 1)  # (n, B, w, D)
    x = x.contiguous() if order is None else x.new_empty(x.shape).index_copy_(0, order, x)
    return x.view(u, n // u, B, w, D)


def heads_from_message(recv: torch.Tensor) -> torch.Tensor:
    """(u, s, B, w, D) from ranks 0..u-1 -> (B, s, u*w, D): head groups in order (one copy)."""
    u, s, B, w, D = recv.shape
    return recv.permute(2, 1, 0, 3, 4).reshape(B, s, u * w, D)


class SeqToHeads(torch.autograd.Function):
    """xs[i] (B, s, h_i, D_i) -> (B, u*s, heads[i]/u, D_i), tokens ascending: one
    all-to-all per tensor (each in its own dtype), x expanded to heads[i] heads first
    (replicas when h_i % u: head j of the expansion is head j // (heads[i]/h_i)); the
    replicas' gradients are summed back in fp32 (a no-op without them)."""

    @staticmethod
    def forward(ctx, group, order, heads: Sequence[int], *xs):
        u = group_rank_and_size(group)[1]
        ctx.args, ctx.heads_in = (group, order, u), [x.shape[2] for x in xs]
        xs = [expand_kv(x, h) for x, h in zip(xs, heads)]
        recv = all_to_all((heads_message(x, u) for x in xs), group, "fwd")
        return tuple(sequence_from_message(r, order) for r in recv)

    @staticmethod
    def backward(ctx, *grads):
        group, order, u = ctx.args
        recv = all_to_all((sequence_message(g, order, u) for g in grads), group, "bwd")
        dxs = [reduce_kv_grad(heads_from_message(r), h).to(r.dtype)
               for r, h in zip(recv, ctx.heads_in)]
        return (None, None, None, *dxs)


def arrival_order(local_len: int, group, layout: str, device=None) -> Optional[torch.Tensor]:
    """Where each gathered token goes in ascending order (None: already ascending)."""
    u = group_rank_and_size(group)[1]
    arrival = ulysses_arrival_positions(u * local_len, u, layout, device)
    return None if arrival is None else torch.argsort(arrival)


class HeadsToSeq(torch.autograd.Function):
    """out (B, u*s, H/u, D), tokens ascending -> (B, s, H, D) of this rank's tokens."""

    @staticmethod
    def forward(ctx, x, group, order):
        u = group_rank_and_size(group)[1]
        ctx.args = (group, order, u)
        recv, = all_to_all([sequence_message(x, order, u)], group, "fwd")
        return heads_from_message(recv)

    @staticmethod
    def backward(ctx, dout):
        group, order, u = ctx.args
        recv, = all_to_all([heads_message(dout, u)], group, "bwd")
        return sequence_from_message(recv, order), None, None


@torch.no_grad()
def _lse_to_sequence(lse: torch.Tensor, group, order) -> torch.Tensor:
    """lse (B, H/u, u*s) fp32, tokens ascending -> (B, H, s) of this rank's tokens."""
    u = group_rank_and_size(group)[1]
    send = sequence_message(lse.transpose(1, 2).unsqueeze(-1), order, u)
    recv, = all_to_all([send], group, "fwd")
    return heads_from_message(recv).squeeze(-1).transpose(1, 2).contiguous()


def ulysses_heads_kv(k, v, group, layout: str):
    """(kh, vh) (B, u*s, Hkv'/u, D): K,V regrouped by heads as ulysses_attention regroups
    them (one all-to-all each), for layers that attend with the same K,V (Gemma 4's shared
    K/V: its consumers then send only q and out; their dK,dV join the producer's before its
    one reverse all-to-all, autograd summing them). H/u heads of the whole sequence: the
    bytes of the local K,V."""
    u = group_rank_and_size(group)[1]
    if u == 1:
        return k, v
    order = arrival_order(k.shape[1], group, layout, k.device)
    kv_heads = ulysses_kv_heads(k.shape[2], u)
    return SeqToHeads.apply(group, order, (kv_heads, kv_heads), k, v)


def ulysses_attention(q, k, v, group, layout: str, inner: Callable, return_lse: bool = False,
                      heads_kv=None):
    """(out (B, s, H, D), lse (B, H, s) fp32 or None) with all-to-alls over `group`.

    inner(qh, kh, vh) -> (out, lse) is the attention over the gathered tokens, ascending:
    one local kernel (pure Ulysses) or the ring across ring ranks (hybrid). heads_kv:
    ulysses_heads_kv's (kh, vh) of these k, v, already regrouped (only q travels in).
    """
    u = group_rank_and_size(group)[1]
    if u == 1:
        out, lse = inner(q, *(heads_kv or (k, v)))
        return out, (lse if return_lse else None)
    order = arrival_order(q.shape[1], group, layout, q.device)
    if heads_kv is not None:
        (qh,), (kh, vh) = SeqToHeads.apply(group, order, (q.shape[2],), q), heads_kv
    else:
        kv_heads = ulysses_kv_heads(k.shape[2], u)
        qh, kh, vh = SeqToHeads.apply(group, order, (q.shape[2], kv_heads, kv_heads), q, k, v)
    out_h, lse_h = inner(qh, kh, vh)  # (B, u*s, H/u, D), (B, H/u, u*s)
    out = HeadsToSeq.apply(out_h, group, order)
    return out, (_lse_to_sequence(lse_h, group, order) if return_lse else None)
