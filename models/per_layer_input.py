"""Per-layer input embeddings (Gemma 4's PLE, model.per_layer_input_dim = p): each token
gets one p-vector per layer, made once before the blocks from the token's id and its input
embedding; each block gates its own into its output.

    e = embed(t) * sqrt(d)                                   # the input embedding (B, T/cp, d)
    z = (norm(reshape(W_proj e / sqrt(d))) + E_ple[t] * sqrt(p)) / sqrt(2)   # (B, T/cp, L, p)
    block i:  x = x + norm_i(W_up,i (gelu(W_gate,i x) * z[:, :, i]))

All token-local, so nothing travels over CP. Under TP the (V, L p) embedding is split by
vocabulary rows as the input embedding is (the largest tensor of the small Gemma 4s); the
projections and norms are replicated, their inputs the same on every TP rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.tensor_parallel import VocabParallelEmbedding

from .norms import RMSNorm, make_norm


class PerLayerInput(nn.Module):
    """z (B, T/cp, L, p) from the tokens and their input embedding (module docstring)."""

    def __init__(self, cfg: ModelConfig, tp_group, device=None, dtype=None):
        super().__init__()
        self.n_layers, self.dim, self.d = cfg.n_layers, cfg.per_layer_input_dim, cfg.d_model
        width = self.n_layers * self.dim
        self.embed = VocabParallelEmbedding(cfg.vocab_size, width, tp_group=tp_group,
                                            device=device, dtype=dtype)
        self.model_projection = nn.Linear(cfg.d_model, width, bias=False, device=device,
                                          dtype=dtype)
        self.projection_norm = RMSNorm(self.dim, cfg.norm_eps, cfg.norm_offset,
                                       device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        shape = (*tokens.shape, self.n_layers, self.dim)
        own = self.embed(tokens) * torch.tensor(self.dim ** 0.5).to(embedded.dtype)
        mixed = self.model_projection(embedded) * self.d ** -0.5  # (B, T/cp, L p)
        mixed = self.projection_norm(mixed.reshape(shape))
        return (mixed + own.reshape(shape)) * 2.0 ** -0.5  # (B, T/cp, L, p)


class PerLayerGate(nn.Module):
    """A block's use of its per-layer input z_i: x + norm(projection(gelu(input_gate x) *
    z_i)) (transformers' per_layer_input_gate, per_layer_projection,
    post_per_layer_input_norm)."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        dim, d = cfg.per_layer_input_dim, cfg.d_model
        self.input_gate = nn.Linear(d, dim, bias=False, device=device, dtype=dtype)
        self.projection = nn.Linear(dim, d, bias=False, device=device, dtype=dtype)
        self.norm = make_norm(cfg, device, dtype)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.input_gate(x), approximate="tanh") * z  # (B, T/cp, p)
        return x + self.norm(self.projection(h))
