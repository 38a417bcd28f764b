"""Hugging Face Llama <-> ctxpar: config.json fields and the weights in safetensors.

ctxpar's GPT with mlp=swiglu, norm=rmsnorm, bias=false is Llama's architecture (RoPE with
rotate-half pairs, GQA, SwiGLU, RMSNorm, pre-norm), so a LlamaForCausalLM folder is the
exchange format both ways:

    ctxpar model.*      config.json                 ctxpar model.*     config.json
    vocab_size          vocab_size                  norm_eps           rms_norm_eps
    d_model             hidden_size                 rope_theta         rope_theta
    n_layers            num_hidden_layers           rope_scaling       rope_scaling
    n_heads             num_attention_heads         tie_embeddings     tie_word_embeddings
    n_kv_heads          num_key_value_heads         seq_len            max_position_embeddings
    ffn_hidden          intermediate_size           init_std           initializer_range

plus hidden_act=silu, attention_bias=mlp_bias=false, head_dim=d_model/n_heads. Written in
the classic form (rope_theta / rope_scaling), which transformers 4.x reads and 5.x
converts to its ``rope_parameters``; both forms are read. Anything else (another
activation, biases, a RoPE type ctxpar does not implement, partial rotary, dropout) is
refused with the field's name (``CheckpointError`` -> exit 2). The vocabulary is exported
as is: ctxpar never pads it (config refuses vocab_size % tp).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from ..config import ROPE_SCALING_KEYS, resolved_ffn_hidden
from .names import to_hf
from .resume import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# model.* a run started from a Llama folder may set differently: context extension.
MAY_DIFFER = ("seq_len", "rope_theta", "rope_scaling", "init_std")


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def llama_config(m, tokenizer: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """config.json of the LlamaForCausalLM equal to ModelConfig m; refuses non-Llama models."""
    for key, value, llama in (("mlp", m.mlp, "swiglu"), ("norm", m.norm, "rmsnorm"),
                              ("bias", m.bias, False)):
        if value != llama:
            raise CheckpointError(f"model.{key}={value!r} cannot be exported as "
                                  f"LlamaForCausalLM (Llama has {key}={llama!r})")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model,
        "intermediate_size": resolved_ffn_hidden(m), "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
        "head_dim": m.d_model // m.n_heads, "hidden_act": "silu",
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": m.rope_scaling,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": m.init_std, "pretraining_tp": 1,
        "torch_dtype": "float32", "bos_token_id": None,
        "eos_token_id": (tokenizer or {}).get("eos_id"),
    }


def read_config(path: str) -> Dict[str, Any]:
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable config.json ({e})") from None


def _rope(hf: Dict[str, Any], file: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, ctxpar rope_scaling) from either form of a Llama config."""
    params = dict(hf.get("rope_parameters") or {})  # transformers >= 5
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**params, **legacy}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{file}: partial_rotary_factor={partial} (ctxpar rotates "
                              f"every channel)")
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KEYS:
        raise CheckpointError(f"{file}: rope_scaling.rope_type={kind!r} is not implemented by "
                              f"ctxpar (it has {', '.join(ROPE_SCALING_KEYS)})")
    return theta, {"rope_type": kind, **{k: params[k] for k in ROPE_SCALING_KEYS[kind]}}


def model_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """ctxpar model.* values of a Llama config.json; refuses what ctxpar cannot represent."""
    file = os.path.join(path, CONFIG)

    def refuse(field, value, why):
        raise CheckpointError(f"{file}: {field}={value!r}: {why}")

    if hf.get("model_type") != "llama":
        refuse("model_type", hf.get("model_type"), "ctxpar imports Llama models only")
    checks = (("hidden_act", "silu", "ctxpar's MLP is SwiGLU (silu)"),
              ("attention_bias", False, "ctxpar's attention has no biases"),
              ("mlp_bias", False, "ctxpar's MLP has no biases"),
              ("attention_dropout", 0.0, "ctxpar trains without dropout"))
    for field, want, why in checks:
        if hf.get(field, want) != want:
            refuse(field, hf[field], why)
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads):
        refuse("head_dim", hf["head_dim"], f"ctxpar's head dim is hidden_size/"
                                           f"num_attention_heads = {d // heads}")
    theta, scaling = _rope(hf, file)
    return {"vocab_size": hf["vocab_size"], "d_model": d, "n_layers": hf["num_hidden_layers"],
            "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn_hidden": hf["intermediate_size"], "mlp": "swiglu", "norm": "rmsnorm",
            "bias": False, "norm_eps": hf["rms_norm_eps"], "rope_theta": theta,
            "rope_scaling": scaling, "tie_embeddings": bool(hf.get("tie_word_embeddings")),
            "seq_len": hf.get("max_position_embeddings"),
            "init_std": hf.get("initializer_range")}


def check_matches(m, hf_fields: Dict[str, Any], path: str) -> Dict[str, Tuple[Any, Any]]:
    """model.* against an imported folder's fields: refuse any architecture difference;
    return the allowed ones (MAY_DIFFER) that differ, {field: (folder's, config's)}."""
    now = {**vars(m), "n_kv_heads": m.n_kv_heads or m.n_heads,
           "ffn_hidden": resolved_ffn_hidden(m)}
    changed = {}
    for key, value in hf_fields.items():
        if value == now[key]:
            continue
        if key in MAY_DIFFER:
            changed[key] = (value, now[key])
            continue
        raise CheckpointError(f"model.{key}={now[key]!r} but model.init_from={path} has "
                              f"{key}={value!r}: set model.{key}={value!r} (only "
                              f"{', '.join(MAY_DIFFER)} may differ)")
    return changed


class WeightReader:
    """Full tensors of a Llama folder by GPT name, read one at a time (safetensors, lazily)."""

    IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved

    def __init__(self, path: str, tied: bool):
        from safetensors import safe_open
        index = os.path.join(path, WEIGHTS_INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, WEIGHTS)):
            files = [WEIGHTS]
        else:
            raise CheckpointError(f"{path}: neither {WEIGHTS} nor {WEIGHTS_INDEX}")
        self.path, self.tied, self._where = path, tied, {}
        self._files = [safe_open(os.path.join(path, f), framework="pt") for f in files]
        for handle in self._files:
            for key in handle.keys():
                self._where[key] = handle
        self.used = set()

    def get(self, gpt_name: str) -> torch.Tensor:
        key = to_hf(gpt_name)
        if key not in self._where:
            raise CheckpointError(f"{self.path}: no tensor {key!r} (for {gpt_name})")
        self.used.add(key)
        return self._where[key].get_tensor(key)

    def unused(self) -> list:
        """Tensors of the folder no parameter took (tied lm_head copies and buffers aside)."""
        left = set(self._where) - self.used
        if self.tied:
            left.discard("lm_head.weight")
        return sorted(k for k in left if not k.endswith(self.IGNORED))


def tokenizer_info(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """EOS name and id of the run's tokenizer.json (None: the byte-level tokenizer)."""
    if path is None:
        return None
    from ..data.tokenizer import HFTokenizer
    tok = HFTokenizer(path)
    return {"path": path, "eos_token": tok.eos_token, "eos_id": tok.eos_id}


def save_folder(out_dir: str, weights: Iterator[Tuple[str, torch.Tensor]], m,
                tokenizer: Optional[str] = None, dtype: torch.dtype = torch.float32) -> None:
    """Write a LlamaForCausalLM folder: config.json, model.safetensors, and the tokenizer
    files when the run used a Hugging Face tokenizer. weights: (GPT name, full tensor)."""
    from safetensors.torch import save_file
    tok = tokenizer_info(tokenizer)
    cfg = llama_config(m, tok)  # refuses non-Llama models before anything is written
    tensors = {to_hf(n): t.to(dtype).contiguous() for n, t in weights}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump({**cfg, "torch_dtype": str(dtype).replace("torch.", "")}, f, indent=2)
    if tok is not None:
        shutil.copyfile(tok["path"], os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
                       "eos_token": tok["eos_token"], "model_max_length": m.seq_len}, f,
                      indent=2)
