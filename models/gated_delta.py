"""Gated DeltaNet, the token mixer of 'linear_attention' layers (Qwen3.5, Qwen3-Next).

As transformers' Qwen3_5GatedDeltaNet computes it, parameter for parameter (Qwen3.5's
separate projections; Qwen3-Next's fused in_proj_qkvz / in_proj_ba hold the same rows
grouped by key head, a permutation at import; OLMo Hybrid's q/k/v_proj and q/k/v_conv1d
are in_proj_qkv's and the conv's [q | k | v] sections, a concatenation at import: the
conv is depthwise, so one conv over [q | k | v] is the three convs):

    q|k|v = silu(causal_conv1d(in_proj_qkv x))         depthwise, K taps, no bias
    g     = -exp(A_log) * softplus(in_proj_a x + dt_bias)   per value head, fp32
    beta  = sigmoid(in_proj_b x)    (times 2 under model.linear_allow_neg_eigval: OLMo Hybrid)
    o     = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)   GQA: key heads shared
    y     = out_proj(rmsnorm(o) * w * silu(in_proj_z x))    the norm per value head

The conv and the rule run over the model's CP group (ctxpar.context_parallel.linear: the
conv's halo, state passing or heads, cu_seqlens restarting both at each document). TP
splits it by heads, as attention: each rank holds Hk/tp key heads and the Hv/tp value
heads that read them (in_proj_qkv and the conv by [q | k | v] section, in_proj_z/a/b,
dt_bias, A_log by value head), out_proj by rows (one all-reduce), the norm's (Dv,) weight
replicated (its gradient summed over TP). Shapes per rank: (B, T/cp, .../tp).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.config.layers import gated_delta_dims
from ctxpar.context_parallel import ContextParallel
from ctxpar.context_parallel.linear import gated_delta_rule_cp, gated_delta_step
from ctxpar.context_parallel.linear.tiles import tiled_linear_block
from ctxpar.inference.linear_cache import LinearLayerCache
from ctxpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_model_parallel_region)
from ctxpar.tensor_parallel.layers import column_parallel_parameter
from ctxpar.tensor_parallel.mappings import tp_size_of

from .linear_tiles import DeltaRuleTiles, linear_tile, set_tile
from .options import LayerArgs
from .short_conv import DepthwiseConv
from .token_mixer import TokenMixer


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(z) over each value head's channels (transformers'
    Qwen3_5RMSNormGated: the norm in fp32, w applied in x's dtype; w starts at ones,
    whatever model.norm_offset). tp_group: w is replicated over the TP ranks' heads, so
    its gradient is summed over TP (f on the weight)."""

    def __init__(self, dim: int, eps: float, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        w = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        return LeanGatedNorm.apply(x, z, w, self.eps)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * silu(z) as transformers' Qwen3_5RMSNormGated computes it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class LeanGatedNorm(torch.autograd.Function):
    """gated_rmsnorm saving x, z and w only (in their dtype): its backward recomputes the
    norm with autograd (the same operations, so the same gradients), where autograd on
    gated_rmsnorm keeps three fp32 and three 16-bit copies of the (B, T, Hv, Dv) values."""

    @staticmethod
    def forward(ctx, x, z, w, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, z, w)
        return gated_rmsnorm(x, z, w, eps)

    @staticmethod
    def backward(ctx, dout):
        x, z, w = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x, z, w)]
            out = gated_rmsnorm(*leaves, ctx.eps)
            wrt = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, dout))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None)


class GatedDeltaNet(DeltaRuleTiles, TokenMixer):
    """Qwen3.5's linear attention over CP and TP (module docstring). cp: the model's
    ContextParallel (group and layout, shared with attention); strategy: parallel.linear_cp;
    tp_group: the heads' split (None: all heads here); tile: tokens per tile of the block
    under memory.tiled_linear (0: untiled; models/linear_tiles.py). A token mixer that
    splits nothing (models/token_mixer.py): its forward is its mix."""

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "GatedDeltaNet":
        return cls(args.cfg, args.cp, args.linear_cp, args.tp_group, args.device, args.dtype,
                   linear_tile(args))

    def __init__(self, cfg: ModelConfig, cp: ContextParallel, strategy: str = "state",
                 tp_group=None, device=None, dtype=None, tile: int = 0):
        super().__init__()
        dims, tp = gated_delta_dims(cfg), tp_size_of(tp_group)
        self.cp, self.strategy, self.dims, self.tp_group = cp, strategy, dims, tp_group
        set_tile(self, tile)
        self.key_heads, self.value_heads = dims.num_key_heads // tp, dims.num_value_heads // tp
        key_dim = dims.num_key_heads * dims.key_head_dim
        value_dim = dims.num_value_heads * dims.value_head_dim
        sections = (key_dim, key_dim, value_dim)   # in_proj_qkv's rows, each split over TP
        self.split = tuple(n // tp for n in sections)
        col = dict(tp_group=tp_group, bias=False, copy_input=False, device=device, dtype=dtype)
        d, hv = cfg.d_model, dims.num_value_heads
        self.in_proj_qkv = ColumnParallelLinear(d, key_dim * 2 + value_dim, sections=sections,
                                                **col)
        self.in_proj_z = ColumnParallelLinear(d, value_dim, **col)
        self.in_proj_b = ColumnParallelLinear(d, hv, **col)
        self.in_proj_a = ColumnParallelLinear(d, hv, **col)
        self.conv1d = DepthwiseConv(sections, dims.conv_kernel, False, tp_group, device, dtype)
        per_head = dict(device=device, dtype=dtype, what="model.linear_num_value_heads")
        self.dt_bias = column_parallel_parameter((hv,), tp_group, **per_head)
        self.A_log = column_parallel_parameter((hv,), tp_group, **per_head)
        self.norm = GatedRMSNorm(dims.value_head_dim, dims.norm_eps, tp_group, device, dtype)
        self.out_proj = RowParallelLinear(value_dim, d, tp_group=tp_group, bias=False,
                                          device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens=None,
                cache: Optional[LinearLayerCache] = None) -> torch.Tensor:
        """x (B, T/cp, d) normed hidden states -> (B, T/cp, d). cache: generation's
        (ctxpar/inference/linear_cache.py): prefill keeps the final state and the conv
        window, decode (T = 1, the same token on every CP rank) steps them."""
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)      # f once for 4 projections
        if self.tile_tokens and cache is None:
            return tiled_linear_block(self, x, cu_seqlens, self.tile_tokens, self.strategy)
        mixed = self.conv1d(self.conv_input(x), self.cp, cu_seqlens,
                            cache)                                      # (B, T/cp, 2Hk Dk + Hv Dv)
        q, k, v, g, beta = self.rule_inputs(x, mixed)
        if cache is not None and cache.mode == "decode":
            o, cache.state = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                              cache.state, use_qk_l2norm_in_kernel=True)
            o = o.to(q.dtype)[:, None]                                   # (B, 1, Hv, Dv)
        else:
            if cache is not None:  # prefill: a pad token writes nothing, decays nothing
                beta, g = beta * cache.valid[..., None], g * cache.valid[..., None]
            o, final = gated_delta_rule_cp(q, k, v, g, beta, cp_group=self.cp.cp_group,
                                           layout=self.cp.layout, strategy=self.strategy,
                                           cu_seqlens=cu_seqlens, chunk_size=self.dims.chunk_size,
                                           output_final_state=cache is not None,
                                           use_qk_l2norm_in_kernel=True)  # (B, T/cp, Hv, Dv)
            if cache is not None:
                cache.state = final  # every row's state after its last prompt token
        return self.gated_output(x, o)

    def conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d) past f -> the conv's input [q | k | v] (B, L, 2Hk Dk + Hv Dv)."""
        return self.in_proj_qkv(x)

    def beta_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj_b(x)                                        # (B, L, Hv)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """g (B, L, Hv) fp32, the log-decay per value head."""
        return -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)

    def gated_output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """out_proj(norm(o) * silu(z)): (B, L, d), all-reduced over TP."""
        z = self.in_proj_z(x).view(*o.shape)
        return self.out_proj(self.norm(o, z).flatten(2))


def init_gated_delta(name: str, shape, cfg: ModelConfig, gen: torch.Generator
                     ) -> Optional[torch.Tensor]:
    """The full tensor of a Gated DeltaNet parameter whose init is its own (None: the
    model's rule, normal(0, init_std)): transformers' dt_bias ones and A = exp(A_log)
    uniform in [0.01, 16]; the gated norm's w ones; the conv PyTorch's default for a
    depthwise Conv1d, uniform(+-1/sqrt(K))."""
    if name.endswith("linear_attn.dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if name.endswith("linear_attn.A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=gen).log()
    if name.endswith("linear_attn.conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    return None
