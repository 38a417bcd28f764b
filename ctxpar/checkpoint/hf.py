"""Hugging Face folders <-> ctxpar: config.json fields and the weights in safetensors.

A family (families/: one file each, registered in config/hf_families.py) is ctxpar's GPT
with some fields fixed; the rest map one to one, both ways, here:

    ctxpar model.*      config.json                 ctxpar model.*     config.json
    vocab_size          vocab_size                  norm_eps           rms_norm_eps
    d_model             hidden_size                 rope_theta,        rope_parameters
    n_layers            num_hidden_layers             rope_scaling     (rope_config.py)
    n_heads             num_attention_heads         tie_embeddings     tie_word_embeddings
    n_kv_heads          num_key_value_heads         seq_len            max_position_embeddings
    ffn_hidden          intermediate_size           init_std           initializer_range
    head_dim            head_dim

and each family's hooks (families/base.py) read and write the rest. This file names no
family. RoPE is written as ``rope_parameters`` (per layer type where the family has
them), the form transformers 5's config classes read; both forms are read. Every export
is written by export.py, which reads its config.json back before it reports success
(export_check.py). A field ctxpar
does not implement at its value, or does not know, is refused with its name
(``CheckpointError`` -> exit 2), as is every tensor of the folder ctxpar would not use, a
missing one, a shard the index names that is absent and a dtype it cannot read
(weight_reader.py's ``WeightReader.check``, re-exported here). The vocabulary is
exported as is: ctxpar never pads it (config refuses vocab_size % tp).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from ..config import ModelConfig, resolved_ffn_hidden, resolved_head_dim
from ..config.hf_families import NOT_BUILT
from ..config.layers import layer_types
from ..config.dsa import dsa_architecture
from .families import FAMILIES, WRAPPERS, family_of, moe_fixed_of, moe_held
from .families.base import ARCH_DEFAULTS, refuse_export_of
from .resume import CheckpointError
from .rope_config import rope_keys
from .weight_reader import (CONFIG, DTYPES, WEIGHTS, WEIGHTS_INDEX, WeightReader,  # noqa: F401
                            is_hf_folder, read_raw_config, folder_buffers)

# model.* a run started from a folder may set differently: context extension; the export
# label.
MAY_DIFFER = ("seq_len", "rope_theta", "rope_scaling", "layer_rope", "init_std", "family")


def naming_of(m) -> str:
    """How m's family names its tensors (names.HF_NAMINGS)."""
    try:
        return FAMILIES[family_of(m)].naming(m)
    except KeyError:  # no family holds m: its export is refused elsewhere
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
    refuse_export = refuse_export_of(fam)
    _check_moe_held(m, name)
    for key, want in fam.fixed.items():
        if getattr(m, key) != want:
            raise CheckpointError(f"model.{key}={getattr(m, key)!r} cannot be exported as "
                                  f"{fam.architecture} ({name} has {key}={want!r})")
    fam.check_query_scale(m, refuse_export)
    types = fam.export_layer_types(m, refuse_export)
    cfg = {
        "architectures": [fam.architecture], "model_type": name,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "intermediate_size": resolved_ffn_hidden(m), "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
        "head_dim": resolved_head_dim(m), fam.activation[0]: fam.activation[1],
        "max_position_embeddings": max(m.seq_len, max_positions or 0),
        "rms_norm_eps": m.norm_eps, **rope_keys(m.rope_theta, m.rope_scaling),
        "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0,
        "initializer_range": m.init_std, "torch_dtype": "float32",
        **{k: (source or {}).get(k) for k in TOKEN_IDS},
        **{k: v for k, v in (tokenizer or {}).get("ids", {}).items() if v is not None},
    }
    fam.config(cfg, m, types, source, refuse_export)
    fam.export_mtp(cfg, m, refuse_export)  # model.mtp's keys, or its refusal
    return cfg


MTP_MAY_DIFFER = ("loss_weight",)  # model.mtp's training choice, not the model


def folder_mtp(hf_cfg: Dict[str, Any], path: str):
    """The folder's MTP layers as model.mtp (its family's mtp hook), None: none."""
    file = os.path.join(path, CONFIG)

    def refuse(field, value, why):
        raise CheckpointError(f"{file}: {field}={value!r}: {why}")

    return FAMILIES[hf_cfg["model_type"]].mtp(hf_cfg, refuse)


def check_mtp(m, hf_cfg: Dict[str, Any], path: str) -> None:
    """model.mtp against the folder's MTP layers: null takes none (left out, said at
    start-up); set, the folder must hold the same layers (loss_weight aside)."""
    if m.mtp is None:
        return
    from dataclasses import fields
    theirs = folder_mtp(hf_cfg, path)
    if theirs is None:
        raise CheckpointError(f"model.mtp is set but model.init_from={path} has no "
                              f"multi-token prediction layers (set model.mtp: null)")
    for f in fields(theirs):
        want, got = getattr(theirs, f.name), getattr(m.mtp, f.name)
        if f.name not in MTP_MAY_DIFFER and want != got:
            raise CheckpointError(f"model.mtp.{f.name}={got!r} but model.init_from={path} has "
                                  f"{f.name}={want!r}: set model.mtp.{f.name}={want!r}")


def _check_moe_held(m, name: str) -> None:
    """model.moe exported by a MoE family only, with the values it fixes."""
    fam = FAMILIES[name]
    if moe_held(m, fam):
        return
    if fam.moe_fixed is None:
        moe_families = [n for n, f in FAMILIES.items() if f.moe_fixed is not None]
        raise CheckpointError(f"model.moe is set: {fam.architecture} has no experts (the "
                              f"mixture-of-experts families: {', '.join(moe_families)})")
    if m.moe is None:
        raise CheckpointError(f"model.moe=None cannot be exported as {fam.architecture} (a "
                              f"mixture-of-experts family)")
    key, want = next((k, v) for k, v in moe_fixed_of(fam).items() if getattr(m.moe, k) != v)
    raise CheckpointError(f"model.moe.{key}={getattr(m.moe, key)!r} cannot be exported as "
                          f"{fam.architecture} ({name} has {key}={want!r})")


def read_config(path: str) -> Dict[str, Any]:
    """config.json of the folder's causal LM: the file itself, or a multimodal folder's
    text_config (families.WRAPPERS: Qwen3.5's released folders) with the head's tying."""
    from .families.base import IGNORED_KEYS
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


def left_out(path: str, m=None) -> Optional[str]:
    """What a folder holds besides the causal LM ctxpar imports: a multimodal folder's
    vision tower, the multi-token prediction layers its family leaves out unless model.mtp
    takes them (m: the run's ModelConfig; None: nothing)."""
    wrapper = WRAPPERS.get(read_raw_config(path).get("model_type"))
    what = [] if wrapper is None else [wrapper.what]
    mtp = [] if m is not None and m.mtp is not None else WeightReader(path, False).left_out()
    if mtp:  # their common prefix up to a dot: mtp.*, model.layers.61.*
        prefix = os.path.commonprefix(mtp)
        prefix = prefix[:prefix.rfind(".") + 1] if "." in prefix else prefix
        what.append(f"the multi-token prediction layers ({len(mtp)} tensors "
                    f"{prefix}*, which transformers drops too)")
    if not what:
        return None
    return f"its {'language model' if wrapper else 'causal LM'}; left out: {' and '.join(what)}"


def model_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """ctxpar model.* values of a config.json of a known family; refuses, naming the field,
    what ctxpar cannot represent and what it does not know."""
    file = os.path.join(path, CONFIG)

    def refuse(field, value, why):
        raise CheckpointError(f"{file}: {field}={value!r}: {why}")

    name = hf.get("model_type")
    if name in NOT_BUILT:
        refuse("model_type", name, NOT_BUILT[name])
    if name not in FAMILIES:
        refuse("model_type", name, f"ctxpar imports {', '.join(FAMILIES)} (a folder of "
                                   f"another family cannot be relabelled: its architecture "
                                   f"differs)")
    fam = FAMILIES[name]
    arch = hf.get("architectures")
    if arch is not None and arch != [fam.architecture]:
        refuse("architectures", arch, f"ctxpar imports {fam.architecture} (the causal LM "
                                      f"with its head) for model_type {name!r}")
    fam.check_keys(hf, refuse)
    fields = fam.fields(hf, refuse)
    hf = fam.prepare(hf, refuse)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            refuse(key, hf.get(key), "config.json must give it as an integer")
    hf, kinds = fam.layers(hf, file, refuse)
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    hd = hf.get("head_dim") or d // heads
    theta, scaling = fam.rope(hf, file)
    fields.update({
        "vocab_size": hf["vocab_size"], "d_model": d, "n_layers": hf["num_hidden_layers"],
        "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hd if hd != d // heads or d % heads else None,
        "query_pre_attn_scalar": None, "ffn_hidden": hf["intermediate_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),  # transformers' default for each family
        "rope_theta": theta, "rope_scaling": scaling,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", fam.tied_default)),
        "seq_len": hf.get("max_position_embeddings"), "init_std": hf.get("initializer_range"),
        "family": name, **kinds})
    return fields


def architecture(fields: Dict[str, Any]) -> Dict[str, Any]:
    """model.* fields with the ones left unset resolved (n_kv_heads, ffn_hidden, head_dim,
    query_pre_attn_scalar, layer_types), so that two descriptions of one architecture
    compare equal; model.dsa's training fields (stage, loss_weight) are no architecture."""
    m = ModelConfig(**{k: v for k, v in fields.items() if k != "init_from"})
    return {**vars(m), "n_kv_heads": m.n_kv_heads or m.n_heads, "layer_types": layer_types(m),
            "layer_rope": _own_layer_rope(m),
            "dsa": dsa_architecture(m.dsa),
            "ffn_hidden": resolved_ffn_hidden(m), "head_dim": resolved_head_dim(m),
            "query_pre_attn_scalar": (m.query_pre_attn_scalar if m.query_pre_attn_scalar
                                      is not None else float(resolved_head_dim(m)))}


def _own_layer_rope(m) -> Optional[Dict[str, Any]]:
    """model.layer_rope without the entries that turn as the model's own RoPE (the same
    base and scaling): an entry written out and one left unset are one model."""
    own = {kind: rope for kind, rope in (m.layer_rope or {}).items()
           if float(rope.get("rope_theta", m.rope_theta)) != float(m.rope_theta)
           or rope.get("rope_scaling", m.rope_scaling) != m.rope_scaling}
    return own or None


ROUTER_LOSSES = ("aux_loss_coef", "z_loss_coef")  # model.moe's that a run may change


def _router_losses_only(a, b) -> bool:
    """Two model.moe that differ in their router losses' weights only."""
    from dataclasses import replace
    zero = dict.fromkeys(ROUTER_LOSSES, 0.0)
    return a is not None and b is not None and replace(a, **zero) == replace(b, **zero)


def _loss_weight_only(a, b) -> bool:
    from dataclasses import replace
    return replace(a, loss_weight=0.0) == replace(b, loss_weight=0.0)


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
        if key == "mtp" and "mtp" not in hf_fields:  # a folder's: check_mtp compares them
            continue
        if key == "mtp" and now[key] is not None and value is not None and \
                _loss_weight_only(value, now[key]):
            changed["mtp.loss_weight"] = (value.loss_weight, now[key].loss_weight)
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
