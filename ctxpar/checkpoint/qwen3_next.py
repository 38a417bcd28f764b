"""Qwen3-Next (qwen3_next) and Qwen3.5-MoE (qwen3_5_moe_text) folders: Qwen3.5's hybrid
layers (linear_families.py: Gated DeltaNet and gated full attention, (1 + w) norms,
partial RoPE) with Qwen2-MoE's experts behind a sigmoid-gated shared expert
(moe_families.py).

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
Their released folders' multi-token prediction layers (mtp.*) are left out, as
transformers' causal LMs drop them on loading; the start-up line says so.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..config.layers import gated_delta_dims

QWEN3_NEXT_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
# config.json keys transformers' Qwen3.5-MoE reads in no code (module docstring; the
# multi-token prediction layers' sizes too: no transformers model builds them)
# The released Qwen3.5, Qwen3-Next and Qwen3.5-MoE folders' multi-token prediction layers
# (mtp.* tensors, sized by these config.json keys): transformers' causal LMs build none and
# drop the tensors on loading (_keys_to_ignore_on_load_unexpected), and so does the import,
# saying so in its start-up line; the export writes none.
MTP_KEYS = ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
MTP_PREFIX = "mtp."
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_5_text", "qwen3_5")
QWEN3_5_MOE_INERT = ("intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                     "norm_topk_prob", *MTP_KEYS)
# the folder's fused Gated DeltaNet projection -> ctxpar's two parts, in its row order
FUSED = {"linear_attn.in_proj_qkvz.weight": ("linear_attn.in_proj_qkv.weight",
                                             "linear_attn.in_proj_z.weight"),
         "linear_attn.in_proj_ba.weight": ("linear_attn.in_proj_b.weight",
                                           "linear_attn.in_proj_a.weight")}
Dims = Tuple[int, int, int, int]  # key heads, key head dim, value heads, value head dim


def dims_of(fields: Dict[str, Any]) -> Dims:
    """(Hk, dk, Hv, dv) from model.* linear_* fields (linear_families'
    linear_attention_fields, which has transformers' defaults)."""
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


def left_out(key: str, model_type: Optional[str]) -> bool:
    """A tensor the import leaves out: a multi-token prediction layer's."""
    return model_type in MTP_MODEL_TYPES and key.startswith(MTP_PREFIX)


def fused_source(key: str, model_type: Optional[str]) -> Optional[Tuple[str, int]]:
    """(the folder's fused key, which part) of ctxpar's HF-form key `key` in a qwen3_next
    folder, None for the other tensors: a Qwen3-Next folder holds the fused projections
    only (one with Qwen3.5's four is another architecture, refused as such)."""
    if model_type != "qwen3_next":
        return None
    for fused, parts in FUSED.items():
        for i, part in enumerate(parts):
            if key.endswith(part):
                return key[:-len(part)] + fused, i
    return None


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


def fused_shape(fused_key: str, dims: Dims, d_model: int) -> Tuple[int, int]:
    return dims[0] * sum(_sections(fused_key, dims)), d_model


def saved_tensors(tensors: Dict[str, torch.Tensor], m) -> Dict[str, torch.Tensor]:
    """The export's tensors as transformers saves a Qwen3-Next folder: each Gated DeltaNet
    layer's four projections as in_proj_qkvz and in_proj_ba."""
    out, dims = dict(tensors), model_dims(m)
    for key in list(tensors):
        for fused, parts in FUSED.items():
            if key.endswith(parts[0]):
                base = key[:-len(parts[0])]
                out[base + fused] = fuse(fused, [out.pop(base + p) for p in parts], dims)
    return out


def moe_text_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """A qwen3_5_moe_text config.json with intermediate_size its experts' width (ctxpar's
    model.ffn_hidden; transformers reads none: module docstring)."""
    return {**hf, "intermediate_size": hf.get("moe_intermediate_size", 512)}


def hybrid_moe_config(cfg: Dict[str, Any], m, refuse: Callable) -> None:
    """Qwen3.5-MoE's export: no intermediate_size (no dense MLP), so model.ffn_hidden must
    be the experts' width for the folder to hold it."""
    ffn = cfg.pop("intermediate_size")  # resolved_ffn_hidden(m)
    if (m.moe.expert_hidden or ffn) != ffn:
        refuse(f"model.ffn_hidden={ffn} with model.moe.expert_hidden={m.moe.expert_hidden} "
               f"(Qwen3.5-MoE has no dense MLP: its ffn_hidden is the experts' width)")
