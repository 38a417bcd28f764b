"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024; DeepSeek-V3), the token
mixer of attention layers under model.mla, as transformers' DeepseekV3Attention computes it.

    q       q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))     (B, T/cp, H/tp, dn + dr)
    latent  [kv_a_layernorm(c_kv) ; rope(k_rot)]                  (B, T/cp, R + dr)
            with (c_kv, k_rot) = kv_a_proj_with_mqa(x)
    o       attention of q over k = [c_kv W_uk ; k_rot], v = c_kv W_uv per head, W = kv_b_proj
    out     o_proj(o)

Over CP the latent travels, never the expanded K,V: ctxpar.context_parallel.latent_attention
(every pattern; backward sends the latent's gradient) expands each block it holds just
before using it, so what a rank keeps for backward is q, the latent, the output and its
LSE. RoPE turns the rope parts only (model.mla.qk_rope_head_dim channels; interleaved
pairs under rope_interleave, DeepSeek's layout: the same as rotate-half on the channels
taken evens first); the shared key k_rot is rotated once per token for every head. Under
model.rope=false (Kimi Linear's MLA, transformers' KimiLinearAttention) nothing turns: the
rope parts keep their channels and the shared key its width, unrotated, so the latent,
its ring and the cache are the same tensors, positions entering through the mask alone.

TP splits the heads: q_proj / q_b_proj and kv_b_proj by rows (column-parallel), o_proj by
columns; the low-rank paths (q_a_proj, kv_a_proj_with_mqa and their norms) are replicated,
and their outputs pass f (identity forward, all-reduce backward) where the split heads
take them, so every TP rank's replicated weights get the whole gradient.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ctxpar.config import ModelConfig, rotary_dim, softmax_scale
from ctxpar.config.layers import LayerAttention, layer_attention
from ctxpar.context_parallel import AttentionMask, ContextParallel, LatentDims
from ctxpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_model_parallel_region)
from ctxpar.tensor_parallel.mappings import tp_size_of

from .norms import RMSNorm
from .options import LayerArgs
from .rope import apply_rotary
from .token_mixer import TokenMixer


# The bottlenecks' norms' epsilon: DeepSeek's (transformers' DeepseekV3RMSNorm default, which
# its attention builds them with, whatever rms_norm_eps says)
LATENT_NORM_EPS = 1e-6


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... laid out as rotate-half's
    (x0, x2, ... | x1, x3, ...): transformers' apply_rotary_pos_emb_interleave returns its
    result in this order, so q and k rotated after it equal transformers' bit for bit."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLA(TokenMixer):
    """Multi-head latent attention (module docstring); as a token mixer: project_in makes q
    and the latent, mix is the CP latent attention (or generation's cache), project_out
    o_proj. Under 'selective' recompute the Block replays the projections, never the core."""

    selective_recompute = True

    def __init__(self, cfg: ModelConfig, tp_group, cp: ContextParallel, backend: str,
                 device=None, dtype=None, layer: Optional[LayerAttention] = None):
        super().__init__()
        mla, tp = cfg.mla, tp_size_of(tp_group)
        self.tp_group, self.cp, self.backend = tp_group, cp, backend
        self.layer = layer or layer_attention(cfg)[0]
        self.dims = LatentDims(mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                               mla.v_head_dim)
        self.n_heads = cfg.n_heads // tp  # this rank's heads
        self.scale = softmax_scale(cfg)
        self.rotary_dim = rotary_dim(cfg)  # = qk_rope_head_dim
        self.rope = self.layer.rope  # model.rope=false: NoPE (Kimi Linear's)
        self.interleave = mla.rope_interleave
        d, h, dims = cfg.d_model, cfg.n_heads, self.dims
        kw = dict(device=device, dtype=dtype)
        lin = dict(tp_group=tp_group, bias=False, **kw)
        self.q_lora_rank = mla.q_lora_rank
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d, h * dims.qk_head_dim, **lin)
        else:  # the bottleneck replicated over TP, q_b_proj split by heads
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=False, **kw)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, h * dims.qk_head_dim, **lin)
        self.kv_a_proj_with_mqa = nn.Linear(d, dims.latent_dim, bias=False, **kw)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, **kw)
        # used through its weight (the latent attention expands each block with it)
        self.kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank,
                                              h * dims.kv_b_rows_per_head, **lin)
        self.o_proj = RowParallelLinear(h * dims.v_head_dim, d, **lin)

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "MLA":
        return cls(args.cfg, args.tp_group, args.cp, args.backend, args.device, args.dtype,
                   args.layer)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(interleaved_to_half(x) if self.interleave else x, cos, sin)

    def project_in(self, x: torch.Tensor, cos, sin) -> Tuple[tuple, tuple]:
        """x (B, T/cp, d) -> (q (B, T/cp, H/tp, dn + dr), latent (B, T/cp, R + dr))."""
        q, latent, _ = self.project(x, cos, sin)
        return (q, latent), ()

    def project(self, x: torch.Tensor, cos, sin):
        """project_in's q and latent, and the query latent qa (B, T/cp, q_lora_rank) (None
        without the bottleneck): DSA's indexer reads it."""
        B, T = x.shape[:2]
        dims, qa = self.dims, None
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # f inside: q_proj's input gradient summed over TP
        else:
            qa = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qa)  # f on qa: the replicated bottleneck's whole gradient
        q_nope, q_rot = q.view(B, T, self.n_heads, dims.qk_head_dim).split(
            [dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        c_kv, k_rot = self.kv_a_proj_with_mqa(x).split(
            [dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        if self.rope:  # one key for all heads, turned once
            k_rot = self._rope(k_rot.unsqueeze(2), cos, sin).squeeze(2)
            q_rot = self._rope(q_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_rot), dim=-1)
        # f: every TP rank's heads read the whole latent; its gradient summed over TP
        latent = copy_to_tensor_model_parallel_region(latent, self.tp_group)
        return q, latent, qa

    def mix(self, inputs: tuple, cu_seqlens=None, cache=None) -> torch.Tensor:
        q, latent = inputs
        if cache is not None:  # generation: the cache keeps the latent (ctxpar.inference)
            return cache(q, latent, (self.kv_b_proj.weight, self.dims), self.core,
                         self.mask())
        return self.core(q, latent, cu_seqlens)  # (B, T/cp, H/tp, dv)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.flatten(2))

    def mask(self, cu_seqlens=None) -> AttentionMask:
        """Causal by global positions, inside the layer's window or chunk and each
        document of cu_seqlens."""
        return AttentionMask(causal=True, sliding_window=self.layer.sliding_window,
                             chunk_size=self.layer.chunk_size, cu_seqlens=cu_seqlens)

    def core(self, q, latent, cu_seqlens=None) -> torch.Tensor:
        # Exact attention over the whole sequence, the latent on the wire (cp.comm's pattern)
        return self.cp.latent_attention(q, latent, self.kv_b_proj.weight, self.dims,
                                        backend=self.backend, softmax_scale=self.scale,
                                        mask=self.mask(cu_seqlens))
