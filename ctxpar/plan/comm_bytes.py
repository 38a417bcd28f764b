"""The bytes each collective carries per rank: CP's attention calls (ring, all-gather,
Ulysses, hybrid; windowed and chunked layers' halos and shortened rings; Gemma 4's shared
K/V; DeepSeek-V4's compressors) and TP's all-reduces. Checked against cp_stats()
(tests/test_plan.py, tests/test_context_parallel.py, tests/test_attention_mask.py,
tests/test_gemma4.py). The shapes per rank are counts.rank_shapes'.
"""
from __future__ import annotations

from functools import lru_cache

from ..config import ModelConfig
from ..config.layer_mixers import COMPRESSED_TYPES
from ..context_parallel.halo import halo_tokens
from ..context_parallel.ulysses import ulysses_kv_heads
from . import compressed_layers, dsa_layers, mla_layers
from .candidate import Candidate
from .counts import RankShapes, rank_shapes, ring_grad_bytes
from .kv_layers import exchange_held, wire_tensors

def cp_bytes(comm: str, P: int, u: int, B: int, s: int, H: int, Hkv: int, D: int, e: int,
             grad_e: int = 4, return_lse: bool = False, kv_tensors: int = 2):
    """(forward, backward) bytes one rank sends (= receives) in one attention call over P
    CP ranks, s local tokens, H query and Hkv kv heads of D, inputs of e bytes; the ring's
    dK,dV in grad_e bytes (ring_grad_dtype). The minimum of each algorithm as stats.py
    counts it: ring P-1 K,V hops forward, P-1 K,V + P dK,dV backward; all-gather (P-1)x
    the local K,V each way, the dK,dV reduce-scatter (P-1)x fp32; Ulysses (u-1)/u of q, k,
    v, out (and the LSE when returned) forward, of dout, dq, dk, dv backward; hybrid both
    (the ring over P/u ranks of u x s tokens at Hkv'/u heads). kv_tensors 1: Gemma 4's
    keys equal to values, k_proj x alone in place of K and V (wire_tensors), its gradient
    fp32 on the ring (the expansion patterns')."""
    if P == 1:
        return 0, 0
    if kv_tensors == 1:
        grad_e = 4
    kv = kv_tensors * B * s * Hkv * D * e
    if comm == "ring":
        return (P - 1) * kv, (P - 1) * kv + P * kv_tensors * B * s * Hkv * D * grad_e
    if comm == "allgather":
        return (P - 1) * kv, (P - 1) * kv + (P - 1) * kv_tensors * B * s * Hkv * D * 4
    if comm == "ulysses":
        u = P
    r, Hk = P // u, ulysses_kv_heads(Hkv, u)
    part = lambda nbytes: nbytes * (u - 1) // u  # noqa: E731 - an all-to-all's share
    qkv, o, lse = B * s * (H + kv_tensors * Hk) * D * e, B * s * H * D * e, B * s * H * 4
    fwd = part(qkv) + part(o) + (part(lse) if return_lse else 0)
    bwd = part(o) + part(qkv)
    if r > 1:  # the ring over gathered shards: u*s tokens at Hk/u heads = s*Hk
        kv_r = kv_tensors * B * s * Hk * D * e
        fwd, bwd = fwd + (r - 1) * kv_r, \
            bwd + (r - 1) * kv_r + r * kv_tensors * B * s * Hk * D * grad_e
    return fwd, bwd


def ring_part(comm: str, P: int, u: int, s: int, Hkv: int):
    """(ring ranks, tokens a ring rank holds, kv heads it moves) of a pattern's P2P part
    (hybrid's ring runs over P/u ranks of u s tokens at lcm(Hkv, u)/u heads); None for
    Ulysses, which has none."""
    if comm == "ulysses" or P == 1:
        return None
    if comm == "hybrid":
        return P // u, u * s, ulysses_kv_heads(Hkv, u) // u
    return P, s, Hkv


def masked_cp_bytes(comm: str, P: int, u: int, B: int, s: int, H: int, Hkv: int, D: int,
                    e: int, grad_e: int, layout: str, sliding_window=None, chunk_size=None,
                    rank=None, return_lse: bool = False):
    """(forward, backward) bytes `rank` sends (None: the most of any rank, each phase) in
    one causal attention call with a sliding window and/or chunks, the rest as cp_bytes.
    Where a window's (or chunk's) reach fits in the neighbouring slabs (contiguous,
    zigzag: halo.halo_tokens, the exchange's own links) the ring and all-gather become
    the halo exchange: its K,V tails forward, again backward beside their dK,dV going
    back (ring_grad_dtype; all-gather fp32). Otherwise the ring stops after the last
    step with work (ring_steps, as blocks.ring_steps) and all-gather gathers its usual
    blocks (cp_bytes). Ulysses moves what it always does. Held to cp_stats() rank by rank
    in tests/test_attention_mask.py."""
    full = cp_bytes(comm, P, u, B, s, H, Hkv, D, e, grad_e, return_lse)
    part = ring_part(comm, P, u, s, Hkv)
    if part is None or (sliding_window is None and chunk_size is None):
        return full
    r, S, hk = part
    a2a = cp_bytes("ulysses", u, u, B, s, H, Hkv, D, e, return_lse=return_lse) \
        if comm == "hybrid" else (0, 0)
    kv_token = 2 * B * hk * D  # (k, v) elements of one token
    ge = 4 if comm == "allgather" else grad_e
    per_rank = [halo_tokens(layout, i, r, S, sliding_window, chunk_size)
                for i in (range(r) if rank is None else [rank])]
    if per_rank[0] is not None:
        fwd = max(sent * kv_token * e for sent, _ in per_rank)
        bwd = max(sent * kv_token * e + got * kv_token * ge for sent, got in per_rank)
        return a2a[0] + fwd, a2a[1] + bwd
    if comm == "allgather":
        return full
    steps, kv = ring_steps(layout, S, r, sliding_window, chunk_size), S * kv_token
    if steps == 1:  # every rank's keys are its own: no ring at all
        return a2a
    return a2a[0] + (steps - 1) * kv * e, a2a[1] + (steps - 1) * kv * e + steps * kv * grad_e


@lru_cache(maxsize=1024)
def ring_steps(layout: str, S: int, world: int, sliding_window=None, chunk_size=None) -> int:
    """Ring steps that carry work for some rank under a causal window and/or chunks (the
    ring stops after the last: blocks.ring_steps, which plans every block; here from the
    slabs alone). A query at position p sees back to max(p - w + 1, start of p's chunk),
    nondecreasing in p, so a slab's first query reaches furthest; contiguous and zigzag:
    the step of each (query slab, key slab) pair that reach allows; striped: step s holds
    keys s positions back, so min(P, w, c) steps."""
    big = S * world
    w, c = sliding_window or big + 1, chunk_size or big + 1
    if layout == "striped":
        return min(world, w, c)
    per = 2 if layout == "zigzag" else 1
    m = S // per
    owner = (lambda x: x) if per == 1 else (lambda x: x if x < world else 2 * world - 1 - x)
    last = 0
    for k in range(per * world):  # query slab k at positions [k m, (k + 1) m)
        p = k * m
        first = max(p - w + 1, p - p % c, 0) // m  # the earliest key slab it sees
        for x in range(first, k):
            last = max(last, (owner(k) - owner(x)) % world)
            if last == world - 1:
                return world
    return last + 1


def layer_cp_bytes(m: ModelConfig, cand: Candidate, e: int, attn=None):
    """cp_bytes for one layer of this model and layout (per-rank heads); attn, a layer's
    config.layers.LayerAttention: a window's or chunks' bytes (masked_cp_bytes); MLA's
    latent (mla_layers.mla_cp_bytes); the layer type's K/V heads; DeepSeek-V4's compressed
    layers (compressed_layers.cp_parts); Gemma 4's shared K/V (shared_kv_cp_bytes)."""
    s = rank_shapes(m, cand, attn.kind if attn is not None else None)
    g = ring_grad_bytes(cand.ring_grad_dtype)
    if m.compressed_attention is not None and attn is not None \
            and attn.kind in COMPRESSED_TYPES:  # the window's halo and the compressors'
        window, compressors = compressed_cp_parts(m, cand, e, attn)
        return window[0] + compressors[0], window[1] + compressors[1]
    if m.mla is not None:  # no windows under MLA (search.check_modelled)
        fwd, bwd = mla_layers.mla_cp_bytes(m, cand.cp_comm, cand.cp, cand.ulysses, s.B,
                                           s.N // s.B, s.h, e, g)
        if m.dsa is None:
            return fwd, bwd
        more = dsa_layers.dsa_cp_bytes(m, cand.cp_comm, cand.cp, s.B, s.N // s.B, e)
        return fwd + more[0], bwd + more[1]  # the indexer key (and the KL pass)
    if attn is not None and (attn.sliding_window or attn.chunk_size):
        own = masked_cp_bytes(cand.cp_comm, cand.cp, cand.ulysses, s.B, s.N // s.B, s.h,
                              s.hk, s.hd, e, g, cand.token_layout, attn.sliding_window,
                              attn.chunk_size)
    else:
        own = cp_bytes(cand.cp_comm, cand.cp, cand.ulysses, s.B, s.N // s.B, s.h, s.hk, s.hd,
                       e, g, kv_tensors=wire_tensors(m, attn, cand))
    return shared_kv_cp_bytes(m, cand, e, attn, own)


def shared_kv_cp_bytes(m: ModelConfig, cand: Candidate, e: int, attn, own):
    """(forward, backward) bytes of a layer whose own exchange is `own`, where Gemma 4's
    producer holds it for its consumers (kv_layers.exchange_held): a consumer sends no K/V
    (under Ulysses q's and out's all-to-alls, dout's and dq's; under the all-gather
    nothing), the all-gather's producer gathers once in forward and reduce-scatters the
    slots' summed gradient once, with no gather again in backward. Held to cp_stats()
    layer by layer in tests/test_gemma4.py."""
    if not exchange_held(m, attn, cand, halo_received(m, cand, attn) >= 0):
        return own
    if attn.kv_source is not None:
        if cand.cp_comm == "allgather":
            return 0, 0
        s = rank_shapes(m, cand, attn.kind)
        return cp_bytes("ulysses", cand.cp, cand.cp, s.B, s.N // s.B, s.h, s.hk, s.hd, e,
                        kv_tensors=0)
    if cand.cp_comm == "allgather":  # backward: the reduce-scatter alone
        return own[0], own[1] - own[0]
    return own


def compressed_cp_parts(m: ModelConfig, cand: Candidate, e: int, attn):
    """((window fwd, bwd), (compressors fwd, bwd)) bytes of the busiest rank in one of
    DeepSeek-V4's compressed layers (compressed_layers.cp_parts): the window at its one
    K = V head (masked_cp_bytes)."""
    s, g = rank_shapes(m, cand, attn.kind), ring_grad_bytes(cand.ring_grad_dtype)
    return compressed_layers.cp_parts(
        m, cand, attn.kind, s.B, e, lambda r: masked_cp_bytes(
            cand.cp_comm, cand.cp, 1, s.B, s.N // s.B, s.h, 1, s.hd, e, g,
            cand.token_layout, m.sliding_window, rank=r))


def halo_received(m: ModelConfig, cand: Candidate, attn) -> int:
    """K,V tokens the busiest rank receives in a layer's halo exchange; -1 where the
    layer has none (full attention, Ulysses, or a reach beyond the neighbours' slabs)."""
    s = rank_shapes(m, cand, attn.kind if attn is not None else None)
    part = ring_part(cand.cp_comm, cand.cp, cand.ulysses, s.N // s.B, s.hk)
    if part is None or attn is None or not (attn.sliding_window or attn.chunk_size):
        return -1
    r, S, _ = part
    got = [halo_tokens(cand.token_layout, i, r, S, attn.sliding_window, attn.chunk_size)
           for i in range(r)]
    return -1 if got[0] is None else max(g for _, g in got)


def tp_bytes_per_layer(s: RankShapes, e: int, tp: int):
    """(fwd, bwd) bytes one rank sends for a block's TP all-reduces: 2 forward (after o
    and down projections), 2 backward (the f ops before q/k/v and the MLP), each a ring
    all-reduce of N d e bytes sending 2 (tp-1)/tp of it."""
    if tp == 1:
        return 0, 0
    one = 2 * (tp - 1) * s.N * s.d * e // tp
    return 2 * one, 2 * one
