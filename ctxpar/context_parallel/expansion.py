"""How a tensor on the wire becomes K,V where it arrives: the expansions of latent.py's patterns.

latent.py's ring and all-gather move one tensor per token (the "latent") and make each
visiting block's K,V on the rank that holds it, just before its attention; backward makes
them again and folds the block's dK, dV back into the latent's gradient (what travels home)
and the expansion's parameters' gradients (this rank's share, summed over CP with every
replicated parameter's). An expansion is an object with

    params             the tensors the expansion reads whose gradients the pattern returns
    v_head_dim         the width of the V it makes
    expand(rows, index) -> (k (B, L, h, dqk), v (B, L, h, dv))
    fold(rows, index, dk, dv, dparams) -> d rows (fp32); adds into dparams (fp32, params')
    heads_shard(group) -> the expansion for this rank's head group (Ulysses)

where rows (B, L, ...) are a block's latent rows and index (L,) their places in the
sequence (layout.rank_positions of the sending rank: where RoPE turns them). Two exist:

MLAExpansion (latent.py)  DeepSeek's kv_b_proj per head, its fold written by hand
FunctionExpansion (here)  any differentiable fn(rows, index, *params): Gemma 4's keys equal
                          to values (V = v_norm(raw), K = RoPE(k_norm(raw)) at the sender's
                          positions, models/attention.py), folded by autograd on the block
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch

from .layouts import rank_positions


def block_index(S: int, src: int, world: int, layout: str, lo: int, hi: int,
                device=None) -> torch.Tensor:
    """(hi - lo,) the sequence places of rows [lo, hi) of rank src's block of S tokens: the
    layout's positions over `world` ranks (a hybrid ring's: its r shards, layouts.py)."""
    return rank_positions(S * world, src, world, layout, device)[lo:hi]


class FunctionExpansion:
    """K,V = fn(rows, index, *params), differentiable in rows and params; its fold is
    autograd's on the block (made again, under grad), dK, dV cast to K,V's dtype as the
    K,V-on-the-wire patterns hand them to the layer's own autograd."""

    def __init__(self, fn: Callable, params: Sequence[torch.Tensor], v_head_dim: int):
        self.fn, self.params, self.v_head_dim = fn, tuple(params), v_head_dim

    def expand(self, rows: torch.Tensor, index: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fn(rows, index, *self.params)

    def fold(self, rows, index, dk, dv, dparams: List[torch.Tensor]) -> torch.Tensor:
        with torch.enable_grad():
            leaves = [rows.detach().requires_grad_()] + \
                     [p.detach().requires_grad_() for p in self.params]
            k, v = self.fn(*leaves[:1], index, *leaves[1:])
            grads = torch.autograd.grad((k, v), leaves, (dk.to(k.dtype), dv.to(v.dtype)),
                                        allow_unused=True)
        for acc, g in zip(dparams, grads[1:]):
            if g is not None:
                acc += g.float()
        return grads[0].float()

    def heads_shard(self, group) -> "FunctionExpansion":
        return self  # its parameters are every head's (a per-head norm's (hd,) weight)
