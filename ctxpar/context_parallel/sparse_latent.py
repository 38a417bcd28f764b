"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5) over a CP group: the entry points.

    indices = indexer_topk(index_q, index_k, index_weights, top_k, comm="ring",
                           cp_group=g, layout="zigzag", cu_seqlens=cu)      # (B, s, k) int64
    out, lse = sparse_latent_attention(q, latent, kv_b_proj.weight, dims, indices,
                                       comm="ring", cp_group=g, layout="zigzag",
                                       cu_seqlens=cu, softmax_scale=scaling, return_lse=True)
    kl = indexer_kl("sparse", q, latent, kv_b_proj.weight, dims, lse, index_q, index_k,
                    index_weights, indices, comm="ring", cp_group=g, layout="zigzag")

Shapes (s = this rank's tokens, n = s x P): q (B, s, H, dn + dr), latent (B, s, R + dr)
as latent_attention (latent_api.py); index_q (B, s, Hi, D), index_k (B, s, D),
index_weights (B, s, Hi) = weights_proj(x) * Hi ** -0.5, RoPE applied by the caller
(DeepseekV32Indexer's inputs). indices: global positions, -1 = none.

What travels (docs/parallelism.md, "DeepSeek sparse attention"): the indexer pass moves
the indexer keys (D a token), the attention pass the latent (R + dr), the loss pass both;
comm="ring" block by block over the P2P ring, comm="allgather" gathered once. Ulysses is
refused: the indexer sums all its heads per token and a query's top-k spans the whole
sequence, so splitting heads leaves every rank the whole sequence to score. DSA is
causal; documents by cu_seqlens; windows, chunks and sinks are not part of it.
Every argument is checked before any communication (one ValueError line, every rank).
"""
from __future__ import annotations

from typing import Optional

import torch

from .arguments import world_group
from .comm import group_rank_and_size
from .documents import check_cu_seqlens
from .dsa_attention import SparseLatentCore, absorb, values_out
from .dsa_indexer import RunningTopK, tile_sizes, topk_visit
from .dsa_loss import IndexerKL, _Pass, main_topk_recall
from .dsa_pairs import Positions, Selection, dense_tiles
from .dsa_stream import stream_blocks
from .kernels import default_scale
from .latent import LatentDims
from .latent_api import _check_inputs as check_latent_inputs
from .layouts import check_layout

DSA_STAGES = ("frozen", "dense_warmup", "sparse")
DSA_COMMS = ("ring", "allgather")


def _check_common(caller, comm, layout, s, cp_group, batch, cu_seqlens, device):
    """comm, layout and documents, locally; returns (group, Positions, rank)."""
    if comm not in DSA_COMMS:
        raise ValueError(f"{caller}: comm={comm!r} is not supported; choose one of "
                         f"{list(DSA_COMMS)} (the indexer sums every head per token and a "
                         "query's top-k spans the whole sequence: Ulysses' head split "
                         "buys nothing)")
    check_layout(layout)
    group = world_group(cp_group)
    rank, world = group_rank_and_size(group)
    if layout == "zigzag" and s % 2:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq, got {s}")
    cus = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, s * world, batch,
                                                           caller)
    return group, Positions(s, world, layout, cus, device), rank


def _check_indexer(caller, index_q, index_k, index_weights):
    for name, t, nd, what in (("index_q", index_q, 4, "(batch, local_seq, index_heads, "
                                                      "index_head_dim)"),
                              ("index_k", index_k, 3, "(batch, local_seq, index_head_dim)"),
                              ("index_weights", index_weights, 3,
                               "(batch, local_seq, index_heads)")):
        if not isinstance(t, torch.Tensor) or t.dim() != nd or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{caller}: {name} must be a {nd}-D float tensor {what}, "
                             f"got {shape}")
    B, s, Hi, D = index_q.shape
    if index_k.shape != (B, s, D) or index_weights.shape != (B, s, Hi):
        raise ValueError(f"{caller}: index_k {tuple(index_k.shape)} and index_weights "
                         f"{tuple(index_weights.shape)} must be {(B, s, D)} and "
                         f"{(B, s, Hi)} for index_q {tuple(index_q.shape)}")


def _check_top_k(caller, top_k):
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0:
        raise ValueError(f"{caller}: top_k={top_k!r} must be a positive integer")


def indexer_topk(index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor,
                 top_k: int, *, comm: str = "ring", cp_group=None, tp_group=None,
                 layout: str = "contiguous", cu_seqlens=None,
                 index_softmax_scale: Optional[float] = None,
                 tile_budget: Optional[int] = None) -> torch.Tensor:
    """(B, s, min(top_k, n)) int64: the global positions of each local query's top-k
    visible keys by DeepseekV32Indexer's score, descending, ties to the lower position
    (dsa_indexer.py); -1 past a query's visible count. tp_group: index_q and
    index_weights hold this TP rank's indexer heads (scores all-reduced per tile).
    tile_budget: elements of one tile's per-head products (default 2**20)."""
    caller = "indexer_topk"
    _check_indexer(caller, index_q, index_k, index_weights)
    _check_top_k(caller, top_k)
    B, s, Hi, D = index_q.shape
    group, pos, rank = _check_common(caller, comm, layout, s, cp_group, B,
                                     cu_seqlens, index_q.device)
    scale = default_scale(D) if index_softmax_scale is None else float(index_softmax_scale)
    k = min(top_k, pos.n)
    q_tile, k_tile = tile_sizes(s, Hi, k, tile_budget)
    with torch.no_grad():
        topk = RunningTopK(B, s, k, pos.n, index_q.device)
        stream_blocks((index_k,), group, comm,
                      topk_visit(index_q, index_weights, pos, rank, topk, scale, q_tile,
                                 k_tile, tp_group))
        return topk.positions()


def _check_indices(caller, indices, q):
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 \
            or indices.shape[:2] != q.shape[:2] or indices.dtype not in (torch.int64,
                                                                          torch.int32):
        shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else indices
        raise ValueError(f"{caller}: indices must be an int64 (batch, local_seq, top_k) "
                         f"tensor of global positions for q {tuple(q.shape[:2])}, got "
                         f"{shape}")


def _q_tile(s, heads, width, budget):
    """Query rows per tile: (Q, K, R + dr) gathered rows and (Q, H, K) scores in budget."""
    return max(1, min(s, (budget or 1 << 20) // (max(width, 1) * heads)))


def sparse_latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
                            dims: LatentDims, indices: torch.Tensor, *, comm: str = "ring",
                            cp_group=None, layout: str = "contiguous", cu_seqlens=None,
                            softmax_scale: Optional[float] = None, return_lse: bool = False,
                            tile_budget: Optional[int] = None):
    """MLA of each local query over its selected, visible keys (DeepseekV32Attention's
    eager result): out (B, s, H, dv) in q's dtype, and with return_lse lse (B, H, s) fp32.
    Gradients to q, latent, kv_b_weight (its this-rank share, as latent_attention)."""
    caller = "sparse_latent_attention"
    check_latent_inputs(q, latent, kv_b_weight, dims, "ring", layout, 1, caller)
    _check_indices(caller, indices, q)
    B, s, H, _ = q.shape
    group, pos, rank = _check_common(caller, comm, layout, s, cp_group, B, cu_seqlens,
                                     q.device)
    scale = default_scale(dims.qk_head_dim) if softmax_scale is None else float(softmax_scale)
    sel = Selection(indices.long(), pos, rank)
    q_tile = _q_tile(s, H + dims.latent_dim, indices.shape[-1], tile_budget)
    qa = absorb(q, kv_b_weight, dims)
    o, lse = SparseLatentCore.apply(qa, latent, sel, group, comm, dims.kv_lora_rank, scale,
                                    q_tile)
    out = values_out(o, kv_b_weight, dims)
    return (out, lse) if return_lse else out


def indexer_kl(stage: str, q, latent, kv_b_weight, dims: LatentDims, main_lse, index_q,
               index_k, index_weights, indices=None, *, comm: str = "ring", cp_group=None,
               tp_group=None, layout: str = "contiguous", cu_seqlens=None,
               softmax_scale: Optional[float] = None,
               index_softmax_scale: Optional[float] = None,
               tile_budget: Optional[int] = None) -> torch.Tensor:
    """KL(p || softmax(I)) per local query, (B, s) fp32 (dsa_loss.py): 'dense_warmup' over
    every visible key (main_lse the dense MLA's), 'sparse' over the selected ones
    (main_lse the sparse attention's). Gradients to index_q, index_k, index_weights only.
    tp_group: q/kv_b_weight/main_lse and index_q/index_weights hold this TP rank's heads."""
    caller = "indexer_kl"
    if stage not in ("dense_warmup", "sparse"):
        raise ValueError(f"{caller}: stage={stage!r}; the indexer loss has stages "
                         "'dense_warmup' and 'sparse' ('frozen' trains no indexer)")
    check_latent_inputs(q, latent, kv_b_weight, dims, "ring", layout, 1, caller)
    _check_indexer(caller, index_q, index_k, index_weights)
    B, s, H, _ = q.shape
    if index_q.shape[:2] != (B, s) or not isinstance(main_lse, torch.Tensor) \
            or main_lse.shape != (B, H, s):
        raise ValueError(f"{caller}: main_lse must be (batch, heads, local_seq) = "
                         f"{(B, H, s)} and index_q's tokens {(B, s)}, got "
                         f"{tuple(getattr(main_lse, 'shape', ()))} and "
                         f"{tuple(index_q.shape[:2])}")
    if stage == "sparse":
        if indices is None:
            raise ValueError(f"{caller}: stage 'sparse' needs the indices of indexer_topk")
        _check_indices(caller, indices, q)
    group, pos, rank = _check_common(caller, comm, layout, s, cp_group, B,
                                     cu_seqlens, q.device)
    tp = 1 if tp_group is None else group_rank_and_size(tp_group)[1]
    scale = default_scale(dims.qk_head_dim) if softmax_scale is None else float(softmax_scale)
    index_scale = default_scale(index_q.shape[-1]) if index_softmax_scale is None \
        else float(index_softmax_scale)
    width = H + index_q.shape[2] + dims.latent_dim
    if stage == "sparse":
        sel = Selection(indices.long(), pos, rank)
        q_tile = _q_tile(s, width, indices.shape[-1], tile_budget)
        tiles = lambda src: sel.tiles(src, q_tile)  # noqa: E731
    else:
        q_tile, k_tile = tile_sizes(s, width, 256, tile_budget)
        tiles = lambda src: dense_tiles(pos, rank, src, q_tile, k_tile)  # noqa: E731
    with torch.no_grad():
        qa = absorb(q.detach(), kv_b_weight.detach(), dims)
    return IndexerKL.apply(index_q, index_k, index_weights, qa, latent.detach(),
                           main_lse.detach(), tiles, group, comm, scale, index_scale, H * tp,
                           tp_group)


def indexer_recall(q, latent, kv_b_weight, dims: LatentDims, main_lse, indices, top_k: int,
                   *, comm: str = "ring", cp_group=None, tp_group=None,
                   layout: str = "contiguous", cu_seqlens=None,
                   softmax_scale: Optional[float] = None,
                   tile_budget: Optional[int] = None) -> torch.Tensor:
    """(B, s) fp32, no gradient: per local query, the share of the dense main attention's
    top_k keys (by p, summed over heads; main_lse the dense MLA's, latent_attention's)
    that `indices` selected: the indexer's recall, a metric (one more pass of the latent)."""
    caller = "indexer_recall"
    check_latent_inputs(q, latent, kv_b_weight, dims, "ring", layout, 1, caller)
    _check_indices(caller, indices, q)
    _check_top_k(caller, top_k)
    B, s, H, _ = q.shape
    if not isinstance(main_lse, torch.Tensor) or main_lse.shape != (B, H, s):
        raise ValueError(f"{caller}: main_lse must be (batch, heads, local_seq) = "
                         f"{(B, H, s)}, got {tuple(getattr(main_lse, 'shape', ()))}")
    group, pos, rank = _check_common(caller, comm, layout, s, cp_group, B,
                                     cu_seqlens, q.device)
    tp = 1 if tp_group is None else group_rank_and_size(tp_group)[1]
    scale = default_scale(dims.qk_head_dim) if softmax_scale is None else float(softmax_scale)
    q_tile, k_tile = tile_sizes(s, H + dims.latent_dim, top_k, tile_budget)
    tiles = lambda src: dense_tiles(pos, rank, src, q_tile, k_tile)  # noqa: E731
    with torch.no_grad():
        ps = _Pass(absorb(q, kv_b_weight, dims), main_lse, None, None, tiles, scale, None,
                   H * tp, tp_group)
        return main_topk_recall(ps, latent, indices.long(), pos, min(top_k, pos.n), group,
                                comm)


__all__ = ["DSA_COMMS", "DSA_STAGES", "indexer_kl", "indexer_recall", "indexer_topk",
           "sparse_latent_attention"]
