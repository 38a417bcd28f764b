"""The planner's view of Gemma 4's per-layer attention shapes (config/kv_layers.py): each
block's head dim and kv heads (its full layers' global_head_dim, global_n_kv_heads), a
block sharing an earlier one's K/V keeping none of its own (no k/v projections, no saved
K/V: its attention saves references to its producer's), the per-layer input embeddings
on the first stage, what a later pipeline stage receives of them beside x; whether a
shared K/V's exchange is held for its consumers (exchange_held); and which attention
kernels take a head dim.

    s_i = layer_rank_shapes(s, m, cand, i)   # RankShapes of block i (hk 0: shared K/V;
                                             # f twice under model.double_wide_mlp)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..config import ModelConfig
from ..config.kv_layers import layer_ffn_hidden
from ..config.layers import kv_sources, layer_attention
from ..config.moe import hash_layers
from ..config.parameters import (kv_heads_per_rank, layer_head_dim, layer_kv_heads,
                                 layer_v_head_dim)
from ..context_parallel.kernels import FUSED_MAX_HEAD_DIM, FlashAttn4Backend

# The largest head dim each fused kernel takes (ctxpar/context_parallel/kernels.py): Dao's
# flash-attn 2 and torch's flash SDPA 256, FlashAttention-4 its built sizes; the math
# kernel any (Gemma 4's full layers, 512, run there on CUDA in bf16).
KERNEL_HEAD_DIMS = {"flash_attn": FUSED_MAX_HEAD_DIM, "sdpa (CUDA bf16/fp16)": FUSED_MAX_HEAD_DIM,
                    "flash_attn4": max(FlashAttn4Backend.HEAD_DIMS)}


def per_layer_shapes(m: ModelConfig) -> bool:
    """Whether the model's blocks differ in head dim, kv heads or own K/V within a type."""
    return bool(m.global_head_dim or m.global_n_kv_heads or m.num_kv_shared_layers)


def layer_rank_shapes(s, m: ModelConfig, tp: int, i: int, cand=None):
    """RankShapes s with block i's head dim and kv heads on a TP rank (0 kv heads for a
    block that shares an earlier one's K/V) and its dense MLP's width (twice model.ffn_hidden
    on such a block under model.double_wide_mlp); under cand's CP a k_eq_v block's core
    keeps k_proj x alone (wire_tensors)."""
    a = layer_attention(m)[i]
    hk = 0 if a.kv_source is not None else kv_heads_per_rank(m, tp, layer_kv_heads(m, a))
    return replace(s, hd=layer_head_dim(m, a), hk=hk,
                   f=layer_ffn_hidden(m, a.kv_source) // tp,
                   kv_tensors=wire_tensors(m, a, cand))


def wire_tensors(m: ModelConfig, a, cand) -> int:
    """Tensors per kv head a layer's CP attention moves and keeps: 1 for keys equal to
    values (model.attention_k_eq_v) under CP without a pipeline, k_proj x with K and V made
    where it arrives (models/attention.py set_sequence_rotary: not for whole-projection k
    norms; the pipeline's stages carry K and V); 2, K and V, otherwise (a None layer or
    candidate: the model's)."""
    return 1 if (cand is not None and cand.cp > 1 and cand.pp == 1 and a is not None
                 and a.k_eq_v and m.qk_norm_scope != "all_heads" and m.mla is None) else 2


def exchange_held(m: ModelConfig, a, cand, halo: bool) -> bool:
    """Whether a shared-KV layer's CP exchange (a producer's or a consumer's: a.kv_source,
    a.keeps_shared_kv) is made once by the producer and held for its consumers
    (ContextParallel.held_kv / held_latent): under Ulysses (regrouped by heads) and the
    all-gather (gathered: unless a short window's halo is the exchange, halo), of k_proj x
    alone or K,V of equal widths (a narrower V travels padded, per layer). The ring and
    hybrid exchange per layer; a pipeline's consumers send the K/V they received (models/
    pipe_carry.py), while its producers still hold theirs."""
    shared = a is not None and (a.keeps_shared_kv or (a.kv_source is not None and cand.pp == 1))
    if not shared or cand.cp == 1 or cand.cp_comm not in ("ulysses", "allgather"):
        return False
    wire = wire_tensors(m, a, cand) == 1
    if not wire and layer_head_dim(m, a) != layer_v_head_dim(m, a):
        return False
    return cand.cp_comm == "ulysses" or wire or not halo


def carried_bytes(m: ModelConfig, tp: int, tokens: int, e: int, after: int) -> int:
    """Bytes of one micro-batch a pipeline stage whose first block is after + 1 receives
    beside x (models/pipe_carry.py): the K/V of each producer <= after that a later block
    reads, the per-layer inputs of blocks after + 1 .. L-1, the token ids (int64) while a
    hash-routed MoE layer after it reads them (model.moe.hash_layers); tokens: N on the rank. Held
    twice until the micro-batch's backward: DeepSpeed's received copy (kept for sending the
    gradients back) and the clone its forward hands the blocks (the consumers' cores save
    it, the pass-through goes on as the stage's output)."""
    per_token = 0
    for j in sorted({j for c, j in kv_sources(m).items() if j <= after < c}):
        a = layer_attention(m)[j]
        per_token += kv_heads_per_rank(m, tp, layer_kv_heads(m, a)) * (
            layer_head_dim(m, a) + layer_v_head_dim(m, a))
    if m.per_layer_input_dim:
        per_token += max(m.n_layers - 1 - after, 0) * m.per_layer_input_dim
    ids = 8 if any(j > after for j in hash_layers(m.moe)) else 0
    return 2 * tokens * (per_token * e + ids)


def kernels_refusing(m: ModelConfig) -> Optional[str]:
    """The fused kernels that cannot take the model's largest head dim, in words (None:
    every one takes it)."""
    hd = max(layer_head_dim(m, a) for a in layer_attention(m))
    refusing = [k for k, most in KERNEL_HEAD_DIMS.items() if hd > most]
    return None if not refusing else (f"head dim {hd}: {', '.join(refusing)} cannot take it "
                                      f"(those layers run on the math kernel)")

