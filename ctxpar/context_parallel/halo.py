"""The ring as a halo exchange: a causal window or chunks shorter than a rank's slabs.

Under a causal mask with a window w (mask.py: a query sees itself and the w - 1 keys
before it) or chunks (documents cut every chunk_size tokens), the keys before position p
that any query at or after p sees are the last reach(p) = min(w - 1, p - start of the
piece holding p) tokens before p (the largest over the samples' documents). The
contiguous and zigzag layouts give each rank slabs of consecutive positions whose
preceding slab lives on one neighbour; when every slab's reach fits in the slab before
it, those tails are all a rank needs: one P2P batch instead of P - 1 ring steps of whole
blocks (a chunk boundary at a slab's start: nothing at all).

    contiguous  (rank r holds positions [r*S, (r+1)*S)) r sends the last reach((r+1)*S)
                rows of k, v to r + 1 and receives reach(r*S) from r - 1 (rank 0 receives
                nothing, the last rank sends nothing)
    zigzag      (rank r holds chunks r and 2P-1-r of S/2 each) chunk r needs chunk r-1's
                tail, on rank r-1; chunk 2P-1-r needs chunk 2P-2-r's, on rank r+1 (rank
                P-1: its own first chunk, local). So r sends its first chunk's tail to
                r + 1 and its second chunk's to r - 1: two links, about twice contiguous's
                bytes, still independent of n and P
    striped     token i on rank i mod P: a window of w >= P reaches every rank, no halo

    forward   halo K,V (2*B*h*Hkv*D in k's dtype per link), one P2P batch overlapped with
              the local (banded) blocks; then the halo blocks
    backward  halo K,V again, and the halo's dK,dV back to where they came from (in the
              ring's ring_grad_dtype: fp32 exact, bf16 half the bytes and one rounding),
              added in fp32 into the sender's rows

ring.py and allgather.py hand over to this whenever it applies (comm 'ring', the ring of
'hybrid', and 'allgather': what it would gather beyond the halo is invisible anyway).
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Optional, Tuple

import torch

from .blocks import (QueryRows, backward_block, banded, forward_block_, mask_key,
                     sample_bounds, step_plan)
from .comm import NoComm, exchange, group_rank_and_size, wait_all
from .documents import doc_plan
from .layouts import rank_positions
from .mask import with_chunks
from .merge import empty_accumulators
from .sinks import finish

HALO_LAYOUTS = {"contiguous": 1, "zigzag": 2}  # layout -> slabs per rank


def _reach(p: int, window, docs, n: int) -> int:
    """How many keys before position p some query at or after p sees (causal)."""
    cap = n if window is None else window - 1
    return max(min(cap, p - max(c for c in cu if c <= p))
               for cu in (set(docs) if docs else {(0, n)}))


@lru_cache(maxsize=256)
def _slab_reach(layout: str, S: int, world: int, key):
    """{slab start: reach} for every slab (S / slabs-per-rank positions) after the first,
    or None when some reach exceeds a slab (the ring, not the halo)."""
    window, docs = key
    m = S // HALO_LAYOUTS[layout]
    reach = {p: _reach(p, window, docs, S * world) for p in range(m, S * world, m)}
    return None if max(reach.values()) > m else reach


def halo_applies(layout: str, mask, S: int, world: int) -> bool:
    """A causal window or chunks reach no further than the neighbours' slabs: the halo."""
    return (layout in HALO_LAYOUTS and world > 1 and mask is not None and mask.causal
            and (mask.sliding_window is not None or mask.chunk_size is not None)
            and _slab_reach(layout, S, world, mask_key(mask)) is not None)


def halo_tokens(layout: str, rank: int, world: int, S: int, sliding_window=None,
                chunk_size=None, cu_seqlens=None) -> Optional[Tuple[int, int]]:
    """(K,V tokens `rank` sends, tokens it receives) in one halo exchange of a causal
    window and/or chunks over `world` ranks of S tokens (cu_seqlens: the documents of the
    full sequence, one tensor or one per sample; None: one sequence), or None where the
    halo does not apply (the ring or all-gather moves whole blocks): the planner's count
    of the exchange, from the same links the exchange makes."""
    n = S * world
    docs = None
    if cu_seqlens is not None or chunk_size is not None:
        cus = [torch.tensor([0, n])] if cu_seqlens is None else \
            list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens]
        docs = tuple(tuple(with_chunks(cu, chunk_size).tolist()) for cu in cus)
    key = (sliding_window, docs)
    if (layout not in HALO_LAYOUTS or world == 1
            or (sliding_window is None and chunk_size is None)
            or S % HALO_LAYOUTS[layout] or _slab_reach(layout, S, world, key) is None):
        return None
    links = _links(layout, rank, world, S, key)
    return (sum(rows.stop - rows.start for _, rows in links.sends),
            sum(h for _, _, h in links.recvs))


class Links(NamedTuple):
    """This rank's halo traffic: sends [(peer, local rows)], receives [(peer, first global
    position, length)], in ascending position order; none of length 0."""

    sends: List[Tuple[int, slice]]
    recvs: List[Tuple[int, int, int]]


@lru_cache(maxsize=1024)
def _links(layout: str, rank: int, world: int, S: int, key) -> Links:
    reach = _slab_reach(layout, S, world, key)
    if layout == "contiguous":
        sends = [(rank + 1, S, (rank + 1) * S)] if rank + 1 < world else []
        recvs = [(rank - 1, rank * S)] if rank > 0 else []
    else:  # zigzag: chunks rank (rows [0, c)) and 2P-1-rank (rows [c, 2c))
        c, last = S // 2, 2 * world - 1
        sends = ([(rank + 1, c, (rank + 1) * c)] if rank + 1 < world else []) \
            + ([(rank - 1, 2 * c, (last + 1 - rank) * c)] if rank > 0 else [])
        recvs = ([(rank - 1, rank * c)] if rank > 0 else []) \
            + ([(rank + 1, (last - rank) * c)] if rank + 1 < world else [])
    # a send: the last reach(p) rows before local row `end`, for the slab starting at p
    return Links([(peer, slice(end - reach[p], end)) for peer, end, p in sends if reach[p]],
                 [(peer, p - reach[p], reach[p]) for peer, p in recvs if reach[p]])


@lru_cache(maxsize=1024)
def _halo_plan(layout: str, rank: int, S: int, world: int, key, bands: bool):
    """[(samples, block)] of the local queries against the received halo tokens (in the
    order of Links.recvs, concatenated); bands for a kernel that takes windows."""
    window, docs = key
    q_pos = rank_positions(S * world, rank, world, layout)
    k_pos = torch.cat([torch.arange(p, p + h)
                       for _, p, h in _links(layout, rank, world, S, key).recvs])
    return [(b, blk) for b, cu in sample_bounds(docs, S * world)
            for blk in doc_plan(cu, q_pos, k_pos, True, window, bands)]


def _halo_kv(k, v, links: Links, group, phase: str):
    """One (2, B, h, Hkv, D) buffer per receive being filled with its peer's K,V tail, and
    the requests (a NoComm group: local rows stand in, nothing moves)."""
    sends = [(p, torch.stack((k[:, rows], v[:, rows]))) for p, rows in links.sends]
    if isinstance(group, NoComm):
        return [torch.stack((k[:, :h], v[:, :h])) for _, _, h in links.recvs], []
    recvs = [(p, torch.empty((2, k.shape[0], h, *k.shape[2:]), dtype=k.dtype,
                             device=k.device)) for p, _, h in links.recvs]
    return [t for _, t in recvs], exchange(group, sends, recvs, phase)


def halo_forward(q, k, v, group, causal, layout, scale, kernel, mask, sinks=None):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32): the local blocks, then the halo's."""
    (rank, world), S, key = group_rank_and_size(group), q.shape[1], mask_key(mask)
    links = _links(layout, rank, world, S, key)
    bufs, reqs = _halo_kv(k, v, links, group, "fwd")
    out, lse = empty_accumulators(q)
    bands = banded(kernel, q)
    for b, blk in step_plan(layout, causal, rank, rank, S, world, mask, bands):
        forward_block_(kernel, q, k, v, blk, scale, out, lse, b)
    wait_all(reqs)
    if bufs:
        halo = torch.cat(bufs, dim=2)  # (2, B, received tokens, Hkv, D)
        for b, blk in _halo_plan(layout, rank, S, world, key, bands):
            forward_block_(kernel, q, halo[0], halo[1], blk, scale, out, lse, b)
    return finish(out, lse, q.dtype, sinks)


def halo_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel, mask,
                  grad_dtype: torch.dtype = torch.float32):
    """(dq, dk, dv): the halo K,V come again, their dK,dV go back to where they came from
    in `grad_dtype` (the ring's ring_grad_dtype; summed in fp32 on both sides)."""
    (rank, world), S, key = group_rank_and_size(group), q.shape[1], mask_key(mask)
    links = _links(layout, rank, world, S, key)
    bufs, reqs = _halo_kv(k, v, links, group, "bwd")
    rows = QueryRows(dout.contiguous(), q, out, lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
    bands = banded(kernel, q)
    for b, blk in step_plan(layout, causal, rank, rank, S, world, mask, bands):
        qs, ks, g = backward_block(kernel, rows, k, v, blk, scale, b)
        dq[b, qs] += g[0]
        dkv[0, b, ks] += g[1]
        dkv[1, b, ks] += g[2]
    wait_all(reqs)
    sends = []
    if bufs:
        halo = torch.cat(bufs, dim=2)
        dhalo = torch.zeros(halo.shape, dtype=torch.float32, device=q.device)
        for b, blk in _halo_plan(layout, rank, S, world, key, bands):
            qs, ks, g = backward_block(kernel, rows, halo[0], halo[1], blk, scale, b)
            dq[b, qs] += g[0]
            dhalo[0, b, ks] += g[1]
            dhalo[1, b, ks] += g[2]
        # Each received tail's dK,dV back to its sender, in the order they arrived.
        starts = [0]
        for _, _, h in links.recvs:
            starts.append(starts[-1] + h)
        sends = [(p, dhalo[:, :, a:e].to(grad_dtype).contiguous())
                 for (p, _, _), a, e in zip(links.recvs, starts, starts[1:])]
    recvs = [(p, torch.zeros((2, k.shape[0], r.stop - r.start, *k.shape[2:]),
                             dtype=grad_dtype, device=q.device)) for p, r in links.sends]
    wait_all(exchange(group, sends, recvs, "bwd"))
    if not isinstance(group, NoComm):
        for (_, local_rows), (_, got) in zip(links.sends, recvs):
            dkv[:, :, local_rows] += got
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
