"""The q/k RMSNorm over a whole projection (model.qk_norm_scope='all_heads': OLMo 2, OLMo
Hybrid), as transformers' Olmo2/OlmoHybrid attention computes it:

    q = rmsnorm(q_proj x) * w_q     over all n_heads x head_dim channels at once
    k = rmsnorm(k_proj x) * w_k     over all n_kv_heads x head_dim channels

TP splits the projection by heads, so one rank holds a slice of the channels the norm
averages over: each rank sums its channels' squares and one all-reduce over TP gives the
whole projection's (g forward, f backward: every rank's normed channels depend on every
rank's squares). The weight is split with the heads (its gradient needs no reduction).
Shapes per rank: (B, T/cp, width/tp).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ctxpar.tensor_parallel import copy_to_tensor_model_parallel_region
from ctxpar.tensor_parallel.layers import column_parallel_parameter
from ctxpar.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


class AllHeadsRMSNorm(nn.Module):
    """x / rms(x) * w over a projection of ``width`` channels, this rank holding width/tp
    of them (module docstring); computed in fp32, w applied in fp32 and cast back, as
    transformers' OlmoHybridRMSNorm does."""

    def __init__(self, width: int, eps: float, tp_group=None, device=None, dtype=None):
        super().__init__()
        self.width, self.eps, self.tp_group = width, eps, tp_group
        self.weight = column_parallel_parameter((width,), tp_group, device=device,
                                                dtype=dtype, what="the q/k norm's channels")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()                                         # (B, T/cp, width/tp)
        squares = h.pow(2).sum(-1, keepdim=True)              # this rank's channels
        if self.tp_group is not None:  # the whole width's: all-reduce, gradients summed back
            squares = copy_to_tensor_model_parallel_region(
                reduce_from_tensor_model_parallel_region(squares, self.tp_group),
                self.tp_group)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * h).to(x.dtype)
