"""A reference MLA layer: DeepseekV3Attention's projections around ctxpar's latent_attention.

    layer = ReferenceMLA.from_config(hf_config)          # any object with the V3 fields
    layer.load_state_dict(hf_attention.state_dict())     # the same parameter names
    out = layer(hidden, cos, sin, comm="ring", cp_group=g, layout="zigzag", causal=True)

It computes q and the latent from this rank's hidden states exactly as transformers'
``DeepseekV3Attention.forward`` does (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj;
kv_a_proj_with_mqa -> (c_kv, k_rot); kv_a_layernorm on c_kv; RoPE on the rope parts only,
interleaved pairs when rope_interleave; the softmax scale qk_head_dim ** -0.5 times YaRN's
mscale(factor, mscale_all_dim) squared) and hands them to ``latent_attention`` with
kv_b_proj's weight, then o_proj. cos, sin (B, s, qk_rope_head_dim) are this rank's rows
of the rotary embedding (transformers' DeepseekV3RotaryEmbedding for the global positions,
YaRN's attention factor included), as DeepseekV3Attention takes its position_embeddings.

The tests hold it to transformers on one process and to itself across CP; the model-side
MLA mixer is expected to be this, with the model's own RoPE and TP.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ctxpar.context_parallel.latent import LatentDims, expand_latent
from ctxpar.context_parallel.latent_api import latent_attention


class RMSNorm(nn.Module):
    """DeepseekV3RMSNorm: normalised in fp32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def yarn_softmax_scale(qk_head_dim: int, rope_parameters: Optional[dict]) -> float:
    """DeepseekV3Attention.scaling: qk_head_dim ** -0.5, times mscale ** 2 under YaRN with
    mscale_all_dim (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1)."""
    scale = qk_head_dim ** -0.5
    rp = rope_parameters or {}
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim", 0):
        factor = rp["factor"]
        m = 1.0 if factor <= 1 else 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= m * m
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb (rotate_half) or, interleaved, its
    apply_rotary_pos_emb_interleave (pairs (x0, x1), (x2, x3), ... out as [evens ; odds]);
    cos, sin broadcast to x (their last dim is cat(freqs, freqs))."""
    if interleave:
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ReferenceMLA(nn.Module):
    """DeepseekV3Attention's parameters (same names) and math, attention by latent_attention."""

    def __init__(self, hidden_size: int, num_heads: int, dims: LatentDims,
                 q_lora_rank: Optional[int] = None, rope_interleave: bool = True,
                 attention_bias: bool = False, softmax_scale: Optional[float] = None):
        super().__init__()
        self.num_heads, self.dims, self.rope_interleave = num_heads, dims, rope_interleave
        self.softmax_scale = softmax_scale
        qk = num_heads * dims.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank)
            self.q_b_proj = nn.Linear(q_lora_rank, qk, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, dims.latent_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank)
        self.kv_b_proj = nn.Linear(dims.kv_lora_rank, num_heads * dims.kv_b_rows_per_head,
                                   bias=False)
        self.o_proj = nn.Linear(num_heads * dims.v_head_dim, hidden_size, bias=attention_bias)

    @classmethod
    def from_config(cls, config) -> "ReferenceMLA":
        """From a DeepseekV3Config (or anything with its field names)."""
        dims = LatentDims.from_config(config)
        return cls(config.hidden_size, config.num_attention_heads, dims,
                   config.q_lora_rank, bool(getattr(config, "rope_interleave", True)),
                   bool(getattr(config, "attention_bias", False)),
                   yarn_softmax_scale(dims.qk_head_dim,
                                      getattr(config, "rope_parameters", None)))

    def project(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q (B, s, H, dn + dr), latent (B, s, R + dr)), RoPE applied to both rope parts."""
        B, s, _ = hidden.shape
        d = self.dims
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_rot = q.view(B, s, self.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(hidden).split(
            [d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos.unsqueeze(2), sin.unsqueeze(2), self.rope_interleave)
        k_rot = apply_rope(k_rot, cos, sin, self.rope_interleave)
        q = torch.cat((q_nope, q_rot), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_rot), dim=-1)
        return q, latent

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                **cp) -> torch.Tensor:
        """hidden (B, s, hidden_size) of this rank's tokens -> (B, s, hidden_size); cp: the
        keyword arguments of latent_attention (comm, groups, layout, causal, mask, ...)."""
        q, latent = self.project(hidden, cos, sin)
        out = latent_attention(q, latent, self.kv_b_proj.weight, self.dims,
                               softmax_scale=self.softmax_scale, **cp)
        return self.o_proj(out.flatten(2))


def mla_inputs(batch: int, n: int, heads: int, dims: LatentDims, seed: int = 1234):
    """Full-sequence fp32 q (B, n, H, dn + dr), latent (B, n, R + dr), kv_b weight
    (H (dn + dv), R), dout (B, n, H, dv) and sinks (H,): the same on every rank. W is
    scaled by R ** -0.5 so that the expanded k, v are O(1), like q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n, heads, dims.qk_head_dim, generator=gen)
    latent = torch.randn(batch, n, dims.latent_dim, generator=gen)
    weight = torch.randn(heads * dims.kv_b_rows_per_head, dims.kv_lora_rank,
                         generator=gen) * dims.kv_lora_rank ** -0.5
    dout = torch.randn(batch, n, heads, dims.v_head_dim, generator=gen)
    return q, latent, weight, dout, torch.randn(heads, generator=gen)


def expanded_reference(q, latent, weight, dims: LatentDims, dout, visible, scale: float,
                       sinks=None) -> dict:
    """Plain fp32 attention on the expanded K,V of the full sequence, by autograd: out,
    lse, and the gradients of q, latent, kv_b weight (and sinks). visible: (B or 1, n, n)
    bool, True = query row sees key column (mask.dense_mask per sample)."""
    leaves = [x.detach().float().requires_grad_() for x in (q, latent, weight)]
    if sinks is not None:
        leaves.append(sinks.detach().float().requires_grad_())
    qf, lat, w = leaves[:3]
    k, v = expand_latent(lat, w, dims)
    s = torch.einsum("blhd,bshd->bhls", qf, k) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:  # one more logit per head, no value (gpt-oss' eager attention)
        s = torch.cat((s, leaves[3][None, :, None, None].expand(*s.shape[:3], 1)), dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = s.softmax(-1)[..., :visible.shape[-1]]
    out = torch.einsum("bhls,bshd->blhd", p, v)
    grads = torch.autograd.grad(out, leaves, dout.float())
    names = ("dq", "dlatent", "dweight", "dsinks")
    return {"out": out.detach(), "lse": lse.detach(), **dict(zip(names, grads))}
