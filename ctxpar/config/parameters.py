"""The parameters a ModelConfig describes: every tensor's GPT name, full shape and TP split.

    specs = parameter_specs(m)                         # the whole model, in GPT's order
    numel = sum(s.numel(tp) for s in block_specs(m))   # one block on one TP rank

The one description of the model's shapes: models/gpt.py checks every module it builds
against it (``check_parameters``, at construction, on any device and TP degree), and the
planner counts parameters, optimizer state and ZeRO shards from it (ctxpar/plan/counts.py),
so a change of the model that the planner does not know fails at the model's construction
instead of drifting its predictions.

TP split, as the TP layers make it (ctxpar/tensor_parallel/layers.py):

    column   split along dim 0 (q/k/v, gate/up, the embedding's and head's vocabulary
             rows; their biases too; the attention sinks, one per query head; the linear
             mixers' projections, convs and per-head vectors, a fused one part by part)
    row      split along dim 1 (o_proj, down_proj, out_proj); their biases replicated
    heads    k/v with fewer kv heads than TP ranks: each rank holds every kv head
             (ReplicatedHeadLinear), the full shape
    None     replicated (norms)
"""
from __future__ import annotations

from operator import attrgetter
from typing import Iterable, List, Optional, Tuple

from .compressed_layers import compressed_attention_specs
from .param_spec import ParamSpec, linear_specs as _linear
from .layer_mixers import LAYER_MIXERS, first_layer_type, layer_types, token_mixer_of
from .attention_heads import sinks_on
from .layers import (GDN_FIELDS, MAMBA_FIELDS, LayerAttention, gated_delta_dims, kv_sources,
                     layer_attention, mamba_dims, mtp_layer_attention)
from .kv_layers import layer_ffn_hidden
from .moe import moe_layer_indices
from .sections import GATED_MLPS, ModelConfig, resolved_ffn_hidden, resolved_head_dim


def head_dim(m: ModelConfig) -> int:
    return resolved_head_dim(m)


def kv_heads_per_rank(m: ModelConfig, tp: int, n_kv: Optional[int] = None) -> int:
    """K/V heads one TP rank computes: Hkv/tp, or 1 when Hkv < tp (each rank then uses the
    kv head of its query heads, from the replicated projection); n_kv: a layer's own Hkv
    (layer_kv_heads), else the model's."""
    n_kv = n_kv or m.n_kv_heads or m.n_heads
    return n_kv // tp if n_kv % tp == 0 else 1


def _norm(name: str, m: ModelConfig, dim: Optional[int] = None) -> List[ParamSpec]:
    specs = [ParamSpec(f"{name}.weight", (dim or m.d_model,), None)]
    if m.norm == "layernorm" and m.bias:
        specs.append(ParamSpec(f"{name}.bias", (m.d_model,), None))
    return specs


def block_fields(m: ModelConfig) -> tuple:
    """The fields block_specs(m, 0) reads (a cache key: the planner's search asks per
    candidate, over configs that differ in seq_len and the like): block 0's mixers and the
    linear mixers' sizes among them."""
    return (*_BLOCK_FIELDS(m), LAYER_MIXERS[first_layer_type(m)],
            None if m.moe is None else repr(m.moe), repr(m.reordered_norms), repr(m.mla),
            repr(m.layer_kv_heads), repr(m.attention_sinks), repr(m.dsa),
            repr(m.hyper_connections), repr(m.compressed_attention),
            # V4's three types share LAYER_MIXERS' entry, not their parameters
            first_layer_type(m) if m.compressed_attention is not None else None)


# block_fields' model fields: the attention's and MLP's, the linear mixers' sizes, conv bias
_BLOCK_FIELDS = attrgetter("d_model", "n_heads", "n_kv_heads", "ffn_hidden", "mlp", "norm",
                           "bias", "attention_bias", "qk_norm", "qk_norm_scope",
                           "head_dim", "v_head_dim",
                           "post_norms", "attention_output_gate", "global_head_dim",
                           "global_n_kv_heads", "attention_k_eq_v", "num_kv_shared_layers",
                           "per_layer_input_dim", "double_wide_mlp", *GDN_FIELDS,
                           *MAMBA_FIELDS[:6])


def block_specs(m: ModelConfig, i: int = 0, tp: int = 1) -> List[ParamSpec]:
    """Block i's parameters, by its layer type (config.layers.LAYER_MIXERS): the token
    mixer's norm and parameters, the post norm, then the MLP's. tp decides only whether
    k/v are split (n_kv_heads % tp == 0) or replicated by heads."""
    moe = i in moe_layer_indices(m.moe, m.n_layers)
    kind = layer_types(m)[i]
    specs = _layer_specs(m, kind, f"layers.{i}.", moe, tp, i) + \
        _hyper_connection_specs(m, kind, f"layers.{i}.")
    if m.dsa is not None and not m.dsa.layer_has_indexer(i):  # 'shared': no indexer
        return [s for s in specs if ".indexer." not in s.name]
    return specs


def _layer_specs(m: ModelConfig, kind: str, p: str, moe: bool, tp: int,
                 i: Optional[int] = None) -> List[ParamSpec]:
    """A Block's parameters under prefix p: its layer type's mixers, a mixture of experts
    in its MLP's place where moe, the per-layer input's gate (model.per_layer_input_dim);
    i: its index (None: an MTP block, its type's shapes)."""
    token, channel = token_mixer_of(m, kind), LAYER_MIXERS[kind][1]
    reordered = kind in (m.reordered_norms or ())  # outputs normed, not inputs (OLMo 2)
    specs = _norm(p + "attn_norm", m) if token and not reordered else []
    if token:
        name, mixer_specs = TOKEN_MIXER_PARAMETERS[token]
        specs += mixer_specs(m, f"{p}{name}.", tp, i)
    if (m.post_norms or reordered) and token:
        specs += _norm(p + "post_attn_norm", m)
    # the dense MLP's width: twice model.ffn_hidden on a layer sharing K/V under
    # model.double_wide_mlp (Gemma 4; an MTP block, i None, shares none)
    ffn = layer_ffn_hidden(m, None if i is None else kv_sources(m).get(i))
    if channel and moe:
        return specs + _moe_specs(m, p, ffn) + _per_layer_input_specs(m, p)
    if channel and reordered:
        return specs + _dense_mlp(m, p + "mlp.", ffn) + _norm(p + "post_mlp_norm", m)
    return specs + (_mlp_specs(m, p, ffn) if channel else []) + _per_layer_input_specs(m, p)


def _hyper_connection_specs(m: ModelConfig, kind: str, p: str) -> List[ParamSpec]:
    """models/hyper_connections.py's maps of a block (model.hyper_connections; replicated
    over TP): one per sublayer it has, attn_hc before mlp_hc, after the block's own."""
    if m.hyper_connections is None:
        return []
    n, specs = m.hyper_connections.streams, []
    for name, present in (("attn_hc", token_mixer_of(m, kind)), ("mlp_hc", LAYER_MIXERS[kind][1])):
        if present:
            specs += [ParamSpec(f"{p}{name}.fn", ((2 + n) * n, n * m.d_model), None),
                      ParamSpec(f"{p}{name}.base", ((2 + n) * n,), None),
                      ParamSpec(f"{p}{name}.scale", (3,), None)]
    return specs


def _per_layer_input_specs(m: ModelConfig, p: str) -> List[ParamSpec]:
    """models/per_layer_input.py's gate of a block (replicated over TP)."""
    if not m.per_layer_input_dim:
        return []
    dim = m.per_layer_input_dim
    return (_linear(p + "per_layer_input.input_gate", m.d_model, dim, None, False) +
            _linear(p + "per_layer_input.projection", dim, m.d_model, None, False) +
            _norm(p + "per_layer_input.norm", m))


def _moe_specs(m: ModelConfig, p: str, ffn: int) -> List[ParamSpec]:
    """models/moe.py's parameters (transformers' Qwen3-MoE / Qwen3-Next names): the router
    (replicated; Gemma 4's scales under scaled_router), the experts (over EP by expert, over
    TP by width), the shared expert (a dense MLP) and its gate; under beside_mlp the dense
    MLP (ffn wide) and its three norms (models/moe_beside_mlp.py)."""
    moe, d = m.moe, m.d_model
    f, e = moe.expert_hidden or resolved_ffn_hidden(m), moe.num_experts
    rows = 2 * f if m.mlp in GATED_MLPS else f
    specs = _norm(p + "mlp_norm", m) + _linear(p + "mlp.gate", d, e, None, moe.router_bias)
    if moe.scaled_router:
        specs += [ParamSpec(p + "mlp.gate.scale", (d,), None),
                  ParamSpec(p + "mlp.gate.per_expert_scale", (e,), None)]
    specs += [ParamSpec(p + "mlp.experts.gate_up_proj", (e, rows, d), "experts_column"),
              ParamSpec(p + "mlp.experts.down_proj", (e, d, f), "experts_row")]
    if moe.expert_bias:
        specs += [ParamSpec(p + "mlp.experts.gate_up_proj_bias", (e, rows), "experts_bias"),
                  ParamSpec(p + "mlp.experts.down_proj_bias", (e, d), "experts_bias")]
    if moe.shared_expert_hidden:
        specs += _dense_mlp(m, p + "mlp.shared_expert.", moe.shared_expert_hidden)
    if moe.shared_expert_gate:
        specs += _linear(p + "mlp.shared_expert_gate", d, 1, None, False)
    if moe.beside_mlp:
        specs += _dense_mlp(m, p + "mlp.dense.", ffn) + _norm(p + "mlp.dense_norm", m) + \
            _norm(p + "mlp.experts_norm", m) + _norm(p + "mlp.post_experts_norm", m)
    return specs + (_norm(p + "post_mlp_norm", m) if m.post_norms else [])


def _gated_delta_specs(m: ModelConfig, p: str, tp: int = 1, i=None) -> List[ParamSpec]:
    """models/gated_delta.py's parameters (transformers' Qwen3_5GatedDeltaNet names) in
    named_parameters' order (a module's own before its children's); split over TP by
    heads, as attention (in_proj_qkv and the conv by [q | k | v] section, each part's
    rows column-wise), the gated norm's (Dv,) weight replicated."""
    g = gated_delta_dims(m)
    key, value, hv = (g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim,
                      g.num_value_heads)
    return [ParamSpec(p + "dt_bias", (hv,), "column"), ParamSpec(p + "A_log", (hv,), "column"),
            *_linear(p + "in_proj_qkv", m.d_model, 2 * key + value, "column", False),
            *_linear(p + "in_proj_z", m.d_model, value, "column", False),
            *_linear(p + "in_proj_b", m.d_model, hv, "column", False),
            *_linear(p + "in_proj_a", m.d_model, hv, "column", False),
            ParamSpec(p + "conv1d.weight", (2 * key + value, 1, g.conv_kernel), "column"),
            ParamSpec(p + "norm.weight", (g.value_head_dim,), None),
            *_linear(p + "out_proj", value, m.d_model, "row", False)]


def _kda_specs(m: ModelConfig, p: str, tp: int = 1, i=None) -> List[ParamSpec]:
    """models/kda.py's parameters (transformers' KimiLinearDeltaAttention names, A_log
    (Hv,)); split over TP by heads (q/k/v_proj, the conv by [q | k | v] section, f_b_proj,
    dt_bias, A_log, b_proj, g_b_proj), the low-rank f_a_proj, g_a_proj and the norm's
    (Dv,) weight replicated, o_proj by rows."""
    g = gated_delta_dims(m)
    hv, dk, dv = g.num_value_heads, g.key_head_dim, g.value_head_dim
    key, value, d = g.num_key_heads * dk, hv * dv, m.d_model
    return [*_linear(p + "q_proj", d, key, "column", False),
            *_linear(p + "k_proj", d, key, "column", False),
            *_linear(p + "v_proj", d, value, "column", False),
            ParamSpec(p + "conv1d.weight", (2 * key + value, 1, g.conv_kernel), "column"),
            ParamSpec(p + "forget_gate.dt_bias", (hv * dk,), "column"),
            ParamSpec(p + "forget_gate.A_log", (hv,), "column"),
            *_linear(p + "forget_gate.f_a_proj", d, dk, None, False),
            *_linear(p + "forget_gate.f_b_proj", dk, hv * dk, "column", False),
            *_linear(p + "b_proj", d, hv, "column", False),
            *_linear(p + "g_a_proj", d, dv, None, False),
            *_linear(p + "g_b_proj", dv, value, "column", False),
            ParamSpec(p + "o_norm.weight", (dv,), None),
            *_linear(p + "o_proj", value, d, "row", False)]


def _mamba2_specs(m: ModelConfig, p: str, tp: int = 1, i=None) -> List[ParamSpec]:
    """models/mamba2.py's parameters (transformers' NemotronHMamba2Mixer names); split
    over TP by heads and B/C groups (in_proj by [z | x | B | C | dt] section, the conv by
    [x | B | C]), out_proj by rows."""
    d = mamba_dims(m)
    width, conv = d.num_heads * d.head_dim, d.num_heads * d.head_dim + 2 * d.n_groups * \
        d.state_size
    specs = [ParamSpec(p + name, (d.num_heads,), "column") for name in ("dt_bias", "A_log", "D")]
    specs += _linear(p + "in_proj", m.d_model, width + conv + d.num_heads, "column", m.bias)
    specs.append(ParamSpec(p + "conv1d.weight", (conv, 1, d.conv_kernel), "column"))
    if d.conv_bias:
        specs.append(ParamSpec(p + "conv1d.bias", (conv,), "column"))
    specs.append(ParamSpec(p + "norm.weight", (width,), "column"))
    return specs + _linear(p + "out_proj", width, m.d_model, "row", m.bias)


def attention_shape(m: ModelConfig, i: Optional[int] = None) -> LayerAttention:
    """Layer i's attention (config.layers.layer_attention; i None: an MTP block's,
    config.layers.mtp_layer_attention, else the model's plain shapes)."""
    if i is not None:
        return layer_attention(m)[i]
    if m.mtp is not None:
        return mtp_layer_attention(m)
    return LayerAttention("full_attention", None, None, 0.0, None)


def layer_head_dim(m: ModelConfig, a: LayerAttention) -> int:
    """A layer's head dim: its own (model.global_head_dim), or the model's."""
    return a.head_dim or head_dim(m)


def layer_kv_heads(m: ModelConfig, a: LayerAttention) -> int:
    """A layer's K/V heads: its type's (model.layer_kv_heads, Gemma 4's
    model.global_n_kv_heads: LayerAttention.n_kv_heads), or the model's."""
    return a.n_kv_heads or m.n_kv_heads or m.n_heads


def layer_v_head_dim(m: ModelConfig, a: LayerAttention) -> int:
    """A layer's value head width: model.v_head_dim, or its head dim."""
    return m.v_head_dim or layer_head_dim(m, a)


def _attention_specs(m: ModelConfig, p: str, tp: int, i: Optional[int] = None
                     ) -> List[ParamSpec]:
    """models/attention.py's parameters; a layer sharing an earlier one's K/V (model.
    num_kv_shared_layers) has no k_proj, v_proj or k_norm, a k_eq_v layer no v_proj; values
    v_head_dim wide (model.v_head_dim), sinks on the layer's type (model.attention_sinks)."""
    a = attention_shape(m, i)
    d, hd, n_kv = m.d_model, layer_head_dim(m, a), layer_kv_heads(m, a)
    vd = layer_v_head_dim(m, a)
    kv_split = "column" if n_kv % tp == 0 else "heads"
    own_kv = a.kv_source is None
    qkv_bias = m.bias or m.attention_bias
    specs = []
    if sinks_on(m, a.kind):  # one logit per query head, split with the heads
        specs.append(ParamSpec(p + "sinks", (m.n_heads,), "column"))
    q_rows = m.n_heads * hd * (2 if m.attention_output_gate else 1)  # per head [q | gate]
    specs += _linear(p + "q_proj", d, q_rows, "column", qkv_bias)
    if own_kv:
        specs += _linear(p + "k_proj", d, n_kv * hd, kv_split, qkv_bias)
    if own_kv and not a.k_eq_v:
        specs += _linear(p + "v_proj", d, n_kv * vd, kv_split, qkv_bias)
    specs += _linear(p + "o_proj", m.n_heads * vd, d, "row", m.bias)
    if m.qk_norm and m.qk_norm_scope == "all_heads":  # the whole width, split with heads
        specs += [ParamSpec(p + "q_norm.weight", (m.n_heads * hd,), "column"),
                  ParamSpec(p + "k_norm.weight", (n_kv * hd,), "column")]
    elif m.qk_norm:  # one (hd,) weight shared by every head: replicated over TP
        specs += _norm(p + "q_norm", m, hd) + (_norm(p + "k_norm", m, hd) if own_kv else [])
    return specs


def _mla_specs(m: ModelConfig, p: str, tp: int, i=None) -> List[ParamSpec]:
    """models/mla.py's parameters (transformers' DeepseekV3Attention names): the heads'
    projections split over TP by heads, the low-rank paths and their norms replicated."""
    mla, d, h = m.mla, m.d_model, m.n_heads
    qk, rows = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    if mla.q_lora_rank is None:
        specs = _linear(p + "q_proj", d, h * qk, "column", False)
    else:
        specs = _linear(p + "q_a_proj", d, mla.q_lora_rank, None, False)
        specs += [ParamSpec(p + "q_a_layernorm.weight", (mla.q_lora_rank,), None)]
        specs += _linear(p + "q_b_proj", mla.q_lora_rank, h * qk, "column", False)
    specs += _linear(p + "kv_a_proj_with_mqa", d, mla.latent_dim, None, False)
    specs += [ParamSpec(p + "kv_a_layernorm.weight", (mla.kv_lora_rank,), None)]
    specs += _linear(p + "kv_b_proj", mla.kv_lora_rank, h * rows, "column", False)
    return specs + _linear(p + "o_proj", h * mla.v_head_dim, d, "row", False)


def _dsa_specs(m: ModelConfig, p: str, tp: int, layer=None) -> List[ParamSpec]:
    """models/dsa.py's: MLA's, then the lightning indexer's (transformers' names), its
    heads split over TP, its key replicated; a 'shared' layer has none (block_specs drops
    them)."""
    dsa, i = m.dsa, p + "indexer."
    specs = _linear(i + "wq_b", m.mla.q_lora_rank, dsa.index_n_heads * dsa.index_head_dim,
                    "column", False)
    specs += _linear(i + "wk", m.d_model, dsa.index_head_dim, None, False)
    specs += [ParamSpec(i + "k_norm.weight", (dsa.index_head_dim,), None),
              ParamSpec(i + "k_norm.bias", (dsa.index_head_dim,), None)]
    return _mla_specs(m, p, tp) + specs + _linear(i + "weights_proj", m.d_model,
                                                  dsa.index_n_heads, "column", False)


# Each token mixer's parameters under its submodule's name: models/mixers.py registers the
# same kinds under the same names (the model checks itself against these when built)
TOKEN_MIXER_PARAMETERS = {  # token mixer -> (submodule, specs(m, its prefix, tp)); tp
    #                           changes only attention's (kv heads split or replicated)
    "attention": ("attn", _attention_specs),
    "mla": ("attn", _mla_specs),
    "dsa": ("attn", _dsa_specs),
    "gated_delta": ("linear_attn", _gated_delta_specs),
    "mamba2": ("mamba", _mamba2_specs),
    "kda": ("kda", _kda_specs),
    "compressed": ("attn", compressed_attention_specs),
}


def _mlp_specs(m: ModelConfig, p: str, ffn: int) -> List[ParamSpec]:
    specs = _norm(p + "mlp_norm", m) + _dense_mlp(m, p + "mlp.", ffn)
    return specs + (_norm(p + "post_mlp_norm", m) if m.post_norms else [])


def _dense_mlp(m: ModelConfig, p: str, ffn: int) -> List[ParamSpec]:
    """models/mlp.py's MLP of width ffn under prefix p (a block's, or a shared expert's)."""
    d = m.d_model
    specs = _linear(p + "gate_proj", d, ffn, "column", m.bias) if m.mlp in GATED_MLPS else []
    specs += _linear(p + "up_proj", d, ffn, "column", m.bias)
    return specs + _linear(p + "down_proj", ffn, d, "row", m.bias)


def embedding_spec(m: ModelConfig) -> ParamSpec:
    return ParamSpec("embed.weight", (m.vocab_size, m.d_model), "column")


def per_layer_embedding_specs(m: ModelConfig) -> List[ParamSpec]:
    """models/per_layer_input.py's embedding (vocabulary rows over TP, as the embedding's),
    its projection of the input embedding and that projection's norm (replicated)."""
    if not m.per_layer_input_dim:
        return []
    width = m.n_layers * m.per_layer_input_dim
    return [ParamSpec("per_layer_input.embed.weight", (m.vocab_size, width), "column"),
            *_linear("per_layer_input.model_projection", m.d_model, width, None, False),
            *_norm("per_layer_input.projection_norm", m, m.per_layer_input_dim)]


def head_specs(m: ModelConfig) -> List[ParamSpec]:
    """model.hyper_connections' head (the streams' collapse), the final norm and, untied,
    the head (a tied head is the embedding's weight)."""
    n = m.hyper_connections.streams if m.hyper_connections is not None else 0
    specs = [ParamSpec("hc_head.fn", (n, n * m.d_model), None),
             ParamSpec("hc_head.base", (n,), None),
             ParamSpec("hc_head.scale", (1,), None)] if n else []
    specs += _norm("final_norm", m)
    if not m.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (m.vocab_size, m.d_model), "column"))
    return specs


def mtp_specs(m: ModelConfig, tp: int = 1) -> List[ParamSpec]:
    """models/mtp.py's parameters (model.mtp; none without): per depth k its input norms
    and projection (replicated over TP: 2d -> d), its Block (a dense MLP, or model.moe's
    experts under model.mtp.moe), its output norm; under shared_projection only depth 0 holds the norms and the projection."""
    specs = []
    for k in range(m.mtp.depth if m.mtp is not None else 0):
        p = f"mtp.layers.{k}."
        own = k == 0 or not m.mtp.shared_projection
        if own:
            specs += _norm(p + "enorm", m) + _norm(p + "hnorm", m)
            specs += _linear(p + "eh_proj", 2 * m.d_model, m.d_model, None, False)
        specs += _layer_specs(m, m.mtp.layer_type, p + "block.", m.mtp.moe, tp)
        if own:
            specs += _norm(p + "norm", m)
    return specs


def parameter_specs(m: ModelConfig, tp: int = 1) -> List[ParamSpec]:
    """Every parameter of the whole model, in GPT's named_parameters() order."""
    specs = [embedding_spec(m), *per_layer_embedding_specs(m)]
    for i in range(m.n_layers):
        specs += block_specs(m, i, tp)
    return specs + head_specs(m) + mtp_specs(m, tp)


def active_parameters(m: ModelConfig) -> float:
    """Parameters one token computes with (6 N per token's FLOPs): every one, but of a
    mixture of experts' routed experts only top_k of num_experts."""
    share = m.moe.top_k / m.moe.num_experts if m.moe is not None else 1.0
    return sum(s.numel() * (share if s.split in ("experts_column", "experts_row",
                                                             "experts_bias") else 1.0)
               for s in parameter_specs(m))


def check_parameters(named: Iterable[Tuple[str, object]], m: ModelConfig, tp: int,
                     ep: int = 1) -> None:
    """Raise if the built parameters (name, tensor) differ from parameter_specs in a name
    or a per-rank shape: the model and the planner would disagree."""
    got = [(name, tuple(p.shape)) for name, p in named]
    want = [(s.name, s.local_shape(tp, ep)) for s in parameter_specs(m, tp)]
    if got != want:
        diff = sorted(set(got) ^ set(want))[:4]
        raise AssertionError(f"the model's parameters differ from ctxpar.config.parameters' "
                             f"description at tp={tp} (built vs described, first: {diff}); "
                             f"change both")
