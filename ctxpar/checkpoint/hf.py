"""Hugging Face folders <-> ctxpar: config.json fields and the weights in safetensors.

A family (families.py: Llama, Qwen2, Qwen3, Mistral, Gemma 3, the hybrids of
linear_families.py, the mixtures of experts of moe_families.py) is ctxpar's GPT with some
fields fixed; the rest map one to one, both ways:

    ctxpar model.*      config.json                 ctxpar model.*     config.json
    vocab_size          vocab_size                  norm_eps           rms_norm_eps
    d_model             hidden_size                 rope_theta         rope_theta
    n_layers            num_hidden_layers           rope_scaling       rope_scaling
    n_heads             num_attention_heads         tie_embeddings     tie_word_embeddings
    n_kv_heads          num_key_value_heads         seq_len            max_position_embeddings
    ffn_hidden          intermediate_size           init_std           initializer_range
    head_dim            head_dim                    query_pre_attn_scalar (Gemma)

Written in the classic form (rope_theta / rope_scaling), which transformers 4.x reads and
5.x converts to its ``rope_parameters``; both forms are read (Gemma 3's per-layer-type
form too). A field ctxpar does not implement at its value, or does not know, is refused
with its name (``CheckpointError`` -> exit 2), as is every tensor of the folder ctxpar
would not use, a missing one, a shard the index names that is absent and a dtype it
cannot read (weight_reader.py's ``WeightReader.check``, re-exported here). The vocabulary is exported as is: ctxpar never pads it
(config refuses vocab_size % tp).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..config import (ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL, ModelConfig,
                      resolved_ffn_hidden, resolved_head_dim)
from ..config.layers import ATTENTION_TYPES, layer_types
from .families import (ARCH_DEFAULTS, FAMILIES, IGNORED_KEYS, MAPPED_KEYS, NOT_IMPLEMENTED,
                       WRAPPERS, family_of, moe_held)
from .linear_families import (HYBRID_LAYER_TYPES, NEMOTRON_EXPORT, hybrid_family_config,
                              linear_attention_fields, nemotron_block_types, nemotron_fields,
                              qwen3_5_rope)
from .moe_families import MOE_FAMILIES, moe_config, moe_fields, per_expert_tensors
from .names import to_hf
from .olmo_hybrid import olmo_hybrid_config, olmo_hybrid_fields, saved_tensors
from . import qwen3_next
from .qwen3_next import QWEN3_NEXT_FAMILIES
from .resume import CheckpointError
from .weight_reader import (CONFIG, DTYPES, WEIGHTS, WEIGHTS_INDEX, WeightReader,  # noqa: F401
                            is_hf_folder, read_raw_config, router_buffer_names)

# model.* a run started from a folder may set differently: context extension; the export
# label.
MAY_DIFFER = ("seq_len", "rope_theta", "rope_scaling", "layer_rope", "init_std", "family")


def naming_of(m) -> str:
    """How m's family names its tensors (names.HF_NAMINGS)."""
    try:
        if family_of(m) in ("nemotron_h", "olmo_hybrid"):
            return family_of(m)
    except KeyError:  # no family holds m: its export is refused elsewhere
        pass
    return "post_norms" if m.post_norms else "default"


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def family_config(m, tokenizer: Optional[Dict[str, Any]] = None,
                  source: Optional[Dict[str, Any]] = None,
                  max_positions: Optional[int] = None) -> Dict[str, Any]:
    """config.json of model.family's ForCausalLM equal to ModelConfig m (families.family_of
    when model.family is unset); refuses a model the family cannot hold.

    Token ids: the source folder's config.json's (source: where model.init_from's chain
    started), each replaced by the run's tokenizer's where it names one (tokenizer_info).
    max_position_embeddings: the larger of m.seq_len and max_positions (the source's
    limit, or the longest run along the chain): training shorter keeps the limit."""
    try:
        name = family_of(m)
    except KeyError:
        fields = ", ".join(f"model.{k}={getattr(m, k)!r}" for k in ARCH_DEFAULTS)
        raise CheckpointError(f"no Hugging Face family holds this model ({fields}); the "
                              f"families: {', '.join(FAMILIES)} (docs/checkpoints.md)") from None
    fam = FAMILIES[name]
    _check_moe_held(m, name)
    for key, want in fam.fixed.items():
        if getattr(m, key) != want:
            raise CheckpointError(f"model.{key}={getattr(m, key)!r} cannot be exported as "
                                  f"{fam.architecture} ({name} has {key}={want!r})")
    if name != "gemma3_text" and m.query_pre_attn_scalar not in (None, resolved_head_dim(m)):
        raise CheckpointError(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} cannot "
                              f"be exported as {fam.architecture} (its scale is head_dim)")
    hd = resolved_head_dim(m)
    types = _exported_layer_types(m, name, fam.architecture)
    cfg = {
        "architectures": [fam.architecture], "model_type": name,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "intermediate_size": resolved_ffn_hidden(m), "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
        "head_dim": hd, fam.activation[0]: fam.activation[1],
        "max_position_embeddings": max(m.seq_len, max_positions or 0),
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": m.rope_scaling,
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": m.init_std, "torch_dtype": "float32",
        **{k: (source or {}).get(k) for k in TOKEN_IDS},
        **{k: v for k, v in (tokenizer or {}).get("ids", {}).items() if v is not None},
    }
    _family_keys(cfg, m, name, types, source)
    return cfg


def _family_keys(cfg: Dict[str, Any], m, name: str, types: list,
                 source: Optional[Dict[str, Any]]) -> None:
    """family_config's keys that only some families write: their windows, biases, experts
    and hybrid layers (each family's module), Gemma 3's RoPE per layer type."""
    fam, sliding = FAMILIES[name], "sliding_attention" in types
    if name == "llama":
        cfg.update(attention_bias=m.bias, mlp_bias=m.bias, pretraining_tp=1)
    if name in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=sliding, sliding_window=m.sliding_window,
                   layer_types=types, max_window_layers=(
                       types.index("sliding_attention") if sliding else m.n_layers))
    if name in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if name in ("mistral", "mixtral"):
        cfg["sliding_window"] = m.sliding_window if sliding else None
    if name in MOE_FAMILIES:  # model.moe (moe_families.py); Qwen3-MoE's window on every
        # layer or none, Qwen2-MoE's none, its q/k/v biases from qkv_bias
        cfg.update(moe_config(m, name, lambda what: _refuse_export(what, fam), source))
        if name == "qwen3_moe":
            cfg.update(use_sliding_window=sliding,
                       sliding_window=m.sliding_window if sliding else None)
        if name == "qwen2_moe":
            cfg.update(qkv_bias=m.attention_bias, use_sliding_window=False,
                       sliding_window=None, layer_types=types)
        if name == "gpt_oss":  # its alternating windows; biases on q/k/v/o
            cfg.update(layer_types=types, attention_bias=True,
                       sliding_window=m.sliding_window if sliding else None)
    if name in ("nemotron_h", "qwen3_5_text"):  # the hybrids' layers (linear_families.py)
        hybrid_family_config(cfg, m, name, types)
    if name in QWEN3_NEXT_FAMILIES:  # Qwen3.5's layers with experts (qwen3_next.py)
        hybrid_family_config(cfg, m, "qwen3_5_text", types)
        if name == "qwen3_5_moe_text":
            qwen3_next.hybrid_moe_config(cfg, m, lambda what: _refuse_export(what, fam))
    if name == "olmo_hybrid":  # its layers and RoPE or NoPE (olmo_hybrid.py)
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg.update(olmo_hybrid_config(m, types))
    if name == "gemma3_text":
        _gemma3_keys(cfg, m, types)


def _gemma3_keys(cfg: Dict[str, Any], m, types: list) -> None:
    """Gemma 3's window, query scale and RoPE base per layer type (rope_parameters)."""
    hd, sliding = resolved_head_dim(m), "sliding_attention" in types
    scaling = dict(m.rope_scaling or {"rope_type": "default"})
    local = (m.layer_rope or {}).get("sliding_attention", {})
    local_scaling = dict(local.get("rope_scaling") or {"rope_type": "default"})
    del cfg["rope_theta"], cfg["rope_scaling"]
    # transformers makes Gemma 3's sliding mask whatever the layers: a window it reads
    # (its default) when no layer slides
    cfg.update(attention_bias=False, layer_types=types,
               sliding_window=m.sliding_window if sliding else 4096,
               query_pre_attn_scalar=_number(m.query_pre_attn_scalar
                                             if m.query_pre_attn_scalar is not None
                                             else hd),
               final_logit_softcapping=None, attn_logit_softcapping=None,
               use_bidirectional_attention=False,
               rope_parameters={"full_attention": {**scaling, "rope_theta": m.rope_theta},
                                "sliding_attention": {
                                    **local_scaling, "rope_theta": float(local.get(
                                        "rope_theta", m.rope_theta))}})


def _refuse_export(what: str, fam) -> None:
    raise CheckpointError(f"{what} cannot be exported as {fam.architecture}")


def _check_moe_held(m, name: str) -> None:
    """model.moe exported by a MoE family only, with the values it fixes."""
    fam = FAMILIES[name]
    if moe_held(m, fam):
        return
    if fam.moe_fixed is None:
        raise CheckpointError(f"model.moe is set: {fam.architecture} has no experts (the "
                              f"mixture-of-experts families: {', '.join(MOE_FAMILIES)})")
    if m.moe is None:
        raise CheckpointError(f"model.moe=None cannot be exported as {fam.architecture} (a "
                              f"mixture-of-experts family)")
    key, want = next((k, v) for k, v in fam.moe_fixed.items() if getattr(m.moe, k) != v)
    raise CheckpointError(f"model.moe.{key}={getattr(m.moe, key)!r} cannot be exported as "
                          f"{fam.architecture} ({name} has {key}={want!r})")


def _exported_layer_types(m, name: str, architecture: str) -> list:
    """Each layer's type as the family writes it; refuses the attention kinds it cannot
    hold (chunks and sinks: none of them; mixed layers: Llama and Mistral; RoPE per layer
    type: Gemma 3's sliding layers only)."""
    types = layer_types(m)

    def refuse(what):
        raise CheckpointError(f"{what} cannot be exported as {architecture}")
    if m.attention_sinks and name != "gpt_oss":
        refuse("model.attention_sinks=true")
    if name in ("qwen3_5_text", "olmo_hybrid", *QWEN3_NEXT_FAMILIES):  # Gated DeltaNet
        # and full attention only
        if set(types) - set(HYBRID_LAYER_TYPES) or (
                name == "olmo_hybrid" and set(types) != set(HYBRID_LAYER_TYPES)):
            refuse(f"model.layer_types={types} ({architecture[:-len('ForCausalLM')]} has "
                   f"{' and '.join(HYBRID_LAYER_TYPES)} layers"
                   f"{', both' if name == 'olmo_hybrid' else ''})")
        if name == "olmo_hybrid" and m.partial_rotary_factor != 1.0:
            refuse(f"model.partial_rotary_factor={m.partial_rotary_factor}")
        return types
    if name == "nemotron_h":  # one op a block: Mamba2, attention or MLP (a MoE block is an
        # MLP block of model.moe.layers, written 'moe': nemotron_moe.py)
        if set(types) - set(NEMOTRON_EXPORT):
            refuse(f"model.layer_types={types} (Nemotron-H has {', '.join(NEMOTRON_EXPORT)} "
                   f"blocks)")
        return types
    if m.partial_rotary_factor != 1.0:
        refuse(f"model.partial_rotary_factor={m.partial_rotary_factor}")
    linear = sorted(set(types) - set(ATTENTION_TYPES))
    if linear:
        refuse(f"model.layer_types with {linear} layers (Gated DeltaNet, Mamba2 and "
               f"single-op blocks: Qwen3.5's layer_types hold Gated DeltaNet)")
    if "chunked_attention" in types:
        refuse(f"model.layer_types={types} (chunked attention)")
    if name in ("llama", "qwen2_moe") and "sliding_attention" in types:
        refuse(f"model.sliding_window={m.sliding_window} (Llama has no window; Mistral, "
               f"Qwen and Gemma 3 do)" if name == "llama" else
               f"model.sliding_window={m.sliding_window} (ctxpar writes Qwen2-MoE without "
               f"sliding layers; Mixtral and Qwen3-MoE have a window)")
    if name in ("mistral", "mixtral", "qwen3_moe") and len(set(types)) > 1:
        refuse(f"model.layer_types={types} ({FAMILIES[name].architecture[:-11]}'s window is "
               f"on every layer or none)")
    allowed = {"sliding_attention"} if name == "gemma3_text" else set()
    if set(m.layer_rope or {}) - allowed:
        refuse(f"model.layer_rope={m.layer_rope} (RoPE per layer type: Gemma 3's sliding "
               f"layers only)")
    return types


def _number(x: float):
    """x as transformers' config classes type it: an int when whole (Gemma's
    query_pre_attn_scalar is an int field)."""
    return int(x) if float(x).is_integer() else x


def read_config(path: str) -> Dict[str, Any]:
    """config.json of the folder's causal LM: the file itself, or a multimodal folder's
    text_config (families.WRAPPERS: Qwen3.5's released folders) with the head's tying."""
    hf = read_raw_config(path)
    wrapper = WRAPPERS.get(hf.get("model_type"))
    if wrapper is None:
        return hf
    file, text = os.path.join(path, CONFIG), hf.get("text_config")
    allowed = {"text_config", "tie_word_embeddings", *wrapper.top_keys} | IGNORED_KEYS
    for key in sorted(hf):
        if key not in allowed:
            raise CheckpointError(f"{file}: {key}={hf[key]!r}: a config field ctxpar does "
                                  f"not know for model_type {hf['model_type']!r}")
    if not isinstance(text, dict) or text.get("model_type", wrapper.text_family) != \
            wrapper.text_family:
        raise CheckpointError(f"{file}: text_config={text!r}: ctxpar imports a "
                              f"{hf['model_type']!r} folder's {wrapper.text_family!r} "
                              f"language model")
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": wrapper.text_family, "tie_word_embeddings": tied,
            "architectures": [FAMILIES[wrapper.text_family].architecture]}


def left_out(path: str) -> Optional[str]:
    """What a folder holds besides the causal LM ctxpar imports: a multimodal folder's
    vision tower, Qwen3-Next's and Qwen3.5-MoE's multi-token prediction layers (None:
    nothing)."""
    wrapper = WRAPPERS.get(read_raw_config(path).get("model_type"))
    what = [] if wrapper is None else [wrapper.what]
    mtp = WeightReader(path, False).left_out()
    if mtp:
        what.append(f"the multi-token prediction layers ({len(mtp)} tensors "
                    f"{qwen3_next.MTP_PREFIX}*, which transformers drops too)")
    if not what:
        return None
    return f"its {'language model' if wrapper else 'causal LM'}; left out: {' and '.join(what)}"


def _rope(hf: Dict[str, Any], file: str, default_theta: float,
          full_layers_only: bool) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, ctxpar rope_scaling) from either form of config.json (Gemma 3's
    per-layer-type rope_parameters: its full-attention layers')."""
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    if full_layers_only and isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    return _rope_of(params, hf, file, hf.get("rope_theta", default_theta))


def _rope_of(params: Dict[str, Any], hf: Dict[str, Any], file: str,
             default_theta: float) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, ctxpar rope_scaling) of one set of RoPE parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
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


def _attention_kinds(hf: Dict[str, Any], file: str, refuse) -> Dict[str, Any]:
    """model.sliding_window, layer_types and layer_rope as transformers reads config.json:
    Mistral, a window on every layer or none; Qwen2/Qwen3, sliding layers from
    max_window_layers on when use_sliding_window (layer_types when given; a sliding layer
    without a window attends fully); Gemma 3, layer_types or all but every
    sliding_window_pattern-th layer sliding, those with their own RoPE (rope_parameters'
    sliding_attention, else rope_local_base_freq)."""
    name, n, types = hf["model_type"], hf["num_hidden_layers"], hf.get("layer_types")
    if name in ("mistral", "mixtral", "qwen3_moe"):  # every layer (Qwen3-MoE: when
        # use_sliding_window, as its config class reads it) or none
        window = hf.get("sliding_window") if name != "qwen3_moe" or \
            hf.get("use_sliding_window") else None
        return {} if window is None else {"sliding_window": window}
    if name == "qwen2_moe":  # use_sliding_window is false (families.py): full attention
        if types is not None and types != ["full_attention"] * n:
            refuse("layer_types", types, f"Qwen2-MoE's layers are full attention in ctxpar "
                                         f"({n}; use_sliding_window is false)")
        return {}
    if name == "gpt_oss":  # layer_types, or every other layer sliding from the first
        window = hf.get("sliding_window", 128)
        if types is None:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(n)]
    elif name == "gemma3_text":
        window = hf.get("sliding_window", 4096)
        if types is None:
            every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(n)]
    else:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if types is None:
            types = ["sliding_attention" if window is not None and i >= hf.get(
                "max_window_layers", 28) else "full_attention" for i in range(n)]
        if window is None:  # transformers' sliding layers without a window: full ones
            types = ["full_attention"] * n
    if not isinstance(types, list) or len(types) != n or \
            set(types) - {"full_attention", "sliding_attention"}:
        refuse("layer_types", types, f"one of 'full_attention', 'sliding_attention' per "
                                     f"layer ({n})")
    if "sliding_attention" not in types:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse("sliding_window", window, "the sliding layers need a window of >= 1 tokens")
    fields = {"sliding_window": window,
              "layer_types": None if set(types) == {"sliding_attention"} else types}
    if name == "gemma3_text":
        local = (hf.get("rope_parameters") or {}).get("sliding_attention")
        theta, scaling = _rope_of(local, hf, file, 10_000.0) if isinstance(local, dict) \
            else (float(hf.get("rope_local_base_freq", 10_000.0)), None)
        fields["layer_rope"] = {"sliding_attention": {"rope_theta": theta,
                                                      "rope_scaling": scaling}}
    return fields


def model_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """ctxpar model.* values of a config.json of a known family; refuses, naming the field,
    what ctxpar cannot represent and what it does not know."""
    file = os.path.join(path, CONFIG)

    def refuse(field, value, why):
        raise CheckpointError(f"{file}: {field}={value!r}: {why}")

    name = hf.get("model_type")
    if name not in FAMILIES:
        refuse("model_type", name, f"ctxpar imports {', '.join(FAMILIES)} (a folder of "
                                   f"another family cannot be relabelled: its architecture "
                                   f"differs)")
    fam = FAMILIES[name]
    arch = hf.get("architectures")
    if arch is not None and arch != [fam.architecture]:
        refuse("architectures", arch, f"ctxpar imports {fam.architecture} (the causal LM "
                                      f"with its head) for model_type {name!r}")
    _check_keys(hf, name, refuse)
    fields = _family_fields(hf, name, refuse)
    if name == "nemotron_h":  # its layer count is its blocks'
        hf = {**hf, "num_hidden_layers": len(nemotron_block_types(hf, refuse))}
    if name == "qwen3_5_moe_text":  # no dense MLP: ffn_hidden is the experts' width
        hf = qwen3_next.moe_text_fields(hf)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            refuse(key, hf.get(key), "config.json must give it as an integer")
    if name in ("qwen3_5_text", *QWEN3_NEXT_FAMILIES):  # Gated DeltaNet layers; the
        # attention layers' partial RoPE
        kinds = linear_attention_fields(hf, refuse)
        hf, kinds["partial_rotary_factor"] = qwen3_5_rope(hf)
    elif name == "nemotron_h":  # Mamba2, attention and MLP blocks
        kinds = nemotron_fields(hf, refuse)
    elif name == "olmo_hybrid":  # Gated DeltaNet layers; RoPE or NoPE
        hf, kinds = olmo_hybrid_fields(hf, refuse)
    else:
        kinds = _attention_kinds(hf, file, refuse)
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    hd = hf.get("head_dim") or d // heads
    theta, scaling = _rope(hf, file, fam.default_theta, name == "gemma3_text")
    qpas = hf.get("query_pre_attn_scalar") if name == "gemma3_text" else None
    fields.update({
        "vocab_size": hf["vocab_size"], "d_model": d, "n_layers": hf["num_hidden_layers"],
        "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hd if hd != d // heads or d % heads else None,
        "query_pre_attn_scalar": None if qpas in (None, hd) else float(qpas),
        "ffn_hidden": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),  # transformers' default for each family
        "rope_theta": theta, "rope_scaling": scaling,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", name == "gemma3_text")),
        "seq_len": hf.get("max_position_embeddings"), "init_std": hf.get("initializer_range"),
        "family": name, **kinds})
    return fields


def _check_keys(hf: Dict[str, Any], name: str, refuse: Callable) -> None:
    """Every config.json key known for the family (mapped, neutral at its value, the
    family's own, inert or ignored), its MLP's activation ctxpar's; refuses the first that
    is not."""
    fam = FAMILIES[name]
    known = (IGNORED_KEYS | MAPPED_KEYS | set(NOT_IMPLEMENTED) | set(fam.neutral)
             | set(fam.own) | set(fam.inert) | {fam.activation[0]})
    for key in sorted(hf):
        if key in fam.inert:
            continue
        if key in NOT_IMPLEMENTED and key not in fam.own and hf[key] not in (None, 0, False,
                                                                              {}):
            refuse(key, hf[key], f"{NOT_IMPLEMENTED[key]} is not implemented by ctxpar")
        if key not in known:
            refuse(key, hf[key], f"a config field ctxpar does not know for model_type "
                                 f"{name!r}; it may change the computation (remove it from "
                                 f"config.json if it does not)")
    act_key, act = fam.activation
    if hf.get(act_key, act) != act:
        refuse(act_key, hf[act_key], f"{fam.architecture}'s MLP in ctxpar uses {act}")
    if name == "gemma3_text" and hf.get("hidden_act", act) != act:
        refuse("hidden_act", hf["hidden_act"], f"Gemma 3's MLP in ctxpar uses {act}")
    if hf.get("attention_dropout", 0.0) not in (0, 0.0, None):
        refuse("attention_dropout", hf["attention_dropout"], "ctxpar trains without dropout")
    for key, (want, why) in fam.neutral.items():
        if hf.get(key, want) != want:
            refuse(key, hf[key], why)


def _family_fields(hf: Dict[str, Any], name: str, refuse: Callable) -> Dict[str, Any]:
    """model.* values the family fixes, with Llama's biases, Qwen2-MoE's q/k/v biases and
    the experts (moe_families.py) from config.json; gpt-oss's quantization checked."""
    fields = dict(FAMILIES[name].fixed)
    if name == "llama":
        attn, mlp = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn != mlp:
            refuse("attention_bias", attn, f"with mlp_bias={mlp}: ctxpar's model.bias puts "
                                           f"biases on every linear layer, or on none")
        fields["bias"] = bool(attn)
    if name == "qwen2_moe":  # its q/k/v biases (transformers' default: on)
        fields["attention_bias"] = hf.get("qkv_bias", True)
        if not isinstance(fields["attention_bias"], bool):
            refuse("qkv_bias", hf["qkv_bias"], "config.json must give it as a boolean")
    if name in MOE_FAMILIES:  # model.moe (moe_families.py)
        fields["moe"] = moe_fields(hf, name, refuse)
    quant = hf.get("quantization_config")
    if name == "gpt_oss" and quant and (not isinstance(quant, dict) or quant.get(
            "quant_method") != "mxfp4"):  # MXFP4 experts are dequantized (WeightReader)
        refuse("quantization_config", quant, "gpt-oss's MXFP4 experts are read; no other "
                                             "quantization is implemented by ctxpar")
    return fields


def architecture(fields: Dict[str, Any]) -> Dict[str, Any]:
    """model.* fields with the ones left unset resolved (n_kv_heads, ffn_hidden, head_dim,
    query_pre_attn_scalar, layer_types), so that two descriptions of one architecture
    compare equal."""
    m = ModelConfig(**{k: v for k, v in fields.items() if k != "init_from"})
    return {**vars(m), "n_kv_heads": m.n_kv_heads or m.n_heads, "layer_types": layer_types(m),
            "ffn_hidden": resolved_ffn_hidden(m), "head_dim": resolved_head_dim(m),
            "query_pre_attn_scalar": (m.query_pre_attn_scalar if m.query_pre_attn_scalar
                                      is not None else float(resolved_head_dim(m)))}


ROUTER_LOSSES = ("aux_loss_coef", "z_loss_coef")  # model.moe's that a run may change


def _router_losses_only(a, b) -> bool:
    """Two model.moe that differ in their router losses' weights only."""
    from dataclasses import replace
    zero = dict.fromkeys(ROUTER_LOSSES, 0.0)
    return a is not None and b is not None and replace(a, **zero) == replace(b, **zero)


def check_matches(m, hf_fields: Dict[str, Any], path: str) -> Dict[str, Tuple[Any, Any]]:
    """model.* against an imported folder's fields: refuse any architecture difference;
    return the allowed ones (MAY_DIFFER, and model.moe's ROUTER_LOSSES) that differ,
    {field: (folder's, config's)}. model.family left unset is no difference (the run takes
    the folder's). A refusal is one line naming each differing field of a section
    (model.moe.top_k), not the sections' whole reprs."""
    from dataclasses import fields, is_dataclass

    may = ", ".join(MAY_DIFFER + tuple(f"moe.{k}" for k in ROUTER_LOSSES))
    theirs, now = architecture(hf_fields), architecture(vars(m))
    changed = {}
    for key, value in theirs.items():
        if key == "init_from" or value == now[key] or (key == "family" and m.family is None):
            continue
        if key == "moe" and _router_losses_only(value, now[key]):  # training, not the model
            changed.update({f"moe.{k}": (getattr(value, k), getattr(now[key], k))
                            for k in ROUTER_LOSSES if getattr(value, k) != getattr(now[key], k)})
            continue
        if key in MAY_DIFFER:
            changed[key] = (value, now[key])
            continue
        diffs = [(key, value, now[key])]  # (name, the folder's, the config's)
        if is_dataclass(value) and type(value) is type(now[key]):
            diffs = [(f"{key}.{f.name}", getattr(value, f.name), getattr(now[key], f.name))
                     for f in fields(value) if f.name not in (ROUTER_LOSSES if key == "moe"
                                                              else ())
                     and getattr(value, f.name) != getattr(now[key], f.name)]
        name, folder, mine = diffs[0]
        more = f" (and {', '.join(f'model.{d[0]}' for d in diffs[1:])} differ)" \
            if diffs[1:] else ""
        raise CheckpointError(f"model.{name}={mine!r} but model.init_from={path} has "
                              f"{name}={folder!r}: set "
                              + " ".join(f"model.{n}={f!r}" for n, f, _ in diffs)
                              + f"{more} (only {may} may differ)")
    return changed


def tokenizer_info(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """EOS name and the token ids of the run's tokenizer.json (None: the byte-level
    tokenizer): EOS always; BOS and PAD as the tokenizer_config.json beside it names them,
    BOS else the one token its post-processor puts first (None: it does not say)."""
    if path is None:
        return None
    from ..data.tokenizer import HFTokenizer, declared_token
    tok = HFTokenizer(path)
    bos = tok.token_id(declared_token(path, "bos_token"))
    if bos is None and len(tok.bos_ids) == 1:
        bos = tok.bos_ids[0]
    return {"path": path, "eos_token": tok.eos_token,
            "ids": {"eos_token_id": tok.eos_id, "bos_token_id": bos,
                    "pad_token_id": tok.token_id(declared_token(path, "pad_token"))}}


def save_folder(out_dir: str, weights: Iterator[Tuple[str, torch.Tensor]], m,
                tokenizer: Optional[str] = None, dtype: torch.dtype = torch.float32,
                source: Optional[Dict[str, Any]] = None,
                max_positions: Optional[int] = None) -> None:
    """Write a Hugging Face folder of m's family (family_config, with the source folder's
    token ids and position limit): config.json, model.safetensors, and the tokenizer files
    when the run used a Hugging Face tokenizer. weights: (GPT name, full tensor)."""
    from safetensors.torch import save_file
    tok = tokenizer_info(tokenizer)
    # refuses a model no family holds before anything is written
    cfg = family_config(m, tok, source, max_positions)
    naming = naming_of(m)
    tensors = {}
    for n, t in weights:  # OLMo Hybrid's fused [q | k | v] written as its parts, the
        key = to_hf(n, naming)  # experts per expert, as transformers' save_pretrained does
        for k, part in (saved_tensors(key, t, m) if naming == "olmo_hybrid" else [(key, t)]):
            for k2, v in per_expert_tensors(k, part.to(dtype), cfg["model_type"]):
                tensors[k2] = v.contiguous()
    if cfg["model_type"] == "qwen3_next":  # its Gated DeltaNet's projections fused
        tensors = qwen3_next.saved_tensors(tensors, m)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump({**cfg, "torch_dtype": str(dtype).replace("torch.", "")}, f, indent=2)
    if tok is not None:
        shutil.copyfile(tok["path"], os.path.join(out_dir, "tokenizer.json"))
        # the folder's own tokenizer_config.json (special tokens, chat template) when it
        # had one, with the run's EOS and length
        saved = {"tokenizer_class": "PreTrainedTokenizerFast"}
        beside = os.path.join(os.path.dirname(os.path.abspath(tok["path"])),
                              "tokenizer_config.json")
        if os.path.isfile(beside):
            with open(beside, encoding="utf-8") as f:
                saved = json.load(f)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({**saved, "eos_token": tok["eos_token"],
                       "model_max_length": cfg["max_position_embeddings"]}, f, indent=2)
