"""What a model is built with besides its ModelConfig: the run's settings and its groups;
and what each of its layers is built with.

    GPT(cfg.model, ModelGroups.from_state(state), ModelOptions.from_config(cfg))
    Block(LayerArgs(cfg.model, layer_attention(cfg.model)[i], cp, tp_group, ...))

as Megatron-Core passes one config and one bundle of process groups. ModelOptions reads the
run config in one place (GPT.from_config and GPTPipe.from_config both use it); ModelGroups
holds the groups a model's layers use (a ParallelState has them all); LayerArgs is one
layer's share of both, which every mixer kind builds itself from (models/mixers.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ctxpar.config import Config, LayerAttention, MemoryConfig, ModelConfig
from ctxpar.context_parallel import ContextParallel


@dataclass(frozen=True)
class ModelOptions:
    """Attention, recompute, memory and init settings of a model (the config's parallel,
    activation_checkpointing, memory and train sections); the defaults are the constructors'."""

    layout: str = "contiguous"               # parallel.layout: the CP token layout
    cp_comm: str = "ring"                    # parallel.cp_comm: the CP pattern
    ring_grad_dtype: str = "fp32"            # parallel.ring_grad_dtype
    attention_backend: str = "auto"          # parallel.attention_backend
    activation_checkpointing: str = "none"   # activation_checkpointing.mode
    every_n_layers: int = 1                  # activation_checkpointing.every_n_layers
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    seed: int = 1234                         # train.seed: the layout-independent init
    linear_cp: str = "state"                 # parallel.linear_cp: the linear mixers' CP

    @classmethod
    def from_config(cls, cfg: Config) -> "ModelOptions":
        return cls(layout=cfg.parallel.layout, cp_comm=cfg.parallel.cp_comm,
                   ring_grad_dtype=cfg.parallel.ring_grad_dtype,
                   attention_backend=cfg.parallel.attention_backend,
                   activation_checkpointing=cfg.activation_checkpointing.mode,
                   every_n_layers=cfg.activation_checkpointing.every_n_layers,
                   memory=cfg.memory,
                   seed=cfg.train.seed,
                   linear_cp=cfg.parallel.linear_cp)


@dataclass(frozen=True)
class ModelGroups:
    """The process groups a model's layers use; None: no TP (tp_group), the world
    (cp_group, as context_parallel_attention reads it). GPT refuses a None CP group in a
    multi-rank run."""

    tp_group: Any = None
    cp_group: Any = None
    ulysses_group: Any = None   # cp_comm 'hybrid': the inner Ulysses group
    ring_group: Any = None      # cp_comm 'hybrid': the outer ring
    ep_group: Any = None        # model.moe: the ranks the experts are split over (None: 1)
    dp_cp_group: Any = None     # model.moe: the ranks of a batch's tokens (router losses)

    @classmethod
    def from_state(cls, state) -> "ModelGroups":
        return cls(state.tp_group, state.cp_group, state.ulysses_group, state.ring_group,
                   state.ep_group, state.dp_cp_group)



@dataclass(frozen=True)
class LayerArgs:
    """What one layer's mixers are built from: each kind's ``from_layer`` reads its share
    (models/mixers.py), so a new kind needs no new argument threaded through the model."""

    cfg: ModelConfig
    layer: LayerAttention       # its kind, mixers, window, chunks, RoPE (ctxpar.config.layers)
    cp: ContextParallel         # the model's CP attention: groups, pattern, layout
    tp_group: Any = None
    ep_group: Any = None        # model.moe: the experts' EP group (None: all experts here)
    moe: bool = False           # this layer's MLP is a mixture of experts (model.moe.layers)
    backend: str = "auto"       # parallel.attention_backend
    linear_cp: str = "state"    # parallel.linear_cp: the linear mixers' CP strategy
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # memory.tiled_mlp
    selective: bool = False     # activation_checkpointing 'selective'
    device: Any = None
    dtype: Any = None
    hash_routed: bool = False   # its experts chosen by a token-id table (model.moe.hash_layers)

    @property
    def mlp_tile(self):
        """The MLPs' and experts' tokens a tile under memory.tiled_mlp (None: untiled)."""
        return self.memory.mlp_tile_tokens if self.memory.tiled_mlp else None
