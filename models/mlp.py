"""The dense MLP: gated (SwiGLU, GeGLU) or not (GELU, squared ReLU), split over TP by
columns then rows, tiled over tokens on request (memory/tiled_mlp.py). A block's MLP, and
a mixture of experts' shared expert (models/moe.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import Union

import torch
import torch.nn as nn

from ctxpar.config import GATED_MLPS, ModelConfig, resolved_ffn_hidden
from ctxpar.config.kv_layers import layer_ffn_hidden
from ctxpar.memory.tiled_mlp import gated_product, mark_zero3_leaf, tiled_mlp, up_activation
from ctxpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_model_parallel_region)

from .options import LayerArgs


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x), GeGLU: down(gelu(gate x) * up x) (tanh-GELU),
    GELU: down(gelu(up x)), or squared ReLU: down(relu(up x)^2) (Nemotron-H); gate/up
    split by columns. model.swiglu_limit clamps gate and up first (DeepSeek-V4).

    ``tile_tokens`` ('auto' or N; None: untiled) runs it over tiles of tokens, recomputed in
    backward, so the (B*T/cp, ffn/tp) intermediates never exist whole (memory/tiled_mlp.py).
    """

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "MLP":
        """A block's MLP, tiled under memory.tiled_mlp (memory.mlp_tile_tokens); twice as
        wide on a layer sharing K/V under model.double_wide_mlp (Gemma 4)."""
        cfg = replace(args.cfg, ffn_hidden=layer_ffn_hidden(args.cfg, args.layer.kv_source))
        return cls(cfg, args.tp_group, args.device, args.dtype, tile_tokens=args.mlp_tile)

    def __init__(self, cfg: ModelConfig, tp_group, device=None, dtype=None,
                 tile_tokens: Union[int, str, None] = None):
        super().__init__()
        self.tp_group, self.mlp, self.limit = tp_group, cfg.mlp, cfg.swiglu_limit
        self.gated = cfg.mlp in GATED_MLPS
        ffn, lin = resolved_ffn_hidden(cfg), dict(tp_group=tp_group, bias=cfg.bias,
                                                  device=device, dtype=dtype)
        if self.gated:
            self.gate_proj = ColumnParallelLinear(cfg.d_model, ffn, copy_input=False, **lin)
        self.up_proj = ColumnParallelLinear(cfg.d_model, ffn, copy_input=False, **lin)
        self.down_proj = RowParallelLinear(ffn, cfg.d_model, **lin)
        self.tile_tokens = tile_tokens
        if tile_tokens is not None:
            mark_zero3_leaf(self)  # ZeRO-3 gathers the three weights once, not per tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens is not None:  # f and g inside, once per layer
            return tiled_mlp(x, self.gate_proj if self.gated else None, self.up_proj,
                             self.down_proj, self.tp_group, self.tile_tokens, self.mlp,
                             self.limit)
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # (B, T/cp, d)
        if self.gated:
            h = gated_product(self.gate_proj(x), self.up_proj(x), self.mlp, self.limit)
        else:
            h = up_activation(self.up_proj(x), self.mlp)  # tanh-GELU or squared ReLU
        return self.down_proj(h)  # (B, T/cp, d), all-reduced over TP
