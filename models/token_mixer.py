"""What a Block asks of its token mixer, whichever kind it is (models/mixers.py registers
the kinds): the one part of a layer that reads other tokens, so the one that talks over CP.

The Block runs every kind on one path, in three steps:

    inputs, carry = mixer.project_in(norm(x), cos, sin)  # token-local: projections, RoPE
    o = mixer.mix(inputs, cu_seqlens, cache)  # across tokens, over the CP group
    y = mixer.project_out(o, *carry)          # token-local, back to (B, T/cp, d)

``inputs`` is what mix reads, ``carry`` (tensors or None) what project_out reads besides
mix's output: attention's (q, k, v) and (gate,).

Under activation_checkpointing 'selective' a mixer whose ``selective_recompute`` is set
(attention) has project_in and project_out (with the rest of its block) replayed in
backward while mix keeps what it saved itself (the CP attention's q, k, v, output and
LSE), so the communication is never replayed. carry's tensors are arguments of the
replayed piece, which torch's checkpoint saves (activation offload moves them to the
host). A mixer that splits nothing (Gated DeltaNet, Mamba2: their conv and state run over
CP from the projections on) does all its work in its forward, ``mixer(x, cu_seqlens,
cache)``: the defaults below.

``cache`` is the layer's share of generation's cache (ctxpar.inference: a callable that
keeps k, v for attention, a LinearLayerCache for a linear mixer), None in training;
``cu_seqlens`` packed documents' boundaries, training only.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ctxpar.context_parallel import ContextParallel


class TokenMixer(nn.Module):
    """The interface (module docstring) with the defaults of a mixer that splits nothing."""

    cp: ContextParallel                 # the group and layout it mixes over (Block.use_cp)
    rotary_dim: Optional[int] = None    # the channels of a head RoPE turns; None: no RoPE
    selective_recompute: bool = False   # project_in / project_out replayed under 'selective'

    def project_in(self, x: torch.Tensor, cos, sin) -> Tuple[tuple, tuple]:
        """x (B, T/cp, d) normed -> (what mix reads, what project_out reads besides)."""
        return (x,), ()

    def mix(self, inputs: tuple, cu_seqlens=None, cache=None) -> torch.Tensor:
        """Across tokens, over self.cp (and its documents, or generation's cache)."""
        return self(inputs[0], cu_seqlens, cache)

    def project_out(self, o: torch.Tensor, *carry) -> torch.Tensor:
        """mix's output -> (B, T/cp, d), before the residual."""
        return o
