"""Which (query, key) pairs DeepSeek sparse attention (DSA) computes, tile by tile.

Every DSA pass (the indexer's top-k, the sparse attention, the indexer's losses) walks
the blocks of keys that reach a rank (the ring's, or the all-gather's slots) and, inside
each, tiles of pairs:

dense tiles     (query rows) x (key rows) of the block, with the causal and document mask
                as a bool tile: the indexer's scores and the warm-up loss see every
                visible key. A tile with no visible pair is skipped.
selected tiles  per query, only its selected keys that sit in the visiting block, gathered
                (``Selection``): the sparse attention and the sparse-stage loss. Each
                query's selection is sorted by (owner rank, row) once, so a block's keys
                of a query are one run; a tile gathers max-over-its-queries of them (the
                rest padded and masked). A block none of the tile's queries selected is
                skipped, no compute.

A tile hands its keys to ``pair_dot`` / ``pair_values`` either shared by its queries
(dense: (B, K, C)) or per query (selected: (B, Q, K, C)); ``scatter_keys_`` adds a key
gradient back the same way.
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Optional

import torch

from .documents import doc_ids
from .layouts import rank_positions


class Positions:
    """Global positions and document ids of every rank's tokens under one layout.

    pos[r] (s,) ascending; owner/row (n,): which rank holds position t, at which row;
    docs (Bd, n) the document id per position, Bd = 1 when the batch shares boundaries.
    """

    def __init__(self, s: int, world: int, layout: str, cus: Optional[List[torch.Tensor]],
                 device):
        n = s * world
        self.s, self.world, self.n = s, world, n
        self.pos = [rank_positions(n, r, world, layout, device) for r in range(world)]
        self.owner = torch.empty(n, dtype=torch.long, device=device)
        self.row = torch.empty(n, dtype=torch.long, device=device)
        for r, p in enumerate(self.pos):
            self.owner[p] = r
            self.row[p] = torch.arange(s, device=device)
        everything = torch.arange(n, device=device)
        if cus is None or all(torch.equal(cu, cus[0]) for cu in cus):
            cus = None if cus is None else cus[:1]
        self.docs = torch.zeros(1, n, dtype=torch.long, device=device) if cus is None \
            else torch.stack([doc_ids(cu.to(device), everything) for cu in cus])

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(Bd, Q, K) bool: key at k_pos is earlier (or the same) and in the query's document."""
        causal = k_pos[None, None, :] <= q_pos[None, :, None]
        return causal & (self.docs[:, q_pos, None] == self.docs[:, None, k_pos])


class Tile(NamedTuple):
    """Query rows qs of this rank against keys of the visiting block.

    rows None: dense, key rows ks, valid (Bd, Q, K). Else selected: rows (B, Q, K) key rows
    of the block per query (0 where padded), valid (B, Q, K)."""

    qs: slice
    ks: Optional[slice]
    rows: Optional[torch.Tensor]
    valid: torch.Tensor


def dense_tiles(pos: Positions, rank: int, src: int, q_tile: int, k_tile: int
                ) -> Iterator[Tile]:
    """The visible tiles of (rank's queries) x (src's keys), causal and documents."""
    qp, kp = pos.pos[rank], pos.pos[src]
    for q0 in range(0, pos.s, q_tile):
        qs = slice(q0, min(q0 + q_tile, pos.s))
        last = int(qp[qs.stop - 1])
        k_end = int(torch.searchsorted(kp, last, right=True))  # keys after every query: none
        for k0 in range(0, k_end, k_tile):
            ks = slice(k0, min(k0 + k_tile, k_end))
            valid = pos.visible(qp[qs], kp[ks])
            if valid.any():
                yield Tile(qs, ks, None, valid)


class Selection:
    """A (B, s, k) selection of global positions (-1 = none) arranged for the blocks.

    Entries that are invisible (later than the query, another document) or -1 are dropped
    (DeepseekV32Attention ANDs the selection with its mask). Per query the rest is sorted
    by (owner, row); counts (B, s, P) and starts (B, s, P) say where owner p's run is.
    """

    def __init__(self, indices: torch.Tensor, pos: Positions, rank: int):
        B, s, k = indices.shape
        n, P = pos.n, pos.world
        idx = indices.clamp(0, n - 1)
        qp = pos.pos[rank]
        ok = (indices >= 0) & (indices < n) & (idx <= qp[None, :, None])
        d = pos.docs.expand(B, n)
        ok &= torch.gather(d, 1, idx.flatten(1)).view(B, s, k) == d[:, qp, None]
        key = torch.where(ok, pos.owner[idx] * s + pos.row[idx], P * s)  # dropped: last
        key, _ = key.sort(dim=-1)
        self.rows = key % s                                                # (B, s, k)
        owner = key // s                                                   # P = dropped
        self.counts = torch.stack([(owner == p).sum(-1) for p in range(P)], dim=-1)
        self.starts = self.counts.cumsum(-1) - self.counts                 # (B, s, P)
        self.k = k

    def pairs(self) -> int:
        return int(self.counts.sum())

    def tiles(self, src: int, q_tile: int) -> Iterator[Tile]:
        """The tiles of the selected keys of block `src`; nothing when none selected there."""
        s = self.rows.shape[1]
        for q0 in range(0, s, q_tile):
            qs = slice(q0, min(q0 + q_tile, s))
            counts = self.counts[:, qs, src]
            width = int(counts.max())
            if width == 0:
                continue
            j = torch.arange(width, device=counts.device)
            valid = j < counts[..., None]                                  # (B, Q, K)
            cols = (self.starts[:, qs, src, None] + j).clamp(max=self.k - 1)
            rows = torch.gather(self.rows[:, qs], 2, cols).masked_fill(~valid, 0)
            yield Tile(qs, None, rows, valid)


def tile_keys(x: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The tile's keys from a block x (B, s, C): (B, K, C) dense, (B, Q, K, C) selected."""
    if tile.rows is None:
        return x[:, tile.ks]
    B, Q, K = tile.rows.shape
    return x.flatten(0, 1).index_select(0, _flat_rows(tile.rows, x.shape[1])).view(B, Q, K, -1)


def _flat_rows(rows: torch.Tensor, s: int) -> torch.Tensor:
    """(B, Q, K) rows of a (B, s, C) block -> rows of its (B s, C) flattening, (B Q K,)."""
    offsets = torch.arange(rows.shape[0], device=rows.device) * s
    return (rows + offsets[:, None, None]).flatten()


def pair_dot(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries (B, Q, H, C) . keys (B, K, C) or (B, Q, K, C) -> (B, Q, H, K)."""
    if keys.dim() == 3:
        return torch.einsum("bqhc,bkc->bqhk", queries, keys)
    return torch.einsum("bqhc,bqkc->bqhk", queries, keys)


def pair_values(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """weights (B, Q, H, K) x keys (B, K, C) or (B, Q, K, C) -> (B, Q, H, C)."""
    if keys.dim() == 3:
        return torch.einsum("bqhk,bkc->bqhc", weights, keys)
    return torch.einsum("bqhk,bqkc->bqhc", weights, keys)


def key_grad(weights: torch.Tensor, queries: torch.Tensor, dense: bool) -> torch.Tensor:
    """sum over heads (and, dense, queries) of weights (B, Q, H, K) x queries (B, Q, H, C):
    (B, K, C) dense, (B, Q, K, C) selected."""
    if dense:
        return torch.einsum("bqhk,bqhc->bkc", weights, queries)
    return torch.einsum("bqhk,bqhc->bqkc", weights, queries)


def scatter_keys_(grad: torch.Tensor, tile: Tile, g: torch.Tensor) -> None:
    """grad (B, s, C) fp32 += the tile's key gradient g (key_grad's shape) at its rows."""
    if tile.rows is None:
        grad[:, tile.ks] += g
        return
    grad.view(-1, g.shape[-1]).index_add_(0, _flat_rows(tile.rows, grad.shape[1]),
                                          g.flatten(0, 2))
