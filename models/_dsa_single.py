"""TEMPORARY: DSA at cp 1 from ctxpar.testing.dsa's reference, with the CP API's signatures,
until ctxpar.context_parallel.sparse_latent lands (models/dsa.py imports that first)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ctxpar.context_parallel.latent import expand_latent
from ctxpar.testing.dsa import (reference_index_scores, reference_indexer_kl, reference_topk,
                                reference_visible, selected_mask)


def _one_process(cp_group, tp_group):
    if (cp_group is not None and dist.get_world_size(cp_group) > 1) or tp_group is not None:
        raise ValueError("DSA over CP or TP needs ctxpar.context_parallel.sparse_latent")


def indexer_topk(index_q, index_k, index_w, top_k, *, comm="ring", cp_group=None,
                 tp_group=None, layout="contiguous", cu_seqlens=None, index_softmax_scale=None):
    _one_process(cp_group, tp_group)
    with torch.no_grad():
        B, n = index_k.shape[:2]
        scores = reference_index_scores(index_q, index_k, index_w, index_softmax_scale)
        return reference_topk(scores, reference_visible(n, B, cu_seqlens), top_k)


def sparse_latent_attention(q, latent, weight, dims, indices, *, comm="ring", cp_group=None,
                            layout="contiguous", cu_seqlens=None, softmax_scale=None,
                            return_lse=False):
    _one_process(cp_group, None)
    B, n = latent.shape[:2]
    allowed = selected_mask(indices, n) & reference_visible(n, B, cu_seqlens)
    k, v = expand_latent(latent, weight, dims)
    s = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * softmax_scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.einsum("bhls,bshd->blhd", (s - lse[..., None]).exp(), v.float()).to(q.dtype)
    return (out, lse) if return_lse else out


def indexer_kl(stage, q, latent, weight, dims, main_lse, index_q, index_k, index_w,
               indices=None, *, comm="ring", cp_group=None, tp_group=None,
               layout="contiguous", cu_seqlens=None, softmax_scale=None,
               index_softmax_scale=None):
    _one_process(cp_group, tp_group)
    B, n = latent.shape[:2]
    return reference_indexer_kl(stage, q, latent, weight, dims, index_q, index_k, index_w,
                                reference_visible(n, B, cu_seqlens), softmax_scale, indices,
                                index_softmax_scale)
