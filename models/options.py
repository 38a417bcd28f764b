"""The run config's settings a model is built with, read from the config in one place.

GPT.from_config and GPTPipe.from_config both pass
``ModelOptions.from_config(cfg).kwargs()`` to their constructors; the process groups come
from the ParallelState they are given.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict

from ctxpar.config import Config, MemoryConfig


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

    @classmethod
    def from_config(cls, cfg: Config) -> "ModelOptions":
        return cls(layout=cfg.parallel.layout, cp_comm=cfg.parallel.cp_comm,
                   ring_grad_dtype=cfg.parallel.ring_grad_dtype,
                   attention_backend=cfg.parallel.attention_backend,
                   activation_checkpointing=cfg.activation_checkpointing.mode,
                   every_n_layers=cfg.activation_checkpointing.every_n_layers,
                   memory=cfg.memory,
                   seed=cfg.train.seed)

    def kwargs(self) -> Dict[str, Any]:
        """The constructors' keyword arguments (memory stays the config's object)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
