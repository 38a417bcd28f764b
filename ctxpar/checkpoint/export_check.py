"""The export checks itself: a written config.json read back as its reader will read it.

A family's transformers config class fills every field config.json leaves out, or spells
the old way, with its own default: gpt-oss's class reads a missing ``rope_parameters`` as
YaRN with factor 32 over 4,096 positions, whatever ``rope_theta`` / ``rope_scaling: null``
say. An export that writes such a field is another model, silently. So before an export
reports success, its config.json is read back

  - through the installed transformers' config class (``AutoConfig``), then written the
    way ``save_pretrained`` writes it, so every default the class filled in is explicit;
  - else through ctxpar's own importer (``hf.read_config``),

and mapped onto model.* by the importer's mapping (``hf.model_fields``: the one
``--model-config`` and ``model.init_from`` use). Every field must equal what the exported
model means; the first that does not is named with both values (``ExportMismatch``, a
CheckpointError: exit 2). What may differ: the position limit (``max_position_embeddings``
is the larger of the run's and its source's) and model.init_from.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict

from ..config import ModelConfig
from ..config.layer_mixers import token_mixers
from ..config.layers import gated_delta_dims, mamba_dims
from . import hf
from .families import family_of
from .resume import CheckpointError
from .weight_reader import CONFIG

# model.* an exported config.json may mean differently from the model: the position limit
# (hf.family_config keeps the source's when larger), where the run started from, and the
# linear kernels' chunk (a blocking of the chunked scan: the same sums)
NOT_COMPARED = ("seq_len", "init_from", "linear_chunk_size", "mtp")  # mtp: below
# what a model without RoPE (model.rope false: NoPE attention) does not compute with
NOPE = ("rope_theta", "rope_scaling", "layer_rope")


class ExportMismatch(CheckpointError):
    """A written config.json that its reader reads as another model."""


def transformers_reading(folder: str) -> Dict[str, Any] | None:
    """config.json as the installed transformers' config class reads it, every default it
    fills in made explicit (save_pretrained's form); None without transformers."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    config = AutoConfig.from_pretrained(folder)
    return json.loads(config.to_json_string(use_diff=True))


def resolved(fields: Dict[str, Any]) -> Dict[str, Any]:
    """hf.architecture's fields with the linear mixers' sizes resolved too (an unset one
    and its default written out are one model)."""
    arch = hf.architecture(fields)
    m = ModelConfig(**{k: v for k, v in fields.items() if k != "init_from"})
    mixers = token_mixers(m)
    if mixers & {"gated_delta", "kda"}:  # KDA reads the same linear_* fields
        g = gated_delta_dims(m)
        arch.update(linear_num_key_heads=g.num_key_heads,
                    linear_num_value_heads=g.num_value_heads,
                    linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
                    linear_conv_kernel_dim=g.conv_kernel,
                    linear_allow_neg_eigval=g.allow_neg_eigval, linear_norm_eps=g.norm_eps)
    if "mamba2" in mixers:
        d = mamba_dims(m)
        arch.update(mamba_num_heads=d.num_heads, mamba_head_dim=d.head_dim,
                    ssm_state_size=d.state_size, n_groups=d.n_groups, conv_kernel=d.conv_kernel,
                    use_conv_bias=d.conv_bias, time_step_min=d.time_step_min,
                    time_step_max=d.time_step_max, time_step_floor=d.time_step_floor)
    return arch


def check_config(folder: str, m: ModelConfig, name: str | None = None) -> str:
    """Refuse (ExportMismatch, one line naming the file as ``name``) a config.json in
    folder that does not read back as model m; returns which reader read it
    ('transformers X' or "ctxpar's importer")."""
    read = transformers_reading(folder)
    reader = "ctxpar's importer"
    if read is None:
        read = hf.read_config(folder)
    else:
        import transformers
        reader = f"transformers {transformers.__version__}"
        with tempfile.TemporaryDirectory(prefix="ctxpar-reread-") as again:
            with open(os.path.join(again, CONFIG), "w") as f:
                json.dump(read, f)  # the importer reads a folder; the reading is its file
            read = hf.read_config(again)
    file = name or os.path.join(folder, CONFIG)
    try:
        fields = hf.model_fields(read, folder)
    except CheckpointError as e:
        raise ExportMismatch(f"{file} as {reader} reads it is not a model ctxpar reads "
                             f"back: {e}") from None
    meant = resolved({**vars(m), "family": family_of(m)})
    back = resolved(fields)
    skip = NOT_COMPARED + (() if meant["rope"] else NOPE)
    for key, value in meant.items():
        if key not in skip and back.get(key) != value:
            raise ExportMismatch(f"{file}: model.{key}: the export means {value!r}, "
                                 f"{reader} reads {back.get(key)!r}")
    # model.mtp: the family's reading of its MTP keys (its loss weight is no model field)
    from dataclasses import replace
    mtp = hf.folder_mtp(read, folder)
    if (mtp and replace(mtp, loss_weight=0.0)) != (m.mtp and replace(m.mtp, loss_weight=0.0)):
        raise ExportMismatch(f"{file}: model.mtp: the export means {m.mtp!r}, {reader} reads "
                             f"{mtp!r}")
    return reader


def check_exportable(m: ModelConfig) -> str:
    """model m's family holds it (hf.family_config) and its config.json reads back as m:
    what an export of m will write, checked before a run trains for it (no weights)."""
    cfg = hf.family_config(m)
    with tempfile.TemporaryDirectory(prefix="ctxpar-export-config-") as folder:
        with open(os.path.join(folder, CONFIG), "w") as f:
            json.dump(cfg, f)
        return check_config(folder, m, f"the export's {CONFIG} (model.family={cfg['model_type']})")
