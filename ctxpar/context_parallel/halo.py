"""The ring as a halo exchange: a sliding window shorter than a rank's share, contiguous layout.

Under the contiguous layout rank r holds positions [r*S, (r+1)*S). With a causal window w
(mask.py: a query sees itself and the w - 1 keys before it) and w - 1 <= S, the only
remote keys any local query sees are the previous rank's last h = w - 1 tokens. So instead
of P - 1 ring steps of whole blocks, one message: rank r sends k, v[:, S-h:] to r + 1 and
receives rank r - 1's (rank 0 receives nothing, the last rank sends nothing).

    forward   halo K,V -> r+1 (2*B*h*Hkv*D in k's dtype), one P2P batch, overlapped with
              the local (banded) block; then the halo block
    backward  halo K,V again -> r+1, and the halo's dK,dV back <- to r-1 (in the ring's
              ring_grad_dtype: fp32 exact, bf16 half the bytes and one rounding), who
              adds them in fp32 into its last h rows

ring.py and allgather.py hand over to this whenever it applies (comm 'ring', the ring of
'hybrid', and 'allgather': what it would gather beyond the halo is invisible anyway).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from .blocks import (QueryRows, backward_block, forward_block_, mask_key, sample_bounds,
                     step_plan)
from .comm import NoComm, group_rank_and_size
from .documents import doc_plan
from .layouts import rank_positions
from .merge import empty_accumulators
from .sinks import finish
from .stats import record_comm


def halo_applies(layout: str, mask, S: int, world: int) -> bool:
    """A window alone decides who sees whom within one neighbour: the halo exchange."""
    return (layout == "contiguous" and world > 1 and mask is not None
            and mask.sliding_window is not None and mask.sliding_window - 1 <= S)


@lru_cache(maxsize=1024)
def _halo_plan(rank: int, S: int, world: int, h: int, key):
    """[(samples, block)] of the local queries against the previous rank's last h keys."""
    window, docs = key
    q_pos = rank_positions(S * world, rank, world, "contiguous")
    k_pos = torch.arange(rank * S - h, rank * S)
    return [(b, blk) for b, cu in sample_bounds(docs, S * world)
            for blk in doc_plan(cu, q_pos, k_pos, True, window)]


def _peer(group, rank: int) -> int:
    return dist.get_global_rank(dist.group.WORLD if group is None else group, rank)


def _exchange(group, rank, world, send, recv, to_next: bool, phase: str):
    """Start one P2P batch: `send` to the next (previous) rank, `recv` from the previous
    (next); the ends of the line skip what has no partner. Returns the requests."""
    if isinstance(group, NoComm):
        return []
    nxt, prv = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)
    ops, sent, got = [], 0, 0
    if 0 <= nxt < world:
        ops.append(dist.P2POp(dist.isend, send, _peer(group, nxt), group=group))
        sent = send.numel() * send.element_size()
    if 0 <= prv < world:
        ops.append(dist.P2POp(dist.irecv, recv, _peer(group, prv), group=group))
        got = recv.numel() * recv.element_size()
    record_comm(phase, sent, got)
    return dist.batch_isend_irecv(ops) if ops else []


def _halo_kv(k, v, h: int, group, rank: int, world: int, phase: str):
    """(2, B, h, Hkv, D) buffer being filled with rank - 1's last h K,V, and its requests
    (a NoComm group: the local tail stands in, nothing moves)."""
    send = torch.stack((k[:, k.shape[1] - h:], v[:, v.shape[1] - h:]))
    recv = send.clone() if isinstance(group, NoComm) else torch.empty_like(send)
    return recv, _exchange(group, rank, world, send, recv, True, phase)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def halo_forward(q, k, v, group, causal, layout, scale, kernel, mask, sinks=None):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32): the local band, then the halo block."""
    rank, world = group_rank_and_size(group)
    S, h = q.shape[1], mask.sliding_window - 1
    halo, reqs = _halo_kv(k, v, h, group, rank, world, "fwd") if h else (None, [])
    out, lse = empty_accumulators(q)
    for b, blk in step_plan(layout, causal, rank, rank, S, world, mask):
        forward_block_(kernel, q, k, v, blk, scale, out, lse, b)
    _wait(reqs)
    if h and rank > 0:
        for b, blk in _halo_plan(rank, S, world, h, mask_key(mask)):
            forward_block_(kernel, q, halo[0], halo[1], blk, scale, out, lse, b)
    return finish(out, lse, q.dtype, sinks)


def halo_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel, mask,
                  grad_dtype: torch.dtype = torch.float32):
    """(dq, dk, dv): the halo K,V come again, their dK,dV go back to rank - 1 in
    `grad_dtype` (the ring's ring_grad_dtype; summed in fp32 on both sides)."""
    rank, world = group_rank_and_size(group)
    S, h = q.shape[1], mask.sliding_window - 1
    halo, reqs = _halo_kv(k, v, h, group, rank, world, "bwd") if h else (None, [])
    rows = QueryRows(dout.contiguous(), q, out, lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
    for b, blk in step_plan(layout, causal, rank, rank, S, world, mask):
        qs, ks, g = backward_block(kernel, rows, k, v, blk, scale, b)
        dq[b, qs] += g[0]
        dkv[0, b, ks] += g[1]
        dkv[1, b, ks] += g[2]
    _wait(reqs)
    if not h:
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
    dhalo = torch.zeros((2, *halo.shape[1:]), dtype=torch.float32, device=q.device)
    if rank > 0:
        for b, blk in _halo_plan(rank, S, world, h, mask_key(mask)):
            qs, ks, g = backward_block(kernel, rows, halo[0], halo[1], blk, scale, b)
            dq[b, qs] += g[0]
            dhalo[0, b, ks] += g[1]
            dhalo[1, b, ks] += g[2]
    send = dhalo.to(grad_dtype)  # no copy in fp32
    recv = torch.zeros_like(send)
    _wait(_exchange(group, rank, world, send, recv, False, "bwd"))
    if rank < world - 1 and not isinstance(group, NoComm):
        dkv[:, :, S - h:] += recv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)

