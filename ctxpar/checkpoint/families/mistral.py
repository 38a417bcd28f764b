"""Mistral (``mistral``, MistralForCausalLM): Llama's layers with sliding_window on every
layer or none (null: full attention)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .base import ARCH_DEFAULTS, Family, Refuse, window_on_every_layer_or_none


def window_on_every_layer(hf: Dict[str, Any], window: Any) -> Dict[str, Any]:
    """model.sliding_window of a family whose window is on every layer (None: none)."""
    return {} if window is None else {"sliding_window": window}


class Mistral(Family):
    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        return hf, window_on_every_layer(hf, hf.get("sliding_window"))

    def check_windows(self, m, types: List[str], refuse_export) -> None:
        window_on_every_layer_or_none(self, m, types, refuse_export)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        cfg["sliding_window"] = m.sliding_window if "sliding_attention" in types else None


FAMILY = Mistral("mistral", "MistralForCausalLM", dict(ARCH_DEFAULTS), ("hidden_act", "silu"),
                 own=("sliding_window",))
