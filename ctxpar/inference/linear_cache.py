"""The linear layers' generation state under CP: each Gated DeltaNet, KDA or Mamba2 layer's
recurrent state and conv window, the same on every CP rank.

    prefill  the layer runs its training CP op (state passing or heads) on this rank's
             shard of the padded prompts, with the padding made a no-op (a pad token
             writes nothing and decays nothing; pads sit after every prompt token of their
             row), so the sequence's final state, which the op returns on every rank, is
             each row's state after its last prompt token. The conv window, the K - 1
             conv inputs before the next position, comes from the ranks that hold them
             (conv_window: one all-reduce of (B, K-1, C), exact: one rank holds each).
    decode   every CP rank steps the recurrence on the same token (conv_step, then
             gated_delta_step, kda_step or ssd_step): replicated, as the rest of a decode
             step is outside attention; no communication.

Memory per rank and layer: the state (B, H, Dk, Dv) or (B, H, P, N) fp32 and the window
(B, K-1, C), independent of the prompt's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .cp_ops import group_rank_and_size

LINEAR_MIXERS = ("gated_delta", "kda", "mamba2")  # the token mixers (LayerAttention) cached


@dataclass
class LinearLayerCache:
    """One linear layer's state on this rank; the layer reads the mode and the prompt's
    shape, and writes ``state`` and ``conv`` (models/gated_delta.py, models/mamba2.py)."""

    cp_group: object = None
    mode: Optional[str] = None               # 'prefill' or 'decode'
    valid: Optional[torch.Tensor] = None     # (B, T/cp) bool: prompt tokens, not padding
    positions: Optional[torch.Tensor] = None  # (T/cp,) this rank's global positions
    lengths: Optional[torch.Tensor] = None   # (B,) prompt lengths
    state: Optional[torch.Tensor] = None     # the recurrent state, fp32
    conv: Optional[torch.Tensor] = None      # (B, K-1, C) the conv inputs before the next token

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv)
                   if t is not None)

    def prefill_window(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width, C): the conv inputs x (B, T/cp, C) at each row's positions
        len - width .. len - 1 (zeros before position 0), gathered over CP."""
        return conv_window(x, self.positions, self.lengths, width, self.cp_group)


def conv_window(x: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, width: int,
                cp_group) -> torch.Tensor:
    """(B, width, C) of x (B, T/cp, C), this rank's tokens at global `positions` (T/cp,):
    row b's values at positions lengths[b] - width .. lengths[b] - 1, zeros where a
    position is negative or on another rank, then summed over CP (each position is on one
    rank: the sum is that rank's values, exactly)."""
    want = lengths[:, None] - width + torch.arange(width, device=x.device)  # (B, width)
    hit = positions[None, None, :] == want[:, :, None]                    # (B, width, T/cp)
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    picked = x[rows, hit.int().argmax(-1)]                                # (B, width, C)
    out = torch.where(hit.any(-1, keepdim=True), picked, torch.zeros((), dtype=x.dtype,
                                                                     device=x.device))
    if group_rank_and_size(cp_group)[1] > 1:
        dist.all_reduce(out, group=cp_group)
    return out
