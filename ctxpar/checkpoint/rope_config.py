"""RoPE in config.json, both directions: transformers 5's ``rope_parameters`` (one set, or
one per layer type) and the classic ``rope_theta`` / ``rope_scaling`` (transformers 4),
read as ctxpar's model.rope_theta and model.rope_scaling; written in the form the
installed transformers' config classes read (a 5.x class reads a missing
rope_parameters as its own default: gpt-oss's is YaRN, whatever the classic keys say).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..config import ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL
from .resume import CheckpointError

ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def rope_keys(theta: float, scaling: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """config.json's RoPE keys: ``rope_parameters`` (transformers 5, and ctxpar's
    importer), or the classic rope_theta / rope_scaling under transformers 4."""
    try:
        import transformers
        classic = int(transformers.__version__.split(".")[0]) < 5
    except ImportError:
        classic = False
    if classic:
        return {"rope_theta": theta, "rope_scaling": scaling}
    return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta}}


def drop_rope_keys(cfg: Dict[str, Any]) -> None:
    """Remove hf.family_config's RoPE keys (a family that writes its own, or none)."""
    for key in ROPE_KEYS:
        cfg.pop(key, None)


def read_rope(hf: Dict[str, Any], file: str, default_theta: float,
              layer_type: Optional[str] = None) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, ctxpar rope_scaling) from either form of config.json (layer_type: the
    entry of a per-layer-type rope_parameters to read, when it has one)."""
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    return rope_of(params, hf, file, hf.get("rope_theta", default_theta))


def rope_of(params: Dict[str, Any], hf: Dict[str, Any], file: str,
            default_theta: float) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, ctxpar rope_scaling) of one set of RoPE parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    kind = params.pop("rope_type", params.pop("type", "default"))
    # proportional RoPE (Gemma 4) holds its own partial_rotary_factor: frequencies of it
    partial = 1.0 if kind == "proportional" else params.pop(
        "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{file}: partial_rotary_factor={partial}: the families ctxpar "
                              f"imports rotate every channel (model.partial_rotary_factor is "
                              f"not read from a Hugging Face folder yet)")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise CheckpointError(f"{file}: rope_scaling.rope_type={kind!r} is not implemented by "
                              f"ctxpar (it has {', '.join(ROPE_SCALING_KEYS)})")
    if kind in ("llama3", "yarn"):  # transformers' default: the model's own length
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings",
                                 hf.get("max_position_embeddings")))
    missing = [k for k in ROPE_SCALING_KEYS[kind] if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{file}: rope_scaling of rope_type={kind!r} has no "
                              f"{', '.join(missing)} (ctxpar needs it given)")
    optional = {k: params[k] for k in ROPE_SCALING_OPTIONAL.get(kind, ())
                if params.get(k) is not None}
    left = sorted(k for k in set(params) - set(ROPE_SCALING_KEYS[kind]) - set(optional)
                  if not (k in ROPE_SCALING_OPTIONAL.get(kind, ()) and params[k] is None))
    if left:
        raise CheckpointError(f"{file}: rope_scaling.{left[0]}={params[left[0]]!r} is not "
                              f"implemented by ctxpar for rope_type={kind!r}")
    return theta, {"rope_type": kind, **{k: params[k] for k in ROPE_SCALING_KEYS[kind]},
                   **optional}
