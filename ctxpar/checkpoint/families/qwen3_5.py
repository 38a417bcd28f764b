"""Qwen3.5 (``qwen3_5_text``, Qwen3_5ForCausalLM; the multimodal ``qwen3_5`` folders'
language model): Gated DeltaNet and gated full-attention layers, (1 + w) norms, q/k
norms, partial RoPE. The Gated DeltaNet's keys are read here for its lineage too
(qwen3_next.py, olmo_hybrid.py).

    config.json                    ctxpar model.*
    layer_types                    layer_types ('linear_attention', 'full_attention')
      (or full_attention_interval: every n-th layer full, transformers' default 4)
    linear_num_key_heads           linear_num_key_heads
    linear_num_value_heads         linear_num_value_heads
    linear_key_head_dim            linear_key_head_dim
    linear_value_head_dim          linear_value_head_dim
    linear_conv_kernel_dim         linear_conv_kernel_dim
    rope_parameters.partial_rotary_factor   partial_rotary_factor (RoPE on the attention
                                   layers only: the linear layers have no positions)

Qwen3.5's multimodal RoPE keys (rope_parameters' mrope_section, mrope_interleaved) are
read as plain RoPE: a text-only sequence gives its three position streams (time, height,
width) the same ids, so every frequency turns by the same angle whichever stream it is
taken from. model.linear_chunk_size is ctxpar's (the chunked kernel's block, a rounding
choice only), never in config.json.

The released folders' multi-token prediction layers (mtp.*, mtp_num_hidden_layers of
them) are ctxpar's model.mtp with shared_projection (one fc and its norms for every
depth, as vLLM's Qwen3.5 MTP reads them), [embedding; hidden] into fc, full attention
and the dense MLP in each layer (qwen3_next.py's: their experts, model.mtp.moe):

    mtp.pre_fc_norm_embedding.weight   mtp.layers.0.enorm.weight
    mtp.pre_fc_norm_hidden.weight      mtp.layers.0.hnorm.weight
    mtp.fc.weight                      mtp.layers.0.eh_proj.weight
    mtp.layers.{k}.<a block's names>   mtp.layers.{k}.block.<GPT's block names>
    mtp.norm.weight                    mtp.layers.0.norm.weight

With model.mtp set they are imported, trained and exported under these names; with
model.mtp null they are left out, as transformers' causal LMs drop them on loading
(_keys_to_ignore_on_load_unexpected), the start-up line says so and the export writes
none. transformers builds no MTP layer for these families (its MtpLayer is the reference).
"""
from __future__ import annotations

import re

from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

from ...config.layers import gated_delta_dims, layer_types
from ...config.mtp import MTPConfig
from ..rope_config import drop_rope_keys
from .base import ARCH_DEFAULTS, NO_BIAS, Family, Refuse

LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads",
                         "linear_key_head_dim", "linear_value_head_dim",
                         "linear_conv_kernel_dim")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # plain RoPE on text (module docstring)
HYBRID_LAYER_TYPES = ("linear_attention", "full_attention")
MTP_KEYS = ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
MTP_PREFIX = "mtp."
# model.mtp's generic Hugging Face names (checkpoint/names.py) -> Qwen's shared ones
MTP_SHARED = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
              "norm": "norm"}
_MTP_OWN = re.compile(r"^mtp\.layers\.0\.(enorm|hnorm|eh_proj|norm)\.weight$")
# Qwen3.5's layers: (1 + w) norms, q/k norms, the attention's sigmoid output gate
QWEN3_5_FIXED = {**ARCH_DEFAULTS, "norm_offset": 1.0, "qk_norm": True,
                 "attention_output_gate": True}


def qwen3_5_layer_types(hf: Dict[str, Any], refuse: Refuse) -> List[str]:
    """layer_types as Qwen3_5TextConfig reads them: given, or every
    full_attention_interval-th layer full attention, the rest Gated DeltaNet."""
    n, types = hf["num_hidden_layers"], hf.get("layer_types")
    if types is None:
        every = hf.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n or set(types) - set(HYBRID_LAYER_TYPES):
        refuse("layer_types", types, f"one of {', '.join(map(repr, HYBRID_LAYER_TYPES))} per "
                                     f"layer ({n})")
    return types


def linear_attention_fields(hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
    """model.* of a Qwen3.5-lineage config.json's layers: the layer types and, when a
    layer is Gated DeltaNet, its sizes (transformers' defaults where config.json has none)."""
    types = qwen3_5_layer_types(hf, refuse)
    fields: Dict[str, Any] = {"layer_types": types}
    if "linear_attention" not in types:
        return fields
    defaults = dict(linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4)  # Qwen3_5TextConfig's
    for key in LINEAR_ATTENTION_KEYS:
        value = hf.get(key, defaults[key])
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            refuse(key, value, "config.json must give it as an integer >= 1")
        fields[key] = value
    return fields


def linear_attention_config(m, types: List[str]) -> Dict[str, Any]:
    """config.json's layer types and Gated DeltaNet sizes of ModelConfig m, from the
    resolved sizes (config.layers.gated_delta_dims)."""
    g = gated_delta_dims(m)
    return {"layer_types": types, "linear_num_key_heads": g.num_key_heads,
            "linear_num_value_heads": g.num_value_heads,
            "linear_key_head_dim": g.key_head_dim, "linear_value_head_dim": g.value_head_dim,
            "linear_conv_kernel_dim": g.conv_kernel}


def qwen3_5_rope(hf: Dict[str, Any]) -> Tuple[Dict[str, Any], float]:
    """(config.json without the RoPE keys read here, partial_rotary_factor): Qwen3.5 keeps
    the factor in rope_parameters (0.25 by default there) beside the multimodal keys,
    which are plain RoPE on text (module docstring)."""
    params = dict(hf.get("rope_parameters") or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    for key in MROPE_KEYS:
        params.pop(key, None)
    rest = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    return {**rest, "rope_parameters": params or None}, float(partial)


def hybrid_layer_types(fam: Family, m, refuse_export: Callable[[str], None],
                       both: bool = False) -> List[str]:
    """A Gated DeltaNet hybrid's layers: linear_attention and full_attention only (both
    present when `both`), no sinks."""
    types = layer_types(m)
    if m.attention_sinks:
        refuse_export("model.attention_sinks=true")
    if set(types) - set(HYBRID_LAYER_TYPES) or (both and set(types) != set(HYBRID_LAYER_TYPES)):
        refuse_export(f"model.layer_types={types} ({fam.label} has "
                      f"{' and '.join(HYBRID_LAYER_TYPES)} layers{', both' if both else ''})")
    return types


class Qwen3_5(Family):
    # its MTP layers' MLP: a dense one (Qwen3.5), the experts (Qwen3-Next, Qwen3.5-MoE)
    mtp_moe: ClassVar[bool] = False

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        kinds = linear_attention_fields(hf, refuse)
        hf, kinds["partial_rotary_factor"] = qwen3_5_rope(hf)
        return hf, kinds

    def export_layer_types(self, m, refuse_export) -> List[str]:
        return hybrid_layer_types(self, m, refuse_export)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        drop_rope_keys(cfg)  # written here, with the partial factor
        cfg.update(attention_bias=False, **linear_attention_config(m, types),
                   rope_parameters={**(m.rope_scaling or {"rope_type": "default"}),
                                    "rope_theta": m.rope_theta,
                                    "partial_rotary_factor": m.partial_rotary_factor})

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        return key.startswith(MTP_PREFIX)

    def folder_key(self, key: str) -> str:
        own = _MTP_OWN.match(key)
        return f"mtp.{MTP_SHARED[own.group(1)]}.weight" if own else key

    def to_folder(self, key: str, t, m):
        return super().to_folder(self.folder_key(key), t, m)

    def mtp(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[MTPConfig]:
        depth = hf.get("mtp_num_hidden_layers", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            refuse("mtp_num_hidden_layers", depth, "config.json must give it as an integer >= 0")
        if hf.get("mtp_use_dedicated_embeddings", False):
            refuse("mtp_use_dedicated_embeddings", True, "MTP layers with an embedding of "
                                                         "their own are not implemented")
        return MTPConfig(depth=depth, shared_projection=True, moe=self.mtp_moe) if depth \
            else None

    def export_mtp(self, cfg: Dict[str, Any], m, refuse_export) -> None:
        mtp = m.mtp
        if mtp is None:
            return
        if not mtp.shared_projection or mtp.hidden_first or \
                mtp.layer_type != "full_attention" or mtp.moe != self.mtp_moe:
            refuse_export(f"model.mtp={mtp} ({self.label}'s MTP layers share one fc, take "
                          f"[embedding; hidden] and are full attention: shared_projection="
                          f"true, hidden_first=false, layer_type=full_attention, moe="
                          f"{str(self.mtp_moe).lower()})")
        cfg.update(mtp_num_hidden_layers=mtp.depth, mtp_use_dedicated_embeddings=False)


FAMILY = Qwen3_5(
    "qwen3_5_text", "Qwen3_5ForCausalLM", dict(QWEN3_5_FIXED), ("hidden_act", "silu"),
    neutral={"attention_bias": (False, NO_BIAS)},
    own=("layer_types", "full_attention_interval", *LINEAR_ATTENTION_KEYS),
    inert=MTP_KEYS)  # read by the mtp hook where model.mtp asks (module docstring)
