"""DeepSeek sparse attention (model.dsa) under a layout: what its indexer adds to MLA's counts
(mla_layers.py), from what ctxpar.context_parallel.sparse_latent does.

Per rank (counts.RankShapes): N = B s tokens, h = H/tp main heads, Hi = index_n_heads/tp
indexer heads of width D (index_head_dim), k = index_topk; e the activations' element size.

pairs    a query attends min(k, q + 1) keys: the count of a window of width k over the
         causal triangle (mask.visible_pairs), n k - k (k - 1) / 2 for a whole sequence
         instead of n (n + 1) / 2; under 'dense_warmup' the attention is dense (MLA's)
FLOPs    the sparse attention in the absorbed form (q_nope through kv_b_proj's key rows):
         scores at R + dr and values at R per head and selected pair, so its kernel head
         dim is (R + dr + R) / 2; the indexer scores every visible pair, 2 Hi (D + 1) each
         (the dot products, then the weighted sum), forward only under 'frozen' (no
         gradient); under 'dense_warmup' / 'sparse' its KL pass scores its set again with
         the main attention's probabilities (2 h (R + dr) a pair), and backward twice that
wire     the indexer's key, D numbers a token, travels with the top-k pass ((P - 1) s D e
         forward, ring or all-gather); the KL pass sends the latent and the key again and,
         backward, both again and the key's fp32 gradient (P s D 4 on the ring, (P - 1)
         s D 4 reduce-scattered)
saved    the selection, k int64 positions a query (sparse_latent_attention keeps it for
         backward), the absorbed q (N h (R + dr)) in q's place (N h dqk); in the loss
         stages also the indexer's inputs (index_q, index_k, index_w fp32) and two fp32
         row statistics
working  the running top-k (N k int64) while the indexer streams, and the tiles of its
         products (sparse_latent's tile_budget, 2**22 elements, fp32)
"""
from __future__ import annotations

from typing import Tuple

from ..config import ModelConfig

TILE_ELEMENTS = 1 << 22  # sparse_latent's default tile_budget: one tile's products


def trains_indexer(m: ModelConfig) -> bool:
    """Whether the indexer's KL pass runs ('dense_warmup', 'sparse')."""
    return m.dsa.stage != "frozen"


def sparse_attention(m: ModelConfig) -> bool:
    """Whether the attention runs over the selection (every stage but the warm-up)."""
    return m.dsa is not None and m.dsa.stage != "dense_warmup"


def kernel_head_dim(m: ModelConfig) -> float:
    """The absorbed sparse attention's mean width a pair: R + dr for scores, R for values."""
    return (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim + m.mla.kv_lora_rank) / 2


def index_heads(m: ModelConfig, tp: int) -> int:
    return m.dsa.index_n_heads // tp


def indexer_flops(m: ModelConfig, tp: int, B: int, pairs: int, sparse_pairs: int) -> Tuple[
        float, float]:
    """(forward, backward) FLOPs of one layer's indexer on the busiest rank: pairs the
    visible (query, key) pairs it scores, sparse_pairs the selected ones (the sparse
    stage's KL set)."""
    hi, d = index_heads(m, tp), m.dsa.index_head_dim
    score = 2 * hi * (d + 1)
    fwd = B * pairs * score
    if not trains_indexer(m):
        return float(fwd), 0.0
    kl_pairs = pairs if m.dsa.stage == "dense_warmup" else sparse_pairs
    main = 2 * (m.n_heads // tp) * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim)
    kl = B * kl_pairs * (score + main)
    return float(fwd + kl), float(2 * B * kl_pairs * score)


def dsa_cp_bytes(m: ModelConfig, comm: str, P: int, B: int, s: int, e: int) -> Tuple[int, int]:
    """(forward, backward) bytes one rank sends in one layer beyond MLA's (module
    docstring: wire)."""
    if P == 1:
        return 0, 0
    key = B * s * m.dsa.index_head_dim
    fwd = (P - 1) * key * e if sparse_attention(m) else 0
    if not trains_indexer(m):
        return fwd, 0
    both = (P - 1) * B * s * (m.mla.latent_dim + m.dsa.index_head_dim) * e
    grad = (P if comm == "ring" else P - 1) * key * 4
    return fwd + both, both + grad


def indexer_saved(s, e: int, m: ModelConfig) -> int:
    """Bytes one DSA layer keeps beyond MLA's core (module docstring: saved)."""
    tp = s.tp
    out = 0
    if sparse_attention(m):
        out += s.N * m.dsa.index_topk * 8 + s.N * s.h * (
            m.mla.latent_dim - m.mla.qk_head_dim) * e
    if trains_indexer(m):
        hi, d = index_heads(m, tp), m.dsa.index_head_dim
        out += s.N * hi * d * e + s.N * d * e + s.N * hi * 4 + 2 * 4 * s.N
    return out


def working_set(s, m: ModelConfig) -> int:
    """Bytes the indexer holds while it streams (module docstring: working)."""
    if not sparse_attention(m):
        return 0
    return s.N * m.dsa.index_topk * 8 + 3 * TILE_ELEMENTS * 4
