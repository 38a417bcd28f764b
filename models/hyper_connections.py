"""Manifold-constrained hyper-connections (mHC; Xie et al., 2026; DeepSeek-V4 §2.2) under
model.hyper_connections: the residual stream as N parallel streams (B, T/cp, N, d).

Around each sublayer (token mixer, channel mixer) a HyperConnection reads the N streams,
flattened and RMS-normed without a weight, through one linear map fn ((2+N)N, N d) into

    pre  = sigmoid(scale_0 w_pre + b_pre) + eps         (B, T/cp, N)    collapse: the input
    post = 2 sigmoid(scale_1 w_post + b_post)           (B, T/cp, N)    expand: the output
    comb = Sinkhorn(softmax(scale_2 w_comb + b_comb) + eps)  (B, T/cp, N, N)  mix: the residual

and the block computes  x' = post * f(sum_n pre_n x_n) + comb^T x  per token. comb is made
doubly stochastic by sinkhorn_iters alternating column and row normalisations (column
first), so the mixed residual does not grow with depth. The embedding enters as N equal
copies; the HyperHead collapses the N streams (its own pre) before the final norm.

Everything here is token-local: no communication under CP (each rank's tokens), TP (the
parameters are replicated, their inputs identical on a TP group's ranks) or EP. The maps
compute in fp32 from fp32 casts of their parameters and the streams, as transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead do; the collapsed input and the mixed
streams come back in the streams' dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig

from .attention import l2_norm  # x / rms(x), no weight: DeepseekV4UnweightedRMSNorm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """(..., N, N) positive -> doubly stochastic: columns, then iters-1 times rows and columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One sublayer's mHC: fn ((2+N)N, N d), base ((2+N)N,), scale (3,) (pre, post, comb);
    transformers' ``attn_hc`` / ``ffn_hc`` (fn, base, scale) of a decoder layer."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        hc = cfg.hyper_connections
        n = hc.streams
        self.streams, self.iters, self.eps, self.norm_eps = n, hc.sinkhorn_iters, hc.eps, \
            cfg.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.d_model, device=device,
                                           dtype=dtype))
        self.base = nn.Parameter(torch.empty((2 + n) * n, device=device, dtype=dtype))
        self.scale = nn.Parameter(torch.empty(3, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, N, d) -> (collapsed (B, T, d), (post (B, T, N), comb (B, T, N, N)) fp32)."""
        n = self.streams
        flat = l2_norm(x.flatten(2).float(), self.norm_eps)  # (B, T, N d)
        mixes = F.linear(flat, self.fn.float())  # (B, T, (2+N)N)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n),
                             dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)
        return collapsed, (post, comb)


def mix_streams(x: torch.Tensor, out: torch.Tensor, mix) -> torch.Tensor:
    """The residual after a sublayer: x + out, or under mHC post * out + comb^T x over the
    streams, x (B, T, N, d), out (B, T, d), in x's dtype (transformers' decoder layer)."""
    if mix is None:
        return x + out
    post, comb = mix
    return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(x.dtype).transpose(-1, -2), x)


class HyperHead(nn.Module):
    """The streams' last collapse, before the final norm: fn (N, N d), base (N,), scale (1,)
    (transformers' ``hc_head``: hc_fn, hc_base, hc_scale)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        n = cfg.hyper_connections.streams
        self.eps, self.norm_eps = cfg.hyper_connections.eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * cfg.d_model, device=device, dtype=dtype))
        self.base = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
        self.scale = nn.Parameter(torch.empty(1, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, N, d) -> (B, T, d)."""
        flat = l2_norm(x.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float()
                            + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def expand_streams(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The embedding (B, T, d) as model.hyper_connections.streams equal streams (B, T, N, d)."""
    n = cfg.hyper_connections.streams
    return x.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


def residual_shape(cfg: ModelConfig) -> tuple:
    """A token's residual between blocks: (N, d) under model.hyper_connections, else (d,)."""
    hc = cfg.hyper_connections
    return (cfg.d_model,) if hc is None else (hc.streams, cfg.d_model)


def hyper_connection(cfg: ModelConfig, present: bool, device=None,
                     dtype=None) -> Optional[HyperConnection]:
    """A sublayer's HyperConnection under model.hyper_connections, else None."""
    return HyperConnection(cfg, device, dtype) if present and cfg.hyper_connections else None


def init_hyper_connections(name: str, shape, cfg: ModelConfig,
                           g: torch.Generator) -> Optional[torch.Tensor]:
    """transformers' init of the mHC maps: fn normal(0, init_std), base zeros, scale ones."""
    if not name.startswith("hc_head.") and "_hc." not in name:
        return None
    if name.endswith(".fn"):
        return torch.empty(shape).normal_(0.0, cfg.init_std, generator=g)
    return torch.zeros(shape) if name.endswith(".base") else torch.ones(shape)
