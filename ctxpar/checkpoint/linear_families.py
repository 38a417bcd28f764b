"""The hybrid families' linear layers in config.json: Qwen3.5's Gated DeltaNet.

    config.json (qwen3_5_text)     ctxpar model.*
    layer_types                    layer_types ('linear_attention', 'full_attention')
      (or full_attention_interval: every n-th layer full, transformers' default 4)
    linear_num_key_heads           linear_num_key_heads
    linear_num_value_heads         linear_num_value_heads
    linear_key_head_dim            linear_key_head_dim
    linear_value_head_dim          linear_value_head_dim
    linear_conv_kernel_dim         linear_conv_kernel_dim
    rope_parameters.partial_rotary_factor   partial_rotary_factor (RoPE on the attention
                                   layers only: the linear layers have no positions)

Qwen3.5's multimodal RoPE keys (rope_parameters' mrope_section, mrope_interleaved) are
read as plain RoPE: a text-only sequence gives its three position streams (time, height,
width) the same ids, so every frequency turns by the same angle whichever stream it is
taken from. model.linear_chunk_size is ctxpar's (the chunked kernel's block, a rounding
choice only), never in config.json.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from ..config.layers import gated_delta_dims

LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads",
                         "linear_key_head_dim", "linear_value_head_dim",
                         "linear_conv_kernel_dim")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # plain RoPE on text (module docstring)
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")


def qwen3_5_layer_types(hf: Dict[str, Any], refuse: Callable) -> List[str]:
    """layer_types as Qwen3_5TextConfig reads them: given, or every
    full_attention_interval-th layer full attention, the rest Gated DeltaNet."""
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None:
        every = hf.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - set(HYBRID_LAYER_TYPES):
        refuse("layer_types", types, f"one of {', '.join(map(repr, HYBRID_LAYER_TYPES))} per "
                                     f"layer ({n})")
    return types


def linear_attention_fields(hf: Dict[str, Any], refuse: Callable) -> Dict[str, Any]:
    """model.* of a qwen3_5_text config.json's layers: the layer types and, when a layer
    is Gated DeltaNet, its sizes (transformers' defaults where config.json has none)."""
    types = qwen3_5_layer_types(hf, refuse)
    fields: Dict[str, Any] = {"layer_types": types}
    if "linear_attention" not in types:
        return fields
    defaults = dict(linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4)  # Qwen3_5TextConfig's
    for key in LINEAR_ATTENTION_KEYS:
        value = hf.get(key, defaults[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            refuse(key, value, "config.json must give it as an integer >= 1")
        fields[key] = value
    return fields


def linear_attention_config(m, types: List[str]) -> Dict[str, Any]:
    """config.json's layer types and Gated DeltaNet sizes of ModelConfig m (qwen3_5_text),
    from the resolved sizes (config.layers.gated_delta_dims)."""
    g = gated_delta_dims(m)
    return {"layer_types": types, "linear_num_key_heads": g.num_key_heads,
            "linear_num_value_heads": g.num_value_heads,
            "linear_key_head_dim": g.key_head_dim, "linear_value_head_dim": g.value_head_dim,
            "linear_conv_kernel_dim": g.conv_kernel}


def qwen3_5_rope(hf: Dict[str, Any]) -> Tuple[Dict[str, Any], float]:
    """(config.json without the RoPE keys read here, partial_rotary_factor): Qwen3.5 keeps
    the factor in rope_parameters (0.25 by default there) beside the multimodal keys,
    which are plain RoPE on text (module docstring)."""
    params = dict(hf.get("rope_parameters") or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    for key in MROPE_KEYS:
        params.pop(key, None)
    rest = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    return {**rest, "rope_parameters": params or None}, float(partial)
