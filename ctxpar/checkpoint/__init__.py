"""Checkpoints: complete-or-ignored saves, resume on any layout, Hugging Face exchange.

    resume.py      tags, the manifest (COMPLETE), verification, DeepSpeed save/load, RNG
    reshard.py     resume on the saving layout or another one (find the resume point, then load)
    universal.py   any layout -> DeepSpeed's universal checkpoint, and back into an engine
    names.py       parameter names: GPT <-> pipeline stages <-> Hugging Face
    families/      the Hugging Face families, one file each, registered in one table
                   (families/registry.py): config.json onto model.* and back, tensor names
    hf.py          Hugging Face config.json and safetensors, both directions, through the
                   families' hooks (it names none); refusals
    weight_reader.py a folder's tensors by GPT name; rope_config.py RoPE in config.json
    export_check.py an export's config.json read back as transformers reads it: the same
                   model, or the export stops naming the field
    preemption.py  SIGTERM/SIGUSR1: every rank stops after the same step, saves, exits 0
    weights.py     model.init_from (Hugging Face folder or ctxpar checkpoint), export

The names below are loaded from their modules on first use (PEP 562), so that config/
can read families/registry.py without loading the rest. docs/checkpoints.md describes the files on disk and what may change between save and resume.
"""

_EXPORTS = {
    "export_check": ("ExportMismatch", "check_exportable"),
    "hf": ("family_config",),
    "preemption": ("PreemptionGuard",),
    "reshard": ("ResumePoint", "checkpoint_meta", "describe", "layout_of", "resume_point",
                "restore"),
    "resume": ("CheckpointError", "complete_tags", "is_tag", "latest_complete", "list_tags",
               "load", "read_manifest", "resume_problem", "save", "tag_for", "verify"),
    "universal": ("universal_checkpoint_info",),
    "weights": ("InitSource", "check_init_from", "export_hf", "load_initial_weights"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
