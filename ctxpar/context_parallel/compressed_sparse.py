"""DeepSeek-V4's compressed sparse attention (CSA) core over a CP group.

    out = csa_attention(q, kv, compress_kv, compress_gate, position_bias, norm_weight,
                        sinks, IndexerInputs(...), sliding_window=128, compress_rate=4,
                        index_topk=512, entry_rope=rope, cp_group=g, layout="zigzag")

Each query at global position t attends, in one softmax with the per-head sinks, to

    the sliding window     the shared K=V head kv at positions t - sliding_window < j <= t
    the selected entries   the index_topk compressed entries the lightning indexer
                           picked among those it can see (w < (t + 1) // m)

exactly as transformers' ``DeepseekV4Attention`` on a "compressed_sparse_attention" layer
(``DeepseekV4CSACompressor`` with its ``DeepseekV4Indexer``, eager attention with the
sinks). The entries are CSA's overlapping compressor's (compressor.py, overlap: two series,
2m slots), made by the ranks ending their windows and all-gathered, as HCA's; the indexer
(csa_indexer.py) picks each local query's entries from its own all-gathered compressed
keys. The attention is compressed.CompressedCore, HCA's one autograd Function, with the
entries' block swapped: ``SelectedEntries`` attends each query to its own selected entries
only, gathered per query tile (dsa_attention's sparse pass over dsa_pairs' selected tiles,
the entries' block being local; packed documents as compressed.py's, the indexer's
choices inside each document), merged into the window's (out, lse) by log-sum-exp,
backward from the merged (out, lse). Gradients reach q, kv, the sinks and the attention
compressor's inputs; none reach the indexer (csa_indexer.py: why).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .arguments import world_group
from .comm import LOCAL, group_rank_and_size
from .compressed import check_core, compressed_attention
from .compressed_windows import split_samples
from .csa_indexer import IndexerInputs, check_indexer, csa_indexer
from .dsa_attention import sparse_backward, sparse_forward
from .dsa_pairs import Selection
from .merge import merge_block_
from .sparse_latent import _q_tile as selected_q_tile


class EntrySelection(Selection):
    """dsa_pairs.Selection of compressed entries, all held by this rank (one owner):
    indices (B, S, k) distinct entry ids (csa_indexer's); -1 and entries the query
    cannot see (outside lo <= w < hi, (S,) each: compressed_windows.entry_ranges) are
    dropped, as DeepseekV4Attention's block bias (0 where selected, -inf elsewhere) drops
    them."""

    def __init__(self, indices: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
        B, S, k = indices.shape
        none = int(hi.max()) + 1 if S else 1            # sorts after every kept entry
        ok = (indices >= lo[None, :, None]) & (indices < hi[None, :, None])
        key = torch.where(ok, indices, none).sort(dim=-1).values
        self.rows = key.clamp(max=max(none - 2, 0))     # dropped slots: masked by counts
        self.counts = (key < none).sum(-1, keepdim=True)  # (B, S, 1)
        self.starts = torch.zeros_like(self.counts)
        self.k = k


class SelectedEntries(NamedTuple):
    """CSA's entries part of CompressedCore: each query's selected entries, per query
    tile (the kernels take keys shared by a block's queries, so these are einsums)."""

    sel: EntrySelection
    q_tile: int

    def forward_(self, kernel, q, entries, scale, out, lse) -> None:
        """Merge the selected entries' (out, lse) into the running fp32 (out, lse)."""
        o, o_lse = sparse_forward(q, entries, self.sel, LOCAL, "allgather",
                                  entries.shape[-1], scale, self.q_tile)
        merge_block_(out, lse, o, o_lse)

    def backward(self, kernel, dout, q, entries, out, lse, scale):
        """(dq, dentries) fp32 from the merged (out, lse): K = V, one gradient each."""
        return sparse_backward(dout.float(), q, entries, out.float(), lse, self.sel, LOCAL,
                               "allgather", entries.shape[-1], scale, self.q_tile)


def csa_attention(q: torch.Tensor, kv: torch.Tensor, compress_kv: torch.Tensor,
                  compress_gate: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, sinks: Optional[torch.Tensor],
                  indexer: IndexerInputs, *, sliding_window: int, compress_rate: int,
                  index_topk: int, entry_rope: Callable, cp_group=None,
                  layout: str = "contiguous", comm: str = "ring", norm_eps: float = 1e-6,
                  softmax_scale: Optional[float] = None,
                  index_softmax_scale: Optional[float] = None, backend: str = "auto",
                  cu_seqlens=None, return_lse: bool = False, return_indices: bool = False,
                  tile_budget: Optional[int] = None, reset_positions: bool = True,
                  tp_group=None):
    """V4's CSA attention core of this rank's queries (module docstring).

    q (B, S, H, D), kv (B, S, D), sinks (H,) or None as hca_attention; compress_kv,
    compress_gate (B, S, 2D) the CSA compressor's kv_proj and gate_proj of the local hidden
    states, position_bias (m, 2D), norm_weight (D,); indexer: the indexer's tensors
    (csa_indexer.IndexerInputs). entry_rope(x (B, T, d), positions (T,)) the compressor's
    RoPE, used for both the entries (d = D) and the indexer's keys (d = index_head_dim).
    Tokens follow `layout` (contiguous or zigzag, each slab at least 2m tokens when P > 1);
    the window goes through `comm` (ring or allgather). tile_budget: elements of one tile
    of the indexer's scores and of the selected entries' (default 2**20). cu_seqlens,
    reset_positions: packed documents as hca_attention's (the indexer's keys and choices
    inside each document too). tp_group: the indexer's heads are split over it (docs:
    "the indexer over TP"); q's heads and the sinks are whatever share the caller holds.
    Returns out (B, S, H, D), then the merged lse (B, H, S) fp32 with return_lse, then
    the indexer's indices (B, S, min(index_topk, N)) global entry ids (N the sequence's
    entries; -1 = none) with return_indices.
    """
    caller = "csa_attention"
    m, found = compress_rate, {}
    world = group_rank_and_size(world_group(cp_group))[1]
    check_indexer(indexer, tuple(q.shape[:2]), m, index_topk, layout, world, caller)
    compressor = (compress_kv, compress_gate, position_bias, norm_weight)
    docs = check_core(q, kv, compressor, sliding_window, m, layout, comm, world, True,
                      cu_seqlens, caller)
    kw = dict(sliding_window=sliding_window, compress_rate=m, index_topk=index_topk,
              entry_rope=entry_rope, cp_group=cp_group, layout=layout, comm=comm,
              norm_eps=norm_eps, softmax_scale=softmax_scale,
              index_softmax_scale=index_softmax_scale, backend=backend,
              tile_budget=tile_budget, reset_positions=reset_positions, tp_group=tp_group)
    if split_samples(docs):
        return _by_sample(q, kv, compressor, sinks, indexer, docs, kw, return_lse,
                          return_indices)
    cu = None if docs is None else docs[0].to(torch.int32)

    def selected(lo, hi, count):  # after the entries' gather: the indexer's collectives
        indices = csa_indexer(indexer, compress_rate=m, index_topk=index_topk,
                              entry_rope=entry_rope, cp_group=cp_group, layout=layout,
                              norm_eps=norm_eps, index_softmax_scale=index_softmax_scale,
                              tile_budget=tile_budget, cu_seqlens=cu,
                              reset_positions=reset_positions, tp_group=tp_group)
        found["indices"] = indices
        sel = EntrySelection(indices, lo.to(indices.device), hi.to(indices.device))
        width = q.shape[2] + q.shape[3]  # the tile's (Q, H, K) scores and (Q, K, D) rows
        return SelectedEntries(sel, selected_q_tile(q.shape[1], width, indices.shape[-1],
                                                    tile_budget))

    out, lse = compressed_attention(
        q, kv, compressor, sinks, selected, overlap=True, sliding_window=sliding_window,
        compress_rate=m, entry_rope=entry_rope, cp_group=cp_group, layout=layout,
        comm=comm, norm_eps=norm_eps, softmax_scale=softmax_scale, backend=backend,
        cu_seqlens=cu, reset_positions=reset_positions, caller=caller)
    return _returns(out, lse, found.get("indices"), return_lse, return_indices)


def _returns(out, lse, indices, return_lse: bool, return_indices: bool):
    if not (return_lse or return_indices):
        return out
    return (out,) + ((lse,) if return_lse else ()) + ((indices,) if return_indices else ())


def _by_sample(q, kv, compressor, sinks, indexer, docs, kw, return_lse, return_indices):
    """csa_attention sample by sample (their documents differ), concatenated; the indices
    padded with -1 to the widest sample's."""
    outs = []
    for b, cu in enumerate(docs):
        one = [t[b:b + 1] for t in compressor[:2]] + list(compressor[2:])
        index = IndexerInputs(*(t[b:b + 1] for t in indexer[:4]), *indexer[4:])
        outs.append(csa_attention(q[b:b + 1], kv[b:b + 1], *one, sinks, index,
                                  cu_seqlens=cu.to(torch.int32), return_lse=True,
                                  return_indices=True, **kw))
    k = max(o[2].shape[-1] for o in outs)
    indices = torch.cat([torch.nn.functional.pad(o[2], (0, k - o[2].shape[-1]), value=-1)
                         for o in outs])
    return _returns(torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]),
                    indices, return_lse, return_indices)
