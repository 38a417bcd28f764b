"""Mamba2, the token mixer of 'mamba' layers (Nemotron-H's 'M' blocks).

As transformers' NemotronHMamba2Mixer computes it on its torch path, parameter for
parameter:

    z | xBC | dt = in_proj x                          widths H P, H P + 2 G N, H
    x | B | C    = silu(causal_conv1d(xBC))            depthwise, K taps, bias (use_conv_bias)
    y            = ssd(x, clamp(softplus(dt + dt_bias), time_step_min), A = -exp(A_log),
                       B, C) + D x                     per head, B/C shared in G groups
    out          = out_proj(groupnorm_rms(y * silu(z)) * w)   RMS over each of G groups

The conv and the SSD run over the model's CP group (ctxpar.context_parallel.linear: the
conv's halo, state passing or heads, cu_seqlens restarting both at each document). TP
splits it by heads and B/C groups, as Megatron's Mamba mixer: each rank holds H/tp heads
and the G/tp groups they read (in_proj by [z | x | B | C | dt] section, the conv by
[x | B | C], dt_bias, A_log, D and the norm's weight by head), out_proj by rows (one
all-reduce); a norm group never straddles ranks. Shapes per rank: (B, T/cp, .../tp).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.config.layers import mamba_dims
from ctxpar.context_parallel import ContextParallel
from ctxpar.context_parallel.linear import discretize_dt, ssd_cp, ssd_step
from ctxpar.context_parallel.linear.tiles import tiled_linear_block
from ctxpar.inference.linear_cache import LinearLayerCache
from ctxpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_model_parallel_region)
from ctxpar.tensor_parallel.layers import column_parallel_parameter
from ctxpar.tensor_parallel.mappings import tp_size_of

from .linear_tiles import SSDTiles, linear_tile, set_tile
from .options import LayerArgs
from .short_conv import DepthwiseConv
from .token_mixer import TokenMixer


class GroupedGatedRMSNorm(nn.Module):
    """w * rmsnorm_per_group(x * silu(z)) (transformers' NemotronHRMSNormGated: gate
    first, in fp32, the RMS over each of n_groups equal slices; w starts at ones). TP:
    dim and n_groups are the full ones; a rank holds n_groups/tp whole groups."""

    def __init__(self, dim: int, n_groups: int, eps: float, tp_group=None, device=None,
                 dtype=None):
        super().__init__()
        self.eps, self.n_groups = eps, n_groups // tp_size_of(tp_group)
        self.weight = column_parallel_parameter((dim,), tp_group, device=device, dtype=dtype,
                                                what="mamba heads x head_dim")

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return LeanGroupedGatedNorm.apply(x, z, self.weight, self.n_groups, self.eps)


def grouped_gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, groups: int,
                          eps: float) -> torch.Tensor:
    """w * rmsnorm_per_group(x * silu(z)), as transformers' NemotronHRMSNormGated."""
    h = (x.float() * F.silu(z.float())).unflatten(-1, (groups, -1))     # (..., G, HP/G)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.flatten(-2).to(x.dtype)


class LeanGroupedGatedNorm(torch.autograd.Function):
    """grouped_gated_rmsnorm saving x, z and w only (their dtype); backward recomputes it
    with autograd (the same operations: the same gradients), where autograd on it keeps
    four fp32 copies of the (B, T, H P) values (models/gated_delta.py's LeanGatedNorm)."""

    @staticmethod
    def forward(ctx, x, z, w, groups, eps):
        ctx.args = (groups, eps)
        ctx.save_for_backward(x, z, w)
        return grouped_gated_rmsnorm(x, z, w, groups, eps)

    @staticmethod
    def backward(ctx, dout):
        x, z, w = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (x, z, w)]
            out = grouped_gated_rmsnorm(*leaves, *ctx.args)
            wrt = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wrt, dout))
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None)


class Mamba2(SSDTiles, TokenMixer):
    """Nemotron-H's Mamba2 mixer over CP and TP (module docstring). cp: the model's
    ContextParallel (group and layout); strategy: parallel.linear_cp; tp_group: the heads'
    split (None: all heads here); tile: tokens per tile under memory.tiled_linear (0:
    untiled; models/linear_tiles.py). A token mixer that splits nothing
    (models/token_mixer.py): its forward is its mix."""

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "Mamba2":
        return cls(args.cfg, args.cp, args.linear_cp, args.tp_group, args.device, args.dtype,
                   linear_tile(args))

    def __init__(self, cfg: ModelConfig, cp: ContextParallel, strategy: str = "state",
                 tp_group=None, device=None, dtype=None, tile: int = 0):
        super().__init__()
        dims, tp = mamba_dims(cfg), tp_size_of(tp_group)
        self.cp, self.strategy, self.dims, self.tp_group = cp, strategy, dims, tp_group
        set_tile(self, tile)
        self.heads, self.groups = dims.num_heads // tp, dims.n_groups // tp  # this TP rank's
        width, bc, h = dims.num_heads * dims.head_dim, dims.n_groups * dims.state_size, \
            dims.num_heads
        sections = (width, width, bc, bc, h)                   # z | x | B | C | dt, each split
        self.split = (width // tp, (width + 2 * bc) // tp, h // tp)     # z | xBC | dt
        self.xbc_split = (width // tp, bc // tp, bc // tp)             # x | B | C
        self.in_proj = ColumnParallelLinear(cfg.d_model, sum(sections), tp_group=tp_group,
                                            bias=cfg.bias, copy_input=False, sections=sections,
                                            device=device, dtype=dtype)
        self.conv1d = DepthwiseConv(sections[1:4], dims.conv_kernel, dims.conv_bias, tp_group,
                                    device, dtype)
        per_head = dict(device=device, dtype=dtype, what="model.mamba_num_heads")
        self.dt_bias = column_parallel_parameter((h,), tp_group, **per_head)
        self.A_log = column_parallel_parameter((h,), tp_group, **per_head)
        self.D = column_parallel_parameter((h,), tp_group, **per_head)
        self.norm = GroupedGatedRMSNorm(width, dims.n_groups, cfg.norm_eps, tp_group, device,
                                        dtype)
        self.out_proj = RowParallelLinear(width, cfg.d_model, tp_group=tp_group, bias=cfg.bias,
                                          device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens=None,
                cache: Optional[LinearLayerCache] = None) -> torch.Tensor:
        """x (B, T/cp, d) normed hidden states -> (B, T/cp, d). cache: generation's
        (ctxpar/inference/linear_cache.py): prefill keeps the final state and the conv
        window, decode (T = 1, the same token on every CP rank) steps them."""
        B, T = x.shape[:2]
        dims, heads, groups = self.dims, self.heads, self.groups     # this TP rank's
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        if self.tile_tokens and cache is None:
            return tiled_linear_block(self, x, cu_seqlens, self.tile_tokens, self.strategy)
        z, xbc, dt = self.in_proj(x).split(self.split, dim=-1)
        xbc = self.conv1d(xbc, self.cp, cu_seqlens, cache)             # (B, T/cp, HP + 2GN)
        xs, Bm, Cm = xbc.split(self.xbc_split, dim=-1)
        xs = xs.view(B, T, heads, dims.head_dim)
        Bm = Bm.view(B, T, groups, dims.state_size)
        Cm = Cm.view(B, T, groups, dims.state_size)
        A, limit = -torch.exp(self.A_log.float()), (dims.time_step_min, math.inf)
        if cache is not None and cache.mode == "decode":
            dt = discretize_dt(dt[:, 0], self.dt_bias, True, limit)     # (B, H)
            y, cache.state = ssd_step(xs[:, 0], dt, A, Bm[:, 0], Cm[:, 0], cache.state, self.D)
            y = y.to(xs.dtype)[:, None]                                  # (B, 1, H, P)
        else:
            kw = dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=limit)
            if cache is not None:  # prefill: a pad token's dt is 0 (no write, no decay)
                dt = discretize_dt(dt, self.dt_bias, True, limit) * cache.valid[..., None]
                kw.update(dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf))
            y = ssd_cp(xs, dt, A, Bm, Cm, chunk_size=dims.chunk_size,
                       cp_group=self.cp.cp_group, layout=self.cp.layout,
                       strategy=self.strategy, cu_seqlens=cu_seqlens,
                       return_final_states=cache is not None, **kw)    # (B, T/cp, H, P)
            if cache is not None:
                y, cache.state = y  # every row's state after its last prompt token
        return self.out_proj(self.norm(y.flatten(2), z).to(x.dtype))  # all-reduced over TP


def init_mamba2(name: str, shape, cfg: ModelConfig, gen: torch.Generator
                ) -> Optional[torch.Tensor]:
    """The full tensor of a Mamba2 parameter whose init is its own (None: the model's
    rule): transformers' NemotronH init, A_log = log(1..H), D ones, dt_bias softplus^-1 of
    a log-uniform dt in [time_step_min, time_step_max] floored at time_step_floor; the
    norm's w ones; the conv PyTorch's depthwise default, uniform(+-1/sqrt(K))."""
    if ".mamba." not in name:
        return None
    dims = mamba_dims(cfg)
    if name.endswith("mamba.A_log"):
        return torch.arange(1, shape[0] + 1, dtype=torch.float32).log()
    if name.endswith("mamba.D") or name.endswith("mamba.norm.weight"):
        return torch.ones(shape)
    if name.endswith("mamba.dt_bias"):
        lo, hi = math.log(dims.time_step_min), math.log(dims.time_step_max)
        dt = (torch.rand(shape, generator=gen) * (hi - lo) + lo).exp()
        dt = dt.clamp(min=dims.time_step_floor)
        return dt + torch.log(-torch.expm1(-dt))                      # softplus^-1(dt)
    if name.endswith("mamba.conv1d.weight") or name.endswith("mamba.conv1d.bias"):
        bound = 1 / math.sqrt(dims.conv_kernel)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    return None
