"""Full-size weights in and out of a run: model.init_from, and ctxpar checkpoint -> HF export.

    source = check_init_from(cfg)                    # file reads only: before any collective
    msg = load_initial_weights(model, cfg, state, source)   # collective, before deepspeed's init

A source is a Hugging Face folder of a known family (hf.py, families/) or a ctxpar
checkpoint; either way every
rank copies its TP slice of each full tensor (``shard_full_tensor``, the rule of the
model's own init) into GPT's parameters, or its pipeline stage's under GPT's names, so any
layout starts from the same weights. A ctxpar checkpoint is first turned into DeepSpeed's
universal form by rank 0 (universal.py), whatever layout saved it.
"""
from __future__ import annotations

import glob
import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..config import ConfigError, ModelConfig
from ..config.load import model_section
from ..tensor_parallel.utils import full_shape, shard_full_tensor
from . import hf
from .export import save_folder
from .names import from_pipe
from .resume import MARKER, CheckpointError, is_tag, latest_complete, run_on_rank0, verify
from .universal import (load_buffers_, naming, num_experts, read_state, saved_buffers,
                        to_universal)


def resolve_checkpoint(path: str) -> str:
    """A step_* folder from a tag folder, a save_dir (its newest good tag) or a run dir."""
    if os.path.isfile(os.path.join(path, MARKER)) or is_tag(os.path.basename(
            os.path.normpath(path))):
        return path
    for save_dir in (path, os.path.join(path, "checkpoints")):
        tag = latest_complete(save_dir)
        if tag is not None:
            return os.path.join(save_dir, tag)
    raise CheckpointError(f"{path}: no complete ctxpar checkpoint (a step_* folder with a "
                          f"{MARKER} manifest, a save_dir or a run dir holding one)")


def saved_model(manifest: Dict[str, Any], tag_dir: str) -> ModelConfig:
    model = (manifest.get("config") or {}).get("model")
    if model is None:
        raise CheckpointError(f"{os.path.join(tag_dir, MARKER)} records no config (saved "
                              f"by an older ctxpar)")
    # the manifest's plain dict, its sections (model.moe, model.mla) built as the config's
    try:
        return model_section(model, os.path.join(tag_dir, MARKER))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


@dataclass
class InitSource:
    path: str
    kind: str  # 'hf' or 'ctxpar'
    changed: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)
    manifest: Dict[str, Any] = field(default_factory=dict)
    family: Optional[str] = None  # the folder's model_type (kind 'hf')
    note: Optional[str] = None  # what a multimodal folder's import leaves out

    def describe(self) -> str:
        what = (f"Hugging Face {hf.FAMILIES[self.family].architecture[:-len('ForCausalLM')]}"
                f" folder" if self.kind == "hf" else "ctxpar checkpoint")
        what += f", {self.note}" if self.note else ""
        # init_std only draws a random init: every weight comes from the source here
        diff = "".join(f", {k} {a!r} -> {b!r}" for k, (a, b) in self.changed.items()
                       if k != "init_std")
        return f"initialized from {self.path} ({what}{diff}); step 0, fresh optimizer"


def check_init_from(cfg) -> InitSource:
    """What model.init_from points at, checked against model.* (config.json's fields, and
    every tensor's name, shape and dtype from the safetensors headers); CheckpointError
    otherwise. File reads only. The source's family (a folder's model_type, a checkpoint's
    model.family) becomes model.family when the config leaves it unset, so the run's
    export writes the family it came from."""
    path = cfg.model.init_from
    if hf.is_hf_folder(path):
        fields = hf.model_fields(hf.read_config(path), path)
        changed = hf.check_matches(cfg.model, fields, path)
        hf.check_mtp(cfg.model, hf.read_config(path), path)  # model.mtp: the folder's layers
        hf.WeightReader(path, cfg.model.tie_embeddings, hf.naming_of(cfg.model)).check(cfg.model)
        if cfg.model.family is None:
            cfg.model.family = fields["family"]
        return InitSource(path, "hf", changed, family=fields["family"],
                          note=hf.left_out(path, cfg.model))
    tag_dir = resolve_checkpoint(path)
    manifest = verify(tag_dir)
    fields = vars(saved_model(manifest, tag_dir))
    changed = hf.check_matches(cfg.model, fields, tag_dir)
    if cfg.model.family is None:  # a chain of runs keeps the family of the first folder
        cfg.model.family = fields["family"]
    return InitSource(tag_dir, "ctxpar", changed, manifest)


def gpt_named_parameters(model) -> Iterator:
    """(GPT name, parameter) of a GPT or of a pipeline stage (GPTPipe)."""
    return model.gpt_named_parameters() if hasattr(model, "gpt_named_parameters") \
        else model.named_parameters()


def gpt_named_buffers(model) -> Iterator:
    """(GPT name, buffer) of a GPT or of a pipeline stage's blocks (GPTPipe)."""
    if not hasattr(model, "gpt_named_parameters"):
        return model.named_buffers()
    blocks = [m for name, m in model.named_children() if name.isdigit()]
    return ((m.gpt_prefix + n, b) for m in blocks for n, b in m.named_buffers())


def checkpoint_buffers(tag_dir: str, universal_dir: str, n_layers: int
                       ) -> Dict[str, torch.Tensor]:
    """{GPT name: tensor} of the persistent buffers a ctxpar checkpoint saved (the routers'
    correction biases and token-id tables, Gemma 4's layer scalars): from the universal
    folder's model file, or a pipeline's per-layer files (layer_XX-model_00-model_states.pt,
    DeepSpeed's; every TP rank's copy alike)."""
    found = saved_buffers(universal_dir)
    if found:
        return found
    for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*-model_00-model_states.pt"))):
        index = int(os.path.basename(path)[len("layer_"):].split("-")[0])
        if not 1 <= index <= n_layers:
            continue
        sd = torch.load(path, map_location="cpu", weights_only=False)
        found.update({from_pipe(f"{index}.{k}", n_layers): t for k, t in sd.items()
                      if k.endswith(("e_score_correction_bias", "tid2eid", "layer_scalar"))})
    return found


@torch.no_grad()
def copy_full_weights_(model, get: Callable[[str], torch.Tensor], tp_group) -> None:
    """Every parameter <- its TP slice of get(GPT name), a full tensor; shapes checked."""
    from ..tensor_parallel.mappings import tp_size_of
    tp = tp_size_of(tp_group)
    for name, p in gpt_named_parameters(model):
        full = get(name)
        if tuple(full.shape) != tuple(full_shape(p, tp)):
            raise CheckpointError(f"{name}: the source holds shape {tuple(full.shape)}, the "
                                  f"model wants {tuple(full_shape(p, tp))}")
        p.copy_(shard_full_tensor(full.to(p.dtype), p, tp_group))


def load_initial_weights(model, cfg, state, source: InitSource) -> str:
    """Collective: fill the model (before deepspeed.initialize) from source; a log line."""
    if source.kind == "hf":
        reader = hf.WeightReader(source.path, cfg.model.tie_embeddings,
                                  hf.naming_of(cfg.model))
        copy_full_weights_(model, reader.get, state.tp_group)
        reader.check_mtp_copies(cfg.model)  # the MTP layers' copies of embedding and head
        # the routers' correction biases
        load_buffers_(gpt_named_buffers(model), reader.buffers(cfg.model))
        return source.describe()
    work = os.path.join(cfg.logging.run_dir, "init_from.universal")
    m = cfg.model
    run_on_rank0(lambda: to_universal(source.path, work, source.manifest["layout"],
                                        m.n_layers, naming(False, m.n_layers, True),
                                        num_experts(m)))
    copy_full_weights_(model, lambda n: read_state(work, n, "fp32"), state.tp_group)
    # the routers' correction biases, whichever layout saved them and loads them
    load_buffers_(gpt_named_buffers(model), checkpoint_buffers(source.path, work, m.n_layers))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(work, ignore_errors=True)
    return source.describe()


def init_chain(init_from: Optional[str]) -> Tuple[Optional[Dict[str, Any]], Optional[int],
                                                   Optional[str]]:
    """Where a run's weights came from, through model.init_from and the init_from of each
    ctxpar checkpoint on the way: (the config.json of the Hugging Face folder the chain
    starts at or None, the largest position limit along it (the folder's
    max_position_embeddings, each run's seq_len) or None, a note when a link is gone)."""
    limit, seen = None, set()
    while init_from is not None and init_from not in seen:
        seen.add(init_from)
        if hf.is_hf_folder(init_from):
            folder = hf.read_config(init_from)
            return folder, max(limit or 0, folder.get("max_position_embeddings") or 0) or None, \
                None
        try:
            model = (verify(resolve_checkpoint(init_from)).get("config") or {}).get("model") or {}
        except CheckpointError:
            return None, limit, (f"model.init_from={init_from} is not here: the export's token "
                                 f"ids are the tokenizer's and its position limit the trained "
                                 f"length")
        limit = max(limit or 0, model.get("seq_len") or 0) or None
        init_from = model.get("init_from")
    return None, limit, None


def export_hf(path: str, out_dir: str, dtype: torch.dtype = torch.float32,
              notes: Optional[list] = None) -> str:
    """A ctxpar checkpoint (tag, save_dir or run dir) -> a Hugging Face folder of its
    model.family (hf.family_config); no processes.

    The run's data.tokenizer, if it had one, is exported with it; the token ids and the
    position limit of the folder model.init_from started from are kept (init_chain; a
    line in notes when that folder is gone). Returns the tag folder.
    """
    tag_dir = resolve_checkpoint(path)
    manifest = verify(tag_dir)
    m = saved_model(manifest, tag_dir)
    hf.family_config(m)  # refuse a model no family holds before converting anything
    tokenizer = ((manifest.get("config") or {}).get("data") or {}).get("tokenizer")
    source, limit, note = init_chain(m.init_from)
    if note and notes is not None:
        notes.append(note)
    with tempfile.TemporaryDirectory(prefix="ctxpar-export-") as work:
        out = os.path.join(work, "universal")
        names = to_universal(tag_dir, out, manifest["layout"], m.n_layers,
                               naming(False, m.n_layers, True), num_experts(m))
        saved, wanted = checkpoint_buffers(tag_dir, out, m.n_layers), list(hf.folder_buffers(m))
        lost = [n for n in wanted if n not in saved]
        if lost:
            raise CheckpointError(f"{tag_dir}: no saved {lost[0]} (a buffer the export "
                                  f"writes: transformers would start it at zeros)")
        weights = itertools.chain(((n, read_state(out, n, "fp32")) for n in names),
                                  ((n, saved[n]) for n in wanted))
        save_folder(out_dir, weights, m, tokenizer, dtype, source, limit)
    return tag_dir

