"""Nemotron-H's mixture-of-experts blocks ('moe', pattern letter 'E'; Nemotron 3) in
config.json: transformers' NemotronHMoE as ctxpar's model.moe (models/moe.py).

    config.json                            ctxpar model.moe.*
    layers_block_type 'moe' / 'E'          layers: those blocks' indices (each a ctxpar
                                           'mlp' block whose MLP is the MoE)
    n_routed_experts (num_local_experts)   num_experts
    num_experts_per_tok                    top_k
    moe_intermediate_size                  expert_hidden (squared-ReLU experts, no gate:
                                           up_proj (E, f, d), down_proj (E, d, f))
    moe_shared_expert_intermediate_size    shared_expert_hidden (always one, ungated)
    norm_topk_prob                         norm_topk
    routed_scaling_factor                  routed_scaling_factor
    n_group, topk_group                    n_group, topk_group
    (fixed)                                score sigmoid, score_correction_bias (the
                                           router's e_score_correction_bias buffer)

transformers' NemotronHTopkRouter is DeepSeek-V3's (ctxpar/moe/router.py): sigmoid scores,
the top-k chosen on scores + e_score_correction_bias among the topk_group best of n_group
groups, weighted by the unbiased scores, normalised, times routed_scaling_factor.
NemotronHForCausalLM adds no router loss (output_router_logits only returns the logits):
aux_loss_coef is 0. moe_latent_size (a projection d -> latent around the experts) is not
implemented by ctxpar: refused unless null. n_shared_experts and moe_shared_expert_overlap
are read by no transformers code (one shared MLP, moe_shared_expert_intermediate_size
wide): inert.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ..config import resolved_ffn_hidden
from ..config.moe import MoEConfig, moe_layer_indices
from .moe_families import integer_field

# config.json keys read here (families.py's nemotron_h own), and those no code reads
NEMOTRON_MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                     "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
                     "moe_latent_size")
NEMOTRON_MOE_INERT = ("n_shared_experts", "moe_shared_expert_overlap", "output_router_logits")
DEFAULTS = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=7688,
                moe_shared_expert_intermediate_size=7688, norm_topk_prob=True,
                routed_scaling_factor=1.0, n_group=1, topk_group=1)  # NemotronHConfig's
# model.moe.* every Nemotron-H MoE has (families.py's moe_fixed)
NEMOTRON_MOE_FIXED = {"score": "sigmoid", "score_correction_bias": True,
                      "shared_expert_gate": False, "router_bias": False, "expert_bias": False,
                      "swiglu_limit": None, "aux_loss_coef": 0.0}


def _integer(hf, key, refuse) -> int:
    return integer_field(hf, key, DEFAULTS.get(key), refuse)


def nemotron_moe_fields(hf: Dict[str, Any], sparse: List[int],
                        refuse: Callable) -> Optional[MoEConfig]:
    """model.moe of a nemotron_h config.json whose blocks `sparse` are 'moe' (None when
    there are none: the MoE keys then compute nothing)."""
    if not sparse:
        return None
    if hf.get("moe_latent_size") is not None:
        refuse("moe_latent_size", hf["moe_latent_size"], "a latent projection around the "
               "experts is not implemented by ctxpar")
    given = [k for k in ("n_routed_experts", "num_local_experts") if hf.get(k) is not None]
    if len(given) == 2 and hf["n_routed_experts"] != hf["num_local_experts"]:
        refuse("num_local_experts", hf["num_local_experts"], f"n_routed_experts="
               f"{hf['n_routed_experts']} names the same count (transformers' attribute_map)")
    e = _integer(hf, given[0] if given else "n_routed_experts", refuse)
    k = _integer(hf, "num_experts_per_tok", refuse)
    if k > e:
        refuse("num_experts_per_tok", k, f"more than n_routed_experts={e}")
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
    scale = hf.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        refuse("routed_scaling_factor", scale, "config.json must give it as a number > 0")
    groups, best = _integer(hf, "n_group", refuse), _integer(hf, "topk_group", refuse)
    if e % groups or e // groups < 2:  # transformers scores a group by its two best
        refuse("n_group", groups, f"must divide n_routed_experts={e} into groups of >= 2")
    if best > groups or k > best * (e // groups):
        refuse("topk_group", best, f"must be <= n_group={groups} with room for "
                                   f"num_experts_per_tok={k} in its groups")
    return MoEConfig(num_experts=e, top_k=k, norm_topk=norm,
                     expert_hidden=_integer(hf, "moe_intermediate_size", refuse),
                     shared_expert_hidden=_integer(hf, "moe_shared_expert_intermediate_size",
                                                   refuse),
                     routed_scaling_factor=float(scale), n_group=groups, topk_group=best,
                     layers=sparse, **NEMOTRON_MOE_FIXED)


def nemotron_moe_config(m, refuse: Callable) -> Dict[str, Any]:
    """config.json's MoE keys of ModelConfig m (nemotron_h with model.moe); refuse(what)
    where its MoE is not Nemotron-H's (its fixed values are families.py's moe_fixed)."""
    moe = m.moe
    if moe.shared_expert_hidden < 1:
        refuse(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} (Nemotron-H's "
               f"MoE blocks always have a shared expert)")
    if moe.capacity_factor is not None:
        refuse(f"model.moe.capacity_factor={moe.capacity_factor} (transformers' experts drop "
               f"no token)")
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_hidden or resolved_ffn_hidden(m),
            "moe_shared_expert_intermediate_size": moe.shared_expert_hidden,
            "n_shared_experts": 1, "moe_latent_size": None,
            "norm_topk_prob": moe.norm_topk, "routed_scaling_factor": moe.routed_scaling_factor,
            "n_group": moe.n_group, "topk_group": moe.topk_group,
            "output_router_logits": False}


def moe_blocks(m) -> List[int]:
    """The layers whose MLP block is Nemotron-H's 'moe' block."""
    return moe_layer_indices(m.moe, m.n_layers)
