"""Nemotron-H (``nemotron_h``, NemotronHForCausalLM; Nemotron 3's mixture of experts
too): one op a block under ``backbone.layers.N.mixer`` with its ``norm``: Mamba2, NoPE
attention, a squared-ReLU MLP, or the MoE.

    config.json                            ctxpar model.*
    layers_block_type (or the older        layer_types: 'mamba', 'attention', 'mlp' (a
      hybrid_override_pattern M * - E)       'moe' / 'E' block is an 'mlp' one whose MLP
                                             is model.moe)
    mamba_num_heads, mamba_head_dim,       the Mamba2 sizes (chunk_size:
      ssm_state_size, n_groups,              linear_chunk_size); transformers' older
      conv_kernel, use_conv_bias,            mamba_* aliases read too
      time_step_min/max/floor, chunk_size
    layer_norm_epsilon                     norm_eps
    n_routed_experts (num_local_experts)   moe.num_experts
    num_experts_per_tok                    moe.top_k
    moe_intermediate_size                  moe.expert_hidden (squared-ReLU experts, no
                                           gate: up_proj (E, f, d), down_proj (E, d, f))
    moe_shared_expert_intermediate_size    moe.shared_expert_hidden (always one, ungated)
    norm_topk_prob, routed_scaling_factor, moe.norm_topk, routed_scaling_factor,
      n_group, topk_group                    n_group, topk_group
    (fixed)                                moe.score sigmoid, score_correction_bias (the
                                           router's e_score_correction_bias buffer)

transformers' NemotronHTopkRouter is DeepSeek-V3's (ctxpar/moe/router.py): sigmoid scores,
the top-k chosen on scores + e_score_correction_bias among the topk_group best of n_group
groups, weighted by the unbiased scores, normalised, times routed_scaling_factor.
NemotronHForCausalLM adds no router loss (output_router_logits only returns the logits):
aux_loss_coef is 0. moe_latent_size (a projection d -> latent around the experts) is not
implemented by ctxpar: refused unless null. n_shared_experts and moe_shared_expert_overlap
are read by no transformers code (one shared MLP, moe_shared_expert_intermediate_size
wide): inert. transformers 5 reads Nemotron-H's 'mamba' as 'linear_attention' and
'attention' as 'full_attention', names that mean Qwen's two-op blocks in ctxpar: the
import renames them back (config/layer_mixers.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config import resolved_ffn_hidden
from ...config.layers import layer_types, mamba_dims
from ...config.moe import MoEConfig, moe_layer_indices
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, Family, Refuse
from .experts import experts_and_top_k, integer_field

# one op per block, named by transformers 5 (and the older names and pattern letters it
# still reads) -> ctxpar's layer types
BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba",
          "full_attention": "attention", "attention": "attention", "*": "attention",
          "mlp": "mlp", "-": "mlp", "moe": "mlp", "E": "mlp"}
MOE_BLOCKS = ("moe", "E")  # an MLP block whose MLP is the MoE
EXPORT = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
# config.json key -> model.* (transformers' older aliases in ALIASES)
MAMBA_KEYS = {"mamba_num_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim",
              "ssm_state_size": "ssm_state_size", "n_groups": "n_groups",
              "conv_kernel": "conv_kernel", "use_conv_bias": "use_conv_bias",
              "time_step_min": "time_step_min", "time_step_max": "time_step_max",
              "time_step_floor": "time_step_floor", "chunk_size": "linear_chunk_size"}
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
           "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
           "mamba_chunk_size": "chunk_size"}
DEFAULTS = dict(mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                conv_kernel=4, use_conv_bias=True, time_step_min=0.001, time_step_max=0.1,
                time_step_floor=1e-4, chunk_size=128,  # transformers' NemotronHConfig's
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=7688,
                moe_shared_expert_intermediate_size=7688, norm_topk_prob=True,
                routed_scaling_factor=1.0, n_group=1, topk_group=1)
MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "moe_shared_expert_intermediate_size", "norm_topk_prob",
            "routed_scaling_factor", "n_group", "topk_group", "moe_latent_size")
MOE_INERT = ("n_shared_experts", "moe_shared_expert_overlap", "output_router_logits")
# model.moe.* every Nemotron-H MoE has
MOE_FIXED = {"score": "sigmoid", "score_correction_bias": True, "shared_expert_gate": False,
             "router_bias": False, "expert_bias": False, "swiglu_limit": None,
             "aux_loss_coef": 0.0}


def nemotron_blocks(hf: Dict[str, Any], refuse: Refuse) -> List[str]:
    """The blocks as config.json names them: layers_block_type, or the older
    hybrid_override_pattern; num_hidden_layers (if given) must count them."""
    given = hf.get("layers_block_type")
    key, blocks = ("layers_block_type", given) if given is not None else \
        ("hybrid_override_pattern", list(hf.get("hybrid_override_pattern") or ""))
    if not blocks or not all(isinstance(b, str) for b in blocks):
        refuse(key, hf.get(key), "a Nemotron-H config.json lists its blocks (layers_block_type "
                                 "or hybrid_override_pattern)")
    unknown = sorted({b for b in blocks if b not in BLOCKS})
    if unknown:
        refuse(key, hf.get(key), f"{unknown} blocks are not implemented by ctxpar (it has "
                                 f"Mamba2, attention, MLP and MoE blocks)")
    n = hf.get("num_hidden_layers")
    if n is not None and n != len(blocks):
        refuse("num_hidden_layers", n, f"{key} lists {len(blocks)} blocks")
    return blocks


def moe_fields(hf: Dict[str, Any], sparse: List[int], refuse: Refuse) -> Optional[MoEConfig]:
    """model.moe of the blocks `sparse` that are 'moe' (None when there are none: the MoE
    keys then compute nothing)."""
    if not sparse:
        return None
    if hf.get("moe_latent_size") is not None:
        refuse("moe_latent_size", hf["moe_latent_size"], "a latent projection around the "
               "experts is not implemented by ctxpar")
    e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("n_routed_experts", "num_local_experts"))
    norm = hf.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
    scale = hf.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        refuse("routed_scaling_factor", scale, "config.json must give it as a number > 0")
    groups = integer_field(hf, "n_group", DEFAULTS["n_group"], refuse)
    best = integer_field(hf, "topk_group", DEFAULTS["topk_group"], refuse)
    if e % groups or e // groups < 2:  # transformers scores a group by its two best
        refuse("n_group", groups, f"must divide n_routed_experts={e} into groups of >= 2")
    if best > groups or k > best * (e // groups):
        refuse("topk_group", best, f"must be <= n_group={groups} with room for "
                                   f"num_experts_per_tok={k} in its groups")
    return MoEConfig(num_experts=e, top_k=k, norm_topk=norm,
                     expert_hidden=integer_field(hf, "moe_intermediate_size",
                                                 DEFAULTS["moe_intermediate_size"], refuse),
                     shared_expert_hidden=integer_field(
                         hf, "moe_shared_expert_intermediate_size",
                         DEFAULTS["moe_shared_expert_intermediate_size"], refuse),
                     routed_scaling_factor=float(scale), n_group=groups, topk_group=best,
                     layers=sparse, **MOE_FIXED)


def moe_config(m, refuse_export) -> Dict[str, Any]:
    """config.json's MoE keys of ModelConfig m (its fixed values are MOE_FIXED)."""
    moe = m.moe
    if moe.shared_expert_hidden < 1:
        refuse_export(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden} "
                      f"(Nemotron-H's MoE blocks always have a shared expert)")
    if moe.capacity_factor is not None:
        refuse_export(f"model.moe.capacity_factor={moe.capacity_factor} (transformers' "
                      f"experts drop no token)")
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_hidden or resolved_ffn_hidden(m),
            "moe_shared_expert_intermediate_size": moe.shared_expert_hidden,
            "n_shared_experts": 1, "moe_latent_size": None,
            "norm_topk_prob": moe.norm_topk, "routed_scaling_factor": moe.routed_scaling_factor,
            "n_group": moe.n_group, "topk_group": moe.topk_group,
            "output_router_logits": False}


def _mamba_value(hf: Dict[str, Any], key: str, refuse: Refuse):
    value = hf.get(key, DEFAULTS[key])
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "use_conv_bias":
        ok, want = isinstance(value, bool), "a boolean"
    elif key.startswith("time_step"):
        ok, want = number and value > 0, "a number > 0"
    else:
        ok, want = number and value == int(value) and value >= 1, "an integer >= 1"
    if not ok:
        refuse(key, value, f"config.json must give it as {want}")
    return value


class NemotronH(Family):
    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """Its layer count is its blocks'."""
        return {**hf, "num_hidden_layers": len(nemotron_blocks(hf, refuse))}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Layer types, their count, the MoE blocks' model.moe, the Mamba2 sizes
        (transformers' defaults where config.json has none), the norms' epsilon."""
        hf = {ALIASES.get(k, k): v for k, v in hf.items()}
        blocks = nemotron_blocks(hf, refuse)
        types = [BLOCKS[b] for b in blocks]
        fields: Dict[str, Any] = {
            "layer_types": types, "n_layers": len(types),
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "moe": moe_fields(hf, [i for i, b in enumerate(blocks) if b in MOE_BLOCKS], refuse)}
        if "mamba" in types:
            fields.update({field: _mamba_value(hf, key, refuse)
                           for key, field in MAMBA_KEYS.items()})
        return hf, fields

    def export_layer_types(self, m, refuse_export) -> List[str]:
        types = layer_types(m)
        if m.attention_sinks:
            refuse_export("model.attention_sinks=true")
        if set(types) - set(EXPORT):
            refuse_export(f"model.layer_types={types} (Nemotron-H has {', '.join(EXPORT)} "
                          f"blocks)")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        """Its blocks (NoPE: no RoPE keys; no layer count, its blocks give it), Mamba2
        sizes and MoE keys."""
        drop_rope_keys(cfg)
        for key in ("num_hidden_layers", "rms_norm_eps"):
            cfg.pop(key, None)
        d = mamba_dims(m)
        sparse = moe_layer_indices(m.moe, m.n_layers) if m.moe is not None else []
        if any(types[i] != "mlp" for i in sparse):
            refuse_export(f"model.moe.layers={m.moe.layers} with model.layer_types={types} "
                          f"(Nemotron-H's MoE blocks are MLP blocks)")
        cfg.update({"layers_block_type": ["moe" if i in sparse else EXPORT[t]
                                          for i, t in enumerate(types)],
                    **(moe_config(m, refuse_export) if sparse else {}),
                    "layer_norm_epsilon": m.norm_eps, "mamba_num_heads": d.num_heads,
                    "mamba_head_dim": d.head_dim, "ssm_state_size": d.state_size,
                    "n_groups": d.n_groups, "conv_kernel": d.conv_kernel,
                    "use_conv_bias": d.conv_bias, "time_step_min": d.time_step_min,
                    "time_step_max": d.time_step_max, "time_step_floor": d.time_step_floor,
                    "chunk_size": d.chunk_size, "mamba_hidden_act": "silu", "use_bias": False,
                    "mlp_bias": False, "attention_bias": False, "residual_in_fp32": False})

    def naming(self, m) -> str:
        return "nemotron_h"


FAMILY = NemotronH(
    "nemotron_h", "NemotronHForCausalLM", {**ARCH_DEFAULTS, "mlp": "relu2", "rope": False},
    ("mlp_hidden_act", "relu2"),
    neutral={"attention_bias": (False, "Nemotron-H's attention has no biases"),
             "use_bias": (False, "ctxpar's Mamba2 has in/out projection biases only with "
                                 "model.bias, which attention would take too"),
             "mlp_bias": (False, "ctxpar's MLP biases come with model.bias, which "
                                 "Nemotron-H's attention never has"),
             "mamba_proj_bias": (False, "a Mamba2 projection bias"),
             "mamba_hidden_act": ("silu", "ctxpar's Mamba2 conv activation is silu"),
             "residual_in_fp32": (False, "ctxpar adds the residual in the activations' dtype"),
             "hidden_dropout": (0.0, "ctxpar trains without dropout"),
             "num_nextn_predict_layers": (0, "multi-token prediction layers"),
             "sliding_window": (None, "Nemotron-H's attention has no window")},
    own=("layers_block_type", "hybrid_override_pattern", "num_hidden_layers",
         "layer_norm_epsilon", *MAMBA_KEYS, *ALIASES, *MOE_KEYS),
    inert=(*MOE_INERT,  # read by no transformers code (module docstring)
           "mtp_layers_block_type", "mtp_hybrid_override_pattern",
           "expand",  # transformers sizes Mamba2 by mamba_num_heads x mamba_head_dim
           "time_step_limit", "mamba_dt_limit",  # its mixer clamps at time_step_min
           "mamba_ssm_cache_dtype", "use_mamba_kernels", "num_logits_to_keep",
           "rescale_prenorm_residual"),  # the init's, not the model's
    moe_fixed=MOE_FIXED, moe_optional=True, expert_naming="nemotron")
