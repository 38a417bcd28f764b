"""The short causal convolution the linear mixers run before their core (Gated DeltaNet's
over [q | k | v], Mamba2's over [x | B | C]): transformers' depthwise nn.Conv1d parameters
under the same names, split over TP by the channel sections it convolves, the conv itself
over the model's CP group with its halo of K - 1 tokens (ctxpar.context_parallel.linear's
causal_conv1d_cp); in generation, one token at a time from the cache's window.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ctxpar.context_parallel import ContextParallel
from ctxpar.context_parallel.linear import causal_conv1d_cp, conv_step
from ctxpar.inference.linear_cache import LinearLayerCache
from ctxpar.tensor_parallel.layers import column_parallel_parameter


class DepthwiseConv(nn.Module):
    """Holds transformers' nn.Conv1d parameters, (C, 1, K) weight and (C,) bias, under
    the same names, split over TP by channel ``sections`` (the fused projection's parts
    it convolves); the causal conv itself runs over CP (causal_conv1d_cp)."""

    def __init__(self, sections, kernel: int, bias: bool, tp_group=None, device=None,
                 dtype=None):
        super().__init__()
        channels, kw = sum(sections), dict(device=device, dtype=dtype, what="conv channels")
        self.weight = column_parallel_parameter((channels, 1, kernel), tp_group, sections, **kw)
        self.bias = (column_parallel_parameter((channels,), tp_group, sections, **kw)
                     if bias else None)

    def forward(self, x: torch.Tensor, cp: ContextParallel, cu_seqlens,
                cache: Optional[LinearLayerCache] = None) -> torch.Tensor:
        # (B, T/cp, C) -> silu(conv) (B, T/cp, C), the K - 1 tokens before from the ranks before
        if cache is not None and cache.mode == "decode":  # one token (B, 1, C), its window
            out, cache.conv = conv_step(cache.conv, x[:, 0], self.weight.squeeze(1),
                                        self.bias, "silu")
            return out.to(x.dtype)[:, None]
        if cache is not None:  # prefill: keep each row's last K - 1 inputs for decoding
            cache.conv = cache.prefill_window(x, self.weight.shape[-1] - 1)
        return causal_conv1d_cp(x, self.weight.squeeze(1), self.bias, activation="silu",
                                cp_group=cp.cp_group, layout=cp.layout,
                                cu_seqlens=cu_seqlens)
