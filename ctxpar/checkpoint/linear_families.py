"""The hybrid families' linear layers in config.json: Qwen3.5's Gated DeltaNet and
Nemotron-H's Mamba2 blocks (and the list of Nemotron-H's blocks, its MoE ones' keys in
nemotron_moe.py).

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

from ..config.layers import gated_delta_dims, mamba_dims
from .resume import CheckpointError
from .nemotron_moe import moe_blocks, nemotron_moe_config, nemotron_moe_fields

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


# Nemotron-H (nemotron_h): one op per block, named by transformers 5 (and the older names
# and pattern letters it still reads) -> ctxpar's layer types
NEMOTRON_BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
                   "full_attention": "attention", "attention": "attention", "*": "attention",
                   "mlp": "mlp", "-": "mlp", "moe": "mlp", "E": "mlp"}
NEMOTRON_MOE_BLOCKS = ("moe", "E")  # an MLP block whose MLP is the MoE (nemotron_moe.py)
NEMOTRON_EXPORT = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
# config.json key -> model.* (transformers' older aliases in NEMOTRON_ALIASES)
NEMOTRON_MAMBA_KEYS = {"mamba_num_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim",
                       "ssm_state_size": "ssm_state_size", "n_groups": "n_groups",
                       "conv_kernel": "conv_kernel", "use_conv_bias": "use_conv_bias",
                       "time_step_min": "time_step_min", "time_step_max": "time_step_max",
                       "time_step_floor": "time_step_floor", "chunk_size": "linear_chunk_size"}
NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
                    "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                    "mamba_chunk_size": "chunk_size"}
NEMOTRON_DEFAULTS = dict(mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                         conv_kernel=4, use_conv_bias=True, time_step_min=0.001,
                         time_step_max=0.1, time_step_floor=1e-4, chunk_size=128)  # transformers'


def nemotron_blocks(hf: Dict[str, Any], refuse: Callable) -> List[str]:
    """The blocks of a nemotron_h config.json as it names them: layers_block_type, or the
    older hybrid_override_pattern ('M' Mamba2, '*' attention, '-' MLP, 'E' MoE);
    num_hidden_layers (if given) must count them."""
    given = hf.get("layers_block_type")
    key, blocks = ("layers_block_type", given) if given is not None else \
        ("hybrid_override_pattern", list(hf.get("hybrid_override_pattern") or ""))
    if not blocks or not all(isinstance(b, str) for b in blocks):
        refuse(key, hf.get(key), "a Nemotron-H config.json lists its blocks (layers_block_type "
                                 "or hybrid_override_pattern)")
    unknown = sorted({b for b in blocks if b not in NEMOTRON_BLOCKS})
    if unknown:
        refuse(key, hf.get(key), f"{unknown} blocks are not implemented by ctxpar (it has "
                                 f"Mamba2, attention, MLP and MoE blocks)")
    n = hf.get("num_hidden_layers")
    if n is not None and n != len(blocks):
        refuse("num_hidden_layers", n, f"{key} lists {len(blocks)} blocks")
    return blocks


def nemotron_block_types(hf: Dict[str, Any], refuse: Callable) -> List[str]:
    """ctxpar's layer types of a nemotron_h config.json's blocks (a MoE block is an 'mlp'
    one, its MLP model.moe's)."""
    return [NEMOTRON_BLOCKS[b] for b in nemotron_blocks(hf, refuse)]


def nemotron_fields(hf: Dict[str, Any], refuse: Callable) -> Dict[str, Any]:
    """model.* of a nemotron_h config.json's blocks: layer types, their count, the MoE
    blocks' model.moe (nemotron_moe.py), the Mamba2 sizes (transformers' defaults where
    config.json has none), the norms' epsilon."""
    hf = {NEMOTRON_ALIASES.get(k, k): v for k, v in hf.items()}
    blocks = nemotron_blocks(hf, refuse)
    types = [NEMOTRON_BLOCKS[b] for b in blocks]
    moe = nemotron_moe_fields(hf, [i for i, b in enumerate(blocks)
                                   if b in NEMOTRON_MOE_BLOCKS], refuse)
    fields: Dict[str, Any] = {"layer_types": types, "n_layers": len(types),
                              "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "moe": moe}
    if "mamba" not in types:
        return fields
    for key, field in NEMOTRON_MAMBA_KEYS.items():
        value = hf.get(key, NEMOTRON_DEFAULTS[key])
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "use_conv_bias":
            ok, want = isinstance(value, bool), "a boolean"
        elif key.startswith("time_step"):
            ok, want = number and value > 0, "a number > 0"
        else:
            ok, want = number and value == int(value) and value >= 1, "an integer >= 1"
        if not ok:
            refuse(key, value, f"config.json must give it as {want}")
        fields[field] = value
    return fields


def nemotron_config(m, types: List[str], refuse: Callable) -> Dict[str, Any]:
    """config.json's blocks, Mamba2 sizes and MoE keys of ModelConfig m (nemotron_h);
    refuse(what) where model.moe is not Nemotron-H's."""
    d, sparse = mamba_dims(m), moe_blocks(m)
    if any(types[i] != "mlp" for i in sparse):
        refuse(f"model.moe.layers={m.moe.layers} with model.layer_types={types} (Nemotron-H's "
               f"MoE blocks are MLP blocks)")
    return {"layers_block_type": ["moe" if i in sparse else NEMOTRON_EXPORT[t]
                                  for i, t in enumerate(types)],
            **(nemotron_moe_config(m, refuse) if sparse else {}),
            "layer_norm_epsilon": m.norm_eps, "mamba_num_heads": d.num_heads,
            "mamba_head_dim": d.head_dim, "ssm_state_size": d.state_size,
            "n_groups": d.n_groups, "conv_kernel": d.conv_kernel,
            "use_conv_bias": d.conv_bias, "time_step_min": d.time_step_min,
            "time_step_max": d.time_step_max, "time_step_floor": d.time_step_floor,
            "chunk_size": d.chunk_size, "mamba_hidden_act": "silu", "use_bias": False,
            "mlp_bias": False, "attention_bias": False, "residual_in_fp32": False}


def hybrid_family_config(cfg: Dict[str, Any], m, name: str, types: List[str]) -> None:
    """A hybrid family's keys into the config.json hf.family_config writes: Nemotron-H's
    blocks (NoPE: no RoPE keys; no layer count, its blocks give it), Qwen3.5's layer types,
    Gated DeltaNet sizes and rope_parameters with the partial factor."""
    if name == "nemotron_h":
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "num_hidden_layers",
                    "rms_norm_eps"):
            cfg.pop(key, None)
        def refuse(what):
            raise CheckpointError(f"{what} cannot be exported as NemotronHForCausalLM")
        cfg.update(nemotron_config(m, types, refuse))
        return
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):  # written here
        cfg.pop(key, None)
    cfg.update(attention_bias=False, **linear_attention_config(m, types),
               rope_parameters={**(m.rope_scaling or {"rope_type": "default"}),
                                "rope_theta": m.rope_theta,
                                "partial_rotary_factor": m.partial_rotary_factor})
