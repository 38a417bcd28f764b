"""The mixers a Block is made of, by kind: one registry, read once per layer.

    TOKEN_MIXERS[layer.token_mixer]    'attention', 'mla', 'dsa', 'compressed', 'gated_delta', 'kda',
                                       'mamba2' (None: none)
    CHANNEL_MIXERS[kind]               'mlp', or 'moe' where model.moe.layers says
                                       ('moe_beside_mlp' under model.moe.beside_mlp)

A layer's kinds come from its type (ctxpar.config.layer_mixers.LAYER_MIXERS, which the
config validates model.layer_types against and the planner and the Hugging Face exchange
read too). Each kind is a module in a file of its own that builds itself from the layer's
LayerArgs (``from_layer``, models/options.py): a token mixer offers the interface of
models/token_mixer.py, a channel mixer maps x (B, T/cp, d) to (B, T/cp, d). As
Megatron-Core's submodule specs and transformers' ALL_ATTENTION_FUNCTIONS: the Block
never names a kind. A new kind is its file and a line here (docs/development.md,
"Adding a token mixer").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

from ctxpar.config import LayerAttention, ModelConfig

from .attention import Attention
from .compressed_attention import CompressedAttention
from .gated_delta import GatedDeltaNet, init_gated_delta
from .kda import KimiDeltaAttention, init_kda
from .mamba2 import Mamba2, init_mamba2
from .dsa import DSA
from .mla import MLA
from .mlp import MLP
from .moe import MoE
from .moe_beside_mlp import MoEBesideMLP
from .options import LayerArgs
from .token_mixer import TokenMixer

# (name, full shape, cfg, generator) -> the full tensor, or None: not this rule's parameter
InitRule = Callable[[str, tuple, ModelConfig, torch.Generator], Optional[torch.Tensor]]


@dataclass(frozen=True)
class TokenMixerKind:
    attribute: str                        # the Block's submodule: layers.N.<attribute>.*,
    #                                       Hugging Face's name (checkpoints depend on it)
    build: Callable[[LayerArgs], TokenMixer]
    init: Optional[InitRule] = None       # its parameters' own init (None: the model's)


TOKEN_MIXERS: Dict[str, TokenMixerKind] = {
    "attention": TokenMixerKind("attn", Attention.from_layer),
    "gated_delta": TokenMixerKind("linear_attn", GatedDeltaNet.from_layer, init_gated_delta),
    "mamba2": TokenMixerKind("mamba", Mamba2.from_layer, init_mamba2),
    "mla": TokenMixerKind("attn", MLA.from_layer),
    "dsa": TokenMixerKind("attn", DSA.from_layer),
    "kda": TokenMixerKind("kda", KimiDeltaAttention.from_layer, init_kda),
    "compressed": TokenMixerKind("attn", CompressedAttention.from_layer),  # DeepSeek-V4
}

CHANNEL_MIXERS: Dict[str, Callable[[LayerArgs], nn.Module]] = {  # the Block's `mlp`
    "mlp": MLP.from_layer,
    "moe": MoE.from_layer,
    "moe_beside_mlp": MoEBesideMLP.from_layer,  # Gemma 4: the experts and the dense MLP
}

# The mixers' own init rules, asked before the model's (models/gpt.py init_parameters_).
INIT_RULES = tuple(kind.init for kind in TOKEN_MIXERS.values() if kind.init is not None)


def token_mixer_kind(layer: LayerAttention) -> Optional[TokenMixerKind]:
    """The layer's token mixer; None for a block without one (Nemotron-H's 'mlp')."""
    return None if layer.token_mixer is None else TOKEN_MIXERS[layer.token_mixer]


def channel_mixer_builder(args: LayerArgs) -> Optional[Callable[[LayerArgs], nn.Module]]:
    """The layer's channel mixer: its type's, a mixture of experts in an MLP's place on
    model.moe's layers (beside the MLP under model.moe.beside_mlp); None for a block without
    one (Nemotron-H's 'mamba', 'attention')."""
    kind = args.layer.channel_mixer
    if kind is None:
        return None
    if args.moe:
        kind = "moe_beside_mlp" if args.cfg.moe.beside_mlp else "moe"
    return CHANNEL_MIXERS[kind]
