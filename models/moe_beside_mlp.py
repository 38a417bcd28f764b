"""Gemma 4's experts beside the dense MLP (model.moe.beside_mlp; transformers'
Gemma4TextDecoderLayer with enable_moe_block): a block's channel mixer of two branches
summed, the dense MLP on the block's normed x, the experts on x normed again, each branch
normed on its way out; the Block's post_mlp_norm then norms the sum.

    h_1 = dense_norm(mlp(mlp_norm x))                 # the Block's mlp_norm, then MLP
    h_2 = post_experts_norm(experts(experts_norm x))  # routed by the router on x itself
    x   = x + post_mlp_norm(h_1 + h_2)

    GPT (layers.{i}.mlp.)            Hugging Face (model.layers.{i}.)
    dense.{gate,up,down}_proj        mlp.{gate,up,down}_proj (2x wide on a layer sharing
                                     K/V under model.double_wide_mlp)
    dense_norm.weight                post_feedforward_layernorm_1.weight
    experts_norm.weight              pre_feedforward_layernorm_2.weight
    post_experts_norm.weight         post_feedforward_layernorm_2.weight
    gate.weight, gate.scale,         router.proj.weight, router.scale,
      gate.per_expert_scale            router.per_expert_scale (model.moe.scaled_router)
    experts.gate_up_proj, down_proj  experts.gate_up_proj, down_proj

The experts, their router, EP, TP and tiling are models/moe.py's MoE, which this extends:
GPT finds it as a MoE layer (router statistics, the aux-free bias), and it holds the
dense branch and the three norms besides.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ctxpar.config.kv_layers import layer_ffn_hidden

from .mlp import MLP
from .moe import MoE
from .norms import make_norm
from .options import LayerArgs


class MoEBesideMLP(MoE):
    """The module docstring's channel mixer; forward(normed, x) reads the block's x too
    (``sees_residual``: the Block hands it both)."""

    sees_residual = True

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "MoEBesideMLP":
        return cls(args, args.mlp_tile)

    def __init__(self, args: LayerArgs, tile=None):
        cfg = args.cfg
        super().__init__(cfg, args.tp_group, args.ep_group, args.device, args.dtype, tile)
        width = layer_ffn_hidden(cfg, args.layer.kv_source)
        self.dense = MLP(replace(cfg, ffn_hidden=width), args.tp_group, args.device,
                         args.dtype, tile_tokens=tile)
        norm = dict(cfg=cfg, device=args.device, dtype=args.dtype)
        self.dense_norm = make_norm(**norm)
        self.experts_norm = make_norm(**norm)
        self.post_experts_norm = make_norm(**norm)

    def forward(self, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """normed = mlp_norm(x), x the block's (B, T/cp, d) -> h_1 + h_2 (B, T/cp, d)."""
        dense = self.dense_norm(self.dense(normed))
        routed = super().forward(self.experts_norm(x), router_input=x)
        return dense + self.post_experts_norm(routed)
