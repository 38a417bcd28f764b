"""A single-process reference of DeepSeek sparse attention (DSA): indexer, top-k, sparse MLA,
the indexer's KL losses. Whole (B, n, n) matrices, plain autograd: for tests only.

    scores = reference_index_scores(index_q, index_k, index_weights)       # (B, n, n) fp32
    vis = reference_visible(n, B, cu_seqlens)                               # (B, n, n) bool
    idx = reference_topk(scores, vis, top_k)                                # (B, n, k) int64
    ref = reference_sparse_mla(q, latent, W, dims, idx, vis, scale, dout)   # out, lse, grads
    kl = reference_indexer_kl("sparse", q, latent, W, dims, index_q, index_k, index_weights,
                              vis, scale, idx)                              # (B, n) fp32

The math is transformers' ``DeepseekV32Indexer.forward`` (the same in ``GlmMoeDsaIndexer``;
the two differ only in the indexer's RoPE, which the caller applies to index_q, index_k):

    I[s, t] = sum_h w[s, h] * relu(softmax_scale * q_h(s) . k(t))      in fp32
    w = weights_proj(x) * index_n_heads ** -0.5                         (the caller's w)
    indices = topk(I masked to -inf where t is invisible, min(top_k, n)).indices

and ``DeepseekV32Attention``: the attention mask is the causal (document) mask AND the
selected set, so a query with fewer visible tokens than top_k attends to all of them (its
surplus top-k slots pick -inf entries the mask then drops). Here those slots are -1.

The losses follow the DeepSeek-V3.2 report (section 2.1): p[s, t] = (1/H) sum_h of the main
attention's probabilities (summed over heads, L1-normalised), main detached; the indexer's
distribution softmax(I[s, .]) over the same set; KL(p || softmax(I)) per query:
    dense_warmup: the set is every visible (earlier, same-document) token, p dense attention
    sparse:       the set is the selected tokens, p the sparse attention's distribution
"""
from __future__ import annotations

from typing import Optional

import torch

from ctxpar.context_parallel.latent import LatentDims, expand_latent
from ctxpar.context_parallel.mask import dense_mask
from ctxpar.testing.mla import expanded_reference


def reference_index_scores(index_q: torch.Tensor, index_k: torch.Tensor,
                           index_weights: torch.Tensor,
                           softmax_scale: Optional[float] = None) -> torch.Tensor:
    """index_q (B, n, Hi, D), index_k (B, n, D), index_weights (B, n, Hi) -> I (B, n, n)
    fp32, rows queries, columns keys, before any mask (differentiable)."""
    scale = index_q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkd->bqhk", index_q.float(), index_k.float()) * scale
    return torch.einsum("bqh,bqhk->bqk", index_weights.float(), torch.relu(s))


def reference_visible(n: int, batch: int, cu_seqlens=None) -> torch.Tensor:
    """(B, n, n) bool, True = query row sees key column: causal, inside its document
    (cu_seqlens: None, one int32 tensor, or a list of one per sample)."""
    cus = cu_seqlens if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens] * batch
    return torch.stack([dense_mask(n, True, None, cu) for cu in cus])


def reference_topk(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """(B, n, min(top_k, n)) int64: torch.topk of each masked row (transformers' rule),
    -1 in the slots that fell on invisible (-inf) keys."""
    masked = scores.masked_fill(~visible, float("-inf"))
    vals, idx = masked.topk(min(top_k, scores.shape[-1]), dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1)


def selected_mask(indices: torch.Tensor, n: int) -> torch.Tensor:
    """indices (B, n_q, k) int64, -1 = none -> (B, n_q, n) bool, True = selected."""
    sel = torch.zeros(*indices.shape[:2], n + 1, dtype=torch.bool)
    sel.scatter_(-1, torch.where(indices < 0, n, indices), True)
    return sel[..., :n]


def reference_sparse_mla(q, latent, weight, dims: LatentDims, indices, visible, scale: float,
                         dout) -> dict:
    """out, lse and the gradients of q, latent, kv_b weight of MLA on the expanded K,V
    over visible & selected pairs (DeepseekV32Attention's eager path), fp32 autograd."""
    sel = selected_mask(indices, visible.shape[-1]) & visible
    return expanded_reference(q, latent, weight, dims, dout, sel, scale)


def main_probabilities(q, latent, weight, dims: LatentDims, allowed, scale: float):
    """p (B, n, n) fp32 detached: the main attention's softmax over `allowed` pairs,
    averaged over heads (the report's sum over heads, L1-normalised)."""
    with torch.no_grad():
        k, _ = expand_latent(latent.float(), weight.float(), dims)
        s = torch.einsum("blhd,bshd->bhls", q.float(), k) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        return s.softmax(-1).mean(1)


def reference_indexer_kl(stage: str, q, latent, weight, dims: LatentDims, index_q, index_k,
                         index_weights, visible, scale: float, indices=None,
                         index_softmax_scale: Optional[float] = None) -> torch.Tensor:
    """KL(p || softmax(I)) per query, (B, n) fp32, differentiable in index_q, index_k,
    index_weights only (p is detached). stage: 'dense_warmup' (every visible key) or
    'sparse' (the selected ones: indices required)."""
    if stage == "sparse":
        allowed = selected_mask(indices, visible.shape[-1]) & visible
    elif stage == "dense_warmup":
        allowed = visible
    else:
        raise ValueError(f"reference_indexer_kl: unknown stage {stage!r}")
    p = main_probabilities(q, latent, weight, dims, allowed, scale)
    logits = reference_index_scores(index_q, index_k, index_weights, index_softmax_scale)
    log_q = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    terms = p * (torch.log(p.clamp_min(1e-38)) - log_q.masked_fill(~allowed, 0.0))
    return terms.masked_fill(~allowed, 0.0).sum(-1)


def dsa_inputs(batch: int, n: int, heads: int, dims: LatentDims, index_heads: int,
               index_dim: int, seed: int = 4321):
    """Full-sequence fp32 index_q (B, n, Hi, D), index_k (B, n, D), index_weights (B, n, Hi)
    (the same on every rank): Gaussian, weights scaled by Hi ** -0.5 as transformers'.
    Scores are a.s. free of ties except where every head's ReLU is 0 (score 0)."""
    gen = torch.Generator().manual_seed(seed)
    index_q = torch.randn(batch, n, index_heads, index_dim, generator=gen)
    index_k = torch.randn(batch, n, index_dim, generator=gen)
    weights = torch.randn(batch, n, index_heads, generator=gen) * index_heads ** -0.5
    return index_q, index_k, weights


def reference_recall(q, latent, weight, dims: LatentDims, visible, scale: float, indices,
                     top_k: int) -> torch.Tensor:
    """(B, n) fp32: the share of each query's top_k keys by the dense main attention's p
    (reference_topk of main_probabilities) that `indices` selected."""
    p = main_probabilities(q, latent, weight, dims, visible, scale)
    main = reference_topk(p, visible, top_k)
    hit = (main[..., :, None] == indices[..., None, :]).any(-1) & (main >= 0)
    return hit.sum(-1).float() / (main >= 0).sum(-1).clamp_min(1).float()
