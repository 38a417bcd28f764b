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

MLAExpansion              DeepSeek's kv_b_proj per head (LatentDims, expand_latent), its
                          fold written by hand (latent.py's module docstring)
FunctionExpansion (here)  any differentiable fn(rows, index, *params): Gemma 4's keys equal
                          to values (V = v_norm(raw), K = RoPE(k_norm(raw)) at the sender's
                          positions, models/attention.py), folded by autograd on the block
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from .layouts import rank_positions
from .ulysses import head_shard


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


@dataclass(frozen=True)
class LatentDims:
    """The head dims of one MLA layer, by Hugging Face DeepseekV3Config's names."""

    kv_lora_rank: int
    """R: width of the compressed c_kv (512 in DeepSeek-V3)."""
    qk_nope_head_dim: int
    """dn: the per-head key/query part without RoPE (128 in V3)."""
    qk_rope_head_dim: int
    """dr: the RoPE part, one per token shared by every head (64 in V3); even (pairs)."""
    v_head_dim: int
    """dv: the per-head value width (128 in V3)."""

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                raise ValueError(f"LatentDims: {name}={x!r} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"LatentDims: qk_rope_head_dim={self.qk_rope_head_dim} must be "
                             "even (RoPE rotates pairs of dims)")

    @classmethod
    def from_config(cls, config) -> "LatentDims":
        """From any object with the four fields (a DeepseekV3Config, a model section)."""
        return cls(config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim)

    @property
    def qk_head_dim(self) -> int:  # q and the expanded k: [nope ; rope]
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # what travels per token: [c_kv ; k_rot]
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_rows_per_head(self) -> int:  # W's rows per head: [k_nope ; v]
        return self.qk_nope_head_dim + self.v_head_dim


def expand_latent(latent: torch.Tensor, weight: torch.Tensor, dims: LatentDims
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """latent (B, L, R + dr), W (H (dn + dv), R) -> k (B, L, H, dn + dr), v (B, L, H, dv),
    as DeepseekV3Attention.expand_kv (kv_b_proj, split, k_rot broadcast to every head)."""
    c_kv, k_rot = latent.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    heads = weight.shape[0] // dims.kv_b_rows_per_head
    kv = F.linear(c_kv, weight).unflatten(-1, (heads, dims.kv_b_rows_per_head))
    k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rot.unsqueeze(2).expand(-1, -1, heads, -1)), dim=-1)
    return k, v


class MLAExpansion:
    """MLA's expansion (expansion.py's interface): k, v per head from the latent by
    kv_b_proj's W (expand_latent); its fold by hand (module docstring), at R + dr wide."""

    def __init__(self, weight: torch.Tensor, dims: LatentDims):
        self.params, self.dims, self.v_head_dim = (weight,), dims, dims.v_head_dim

    def expand(self, rows, index=None):
        return expand_latent(rows, self.params[0], self.dims)

    def fold(self, rows, index, dk, dv, dparams) -> torch.Tensor:
        """dk (B, L, H, dn + dr), dv (B, L, H, dv) fp32 -> d rows (B, L, R + dr) fp32;
        dW (H (dn + dv), R) added into dparams[0]."""
        weight, dn = self.params[0], self.dims.qk_nope_head_dim
        c_kv = rows[..., :self.dims.kv_lora_rank]
        dkv = torch.cat((dk[..., :dn], dv), dim=-1).flatten(2)        # (B, L, H (dn + dv))
        dparams[0] += dkv.flatten(0, 1).T @ c_kv.flatten(0, 1).float()  # (H (dn + dv), R)
        return torch.cat((dkv @ weight.float(), dk[..., dn:].sum(2)), dim=-1)

    def heads_shard(self, group) -> "MLAExpansion":
        """W's rows of this rank's head group (ulysses.head_shard's order)."""
        heads = self.params[0].unflatten(0, (-1, self.dims.kv_b_rows_per_head))
        return MLAExpansion(head_shard(heads, group).flatten(0, 1), self.dims)
