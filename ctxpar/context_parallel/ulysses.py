"""Ulysses attention (``comm="ulysses"``, DeepSpeed-Ulysses): trade the sequence split for a head split.

Each of the u ranks holds s = n/u tokens of every head. One all-to-all regroups q, k, v
so that each rank holds *all* n tokens of H/u heads; attention is then an ordinary local
problem (one fused kernel call, with LSE); a second all-to-all sends every token's output
back to the rank that holds the token. Backward is the same two all-to-alls in reverse
(dout in, dq/dk/dv out) around the local kernel's backward. Exact: nothing is merged.

    q (B, s, H, D) --a2a--> (B, n, H/u, D) --attention--> (B, n, H/u, D) --a2a--> (B, s, H, D)

- Heads: H % u == 0 (per TP rank; config checks it). K,V go at KV-head width; when Hkv
  does not divide over u, each kv head is replicated to Hkv' = lcm(Hkv, u) heads first
  (query group i of H/u heads then finds its kv heads among kv group i of Hkv'/u) and the
  replicas' gradients are summed back in fp32: exact, at (Hkv'/Hkv) x the K,V bytes.
- Token order: rank i holds the layout's shard i (layouts.py), so the gathered tokens
  arrive as shard 0, shard 1, ...; ``layouts.ulysses_arrival_positions`` says where each
  belongs, and the unpacking puts them in ascending order (one index_select) so that a
  plain causal kernel is exact; the output (and the backward's dq, dk, dv) goes back to
  arrival order as it is packed (one index_copy_ per tensor into the send buffer).
- Copies: at most one per tensor on each side of every all-to-all (the pack into, and the
  unpack out of, its (u, s, B, h, D) message); on the gathered-sequence side none at all in
  contiguous order at batch 1, where the message already is the (B, n, h, D) tensor.
- Hybrid (hybrid.py) runs exactly this inside each ring rank, with the ring over the
  gathered shards as the ``inner`` attention instead of one local kernel.

Message layout of every all-to-all: (u, s, B, h, D), piece i for/from rank i.
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


def _pack_by_heads(tensors: Sequence[torch.Tensor], u: int) -> torch.Tensor:
    """(B, s, H_t, D) each -> (u, s, B, sum H_t/u, D): piece i = head group i of every t."""
    B, s, _, D = tensors[0].shape
    widths = [t.shape[2] // u for t in tensors]
    send = tensors[0].new_empty(u, s, B, sum(widths), D)
    o = 0
    for t, w in zip(tensors, widths):
        send[..., o:o + w, :].copy_(t.unflatten(2, (u, w)).permute(2, 1, 0, 3, 4))
        o += w
    return send


def _unpack_to_sequence(recv: torch.Tensor, order: Optional[torch.Tensor], widths):
    """(u, s, B, h, D) from ranks 0..u-1 -> (B, u*s, w, D) per width, tokens ascending."""
    u, s, B, h, D = recv.shape
    x = recv.view(u * s, B, h, D)  # arrival order: rank 0's tokens, rank 1's, ...
    if order is not None:
        x = x.index_select(0, order)
    return x.transpose(0, 1).split(list(widths), dim=2)


def _pack_by_sequence(tensors: Sequence[torch.Tensor], order: Optional[torch.Tensor],
                      u: int) -> torch.Tensor:
    """(B, n, w_t, D) each, tokens ascending -> (u, n/u, B, sum w_t, D): piece i = rank i's
    tokens (in the order that rank holds them).

    One copy per tensor, straight into its slot of the send buffer: ascending token j goes
    to arrival slot order[j] (index_copy_, the inverse of the unpacking's index_select), so
    neither a cat nor a reordered temporary is made. A single tensor in ascending order is
    sent as it is when its (n, B, ...) transpose is already contiguous (batch 1).
    """
    B, n, _, D = tensors[0].shape
    widths = [t.shape[2] for t in tensors]
    if len(tensors) == 1 and order is None:
        return tensors[0].transpose(0, 1).contiguous().view(u, n // u, B, widths[0], D)
    send = tensors[0].new_empty(n, B, sum(widths), D)
    o = 0
    for t, w in zip(tensors, widths):
        slot = send[:, :, o:o + w]
        if order is None:
            slot.copy_(t.transpose(0, 1))
        else:
            slot.index_copy_(0, order, t.transpose(0, 1))
        o += w
    return send.view(u, n // u, B, sum(widths), D)


def _unpack_by_heads(recv: torch.Tensor, widths):
    """(u, s, B, h, D) from ranks 0..u-1 -> (B, s, u*w, D) per width: head groups in order."""
    u, s, B, h, D = recv.shape
    x = recv.permute(2, 1, 0, 3, 4)  # (B, s, u, h, D)
    out, o = [], 0
    for w in widths:
        out.append(x[..., o:o + w, :].reshape(B, s, u * w, D))
        o += w
    return out


class SeqToHeads(torch.autograd.Function):
    """q (B, s, H, D), k, v (B, s, Hkv, D) -> (B, u*s, H/u, D), (B, u*s, Hkv'/u, D) x 2."""

    @staticmethod
    def forward(ctx, q, k, v, group, kv_heads, order):
        u = group_rank_and_size(group)[1]
        ctx.args, ctx.kv_in = (group, order, u), k.shape[2]
        k, v = expand_kv(k, kv_heads), expand_kv(v, kv_heads)  # replicas when Hkv % u
        recv = all_to_all(_pack_by_heads((q, k, v), u), group, "fwd")
        return _unpack_to_sequence(recv, order, (q.shape[2] // u, kv_heads // u,
                                                 kv_heads // u))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        group, order, u = ctx.args
        recv = all_to_all(_pack_by_sequence((dq, dk, dv), order, u), group, "bwd")
        dq, dk, dv = _unpack_by_heads(recv, (dq.shape[2], dk.shape[2], dv.shape[2]))
        # Replicated kv heads: sum the replicas' gradients in fp32 (a no-op without them).
        dk, dv = (reduce_kv_grad(g, ctx.kv_in).to(g.dtype) for g in (dk, dv))
        return dq, dk, dv, None, None, None


class HeadsToSeq(torch.autograd.Function):
    """out (B, u*s, H/u, D), tokens ascending -> (B, s, H, D) of this rank's tokens."""

    @staticmethod
    def forward(ctx, x, group, order):
        u = group_rank_and_size(group)[1]
        ctx.args = (group, order, u)
        recv = all_to_all(_pack_by_sequence((x,), order, u), group, "fwd")
        return _unpack_by_heads(recv, (x.shape[2],))[0]

    @staticmethod
    def backward(ctx, dout):
        group, order, u = ctx.args
        recv = all_to_all(_pack_by_heads((dout,), u), group, "bwd")
        return _unpack_to_sequence(recv, order, (dout.shape[2] // u,))[0], None, None


@torch.no_grad()
def _lse_to_sequence(lse: torch.Tensor, group, order) -> torch.Tensor:
    """lse (B, H/u, u*s) fp32, tokens ascending -> (B, H, s) of this rank's tokens."""
    u = group_rank_and_size(group)[1]
    send = _pack_by_sequence((lse.transpose(1, 2).unsqueeze(-1),), order, u)
    recv = all_to_all(send, group, "fwd")
    return _unpack_by_heads(recv, (lse.shape[1],))[0].squeeze(-1).transpose(1, 2).contiguous()


def ulysses_attention(q, k, v, group, layout: str, inner: Callable, return_lse: bool = False):
    """(out (B, s, H, D), lse (B, H, s) fp32 or None) with all-to-alls over `group`.

    inner(qh, kh, vh) -> (out, lse) is the attention over the gathered tokens, ascending:
    one local kernel (pure Ulysses) or the ring across ring ranks (hybrid).
    """
    u = group_rank_and_size(group)[1]
    if u == 1:
        out, lse = inner(q, k, v)
        return out, (lse if return_lse else None)
    arrival = ulysses_arrival_positions(u * q.shape[1], u, layout, q.device)
    order = None if arrival is None else torch.argsort(arrival)
    kv_heads = ulysses_kv_heads(k.shape[2], u)
    qh, kh, vh = SeqToHeads.apply(q, k, v, group, kv_heads, order)
    out_h, lse_h = inner(qh, kh, vh)  # (B, u*s, H/u, D), (B, H/u, u*s)
    out = HeadsToSeq.apply(out_h, group, order)
    return out, (_lse_to_sequence(lse_h, group, order) if return_lse else None)
