"""Qwen2 and Qwen3 (``qwen2``, ``qwen3``): Llama's layers with Qwen2's q/k/v biases or
Qwen3's q/k norms, and sliding layers as their config classes read them.

    config.json                      ctxpar model.*
    use_sliding_window, sliding_window   sliding_window (the sliding layers' window)
    layer_types, or max_window_layers    layer_types: given, else sliding from layer
                                     max_window_layers on (28 by default) when
                                     use_sliding_window; a sliding layer without a
                                     window attends fully, as in transformers
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .base import ARCH_DEFAULTS, NO_BIAS, Family, Refuse, attention_layers

SLIDING_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


def qwen_sliding_layers(hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
    """model.sliding_window and layer_types of a Qwen2/Qwen3 config.json."""
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if types is None:
        types = ["sliding_attention" if window is not None and i >= hf.get(
            "max_window_layers", 28) else "full_attention" for i in range(n)]
    if window is None:  # transformers' sliding layers without a window: full ones
        types = ["full_attention"] * n
    return attention_layers(hf, types, window, refuse)


class Qwen(Family):
    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return hf, qwen_sliding_layers(hf, refuse)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        sliding = "sliding_attention" in types
        cfg.update(use_sliding_window=sliding, sliding_window=m.sliding_window,
                   layer_types=types, max_window_layers=(
                       types.index("sliding_attention") if sliding else m.n_layers))
        if self.model_type == "qwen3":
            cfg["attention_bias"] = False


QWEN2 = Qwen("qwen2", "Qwen2ForCausalLM", {**ARCH_DEFAULTS, "attention_bias": True},
             ("hidden_act", "silu"), own=SLIDING_KEYS)
QWEN3 = Qwen("qwen3", "Qwen3ForCausalLM", {**ARCH_DEFAULTS, "qk_norm": True},
             ("hidden_act", "silu"), neutral={"attention_bias": (False, NO_BIAS)},
             own=SLIDING_KEYS)
