"""What every CP attention entry point does with its arguments before any collective.

context_parallel_attention (api.py) and latent_attention (latent_api.py) share these: the
comms, the groups left at None, the CP degree of a call, the mask from either form.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .comm import LOCAL, group_rank_and_size
from .documents import check_cu_seqlens
from .mask import AttentionMask, with_chunks

CP_COMMS = ("ring", "allgather", "ulysses", "hybrid")


def world_group(group, caller: str = "", name: str = ""):
    """A group left at None is the world: the default process group when one exists, else
    this lone rank. For hybrid's groups (name given) a world of more than one rank is
    refused: Ulysses and the ring cannot both span it."""
    if group is not None:
        return group
    if not dist.is_initialized():
        return LOCAL
    if name and dist.get_world_size() > 1:
        raise ValueError(f"{caller}: comm='hybrid' needs {name} (e.g. a ParallelState's); "
                         f"None is the world of {dist.get_world_size()} ranks")
    return None


def cp_group_size(comm: str, cp_group, ulysses_group, ring_group) -> int:
    """The CP degree P of a call: cp_group's size, or u x r under 'hybrid'."""
    if comm == "hybrid":
        return group_rank_and_size(ulysses_group)[1] * group_rank_and_size(ring_group)[1]
    return group_rank_and_size(cp_group)[1]


def resolve_mask(mask: Optional[AttentionMask], causal, cu_seqlens, q: torch.Tensor,
                 cp_size: int, caller: str) -> AttentionMask:
    """The call's AttentionMask from `mask` or `causal`/`cu_seqlens` (not both), checked
    against q (B, local_seq, H, ...) locally: sinks (H,) on q's device; documents and
    chunks folded into validated per-sample boundaries of the full sequence
    (local_seq x cp_size tokens). The sinks stay on the returned mask."""
    if mask is None:
        mask = AttentionMask(causal=bool(causal), cu_seqlens=cu_seqlens)
    elif not isinstance(mask, AttentionMask) or causal or cu_seqlens is not None:
        raise ValueError(f"{caller}: give mask=AttentionMask(...) or causal=/cu_seqlens=, "
                         "not both")
    sinks = mask.sinks
    if sinks is not None and (sinks.shape != (q.shape[2],) or sinks.device != q.device):
        raise ValueError(f"{caller}: sinks of shape {tuple(sinks.shape)} on {sinks.device} "
                         f"must be ({q.shape[2]},) on {q.device}: one logit per query head")
    if mask.cu_seqlens is None and mask.chunk_size is None:
        return mask
    n = q.shape[1] * cp_size
    cus = torch.tensor([0, n], dtype=torch.int32) if mask.cu_seqlens is None \
        else mask.cu_seqlens
    docs = check_cu_seqlens(cus, n, q.shape[0], caller)
    if mask.chunk_size is not None:
        chunked = {}  # one union per distinct tensor (one for the whole batch, usually)
        docs = [chunked.setdefault(id(cu), with_chunks(cu, mask.chunk_size)) for cu in docs]
    return AttentionMask(mask.causal, mask.sliding_window, docs, mask.chunk_size, sinks)
