"""The lightning indexer of DeepSeek sparse attention over a CP group, streamed.

    I[s, t] = sum_h w[s, h] * relu(scale * q_h(s) . k(t))     (DeepseekV32Indexer, fp32)

The indexer keys (B, s, D) travel (dsa_stream: the ring, or one all-gather); each rank
scores its queries against each arriving block in tiles (dsa_pairs.dense_tiles: causal and
document masks, invisible tiles skipped) and folds every tile into a running top-k per
query, so no rank holds more than (local queries x top_k) of state plus one tile of
scores: never the (local queries x n) matrix.

Ties. The running top-k keeps each candidate as one int64 key: the score's fp32 bits in
an order-preserving int32 (high half) and n - 1 - position (low half), so torch.topk of
the keys is the top-k by score descending, then position ascending: a total order,
hence the exact top-k of the union whatever order the blocks arrive in. torch.topk on a
whole fp32 row (transformers) documents no order among equal scores; both agree whenever
the k-th and (k+1)-th scores of a row differ. -0.0 counts as 0.0; invisible keys (-inf)
come last and are returned as -1.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .dsa_pairs import Positions, Tile, dense_tiles, pair_dot, tile_keys

_LOW = (1 << 32) - 1


def tile_index_scores(index_q: torch.Tensor, index_weights: torch.Tensor,
                      index_k: torch.Tensor, tile: Tile, scale: float, tp_group=None
                      ) -> torch.Tensor:
    """I of a tile, (B, Q, K) fp32 (no mask); summed over TP's heads when the indexer
    heads are split (tp_group). Not differentiable (in-place ReLU): its callers run under
    no_grad (the top-k, dsa_loss's passes)."""
    keys = tile_keys(index_k, tile).float()
    dots = pair_dot(index_q[:, tile.qs].float(), keys).mul_(scale).relu_()  # (B, Q, Hi, K)
    scores = torch.einsum("bqh,bqhk->bqk", index_weights[:, tile.qs].float(), dots)
    if tp_group is not None:
        dist.all_reduce(scores, group=tp_group)
    return scores


def _ordered_bits(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 in the same order (IEEE bits, negatives flipped); -0.0 = 0.0."""
    bits = (scores + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


_FLOOR = int(_ordered_bits(torch.tensor(float("-inf"))))  # an invisible key's high half


def ordered_keys(scores: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """int64 keys whose order is (score descending, position ascending); scores fp32."""
    return (_ordered_bits(scores) << 32) + (n - 1 - positions)


def decode_positions_(keys: torch.Tensor, n: int) -> torch.Tensor:
    """The positions of ordered_keys, -1 where the score was -inf (invisible), in place
    (the keys are the largest thing the top-k holds: no copy of them)."""
    invisible = keys < ((_FLOOR + 1) << 32)
    return keys.bitwise_and_(_LOW).neg_().add_(n - 1).masked_fill_(invisible, -1)


class RunningTopK:
    """The top-k keys so far of every local query: (B, s, k) int64, -inf to start."""

    def __init__(self, batch: int, s: int, k: int, n: int, device):
        self.keys = torch.full((batch, s, k), _FLOOR << 32, dtype=torch.int64, device=device)
        self.n = n

    def add(self, tile: Tile, scores: torch.Tensor, key_pos: torch.Tensor) -> None:
        """Fold a dense tile's scores (B, Q, K) at key positions key_pos (K,) in."""
        scores = scores.masked_fill(~tile.valid, float("-inf"))
        new = ordered_keys(scores, key_pos.expand_as(scores), self.n)
        run = self.keys[:, tile.qs]
        if not (new > run.min(-1, keepdim=True).values).any():
            return  # nothing here beats any row's k-th: no merge
        both = torch.cat((run, new.expand(run.shape[0], -1, -1)), dim=-1)
        self.keys[:, tile.qs] = both.topk(run.shape[-1], dim=-1, sorted=False).values

    def positions(self) -> torch.Tensor:
        """(B, s, k) int64 positions by score descending, -1 = none; the keys are spent."""
        keys, self.keys = self.keys, None
        keys = keys.sort(dim=-1, descending=True).values  # merges keep no order
        return decode_positions_(keys, self.n)


def topk_visit(index_q, index_weights, pos: Positions, rank: int, topk: RunningTopK,
               scale: float, q_tile: int, k_tile: int, tp_group=None):
    """The visit of stream_blocks that scores a block of indexer keys and folds it in."""
    def visit(src: int, blocks) -> None:
        for tile in dense_tiles(pos, rank, src, q_tile, k_tile):
            scores = tile_index_scores(index_q, index_weights, blocks[0], tile, scale,
                                       tp_group)
            topk.add(tile, scores, pos.pos[src][tile.ks])
    return visit


def tile_sizes(s: int, heads: int, k: int, budget: Optional[int]) -> tuple:
    """(query rows, key rows) of a tile: the per-head products (Q, Hi, K) within `budget`
    elements (default 2**20: 4 MiB fp32), counting at least 8 heads (a tile's merge holds
    a few (Q, K) int64 keys); keys at least top_k wide (each merge is a top-k of k + K
    candidates, cheaper per candidate the wider K is) and at most 4096 unless top_k is
    more."""
    budget, heads = budget or 1 << 20, max(heads, 8)
    k_tile = max(k, min(4096, budget // heads))
    q_tile = max(1, min(s, budget // (heads * k_tile)))
    return q_tile, k_tile
