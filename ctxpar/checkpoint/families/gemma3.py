"""Gemma 3 (``gemma3_text``, Gemma3ForCausalLM): GeGLU, (1 + w) norms before and after
each op, embeddings scaled by sqrt(d), q/k norms, a softmax scale of its own, sliding
layers with a RoPE of their own.

    config.json                      ctxpar model.*
    query_pre_attn_scalar            query_pre_attn_scalar (the softmax scale, 1/sqrt of it)
    layer_types, or every            layer_types (all but every 6th layer sliding by
      sliding_window_pattern-th        default)
      layer full
    sliding_window                   sliding_window (4096 by default)
    rope_parameters.full_attention   rope_theta, rope_scaling
    rope_parameters.sliding_attention, layer_rope: the sliding layers' own RoPE
      or rope_local_base_freq
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_head_dim
from ..rope_config import drop_rope_keys, read_rope, rope_of
from .base import ARCH_DEFAULTS, NO_BIAS, Family, Refuse, attention_layers


def _number(x: float):
    """x as transformers' config classes type it: an int when whole (Gemma's
    query_pre_attn_scalar is an int field)."""
    return int(x) if float(x).is_integer() else x


class Gemma3(Family):
    layer_rope_types = ("sliding_attention",)
    own_query_scale = True

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        n, types = hf["num_hidden_layers"], hf.get("layer_types")
        if types is None:
            every = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(n)]
        heads, d = hf["num_attention_heads"], hf["hidden_size"]
        hd = hf.get("head_dim") or d // heads
        qpas = hf.get("query_pre_attn_scalar")
        fields = attention_layers(hf, types, hf.get("sliding_window", 4096), refuse)
        fields["query_pre_attn_scalar"] = None if qpas in (None, hd) else float(qpas)
        if "sliding_window" in fields:  # the sliding layers' own RoPE
            local = (hf.get("rope_parameters") or {}).get("sliding_attention")
            theta, scaling = rope_of(local, hf, file, 10_000.0) if isinstance(local, dict) \
                else (float(hf.get("rope_local_base_freq", 10_000.0)), None)
            fields["layer_rope"] = {"sliding_attention": {"rope_theta": theta,
                                                          "rope_scaling": scaling}}
        return hf, fields

    def rope(self, hf: Dict[str, Any], file: str):
        return read_rope(hf, file, self.default_theta, layer_type="full_attention")

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        hd, sliding = resolved_head_dim(m), "sliding_attention" in types
        scaling = dict(m.rope_scaling or {"rope_type": "default"})
        local = (m.layer_rope or {}).get("sliding_attention", {})
        local_scaling = dict(local.get("rope_scaling") or {"rope_type": "default"})
        drop_rope_keys(cfg)
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


FAMILY = Gemma3(
    "gemma3_text", "Gemma3ForCausalLM",
    {**ARCH_DEFAULTS, "mlp": "geglu", "norm_offset": 1.0, "post_norms": True,
     "scale_embeddings": True, "qk_norm": True},
    ("hidden_activation", "gelu_pytorch_tanh"), default_theta=1_000_000.0,
    neutral={"attention_bias": (False, NO_BIAS),
             "hidden_act": ("gelu_pytorch_tanh", "Gemma 3's MLP in ctxpar uses "
                                                 "gelu_pytorch_tanh")},
    own=("query_pre_attn_scalar", "sliding_window", "layer_types", "rope_local_base_freq",
         "sliding_window_pattern", "_sliding_window_pattern"),
    tied_default=True)
