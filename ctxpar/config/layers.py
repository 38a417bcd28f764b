"""What each layer is: its token mixer and channel mixer, its attention's window or chunks,
its RoPE; and the linear mixers' sizes.

    for i, a in enumerate(layer_attention(cfg.model)):
        mask = AttentionMask(causal=True, sliding_window=a.sliding_window,
                             chunk_size=a.chunk_size, cu_seqlens=cu)

The model, the planner and generation read the per-layer kinds from here, so a layer
type means one thing everywhere. transformers' names: model.layer_types lists one of
LAYER_TYPES per layer; unset, every layer is 'sliding_attention' when model.sliding_window
is set, 'chunked_attention' when model.attention_chunk_size is, else 'full_attention'.

Two families of blocks (layer_mixers.LAYER_MIXERS: the token mixer, the channel mixer):

    full_attention, sliding_attention,   norm, attention, residual; norm, MLP, residual
    chunked_attention                    (Llama, Qwen, Mistral, Gemma)
    linear_attention                     the same with Gated DeltaNet in place of
                                         attention (Qwen3-Next, Qwen3.5)
    mamba                                norm, Mamba2, residual: no MLP (Nemotron-H)
    attention                            norm, full causal attention, residual: no MLP
    mlp                                  norm, MLP, residual: no token mixer

The last three are Nemotron-H's single-op blocks under the names its configs wrote
(hybrid_override_pattern 'M', '*', '-'); transformers 5 reads Nemotron-H's 'mamba' as
'linear_attention' and 'attention' as 'full_attention', names that here mean Qwen's
two-op blocks, so a Nemotron-H import renames them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# ATTENTION_TYPES: importable from here too (the Hugging Face import reads it here)
from .layer_mixers import (ATTENTION_TYPES, LAYER_MIXERS, LAYER_TYPES,  # noqa: F401
                           WINDOWED_TYPES, attention_mixer, layer_types)
from .attention_heads import type_kv_heads
from .sections import ModelConfig, resolved_head_dim

DELTA_TYPES = ("linear_attention", "kimi_delta_attention")  # the linear_* fields' layers
GDN_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim")
MAMBA_FIELDS = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                "conv_kernel", "use_conv_bias", "time_step_min", "time_step_max",
                "time_step_floor")


@dataclass(frozen=True)
class LayerAttention:
    kind: str                        # one of LAYER_TYPES
    sliding_window: Optional[int]    # 'sliding_attention' only
    chunk_size: Optional[int]        # 'chunked_attention' only
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    rope: bool = True                # RoPE on q and k (model.rope, model.nope_layers)
    # NoPE layers under model.attn_temperature_tuning: (floor_scale, attn_scale)
    temperature: Optional[Tuple[int, float]] = None
    attention: str = "attention"     # what an attention layer runs: ATTENTION_MIXERS'
    has_indexer: bool = True         # 'dsa': its own indexer (False: model.dsa's 'shared')
    # Per-layer shapes: a layer type's own kv heads (attention_heads.type_kv_heads:
    # MiMo's model.layer_kv_heads, Gemma 4's global_n_kv_heads; None: the model's); Gemma
    # 4's (kv_layers.py) 'full_attention' head dim, values from k_proj (attention_k_eq_v),
    # the earlier layer whose K/V it attends with (model.num_kv_shared_layers; None: its own)
    # and whether later layers attend with its K/V (a producer: models/attention.py's
    # keeps_shared_kv)
    head_dim: Optional[int] = None
    n_kv_heads: Optional[int] = None
    k_eq_v: bool = False
    kv_source: Optional[int] = None
    keeps_shared_kv: bool = False

    @property
    def token_mixer(self) -> Optional[str]:
        """'attention' (or 'mla', 'dsa' under model.mla, model.dsa), 'gated_delta', 'mamba2' or None
        (LAYER_MIXERS)."""
        token = LAYER_MIXERS[self.kind][0]
        return self.attention if token == "attention" else token

    @property
    def channel_mixer(self) -> Optional[str]:
        """'mlp' or None."""
        return LAYER_MIXERS[self.kind][1]


@dataclass(frozen=True)
class GatedDeltaDims:
    """A Gated DeltaNet layer's sizes (model.linear_*, unset ones resolved)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk_size: int
    allow_neg_eigval: bool = False   # beta in [0, 2] (model.linear_allow_neg_eigval)
    norm_eps: float = 1e-6           # the gated output norm's (model.linear_norm_eps)


@dataclass(frozen=True)
class MambaDims:
    """A Mamba2 layer's sizes (model.mamba_*, ssm_state_size, ..., unset ones resolved)."""
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    time_step_min: float
    time_step_max: float
    time_step_floor: float
    chunk_size: int


def _or(value, default):
    return default if value is None else value


def gated_delta_dims(m: ModelConfig) -> GatedDeltaDims:
    key_heads = _or(m.linear_num_key_heads, m.n_heads)
    key_dim = _or(m.linear_key_head_dim, resolved_head_dim(m))
    return GatedDeltaDims(key_heads, _or(m.linear_num_value_heads, key_heads), key_dim,
                          _or(m.linear_value_head_dim, key_dim),
                          _or(m.linear_conv_kernel_dim, 4), _or(m.linear_chunk_size, 64),
                          bool(m.linear_allow_neg_eigval), _or(m.linear_norm_eps, m.norm_eps))


def mamba_dims(m: ModelConfig) -> MambaDims:
    return MambaDims(_or(m.mamba_num_heads, m.n_heads), _or(m.mamba_head_dim,
                                                              resolved_head_dim(m)),
                     _or(m.ssm_state_size, 128), _or(m.n_groups, 1), _or(m.conv_kernel, 4),
                     _or(m.use_conv_bias, True), _or(m.time_step_min, 0.001),
                     _or(m.time_step_max, 0.1), _or(m.time_step_floor, 1e-4),
                     _or(m.linear_chunk_size, 64))


def layer_attention(m: ModelConfig) -> List[LayerAttention]:
    """Every layer's attention (validated configs: config.validation checks the fields)."""
    key = (tuple(m.layer_types) if m.layer_types is not None else m.n_layers,
           m.sliding_window, m.attention_chunk_size, m.rope_theta, repr(m.layer_rope),
           repr(m.rope_scaling), m.rope, repr(m.nope_layers), m.attn_temperature_tuning,
           m.floor_scale, m.attn_scale, m.mla is not None, repr(m.dsa), m.global_head_dim,
           m.global_n_kv_heads, m.attention_k_eq_v, m.num_kv_shared_layers,
           repr(m.layer_kv_heads))
    if key not in _LAYER_ATTENTION:  # once per model: the planner asks per candidate
        out, sources = [], kv_sources(m)
        for i, kind in enumerate(layer_types(m)):
            full = kind == "full_attention"
            rope = (m.layer_rope or {}).get(kind, {})
            turned = m.rope and i not in (m.nope_layers or ())
            out.append(LayerAttention(
                kind,
                m.sliding_window if kind in WINDOWED_TYPES else None,
                m.attention_chunk_size if kind == "chunked_attention" else None,
                float(rope.get("rope_theta", m.rope_theta)),
                rope["rope_scaling"] if "rope_scaling" in rope else m.rope_scaling,
                turned, None if turned or not m.attn_temperature_tuning
                else (m.floor_scale, float(m.attn_scale)),
                attention_mixer(m), m.dsa is None or m.dsa.layer_has_indexer(i),
                m.global_head_dim if full else None, type_kv_heads(m, kind),
                bool(m.attention_k_eq_v) and full, sources.get(i), i in sources.values()))
        _LAYER_ATTENTION[key] = tuple(out)
    return list(_LAYER_ATTENTION[key])


_LAYER_ATTENTION: dict = {}  # layer_attention's: the fields it reads -> every layer's


def kv_sources(m: ModelConfig) -> Dict[int, int]:
    """{layer: the layer whose K/V it attends with} of the last model.num_kv_shared_layers
    layers: the last earlier layer of its type before them (transformers' Gemma 4
    kv_sharing_modes); a type without one is missing (kv_layers.check_kv_layers refuses)."""
    types = layer_types(m)
    first = len(types) - (m.num_kv_shared_layers or 0)
    own = {t: i for i, t in enumerate(types[:first])}  # each type's last computing layer
    return {i: own[types[i]] for i in range(max(first, 0), len(types)) if types[i] in own}


def mtp_layer_attention(m: ModelConfig) -> LayerAttention:
    """The MTP block's attention (model.mtp.layer_type), with the RoPE, window or chunks
    the model's layers of that type have; MLA under model.mla, as theirs."""
    kind = m.mtp.layer_type
    rope = (m.layer_rope or {}).get(kind, {})
    return LayerAttention(kind, m.sliding_window if kind == "sliding_attention" else None,
                          m.attention_chunk_size if kind == "chunked_attention" else None,
                          float(rope.get("rope_theta", m.rope_theta)),
                          rope["rope_scaling"] if "rope_scaling" in rope else m.rope_scaling,
                          attention="mla" if m.mla is not None else "attention",
                          n_kv_heads=type_kv_heads(m, kind))


def check_layers(m: ModelConfig, err) -> None:
    """model.sliding_window, attention_chunk_size, layer_types and layer_rope, one line
    each through err (validation's)."""
    for key in ("sliding_window", "attention_chunk_size"):
        v = getattr(m, key)
        if v is not None and v < 1:
            err(f"model.{key}={v} must be >= 1 (or null: none)")
    if m.layer_types is None:
        if m.sliding_window is not None and m.attention_chunk_size is not None:
            err(f"model.sliding_window={m.sliding_window} and model.attention_chunk_size="
                f"{m.attention_chunk_size} both set: say which layers take which in "
                f"model.layer_types")
        kinds = set(layer_types(m))
    else:
        if len(m.layer_types) != m.n_layers:
            err(f"model.layer_types has {len(m.layer_types)} entries; model.n_layers="
                f"{m.n_layers} needs one per layer")
        bad = sorted({t for t in m.layer_types if t not in LAYER_TYPES})
        if bad:
            err(f"model.layer_types: unknown type(s) {bad}; choose from {list(LAYER_TYPES)}")
        kinds = set(m.layer_types)
        for types, key in ((WINDOWED_TYPES, "sliding_window"),
                           (("chunked_attention",), "attention_chunk_size")):
            kind = types[0]
            if kind in kinds and getattr(m, key) is None:
                err(f"model.layer_types has {kind!r} layers but model.{key} is not set")
            if not kinds & set(types) and getattr(m, key) is not None:
                err(f"model.{key}={getattr(m, key)} is set but no layer in "
                    f"model.layer_types is {kind!r}: it would be ignored")
    check_linear_fields(m, kinds, err)
    check_reordered_norms(m, kinds, err)
    roped = [t for t in LAYER_TYPES if LAYER_MIXERS[t][0] == "attention"]
    for kind, rope in (m.layer_rope or {}).items():
        if kind not in roped:
            err(f"model.layer_rope: unknown layer type {kind!r}; choose from the types with "
                f"attention {roped}")
        if not isinstance(rope, dict) or set(rope) - {"rope_theta", "rope_scaling"}:
            err(f"model.layer_rope.{kind}={rope!r} must be a mapping of rope_theta and/or "
                f"rope_scaling")
        theta = rope.get("rope_theta", m.rope_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            err(f"model.layer_rope.{kind}.rope_theta={theta!r} must be a number > 0")
        if kind not in kinds:
            err(f"model.layer_rope.{kind} is set but no layer is {kind!r}: it would be "
                f"ignored")


def check_reordered_norms(m: ModelConfig, kinds: set, err) -> None:
    """model.reordered_norms: a list of the model's layer types, not beside model.post_norms
    (Gemma's norms on both sides of each mixer)."""
    if m.reordered_norms is None:
        return
    if not isinstance(m.reordered_norms, list) or set(m.reordered_norms) - kinds:
        err(f"model.reordered_norms={m.reordered_norms!r} must list layer types the model "
            f"has ({sorted(kinds)})")
    if m.moe is not None:
        err("model.reordered_norms with model.moe: the experts' blocks are pre-norm")
    if m.post_norms:
        err("model.reordered_norms and model.post_norms=true both set: a block norms its "
            "mixers' outputs only (OLMo 2) or both sides (Gemma), not both")


def check_linear_fields(m: ModelConfig, kinds: set, err) -> None:
    """The Gated DeltaNet, KDA and Mamba2 fields: sizes >= 1, heads that group, and none
    set without a layer to use them. The CP and TP rules: config.validation._check_linear_cp."""
    delta = kinds & set(DELTA_TYPES)
    users = " or ".join(repr(t) for t in DELTA_TYPES)
    for used, fields, names in ((delta, GDN_FIELDS, users),
                                ("mamba" in kinds, MAMBA_FIELDS, "'mamba'")):
        if not used:
            for key in fields:
                if getattr(m, key) is not None:
                    err(f"model.{key}={getattr(m, key)} is set but no layer in "
                        f"model.layer_types is {names}: it would be ignored")
    for key, unset in (("linear_allow_neg_eigval", False), ("linear_norm_eps", None)):
        if getattr(m, key) != unset and not delta:
            err(f"model.{key}={getattr(m, key)} is set but no layer in model.layer_types is "
                f"{users}: it would be ignored")
    if not isinstance(m.linear_allow_neg_eigval, bool):
        err(f"model.linear_allow_neg_eigval={m.linear_allow_neg_eigval!r} must be true or false")
    eps = m.linear_norm_eps
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))
                            or eps <= 0):
        err(f"model.linear_norm_eps={eps!r} must be a number > 0 (or null: model.norm_eps)")
    if m.linear_chunk_size is not None and not kinds & {*DELTA_TYPES, "mamba"}:
        err(f"model.linear_chunk_size={m.linear_chunk_size} is set but no layer in "
            f"model.layer_types is {users} or 'mamba': it would be ignored")
    for key in GDN_FIELDS + MAMBA_FIELDS[:5] + ("linear_chunk_size",):
        v = getattr(m, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            err(f"model.{key}={v!r} must be an integer >= 1 (or null: its default)")
    for key in MAMBA_FIELDS[6:]:
        v = getattr(m, key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or v <= 0):
            err(f"model.{key}={v!r} must be a number > 0 (or null: its default)")
    if delta:
        g = gated_delta_dims(m)
        if g.num_value_heads % g.num_key_heads:
            err(f"model.linear_num_value_heads={g.num_value_heads} is not a multiple of "
                f"model.linear_num_key_heads={g.num_key_heads}")
    if "mamba" in kinds:
        d = mamba_dims(m)
        if d.num_heads % d.n_groups:
            err(f"model.mamba_num_heads={d.num_heads} is not divisible by "
                f"model.n_groups={d.n_groups}")
        if d.time_step_max < d.time_step_min:
            err(f"model.time_step_max={d.time_step_max} < model.time_step_min="
                f"{d.time_step_min}")
