"""Checkpoints that are either complete or ignored: DeepSpeed save/load plus a manifest.

Layout under ``save_dir`` (docs/checkpoints.md has the whole picture):

    step_00000020/            one DeepSpeed tag (model/optimizer shards of every rank)
        rng_rank00000.pt      this rank's RNG states (DeepSpeed keeps one client_state per
                              model-parallel rank, but RNG differs on every rank)
        COMPLETE              the manifest, written last by rank 0 after every rank finished
                              saving: JSON with the step, the layout that saved (tp, cp, pp, dp,
                              ZeRO stage, dtype), the run's config, and every file's size

A tag counts only when its manifest parses and every file it lists is there with its size:
a run killed during ``save_checkpoint`` leaves no manifest, a lost shard or a truncated file
no longer matches it, and ``verify`` says which file in one line (``CheckpointError``).
``latest_complete`` returns the newest tag that verifies, reporting the ones it skips, so
``--resume auto`` continues from the previous good one; nothing is loaded before the tag
verifies. DeepSpeed's own ``latest`` file is not trusted for that reason. Sizes, not
checksums: summing terabytes on rank 0 at every save costs more than it catches.
"""
from __future__ import annotations

import json
import os
import random
import re
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

MARKER = "COMPLETE"
MANIFEST_FORMAT = "ctxpar-checkpoint-v1"
_TAG = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: one line naming the file and what is wrong."""


def is_tag(name: str) -> bool:
    """A checkpoint tag as tag_for writes it: step_<digits>."""
    return _TAG.match(name) is not None


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def list_tags(save_dir: str) -> List[str]:
    """Every step_* directory in save_dir, oldest first (complete or not)."""
    if not os.path.isdir(save_dir):
        return []
    tags = [n for n in os.listdir(save_dir)
            if is_tag(n) and os.path.isdir(os.path.join(save_dir, n))]
    return sorted(tags, key=lambda n: int(_TAG.match(n).group(1)))


def complete_tags(save_dir: str) -> List[str]:
    """The tags in save_dir that carry the COMPLETE marker, oldest first (``verify`` checks
    their files)."""
    return [t for t in list_tags(save_dir) if os.path.isfile(os.path.join(save_dir, t, MARKER))]


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


def _file_sizes(tag_dir: str) -> Dict[str, int]:
    """Every file under tag_dir (relative path -> bytes), the marker excluded.

    Sizes are read through an open file: on NFS, open() revalidates the attributes another
    node's writes changed (close-to-open consistency), where a bare stat may be stale.
    """
    sizes = {}
    for root, _, files in os.walk(tag_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, tag_dir)
            if rel == MARKER or rel.endswith(".tmp"):
                continue
            with open(path, "rb") as f:
                sizes[rel] = os.fstat(f.fileno()).st_size
    return dict(sorted(sizes.items()))


def write_manifest(tag_dir: str, step: int, meta: Dict[str, Any]) -> str:
    """The COMPLETE marker: the files now in tag_dir with their sizes, plus meta; atomic."""
    manifest = {"format": MANIFEST_FORMAT, "step": step, **meta, "files": _file_sizes(tag_dir)}
    path = os.path.join(tag_dir, MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return path


def read_manifest(tag_dir: str) -> Dict[str, Any]:
    """The manifest of a tag; CheckpointError when there is none or it is unreadable.

    A marker from before manifests (its text is just the step) reads as
    ``{"step": n, "legacy": True}``: loadable on the layout that wrote it, not verifiable.
    """
    path = os.path.join(tag_dir, MARKER)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint was not finished "
                              f"(a run stopped while saving)")
    with open(path) as f:
        text = f.read()
    if text.strip().isdigit():
        return {"step": int(text), "legacy": True}
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path} is not a ctxpar manifest (a damaged or foreign marker)")
    return manifest


def verify(tag_dir: str) -> Dict[str, Any]:
    """The manifest, after checking every file it lists exists with its recorded size."""
    manifest = read_manifest(tag_dir)
    for rel, size in manifest.get("files", {}).items():
        path = os.path.join(tag_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (listed in {os.path.join(tag_dir, MARKER)})")
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise CheckpointError(f"{path} has {actual} bytes, the manifest says {size} "
                                  f"(truncated or overwritten)")
    if not manifest.get("legacy") and not manifest.get("files"):
        raise CheckpointError(f"{os.path.join(tag_dir, MARKER)} lists no files")
    return manifest


def latest_complete(save_dir: str, on_skip: Optional[Callable[[str], None]] = None
                    ) -> Optional[str]:
    """The newest tag in save_dir whose manifest verifies, or None.

    Tags without a marker (a save in progress or killed) are passed over silently; tags
    with a marker that fails verification are reported through ``on_skip(message)``.
    """
    for tag in reversed(list_tags(save_dir)):
        tag_dir = os.path.join(save_dir, tag)
        if not os.path.isfile(os.path.join(tag_dir, MARKER)):
            continue
        try:
            verify(tag_dir)
        except CheckpointError as e:
            if on_skip is not None:
                on_skip(f"skipping {tag}: {e}")
            continue
        return tag
    return None


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


def zero0_client_state(engine) -> Dict[str, Any]:
    """What converting a ZeRO stage-0 fp32 checkpoint to another layout needs; {} otherwise.

    At stage 0 the engine's optimizer is the torch AdamW itself: its state_dict keys
    parameters by position, so the names of its parameters, group by group, and this
    rank's TP rank go into the client state (universal.py). ZeRO optimizers record names
    themselves.
    """
    if engine.zero_optimization() or not isinstance(engine.optimizer, torch.optim.Optimizer):
        return {}
    from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {"optimizer_param_names": [[names[id(p)] for p in g["params"]]
                                      for g in engine.optimizer.param_groups],
            "tp_rank": bwc_tensor_model_parallel_rank(engine.mpu)}


def save(engine, save_dir: str, step: int, client_state: Dict[str, Any],
         meta: Optional[Dict[str, Any]] = None) -> str:
    """Collective: every rank saves its shard; rank 0 writes the manifest at the end.

    meta (the layout and config, ``reshard.checkpoint_meta``) goes into the manifest.
    """
    from ..distributed.expert_parallel import dense_format
    from .expert_states import save_experts
    tag = tag_for(step)
    client_state = {**client_state, **zero0_client_state(engine)}
    with dense_format(engine):  # ep > 1: the dense format (distributed/expert_parallel.py)
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=True)
    save_experts(engine, os.path.join(save_dir, tag))  # ZeRO-0, ep > 1: each EP rank's
    rank = dist.get_rank()
    torch.save(rng_state(), os.path.join(save_dir, tag, f"rng_rank{rank:05d}.pt"))
    dist.barrier()  # every rank's files are on disk before the manifest lists them
    if rank == 0:
        write_manifest(os.path.join(save_dir, tag), step, meta or {})
    dist.barrier()
    return tag


def load(engine, save_dir: str, tag: str) -> Dict[str, Any]:
    """Collective: load a verified tag saved on this layout; returns the client_state.
    Under ep > 1 the caller restores each rank's own experts (expert_states.py)."""
    from ..distributed.expert_parallel import dense_format
    with dense_format(engine):
        path, client_state = engine.load_checkpoint(save_dir, tag=tag,
                                                    load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"checkpoint {os.path.join(save_dir, tag)} could not be loaded")
    rng_file = os.path.join(save_dir, tag, f"rng_rank{dist.get_rank():05d}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def run_on_rank0(fn: Callable[[], None]) -> None:
    """Run fn on rank 0; every rank raises its error (no rank left waiting)."""
    err = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"{type(e).__name__}: {e}"
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise RuntimeError(box[0])
