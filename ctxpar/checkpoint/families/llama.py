"""Llama (``llama``, LlamaForCausalLM): ctxpar's GPT as it is; biases on every linear
layer or none.

    config.json                      ctxpar model.*
    attention_bias = mlp_bias        bias (o_proj's with the MLP's: one switch in ctxpar)
    (every other key: hf.py's common mapping; no window, every layer full attention)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .base import ARCH_DEFAULTS, Family, Refuse


class Llama(Family):
    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        attn, mlp = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        if attn != mlp:
            refuse("attention_bias", attn, f"with mlp_bias={mlp}: ctxpar's model.bias puts "
                                           f"biases on every linear layer, or on none")
        return {**self.fixed, "bias": bool(attn)}

    def check_windows(self, m, types: List[str], refuse_export) -> None:
        if "sliding_attention" in types:
            refuse_export(f"model.sliding_window={m.sliding_window} (Llama has no window; "
                          f"Mistral, Qwen and Gemma 3 do)")

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        cfg.update(attention_bias=m.bias, mlp_bias=m.bias, pretraining_tp=1)


FAMILY = Llama(
    "llama", "LlamaForCausalLM", {k: v for k, v in ARCH_DEFAULTS.items() if k != "bias"},
    ("hidden_act", "silu"), own=("attention_bias", "mlp_bias"))
