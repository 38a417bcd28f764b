"""A decode step of multi-head latent attention against the cached latent, W_uk absorbed.

MLA's key of head h for token t is [W_uk[h] c_t ; k_rot_t] and its value W_uv[h] c_t
(W = kv_b_proj.weight, (H (dn + dv), R), rows [W_uk[h] ; W_uv[h]] per head). A query's
score is therefore

    q_nope[h] . W_uk[h] c_t + q_rot[h] . k_rot_t = [W_uk[h]^T q_nope[h] ; q_rot[h]] . latent_t

so one decode step folds W_uk into the query once (H x dn x R multiply-adds) and attends
with it to the latent itself, as a single shared key head of R + dr; the softmax-weighted
sum of the latents' c parts is R wide per head, and W_uv[h] maps it to the head's value
width. This is what DeepSeek's and the serving engines' MLA decoding does ("absorb"), and
it is the same function as expanding the cache (the sums reassociated: equal to fp32
rounding, tests/test_inference.py): a step reads the cache's n x (R + dr) numbers once
instead of multiplying all n latents by W (n x R x H (dn + dv) multiply-adds a step: at
32K cached tokens and V3's 128 heads, 1,102 GFLOP a layer and step against 9.2).

Each rank attends to its share of the cache; the partial is mapped by W_uv before the CP
merge (the merge is a softmax-weighted sum, linear, so W_uv commutes with it), so the
merge moves H x (dv + 1) numbers a head, as for expanded keys (decode.py).
"""
from __future__ import annotations

import torch

from ctxpar.context_parallel.latent import LatentDims

from .decode import partial_attention


def absorbed_partial_attention(q: torch.Tensor, latent: torch.Tensor, weight: torch.Tensor,
                               dims: LatentDims, valid: torch.Tensor, scale: float):
    """q (B, 1, H, dn + dr) RoPE applied; latent (B, S, R + dr) this rank's cached latents;
    weight (H (dn + dv), R) the rows of these H heads; valid (B, S) bool. Returns out
    (B, 1, H, dv) fp32 and lse (B, H, 1) fp32 over this rank's keys, as
    partial_attention(q, k, v, ...) returns with k, v expanded from the latent."""
    B, _, H, _ = q.shape
    R = dims.kv_lora_rank
    w = weight.float().view(H, dims.kv_b_rows_per_head, R)
    w_uk, w_uv = w.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=1)  # (H, dn|dv, R)
    q_nope, q_rot = q.float().split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)               # (B, 1, H, R)
    q_abs = torch.cat((q_latent, q_rot), dim=-1)                          # (B, 1, H, R + dr)
    keys = latent.unsqueeze(1)                                           # (B, 1, S, R + dr)
    out, lse = partial_attention(q_abs, keys, keys[..., :R], valid, scale)  # (B, 1, H, R)
    return torch.einsum("bthr,hvr->bthv", out, w_uv), lse                 # (B, 1, H, dv)
