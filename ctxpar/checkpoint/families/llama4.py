"""Llama 4 (``llama4_text``, Llama4ForCausalLM; the text model of Scout and Maverick):
chunked attention with RoPE on most layers, full attention without RoPE (NoPE) on the
others, whose queries are scaled by position (temperature tuning), a weightless q/k norm
after RoPE, and on the MoE layers a top-k sigmoid router whose weight scales each
expert's input, beside an always-on shared expert.

    config.json                            ctxpar model.*
    no_rope_layers (1: RoPE; or every      nope_layers (the 0s' indices)
      no_rope_layer_interval-th NoPE)
    layer_types, attention_chunk_size      layer_types, attention_chunk_size (transformers'
                                           default: the RoPE layers chunked)
    attn_temperature_tuning, floor_scale,  attn_temperature_tuning, floor_scale, attn_scale
      attn_scale                           (false when no layer is NoPE: it scales nothing)
    use_qk_norm                            qk_l2_norm (on the RoPE layers)
    intermediate_size_mlp                  ffn_hidden (the dense layers' MLP)
    intermediate_size                      moe.expert_hidden = moe.shared_expert_hidden
    num_local_experts, num_experts_per_tok moe.num_experts, moe.top_k
    moe_layers (or every                   moe.layers (none: a dense model, no model.moe)
      interleave_moe_layer_step-th)
    (fixed)                                moe.score sigmoid, norm_topk false,
                                           scale_expert_input, the shared expert ungated

Tensors: the blocks' MLP is ``feed_forward`` (its router ``feed_forward.router``); the
experts are stored fused and transposed (x @ W): gate_up_proj (E, d, 2f) with [gate | up]
halves, down_proj (E, f, d). transformers' Llama 4 rotates the channel pairs (2i, 2i + 1)
(complex RoPE), ctxpar the pairs (i, i + hd/2): q_proj's and k_proj's rows are permuted
within each head on import and back on export (the NoPE layers' too: the same
permutation of q and k leaves q.k, and the weightless norm, unchanged).
Llama4ForCausalLM adds no router loss (output_router_logits, router_aux_loss_coef inert)
and reads no router_jitter_noise (inert).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config import resolved_ffn_hidden, resolved_head_dim
from ...config.layers import layer_types
from ...config.moe import MoEConfig, moe_layer_indices
from .base import ARCH_DEFAULTS, Family, Refuse
from .experts import experts_and_top_k, integer_field

DEFAULTS = dict(num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192,
                attn_scale=0.1)  # transformers' Llama4TextConfig's
MOE_FIXED = {"score": "sigmoid", "norm_topk": False, "scale_expert_input": True,
             "shared_expert_gate": False, "score_correction_bias": False,
             "router_bias": False, "expert_bias": False, "swiglu_limit": None,
             "aux_loss_coef": 0.0, "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 1.0}
OWN = ("no_rope_layers", "no_rope_layer_interval", "layer_types", "attention_chunk_size",
       "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm",
       "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
       "interleave_moe_layer_step")
NAMES = ((".mlp.gate.", ".feed_forward.router."), (".mlp.", ".feed_forward."))
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")
_QK = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
       "self_attn.k_proj.bias")


def pairs_to_halves(hd: int) -> torch.Tensor:
    """ctxpar channel c of a head <- transformers' channel: its pair (2i, 2i + 1) becomes
    (i, i + hd/2)."""
    return torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])


def permute_heads(t: torch.Tensor, hd: int, order: torch.Tensor) -> torch.Tensor:
    """Rows (heads x hd, ...) reordered within each head."""
    return t.reshape(-1, hd, *t.shape[1:])[:, order].reshape(t.shape).contiguous()


def _flag_list(hf: Dict[str, Any], key: str, n: int, refuse: Refuse) -> List[int]:
    value = hf[key]
    if not isinstance(value, list) or len(value) != n or set(value) - {0, 1}:
        refuse(key, value, f"one 0 or 1 per layer ({n})")
    return value


def llama4_moe(hf: Dict[str, Any], refuse: Refuse) -> Optional[MoEConfig]:
    """model.moe of a Llama 4 config.json (None when no layer has experts)."""
    n = hf["num_hidden_layers"]
    layers = hf.get("moe_layers")
    if layers is None:
        step = integer_field(hf, "interleave_moe_layer_step", 1, refuse)
        layers = list(range(step - 1, n, step))
    if not isinstance(layers, list) or any(not isinstance(i, int) or not 0 <= i < n
                                           for i in layers):
        refuse("moe_layers", layers, f"a list of layer indices in [0, {n})")
    if not layers:
        return None
    e, k = experts_and_top_k(hf, DEFAULTS, refuse, ("num_local_experts", "num_experts"))
    width = hf["intermediate_size"]
    return MoEConfig(num_experts=e, top_k=k, expert_hidden=width, shared_expert_hidden=width,
                     layers=None if len(set(layers)) == n else sorted(set(layers)),
                     **MOE_FIXED)


class Llama4(Family):
    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        return {**self.fixed, "moe": llama4_moe(hf, refuse)}

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """The dense layers' width is intermediate_size_mlp (intermediate_size the
        experts')."""
        return {**hf, "intermediate_size": hf.get("intermediate_size_mlp", 16384)}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """NoPE layers, chunks, layer types and temperature tuning as Llama4TextConfig's
        __post_init__ derives them; the q/k norm."""
        n = hf["num_hidden_layers"]
        if hf.get("no_rope_layers"):
            rope = _flag_list(hf, "no_rope_layers", n, refuse)
        else:
            every = integer_field(hf, "no_rope_layer_interval", 4, refuse)
            rope = [int((i + 1) % every != 0) for i in range(n)]
        nope = [i for i in range(n) if not rope[i]]
        chunk = hf.get("attention_chunk_size", DEFAULTS["attention_chunk_size"])
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                                  or chunk < 1):
            refuse("attention_chunk_size", chunk, "a number of tokens >= 1, or null")
        types = hf.get("layer_types") or [
            "chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
        if not isinstance(types, list) or len(types) != n or \
                set(types) - {"full_attention", "chunked_attention"} or \
                ("chunked_attention" in types and chunk is None):
            refuse("layer_types", types, f"one of 'full_attention', 'chunked_attention' per "
                                         f"layer ({n}), chunks with an attention_chunk_size")
        tuning = hf.get("attn_temperature_tuning", True)
        floor = integer_field(hf, "floor_scale", DEFAULTS["floor_scale"], refuse)
        scale = hf.get("attn_scale", DEFAULTS["attn_scale"])
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale < 0:
            refuse("attn_scale", scale, "config.json must give it as a number >= 0")
        for key, value in (("attn_temperature_tuning", tuning),
                           ("use_qk_norm", hf.get("use_qk_norm", True))):
            if not isinstance(value, bool):
                refuse(key, value, "config.json must give it as a boolean")
        chunked = "chunked_attention" in types
        return hf, {
            "nope_layers": nope or None, "attention_chunk_size": chunk if chunked else None,
            "layer_types": None if set(types) == {"full_attention"} or
            set(types) == {"chunked_attention"} else types,
            "attn_temperature_tuning": tuning and bool(nope), "floor_scale": floor,
            "attn_scale": float(scale),
            "qk_l2_norm": hf.get("use_qk_norm", True) and len(nope) < n}

    def export_layer_types(self, m, refuse_export) -> List[str]:
        """Full and chunked layers (no window, sinks or linear mixers), every channel
        turned on the RoPE layers, one RoPE for all."""
        types = layer_types(m)
        if m.attention_sinks:
            refuse_export("model.attention_sinks=true")
        if set(types) - {"full_attention", "chunked_attention"}:
            refuse_export(f"model.layer_types={types} (Llama 4 has full and chunked layers)")
        if m.partial_rotary_factor != 1.0 or not m.rope or m.layer_rope:
            refuse_export(f"model.partial_rotary_factor={m.partial_rotary_factor}, rope="
                          f"{m.rope}, layer_rope={m.layer_rope} (Llama 4 turns every channel "
                          f"of its RoPE layers, NoPE ones given by model.nope_layers)")
        return types

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe, n = m.moe, m.n_layers
        nope = set(m.nope_layers or ())
        cfg.update(
            intermediate_size_mlp=resolved_ffn_hidden(m), layer_types=types,
            no_rope_layers=[0 if i in nope else 1 for i in range(n)], no_rope_layer_interval=4,
            attention_chunk_size=m.attention_chunk_size,
            attn_temperature_tuning=m.attn_temperature_tuning, floor_scale=m.floor_scale,
            attn_scale=m.attn_scale, use_qk_norm=m.qk_l2_norm, attention_bias=False,
            router_jitter_noise=0.0, output_router_logits=False, moe_layers=[],
            interleave_moe_layer_step=1)
        if moe is None:
            return
        width = moe.expert_hidden or resolved_ffn_hidden(m)
        if moe.shared_expert_hidden != width or moe.capacity_factor is not None:
            refuse_export(f"model.moe.shared_expert_hidden={moe.shared_expert_hidden}, "
                          f"capacity_factor={moe.capacity_factor} (Llama 4's shared expert is "
                          f"as wide as its experts, {width}; its experts drop no token)")
        cfg.update(intermediate_size=width, num_local_experts=moe.num_experts,
                   num_experts_per_tok=moe.top_k, moe_layers=moe_layer_indices(moe, n))

    def naming(self, m) -> str:
        return "default"

    def folder_key(self, key: str) -> str:
        for ours, theirs in NAMES:
            key = key.replace(ours, theirs)
        return key

    def folder_shape(self, key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return (shape[0], shape[2], shape[1]) if key.endswith(_TRANSPOSED) else shape

    def from_folder(self, key: str, t: torch.Tensor, hf: Dict[str, Any]) -> torch.Tensor:
        if key.endswith(_TRANSPOSED):
            return t.transpose(1, 2).contiguous()
        if key.endswith(_QK):
            hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            return permute_heads(t, hd, pairs_to_halves(hd))
        return t

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        key = self.folder_key(key)
        if key.endswith(_TRANSPOSED):
            return [(key, t.transpose(1, 2).contiguous())]
        if key.endswith(_QK):
            hd = resolved_head_dim(m)
            return [(key, permute_heads(t, hd, torch.argsort(pairs_to_halves(hd))))]
        return [(key, t)]


FAMILY = Llama4(
    "llama4_text", "Llama4ForCausalLM",
    {k: v for k, v in ARCH_DEFAULTS.items()
     if k not in ("nope_layers", "attn_temperature_tuning", "qk_l2_norm")},
    ("hidden_act", "silu"), default_theta=500_000.0,
    neutral={"attention_bias": (False, "Llama 4's biases are on o_proj too: ctxpar has q/k/v "
                                       "biases without o_proj's")},
    own=OWN,
    inert=("output_router_logits", "router_aux_loss_coef",  # Llama4ForCausalLM adds no loss
           "router_jitter_noise"),  # read by no Llama 4 code
    moe_fixed=MOE_FIXED, moe_optional=True)
