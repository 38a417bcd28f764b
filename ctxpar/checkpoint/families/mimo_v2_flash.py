"""Xiaomi's MiMo-V2-Flash (``mimo_v2_flash``, MiMoV2FlashForCausalLM): full and sliding
attention layers with q/k heads of 192 channels and value heads of 128, twice the K/V
heads and a sink per query head on the sliding layers, values scaled by a constant, RoPE
on a third of each head with a base per layer type, and DeepSeek-V3's router without
shared experts after a dense first layer.

    config.json                            ctxpar model.*
    head_dim, v_head_dim                   head_dim (q, k), v_head_dim (v, o_proj's input)
    num_key_value_heads                    n_kv_heads (the full layers'); the sliding
                                           layers' 2 x num_key_value_heads (transformers
                                           doubles it) in layer_kv_heads.sliding_attention
    (the sliding layers' sinks)            attention_sinks: [sliding_attention]
    attention_value_scale (null: 1)        attention_value_scale
    attention_bias                         attention_bias (q/k/v; o_proj has none)
    layer_types (default: full on layer 0  layer_types, sliding_window (or
      and every 6th), sliding_window         sliding_window_size + 1, transformers' rule)
    rope_parameters.full_attention         rope_theta, rope_scaling
    rope_parameters.sliding_attention      layer_rope.sliding_attention
    rope_parameters.*.partial_rotary_      partial_rotary_factor = int(head_dim x factor) /
      factor (0.334; one for both types)     head_dim (transformers truncates: 64 of 192)
    mlp_layer_types (dense / sparse)       moe.layers: the sparse ones
    n_routed_experts, num_experts_per_tok, moe.num_experts, top_k, expert_hidden, norm_topk,
      moe_intermediate_size, norm_topk_      routed_scaling_factor (null: 1), n_group,
      prob, routed_scaling_factor,           topk_group (glm4_moe.py's router)
      n_group, topk_group
    intermediate_size                      ffn_hidden (the dense layers' MLP)

Tensors: Glm4Moe's names without shared experts; the sinks are
``self_attn.attention_sink_bias`` as transformers saves them (``self_attn.sinks``, its
module's name, read too). The released folders'
multi-token prediction layers (model.mtp.*) are left out: transformers builds none and
drops them on loading; the start-up line says so (model.mtp does not build MiMo's).
MiMoV2FlashForCausalLM adds no router loss: output_router_logits is inert.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_ffn_hidden
from ...config.attention_heads import kv_heads_of, sinks_on, v_head_dim_of
from ...config.layers import layer_types
from ...config.moe import MoEConfig, moe_layer_indices
from ..rope_config import drop_rope_keys, rope_of
from .base import ARCH_DEFAULTS, Family, Refuse, attention_layers
from .experts import experts_and_top_k, integer_field, per_expert_tensors
from .glm4_moe import check_dropless, grouped_router_fields, grouped_router_keys
from .nemotron_h import MOE_FIXED

DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                partial_rotary_factor=0.334, sliding_window=129)  # MiMoV2FlashConfig's
THETAS = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "norm_topk_prob", "routed_scaling_factor", "n_group",
            "topk_group", "mlp_layer_types")
SINKS = ("self_attn.sinks", "self_attn.attention_sink_bias")  # ctxpar's name, the release's
SLIDING = "sliding_attention"


def default_layer_types(n: int) -> List[str]:
    """MiMoV2FlashConfig's: full attention on layer 0 and every 6th, sliding elsewhere."""
    return ["full_attention" if i == 0 or not (i + 1) % 6 else SLIDING for i in range(n)]


def _rope_per_type(hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Dict[str, Any]]:
    """rope_parameters by layer type (transformers' MiMo reads no other form), each with
    its partial factor."""
    params = hf.get("rope_parameters")
    if params is None:
        return {kind: {"rope_type": "default", "rope_theta": theta,
                       "partial_rotary_factor": DEFAULTS["partial_rotary_factor"]}
                for kind, theta in THETAS.items()}
    if not isinstance(params, dict) or set(params) != set(THETAS) or \
            not all(isinstance(p, dict) for p in params.values()):
        refuse("rope_parameters", params, "MiMo-V2-Flash's RoPE is given per layer type: "
                                          "{full_attention: {...}, sliding_attention: {...}}")
    return params


class MiMoV2Flash(Family):
    layer_rope_types = (SLIDING,)
    sinks = True

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        n, d = hf["num_hidden_layers"], hf["hidden_size"]
        e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("n_routed_experts", "num_local_experts"))
        kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"dense", "sparse"}:
            refuse("mlp_layer_types", kinds, f"one of 'dense', 'sparse' per layer ({n})")
        sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"]
        if not sparse:
            refuse("mlp_layer_types", kinds, "no sparse layer (ctxpar's mimo_v2_flash has "
                                             "experts)")
        hf = {**hf, "routed_scaling_factor": hf.get("routed_scaling_factor") or 1.0}
        moe = MoEConfig(num_experts=e, top_k=k, expert_hidden=integer_field(
            hf, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"], refuse),
            shared_expert_hidden=0, **grouped_router_fields(hf, e, k, refuse),
            layers=None if len(sparse) == n else sparse, **MOE_FIXED)
        hd = hf.get("head_dim") or d // hf["num_attention_heads"]
        v = integer_field(hf, "v_head_dim", 128, refuse)
        if v > hd:
            refuse("v_head_dim", v, f"wider than head_dim={hd} (ctxpar carries V padded to "
                                    f"the keys' width)")
        scale = hf.get("attention_value_scale", 0.707)
        scale = 1.0 if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            refuse("attention_value_scale", scale, "a number > 0 (or null: 1)")
        bias = hf.get("attention_bias", False)
        if not isinstance(bias, bool):
            refuse("attention_bias", bias, "config.json must give it as a boolean")
        return {**self.fixed, "moe": moe, "attention_bias": bias,
                "v_head_dim": None if v == hd else v, "attention_value_scale": float(scale)}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Layer types, the window, the sliding layers' K/V heads, sinks and RoPE; the
        partial factor (one for both types)."""
        n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        types = hf.get("layer_types") or default_layer_types(n)
        window = hf.get("sliding_window", DEFAULTS["sliding_window"])
        if hf.get("sliding_window_size") is not None:  # transformers: the size + the query
            window = hf["sliding_window_size"] + 1 if isinstance(
                hf["sliding_window_size"], int) else hf["sliding_window_size"]
        fields = attention_layers(hf, types, window, refuse)
        params = _rope_per_type(hf, refuse)
        hd = hf.get("head_dim") or hf["hidden_size"] // heads
        partials = {p.get("partial_rotary_factor", DEFAULTS["partial_rotary_factor"])
                    for kind, p in params.items() if kind in types}
        partial = partials.pop()
        if partials or isinstance(partial, bool) or not isinstance(partial, (int, float)) \
                or int(hd * partial) < 2 or int(hd * partial) % 2 or partial > 1:
            refuse("rope_parameters", params, f"one partial_rotary_factor for every layer "
                                              f"type, turning an even number >= 2 of "
                                              f"head_dim={hd} channels")
        fields["partial_rotary_factor"] = int(hd * partial) / hd  # transformers truncates
        if SLIDING in types:
            kv = hf.get("num_key_value_heads") or heads
            fields.update(layer_kv_heads={SLIDING: 2 * kv}, attention_sinks=[SLIDING])
            local = {k: v for k, v in params[SLIDING].items() if k != "partial_rotary_factor"}
            theta, scaling = rope_of(local, hf, file, THETAS[SLIDING])
            fields["layer_rope"] = {SLIDING: {"rope_theta": theta, "rope_scaling": scaling}}
        full = {k: v for k, v in params["full_attention"].items()
                if k != "partial_rotary_factor"}
        rest = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_theta",
                                                         "rope_scaling")}
        return {**rest, "rope_parameters": full}, fields

    def export_layer_types(self, m, refuse_export) -> List[str]:
        """Full and sliding layers, a RoPE of their own on the sliding ones only; the
        sliding layers' K/V heads twice the full ones' and their sinks, the full layers
        with neither."""
        types = layer_types(m)
        if set(types) - {"full_attention", SLIDING}:
            refuse_export(f"model.layer_types={types} (MiMo-V2-Flash's layers are full or "
                          f"sliding attention)")
        if set(m.layer_rope or {}) - {SLIDING}:
            refuse_export(f"model.layer_rope={m.layer_rope} (a RoPE of their own on the "
                          f"sliding layers only)")
        full_kv = kv_heads_of(m, "full_attention")
        for kind in set(types):
            kv, sinks = kv_heads_of(m, kind), sinks_on(m, kind)
            if kind == SLIDING and (kv != 2 * full_kv or not sinks):
                refuse_export(f"model.layer_kv_heads={m.layer_kv_heads}, model.attention_"
                              f"sinks={m.attention_sinks} (MiMo-V2-Flash's sliding layers "
                              f"have sinks and 2 x n_kv_heads={2 * full_kv} K/V heads)")
            if kind != SLIDING and (kv != (m.n_kv_heads or m.n_heads) or sinks):
                refuse_export(f"model.layer_kv_heads={m.layer_kv_heads}, model.attention_"
                              f"sinks={m.attention_sinks} (MiMo-V2-Flash's full layers have "
                              f"n_kv_heads K/V heads and no sinks)")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe, n = m.moe, m.n_layers
        if moe.shared_expert_hidden:
            refuse_export(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} "
                          f"(MiMo-V2-Flash has no shared experts)")
        check_dropless(moe, refuse_export)
        sparse = set(moe_layer_indices(moe, n))
        local = (m.layer_rope or {}).get(SLIDING, {})
        partial = m.partial_rotary_factor

        def rope(theta, scaling):
            return {**(scaling or {"rope_type": "default"}), "rope_theta": float(theta),
                    "partial_rotary_factor": partial}

        drop_rope_keys(cfg)
        cfg.update(**grouped_router_keys(moe), moe_intermediate_size=moe.expert_hidden or
                   resolved_ffn_hidden(m), mlp_layer_types=["sparse" if i in sparse else "dense"
                                                  for i in range(n)],
                   attention_bias=m.attention_bias, v_head_dim=v_head_dim_of(m),
                   attention_value_scale=m.attention_value_scale, layer_types=types,
                   sliding_window=m.sliding_window if SLIDING in types else
                   DEFAULTS["sliding_window"],
                   rope_parameters={"full_attention": rope(m.rope_theta, m.rope_scaling),
                                    SLIDING: rope(local.get("rope_theta", m.rope_theta),
                                                  local.get("rope_scaling", m.rope_scaling))})

    def folder_key(self, key: str) -> str:
        """The sinks under the name transformers saves them by (its conversion mapping
        reads both)."""
        return key[:-len(SINKS[0])] + SINKS[1] if key.endswith(SINKS[0]) else key

    def sources(self, key: str) -> List[Tuple[str, ...]]:
        """The sinks under either name (key: folder_key's)."""
        if key.endswith(SINKS[1]):
            return [(key,), (key[:-len(SINKS[1])] + SINKS[0],)]
        return [(key,)]

    def to_folder(self, key: str, t, m) -> List[Tuple[str, Any]]:
        return per_expert_tensors(self.folder_key(key), t, self.expert_naming)

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        """The multi-token prediction layers (model.mtp.*)."""
        return key.startswith("model.mtp.")


FAMILY = MiMoV2Flash(
    "mimo_v2_flash", "MiMoV2FlashForCausalLM",
    {k: v for k, v in ARCH_DEFAULTS.items() if k != "attention_bias"},
    ("hidden_act", "silu"), default_theta=THETAS["full_attention"],
    own=("attention_bias", "v_head_dim", "attention_value_scale", "layer_types",
         "sliding_window", "sliding_window_size", *MOE_KEYS),
    inert=("output_router_logits",  # returns the router logits, adds no loss
           "num_nextn_predict_layers", "num_mtp_layers"),  # MTP layers: left out (above)
    moe_fixed=MOE_FIXED, expert_naming="qwen")
