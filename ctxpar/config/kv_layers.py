"""Gemma 4's attention and block fields, checked in one place: the full layers' own head
dim and kv heads, values from k_proj, the value norm, K/V shared by the last layers, the
per-layer input embeddings and the layer scalar (ModelConfig's docstrings say what each
computes; config.layers.layer_attention resolves them per layer).

    layer                 head_dim          kv heads            V                K/V
    sliding_attention     head_dim          n_kv_heads          v_proj x         its own
    full_attention        global_head_dim   global_n_kv_heads   k_proj x (k_eq_v) its own
    one of the last       its type's        its type's          -                kv_sources'
      num_kv_shared_layers                                                           (MLP 2x wide
                                                                                     under
                                                                                     double_wide_mlp)
"""
from __future__ import annotations

from .dsa import indexer_loss_travels
from .layer_mixers import layer_types
from .sections import ModelConfig, ParallelConfig, resolved_ffn_hidden


def _whole(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def uses_kv_layers(m: ModelConfig) -> bool:
    """Whether the model has any of the fields of this file away from its default."""
    return bool(m.global_head_dim or m.global_n_kv_heads or m.attention_k_eq_v or
                m.value_norm or m.num_kv_shared_layers or m.per_layer_input_dim or
                m.layer_scalar or m.double_wide_mlp)


def layer_ffn_hidden(m: ModelConfig, kv_source) -> int:
    """A layer's dense MLP width: model.ffn_hidden, twice that on a layer that shares K/V
    (kv_source: its LayerAttention's) under model.double_wide_mlp (Gemma 4)."""
    return resolved_ffn_hidden(m) * (2 if m.double_wide_mlp and kv_source is not None else 1)


def carries_between_stages(m: ModelConfig) -> bool:
    """Whether a pipeline stage hands on more than x, tensors taking a gradient: shared K/V
    or per-layer inputs (models/pipe_carry.py), model.moe's routers' statistics
    (models/gpt_pipe.py router_start), model.dsa's indexer sums (models/dsa_pipe.py)."""
    return bool(m.num_kv_shared_layers or m.per_layer_input_dim or m.moe is not None
                or indexer_loss_travels(m.dsa))


def check_kv_layers(m: ModelConfig, p: ParallelConfig, err) -> None:
    """One line per field through err (validation's), before any collective."""
    if not uses_kv_layers(m):
        return
    types = layer_types(m)
    for key in ("global_head_dim", "global_n_kv_heads"):
        v = getattr(m, key)
        if v is not None and not _whole(v, 1):
            err(f"model.{key}={v!r} must be an integer >= 1 (or null: the model's)")
    for key in ("attention_k_eq_v", "value_norm", "layer_scalar", "double_wide_mlp"):
        if not isinstance(getattr(m, key), bool):
            err(f"model.{key}={getattr(m, key)!r} must be true or false")
    for key in ("num_kv_shared_layers", "per_layer_input_dim"):
        if not _whole(getattr(m, key), 0):
            err(f"model.{key}={getattr(m, key)!r} must be an integer >= 0 (0: none)")
    full = [k for k in ("global_head_dim", "global_n_kv_heads", "attention_k_eq_v")
            if getattr(m, k) not in (None, False)]
    if full and "full_attention" not in types:
        err(f"model.{full[0]} is set but no layer in model.layer_types is 'full_attention': "
            f"it would be ignored")
    if m.mla is not None or set(types) - {"full_attention", "sliding_attention"}:
        err(f"model.{(full or ['num_kv_shared_layers'])[0]} and the other Gemma 4 fields take "
            f"'full_attention' and 'sliding_attention' layers of MHA/GQA (no model.mla, "
            f"linear or chunked layers)")
    if m.global_head_dim is not None and (m.partial_rotary_factor != 1.0 or
                                          m.global_head_dim % 2):
        err(f"model.global_head_dim={m.global_head_dim} needs an even head and "
            f"model.partial_rotary_factor=1 (partial RoPE there is rope_scaling's "
            f"'proportional')")
    if m.global_head_dim is not None and m.query_pre_attn_scalar is None:
        err(f"model.global_head_dim={m.global_head_dim} needs model.query_pre_attn_scalar: "
            f"one softmax scale for heads of two sizes (Gemma 4's is 1)")
    kv = m.global_n_kv_heads
    if kv is not None and _whole(kv, 1) and (m.n_heads % kv or (kv % p.tp and p.tp % kv)):
        err(f"model.global_n_kv_heads={kv} must divide model.n_heads={m.n_heads} and divide "
            f"over parallel.tp={p.tp} or be replicated (tp % kv == 0)")
    shared = m.num_kv_shared_layers
    if _whole(shared, 1):
        first = m.n_layers - shared
        missing = sorted(set(types[first:]) - set(types[:max(first, 0)]))
        if shared >= m.n_layers or missing:
            err(f"model.num_kv_shared_layers={shared}: each of the last {shared} layers "
                f"needs an earlier layer of its type to share K/V with (none for "
                f"{missing or 'all layers'})")
    if shared and (m.qk_norm_scope != "head" or m.qk_l2_norm or not m.rope or m.nope_layers):
        err(f"model.num_kv_shared_layers={shared} takes per-head q/k norms and RoPE on "
            f"every layer (no qk_norm_scope 'all_heads', qk_l2_norm or NoPE layers)")
    if (shared or m.per_layer_input_dim) and m.mtp is not None:
        err("model.mtp with model.num_kv_shared_layers or model.per_layer_input_dim: the "
            "MTP block has no shared K/V or per-layer input")
    if m.double_wide_mlp is True and not _whole(shared, 1):
        err(f"model.double_wide_mlp=true needs model.num_kv_shared_layers > 0 (got "
            f"{shared}): it widens those layers' dense MLP only")
    if m.moe is not None and not m.moe.beside_mlp:
        err("model.moe with the Gemma 4 fields needs model.moe.beside_mlp=true: Gemma 4's "
            "experts sit beside the dense MLP (enable_moe_block)")

