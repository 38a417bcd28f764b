"""The block norms: RMSNorm with Gemma's (1 + w) offset, and make_norm, the norm over
d_model a config asks for (Apex's fused kernels where importable, else torch's). The
mixers' own norms stand beside them: the q/k norm over whole projections in qk_norm.py,
the gated output norms in gated_delta.py and mamba2.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.tensor_parallel import copy_to_tensor_model_parallel_region


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w) over the last dim: offset 0 is torch's RMSNorm, offset 1
    Gemma's (its weights stored as w - 1; computed in fp32 and cast back, as transformers
    does). tp_group: the norm acts on a TP rank's share of heads (model.qk_norm) with the
    weight replicated, so its gradient is summed over TP (f on the weight)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, tp_group=None,
                 device=None, dtype=None):
        super().__init__()
        self.eps, self.offset, self.tp_group = eps, offset, tp_group
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        return rms_norm(x, w, self.eps, self.offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
             ) -> torch.Tensor:
    """RMSNorm's computation with the weight given (one already through TP's f: Gemma 4's
    k_norm applied where its keys arrive, models/attention.py)."""
    if not offset:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (offset + weight.float())).type_as(x)


def make_norm(cfg: ModelConfig, device=None, dtype=None) -> nn.Module:
    """A norm over d_model: Apex's fused norm when apex is importable (GPU builds), else
    torch's; RMSNorm with model.norm_offset != 0 is ours (RMSNorm)."""
    dim = cfg.d_model
    kw = dict(eps=cfg.norm_eps, device=device, dtype=dtype)
    if cfg.norm == "rmsnorm" and cfg.norm_offset:
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_offset, device=device, dtype=dtype)
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError:
        if cfg.norm == "rmsnorm":
            return nn.RMSNorm(dim, **kw)
        return nn.LayerNorm(dim, bias=cfg.bias, **kw)
    if cfg.norm == "rmsnorm":
        return FusedRMSNorm(dim, eps=cfg.norm_eps).to(device=device, dtype=dtype)
    return FusedLayerNorm(dim, eps=cfg.norm_eps).to(device=device, dtype=dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, fp32: a weightless RMSNorm (transformers'
    Llama4TextL2Norm; Gemma 4's v_norm and its router's norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
