"""Generation's cache for DeepSeek sparse attention layers (model.dsa): MLA's latent slots
(kv_cache.py) plus one indexer key per slot, and a decode step's top-k over the CP group.

    prefill   the layer's latent and indexer keys kept in this rank's slots; the training
              path runs (the indexer's top-k and the sparse MLA over CP)
    decode    the new token's latent and indexer key kept by the owner rank; every rank
              scores the query against its slots, keeps its best index_topk (score, global
              position) pairs, all-gathers them over CP and keeps the best index_topk of
              the union (ties: the lower position, as training's indexer_topk); each rank
              attends to the selected slots it holds, the partials merged by LSE
              (decode.py). A 'shared' layer reuses the previous layer's selection.

Per slot the layer keeps R + dr + index_head_dim numbers (576 + 128 for DeepSeek-V3.2). The
selection travels as global positions (B, top-k), -1 where a row has fewer tokens, the
form training's indexer_topk returns.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .decode import merge_partials
from .latent_decode import absorbed_partial_attention


def index_scores(index_q, index_k, index_w, scale: float, tp_group=None) -> torch.Tensor:
    """index_q (B, 1, Hi/tp, D), index_k (B, S, D), index_w (B, 1, Hi/tp) -> (B, S) fp32,
    sum_h w_h ReLU(scale q_h . k) (DeepseekV32Indexer's score), summed over TP's heads."""
    s = torch.relu(torch.einsum("bhd,bsd->bhs", index_q[:, 0].float(), index_k.float()) * scale)
    out = torch.einsum("bh,bhs->bs", index_w[:, 0].float(), s)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(out, group=tp_group)  # each rank scored its heads
    return out


def select_over_cp(scores: torch.Tensor, positions: torch.Tensor, top_k: int,
                   cp_group=None) -> torch.Tensor:
    """scores (B, S) fp32 of this rank's slots (-inf: not a key), positions (B, S) their
    global positions -> (B, top_k) the global positions of the best top_k over every CP
    rank's slots, by score then lower position; -1 in the slots past a row's keys."""
    B, S = scores.shape
    k = min(top_k, S)
    vals, idx = scores.topk(k, dim=-1)  # this rank's best: the union's best are among them
    pos = positions.gather(1, idx)
    if k < top_k:  # every rank sends top_k pairs
        vals = torch.cat([vals, vals.new_full((B, top_k - k), float("-inf"))], dim=1)
        pos = torch.cat([pos, pos.new_full((B, top_k - k), -1)], dim=1)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        vals_all = [torch.empty_like(vals) for _ in range(dist.get_world_size(cp_group))]
        pos_all = [torch.empty_like(pos) for _ in vals_all]
        dist.all_gather(vals_all, vals, group=cp_group)
        dist.all_gather(pos_all, pos, group=cp_group)
        vals, pos = torch.cat(vals_all, dim=1), torch.cat(pos_all, dim=1)
    # lower position first, then a stable sort by score: ties keep the lower position
    order = pos.masked_fill(pos < 0, pos.max() + 1).argsort(dim=1, stable=True)
    vals, pos = vals.gather(1, order), pos.gather(1, order)
    best = vals.argsort(dim=1, descending=True, stable=True)[:, :top_k]
    chosen = pos.gather(1, best)
    return chosen.masked_fill(vals.gather(1, best) == float("-inf"), -1)


class SparseLayerCache:
    """One DSA layer's view of the KVCache (``cache.layer(i)``): mixer.mix calls
    ``sparse(mixer, q, latent, index_q, index_k, index_w)``."""

    def __init__(self, cache, latent_slot: int, index_slot: int):
        self.cache, self.latent_slot, self.index_slot = cache, latent_slot, index_slot

    def sparse(self, mixer, q, latent, index_q, index_k, index_w) -> torch.Tensor:
        c, i, j = self.cache, self.latent_slot, self.index_slot
        n = c.filled[c.cp_rank]
        if c.mode == "prefill":  # the training path over CP; its selection kept on mixer
            c.latent[i, :, :n] = latent
            if j is not None:
                c.index_k[j, :, :n] = index_k
            return mixer.attend(q, latent, index_q, index_k, index_w)
        assert c.mode == "decode", "begin_prefill or begin_decode first"
        if c.owner == c.cp_rank:
            c.latent[i, :, n - 1] = latent[:, 0]
            if j is not None:
                c.index_k[j, :, n - 1] = index_k[:, 0]
        valid = c.valid[:, :n]
        if j is None:  # 'shared': the layer before chose
            chosen = mixer.previous.selection
        else:
            scores = index_scores(index_q, c.index_k[j, :, :n], index_w,
                                  mixer.indexer.head_dim ** -0.5, mixer.tp())
            chosen = select_over_cp(scores.masked_fill(~valid, float("-inf")), c.pos[:, :n],
                                    mixer.dsa.index_topk, c.cp_group)
        mixer.selection = chosen
        held = valid & (c.pos[:, :n, None] == chosen[:, None, :]).any(-1)  # (B, n)
        out, lse = absorbed_partial_attention(q, c.latent[i, :, :n], mixer.kv_b_proj.weight,
                                              mixer.dims, held, c.scale)  # never expanded
        return merge_partials(out, lse, c.cp_group, c.stats).to(q.dtype)
