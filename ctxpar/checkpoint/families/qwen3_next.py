"""Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE (``qwen3_5_moe_text``; the multimodal
``qwen3_5_moe`` folders' language model): Qwen3.5's hybrid layers (qwen3_5.py) with
Qwen2-MoE's experts behind a sigmoid-gated shared expert (qwen_moe.py).

    config.json                      ctxpar model.*
    layer_types, full_attention_interval, linear_*, partial_rotary_factor   as qwen3_5_text
    num_experts, num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size, router_aux_loss_coef, output_router_logits
                                     model.moe, as qwen2_moe (a gated shared expert)
    decoder_sparse_step, mlp_only_layers, norm_topk_prob
                                     Qwen3-Next: moe.layers, moe.norm_topk; Qwen3.5-MoE:
                                     inert (its decoder layers are all sparse, its router
                                     always normalises the top-k: transformers reads none
                                     of them, nor intermediate_size)

Qwen3.5-MoE's ctxpar model.ffn_hidden is its moe_intermediate_size (no layer has a dense
MLP; the export writes no intermediate_size and refuses another width).

Tensors: the experts per expert (mlp.experts.{j}.gate_proj / up_proj / down_proj), as
Qwen2-MoE's. Qwen3.5-MoE's Gated DeltaNet holds Qwen3.5's four projections; Qwen3-Next's
holds two, grouped by key head (transformers' fix_query_key_value_ordering):

    in_proj_qkvz (rows)  per key head g: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]
    in_proj_ba (rows)    per key head g: [b_g (r) | a_g (r)]          r = Hv / Hk

ctxpar's in_proj_qkv is [q (all heads) | k | v], in_proj_z, in_proj_b and in_proj_a by
head (value head g r + j belongs to key head g, as both models repeat the keys): the
import takes each part's rows out of the fused tensor, the export puts them back.
Their multi-token prediction layers (mtp.*) are Qwen3.5's (qwen3_5.py) with the experts
of their layers in the MTP block (model.mtp.moe; the experts per expert under
mtp.layers.{k}.mlp.experts.{j}).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config.layers import gated_delta_dims
from ..resume import CheckpointError
from .base import NO_BIAS, Refuse
from .qwen3_5 import (LINEAR_ATTENTION_KEYS, MTP_KEYS, QWEN3_5_FIXED, Qwen3_5,
                      linear_attention_fields)
from .qwen_moe import SHARED_KEYS, qwen_moe_config, qwen_moe_fields

# the folder's fused Gated DeltaNet projection -> ctxpar's two parts, in its row order
FUSED = {"linear_attn.in_proj_qkvz.weight": ("linear_attn.in_proj_qkv.weight",
                                             "linear_attn.in_proj_z.weight"),
         "linear_attn.in_proj_ba.weight": ("linear_attn.in_proj_b.weight",
                                           "linear_attn.in_proj_a.weight")}
Dims = Tuple[int, int, int, int]  # key heads, key head dim, value heads, value head dim


def dims_of(fields: Dict[str, Any]) -> Dims:
    """(Hk, dk, Hv, dv) from model.* linear_* fields (transformers' defaults in)."""
    return (fields["linear_num_key_heads"], fields["linear_key_head_dim"],
            fields["linear_num_value_heads"], fields["linear_value_head_dim"])


def model_dims(m) -> Dims:
    g = gated_delta_dims(m)
    return g.num_key_heads, g.key_head_dim, g.num_value_heads, g.value_head_dim


def _sections(fused: str, dims: Dims) -> Tuple[int, ...]:
    """Rows of each section of one key head's group in a fused tensor."""
    hk, dk, hv, dv = dims
    r = hv // hk
    return (dk, dk, r * dv, r * dv) if fused.endswith("qkvz.weight") else (r, r)


def unfuse(fused_key: str, t: torch.Tensor, part: int, dims: Dims) -> torch.Tensor:
    """ctxpar's part `part` of a fused tensor (module docstring's layout)."""
    hk = dims[0]
    rows = _sections(fused_key, dims)
    groups = t.reshape(hk, sum(rows), t.shape[-1]).split(rows, dim=1)
    if len(rows) == 2:                                  # [b | a]
        return groups[part].reshape(-1, t.shape[-1]).contiguous()
    if part == 1:                                       # z
        return groups[3].reshape(-1, t.shape[-1]).contiguous()
    return torch.cat([g.reshape(-1, t.shape[-1]) for g in groups[:3]]).contiguous()


def fuse(fused_key: str, parts, dims: Dims) -> torch.Tensor:
    """unfuse's inverse: the folder's tensor of ctxpar's two parts."""
    hk, dk, hv, dv = dims
    d = parts[0].shape[-1]
    if fused_key.endswith("ba.weight"):
        return torch.cat([p.reshape(hk, -1, d) for p in parts], dim=1).reshape(-1, d)
    qkv, z = parts
    q, k, v = qkv.split((hk * dk, hk * dk, hv * dv))
    return torch.cat([x.reshape(hk, -1, d) for x in (q, k, v, z)], dim=1).reshape(-1, d)


class Qwen3NextLike(Qwen3_5):
    """Qwen3.5's layers with experts; `every_layer`: Qwen3.5-MoE's (all sparse)."""
    every_layer: bool = False
    mtp_moe = True  # the MTP block's MLP is experts, as its layers' (Qwen3NextDecoderLayer)
    defaults: Dict[str, Any] = {}

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        if self.every_layer:  # no dense MLP: ffn_hidden is the experts' width
            return {**hf, "intermediate_size": hf.get("moe_intermediate_size",
                                                      self.defaults["moe_intermediate_size"])}
        return hf

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        return {**self.fixed, "moe": qwen_moe_fields(hf, self.defaults, refuse, shared=True,
                                                     every_layer=self.every_layer)}

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        cfg.update(qwen_moe_config(m, self.defaults, source, refuse_export, shared=True,
                                   every_layer=self.every_layer))
        super().config(cfg, m, types, source, refuse_export)
        if self.every_layer:
            ffn = cfg.pop("intermediate_size")  # resolved_ffn_hidden(m)
            if (m.moe.expert_hidden or ffn) != ffn:
                refuse_export(f"model.ffn_hidden={ffn} with model.moe.expert_hidden="
                              f"{m.moe.expert_hidden} (Qwen3.5-MoE has no dense MLP: its "
                              f"ffn_hidden is the experts' width)")


class Qwen3Next(Qwen3NextLike):
    defaults = dict(num_experts=512, num_experts_per_tok=10, norm_topk_prob=True,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    router_aux_loss_coef=0.001)

    def fused_source(self, key: str) -> Optional[Tuple[str, int]]:
        """A Qwen3-Next folder holds the fused projections only (one with Qwen3.5's four
        is another architecture, refused as such)."""
        for fused, parts in FUSED.items():
            for i, part in enumerate(parts):
                if key.endswith(part):
                    return key[:-len(part)] + fused, i
        return None

    def unfuse(self, fused_key: str, t: torch.Tensor, part: int, hf: Dict[str, Any],
               path: str) -> torch.Tensor:
        def refuse(key, value, why):
            raise CheckpointError(f"{path}: {key}={value!r}: {why}")
        return unfuse(fused_key, t, part, dims_of(linear_attention_fields(hf, refuse)))

    def fused_shape(self, fused_key: str, m) -> Tuple[int, ...]:
        dims = model_dims(m)
        return dims[0] * sum(_sections(fused_key, dims)), m.d_model

    def saved(self, tensors: Dict[str, torch.Tensor], m) -> Dict[str, torch.Tensor]:
        """Each Gated DeltaNet layer's four projections as in_proj_qkvz and in_proj_ba."""
        out, dims = dict(tensors), model_dims(m)
        for key in list(tensors):
            for fused, parts in FUSED.items():
                if key.endswith(parts[0]):
                    base = key[:-len(parts[0])]
                    out[base + fused] = fuse(fused, [out.pop(base + p) for p in parts], dims)
        return out


class Qwen3_5MoE(Qwen3NextLike):
    every_layer = True
    defaults = dict(num_experts=256, num_experts_per_tok=8, norm_topk_prob=True,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    router_aux_loss_coef=0.001)


_OWN = ("layer_types", "full_attention_interval", *LINEAR_ATTENTION_KEYS)
QWEN3_NEXT = Qwen3Next(
    "qwen3_next", "Qwen3NextForCausalLM", dict(QWEN3_5_FIXED), ("hidden_act", "silu"),
    neutral={"attention_bias": (False, NO_BIAS)}, own=(*_OWN, *SHARED_KEYS),
    inert=MTP_KEYS, moe_fixed={"shared_expert_gate": True}, expert_naming="qwen")
QWEN3_5_MOE = Qwen3_5MoE(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", dict(QWEN3_5_FIXED), ("hidden_act", "silu"),
    neutral={"attention_bias": (False, NO_BIAS)},
    own=(*_OWN, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
         "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits"),
    inert=("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
           *MTP_KEYS),
    moe_fixed={"shared_expert_gate": True, "norm_topk": True, "layers": None},
    expert_naming="qwen")
