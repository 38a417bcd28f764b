"""OLMo Hybrid (``olmo_hybrid``, OlmoHybridForCausalLM): Gated DeltaNet and post-norm
attention layers with q/k norms over all heads; RoPE or NoPE.

    config.json (olmo_hybrid)      ctxpar model.*
    layer_types                    layer_types ('linear_attention', 'full_attention';
                                   unset: every 4th layer full, the last one at least)
    linear_num_key_heads, ...      linear_* (transformers' defaults: the attention's heads,
      linear_conv_kernel_dim         key head dim int(0.75 d / heads), value twice it)
    linear_allow_neg_eigval        linear_allow_neg_eigval (beta in [0, 2])
    rope_parameters.rope_theta     rope_theta, on the attention layers; null: NoPE
                                   (model.rope=false, the released folders')
    (fixed)                        qk_norm over all heads, reordered_norms
                                   ['full_attention'] (OLMo 2's post-norm attention
                                   blocks), linear_norm_eps 1e-5 (its gated norm's)
    linear_a_log_*, linear_dt_*    none: the initialisation's ranges

Tensors (names.HF_NAMINGS['olmo_hybrid'] for the rest): ctxpar's Gated DeltaNet holds
[q | k | v] fused, as Qwen3.5's; OLMo Hybrid's folders hold q_proj, k_proj, v_proj and
q_conv1d, k_conv1d, v_conv1d (the conv is depthwise: one conv over the concatenation is
the three). transformers concatenates the three convs whatever their sizes and saves its
conv as three equal chunks (torch.chunk), not by section: ctxpar reads the concatenation
as it does, and writes the sections (OLMo-core's form, which transformers reads the same).
transformers' loaded form (conversion_mapping's olmo_hybrid: one conv1d, input_layernorm,
post_attention_layernorm) is read too; the export writes the saved form.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config.layers import gated_delta_dims
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, NO_BIAS, Family, Refuse
from .qwen3_5 import HYBRID_LAYER_TYPES, LINEAR_ATTENTION_KEYS, hybrid_layer_types

NEG_EIGVAL = "linear_allow_neg_eigval"
INIT_KEYS = ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max",
             "linear_dt_init_floor")  # the init's ranges: nothing in the forward
# ctxpar's fused tensor (its GPT name's ending) -> the folder's [q | k | v] parts
FUSED = {"linear_attn.in_proj_qkv.weight": ("q_proj", "k_proj", "v_proj"),
         "linear_attn.conv1d.weight": ("q_conv1d", "k_conv1d", "v_conv1d")}
# the saved name's ending -> transformers' loaded one (a folder may hold either)
LOADED = {"attention_layer_norm.weight": "input_layernorm.weight",
          "feedforward_layer_norm.weight": "post_attention_layernorm.weight"}


def olmo_hybrid_layer_types(hf: Dict[str, Any], refuse: Refuse) -> List[str]:
    """layer_types as OlmoHybridConfig reads them: given, or every 4th layer full attention
    (the last one when none is); both kinds present, as transformers requires."""
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    if not isinstance(types, list) or len(types) != n or set(types) != set(HYBRID_LAYER_TYPES):
        refuse("layer_types", types, f"one of {', '.join(map(repr, HYBRID_LAYER_TYPES))} per "
                                     f"layer ({n}), each kind at least once")
    return types


def part_rows(m) -> Tuple[int, int, int]:
    """The [q | k | v] sections' rows of a fused tensor of ModelConfig m."""
    g = gated_delta_dims(m)
    key = g.num_key_heads * g.key_head_dim
    return key, key, g.num_value_heads * g.value_head_dim


class OlmoHybrid(Family):
    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The layer types, the Gated DeltaNet sizes (transformers' defaults where
        config.json has none), beta's range, and NoPE when rope_parameters' rope_theta (or
        a top-level one) is null (transformers then builds no rotary embedding; an absent
        one is its default 10000)."""
        heads, d = hf["num_attention_heads"], hf["hidden_size"]
        key_heads = hf.get("linear_num_key_heads") or heads
        key_dim = hf.get("linear_key_head_dim") or int(0.75 * d / key_heads)
        defaults = dict(linear_num_key_heads=key_heads, linear_num_value_heads=heads,
                        linear_key_head_dim=key_dim, linear_value_head_dim=2 * key_dim,
                        linear_conv_kernel_dim=4)  # OlmoHybridConfig's
        fields: Dict[str, Any] = {"layer_types": olmo_hybrid_layer_types(hf, refuse)}
        for key in LINEAR_ATTENTION_KEYS:
            value = hf.get(key)
            value = defaults[key] if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(key, value, "config.json must give it as an integer >= 1")
            fields[key] = value
        neg = hf.get(NEG_EIGVAL, True)
        if not isinstance(neg, bool):
            refuse(NEG_EIGVAL, neg, "config.json must give it as true or false")
        fields[NEG_EIGVAL] = neg
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        given = params if "rope_theta" in params else hf  # transformers 4's top-level form
        nope = "rope_theta" in given and given["rope_theta"] is None
        fields["rope"] = not nope
        if nope:  # nothing left to read: the attention layers have no positions
            hf = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_theta")}
        return hf, fields

    def export_layer_types(self, m, refuse_export) -> List[str]:
        types = hybrid_layer_types(self, m, refuse_export, both=True)
        if m.partial_rotary_factor != 1.0:
            refuse_export(f"model.partial_rotary_factor={m.partial_rotary_factor}")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        """Its layer types, Gated DeltaNet sizes, beta's range and RoPE (a null
        rope_theta: NoPE)."""
        g = gated_delta_dims(m)
        drop_rope_keys(cfg)
        cfg.update(layer_types=types, linear_num_key_heads=g.num_key_heads,
                   linear_num_value_heads=g.num_value_heads,
                   linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
                   linear_conv_kernel_dim=g.conv_kernel, attention_bias=False,
                   rope_parameters={**(m.rope_scaling or {"rope_type": "default"}),
                                    "rope_theta": m.rope_theta if m.rope else None},
                   **{NEG_EIGVAL: g.allow_neg_eigval})

    def naming(self, m) -> str:
        return "olmo_hybrid"

    def sources(self, key: str) -> List[Tuple[str, ...]]:
        """The saved form first: a fused tensor's [q | k | v] parts, or transformers'
        loaded names."""
        for fused, parts in FUSED.items():
            if key.endswith(fused):
                base = key[:-len(fused)] + "linear_attn."
                split = tuple(f"{base}{p}.weight" for p in parts)
                return [split, (key,)] if fused.endswith("conv1d.weight") else [split]
        for saved, loaded in LOADED.items():
            if key.endswith(saved):
                return [(key,), (key[:-len(saved)] + loaded,)]
        return [(key,)]

    def part_rows(self, m, keys: Tuple[str, ...]) -> Optional[List[int]]:
        """The projections by section; transformers saves the conv in three equal chunks
        (its Concatenate reversed), so only the conv's sum counts (each part's own rows)."""
        return list(part_rows(m)) if "_proj." in keys[0] else None

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        split = self.sources(key)[0]
        if len(split) == 1:
            return [(key, t)]
        return list(zip(split, t.split(part_rows(m), dim=0)))


FAMILY = OlmoHybrid(
    "olmo_hybrid", "OlmoHybridForCausalLM",
    {**{k: v for k, v in ARCH_DEFAULTS.items()
        if k not in ("rope", "linear_allow_neg_eigval")},  # read from config.json
     "qk_norm": True, "qk_norm_scope": "all_heads", "reordered_norms": ["full_attention"],
     "linear_norm_eps": 1e-5},
    ("hidden_act", "silu"),  # its MLP's and its Gated DeltaNet conv's
    neutral={"attention_bias": (False, NO_BIAS)},
    own=("layer_types", NEG_EIGVAL, *LINEAR_ATTENTION_KEYS),
    inert=INIT_KEYS)
