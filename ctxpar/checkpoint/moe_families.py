"""The mixture-of-experts families in config.json and safetensors: Qwen3-MoE, Qwen2-MoE,
Mixtral, gpt-oss, and the experts of Qwen3-Next and Qwen3.5-MoE (model.moe, models/moe.py;
their other keys in qwen3_next.py).

    config.json                          ctxpar model.moe.*
    num_experts (num_local_experts)      num_experts
    num_experts_per_tok                  top_k
    moe_intermediate_size                expert_hidden (Mixtral: intermediate_size)
    norm_topk_prob                       norm_topk (Mixtral: always)
    decoder_sparse_step, mlp_only_layers layers: i with (i + 1) % step == 0 and i not in
                                         mlp_only_layers (None: every layer)
    shared_expert_intermediate_size      shared_expert_hidden, behind shared_expert_gate
                                         (Qwen2-MoE)
    router_aux_loss_coef                 aux_loss_coef, when output_router_logits is true:
                                         transformers' *ForCausalLM.forward adds
                                         router_aux_loss_coef x load_balancing_loss_func to
                                         the loss only then (ctxpar/moe/aux.py computes it)

The router is a softmax over every expert, its top-k taken (score 'softmax'; gpt-oss's
softmax over the top-k logits is the same with norm_topk, plus its router bias); the
experts are SwiGLU (gpt-oss's clamped one, with biases: swiglu_limit, swiglu_alpha).
transformers 5.x holds each layer's experts fused
(``mlp.experts.gate_up_proj`` (E, 2f, d) with [gate | up] rows, ``mlp.experts.down_proj``
(E, d, f)), as ctxpar does, but its save_pretrained writes them per expert, as the
released folders hold them (its conversion_mapping.py reads both):

    Qwen2-MoE, Qwen3-MoE,  mlp.experts.{j}.gate_proj / up_proj / down_proj.weight
    Qwen3-Next, Qwen3.5-MoE  (a multimodal Qwen3.5-MoE's under model.language_model.)
    Mixtral                block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down)
                           .weight, block_sparse_moe.gate.weight (the router)

``per_expert_sources`` finds those in a folder (both forms are read); ``per_expert_tensors``
writes the export in them, as transformers saves.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config.moe import MoEConfig, moe_layer_indices

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "qwen3_next",
                "qwen3_5_moe_text")  # the last two: Qwen3.5's layers (qwen3_next.py)
# config.json keys each MoE family reads here
MOE_KEYS = {
    "qwen3_moe": ("num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                  "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                  "router_aux_loss_coef", "output_router_logits"),
    "mixtral": ("num_experts", "num_local_experts", "num_experts_per_tok",
                "router_aux_loss_coef", "output_router_logits"),
}
MOE_KEYS["qwen2_moe"] = MOE_KEYS["qwen3_moe"] + ("shared_expert_intermediate_size",)
MOE_KEYS["gpt_oss"] = MOE_KEYS["mixtral"] + ("swiglu_limit", "swiglu_alpha")
MOE_KEYS["qwen3_next"] = MOE_KEYS["qwen2_moe"]
MOE_KEYS["qwen3_5_moe_text"] = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                "shared_expert_intermediate_size", "router_aux_loss_coef",
                                "output_router_logits")
DEFAULTS = {  # the config classes' defaults in transformers 5.x
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
                      moe_intermediate_size=768, router_aux_loss_coef=0.001),
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      router_aux_loss_coef=0.001),
    "mixtral": dict(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
    "gpt_oss": dict(num_experts=128, num_experts_per_tok=4, router_aux_loss_coef=0.001,
                    swiglu_limit=7.0, swiglu_alpha=1.702),
    "qwen3_next": dict(num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       router_aux_loss_coef=0.001),
    "qwen3_5_moe_text": dict(num_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
                             moe_intermediate_size=512, shared_expert_intermediate_size=512,
                             router_aux_loss_coef=0.001),
}


def integer_field(hf, key, default, refuse, low=1):
    """config.json's integer `key` (default when absent), refused unless >= low."""
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        refuse(key, value, f"config.json must give it as an integer >= {low}")
    return value


def moe_fields(hf: Dict[str, Any], name: str, refuse: Callable) -> MoEConfig:
    """model.moe of a MoE family's config.json (module docstring's table)."""
    d = DEFAULTS[name]
    experts = [k for k in ("num_experts", "num_local_experts") if hf.get(k) is not None]
    if len(experts) == 2 and hf["num_experts"] != hf["num_local_experts"]:
        refuse("num_local_experts", hf["num_local_experts"], f"num_experts="
               f"{hf['num_experts']} names the same count (transformers' attribute_map)")
    e = integer_field(hf, experts[0] if experts else "num_experts", d["num_experts"], refuse)
    k = integer_field(hf, "num_experts_per_tok", d["num_experts_per_tok"], refuse)
    if k > e:
        refuse("num_experts_per_tok", k, f"more than num_experts={e}")
    n = hf["num_hidden_layers"]
    if name == "gpt_oss":  # every layer: a router bias, expert biases, the clamped SwiGLU;
        # the softmax over the top-k logits is softmax-then-normalised top-k
        limit, alpha = (hf.get(key, d[key]) for key in ("swiglu_limit", "swiglu_alpha"))
        for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                refuse(key, value, "config.json must give it as a number > 0")
        return MoEConfig(num_experts=e, top_k=k, expert_hidden=hf["intermediate_size"],
                         norm_topk=True, router_bias=True, expert_bias=True,
                         swiglu_limit=float(limit), swiglu_alpha=float(alpha),
                         aux_loss_coef=_aux(hf, d, refuse))
    if name == "mixtral":  # every layer, its experts intermediate_size wide, normalised
        return MoEConfig(num_experts=e, top_k=k, expert_hidden=hf["intermediate_size"],
                         norm_topk=True, aux_loss_coef=_aux(hf, d, refuse))
    step = integer_field(hf, "decoder_sparse_step", 1, refuse) if name != "qwen3_5_moe_text" else 1
    dense = (hf.get("mlp_only_layers") or []) if name != "qwen3_5_moe_text" else []
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        refuse("mlp_only_layers", dense, "a list of layer indices")
    layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    # Qwen3.5-MoE: every layer sparse, its top-k always normalised (qwen3_next.py)
    norm = hf.get("norm_topk_prob", d["norm_topk_prob"]) if name != "qwen3_5_moe_text" \
        else True
    if not isinstance(norm, bool):
        refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
    shared = 0
    if name in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        shared = integer_field(hf, "shared_expert_intermediate_size",
                          d["shared_expert_intermediate_size"], refuse)
    return MoEConfig(num_experts=e, top_k=k, norm_topk=norm,
                     expert_hidden=integer_field(hf, "moe_intermediate_size",
                                            d["moe_intermediate_size"], refuse),
                     layers=None if len(layers) == n else layers,
                     shared_expert_hidden=shared, shared_expert_gate=bool(shared),
                     aux_loss_coef=_aux(hf, d, refuse))


def _aux(hf, d, refuse) -> float:
    """router_aux_loss_coef when transformers adds the loss (output_router_logits)."""
    coef, on = hf.get("router_aux_loss_coef", d["router_aux_loss_coef"]), \
        hf.get("output_router_logits", False)
    if not isinstance(on, bool):
        refuse("output_router_logits", on, "config.json must give it as a boolean")
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        refuse("router_aux_loss_coef", coef, "config.json must give it as a number >= 0")
    return float(coef) if on else 0.0


def moe_config(m, name: str, refuse: Callable,
               source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """config.json's MoE keys of ModelConfig m; refuse(what) where the family cannot hold
    model.moe. router_aux_loss_coef: model.moe.aux_loss_coef, or the source folder's when
    the run has none (output_router_logits false: transformers then adds no loss)."""
    moe = m.moe
    if name == "gpt_oss":
        if moe.layers is not None or (moe.expert_hidden or m.ffn_hidden) != m.ffn_hidden or \
                moe.swiglu_limit is None:
            refuse(f"model.moe={moe} (gpt-oss's experts are on every layer, model.ffn_hidden "
                   f"wide, with the clamped SwiGLU)")
        coef = moe.aux_loss_coef or (source or {}).get("router_aux_loss_coef", 0.001)
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "swiglu_limit": moe.swiglu_limit, "swiglu_alpha": moe.swiglu_alpha,
                "router_aux_loss_coef": coef, "output_router_logits": moe.aux_loss_coef > 0}
    if moe.swiglu_limit is not None or moe.expert_bias:
        refuse(f"model.moe.swiglu_limit={moe.swiglu_limit} with expert_bias="
               f"{moe.expert_bias} (gpt-oss's experts)")
    if moe.score != "softmax" or moe.router_bias:
        refuse(f"model.moe.score={moe.score!r} with router_bias={moe.router_bias}"
               if moe.router_bias else f"model.moe.score={moe.score!r}")
    coef = moe.aux_loss_coef or (source or {}).get("router_aux_loss_coef",
                                                   DEFAULTS[name]["router_aux_loss_coef"])
    cfg = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": coef,
           "output_router_logits": moe.aux_loss_coef > 0}
    f = moe.expert_hidden or m.ffn_hidden
    if name == "mixtral":
        if not moe.norm_topk or moe.layers is not None or f != m.ffn_hidden:
            refuse(f"model.moe={moe} (Mixtral's experts are on every layer, "
                   f"model.ffn_hidden wide, their top-k weights normalised)")
        return {**cfg, "num_local_experts": moe.num_experts, "router_jitter_noise": 0.0}
    cfg.update(num_experts=moe.num_experts, moe_intermediate_size=f)
    if name != "qwen3_5_moe_text":  # its layers all sparse, normalised (families.moe_fixed)
        every = moe_layer_indices(moe, m.n_layers)
        cfg.update(norm_topk_prob=moe.norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.n_layers) if i not in every])
    if name in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):  # the gated shared expert
        cfg["shared_expert_intermediate_size"] = moe.shared_expert_hidden
    return cfg


# Per-expert names: (family, fused tensor's name inside the layer) -> the per-expert
# tensors' names, each the fused tensor's part (0 gate / 1 up of gate_up_proj, 0 of
# down_proj); Nemotron-H's squared-ReLU experts have up_proj alone (nemotron_moe.py)
PER_EXPERT = {
    "qwen": {"mlp.experts.gate_up_proj": ("mlp.experts.{j}.gate_proj.weight",
                                          "mlp.experts.{j}.up_proj.weight"),
             "mlp.experts.down_proj": ("mlp.experts.{j}.down_proj.weight",)},
    "mixtral": {"mlp.experts.gate_up_proj": ("block_sparse_moe.experts.{j}.w1.weight",
                                             "block_sparse_moe.experts.{j}.w3.weight"),
                "mlp.experts.down_proj": ("block_sparse_moe.experts.{j}.w2.weight",)},
    "nemotron": {"mixer.experts.up_proj": ("mixer.experts.{j}.up_proj.weight",),
                 "mixer.experts.down_proj": ("mixer.experts.{j}.down_proj.weight",)},
}
# a layer's prefix: a causal LM's (Nemotron-H's backbone.), or a multimodal folder's
# language model's (Qwen3.5-MoE)
_LAYER = re.compile(r"^((?:model\.(?:language_model\.)?|backbone\.)layers\.\d+\.)(.+)$")


def _naming(model_type: Optional[str]) -> Optional[str]:
    return "mixtral" if model_type == "mixtral" else \
        "qwen" if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text",
                                 "qwen3_5_moe") else \
        "nemotron" if model_type == "nemotron_h" else None


def per_expert_sources(keys, model_type: Optional[str]) -> Dict[str, Any]:
    """{fused key: parts}: each part the per-expert keys (expert order) stacked on dim 0,
    the parts concatenated on dim 1; Mixtral's router renamed ({mlp.gate key: [[key]]})."""
    naming = _naming(model_type)
    if naming is None:
        return {}
    keys, found = set(keys), {}
    for key in sorted(keys):
        m = _LAYER.match(key)
        if m is None:
            continue
        layer, rest = m.groups()
        if naming == "mixtral" and rest == "block_sparse_moe.gate.weight":
            found[layer + "mlp.gate.weight"] = [[key]]
        for fused, names in PER_EXPERT[naming].items():
            if rest != names[0].format(j=0):
                continue
            found[layer + fused] = [
                [layer + name.format(j=j) for j in range(_count(keys, layer + name))]
                for name in names]
    return found


def _count(keys, pattern: str) -> int:
    """Experts 0, 1, ... whose tensor of this name the folder holds."""
    j = 0
    while pattern.format(j=j) in keys:
        j += 1
    return j


def assemble(parts: List[List[str]], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The fused tensor of per_expert_sources' parts."""
    if len(parts) == 1 and len(parts[0]) == 1 and ".experts." not in parts[0][0]:
        return read(parts[0][0])                       # a renamed router
    return torch.cat([torch.stack([read(k) for k in part]) for part in parts], dim=1)


def assembled_shape(parts: List[List[str]], shape_of: Callable) -> Tuple[int, ...]:
    """assemble's shape from the parts' headers (None when the experts' shapes differ)."""
    if len(parts) == 1 and len(parts[0]) == 1 and ".experts." not in parts[0][0]:
        return tuple(shape_of(parts[0][0]))
    shapes = [[tuple(shape_of(k)) for k in part] for part in parts]
    if any(len(set(s)) != 1 for s in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    return (len(shapes[0]), sum(s[0][0] for s in shapes), shapes[0][0][1])


# gpt-oss: the router is ``mlp.router``; the experts are stored transposed (x @ W) with
# [gate | up] interleaved column by column: gate_up_proj (E, d, 2f), its bias (E, 2f),
# down_proj (E, f, d) (transformers' GptOssExperts, fused in its folders too)
GPT_OSS_ROUTER = ("mlp.gate.", "mlp.router.")


def gpt_oss_key(key: str, model_type: Optional[str]) -> str:
    """ctxpar's HF-form key (names.to_hf) -> gpt-oss's (the router's name)."""
    if model_type == "gpt_oss" and GPT_OSS_ROUTER[0] in key:
        return key.replace(*GPT_OSS_ROUTER)
    return key


def gpt_oss_shape(key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The folder's shape of a tensor ctxpar holds in `shape`."""
    return (shape[0], shape[2], shape[1]) if key.endswith(("experts.gate_up_proj",
                                                          "experts.down_proj")) else shape


def gpt_oss_from_hf(key: str, t: torch.Tensor) -> torch.Tensor:
    """A gpt-oss tensor in ctxpar's layout ((E, 2f, d) [gate | up], (E, d, f))."""
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        t = t.transpose(1, 2) if t.dim() == 3 else t          # (E, 2f, d) or (E, 2f)
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    if key.endswith("experts.down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


def gpt_oss_to_hf(key: str, t: torch.Tensor) -> torch.Tensor:
    """gpt_oss_from_hf's inverse."""
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        gate, up = t.chunk(2, dim=1)
        t = torch.stack([gate, up], dim=2).flatten(1, 2)      # rows interleaved
        return t.transpose(1, 2).contiguous() if t.dim() == 3 else t.contiguous()
    if key.endswith("experts.down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


# MXFP4 (gpt-oss's released folders, quantization_config quant_method mxfp4): each
# expert tensor as ``{name}_blocks`` (E, R, G, 16) uint8, two e2m1 codes a byte (low
# nibble first), and ``{name}_scales`` (E, R, G) uint8, a shared e8m0 exponent (bias 127)
# per block of 32 along the input; dequantized as transformers' integrations/mxfp4.py
# _convert_moe_packed_tensors does (its lookup table, ldexp, in bf16), giving the folder's
# (E, cols, R) tensor
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def mxfp4_sources(keys, model_type: Optional[str]) -> Dict[str, Tuple[str, str]]:
    """{expert key: (its _blocks key, its _scales key)} of a gpt-oss MXFP4 folder."""
    if model_type != "gpt_oss":
        return {}
    return {k[:-len("_blocks")]: (k, k[:-len("_blocks")] + "_scales") for k in keys
            if k.endswith(tuple(t + "_blocks" for t in MXFP4_TENSORS))}


def mxfp4_shape(blocks_shape) -> Tuple[int, ...]:
    """The dequantized tensor's shape (E, G * 32, R) of blocks (E, R, G, 16)."""
    e, r, g, b = blocks_shape
    return (e, g * b * 2, r)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E, R, G, 16) uint8 codes and (E, R, G) uint8 exponents -> (E, G * 32, R) bf16."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    blocks, exp = blocks.to(torch.uint8), scales.to(torch.int32) - 127
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.bfloat16)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, exp.unsqueeze(-1), out=out)               # (E, R, G, 32), in bf16
    return out.flatten(2).transpose(1, 2).contiguous()


def per_expert_tensors(key: str, t: torch.Tensor, model_type: str):
    """(name, tensor) of a fused HF key as transformers' save_pretrained writes the family
    (per expert; Mixtral's router under block_sparse_moe; gpt-oss's layout); other keys
    as they are."""
    if model_type == "gpt_oss":
        return [(gpt_oss_key(key, model_type), gpt_oss_to_hf(key, t))]
    naming, m = _naming(model_type), _LAYER.match(key)
    if naming is None or m is None:
        return [(key, t)]
    layer, rest = m.groups()
    if naming == "mixtral" and rest == "mlp.gate.weight":
        return [(layer + "block_sparse_moe.gate.weight", t)]
    if rest not in PER_EXPERT[naming]:
        return [(key, t)]
    names = PER_EXPERT[naming][rest]
    pieces = t.chunk(len(names), dim=1)
    return [(layer + name.format(j=j), piece[j].clone()) for name, piece in zip(names, pieces)
            for j in range(t.shape[0])]
