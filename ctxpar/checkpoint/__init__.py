"""Checkpoints: complete-or-ignored saves, resume on any layout, Hugging Face exchange.

    resume.py      tags, the manifest (COMPLETE), verification, DeepSpeed save/load, RNG
    reshard.py     resume on the saving layout or another one (find the resume point, then load)
    universal.py   any layout -> DeepSpeed's universal checkpoint, and back into an engine
    names.py       parameter names: GPT <-> pipeline stages <-> Hugging Face
    families/      the Hugging Face families, one file each, registered in one table
                   (ctxpar/config/hf_families.py): config.json onto model.* and back, tensor names
    hf.py          Hugging Face config.json and safetensors, both directions, through the
                   families' hooks (it names none); refusals
    weight_reader.py a folder's tensors by GPT name; rope_config.py RoPE in config.json
    export_check.py an export's config.json read back as transformers reads it: the same
                   model, or the export stops naming the field
    preemption.py  SIGTERM/SIGUSR1: every rank stops after the same step, saves, exits 0
    weights.py     model.init_from (Hugging Face folder or ctxpar checkpoint), export

docs/checkpoints.md describes the files on disk and what may change between save and resume.
"""
from .export_check import ExportMismatch, check_exportable
from .hf import family_config
from .preemption import PreemptionGuard
from .reshard import (ResumePoint, checkpoint_meta, describe, layout_of, resume_point,
                      restore)
from .resume import (CheckpointError, complete_tags, is_tag, latest_complete, list_tags, load,
                     read_manifest, resume_problem, save, tag_for, verify)
from .universal import universal_checkpoint_info
from .weights import InitSource, check_init_from, export_hf, load_initial_weights

__all__ = [
    "CheckpointError", "ExportMismatch", "InitSource", "PreemptionGuard", "ResumePoint",
    "check_exportable", "check_init_from", "checkpoint_meta", "complete_tags", "describe",
    "export_hf", "family_config", "is_tag", "latest_complete", "layout_of", "list_tags",
    "load", "load_initial_weights", "read_manifest", "restore", "resume_point",
    "resume_problem", "save", "tag_for", "universal_checkpoint_info", "verify",
]
