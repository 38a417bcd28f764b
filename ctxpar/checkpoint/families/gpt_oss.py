"""gpt-oss (``gpt_oss``, GptOssForCausalLM): alternating sliding and full layers with
sinks, biases on q/k/v/o, a mixture of experts on every layer with a router bias, expert
biases and the clamped SwiGLU (experts.py's common keys; swiglu_limit, swiglu_alpha).

Tensors: the router is ``mlp.router``; the experts are stored transposed (x @ W) with
[gate | up] interleaved column by column: gate_up_proj (E, d, 2f), its bias (E, 2f),
down_proj (E, f, d) (transformers' GptOssExperts, fused in its folders too). Its released
folders hold the experts in MXFP4 (checkpoint/mxfp4.py reads them when a family says
``mxfp4``), dequantized as transformers does; the export is bf16 or fp32, unquantized.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config.moe import MoEConfig
from .base import ARCH_DEFAULTS, Family, Refuse, attention_layers
from .experts import aux_loss_coef, experts_and_top_k, router_loss_keys
from .mixtral import MOE_KEYS as MIXTRAL_MOE_KEYS

DEFAULTS = dict(num_experts=128, num_experts_per_tok=4, router_aux_loss_coef=0.001,
                swiglu_limit=7.0, swiglu_alpha=1.702)
ROUTER = ("mlp.gate.", "mlp.router.")  # ctxpar's name, the folder's
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")


def gpt_oss_from_hf(key: str, t: torch.Tensor) -> torch.Tensor:
    """A gpt-oss tensor in ctxpar's layout ((E, 2f, d) [gate | up], (E, d, f))."""
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        t = t.transpose(1, 2) if t.dim() == 3 else t          # (E, 2f, d) or (E, 2f)
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
    if key.endswith("experts.down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


def gpt_oss_to_hf(key: str, t: torch.Tensor) -> torch.Tensor:
    """gpt_oss_from_hf's inverse."""
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        gate, up = t.chunk(2, dim=1)
        t = torch.stack([gate, up], dim=2).flatten(1, 2)      # rows interleaved
        return t.transpose(1, 2).contiguous() if t.dim() == 3 else t.contiguous()
    if key.endswith("experts.down_proj"):
        return t.transpose(1, 2).contiguous()
    return t


class GptOss(Family):
    mxfp4 = True
    sinks = True

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        quant = hf.get("quantization_config")
        if quant and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
            refuse("quantization_config", quant, "gpt-oss's MXFP4 experts are read; no other "
                                                 "quantization is implemented by ctxpar")
        e, k = experts_and_top_k(hf, DEFAULTS, refuse)
        limit, alpha = (hf.get(key, DEFAULTS[key]) for key in ("swiglu_limit", "swiglu_alpha"))
        for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                refuse(key, value, "config.json must give it as a number > 0")
        # the softmax over the top-k logits is softmax-then-normalised top-k
        return {**self.fixed, "moe": MoEConfig(
            num_experts=e, top_k=k, expert_hidden=hf["intermediate_size"], norm_topk=True,
            router_bias=True, expert_bias=True, swiglu_limit=float(limit),
            swiglu_alpha=float(alpha), aux_loss_coef=aux_loss_coef(hf, DEFAULTS, refuse))}

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        n, types = hf["num_hidden_layers"], hf.get("layer_types")
        if types is None:  # every other layer sliding from the first
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(n)]
        return hf, attention_layers(hf, types, hf.get("sliding_window", 128), refuse)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        moe = m.moe
        if moe.layers is not None or (moe.expert_hidden or m.ffn_hidden) != m.ffn_hidden or \
                moe.swiglu_limit is None:
            refuse_export(f"model.moe={moe} (gpt-oss's experts are on every layer, "
                          f"model.ffn_hidden wide, with the clamped SwiGLU)")
        sliding = "sliding_attention" in types
        cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
                   **router_loss_keys(moe, DEFAULTS, source), layer_types=types,
                   attention_bias=True,
                   sliding_window=m.sliding_window if sliding else None)

    def folder_key(self, key: str) -> str:
        return key.replace(*ROUTER) if ROUTER[0] in key else key

    def folder_shape(self, key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        return (shape[0], shape[2], shape[1]) if key.endswith(_TRANSPOSED) else shape

    def from_folder(self, key: str, t: torch.Tensor, hf: Dict[str, Any]) -> torch.Tensor:
        return gpt_oss_from_hf(key, t)

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        return [(self.folder_key(key), gpt_oss_to_hf(key, t))]


FAMILY = GptOss(
    "gpt_oss", "GptOssForCausalLM", {**ARCH_DEFAULTS, "bias": True, "attention_sinks": True},
    ("hidden_act", "silu"), default_theta=150_000.0,
    neutral={"attention_bias": (True, "ctxpar's gpt-oss has biases on q/k/v/o (model.bias)")},
    own=("layer_types", "sliding_window", "quantization_config", *MIXTRAL_MOE_KEYS,
         "swiglu_limit", "swiglu_alpha"),
    # its released config.json's own names, read by no transformers gpt-oss code (it
    # reads num_experts_per_tok and rope_parameters' original_max_position_embeddings)
    inert=("experts_per_token", "initial_context_length"),
    moe_fixed={"shared_expert_hidden": 0, "norm_topk": True, "layers": None,
               "router_bias": True, "expert_bias": True})
