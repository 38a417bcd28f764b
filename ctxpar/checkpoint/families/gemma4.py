"""Gemma 4's text model (``gemma4_text``, Gemma4ForCausalLM): Gemma 3's GeGLU, norms on
both sides of each op, embeddings scaled by sqrt(d) and q/k norms, with plain-weight norms
(w, not 1 + w), a weightless value norm, softmax scale 1, a layer scalar per block, full
layers of their own head dim and kv heads whose values may be their keys' projection,
K/V shared by the last layers and per-layer input embeddings (config/kv_layers.py).

    config.json                              ctxpar model.*
    layer_types (or every 6th full,          layer_types, sliding_window
      the last forced full), sliding_window
    rope_parameters.full_attention           rope_theta, rope_scaling ('proportional':
                                             partial_rotary_factor of the frequencies)
    rope_parameters.sliding_attention        layer_rope.sliding_attention
    global_head_dim, num_global_key_value_   global_head_dim, global_n_kv_heads (the kv
      heads (or per_layer_config: the full     heads only under attention_k_eq_v, as
      layers' head_dim, num_key_value_heads)   transformers reads them)
    attention_k_eq_v                         attention_k_eq_v
    num_kv_shared_layers                     num_kv_shared_layers
    hidden_size_per_layer_input              per_layer_input_dim (vocab_size_per_layer_input
                                             equal to vocab_size)
    final_logit_softcapping                  final_logit_softcapping
    use_double_wide_mlp                      double_wide_mlp (when num_kv_shared_layers > 0:
                                             it widens those layers' MLP only)
    enable_moe_block, num_experts,           moe: num_experts, top_k, expert_hidden,
      top_k_experts, moe_intermediate_size     beside_mlp, scaled_router (softmax, top-k
                                               renormalised, no aux loss: transformers adds
                                               none; models/moe_beside_mlp.py)
    (fixed)                                  query_pre_attn_scalar 1 (softmax scale
                                             1), value_norm, layer_scalar

The experts are stored fused (experts.gate_up_proj (E, 2f, d), experts.down_proj (E, d, f)),
as transformers holds and saves them. Refused in one line: use_bidirectional_attention
(base.NOT_IMPLEMENTED).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_head_dim
from ...config.layers import layer_types
from ...config.moe import MoEConfig
from ..rope_config import drop_rope_keys, rope_of
from .base import ARCH_DEFAULTS, NO_BIAS, Family, Refuse, attention_layers
from .experts import integer_field, refuse_other_routers

# Gemma4TextConfig's RoPE when config.json has none
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
OWN = ("final_logit_softcapping", "layer_types", "sliding_window", "global_head_dim",
       "num_global_key_value_heads", "per_layer_config", "attention_k_eq_v",
       "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
       "use_double_wide_mlp", "enable_moe_block", "num_experts", "top_k_experts",
       "moe_intermediate_size")
# model.moe as Gemma 4 has it (the rest of MoEConfig's routing options at their defaults;
# the router losses a run's choice: transformers adds none)
MOE_FIXED = {"beside_mlp": True, "scaled_router": True, "score": "softmax", "norm_topk": True,
             "layers": None, "shared_expert_hidden": 0, "score_correction_bias": False,
             "routed_scaling_factor": 1.0, "n_group": 1}


def _moe(hf: Dict[str, Any], refuse: Refuse) -> Optional[MoEConfig]:
    """model.moe of enable_moe_block (None without it): the experts beside every layer's
    dense MLP, Gemma4TextRouter's softmax top-k renormalised and scaled per expert."""
    on = hf.get("enable_moe_block", False)
    if not isinstance(on, bool):
        refuse("enable_moe_block", on, "config.json must give it as a boolean")
    if not on:
        return None
    e = integer_field(hf, "num_experts", None, refuse)
    k = integer_field(hf, "top_k_experts", None, refuse)
    if k > e:
        refuse("top_k_experts", k, f"more than num_experts={e}")
    return MoEConfig(num_experts=e, top_k=k,
                     expert_hidden=integer_field(hf, "moe_intermediate_size", None, refuse),
                     **{k: v for k, v in MOE_FIXED.items() if k != "layers"})


def _types(hf: Dict[str, Any]) -> List[str]:
    """layer_types as Gemma4TextConfig's __post_init__ makes them."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    if isinstance(types, list) and types:
        types = [*types[:-1], "full_attention"]  # transformers forces the last one full
    return types


def _full_layer_shape(hf: Dict[str, Any], types: List[str],
                      refuse: Refuse) -> Tuple[Optional[int], Optional[int]]:
    """(head dim, kv heads) of the full layers: per_layer_config's (as transformers saves
    it), else global_head_dim (512 by default) and num_global_key_value_heads."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return hf.get("global_head_dim", 512), kv
    full = {str(i) for i, t in enumerate(types) if t == "full_attention"}
    values = list(per_layer.values()) if isinstance(per_layer, dict) else []
    if not isinstance(per_layer, dict) or set(per_layer) != full or any(
            v != values[0] or set(v) - {"head_dim", "num_key_value_heads"} for v in values):
        refuse("per_layer_config", per_layer, f"the same head_dim and num_key_value_heads on "
                                              f"every full-attention layer ({sorted(full)}), "
                                              f"nothing else")
    return values[0].get("head_dim"), values[0].get("num_key_value_heads")


class Gemma4(Family):
    layer_rope_types = ("sliding_attention",)
    own_query_scale = True

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        rope = hf.get("rope_parameters") or DEFAULT_ROPE
        if not isinstance(rope, dict) or set(rope) - set(DEFAULT_ROPE):
            refuse("rope_parameters", rope, "one set per layer type ('full_attention', "
                                            "'sliding_attention')")
        if hf.get("vocab_size_per_layer_input", hf["vocab_size"]) != hf["vocab_size"]:
            refuse("vocab_size_per_layer_input", hf["vocab_size_per_layer_input"],
                   f"ctxpar's per-layer embedding has the vocabulary's {hf['vocab_size']} rows")
        return {**hf, "rope_parameters": {**DEFAULT_ROPE, **rope}}

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        moe = _moe(hf, refuse)
        return {**self.fixed, **({} if moe is None else {"moe": moe})}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        types = _types(hf)
        fields = attention_layers(hf, types, hf.get("sliding_window", 512), refuse)
        head_dim, kv = _full_layer_shape(hf, types, refuse) if "full_attention" in types \
            else (None, None)
        hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        theta, scaling = rope_of(hf["rope_parameters"]["sliding_attention"], hf, file,
                                 10_000.0)
        if "sliding_window" in fields:  # the sliding layers' own RoPE
            fields["layer_rope"] = {"sliding_attention": {"rope_theta": theta,
                                                          "rope_scaling": scaling}}
        k_eq_v = hf.get("attention_k_eq_v", False)
        if not isinstance(k_eq_v, bool):
            refuse("attention_k_eq_v", k_eq_v, "config.json must give it as a boolean")
        wide = hf.get("use_double_wide_mlp", False)
        if not isinstance(wide, bool):
            refuse("use_double_wide_mlp", wide, "config.json must give it as a boolean")
        cap = hf.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or cap <= 0):
            refuse("final_logit_softcapping", cap, "a number > 0, or null")
        fields.update(
            final_logit_softcapping=None if cap is None else float(cap),
            query_pre_attn_scalar=1.0, value_norm=True, layer_scalar=True,
            global_head_dim=None if head_dim in (None, hd) else head_dim,
            global_n_kv_heads=None if kv in (None, hf.get("num_key_value_heads")) else kv,
            attention_k_eq_v=k_eq_v and "full_attention" in types,
            num_kv_shared_layers=hf.get("num_kv_shared_layers", 0) or 0,
            double_wide_mlp=wide and bool(hf.get("num_kv_shared_layers")),
            per_layer_input_dim=hf.get("hidden_size_per_layer_input", 256) or 0)
        return hf, fields

    def rope(self, hf: Dict[str, Any], file: str):
        return rope_of(hf["rope_parameters"]["full_attention"], hf, file, 1_000_000.0)

    def export_layer_types(self, m, refuse_export) -> List[str]:
        types = super().export_layer_types(m, refuse_export)
        if set(types) - {"full_attention", "sliding_attention"}:
            refuse_export(f"model.layer_types={types} (Gemma 4 has full and sliding layers)")
        if types[-1] != "full_attention":
            refuse_export(f"model.layer_types={types} (Gemma 4's last layer is full "
                          f"attention: transformers makes it so)")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        scaling = dict(m.rope_scaling or {"rope_type": "default"})
        local = (m.layer_rope or {}).get("sliding_attention", {})
        local_scaling = dict(local.get("rope_scaling") or {"rope_type": "default"})
        drop_rope_keys(cfg)
        full = {"head_dim": m.global_head_dim or resolved_head_dim(m)}
        if m.global_n_kv_heads is not None:
            full["num_key_value_heads"] = m.global_n_kv_heads
        cfg.update(
            attention_bias=False, layer_types=types, sliding_window=m.sliding_window or 512,
            final_logit_softcapping=m.final_logit_softcapping,
            use_bidirectional_attention=None,
            attention_k_eq_v=m.attention_k_eq_v, num_kv_shared_layers=m.num_kv_shared_layers,
            hidden_size_per_layer_input=m.per_layer_input_dim,
            vocab_size_per_layer_input=m.vocab_size, use_double_wide_mlp=m.double_wide_mlp,
            **_moe_config(m, refuse_export),
            per_layer_config={i: dict(full) for i, t in enumerate(types)
                              if t == "full_attention"},
            rope_parameters={"full_attention": {**scaling, "rope_theta": m.rope_theta},
                             "sliding_attention": {**local_scaling, "rope_theta": float(
                                 local.get("rope_theta", m.rope_theta))}})

    def naming(self, m) -> str:
        return "gemma4" if m.moe is None else "gemma4_moe"


def _moe_config(m, refuse_export) -> Dict[str, Any]:
    """config.json's MoE keys of m.moe (_moe's inverse)."""
    if m.moe is None:
        return {"enable_moe_block": False}
    refuse_other_routers(m.moe, refuse_export)
    return {"enable_moe_block": True, "num_experts": m.moe.num_experts,
            "top_k_experts": m.moe.top_k,
            "moe_intermediate_size": m.moe.expert_hidden or m.ffn_hidden}


FAMILY = Gemma4(
    "gemma4_text", "Gemma4ForCausalLM",
    {**{k: v for k, v in ARCH_DEFAULTS.items()
        if k not in ("global_head_dim", "global_n_kv_heads", "attention_k_eq_v",
                     "num_kv_shared_layers", "per_layer_input_dim",
                     "final_logit_softcapping")},
     "mlp": "geglu", "post_norms": True, "scale_embeddings": True, "qk_norm": True,
     "value_norm": True, "layer_scalar": True, "query_pre_attn_scalar": 1.0},
    ("hidden_activation", "gelu_pytorch_tanh"), default_theta=1_000_000.0,
    neutral={"attention_bias": (False, NO_BIAS)},
    own=OWN, tied_default=True, moe_fixed=MOE_FIXED, moe_optional=True)
