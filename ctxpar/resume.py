"""Checkpoints that are either complete or ignored: DeepSpeed save/load plus a marker.

Layout under ``save_dir``:

    step_00000020/            one DeepSpeed tag (model/optimizer shards of every rank)
        rng_rank00000.pt      this rank's RNG states (DeepSpeed keeps one client_state per
                              model-parallel rank, but RNG differs on every rank)
        COMPLETE              written last, by rank 0, after every rank finished saving

A run killed during ``save_checkpoint`` leaves a tag without ``COMPLETE``; ``latest_complete``
never returns it, so ``--resume auto`` continues from the previous complete one.
DeepSpeed's own ``latest`` file is not trusted for that reason.
"""
from __future__ import annotations

import os
import random
import re
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

MARKER = "COMPLETE"
_TAG = re.compile(r"^step_(\d+)$")


def is_tag(name: str) -> bool:
    """A checkpoint tag as tag_for writes it: step_<digits>."""
    return _TAG.match(name) is not None


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def complete_tags(save_dir: str) -> List[str]:
    """The tags in save_dir that carry the COMPLETE marker, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    tags = []
    for name in os.listdir(save_dir):
        m = _TAG.match(name)
        if m and os.path.isfile(os.path.join(save_dir, name, MARKER)):
            tags.append((int(m.group(1)), name))
    return [name for _, name in sorted(tags)]


def latest_complete(save_dir: str) -> Optional[str]:
    """The newest tag in save_dir that carries the COMPLETE marker, or None."""
    tags = complete_tags(save_dir)
    return tags[-1] if tags else None


def resume_problem(save_dir: str, resume: str) -> Optional[str]:
    """Why ``--resume`` cannot be honoured (one line), or None. Pure file checks, so every
    rank reaches the same verdict before any collective or DeepSpeed call."""
    if resume in ("auto", "none"):
        return None
    if not is_tag(resume):
        return f"--resume={resume!r} must be 'auto', 'none' or a tag like step_00000100"
    if resume in complete_tags(save_dir):
        return None
    tags = ", ".join(complete_tags(save_dir)) or "none"
    why = "is incomplete (no COMPLETE marker: the run stopped while saving it)" \
        if os.path.isdir(os.path.join(save_dir, resume)) else "does not exist"
    return f"--resume {resume}: checkpoint {os.path.join(save_dir, resume)} {why}; " \
           f"complete checkpoints in {save_dir}: {tags}"


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, save_dir: str, step: int, client_state: Dict[str, Any]) -> str:
    """Collective: every rank saves its shard; rank 0 marks the tag complete at the end."""
    tag = tag_for(step)
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=True)
    rank = dist.get_rank()
    torch.save(rng_state(), os.path.join(save_dir, tag, f"rng_rank{rank:05d}.pt"))
    dist.barrier()  # every rank's files are on disk before the marker says so
    if rank == 0:
        path = os.path.join(save_dir, tag, MARKER)
        with open(path + ".tmp", "w") as f:
            f.write(f"{step}\n")
        os.replace(path + ".tmp", path)
    dist.barrier()
    return tag


def load(engine, save_dir: str, tag: str) -> Dict[str, Any]:
    """Collective: load a complete tag into the engine; returns the client_state."""
    path, client_state = engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"checkpoint {os.path.join(save_dir, tag)} could not be loaded")
    rng_file = os.path.join(save_dir, tag, f"rng_rank{dist.get_rank():05d}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state
