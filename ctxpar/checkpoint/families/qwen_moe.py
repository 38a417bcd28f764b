"""Qwen3-MoE and Qwen2-MoE (``qwen3_moe``, ``qwen2_moe``): Qwen3's / Qwen2's layers with
a softmax-routed mixture of SwiGLU experts (model.moe; experts.py's common keys), Qwen2-MoE's
with a shared expert behind a sigmoid gate. The experts' keys are read here for the
Qwen lineage (qwen3_next.py too).

    config.json                          ctxpar model.moe.*
    moe_intermediate_size                expert_hidden
    norm_topk_prob                       norm_topk
    decoder_sparse_step, mlp_only_layers layers: i with (i + 1) % step == 0 and i not in
                                         mlp_only_layers (None: every layer)
    shared_expert_intermediate_size      shared_expert_hidden, behind shared_expert_gate
                                         (Qwen2-MoE)
    qkv_bias (Qwen2-MoE)                 attention_bias (q/k/v; transformers' default on)

Qwen3-MoE's window is on every layer (use_sliding_window) or none; ctxpar reads Qwen2-MoE
with full attention only (its use_sliding_window false).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config.moe import MoEConfig, moe_layer_indices
from .base import (ARCH_DEFAULTS, Family, Refuse,
                   window_on_every_layer_or_none)
from .experts import (aux_loss_coef, experts_and_top_k, integer_field, refuse_other_routers,
                      router_loss_keys)
from .mistral import window_on_every_layer

ROUTER_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
               "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
               "router_aux_loss_coef", "output_router_logits")
SHARED_KEYS = ROUTER_KEYS + ("shared_expert_intermediate_size",)


def qwen_moe_fields(hf: Dict[str, Any], d: Dict[str, Any], refuse: Refuse, shared: bool,
                    every_layer: bool = False) -> MoEConfig:
    """model.moe of a Qwen-lineage config.json (d: its class's defaults); every_layer:
    a family whose layers are all sparse and normalise their top-k (Qwen3.5-MoE)."""
    e, k = experts_and_top_k(hf, d, refuse)
    n = hf["num_hidden_layers"]
    step = 1 if every_layer else integer_field(hf, "decoder_sparse_step", 1, refuse)
    dense = [] if every_layer else (hf.get("mlp_only_layers") or [])
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        refuse("mlp_only_layers", dense, "a list of layer indices")
    layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    norm = True if every_layer else hf.get("norm_topk_prob", d["norm_topk_prob"])
    if not isinstance(norm, bool):
        refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
    width = integer_field(hf, "shared_expert_intermediate_size",
                          d["shared_expert_intermediate_size"], refuse) if shared else 0
    return MoEConfig(num_experts=e, top_k=k, norm_topk=norm,
                     expert_hidden=integer_field(hf, "moe_intermediate_size",
                                                 d["moe_intermediate_size"], refuse),
                     layers=None if len(layers) == n else layers,
                     shared_expert_hidden=width, shared_expert_gate=bool(width),
                     aux_loss_coef=aux_loss_coef(hf, d, refuse))


def qwen_moe_config(m, d: Dict[str, Any], source: Optional[Dict[str, Any]], refuse_export,
                    shared: bool, every_layer: bool = False) -> Dict[str, Any]:
    """config.json's MoE keys of ModelConfig m (qwen_moe_fields' inverse)."""
    moe = m.moe
    refuse_other_routers(moe, refuse_export)
    cfg = {"num_experts_per_tok": moe.top_k, **router_loss_keys(moe, d, source),
           "num_experts": moe.num_experts,
           "moe_intermediate_size": moe.expert_hidden or m.ffn_hidden}
    if not every_layer:
        sparse = moe_layer_indices(moe, m.n_layers)
        cfg.update(norm_topk_prob=moe.norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(m.n_layers) if i not in sparse])
    if shared:
        cfg["shared_expert_intermediate_size"] = moe.shared_expert_hidden
    return cfg


class QwenMoE(Family):
    shared: bool = False
    defaults: Dict[str, Any] = {}

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        fields = {**self.fixed, "moe": qwen_moe_fields(hf, self.defaults, refuse, self.shared)}
        if self.shared:  # Qwen2-MoE's q/k/v biases (transformers' default: on)
            fields["attention_bias"] = hf.get("qkv_bias", True)
            if not isinstance(fields["attention_bias"], bool):
                refuse("qkv_bias", hf["qkv_bias"], "config.json must give it as a boolean")
        return fields

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        cfg.update(qwen_moe_config(m, self.defaults, source, refuse_export, self.shared))
        sliding = "sliding_attention" in types
        if self.shared:
            cfg.update(qkv_bias=m.attention_bias, use_sliding_window=False,
                       sliding_window=None, layer_types=types)
        else:
            cfg.update(attention_bias=False, use_sliding_window=sliding,
                       sliding_window=m.sliding_window if sliding else None)


class Qwen3MoE(QwenMoE):
    defaults = dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
                    moe_intermediate_size=768, router_aux_loss_coef=0.001)

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        return hf, window_on_every_layer(hf, window)

    def check_windows(self, m, types: List[str], refuse_export) -> None:
        window_on_every_layer_or_none(self, m, types, refuse_export)


class Qwen2MoE(QwenMoE):
    shared = True
    defaults = dict(num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                    moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                    router_aux_loss_coef=0.001)

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        n, types = hf["num_hidden_layers"], hf.get("layer_types")
        if types is not None and types != ["full_attention"] * n:
            refuse("layer_types", types, f"Qwen2-MoE's layers are full attention in ctxpar "
                                         f"({n}; use_sliding_window is false)")
        return hf, {}

    def check_windows(self, m, types: List[str], refuse_export) -> None:
        if "sliding_attention" in types:
            refuse_export(f"model.sliding_window={m.sliding_window} (ctxpar writes Qwen2-MoE "
                          f"without sliding layers; Mixtral and Qwen3-MoE have a window)")


QWEN3_MOE = Qwen3MoE(
    "qwen3_moe", "Qwen3MoeForCausalLM", {**ARCH_DEFAULTS, "qk_norm": True},
    ("hidden_act", "silu"),
    neutral={"attention_bias": (False, "Qwen3-MoE's biases are on o_proj too: ctxpar has "
                                       "q/k/v biases without o_proj's")},
    own=("use_sliding_window", "sliding_window", *ROUTER_KEYS),
    inert=("max_window_layers",),  # written by its folders, read by no Qwen3-MoE code
    moe_fixed={"shared_expert_hidden": 0}, expert_naming="qwen")
QWEN2_MOE = Qwen2MoE(
    "qwen2_moe", "Qwen2MoeForCausalLM",
    {k: v for k, v in ARCH_DEFAULTS.items() if k != "attention_bias"}, ("hidden_act", "silu"),
    neutral={"use_sliding_window": (False, "Qwen2-MoE's sliding layers (every other layer "
                                           "below max_window_layers) are not read by ctxpar")},
    own=("qkv_bias", "layer_types", *SHARED_KEYS),
    inert=("sliding_window", "max_window_layers"),  # read only with use_sliding_window
    moe_fixed={"shared_expert_gate": True}, expert_naming="qwen")
