"""MiniMax-M2 (``minimax_m2``, MiniMaxM2ForCausalLM): GQA attention whose q and k are
RMS-normed over all heads' projection (OLMo 2's ``qk_norm_scope: all_heads``) before a
partial RoPE, and a mixture of SwiGLU experts on every layer with a sigmoid router and
DeepSeek-V3's correction bias.

    config.json                            ctxpar model.*
    rotary_dim (or rope_parameters'         partial_rotary_factor = rotary_dim / head_dim
      partial_rotary_factor)
    num_local_experts (num_experts)        moe.num_experts
    num_experts_per_tok                    moe.top_k
    intermediate_size                      ffn_hidden = moe.expert_hidden (every layer MoE)
    (fixed)                                moe.score sigmoid, score_correction_bias, norm_topk

transformers' MiniMaxM2TopKRouter: sigmoid scores in fp32, the top-k chosen on scores +
e_score_correction_bias (a buffer on the block: ``block_sparse_moe.e_score_correction_bias``
as save_pretrained writes it), weighted by the unbiased scores, normalised (route's
norm_topk, no groups, no scaling). Its folders name the experts Mixtral's way (w1 / w3 /
w2, the router block_sparse_moe.gate). use_qk_norm must be true (transformers always
norms q and k). output_router_logits must be false: transformers' load-balancing loss
counts the top-k of the router's logits without the correction bias, ctxpar's the experts
the tokens are routed to (ctxpar/moe/aux.py), which differ once the bias is not zero;
router_aux_loss_coef is then read by nothing (inert).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_ffn_hidden, resolved_head_dim
from ...config.moe import MoEConfig
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, Family, Refuse, full_attention_only
from .experts import experts_and_top_k, per_expert_tensors

DEFAULTS = dict(num_local_experts=256, num_experts_per_tok=8,
                router_aux_loss_coef=0.001)  # transformers' MiniMaxM2Config's
BIAS = ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias")
MOE_FIXED = {"score": "sigmoid", "score_correction_bias": True, "norm_topk": True,
             "shared_expert_hidden": 0, "shared_expert_gate": False, "router_bias": False,
             "expert_bias": False, "swiglu_limit": None, "aux_loss_coef": 0.0, "n_group": 1,
             "topk_group": 1, "routed_scaling_factor": 1.0, "layers": None}


class MiniMaxM2(Family):
    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        if hf.get("use_qk_norm", True) is not True:
            refuse("use_qk_norm", hf["use_qk_norm"], "transformers' MiniMax-M2 always norms q "
                                                     "and k over all heads")
        e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("num_local_experts", "num_experts"))
        return {**self.fixed, "moe": MoEConfig(num_experts=e, top_k=k,
                                               expert_hidden=hf["intermediate_size"],
                                               **MOE_FIXED)}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """RoPE's partial factor: rope_parameters', else rotary_dim / head_dim (both given,
        they must agree); the rest of the RoPE keys read as every family's."""
        params = dict(hf.get("rope_parameters") or {})
        hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = hf.get("rotary_dim")
        if rotary is not None and (not isinstance(rotary, int) or isinstance(rotary, bool)
                                   or not 0 < rotary <= hd or rotary % 2):
            refuse("rotary_dim", rotary, f"an even number of channels in (0, head_dim={hd}]")
        partial = params.pop("partial_rotary_factor", hf.get(
            "partial_rotary_factor", 1.0 if rotary is None else rotary / hd))
        if not isinstance(partial, (int, float)) or isinstance(partial, bool) or \
                not 0 < partial <= 1:
            refuse("partial_rotary_factor", partial, "a fraction of each head's channels "
                                                     "in (0, 1]")
        if rotary is not None and rotary != int(hd * partial):
            refuse("rotary_dim", rotary, f"partial_rotary_factor={partial} of head_dim={hd} "
                                         f"rotates {int(hd * partial)} channels")
        rest = {k: v for k, v in hf.items() if k not in ("partial_rotary_factor", "rotary_dim")}
        return {**rest, "rope_parameters": params or None}, \
            {"partial_rotary_factor": float(partial)}

    def export_layer_types(self, m, refuse_export) -> List[str]:
        return full_attention_only(self, m, refuse_export)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe = m.moe
        if (moe.expert_hidden or resolved_ffn_hidden(m)) != resolved_ffn_hidden(m):
            refuse_export(f"model.moe.expert_hidden={moe.expert_hidden} (MiniMax-M2's experts "
                          f"are model.ffn_hidden wide: no layer is dense)")
        if moe.capacity_factor is not None:
            refuse_export(f"model.moe.capacity_factor={moe.capacity_factor} (transformers' "
                          f"experts drop no token)")
        hd = resolved_head_dim(m)
        if int(hd * m.partial_rotary_factor) % 2:
            refuse_export(f"model.partial_rotary_factor={m.partial_rotary_factor} (rotary_dim "
                          f"must be an even number of channels of head_dim {hd})")
        drop_rope_keys(cfg)  # written here, with the partial factor
        cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   output_router_logits=False, router_jitter_noise=0.0,
                   router_aux_loss_coef=(source or {}).get("router_aux_loss_coef",
                                                           DEFAULTS["router_aux_loss_coef"]),
                   rotary_dim=int(hd * m.partial_rotary_factor),
                   rope_parameters={**(m.rope_scaling or {"rope_type": "default"}),
                                    "rope_theta": m.rope_theta,
                                    "partial_rotary_factor": m.partial_rotary_factor})

    def folder_key(self, key: str) -> str:
        return key.replace(*BIAS) if key.endswith(BIAS[0]) else key

    def to_folder(self, key: str, t, m) -> List[Tuple[str, Any]]:
        return per_expert_tensors(self.folder_key(key), t, self.expert_naming)


FAMILY = MiniMaxM2(
    "minimax_m2", "MiniMaxM2ForCausalLM",
    {**ARCH_DEFAULTS, "qk_norm": True, "qk_norm_scope": "all_heads"}, ("hidden_act", "silu"),
    default_theta=5_000_000.0,
    neutral={"router_jitter_noise": (0.0, "ctxpar's router multiplies no noise into its "
                                          "input"),
             "output_router_logits": (False, "transformers' load-balancing loss counts the "
                                             "top-k without the correction bias (ctxpar's "
                                             "counts the experts routed to)")},
    own=("use_qk_norm", "rotary_dim", "num_local_experts", "num_experts",
         "num_experts_per_tok"),
    inert=("router_aux_loss_coef",),  # read only with output_router_logits, which is false
    moe_fixed=MOE_FIXED, expert_naming="mixtral")
