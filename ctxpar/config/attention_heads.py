"""What one attention layer's heads are when they differ by layer type: its K/V heads
(model.layer_kv_heads), its sinks (model.attention_sinks as a list of layer types), and
the value heads' width (model.v_head_dim) with their scale (model.attention_value_scale).

    a = layer_attention(m)[i]; n_kv = parameters.layer_kv_heads(m, a)  # type_kv_heads'
    sinks_on(m, a.kind)                                              # this layer's sinks

A type's K/V count reaches every layer as LayerAttention.n_kv_heads (config.layers), the
one per-layer carrier Gemma 4's global_n_kv_heads shares, so the attention module, the
parameters' description, the KV cache and the planner read one count (MiMo-V2-Flash: 8
K/V heads and sinks on its sliding layers, 4 and none on its full ones).
"""
from __future__ import annotations

from typing import Optional

from .layer_mixers import LAYER_MIXERS, LAYER_TYPES, layer_types
from .sections import ModelConfig, resolved_head_dim


def type_kv_heads(m: ModelConfig, kind: Optional[str]) -> Optional[int]:
    """K/V heads of a layer of type kind when its type has its own count (None: the
    model's n_kv_heads): model.layer_kv_heads' (MiMo-V2-Flash), or Gemma 4's
    model.global_n_kv_heads on 'full_attention' layers. config.layers.layer_attention
    carries it per layer as LayerAttention.n_kv_heads (parameters.layer_kv_heads reads it)."""
    own = (m.layer_kv_heads or {}).get(kind)
    if own is None and kind == "full_attention":
        own = m.global_n_kv_heads
    return own


def kv_heads_of(m: ModelConfig, kind: Optional[str] = None) -> int:
    """K/V heads of a layer of type kind: its type's (type_kv_heads), else n_kv_heads
    (else n_heads)."""
    return type_kv_heads(m, kind) or m.n_kv_heads or m.n_heads


def sinks_on(m: ModelConfig, kind: Optional[str] = None) -> bool:
    """Whether a layer of type kind has attention sinks (model.attention_sinks: true,
    false or a list of layer types)."""
    sinks = m.attention_sinks
    return kind in sinks if isinstance(sinks, list) else bool(sinks)


def v_head_dim_of(m: ModelConfig) -> int:
    """Channels per value head of a layer at the model's head dim: model.v_head_dim, else
    head_dim (a layer's own: parameters.layer_v_head_dim)."""
    return m.v_head_dim if m.v_head_dim is not None else resolved_head_dim(m)


def check_attention_heads(m: ModelConfig, tp: int, err) -> None:
    """model.layer_kv_heads, attention_sinks (a list), v_head_dim and
    attention_value_scale, one line each through err (validation's)."""
    attention = [t for t in LAYER_TYPES if LAYER_MIXERS[t][0] == "attention"]
    kinds = set(layer_types(m))
    for kind, heads in (m.layer_kv_heads or {}).items():
        if kind not in attention:
            err(f"model.layer_kv_heads: unknown layer type {kind!r}; choose from the types "
                f"with attention {attention}")
        if kind not in kinds:
            err(f"model.layer_kv_heads.{kind} is set but no layer is {kind!r}: it would be "
                f"ignored")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or \
                m.n_heads % heads:
            err(f"model.layer_kv_heads.{kind}={heads!r} must be an integer >= 1 dividing "
                f"model.n_heads={m.n_heads}")
        elif kind == "full_attention" and m.global_n_kv_heads is not None:
            err(f"model.layer_kv_heads.full_attention={heads} with model.global_n_kv_heads="
                f"{m.global_n_kv_heads}: two counts for the full layers' K/V heads; set one")
        elif heads % tp and tp % heads:
            err(f"model.layer_kv_heads.{kind}={heads} and parallel.tp={tp}: kv heads must "
                f"divide over tp (kv % tp == 0) or be replicated (tp % kv == 0)")
    if m.layer_kv_heads is not None and (m.mla is not None or m.qk_norm_scope == "all_heads"):
        err(f"model.layer_kv_heads={m.layer_kv_heads} with "
            f"{'model.mla' if m.mla is not None else 'model.qk_norm_scope=all_heads'}: "
            f"per-type K/V heads are built for plain GQA attention")
    sinks = m.attention_sinks
    if isinstance(sinks, list) and (not sinks or set(sinks) - set(attention)):
        err(f"model.attention_sinks={sinks!r} must be true, false or a non-empty list of "
            f"layer types with attention {attention}")
    elif isinstance(sinks, list) and set(sinks) - kinds:
        err(f"model.attention_sinks={sinks!r} names a layer type no layer is: it would be "
            f"ignored")
    v = m.v_head_dim
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        err(f"model.v_head_dim={v!r} must be an integer >= 1 (or null: head_dim)")
    elif v is not None and m.mla is None and v > resolved_head_dim(m):
        err(f"model.v_head_dim={v} must be <= head_dim={resolved_head_dim(m)} (V travels "
            f"zero-padded to the keys' width)")
    if v is not None and m.mla is not None:
        err(f"model.v_head_dim={v} with model.mla: MLA's value width is model.mla.v_head_dim")
    if v is not None and (m.attention_k_eq_v or m.global_head_dim is not None):
        err(f"model.v_head_dim={v} with Gemma 4's "
            f"{'attention_k_eq_v' if m.attention_k_eq_v else 'global_head_dim'}: values "
            f"as wide as the keys there (V from k_proj, or the full layers' own head dim)")
    if v is not None and v != resolved_head_dim(m) and m.attention_output_gate:
        err(f"model.v_head_dim={v} with model.attention_output_gate=true: the gate is "
            f"head_dim wide")
    scale = m.attention_value_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        err(f"model.attention_value_scale={scale!r} must be a number > 0 (1: none)")
