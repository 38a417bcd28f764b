"""Kimi Delta Attention (KDA), the token mixer of 'kimi_delta_attention' layers (Kimi Linear).

As transformers' KimiLinearDeltaAttention computes it, parameter for parameter and under
its names (its forget gate a submodule, ``forget_gate.*``; A_log kept as (Hv,), the
(1, 1, Hv, 1) of transformers' a reshape at import), as a block's ``kda`` (transformers'
``self_attn``, the MLA layers' name too: a family's mapping):

    q|k|v = silu(causal_conv1d([q_proj x | k_proj x | v_proj x]))   depthwise, K taps, no bias
    g     = -exp(A_log) * softplus(f_b_proj(f_a_proj x) + dt_bias)  per key channel, fp32
    beta  = sigmoid(b_proj x)     (times 2 under model.linear_allow_neg_eigval)
    o     = kda(l2norm(q), l2norm(k), v, g, beta)         grouped key heads as fla's GVA
    y     = o_proj(rmsnorm(o) * w * sigmoid(g_b_proj(g_a_proj x)))  the norm per value head

f_a_proj and g_a_proj are low rank: d_model -> the head dim (Kimi Linear's rank). The
conv and the rule run over the model's CP group (ctxpar.context_parallel.linear.kda_cp:
the conv's halo, state passing or heads, cu_seqlens restarting both at each document).
TP splits it by heads, as Gated DeltaNet: q/k/v_proj, the conv by [q | k | v] section,
f_b_proj, dt_bias, A_log, b_proj and g_b_proj by head; f_a_proj, g_a_proj and the
norm's (Dv,) weight replicated (their gradients summed over TP: f on the weight), o_proj
by rows (one all-reduce). Shapes per rank: (B, T/cp, .../tp).
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
from ctxpar.context_parallel.linear import kda_cp, kda_step
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


class ReplicatedLinear(nn.Module):
    """A bias-free linear every TP rank holds whole (the gates' low-rank f_a_proj and
    g_a_proj), its input already past f: f on the weight sums its gradient over TP, each
    rank's share being what its heads read."""

    def __init__(self, d_in: int, d_out: int, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, copy_to_tensor_model_parallel_region(self.weight, self.tp_group))


class ForgetGate(nn.Module):
    """transformers' KimiLinearForgetGate: g (B, T, Hv, Dk) fp32 = -exp(A_log) *
    softplus(f_b_proj(f_a_proj x) + dt_bias), this rank's heads."""

    def __init__(self, d_model: int, heads: int, key_dim: int, tp_group=None, device=None,
                 dtype=None):
        super().__init__()
        self.key_dim = key_dim
        self.f_a_proj = ReplicatedLinear(d_model, key_dim, tp_group, device, dtype)
        self.f_b_proj = ColumnParallelLinear(key_dim, heads * key_dim, tp_group=tp_group,
                                             bias=False, copy_input=False, device=device,
                                             dtype=dtype)
        per_head = dict(device=device, dtype=dtype, what="model.linear_num_value_heads")
        self.dt_bias = column_parallel_parameter((heads * key_dim,), tp_group, **per_head)
        self.A_log = column_parallel_parameter((heads,), tp_group, **per_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # (B, T, Hv Dk)
        decay = -self.A_log.float().exp()[:, None]                     # (Hv, 1)
        return decay * F.softplus(f).unflatten(-1, (-1, self.key_dim))  # (B, T, Hv, Dk)


class KimiGatedNorm(nn.Module):
    """transformers' KimiLinearRMSNormGated: rmsnorm(x) * w * sigmoid(gate), all in fp32,
    over each value head's channels; w (Dv,) replicated over TP (f on the weight)."""

    def __init__(self, dim: int, eps: float, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.eps, self.tp_group = eps, tp_group
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = copy_to_tensor_model_parallel_region(self.weight, self.tp_group).float()
        return (w * h * gate.float().sigmoid()).to(x.dtype)


class KimiDeltaAttention(DeltaRuleTiles, TokenMixer):
    """Kimi Linear's KDA over CP and TP (module docstring). cp: the model's ContextParallel;
    strategy: parallel.linear_cp; tp_group: the heads' split (None: all heads here); tile:
    tokens per tile under memory.tiled_linear (0: untiled; models/linear_tiles.py). A
    token mixer that splits nothing (models/token_mixer.py): its forward is its mix."""

    rule_op = "kda"

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "KimiDeltaAttention":
        return cls(args.cfg, args.cp, args.linear_cp, args.tp_group, args.device, args.dtype,
                   linear_tile(args))

    def __init__(self, cfg: ModelConfig, cp: ContextParallel, strategy: str = "state",
                 tp_group=None, device=None, dtype=None, tile: int = 0):
        super().__init__()
        dims, tp = gated_delta_dims(cfg), tp_size_of(tp_group)
        self.cp, self.strategy, self.dims = cp, strategy, dims
        set_tile(self, tile)
        self.key_heads, self.value_heads = dims.num_key_heads // tp, dims.num_value_heads // tp
        hv, dk, dv = dims.num_value_heads, dims.key_head_dim, dims.value_head_dim
        key_dim, value_dim, d = dims.num_key_heads * dk, hv * dv, cfg.d_model
        self.tp_group, self.split = tp_group, (key_dim // tp, key_dim // tp, value_dim // tp)
        col = dict(tp_group=tp_group, bias=False, copy_input=False, device=device, dtype=dtype)
        self.q_proj = ColumnParallelLinear(d, key_dim, **col)
        self.k_proj = ColumnParallelLinear(d, key_dim, **col)
        self.v_proj = ColumnParallelLinear(d, value_dim, **col)
        self.conv1d = DepthwiseConv((key_dim, key_dim, value_dim), dims.conv_kernel, False,
                                    tp_group, device, dtype)
        self.forget_gate = ForgetGate(d, hv, dk, tp_group, device, dtype)
        self.b_proj = ColumnParallelLinear(d, hv, **col)
        self.g_a_proj = ReplicatedLinear(d, dv, tp_group, device, dtype)
        self.g_b_proj = ColumnParallelLinear(dv, value_dim, **col)
        self.o_norm = KimiGatedNorm(dv, dims.norm_eps, tp_group, device, dtype)
        self.o_proj = RowParallelLinear(value_dim, d, tp_group=tp_group, bias=False,
                                        device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens=None,
                cache: Optional[LinearLayerCache] = None) -> torch.Tensor:
        """x (B, T/cp, d) normed hidden states -> (B, T/cp, d). cache: generation's
        (ctxpar/inference/linear_cache.py): prefill keeps the final state and the conv
        window, decode (T = 1, the same token on every CP rank) steps them."""
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)     # f once for all
        if self.tile_tokens and cache is None:
            return tiled_linear_block(self, x, cu_seqlens, self.tile_tokens, self.strategy)
        mixed = self.conv1d(self.conv_input(x), self.cp, cu_seqlens,
                            cache)                             # (B, T/cp, 2 Hk Dk + Hv Dv)
        q, k, v, g, beta = self.rule_inputs(x, mixed)
        if cache is not None and cache.mode == "decode":
            o, cache.state = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                      cache.state, use_qk_l2norm_in_kernel=True)
            o = o.to(q.dtype)[:, None]                                  # (B, 1, Hv, Dv)
        else:
            if cache is not None:  # prefill: a pad token writes nothing, decays nothing
                beta, g = beta * cache.valid[..., None], g * cache.valid[..., None, None]
            o, final = kda_cp(q, k, v, g, beta, cp_group=self.cp.cp_group,
                              layout=self.cp.layout, strategy=self.strategy,
                              cu_seqlens=cu_seqlens, chunk_size=self.dims.chunk_size,
                              output_final_state=cache is not None,
                              use_qk_l2norm_in_kernel=True)            # (B, T/cp, Hv, Dv)
            if cache is not None:
                cache.state = final  # every row's state after its last prompt token
        return self.gated_output(x, o)

    def conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d) past f -> the conv's input [q | k | v] (B, L, 2Hk Dk + Hv Dv)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def beta_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.b_proj(x)                                          # (B, L, Hv)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """g (B, L, Hv, Dk) fp32, the log-decay per key channel."""
        return self.forget_gate(x)

    def gated_output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o_proj(norm(o) * sigmoid(gate)): (B, L, d), all-reduced over TP."""
        gate = self.g_b_proj(self.g_a_proj(x)).view(*o.shape)
        return self.o_proj(self.o_norm(o, gate).flatten(2))


def init_kda(name: str, shape, cfg: ModelConfig, gen: torch.Generator
             ) -> Optional[torch.Tensor]:
    """The full tensor of a KDA parameter whose init is its own (None: the model's rule,
    normal(0, init_std)), transformers' KimiLinear (fla's): A = exp(A_log) uniform in
    [1, 16]; dt_bias the inverse softplus of dt log-uniform in [1e-3, 1e-1]; the gated
    norm's w ones; the conv PyTorch's default for a depthwise Conv1d, uniform(+-1/sqrt(K))."""
    if ".kda." not in f".{name}":
        return None
    if name.endswith("forget_gate.A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith("forget_gate.dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
        dt = dt.exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("o_norm.weight"):
        return torch.ones(shape)
    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    return None
