"""DeepSeek-V4's attention layers in the config (model.compressed_attention, the section:
compressed_attention.py): the rules the section and the V4 layer types follow at load, and
the parameters a V4 layer has (ctxpar/config/parameters.py's TOKEN_MIXER_PARAMETERS
'compressed': the model checks itself against them, the planner counts them).
"""
from __future__ import annotations

from typing import List

from ..context_parallel.compressed import COMPRESS_COMMS
from ..context_parallel.compressor import COMPRESS_LAYOUTS
from .dsa import _positive_int  # the one test of an integer >= 1 (bools refused)
from .layer_mixers import COMPRESSED_TYPES, layer_types
from .param_spec import ParamSpec, linear_specs
from .sections import resolved_head_dim, rotary_dim

V4_LAYER_TYPES = ("sliding_attention", *COMPRESSED_TYPES)


# Attention fields the V4 layer does not read: refused beside model.compressed_attention
NOT_READ = ("mla", "dsa", "qk_norm", "attention_bias", "bias", "attention_output_gate",
            "v_head_dim", "query_pre_attn_scalar", "attention_sinks", "layer_kv_heads",
            "global_head_dim", "global_n_kv_heads", "attention_k_eq_v",
            "num_kv_shared_layers", "nope_layers", "attn_temperature_tuning", "mtp",
            "attention_chunk_size", "value_norm", "qk_l2_norm")


def check_compressed_attention(cfg, err) -> None:
    """model.compressed_attention and the V4 layer types against the model and the run,
    one ConfigError line per rule (at load, before any collective)."""
    m, p = cfg.model, cfg.parallel
    ca, kinds = m.compressed_attention, set(layer_types(m))
    if ca is None:
        if kinds & set(COMPRESSED_TYPES):
            err(f"model.layer_types has {sorted(kinds & set(COMPRESSED_TYPES))} layers but "
                f"model.compressed_attention is not set (DeepSeek-V4's attention)")
        return
    if kinds - set(V4_LAYER_TYPES):
        err(f"model.compressed_attention with layer types {sorted(kinds - set(V4_LAYER_TYPES))}"
            f": DeepSeek-V4's layers are {list(V4_LAYER_TYPES)}")
    for key in ("q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
                "index_head_dim", "index_topk"):
        if not _positive_int(getattr(ca, key)):
            err(f"model.compressed_attention.{key}={getattr(ca, key)!r} must be an "
                f"integer >= 1")
    rates = ca.compress_rates
    if not isinstance(rates, dict) or set(rates) != set(COMPRESSED_TYPES) or \
            not all(_positive_int(v) for v in rates.values()):
        err(f"model.compressed_attention.compress_rates={rates!r} must map each of "
            f"{list(COMPRESSED_TYPES)} to an integer >= 1")
    for key in NOT_READ:
        value = getattr(m, key)
        if value:
            err(f"model.compressed_attention with model.{key}={value!r}: DeepSeek-V4's "
                f"attention does not read it (unset it)")
    if m.n_kv_heads != 1:
        err(f"model.compressed_attention needs model.n_kv_heads=1 (one shared K = V head), "
            f"got {m.n_kv_heads!r}")
    if not m.rope:
        err("model.compressed_attention with model.rope=false: V4's layers turn RoPE")
    if m.sliding_window is None:
        err("model.compressed_attention needs model.sliding_window (every V4 layer's)")
    _check_shapes(m, p.tp, err)
    _check_run(cfg, kinds, err)


def _check_shapes(m, tp: int, err) -> None:
    ca, hd, rope = m.compressed_attention, resolved_head_dim(m), rotary_dim(m)
    if rope % 2 or not 0 < rope <= min(hd, ca.index_head_dim):
        err(f"model.partial_rotary_factor={m.partial_rotary_factor} turns {rope} channels: "
            f"must be even, >= 2 and at most head_dim={hd} and compressed_attention."
            f"index_head_dim={ca.index_head_dim}")
    if m.n_heads % ca.o_groups:
        err(f"model.n_heads={m.n_heads} must divide into model.compressed_attention."
            f"o_groups={ca.o_groups} (the grouped output projection)")
    if ca.o_groups % tp:
        err(f"model.compressed_attention.o_groups={ca.o_groups} must divide over "
            f"parallel.tp={tp} (each TP rank projects whole groups)")


def _check_run(cfg, kinds: set, err) -> None:
    """What is not built around the V4 layers: one line each."""
    m, p, data = cfg.model, cfg.parallel, cfg.data
    for key, value in (("data.reset_positions", data.reset_positions),
                       ("data.dynamic_cp", data.dynamic_cp)):
        if value:
            err(f"model.compressed_attention with {key}=true: not built for V4's layers yet "
                f"(packed documents run with data.document_mask and global positions)")
    if not kinds & set(COMPRESSED_TYPES):
        return
    if p.cp_comm not in COMPRESS_COMMS:
        err(f"model.compressed_attention with parallel.cp_comm={p.cp_comm!r}: V4's "
            f"compressed layers run over {list(COMPRESS_COMMS)}")
    if p.layout not in COMPRESS_LAYOUTS:
        err(f"model.compressed_attention with parallel.layout={p.layout!r}: a compressed "
            f"window needs consecutive tokens on a rank ({list(COMPRESS_LAYOUTS)})")
    for kind in sorted(kinds & set(COMPRESSED_TYPES)):
        rate = m.compressed_attention.compress_rates.get(kind)
        reach = rate * (2 if kind == "compressed_sparse_attention" else 1)
        slab = m.seq_len // p.cp // (2 if p.layout == "zigzag" else 1)
        if p.cp > 1 and slab < reach:
            err(f"model.seq_len={m.seq_len} over parallel.cp={p.cp} ({p.layout}) leaves "
                f"slabs of {slab} tokens: {kind}'s compress rate {rate} needs {reach}")


def compressed_attention_specs(m, p: str, tp: int, i=None) -> List:
    """models/compressed_attention.py's parameters (transformers' DeepseekV4Attention
    names) in named_parameters' order: the sinks and the heads' projections split over TP
    by heads (o_a_proj by groups), o_b_proj by columns; the bottleneck, the K = V head,
    the compressor and the indexer replicated."""
    ca, d, h, hd = m.compressed_attention, m.d_model, m.n_heads, resolved_head_dim(m)
    specs = [ParamSpec(p + "sinks", (h,), "column")]
    specs += linear_specs(p + "q_a_proj", d, ca.q_lora_rank, None, False)
    specs += [ParamSpec(p + "q_a_norm.weight", (ca.q_lora_rank,), None)]
    specs += linear_specs(p + "q_b_proj", ca.q_lora_rank, h * hd, "column", False)
    specs += linear_specs(p + "kv_proj", d, hd, None, False)
    specs += [ParamSpec(p + "kv_norm.weight", (hd,), None)]
    specs += linear_specs(p + "o_a_proj", h * hd // ca.o_groups, ca.o_groups * ca.o_lora_rank,
                     "column", False)
    specs += linear_specs(p + "o_b_proj", ca.o_groups * ca.o_lora_rank, d, "row", False)
    kind = layer_types(m)[i] if i is not None else "sliding_attention"
    if kind not in COMPRESSED_TYPES:
        return specs
    csa = kind == "compressed_sparse_attention"
    specs += compressor_specs(p + "compressor.", d, hd, ca.rate(kind), csa)
    if csa:
        ix = p + "compressor.indexer."
        specs += compressor_specs(ix, d, ca.index_head_dim, ca.rate(kind), True)
        specs += linear_specs(ix + "q_b_proj", ca.q_lora_rank,
                         ca.index_n_heads * ca.index_head_dim, None, False)
        specs += linear_specs(ix + "scorer.weights_proj", d, ca.index_n_heads, None, False)
    return specs


def compressor_specs(p: str, d: int, width: int, rate: int, overlap: bool) -> List:
    """A compressor's (DeepseekV4HCACompressor's; CSA's and its indexer's two series
    with overlap): position_bias, kv_proj, gate_proj, kv_norm, replicated over TP."""
    wide = 2 * width if overlap else width
    return [ParamSpec(p + "position_bias", (rate, wide), None),
            *linear_specs(p + "kv_proj", d, wide, None, False),
            *linear_specs(p + "gate_proj", d, wide, None, False),
            ParamSpec(p + "kv_norm.weight", (width,), None)]
