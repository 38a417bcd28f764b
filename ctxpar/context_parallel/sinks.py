"""Attention sinks (gpt-oss): one more logit per head in every query's softmax denominator.

A sink is a logit with no value: softmax over (visible keys, sink) with the sink's column
dropped (transformers' gpt-oss ``eager_attention_forward``). Every pattern first merges
its blocks into the (out, lse) of the visible keys alone (merge.py); the sink is then one
more term of that merge, applied once to the finished row:

    lse' = logaddexp(lse, sink)
    out' = out * exp(lse - lse') = out * sigmoid(lse - sink)

Backward: with (out', lse') saved, every block's kernel backward already gives the exact
dq, dk, dv of the sink softmax (the kernel's row term D = rowsum(dout * out') is the
sink softmax's, since the sink's value is zero), so no block changes. The sink's own
gradient is -sum over rows of p_sink * D with p_sink = exp(sink - lse'), summed over this
rank's rows (its share; the CP gradient reduction adds the other ranks').
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def finish(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
           sinks: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out in `dtype`, lse fp32) of finished rows, with the sinks' term when given.

    out (B, L, H, D), any dtype (fp32 accumulators: the sinks scale them before rounding);
    lse (B, H, L) fp32; sinks (H,) over these heads."""
    if sinks is None:
        return out.to(dtype), lse
    new = torch.logaddexp(lse, sinks.detach().float()[None, :, None])      # (B, H, L)
    scale = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)             # (B, L, H, 1)
    return (out.float() * scale).to(dtype), new.contiguous()


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (H,) from this rank's rows: dout, out (B, L, H, D) with the sinks'
    term applied, lse (B, H, L) fp32 likewise."""
    rows = (dout.float() * out.float()).sum(-1).transpose(1, 2)            # (B, H, L)
    p_sink = torch.exp(sinks.detach().float()[None, :, None] - lse)        # (B, H, L)
    return -(p_sink * rows).sum((0, 2)).to(sinks.dtype)
