"""Between full-size tensors and this rank's TP shards, driven by the parameter attributes.

A parameter with ``tensor_model_parallel`` set holds chunk ``tp_rank`` of the full tensor
along ``partition_dim`` (``partition_stride`` 1: no interleaved fused weights here), or,
with ``partition_sections`` (a fused parameter's parts, full sizes), chunk ``tp_rank`` of
each part, concatenated; any other parameter is replicated over TP and is its own full
tensor. That one rule serves
the deterministic init (full tensor -> slice), loading a tp=1 checkpoint into any TP
degree, and gathering a sharded model back into a single-process state dict.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from .mappings import gather_along, split_along, tp_size_of


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def expert_shard(param: torch.Tensor) -> Tuple[int, int]:
    """(this EP rank, ep): a mixture of experts' tensor holds experts
    [rank E/ep, (rank + 1) E/ep) of dim 0 (models/moe.py); (0, 1) for any other."""
    return getattr(param, "expert_shard", (0, 1))


def full_shape(param: torch.Tensor, tp_size: int) -> torch.Size:
    """The unsharded shape of a (possibly) TP- or EP-split parameter."""
    shape = list(param.shape)
    shape[0] *= expert_shard(param)[1]
    if is_tensor_parallel(param):
        assert getattr(param, "partition_stride", 1) == 1, "strided partitions not supported"
        shape[param.partition_dim] *= tp_size
    return torch.Size(shape)


def partition_sections(param: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """A fused TP parameter's parts along partition_dim (full sizes), else None."""
    return getattr(param, "partition_sections", None) if is_tensor_parallel(param) else None


def shard_full_tensor(full: torch.Tensor, param: torch.Tensor, tp_group) -> torch.Tensor:
    """This rank's slice of ``full`` for ``param`` (the full tensor itself if replicated)."""
    ep_rank, ep = expert_shard(param)
    full = full.chunk(ep, dim=0)[ep_rank] if ep > 1 else full
    if not is_tensor_parallel(param):
        return full
    dim, sections = param.partition_dim, partition_sections(param)
    if sections is None or tp_size_of(tp_group) == 1:
        return split_along(full, tp_group, dim)
    return torch.cat([split_along(part, tp_group, dim)
                      for part in full.split(sections, dim=dim)], dim=dim)


def gather_full_tensor(local: torch.Tensor, param: torch.Tensor, tp_group,
                       ep_group=None) -> torch.Tensor:
    """The full-size tensor of which ``local`` is this rank's shard, split like ``param``
    (collective over TP for split parameters, then over the EP group for a mixture of
    experts' tensors; a copy of ``local`` for replicated ones)."""
    tp = tp_size_of(tp_group)
    full = local.detach().clone()
    if is_tensor_parallel(param) and tp > 1:
        dim, sections = param.partition_dim, partition_sections(param)
        full = gather_along(full, tp_group, dim)  # [rank 0's | rank 1's | ...]
        if sections is not None:
            ranks = [shard.split([n // tp for n in sections], dim=dim)
                     for shard in full.chunk(tp, dim=dim)]  # each rank's [part 0 | ...]
            full = torch.cat([torch.cat(parts, dim=dim) for parts in zip(*ranks)], dim=dim)
    if expert_shard(param)[1] > 1:
        if ep_group is None:
            raise ValueError("an expert-parallel tensor needs its EP group to be gathered")
        full = gather_along(full, ep_group, 0)  # experts in EP rank order
    return full


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, tp_group, grads: bool = False,
                           ep_group=None) -> Dict[str, torch.Tensor]:
    """Full-size parameters (or their .grad with grads=True) by name, as a tp=1 model has them.

    Collective over the TP group (and ep_group for a mixture of experts' tensors; every
    rank calls it, same order); each rank gets the whole dict. A parameter without a gradient maps to zeros when grads=True.
    """
    out = {}
    for name, p in model.named_parameters():
        local = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        out[name] = gather_full_tensor(local, p, tp_group, ep_group)
    return out


@torch.no_grad()
def load_full_state_dict_(model: nn.Module, full: Dict[str, torch.Tensor], tp_group) -> None:
    """Copy this rank's slice of every full-size tensor into the sharded model (no comm)."""
    missing = [n for n, _ in model.named_parameters() if n not in full]
    if missing:
        raise KeyError(f"full state dict lacks parameters {missing[:5]}")
    tp_size = tp_size_of(tp_group)
    for name, p in model.named_parameters():
        if tuple(full[name].shape) != tuple(full_shape(p, tp_size)):
            raise ValueError(f"{name}: full shape {tuple(full[name].shape)} != expected "
                             f"{tuple(full_shape(p, tp_size))} at tp={tp_size}")
        p.copy_(shard_full_tensor(full[name], p, tp_group))
