"""What the mixture-of-experts families share in config.json and safetensors (model.moe,
models/moe.py): the expert count and top-k, the router's loss, the per-expert tensors.

    config.json                          ctxpar model.moe.*
    num_experts (num_local_experts)      num_experts
    num_experts_per_tok                  top_k
    router_aux_loss_coef                 aux_loss_coef, when output_router_logits is true:
                                         transformers' *ForCausalLM.forward adds
                                         router_aux_loss_coef x load_balancing_loss_func to
                                         the loss only then (ctxpar/moe/aux.py computes it)

Each family's file reads the rest (qwen_moe.py's layers and shared expert, mixtral.py,
gpt_oss.py, qwen3_next.py, nemotron_h.py). transformers 5.x holds each layer's experts
fused (``mlp.experts.gate_up_proj`` (E, 2f, d) with [gate | up] rows,
``mlp.experts.down_proj`` (E, d, f)), as ctxpar does, but its save_pretrained writes
them per expert, as the released folders hold them (its conversion_mapping.py reads
both); ``per_expert_sources`` finds those in a folder, ``per_expert_tensors`` writes the
export in them:

    qwen       mlp.experts.{j}.gate_proj / up_proj / down_proj.weight
    mixtral    block_sparse_moe.experts.{j}.w1 (gate) / w3 (up) / w2 (down).weight,
               block_sparse_moe.gate.weight (the router)
    nemotron   mixer.experts.{j}.up_proj / down_proj.weight (squared-ReLU, no gate)
    deepseek_v4  ffn.experts.{j}.w1 (gate) / w3 (up) / w2 (down).weight (DeepSeek's own)
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Refuse = Callable[[str, Any, str], None]  # (config.json key, value, why): raises


def integer_field(hf, key, default, refuse: Refuse, low=1) -> int:
    """config.json's integer `key` (default when absent), refused unless >= low."""
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        refuse(key, value, f"config.json must give it as an integer >= {low}")
    return value


def experts_and_top_k(hf: Dict[str, Any], defaults: Dict[str, Any], refuse: Refuse,
                      names=("num_experts", "num_local_experts")) -> Tuple[int, int]:
    """(experts, top-k): the count under either of its names (transformers'
    attribute_map makes them one), the top-k no more than it."""
    given = [k for k in names if hf.get(k) is not None]
    if len(given) == 2 and hf[names[0]] != hf[names[1]]:
        refuse(names[1], hf[names[1]], f"{names[0]}={hf[names[0]]} names the same count "
                                       f"(transformers' attribute_map)")
    e = integer_field(hf, given[0] if given else names[0], defaults[names[0]], refuse)
    k = integer_field(hf, "num_experts_per_tok", defaults["num_experts_per_tok"], refuse)
    if k > e:
        refuse("num_experts_per_tok", k, f"more than {names[0]}={e}")
    return e, k


def aux_loss_coef(hf: Dict[str, Any], defaults: Dict[str, Any], refuse: Refuse) -> float:
    """router_aux_loss_coef when transformers adds the loss (output_router_logits)."""
    coef, on = hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"]), \
        hf.get("output_router_logits", False)
    if not isinstance(on, bool):
        refuse("output_router_logits", on, "config.json must give it as a boolean")
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        refuse("router_aux_loss_coef", coef, "config.json must give it as a number >= 0")
    return float(coef) if on else 0.0


def router_loss_keys(moe, defaults: Dict[str, Any],
                     source: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """config.json's router loss: model.moe.aux_loss_coef, or the source folder's when
    the run has none (output_router_logits false: transformers then adds no loss)."""
    coef = moe.aux_loss_coef or (source or {}).get("router_aux_loss_coef",
                                                   defaults["router_aux_loss_coef"])
    return {"router_aux_loss_coef": coef, "output_router_logits": moe.aux_loss_coef > 0}


def refuse_other_routers(moe, refuse_export: Callable[[str], None]) -> None:
    """A softmax-routed family without gpt-oss's experts or router bias."""
    if moe.swiglu_limit is not None or moe.expert_bias:
        refuse_export(f"model.moe.swiglu_limit={moe.swiglu_limit} with expert_bias="
                      f"{moe.expert_bias} (gpt-oss's experts)")
    if moe.score != "softmax" or moe.router_bias:
        refuse_export(f"model.moe.score={moe.score!r} with router_bias={moe.router_bias}"
                      if moe.router_bias else f"model.moe.score={moe.score!r}")


# Per-expert names: (naming, fused tensor's name inside the layer) -> the per-expert
# tensors' names, each the fused tensor's part (0 gate / 1 up of gate_up_proj, 0 of
# down_proj)
PER_EXPERT = {
    "qwen": {"mlp.experts.gate_up_proj": ("mlp.experts.{j}.gate_proj.weight",
                                          "mlp.experts.{j}.up_proj.weight"),
             "mlp.experts.down_proj": ("mlp.experts.{j}.down_proj.weight",)},
    "mixtral": {"mlp.experts.gate_up_proj": ("block_sparse_moe.experts.{j}.w1.weight",
                                             "block_sparse_moe.experts.{j}.w3.weight"),
                "mlp.experts.down_proj": ("block_sparse_moe.experts.{j}.w2.weight",)},
    "deepseek_v4": {"ffn.experts.gate_up_proj": ("ffn.experts.{j}.w1.weight",
                                                 "ffn.experts.{j}.w3.weight"),
                    "ffn.experts.down_proj": ("ffn.experts.{j}.w2.weight",)},
    "nemotron": {"mixer.experts.up_proj": ("mixer.experts.{j}.up_proj.weight",),
                 "mixer.experts.down_proj": ("mixer.experts.{j}.down_proj.weight",)},
}
# a router stored under another name, per naming: (ctxpar's, the folder's)
RENAMED_ROUTER = {"mixtral": ("mlp.gate.weight", "block_sparse_moe.gate.weight")}
# a layer's prefix: a causal LM's (Nemotron-H's backbone.), a multimodal folder's
# language model's (Qwen3.5-MoE), or Qwen3-Next's MTP layers' (mtp.)
_LAYER = re.compile(r"^((?:model\.(?:language_model\.)?|backbone\.|mtp\.)layers\.\d+\.)(.+)$")


def per_expert_sources(keys, naming: Optional[str]) -> Dict[str, Any]:
    """{fused key: parts}: each part the per-expert keys (expert order) stacked on dim 0,
    the parts concatenated on dim 1; a renamed router ({ctxpar's key: [[key]]})."""
    if naming is None:
        return {}
    keys, found = set(keys), {}
    renamed = RENAMED_ROUTER.get(naming)
    for key in sorted(keys):
        m = _LAYER.match(key)
        if m is None:
            continue
        layer, rest = m.groups()
        if renamed is not None and rest == renamed[1]:
            found[layer + renamed[0]] = [[key]]
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


def assembled_shape(parts: List[List[str]], shape_of: Callable) -> Optional[Tuple[int, ...]]:
    """assemble's shape from the parts' headers (None when the experts' shapes differ)."""
    if len(parts) == 1 and len(parts[0]) == 1 and ".experts." not in parts[0][0]:
        return tuple(shape_of(parts[0][0]))
    shapes = [[tuple(shape_of(k)) for k in part] for part in parts]
    if any(len(set(s)) != 1 for s in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    return (len(shapes[0]), sum(s[0][0] for s in shapes), shapes[0][0][1])


def per_expert_tensors(key: str, t: torch.Tensor, naming: Optional[str]):
    """(name, tensor) of a fused HF key as transformers' save_pretrained writes the family
    (per expert; a renamed router); other keys as they are."""
    m = _LAYER.match(key)
    if naming is None or m is None:
        return [(key, t)]
    layer, rest = m.groups()
    renamed = RENAMED_ROUTER.get(naming)
    if renamed is not None and rest == renamed[0]:
        return [(layer + renamed[1], t)]
    if rest not in PER_EXPERT[naming]:
        return [(key, t)]
    names = PER_EXPERT[naming][rest]
    pieces = t.chunk(len(names), dim=1)
    return [(layer + name.format(j=j), piece[j].clone()) for name, piece in zip(names, pieces)
            for j in range(t.shape[0])]
