"""What each layer's attention is: its kind, its window or chunks, its RoPE.

    for i, a in enumerate(layer_attention(cfg.model)):
        mask = AttentionMask(causal=True, sliding_window=a.sliding_window,
                             chunk_size=a.chunk_size, cu_seqlens=cu)

The model, the planner and generation read the per-layer attention from here, so a layer
type means one thing everywhere. transformers' names: model.layer_types lists one of
LAYER_TYPES per layer; unset, every layer is 'sliding_attention' when model.sliding_window
is set, 'chunked_attention' when model.attention_chunk_size is, else 'full_attention'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .sections import ModelConfig

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class LayerAttention:
    kind: str                        # one of LAYER_TYPES
    sliding_window: Optional[int]    # 'sliding_attention' only
    chunk_size: Optional[int]        # 'chunked_attention' only
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]


def layer_types(m: ModelConfig) -> List[str]:
    """One of LAYER_TYPES per layer (model.layer_types, or the one kind the model's
    window or chunk fields imply)."""
    if m.layer_types is not None:
        return list(m.layer_types)
    kind = ("sliding_attention" if m.sliding_window is not None else
            "chunked_attention" if m.attention_chunk_size is not None else "full_attention")
    return [kind] * m.n_layers


def layer_attention(m: ModelConfig) -> List[LayerAttention]:
    """Every layer's attention (validated configs: config.validation checks the fields)."""
    out = []
    for kind in layer_types(m):
        rope = (m.layer_rope or {}).get(kind, {})
        out.append(LayerAttention(
            kind,
            m.sliding_window if kind == "sliding_attention" else None,
            m.attention_chunk_size if kind == "chunked_attention" else None,
            float(rope.get("rope_theta", m.rope_theta)),
            rope["rope_scaling"] if "rope_scaling" in rope else m.rope_scaling))
    return out


def check_layers(m: ModelConfig, err) -> None:
    """model.sliding_window, attention_chunk_size, layer_types and layer_rope, one line
    each through err (validation's)."""
    for key in ("sliding_window", "attention_chunk_size"):
        v = getattr(m, key)
        if v is not None and v < 1:
            err(f"model.{key}={v} must be >= 1 (or null: none)")
    if m.layer_types is None:
        if m.sliding_window is not None and m.attention_chunk_size is not None:
            err(f"model.sliding_window={m.sliding_window} and model.attention_chunk_size="
                f"{m.attention_chunk_size} both set: say which layers take which in "
                f"model.layer_types")
        kinds = set(layer_types(m))
    else:
        if len(m.layer_types) != m.n_layers:
            err(f"model.layer_types has {len(m.layer_types)} entries; model.n_layers="
                f"{m.n_layers} needs one per layer")
        bad = sorted({t for t in m.layer_types if t not in LAYER_TYPES})
        if bad:
            err(f"model.layer_types: unknown type(s) {bad}; choose from {list(LAYER_TYPES)}")
        kinds = set(m.layer_types)
        for kind, key in (("sliding_attention", "sliding_window"),
                          ("chunked_attention", "attention_chunk_size")):
            if kind in kinds and getattr(m, key) is None:
                err(f"model.layer_types has {kind!r} layers but model.{key} is not set")
            if kind not in kinds and getattr(m, key) is not None:
                err(f"model.{key}={getattr(m, key)} is set but no layer in "
                    f"model.layer_types is {kind!r}: it would be ignored")
    for kind, rope in (m.layer_rope or {}).items():
        if kind not in LAYER_TYPES:
            err(f"model.layer_rope: unknown layer type {kind!r}; choose from "
                f"{list(LAYER_TYPES)}")
        if not isinstance(rope, dict) or set(rope) - {"rope_theta", "rope_scaling"}:
            err(f"model.layer_rope.{kind}={rope!r} must be a mapping of rope_theta and/or "
                f"rope_scaling")
        theta = rope.get("rope_theta", m.rope_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            err(f"model.layer_rope.{kind}.rope_theta={theta!r} must be a number > 0")
        if kind not in kinds:
            err(f"model.layer_rope.{kind} is set but no layer is {kind!r}: it would be "
                f"ignored")
