"""DeepSeek-V4 (``deepseek_v4``, DeepseekV4ForCausalLM): compressed attention in every layer
(model.compressed_attention: sliding, CSA and HCA layers), manifold-constrained
hyper-connections (model.hyper_connections), experts on every layer routed by
sqrt(softplus) with a correction bias, the first ones by a token-id table
(model.moe.hash_layers), SwiGLU clamped (model.swiglu_limit).

    config.json                            ctxpar model.*
    q_lora_rank, o_groups, o_lora_rank,    compressed_attention.* (same names)
      index_n_heads, index_head_dim,
      index_topk, compress_rates
    layer_types, sliding_window            layer_types, sliding_window (every layer's)
    rope_parameters.main                   rope_theta (the sliding layers')
    rope_parameters.compress               layer_rope of the CSA and HCA layers
      (each's partial_rotary_factor)       partial_rotary_factor (one for both)
    (flat form) rope_theta,                as DeepseekV4Config.__post_init__ nests them
      compress_rope_theta,
      partial_rotary_factor
    n_routed_experts, num_experts_per_tok  moe.num_experts, top_k
    moe_intermediate_size                  moe.expert_hidden = shared_expert_hidden
                                           (transformers' intermediate_size reads it)
    routed_scaling_factor                  moe.routed_scaling_factor
    mlp_layer_types                        moe.hash_layers: the 'hash_moe' layers
    scoring_func sqrtsoftplus              moe.score (the only router checked here)
    swiglu_limit                           swiglu_limit (experts and shared expert)
    hc_mult, hc_sinkhorn_iters, hc_eps     hyper_connections.streams, sinkhorn_iters, eps

Inert: norm_topk_prob (both V4 routers always normalise the top-k), qk_rope_head_dim
(the runtime width its class derives from partial_rotary_factor), num_nextn_predict_layers
(the MTP layers transformers does not build; a folder's ``mtp.*`` tensors are left out,
said at start-up). Refused away from transformers' computation: n_shared_experts != 1
(DeepseekV4MLP is one shared expert whatever it says), a YaRN compress RoPE (not checked
here), other routers.

Tensors: save_pretrained writes DeepSeek's own names (transformers' conversion_mapping
for deepseek_v4, reversed), e.g. ``model.layers.{i}.attn.wq_a``, ``attn.compressor.wkv``,
``attn.indexer.compressor.ape``, ``ffn.experts.{j}.w1``, ``ffn.gate.bias``,
``hc_attn_fn``, ``head.weight``; ``folder_key`` maps transformers' module names (names.py's
'deepseek_v4' naming) onto them in that order.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from ...config.compressed_attention import CompressedAttentionConfig
from ...config.hyper_connections import HyperConnectionsConfig
from ...config.moe import MoEConfig, hash_layers, moe_layer_indices
from ..rope_config import drop_rope_keys, rope_of
from .base import ARCH_DEFAULTS, Family, Refuse
from .experts import experts_and_top_k, integer_field, per_expert_tensors

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
ATTENTION_KEYS = ("q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
                  "index_head_dim", "index_topk")
HC_KEYS = ("hc_mult", "hc_sinkhorn_iters", "hc_eps")  # -> hyper_connections.*
ROPE_OWN = ("rope_theta", "compress_rope_theta", "partial_rotary_factor", "qk_rope_head_dim")
DEFAULTS = dict(q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_n_heads=64,
                index_head_dim=128, index_topk=512, n_routed_experts=256,
                num_experts_per_tok=6, moe_intermediate_size=2048,
                routed_scaling_factor=1.5, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
                swiglu_limit=10.0, sliding_window=128, rope_theta=10000.0,
                compress_rope_theta=160000.0, partial_rotary_factor=64 / 512,
                router_aux_loss_coef=0.001)  # DeepseekV4Config's
# transformers' state-dict names -> the folder's (conversion_mapping's deepseek_v4 reversed),
# applied in order: the indexer's and the shared expert's before the general ones
_TO_FOLDER = tuple((re.compile(a), b) for a, b in (
    (r"^lm_head\.weight$", "head.weight"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm.")))


def _number(hf, key, refuse: Refuse, low: Optional[float] = 0.0) -> float:
    """config.json's number `key` (its class's default when absent), > low (None: >= 0)."""
    value = hf.get(key, DEFAULTS[key])
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not (value >= 0 if low is None else value > low):
        refuse(key, value, "config.json must give it as a number " +
               (">= 0" if low is None else f"> {low:g}"))
    return float(value)


def _rope_parameters(hf: Dict[str, Any], refuse: Refuse):
    """(main, compress, partial_rotary_factor): the RoPE parameters of the sliding and the
    compressed layers without their partial_rotary_factor (one for both), from the nested
    form or nested from the flat one as DeepseekV4Config.__post_init__ does."""
    rp = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        refuse("rope_scaling", hf["rope_scaling"], "DeepSeek-V4 reads its RoPE from "
               "rope_parameters (main / compress) or rope_theta and compress_rope_theta")
    top = hf.get("partial_rotary_factor")
    if top is None:
        top = (hf["qk_rope_head_dim"] / hf.get("head_dim", 512) if "qk_rope_head_dim" in hf
               else DEFAULTS["partial_rotary_factor"])
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0),
                "partial_rotary_factor": top}
        compress = {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                    "rope_theta": hf.get("compress_rope_theta", 160000.0),
                    "partial_rotary_factor": top}
    for label, params in (("main", main), ("compress", compress)):
        if params.get("rope_type", params.get("type", "default")) != "default":
            refuse(f"rope_parameters.{label}", params, "ctxpar reads DeepSeek-V4's "
                   "default RoPE only (its YaRN on the compressed layers is not checked "
                   "against transformers here)")
    partial = {main.pop("partial_rotary_factor", 1.0), compress.pop("partial_rotary_factor",
                                                                        1.0)}
    if len(partial) != 1:
        refuse("rope_parameters", rp, "one partial_rotary_factor for main and compress "
                                          "(ctxpar's model.partial_rotary_factor)")
    return main, compress, float(partial.pop())


class DeepSeekV4(Family):
    """The hooks: config.json's V4 keys both ways (module docstring), the folder's names."""

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """transformers' intermediate_size is moe_intermediate_size (its attribute_map)."""
        f = integer_field(hf, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"], refuse)
        if hf.get("intermediate_size", f) != f:
            refuse("intermediate_size", hf["intermediate_size"], f"names moe_intermediate_size"
                                                                 f"={f} (its attribute_map)")
        return {**hf, "intermediate_size": f}

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        n = hf["num_hidden_layers"]
        rates = hf.get("compress_rates") or {k: v for k, v in (
            ("compressed_sparse_attention", 4), ("heavily_compressed_attention", 128))}
        if not isinstance(rates, dict) or set(rates) != set(KINDS[1:]):
            refuse("compress_rates", rates, f"one rate for each of {list(KINDS[1:])}")
        attention = CompressedAttentionConfig(
            **{k: integer_field(hf, k, DEFAULTS[k], refuse) for k in ATTENTION_KEYS},
            compress_rates=dict(rates))
        hc = HyperConnectionsConfig(
            streams=integer_field(hf, "hc_mult", DEFAULTS["hc_mult"], refuse),
            sinkhorn_iters=integer_field(hf, "hc_sinkhorn_iters", DEFAULTS["hc_sinkhorn_iters"],
                                         refuse),
            eps=_number(hf, "hc_eps", refuse, low=None))
        return {**self.fixed, "compressed_attention": attention, "hyper_connections": hc,
                "swiglu_limit": _number(hf, "swiglu_limit", refuse),
                "moe": self._moe(hf, n, refuse)}

    def _moe(self, hf: Dict[str, Any], n: int, refuse: Refuse) -> MoEConfig:
        if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            refuse("scoring_func", hf["scoring_func"], "ctxpar reads DeepSeek-V4's "
                   "sqrtsoftplus router only (its others are not checked against transformers)")
        if hf.get("output_router_logits", False) is not False:
            refuse("output_router_logits", hf["output_router_logits"], "the load-balancing "
                   "loss is the softmax routers' in ctxpar (V4 routes by sqrtsoftplus)")
        e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("n_routed_experts", "num_local_experts"))
        f = integer_field(hf, "moe_intermediate_size", DEFAULTS["moe_intermediate_size"], refuse)
        mlp = hf.get("mlp_layer_types")
        if mlp is None:  # DeepseekV4Config's default: three hash-routed layers first
            mlp = ["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)
        if not isinstance(mlp, list) or len(mlp) != n or set(mlp) - {"hash_moe", "moe"}:
            refuse("mlp_layer_types", mlp, f"one of 'hash_moe', 'moe' per layer ({n})")
        hashed = [i for i, t in enumerate(mlp) if t == "hash_moe"]
        return MoEConfig(num_experts=e, top_k=k, expert_hidden=f, norm_topk=True,
                         shared_expert_hidden=f, shared_expert_gate=False,
                         routed_scaling_factor=_number(hf, "routed_scaling_factor", refuse),
                         score="sqrtsoftplus", score_correction_bias=True,
                         hash_layers=hashed or None)

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:  # DeepseekV4Config's default: two HCA, then CSA / HCA in turn
            types = ["heavily_compressed_attention"] * min(n, 2) + [
                KINDS[1] if i % 2 else KINDS[2] for i in range(max(n - 2, 0))]
        if not isinstance(types, list) or len(types) != n or set(types) - set(KINDS):
            refuse("layer_types", types, f"one of {list(KINDS)} per layer ({n})")
        window = integer_field(hf, "sliding_window", DEFAULTS["sliding_window"], refuse)
        main, compress, partial = _rope_parameters(hf, refuse)
        # their partial_rotary_factor read above: none left for rope_of to find
        theta, _ = rope_of(main, {}, file, DEFAULTS["rope_theta"])
        compress_theta, _ = rope_of(compress, {}, file, DEFAULTS["compress_rope_theta"])
        layer_rope = {k: {"rope_theta": compress_theta} for k in KINDS[1:] if k in types}
        left = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_theta",
                                                         "rope_scaling", "partial_rotary_factor")}
        left["rope_theta"] = theta
        return left, {"layer_types": types, "sliding_window": window,
                      "layer_rope": layer_rope or None,
                      "partial_rotary_factor": partial}

    # --------------------------------------------------------------- write config.json

    def export_layer_types(self, m, refuse_export) -> List[str]:
        from ...config.layers import layer_types
        types = layer_types(m)
        if m.compressed_attention is None or set(types) - set(KINDS):
            refuse_export(f"model.layer_types={types} (DeepSeek-V4's layers are {list(KINDS)} "
                          f"under model.compressed_attention)")
        if m.hyper_connections is None or m.swiglu_limit is None:
            refuse_export(f"model.hyper_connections={m.hyper_connections} with "
                          f"model.swiglu_limit={m.swiglu_limit} (DeepSeek-V4 always has mHC "
                          f"and a SwiGLU limit)")
        rope = m.layer_rope or {}
        thetas = {float(rope.get(k, {}).get("rope_theta", m.rope_theta)) for k in KINDS[1:]
                  if k in types}
        if len(thetas) > 1 or any(r.get("rope_scaling") for r in rope.values()) or \
                m.rope_scaling:
            refuse_export(f"model.layer_rope={m.layer_rope} with rope_scaling={m.rope_scaling} "
                          f"(DeepSeek-V4: one default RoPE for the sliding layers, one for "
                          f"the compressed ones)")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe = m.moe
        if moe.shared_expert_hidden != moe.expert_hidden or \
                moe_layer_indices(moe, m.n_layers) != list(range(m.n_layers)) or \
                moe.capacity_factor is not None or not moe.norm_topk:
            refuse_export(f"model.moe={moe} (DeepSeek-V4: experts on every layer, one "
                          f"shared expert of their width, the top-k normalised, dropless)")
        drop_rope_keys(cfg)
        cfg.pop("intermediate_size")  # its attribute_map: moe_intermediate_size
        compress = float(next((r["rope_theta"] for r in (m.layer_rope or {}).values()
                               if "rope_theta" in r), m.rope_theta))
        main = {"rope_type": "default", "rope_theta": float(m.rope_theta),
                "partial_rotary_factor": m.partial_rotary_factor}
        a, hc, hashed = m.compressed_attention, m.hyper_connections, set(hash_layers(moe))
        cfg.update({k: getattr(a, k) for k in ATTENTION_KEYS},
                   compress_rates=dict(a.compress_rates), layer_types=list(types),
                   sliding_window=m.sliding_window, rope_theta=float(m.rope_theta),
                   compress_rope_theta=compress, partial_rotary_factor=m.partial_rotary_factor,
                   rope_parameters={"main": main, "compress": {**main, "rope_theta": compress}},
                   n_routed_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.expert_hidden, n_shared_experts=1,
                   routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=True,
                   scoring_func="sqrtsoftplus", swiglu_limit=m.swiglu_limit,
                   mlp_layer_types=["hash_moe" if i in hashed else "moe"
                                    for i in range(m.n_layers)],
                   hc_mult=hc.streams, hc_sinkhorn_iters=hc.sinkhorn_iters, hc_eps=hc.eps,
                   num_nextn_predict_layers=0, output_router_logits=False)

    # ----------------------------------------------------------------- tensors' names

    def naming(self, m) -> str:
        return "deepseek_v4"

    def folder_key(self, key: str) -> str:
        for pattern, repl in _TO_FOLDER:
            key = pattern.sub(repl, key)
        return key

    def to_folder(self, key: str, t, m):
        return per_expert_tensors(self.folder_key(key), t, self.expert_naming)

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        """A released folder's multi-token prediction layers (``mtp.*``)."""
        return key.startswith("mtp.")


_FIXED = {k: v for k, v in ARCH_DEFAULTS.items() if k != "compressed_attention"}
FAMILY = DeepSeekV4(
    "deepseek_v4", "DeepseekV4ForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    neutral={"attention_bias": (False, "biases on V4's projections are not built by ctxpar"),
             "mlp_bias": (False, "biases on V4's MLPs are not built by ctxpar"),
             "router_jitter_noise": (0.0, "router noise is not built by ctxpar"),
             "n_shared_experts": (1, "transformers' DeepseekV4MLP is one shared expert of "
                                     "moe_intermediate_size, whatever this says")},
    own=(*ATTENTION_KEYS, "compress_rates", "layer_types", "sliding_window", *ROPE_OWN,
         "n_routed_experts", "num_local_experts", "num_experts_per_tok",
         "moe_intermediate_size", "routed_scaling_factor", "mlp_layer_types", "scoring_func",
         "swiglu_limit", *HC_KEYS, "output_router_logits"),
    inert=("norm_topk_prob", "num_nextn_predict_layers", "router_aux_loss_coef"),
    moe_fixed={"score": "sqrtsoftplus", "score_correction_bias": True, "norm_topk": True,
               "shared_expert_gate": False, "aux_loss_coef": 0.0},
    expert_naming="deepseek_v4")
