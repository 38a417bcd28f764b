"""DeepSeek-V4's lightning indexer over compressed keys (CSA's), over a CP group.

    indices = csa_indexer(IndexerInputs(q, weights, kv, gate, position_bias, norm_weight),
                          compress_rate=4, index_topk=512, entry_rope=rope,
                          cp_group=g, layout="zigzag")           # (B, S, k) int64, -1 = none

Each local query at global position t scores every compressed key w it can see
(w < (t + 1) // m: the window is closed, as transformers' ``causal_threshold``)

    I[t, w] = sum_h weights[t, h] * relu(scale * q_h(t) . K_w)     (fp32)

(transformers' ``DeepseekV4IndexerScorer``: relu(q . K) * scale, the same numbers for a
positive scale) and keeps the top ``index_topk`` (``DeepseekV4Indexer``). The keys K_w are
the indexer's own compressed entries: CSA's overlapping compressor (two series, 2m slots)
at index_head_dim with its own weights, RoPE at w * m.

Under CP the keys are made by the ranks that end their windows and **all-gathered**
(compressor.compressed_entries, the same path as the attention's entries): every query
scores every earlier key, so every rank needs all earlier keys anyway, and there are only
n / m of them (index_head_dim numbers per m tokens: 32 a token at V4's 128 / 4), so one
collective beats P - 1 dependent ring steps and the top-k is then local and exact: the
running top-k of DSA's indexer (dsa_indexer.RunningTopK) over tiles of (local queries) x
(visible keys), so no rank holds more than one tile of scores. Order: score descending,
ties by lower entry; torch.topk (transformers) documents no order among equal scores, so
the two agree whenever a row's k-th and (k+1)-th scores differ. A query that sees fewer
than top_k keys gets -1 in the remaining slots, where transformers' topk picked -inf
keys and replaced them by -1: the same tensor.

With packed documents a query scores only its own document's visible keys
(compressed_windows.entry_ranges: lo <= w < hi). Under TP (``tp_group``) each rank holds
its share of the indexer's heads (q, weights) and the partial scores are all-reduced over
TP before the top-k (DSA's ``tile_index_scores``); the keys are replicated.

No gradient. The indices are discrete, so nothing of the main loss reaches the indexer's
weights (transformers: the same; they get no gradient), and transformers' DeepSeek-V4
trains the indexer with no loss of its own (no KL as DeepSeek-V3.2's, dsa_loss.py): this
runs under no_grad, and its keys' halo and gather have no backward.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .arguments import world_group
from .comm import group_rank_and_size
from .compressed_windows import entry_ranges, split_samples
from .compressor import COMPRESS_LAYOUTS, check_compressor, check_slabs, compressed_entries
from .documents import check_cu_seqlens
from .dsa_indexer import RunningTopK, tile_index_scores, tile_sizes
from .dsa_pairs import Tile
from .kernels import default_scale
from .layouts import rank_positions


class IndexerInputs(NamedTuple):
    """The indexer's tensors of this rank's tokens (transformers' DeepseekV4Indexer)."""

    q: torch.Tensor              # (B, S, Hi, Di) q_b_proj(q_residual) per head, RoPE applied
    weights: torch.Tensor        # (B, S, Hi) scorer.weights_proj(h).float() * Hi ** -0.5
    kv: torch.Tensor             # (B, S, 2 Di) its compressor's kv_proj(h)
    gate: torch.Tensor           # (B, S, 2 Di) gate_proj(h)
    position_bias: torch.Tensor  # (m, 2 Di)
    norm_weight: torch.Tensor    # (Di,) kv_norm.weight


def check_indexer(indexer, batch_seq: Optional[tuple], m, top_k, layout: str, world: int,
                  caller: str):
    """Local checks of the indexer's arguments (rank-independent ValueError, one line);
    batch_seq (B, S) of the main q, or None: the indexer's q's."""
    if not isinstance(indexer, IndexerInputs):
        raise ValueError(f"{caller}: indexer must be an IndexerInputs, got "
                         f"{type(indexer).__name__}")
    q, w = indexer.q, indexer.weights
    batch_seq = tuple(q.shape[:2]) if batch_seq is None else tuple(batch_seq)
    for name, v in (("compress_rate", m), ("index_topk", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{caller}: {name}={v!r} must be a positive integer")
    if layout not in COMPRESS_LAYOUTS:
        raise ValueError(f"{caller}: layout={layout!r} must be one of "
                         f"{list(COMPRESS_LAYOUTS)} (a compressed window needs consecutive "
                         "tokens on a rank)")
    if q.dim() != 4 or tuple(q.shape[:2]) != batch_seq \
            or tuple(w.shape) != (*batch_seq, q.shape[2]):
        raise ValueError(f"{caller}: indexer q (batch, local_seq, index_heads, "
                         f"index_head_dim) and weights (batch, local_seq, index_heads) for "
                         f"{tuple(batch_seq)} expected, got {tuple(q.shape)}, "
                         f"{tuple(w.shape)}")
    Di = q.shape[-1]
    check_compressor(indexer[2:], batch_seq, m, 2 * Di, Di, "index_", caller)
    if layout == "zigzag" and batch_seq[1] % 2:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq, got "
                         f"{batch_seq[1]}")
    check_slabs(layout, batch_seq[1], m, world, True, caller)


def entry_topk(index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor,
               lo: torch.Tensor, hi: torch.Tensor, top_k: int, scale: float,
               tile_budget: Optional[int] = None, tp_group=None) -> torch.Tensor:
    """(B, S, min(top_k, T)) int64: each query's top-k visible keys of keys (B, T, Di)
    (entry ids, score descending, -1 = none); query i sees the keys lo[i] <= w < hi[i]
    (compressed_windows.entry_ranges). tp_group: the indexer's heads are split over it
    (each rank's partial scores all-reduced before the top-k)."""
    B, S, Hi, _ = index_q.shape
    T = keys.shape[1]
    k = min(top_k, T)
    topk = RunningTopK(B, S, k, T, keys.device)
    lo, hi = lo.to(keys.device), hi.to(keys.device)
    q_tile, k_tile = tile_sizes(S, Hi, k, tile_budget)
    for q0 in range(0, S, q_tile):
        qs = slice(q0, min(q0 + q_tile, S))
        k_begin, k_end = (int(lo[qs].min()), int(hi[qs].max())) if S else (0, 0)
        for k0 in range(k_begin, k_end, k_tile):
            key_pos = torch.arange(k0, min(k0 + k_tile, k_end), device=keys.device)
            tile = Tile(qs, slice(k0, k0 + len(key_pos)), None,
                        ((key_pos[None, :] >= lo[qs][:, None])
                         & (key_pos[None, :] < hi[qs][:, None]))[None])   # (1, Q, K)
            topk.add(tile, tile_index_scores(index_q, index_weights, keys, tile, scale,
                                             tp_group), key_pos)
    return topk.positions()


def csa_indexer(indexer: IndexerInputs, *, compress_rate: int, index_topk: int,
                entry_rope: Callable, cp_group=None, layout: str = "contiguous",
                norm_eps: float = 1e-6, index_softmax_scale: Optional[float] = None,
                tile_budget: Optional[int] = None, cu_seqlens=None,
                reset_positions: bool = True, tp_group=None) -> torch.Tensor:
    """The indexer's top-k of this rank's queries (module docstring): (B, S, min(top_k,
    N)) int64 global entry ids, -1 beyond a query's visible count, N the sequence's entry
    count. entry_rope as hca_attention's (the compressor's RoPE, at index_head_dim here);
    index_softmax_scale defaults to index_head_dim ** -0.5
    (DeepseekV4IndexerScorer.softmax_scale). cu_seqlens: packed documents, the same for
    every sample (one int32 tensor of the full sequence's boundaries; csa_attention runs
    samples with different documents one by one): keys and visibility per document
    (compressed_windows.py), reset_positions as hca_attention's. tp_group: the group the
    indexer's heads (q, weights) are split over, or None (all heads here)."""
    caller = "csa_indexer"
    group = world_group(cp_group)
    rank, world = group_rank_and_size(group)
    check_indexer(indexer, None, compress_rate, index_topk, layout, world, caller)
    B, S = indexer.q.shape[:2]
    docs = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, S * world, B, caller)
    if split_samples(docs):
        raise ValueError(f"{caller}: cu_seqlens must be the same for every sample (call it "
                         "per sample otherwise: csa_attention does)")
    cu = None if docs is None else docs[0]
    scale = default_scale(indexer.q.shape[-1]) if index_softmax_scale is None \
        else float(index_softmax_scale)
    with torch.no_grad():
        keys = compressed_entries(*indexer[2:], norm_eps, compress_rate, entry_rope,
                                  layout, group, overlap=True, caller=caller, cu=cu,
                                  reset_positions=reset_positions)
        lo, hi = entry_ranges(cu, rank_positions(S * world, rank, world, layout),
                              compress_rate)
        return entry_topk(indexer.q, indexer.weights, keys, lo, hi, index_topk, scale,
                          tile_budget, tp_group)
