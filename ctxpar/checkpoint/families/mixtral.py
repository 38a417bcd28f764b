"""Mixtral (``mixtral``, MixtralForCausalLM): Mistral's layers with a mixture of SwiGLU
experts on every layer, intermediate_size wide, their top-k weights normalised
(experts.py's common keys); its folders name the experts w1 / w3 / w2 and the router
block_sparse_moe.gate."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ...config.moe import MoEConfig
from .base import ARCH_DEFAULTS, Refuse
from .experts import aux_loss_coef, experts_and_top_k, refuse_other_routers, router_loss_keys
from .mistral import Mistral

DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001)
MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok",
            "router_aux_loss_coef", "output_router_logits")


class Mixtral(Mistral):
    """Mistral's layers and windows (mistral.py), with the experts."""

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        e, k = experts_and_top_k(hf, DEFAULTS, refuse)
        return {**self.fixed, "moe": MoEConfig(
            num_experts=e, top_k=k, expert_hidden=hf["intermediate_size"], norm_topk=True,
            aux_loss_coef=aux_loss_coef(hf, DEFAULTS, refuse))}

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe = m.moe
        refuse_other_routers(moe, refuse_export)
        if not moe.norm_topk or moe.layers is not None or \
                (moe.expert_hidden or m.ffn_hidden) != m.ffn_hidden:
            refuse_export(f"model.moe={moe} (Mixtral's experts are on every layer, "
                          f"model.ffn_hidden wide, their top-k weights normalised)")
        cfg.update(num_experts_per_tok=moe.top_k, **router_loss_keys(moe, DEFAULTS, source),
                   num_local_experts=moe.num_experts, router_jitter_noise=0.0,
                   sliding_window=m.sliding_window if "sliding_attention" in types else None)


FAMILY = Mixtral(
    "mixtral", "MixtralForCausalLM", dict(ARCH_DEFAULTS), ("hidden_act", "silu"),
    default_theta=1_000_000.0,
    neutral={"router_jitter_noise": (0.0, "ctxpar's router multiplies no noise into its "
                                          "input")},
    own=("sliding_window", *MOE_KEYS),
    moe_fixed={"shared_expert_hidden": 0, "norm_topk": True, "layers": None},
    expert_naming="mixtral")
