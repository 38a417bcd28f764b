"""A capacity factor (model.moe.capacity_factor): each expert takes at most

    capacity = ceil(capacity_factor * N * k / E)

of the N k assignments of the N tokens this rank routes (GShard, Switch Transformer); the
rest are dropped: the token gets nothing from that expert (its other choices and the
shared expert still count, and the residual carries it past the layer). Assignments are
taken in token order, a token's k choices in their order (Switch's "first come, first
served"; Megatron-Core's drop_policy 'position').

N is this rank's tokens, so which assignments drop depends on how the batch is split over
ranks: a capacity factor makes the layout part of the model (dropless, the default, does
not). The routers' losses and the aux-free counts see the router's choice before dropping.
"""
from __future__ import annotations

import math

import torch


def drop_over_capacity(experts: torch.Tensor, num_experts: int,
                       capacity_factor: float) -> torch.Tensor:
    """experts (N, k) -> (N, k): the assignments past their expert's capacity set to -1."""
    N, k = experts.shape
    capacity = math.ceil(capacity_factor * N * k / num_experts)
    flat = experts.reshape(-1)                                    # token-major (t, j)
    order = torch.argsort(flat, stable=True)                      # by expert, token order
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts                     # each expert's first slot
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return torch.where(place < capacity, flat, torch.full_like(flat, -1)).view(N, k)
