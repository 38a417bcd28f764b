"""What ctxpar's library code needs of a model: the seam between ctxpar/ and models/.

ctxpar never imports a model (tests/test_imports.py holds it to that); the entry points
(train.py, generate.py, tools/) build one and hand it in. A model family that lands in
models/ fits the library when it offers what this page lists; models.gpt.GPT does.

    CausalLM        the whole model on one rank (evaluation, generation, checkpoints)
        cfg                    the ModelConfig it was built from; its parameters are the
                               ones ctxpar.config.parameters describes for cfg (GPT's names
                               and TP splits; the model checks itself when it is built)
        tp_group               its tensor-parallel group (None: no TP)
        named_parameters()     in GPT's names (ctxpar/checkpoint/names.py)
        hidden_states(tokens, positions, kv_cache=None, cu_seqlens=None)
                               the final-normed (B, T/cp, d); with a KVCache each block i
                               attends through kv_cache.layer(i)(q, k, v, core, mask)
                               instead of its CP attention, mask its AttentionMask
                               (window, chunks, sinks; ctxpar/inference/kv_cache.py)
        head_weight()          the (V/tp, d) head weight (the embedding's when tied)
        lm_logits(x)           vocab-parallel logits (..., V/tp) of hidden states

A whole model on the meta device at a run's TP degree ("whole_model") is what the
checkpoint code reads names and TP attributes from (universal_checkpoint_info, restore).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .config import ModelConfig


@runtime_checkable
class CausalLM(Protocol):
    cfg: ModelConfig
    tp_group: object

    def named_parameters(self, *args, **kwargs): ...

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache=None,
                      cu_seqlens=None) -> torch.Tensor: ...

    def head_weight(self) -> torch.Tensor: ...

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor: ...
