"""Kimi Linear (``kimi_linear``, KimiLinearForCausalLM: Kimi-Linear-48B-A3B): Kimi Delta
Attention layers (models/kda.py) between multi-head latent attention layers without RoPE
(model.mla under model.rope=false), dense first layers then DeepSeek-V3's mixture of
experts (deepseek.py's reading of its router and shared experts).

    config.json                              ctxpar model.*
    layer_types ('linear_attention',         layer_types ('kimi_delta_attention',
      'full_attention'); else                  'full_attention')
      linear_attn_config's kda_layers and
      full_attn_layers (1-based); else
      every 4th layer from layer 4 full
    linear_num_heads, linear_head_dim,       linear_num_key_heads = linear_num_value_heads,
      linear_conv_kernel_dim (or             linear_key_head_dim = linear_value_head_dim,
      linear_attn_config's num_heads,        linear_conv_kernel_dim
      head_dim, short_conv_kernel_size)
    q_lora_rank, kv_lora_rank,               mla.* (NoPE: rope_interleave computes
      qk_nope_head_dim, qk_rope_head_dim,      nothing; the softmax scale
      v_head_dim                               (qk_nope + qk_rope) ** -0.5)
    mlp_layer_types ('dense', 'sparse');     moe.layers: the sparse ones
      else the first first_k_dense_replace
      dense
    num_experts, num_experts_per_tok,        moe.* as DeepSeek-V3's (sigmoid scores +
      moe_intermediate_size,                   e_score_correction_bias, group-limited,
      num_shared_experts,                      shared experts ungated of n x the experts'
      routed_scaling_factor, moe_renormalize,  width)
      num_expert_group, topk_group

Its class's attribute_map gives several keys two spellings (num_experts /
num_local_experts, num_experts_per_token / num_experts_per_tok, moe_renormalize /
norm_topk_prob, num_expert_group / n_group, num_shared_experts / n_shared_experts,
model_max_length / max_position_embeddings); both are read, and refused when they
disagree. Inert, and why: num_key_value_heads (MLA expands every head from the latent;
the class's default 32 stands beside any head count), head_dim and qk_head_dim (written by
the class from the MLA widths, read by none), rope_theta / rope_scaling /
rope_parameters (KimiLinearModel builds no rotary embedding), output_router_logits (its
ForCausalLM, DeepSeek-V3's, adds no router loss), pretraining_tp. n_routed_experts is
refused: this class reads num_experts. The released folders' keys for their remote code
(mla_use_nope, moe_router_activation_func, use_grouped_topk, moe_layer_freq,
num_nextn_predict_layers) are read at the values transformers computes, refused at others.

Tensors: as save_pretrained writes them and the released folders hold them (transformers'
conversion_mapping 'kimi_linear' reversed): both mixers under ``self_attn`` (ctxpar's KDA
under ``kda``, its MLA under ``attn``: the 'kimi_linear' naming); the forget gate's
f_a_proj, f_b_proj, dt_bias and A_log directly under self_attn, A_log (1, 1, H, 1) there,
(H,) in ctxpar; the conv as q_conv1d, k_conv1d, v_conv1d (ctxpar's conv1d their
concatenation; a folder with one conv1d is read too); every MLP under
``block_sparse_moe``: the dense layers' gate/up/down_proj, the router's gate.weight and
e_score_correction_bias, the shared experts ``shared_experts.*`` and the experts per
expert as Mixtral's (``experts.{j}.w1`` gate, ``w3`` up, ``w2`` down).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config.layers import gated_delta_dims, layer_types
from ...config.moe import moe_layer_indices
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, Refuse
from .deepseek import MLA_KEYS, DeepSeek
from .experts import per_expert_tensors

# config.json's second spelling (its class's attribute_map) -> the one read here
ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
           "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
           "num_shared_experts": "n_shared_experts",
           "model_max_length": "max_position_embeddings"}
LINEAR_KEYS = {"linear_num_heads": "num_heads", "linear_head_dim": "head_dim",
               "linear_conv_kernel_dim": "short_conv_kernel_size"}  # -> linear_attn_config's
LINEAR_ATTN_CONFIG = ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers",
                      "full_attn_layers")
HF_TYPES = {"linear_attention": "kimi_delta_attention", "full_attention": "full_attention"}
A_LOG = "self_attn.A_log"
CONV, CONV_PARTS = "self_attn.conv1d.weight", ("q_conv1d", "k_conv1d", "v_conv1d")
# what the per-expert 'mixtral' naming renames itself (experts.PER_EXPERT, RENAMED_ROUTER)
PER_EXPERT_KEYS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")
MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "n_shared_experts", "routed_scaling_factor", "norm_topk_prob", "n_group",
            "topk_group", "first_k_dense_replace", "mlp_layer_types")


def canonical(hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
    """config.json with each attribute_map pair under one name (module docstring)."""
    out = dict(hf)
    for alias, name in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            refuse(alias, value, f"{name}={out[name]!r} names the same field (transformers' "
                                 f"attribute_map)")
        out[name] = value
    # KimiLinearMoE reads the count as num_local_experts; DeepSeek's reader, n_routed_experts
    if "num_local_experts" in out:
        out["n_routed_experts"] = out.pop("num_local_experts")
    return out


def _integer(value, key: str, refuse: Refuse, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        refuse(key, value, f"config.json must give it as an integer >= {low}")
    return value


def kimi_layer_types(hf: Dict[str, Any], refuse: Refuse) -> List[str]:
    """transformers' layer types as KimiLinearConfig reads them: layer_types, else
    linear_attn_config's 1-based kda_layers / full_attn_layers, else every 4th from 4."""
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    linear = hf.get("linear_attn_config") or {}
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"),
                          ("kda_layers", "linear_attention")):
            for i in linear[key]:
                if not isinstance(i, int) or not 1 <= i <= n:
                    refuse(f"linear_attn_config.{key}", linear[key], f"1-based layer "
                                                                     f"indices up to {n}")
                types[i - 1] = kind
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - set(HF_TYPES):
        refuse("layer_types", types, f"one of 'linear_attention', 'full_attention' per layer "
                                     f"({n})")
    return types


def sparse_layers(hf: Dict[str, Any], refuse: Refuse) -> List[int]:
    """The MoE layers: mlp_layer_types' 'sparse' ones, else those from
    first_k_dense_replace (1 when absent: KimiLinearConfig's)."""
    n, kinds = hf["num_hidden_layers"], hf.get("mlp_layer_types")
    if kinds is None:
        first = _integer(hf.get("first_k_dense_replace", 1), "first_k_dense_replace", refuse,
                         low=0)
        return list(range(first, n))
    if not isinstance(kinds, list) or len(kinds) != n or set(kinds) - {"dense", "sparse"}:
        refuse("mlp_layer_types", kinds, f"one of 'dense', 'sparse' per layer ({n})")
    return [i for i, kind in enumerate(kinds) if kind == "sparse"]


class KimiLinear(DeepSeek):
    defaults = dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=0,
                    n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                    n_shared_experts=1, routed_scaling_factor=2.446, norm_topk_prob=True,
                    n_group=1, topk_group=1)  # KimiLinearConfig's

    def check_keys(self, hf: Dict[str, Any], refuse: Refuse) -> None:
        if "n_routed_experts" in hf:
            refuse("n_routed_experts", hf["n_routed_experts"], "KimiLinearConfig reads the "
                   "experts' count from num_experts (num_local_experts)")
        linear = hf.get("linear_attn_config") or {}
        if not isinstance(linear, dict) or set(linear) - set(LINEAR_ATTN_CONFIG):
            refuse("linear_attn_config", linear, f"a dict of {', '.join(LINEAR_ATTN_CONFIG)}")
        super(DeepSeek, self).check_keys(canonical(hf, refuse), refuse)

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        hf = canonical(hf, refuse)
        return {k: v for k, v in hf.items() if k not in ("num_key_value_heads", "head_dim")}

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        hf = canonical(hf, refuse)
        n = hf["num_hidden_layers"]
        sparse = sparse_layers(hf, refuse)
        # DeepSeek's reading of the MLA widths and the router, every layer sparse; the
        # sparse layers then as mlp_layer_types says
        def own_names(key, value, why):  # the count as this family's folders spell it
            refuse("num_experts" if key == "n_routed_experts" else key, value,
                   why.replace("n_routed_experts", "num_experts"))
        out = super().fields({**hf, "first_k_dense_replace": 0}, own_names)
        if not sparse:
            out["moe"] = None
        elif sparse != list(range(n)):
            from dataclasses import replace
            out["moe"] = replace(out["moe"], layers=sparse)
        return out

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        types = kimi_layer_types(hf, refuse)
        kinds: Dict[str, Any] = {"layer_types": [HF_TYPES[t] for t in types]}
        if "linear_attention" in types:
            linear = hf.get("linear_attn_config") or {}
            size = {key: _integer(linear.get(inner, hf.get(key, default)), key, refuse)
                    for (key, inner), default in zip(LINEAR_KEYS.items(), (32, 128, 4))}
            kinds.update(linear_num_key_heads=size["linear_num_heads"],
                         linear_num_value_heads=size["linear_num_heads"],
                         linear_key_head_dim=size["linear_head_dim"],
                         linear_value_head_dim=size["linear_head_dim"],
                         linear_conv_kernel_dim=size["linear_conv_kernel_dim"])
        return hf, kinds

    def rope(self, hf: Dict[str, Any], file: str) -> Tuple[float, Optional[Dict[str, Any]]]:
        """No rotary embedding: any RoPE keys are inert (module docstring)."""
        return self.default_theta, None

    def export_layer_types(self, m, refuse_export) -> List[str]:
        types = layer_types(m)
        if m.mla is None:
            refuse_export("model.mla=None (Kimi Linear's attention layers are multi-head "
                          "latent attention)")
        if set(types) - set(HF_TYPES.values()) or m.attention_sinks:
            refuse_export(f"model.layer_types={types} with attention_sinks="
                          f"{m.attention_sinks} (Kimi Linear has kimi_delta_attention and "
                          f"full_attention layers, no sinks)")
        if not m.mla.rope_interleave:
            refuse_export("model.mla.rope_interleave=false (computes nothing without RoPE; "
                          "Kimi Linear's reading is true)")
        if "kimi_delta_attention" in types:
            g = gated_delta_dims(m)
            if (g.num_key_heads, g.key_head_dim) != (g.num_value_heads, g.value_head_dim):
                refuse_export(f"model.linear_num_value_heads={g.num_value_heads} with "
                              f"linear_value_head_dim={g.value_head_dim} (Kimi Linear's KDA "
                              f"has as many value heads of the key heads' width: "
                              f"{g.num_key_heads} x {g.key_head_dim})")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        mla, moe, n = m.mla, m.moe, m.n_layers
        cfg.pop("head_dim")  # its class writes qk_rope_head_dim
        drop_rope_keys(cfg)
        back = {v: k for k, v in HF_TYPES.items()}
        sparse = moe_layer_indices(moe, n)
        cfg.update({k: getattr(mla, k) for k in MLA_KEYS}, attention_bias=False,
                   layer_types=[back[t] for t in types],
                   mlp_layer_types=["sparse" if i in sparse else "dense" for i in range(n)])
        if "kimi_delta_attention" in types:
            g = gated_delta_dims(m)
            cfg.update(linear_num_heads=g.num_key_heads, linear_head_dim=g.key_head_dim,
                       linear_conv_kernel_dim=g.conv_kernel)
        if moe is None:
            return
        f = moe.expert_hidden or m.ffn_hidden
        if moe.shared_expert_gate or moe.shared_expert_hidden % f or \
                moe.capacity_factor is not None or not moe.score_correction_bias:
            refuse_export(f"model.moe={moe} (Kimi Linear's shared experts are ungated, "
                          f"n_shared_experts x the experts' width; its router dropless, on "
                          f"scores + its correction bias)")
        cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=f, n_shared_experts=moe.shared_expert_hidden // f,
                   routed_scaling_factor=moe.routed_scaling_factor,
                   norm_topk_prob=moe.norm_topk, n_group=moe.n_group,
                   topk_group=moe.topk_group, output_router_logits=False)

    def naming(self, m) -> str:
        return "kimi_linear"

    def folder_key(self, key: str) -> str:
        """transformers' loaded names -> the saved ones (its conversion_mapping's
        kimi_linear, reversed): the forget gate's tensors directly under self_attn, every
        MLP (dense, shared, the router's bias) under block_sparse_moe; the experts and the
        router's weight are renamed by the 'mixtral' per-expert naming."""
        key = super().folder_key(key).replace(".self_attn.forget_gate.", ".self_attn.")
        if ".mlp." in key and not key.endswith(PER_EXPERT_KEYS):
            key = key.replace(".mlp.", ".block_sparse_moe.")
        return key

    def sources(self, key: str) -> List[Tuple[str, ...]]:
        """The KDA conv saved as its q, k and v parts (transformers concatenates them on
        loading), or whole."""
        if key.endswith(CONV):
            base = key[:-len("conv1d.weight")]
            return [tuple(f"{base}{p}.weight" for p in CONV_PARTS), (key,)]
        return [(key,)]

    def folder_shape(self, key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return (1, 1, shape[0], 1) if key.endswith(A_LOG) else shape

    def from_folder(self, key: str, t: torch.Tensor, hf: Dict[str, Any]) -> torch.Tensor:
        return t.reshape(-1) if key.endswith(A_LOG) else t

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        key = self.folder_key(key)
        if key.endswith(A_LOG):
            return [(key, t.reshape(1, 1, -1, 1))]
        if key.endswith(CONV):  # [q | k | v] sections of equal width (key heads = value)
            return list(zip(self.sources(key)[0], t.chunk(3, dim=0)))
        return per_expert_tensors(key, t, self.expert_naming)


_FIXED = {**{k: v for k, v in ARCH_DEFAULTS.items() if k != "mla"}, "rope": False}
FAMILY = KimiLinear(
    "kimi_linear", "KimiLinearForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    # the released folders' keys for its remote code, which transformers' class does not
    # read: its computation is theirs at these values only
    neutral={"attention_bias": (False, "biases on MLA's projections are not built by "
                                       "ctxpar"),
             "mla_use_nope": (True, "transformers' KimiLinearAttention turns no RoPE"),
             "moe_router_activation_func": ("sigmoid", "transformers' router scores by "
                                                       "sigmoid"),
             "use_grouped_topk": (True, "transformers' router always takes the top groups"),
             "moe_layer_freq": (1, "transformers' sparse layers are mlp_layer_types' (or "
                                   "every one from first_k_dense_replace)"),
             "num_nextn_predict_layers": (0, "Kimi Linear's multi-token prediction layers "
                                             "are not read by transformers nor ctxpar")},
    own=(*MLA_KEYS, "qk_head_dim", *MOE_KEYS, "n_routed_experts", "layer_types",
         "linear_attn_config", *LINEAR_KEYS),
    inert=("num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
           "output_router_logits", "pretraining_tp"),
    moe_fixed={"score": "sigmoid", "score_correction_bias": True, "shared_expert_gate": False,
               "aux_loss_coef": 0.0},
    moe_optional=True, expert_naming="mixtral")
