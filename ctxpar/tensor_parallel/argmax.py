"""The greedy prediction over a vocabulary split by TP (the partner of the vocab-parallel loss
in cross_entropy.py): each rank holds logits for the ids [r*V/tp, (r+1)*V/tp)."""
from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """argmax over a vocabulary split by TP: (..., V/tp) -> (...) global ids, first max wins.

    Collective over tp_group (two all-reduces: the maximum, then the lowest id holding it,
    so ties resolve as torch.argmax does on the full row).
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits.argmax(dim=-1)
    local_max, local_idx = logits.float().max(dim=-1)
    ids = local_idx + dist.get_rank(tp_group) * logits.shape[-1]  # rank r holds [r*V/tp, ...)
    best = local_max.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=tp_group)
    ids = torch.where(local_max == best, ids, torch.full_like(ids, torch.iinfo(ids.dtype).max))
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=tp_group)  # lowest id among the maxima
    return ids
