"""What a linear mixer supplies to run its block over tiles (memory.tiled_linear):
ctxpar.context_parallel.linear.tiles runs the tiles, these say what one tile is.

    tile(x, state, tail, docs)          the block on one tile from (state, conv tail)
    summary_tile(x, state, tail, docs)  its state passing summary (M, E) carried a tile on
                                        (cp > 1: before the composition gives the state)

DeltaRuleTiles serves Gated DeltaNet and KDA (their tile differs only in the inputs and
gates the mixer computes: ``conv_input``, ``rule_inputs``, ``gated_output``), SSDTiles
Mamba2. Each tile calls the mixer's own pieces and the local kernel of its op
(kernels.get_kernel: the lean torch kernel or the GPU library's), so a tile computes
what the untiled block computes on those tokens.
"""
from __future__ import annotations

import math

import torch

from ctxpar.context_parallel.linear.api import _gdn_combine, _ssd_combine
from ctxpar.context_parallel.linear.kernels import get_kernel
from ctxpar.context_parallel.linear.ssd import discretize_dt
from ctxpar.context_parallel.linear.tiles import conv_tile
from ctxpar.memory.tiled_mlp import mark_zero3_leaf


def _conv(mixer, x, tail, docs):
    """The tile's conv output (B, L, C) and the next tail."""
    conv = mixer.conv1d
    return conv_tile(mixer.conv_input(x), tail, conv.weight.squeeze(1), conv.bias, docs)


class DeltaRuleTiles:
    """Tiles of a delta-rule mixer (GDN: op 'gated_delta', KDA: 'kda'), and the rule's
    inputs both compute the same way. The mixer has dims, key_heads, value_heads, split,
    conv1d and conv_input(x), beta_input(x), decay(x) -> g fp32, gated_output(x, o)."""

    rule_op = "gated_delta"

    def rule_inputs(self, x: torch.Tensor, mixed: torch.Tensor):
        """(q, k (B, L, Hk, Dk), v (B, L, Hv, Dv), g fp32, beta (B, L, Hv)) from x past f
        and the conv's output [q | k | v]; heads on this TP rank."""
        B, T = x.shape[:2]
        dims = self.dims
        q, k, v = mixed.split(self.split, dim=-1)
        q = q.view(B, T, self.key_heads, dims.key_head_dim)            # (B, L, Hk, Dk)
        k = k.view(B, T, self.key_heads, dims.key_head_dim)
        v = v.view(B, T, self.value_heads, dims.value_head_dim)        # (B, L, Hv, Dv)
        beta = self.beta_input(x).sigmoid()                            # (B, L, Hv)
        if dims.allow_neg_eigval:  # beta in [0, 2]: I - beta k k^T may flip a direction
            beta = beta * 2.0
        return q, k, v, self.decay(x), beta

    def tile_shapes(self):
        dims = self.dims
        state = (self.value_heads, dims.key_head_dim, dims.value_head_dim)
        return state, sum(self.split), dims.conv_kernel

    def summary_shapes(self):
        """[M | E] (Hv, Dk, Dk + Dv): state passing's widened state (api._gated_delta_state)."""
        (hv, dk, dv), channels, kernel = self.tile_shapes()
        return (hv, dk, dk + dv), channels, kernel

    def _rule(self, q, k, v, g, beta, state, docs):
        dk = q.shape[-1]
        kernel = get_kernel(self.rule_op, "auto", q, key_dim=dk, value_dim=v.shape[-1])
        return kernel(q, k, v, g, beta, scale=dk ** -0.5, initial_state=state, docs=docs,
                      chunk_size=self.dims.chunk_size, use_qk_l2norm_in_kernel=True)

    def tile(self, x, state, tail, docs):
        mixed, tail = _conv(self, x, tail, docs)
        q, k, v, g, beta = self.rule_inputs(x, mixed)
        o, state = self._rule(q, k, v, g, beta, state, docs)            # (B, L, Hv, Dv)
        return self.gated_output(x, o.to(q.dtype)), state, tail

    def summary_tile(self, x, state, tail, docs):
        mixed, tail = _conv(self, x, tail, docs)
        q, k, v, g, beta = self.rule_inputs(x, mixed)
        v_wide = torch.cat([v.new_zeros(*v.shape[:-1], q.shape[-1]), v], dim=-1)
        _, state = self._rule(q, k, v_wide, g, beta, state, docs)      # [M | E] carried on
        return x.new_empty(*x.shape[:2], 0), state, tail

    def summary_start(self, carry: torch.Tensor) -> torch.Tensor:
        """[I | 0] per row, I zero where the row's first token starts a document."""
        (hv, dk, width), _, _ = self.summary_shapes()
        eye = torch.eye(dk, device=carry.device) * carry[:, None, None, None]
        return torch.cat([eye.expand(-1, hv, dk, dk),
                          carry.new_zeros(len(carry), hv, dk, width - dk)], dim=-1)

    def summary_combine(self, summary, state):
        return _gdn_combine(self.dims.key_head_dim, summary, state)


class SSDTiles:
    """Tiles of Mamba2 (models/mamba2.py's names: in_proj, split, xbc_split, conv1d,
    dt_bias, A_log, D, norm, out_proj)."""

    def tile_shapes(self):
        dims = self.dims
        return (self.heads, dims.head_dim, dims.state_size), self.split[1], dims.conv_kernel

    def summary_shapes(self):
        """[E flattened | M] (H, P N + 1): api._ssd_state's summary."""
        (h, p, n), channels, kernel = self.tile_shapes()
        return (h, p * n + 1), channels, kernel

    def conv_input(self, x):
        return self.in_proj(x).split(self.split, dim=-1)[1]

    def _inputs(self, x, tail, docs):
        """(z, x heads, dt discretized, B, C, A) of one tile, and the next tail."""
        B, L = x.shape[:2]
        dims = self.dims
        z, xbc, dt = self.in_proj(x).split(self.split, dim=-1)
        conv = self.conv1d
        xbc, tail = conv_tile(xbc, tail, conv.weight.squeeze(1), conv.bias, docs)
        xs, Bm, Cm = xbc.split(self.xbc_split, dim=-1)
        dt = discretize_dt(dt, self.dt_bias, True, (dims.time_step_min, math.inf))
        return (z, xs.view(B, L, self.heads, dims.head_dim),
                dt, Bm.view(B, L, self.groups, dims.state_size),
                Cm.view(B, L, self.groups, dims.state_size),
                -torch.exp(self.A_log.float())), tail

    def _scan(self, xs, dt, A, Bm, Cm, state, docs):
        kernel = get_kernel("ssd", "auto", xs)
        return kernel(xs, dt, A, Bm, Cm, self.D, state, docs, self.dims.chunk_size)

    def tile(self, x, state, tail, docs):
        (z, xs, dt, Bm, Cm, A), tail = self._inputs(x, tail, docs)
        y, state = self._scan(xs, dt, A, Bm, Cm, state, docs)          # (B, L, H, P)
        return self.out_proj(self.norm(y.to(xs.dtype).flatten(2), z).to(x.dtype)), state, tail

    def summary_tile(self, x, state, tail, docs):
        (z, xs, dt, Bm, Cm, A), tail = self._inputs(x, tail, docs)
        E, M = state[..., :-1].unflatten(-1, self.tile_shapes()[0][1:]), state[..., -1]
        _, E = self._scan(xs, dt, A, Bm, Cm, E, docs)                   # the state from zero
        M = M * (dt * A).sum(1).exp()                                    # (B, H) decay
        if docs is not None:  # a document starting inside the tile: nothing reaches its end
            M = M * (docs.device[:, -1] == docs.device[:, 0]).to(M.dtype)[:, None]
        return x.new_empty(*x.shape[:2], 0), torch.cat([E.flatten(2), M[..., None]], -1), tail

    def summary_start(self, carry: torch.Tensor) -> torch.Tensor:
        """[0 | carry] per row: M starts at one where the row continues the state."""
        (h, width), _, _ = self.summary_shapes()
        return torch.cat([carry.new_zeros(len(carry), h, width - 1),
                          carry[:, None, None].expand(-1, h, 1)], dim=-1)

    def summary_combine(self, summary, state):
        return _ssd_combine(self.tile_shapes()[0][1:], summary, state)


def linear_tile(args) -> int:
    """Tokens per tile of a linear block from a layer's LayerArgs: memory.linear_tile_tokens
    under memory.tiled_linear, 0 (untiled) otherwise."""
    return args.memory.linear_tile_tokens if args.memory.tiled_linear else 0


def set_tile(mixer, tile: int) -> None:
    """mixer.tile_tokens = tile; a tiled mixer is also a ZeRO-3 leaf (tiled_mlp's
    mark_zero3_leaf): DeepSpeed gathers all its parameters on entry to its forward and to
    its backward (the hooks on its outputs), which the tiles' forward and the recomputing
    backward (ChunkedScan's) both run inside, and reduces their gradients once, after the
    mixer's backward, where ChunkedScan returns them summed over tiles. Its children are
    not hooked: the tiles call them, per tile, on parameters already gathered."""
    mixer.tile_tokens = tile
    if tile:
        mark_zero3_leaf(mixer)
