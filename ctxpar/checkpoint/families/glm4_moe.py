"""GLM-4.5 / GLM-4.6 (``glm4_moe``, Glm4MoeForCausalLM): Llama's layers with q/k/v biases,
optional per-head q/k norms, RoPE on the first half of each head's channels, and
DeepSeek-V3's mixture of experts after the first dense layers.

    config.json                            ctxpar model.*
    attention_bias                         attention_bias (q/k/v; o_proj has none)
    use_qk_norm                            qk_norm (per-head RMSNorm before RoPE, Qwen3's)
    rope_parameters.partial_rotary_factor  partial_rotary_factor (or the top-level key of
                                           the released folders; the class's default 0.5)
    intermediate_size                      ffn_hidden (the dense first layers' MLP)
    first_k_dense_replace                  moe.layers: k .. num_hidden_layers - 1
    n_routed_experts (num_local_experts)   moe.num_experts
    num_experts_per_tok                    moe.top_k
    moe_intermediate_size                  moe.expert_hidden
    n_shared_experts                       moe.shared_expert_hidden = n x moe_intermediate_size
                                           (one ungated MLP, mlp.shared_experts.*)
    norm_topk_prob, routed_scaling_factor, moe.norm_topk, routed_scaling_factor, n_group,
      n_group, topk_group                    topk_group
    (fixed)                                moe.score sigmoid, score_correction_bias (the
                                           router's e_score_correction_bias buffer)

transformers' Glm4MoeTopkRouter is DeepSeek-V3's (ctxpar/moe/router.py's route): sigmoid
scores in fp32, the top-k chosen on scores + e_score_correction_bias among the topk_group
best of n_group groups, weighted by the unbiased scores, normalised, times
routed_scaling_factor. Glm4MoeForCausalLM adds no router loss: aux_loss_coef is 0 and
output_router_logits is inert (it returns the logits only). Its attention is causal on
every layer (no window).

The released folders' multi-token prediction layers (num_nextn_predict_layers of them,
model.layers.{num_hidden_layers + i}.*: eh_proj, enorm, hnorm, shared_head and a decoder
layer with experts) are DeepSeek-V3's (deepseek.py's names and model.mtp with moe): with
model.mtp set they are imported, trained and exported; with model.mtp null left out, as
transformers' Glm4MoeForCausalLM drops them on loading, the start-up line saying so, the
export writing none and num_nextn_predict_layers 0.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_ffn_hidden
from ...config.moe import MoEConfig, moe_layer_indices
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, Family, Refuse, full_attention_only
from .deepseek import NumberedMTP
from .experts import experts_and_top_k, integer_field, per_expert_tensors
from .nemotron_h import MOE_FIXED

DEFAULTS = dict(n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                n_group=1, topk_group=1, first_k_dense_replace=1,
                partial_rotary_factor=0.5)  # transformers' Glm4MoeConfig's
MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "norm_topk_prob",
            "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace")
SHARED = ("mlp.shared_expert.", "mlp.shared_experts.")  # ctxpar's name, the folder's
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def grouped_router_fields(hf: Dict[str, Any], e: int, k: int,
                          refuse: Refuse) -> Dict[str, Any]:
    """model.moe's DeepSeek-V3 router values of a config.json (GLM-4.5's, MiMo-V2-Flash's):
    norm_topk_prob, routed_scaling_factor, n_group, topk_group, checked against the e
    experts and top-k k."""
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
    scale = hf.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        refuse("routed_scaling_factor", scale, "config.json must give it as a number > 0")
    groups = integer_field(hf, "n_group", 1, refuse)
    best = integer_field(hf, "topk_group", 1, refuse)
    if e % groups or (groups > 1 and e // groups < 2):  # a group scored by its two best
        refuse("n_group", groups, f"must divide n_routed_experts={e} into groups of >= 2")
    if best > groups or k > best * (e // groups):
        refuse("topk_group", best, f"must be <= n_group={groups} with room for "
                                   f"num_experts_per_tok={k} in its groups")
    return dict(norm_topk=norm, routed_scaling_factor=float(scale), n_group=groups,
                topk_group=best)


def grouped_router_keys(moe) -> Dict[str, Any]:
    """config.json's router keys of model.moe (grouped_router_fields' inverse)."""
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.norm_topk, "routed_scaling_factor": moe.routed_scaling_factor,
            "n_group": moe.n_group, "topk_group": moe.topk_group,
            "output_router_logits": False}


def glm_moe_fields(hf: Dict[str, Any], refuse: Refuse) -> MoEConfig:
    """model.moe of a GLM-4.5 config.json (transformers' defaults where it has none)."""
    e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("n_routed_experts", "num_local_experts"))
    n = hf["num_hidden_layers"]
    first = integer_field(hf, "first_k_dense_replace", DEFAULTS["first_k_dense_replace"],
                          refuse, low=0)
    if first >= n:
        refuse("first_k_dense_replace", first, f"leaves no MoE layer of {n} (ctxpar's "
                                               f"glm4_moe has experts)")
    router = grouped_router_fields(hf, e, k, refuse)
    width = integer_field(hf, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"],
                          refuse)
    shared = integer_field(hf, "n_shared_experts", 1, refuse)
    return MoEConfig(num_experts=e, top_k=k, expert_hidden=width,
                     shared_expert_hidden=shared * width, **router,
                     layers=list(range(first, n)) if first else None, **MOE_FIXED)


def check_dropless(moe, refuse_export) -> None:
    """transformers' experts drop no token: model.moe.capacity_factor unset."""
    if moe.capacity_factor is not None:
        refuse_export(f"model.moe.capacity_factor={moe.capacity_factor} (transformers' "
                      f"experts drop no token)")


def glm_moe_config(m, refuse_export) -> Dict[str, Any]:
    """config.json's MoE keys of ModelConfig m (glm_moe_fields' inverse)."""
    moe, n = m.moe, m.n_layers
    sparse = moe_layer_indices(moe, n)
    first = n - len(sparse)
    if sparse != list(range(first, n)):
        refuse_export(f"model.moe.layers={moe.layers} (GLM-4.5's MoE layers are all those "
                      f"after its first_k_dense_replace dense ones)")
    width = moe.expert_hidden or resolved_ffn_hidden(m)
    if moe.shared_expert_hidden < width or moe.shared_expert_hidden % width:
        refuse_export(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} (GLM-4.5's "
                      f"shared experts are n_shared_experts >= 1 x moe_intermediate_size="
                      f"{width})")
    check_dropless(moe, refuse_export)
    return {**grouped_router_keys(moe), "moe_intermediate_size": width,
            "n_shared_experts": moe.shared_expert_hidden // width,
            "first_k_dense_replace": first}


class Glm4Moe(NumberedMTP, Family):
    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        fields = {**self.fixed, "moe": glm_moe_fields(hf, refuse)}
        for key, field in (("attention_bias", "attention_bias"), ("use_qk_norm", "qk_norm")):
            fields[field] = hf.get(key, False)
            if not isinstance(fields[field], bool):
                refuse(key, hf[key], "config.json must give it as a boolean")
        return fields

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """RoPE's partial factor, from rope_parameters or the top level (0.5 when neither
        has it); the rest of the RoPE keys read as every family's."""
        params = dict(hf.get("rope_parameters") or {})
        partial = params.pop("partial_rotary_factor",
                             hf.get("partial_rotary_factor", DEFAULTS["partial_rotary_factor"]))
        if not isinstance(partial, (int, float)) or isinstance(partial, bool) or \
                not 0 < partial <= 1:
            refuse("partial_rotary_factor", partial, "a fraction of each head's channels "
                                                     "in (0, 1]")
        rest = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
        return {**rest, "rope_parameters": params or None}, \
            {"partial_rotary_factor": float(partial)}

    def export_layer_types(self, m, refuse_export) -> List[str]:
        return full_attention_only(self, m, refuse_export)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        drop_rope_keys(cfg)  # written here, with the partial factor
        cfg.update(attention_bias=m.attention_bias, use_qk_norm=m.qk_norm,
                   **glm_moe_config(m, refuse_export),
                   rope_parameters={**(m.rope_scaling or {"rope_type": "default"}),
                                    "rope_theta": m.rope_theta,
                                    "partial_rotary_factor": m.partial_rotary_factor})

    def folder_key(self, key: str) -> str:
        return key.replace(*SHARED) if SHARED[0] in key else key

    def to_folder(self, key: str, t, m) -> List[Tuple[str, Any]]:
        return per_expert_tensors(self.folder_key(key), t, self.expert_naming)

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        """The multi-token prediction layers: model.layers.N.* past num_hidden_layers."""
        layer = _LAYER.match(key)
        return layer is not None and int(layer.group(1)) >= hf.get("num_hidden_layers", 46)

    def mtp_moe_of(self, hf: Dict[str, Any], refuse: Refuse) -> MoEConfig:
        return glm_moe_fields(hf, refuse)  # it refuses a folder without experts


FAMILY = Glm4Moe(
    "glm4_moe", "Glm4MoeForCausalLM",
    {k: v for k, v in ARCH_DEFAULTS.items() if k not in ("attention_bias", "qk_norm")},
    ("hidden_act", "silu"),
    own=("attention_bias", "use_qk_norm", *MOE_KEYS),
    inert=("output_router_logits",  # returns the router logits, adds no loss
           "num_nextn_predict_layers", "num_mtp_layers"),  # read by the mtp hook (above)
    moe_fixed=MOE_FIXED, expert_naming="qwen")
