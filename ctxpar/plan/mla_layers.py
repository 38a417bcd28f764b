"""Multi-head latent attention (model.mla) under a layout: what it saves, sends and computes.

Per rank (counts.RankShapes): N = B s tokens, h = H/tp heads; the layer's widths R
(kv_lora_rank), dn, dr, dv (config/mla.py), dqk = dn + dr; e the activations' element
size. What ctxpar.context_parallel.latent_attention does (latent.py, latent_api.py):

saved    q (N, h, dqk), the latent (N, R + dr), out (N, h, dv), lse fp32 (h, N): never the
         expanded K,V. Ulysses and hybrid keep the all-to-all'd q and out (the same
         elements), the latent gathered over the u ranks (u N (R + dr)) and o_proj's input,
         the out all-to-all'd back (N h dv). The kernel's out is never the padded one
         (a fused kernel that pads v to dqk: ring_forward keeps a contiguous dv-wide copy).
         In mode 'none' the bottlenecks' norms as well (bottleneck_saved).
wire     the latent, R + dr numbers a token, instead of K,V (h (dqk + dv)); backward its
         gradient in fp32 (ring, all-gather) or in e (Ulysses' reduce-scatter, after the
         inner call cast it back). The expanded form (a what-if the planner prints,
         --explain) circulates K at dqk and V at dv per head with its dK,dV in
         ring_grad_dtype, as the ring does for any attention.
FLOPs    attention at dqk for the scores and dv for the values (stats.attention_flops'
         mean head dim); each visiting latent block's key rows expanded by kv_b_proj,
         2 rows R h (dn + dv) forward, three times that backward (the expansion again, dW
         and the latent's gradient), where the expanded form applies kv_b_proj once to
         the local tokens.
"""
from __future__ import annotations

from typing import Tuple

from ..config import ModelConfig
from ..context_parallel.blocks import block_plan
from ..context_parallel.latent import LatentDims


def latent_dims(m: ModelConfig) -> LatentDims:
    return LatentDims.from_config(m.mla)


def kernel_head_dim(m: ModelConfig) -> float:
    """The attention kernel's mean head dim: q k^T at dqk, p v at dv (stats.attention_flops)."""
    dims = latent_dims(m)
    return (dims.qk_head_dim + dims.v_head_dim) / 2


def _ulysses(cand) -> int:
    """The Ulysses degree of the pattern (1 for ring and all-gather)."""
    if cand.cp == 1 or cand.cp_comm in ("ring", "allgather"):
        return 1
    return cand.cp if cand.cp_comm == "ulysses" else cand.ulysses


def core_saved(s, e: int, cand, m: ModelConfig) -> int:
    """Bytes LatentAttention keeps per layer (module docstring: saved)."""
    dims, u = latent_dims(m), _ulysses(cand)
    q, out = s.N * s.h * dims.qk_head_dim * e, s.N * s.h * dims.v_head_dim * e
    latent = u * s.N * dims.latent_dim * e
    back = out if u > 1 else 0  # o_proj's input: the out all-to-all'd back to tokens
    return q + latent + out + 4 * s.N * s.h + back


def bottleneck_saved(s, e: int, m: ModelConfig, device: str = "cpu") -> int:
    """Mode 'none': what the low-rank paths' norms keep beyond the core. q_a_layernorm as
    counts.norm_saved at width q_lora_rank (its output q_b_proj's input); kv_a_layernorm's
    input is a view of kv_a_proj_with_mqa's output, whose whole (N, R + dr) storage is
    kept, with the fp32 rstd, and on CPU (the composite rms_norm) the normed (N, R); its
    output goes into the latent's cat, which keeps nothing."""
    mla, dims = m.mla, latent_dims(m)
    out = s.N * dims.latent_dim * e + 4 * s.N + (s.N * dims.kv_lora_rank * e
                                                  if device == "cpu" else 0)
    if mla.q_lora_rank is not None:
        copies = 3 if device == "cpu" else 2
        out += copies * s.N * mla.q_lora_rank * e + 4 * s.N
    return out


def rope_width(m: ModelConfig) -> int:
    """RoPE's cos/sin are made at the rope part's width (qk_rope_head_dim)."""
    return latent_dims(m).qk_rope_head_dim


# ------------------------------------------------------------------ bytes on the wire


def ring_widths(m: ModelConfig, h: int, expanded: bool = False) -> int:
    """Numbers a token puts on the ring for h heads: the latent R + dr, or (the what-if)
    the expanded K and V, h (dqk + dv)."""
    dims = latent_dims(m)
    return h * (dims.qk_head_dim + dims.v_head_dim) if expanded else dims.latent_dim


def mla_cp_bytes(m: ModelConfig, comm: str, P: int, u: int, B: int, s: int, h: int, e: int,
                 g: int = 4, expanded: bool = False) -> Tuple[int, int]:
    """(forward, backward) bytes one rank sends (= receives) in one MLA layer over P CP
    ranks (u of them Ulysses' under hybrid), s local tokens, h heads: comm_bytes.cp_bytes at
    the latent's width. ring: P-1 latent hops forward; P-1 again and P of its fp32
    gradient backward; all-gather: (P-1)x the latent each way and its fp32 gradient
    reduce-scattered; Ulysses: (u-1)/u of q and out (and dout, dq backward), the latent
    all-gathered (u-1)x forward and its gradient (in e) reduce-scattered; hybrid: both,
    the ring over P/u ranks of u s tokens. expanded: K,V circulate instead (g: the ring's
    dK,dV bytes, ring_grad_dtype; the expanded all-gather's fp32)."""
    if P == 1:
        return 0, 0
    dims = latent_dims(m)
    gb = g if expanded else 4
    if comm in ("ring", "allgather"):
        kv = B * s * ring_widths(m, h, expanded)
        back = P * kv * gb if comm == "ring" else (P - 1) * kv * 4
        return (P - 1) * kv * e, (P - 1) * kv * e + back
    u = P if comm == "ulysses" else u
    r = P // u
    part = lambda nbytes: nbytes * (u - 1) // u  # noqa: E731 - an all-to-all's share
    qo = part(B * s * h * dims.qk_head_dim * e) + part(B * s * h * dims.v_head_dim * e)
    kv = part(B * s * ring_widths(m, h, True) * e) if expanded \
        else (u - 1) * B * s * dims.latent_dim * e
    fwd, bwd = qo + kv, qo + kv
    if r > 1:  # the ring over r ranks: u s tokens, the latent whole (K,V at h/u heads)
        ring = B * u * s * ring_widths(m, h // u, expanded)
        fwd, bwd = fwd + (r - 1) * ring * e, bwd + (r - 1) * ring * e + r * ring * gb
    return fwd, bwd


def ulysses_bytes(m: ModelConfig, u: int, B: int, s: int, h: int, e: int,
                  expanded: bool = False) -> Tuple[int, int]:
    """(forward, backward) bytes of hybrid's Ulysses exchange over its u ranks alone."""
    return mla_cp_bytes(m, "ulysses", u, u, B, s, h, e, expanded=expanded)


def ring_step_bytes(m: ModelConfig, cand, s, e: int, g: int, expanded: bool = False
                    ) -> Tuple[int, int]:
    """(block, its gradient) bytes of one ring step: a ring rank's u s tokens' latent
    (the expanded K,V at h/u heads) and its fp32 gradient (dK,dV in g)."""
    u = _ulysses(cand)
    block = s.B * u * (s.N // s.B) * ring_widths(m, s.h // u, expanded)
    return block * e, block * (g if expanded else 4)


# ------------------------------------------------------------------ FLOPs


def expanded_rows(layout: str, ranks: int, S: int) -> int:
    """Key rows the busiest of `ranks` ring ranks expands in one causal layer's forward:
    each step's visible block's key span (latent._key_span of blocks.block_plan; zigzag's
    earlier ranks' first halves only), a step without work expanding nothing."""
    def rows(rank):
        spans = (block_plan(layout, True, rank, src, S) for src in range(ranks))
        return sum(b.k1 - b.k0 for b in spans if b is not None)
    return max(rows(rank) for rank in range(ranks))


def expansion_flops(m: ModelConfig, cand, s) -> int:
    """Forward FLOPs of one layer's kv_b_proj expansions on the busiest rank: 2 B rows R
    (h/u) (dn + dv), rows those of the ring over P/u ranks of u s tokens (Ulysses: all T
    rows once, one local call)."""
    dims, u = latent_dims(m), _ulysses(cand)
    ranks, S = cand.cp // u, u * (s.N // s.B)
    rows = S if ranks == 1 else expanded_rows(cand.token_layout, ranks, S)
    return 2 * s.B * rows * dims.kv_lora_rank * (s.h // u) * dims.kv_b_rows_per_head


def local_expansion_flops(m: ModelConfig, s) -> int:
    """Forward FLOPs of kv_b_proj applied once to the rank's N tokens (the expanded form,
    and what counting kv_b_proj as an ordinary projection's parameters charges)."""
    dims = latent_dims(m)
    return 2 * s.N * dims.kv_lora_rank * s.h * dims.kv_b_rows_per_head


# ------------------------------------------------------------------ working sets


def _sizes(s, m: ModelConfig):
    """Elements (q, out, latent, one block's expansion, a padded (N, h, D) tensor) of the
    rank's N tokens: q (N, h, dqk), out (N, h, dv), the latent (N, R + dr), what
    expand_latent makes for N key rows (kv_b_proj's output (N, h, dn + dv), v a view of
    it, and the cat'd k (N, h, dqk)), and D = max(dqk, dv) wide: a fused kernel (sdpa,
    flash-attn) takes one head dim, so kernels.PaddedHeadDims pads v (and in backward
    dout, out) to dqk and the kernel's out (dv's gradient) comes back that wide."""
    dims = latent_dims(m)
    dqk, dv = dims.qk_head_dim, dims.v_head_dim
    q, o = s.N * s.h * dqk, s.N * s.h * dv
    kv = s.N * s.h * (dims.kv_b_rows_per_head + dqk)
    return q, o, s.N * dims.latent_dim, kv, s.N * s.h * max(dqk, dv), dqk != dv


def attention_forward(s, cand, e: int, m: ModelConfig) -> float:
    """Bytes latent_attention holds in its forward beyond what it saves (one layer): one
    visiting block's expansion (a block's key rows are at most the rank's N: Ulysses' u N
    rows at h/u heads, the same elements), the padded v and the kernel's padded out
    (PaddedHeadDims; alone, the out's dv-wide copy is the saved one), and over CP the
    block's kernel output beside the (N, h, dv) fp32 accumulator (16-bit), the ring's
    two latent receive buffers (one for a single hop), all-gather's P slots, Ulysses'
    send and receive of q and out and its gathered latent's buffer. Held to the
    allocator alone (tests/test_plan_mla.py); over CP read from latent.py."""
    q, o, lat, kv, wide, pad = _sizes(s, m)
    u = _ulysses(cand)
    alone = kv * e + (2 * wide * e if pad else 0)
    if cand.cp == 1:
        return alone
    base = kv * e + (wide * e if pad else 0) + wide * e + (4 * o if e != 4 else 0)
    if cand.cp_comm == "allgather":
        return base + cand.cp * lat * e
    ring = cand.cp // u
    out = base + min(ring - 1, 2) * u * lat * e if ring > 1 else alone
    return out + (2 * (q + o) * e + u * lat * e if u > 1 else 0)


def attention_backward(s, cand, e: int, m: ModelConfig) -> float:
    """Bytes latent_attention holds in its backward beyond its saved tensors and dout, at
    a visit's kernel backward: the fp32 dq, dW (h (dn + dv), R), the latent's gradient
    (the ring: and its receive buffer; all-gather: one per slot) and the rows' (h, N)
    fp32 softmax term; the visit's expansion again, its fp32 dK, dV (N, h, dqk + dv), the
    padded dout, v and out and the kernel's dq, dk, dv (dv padded); the ring's two latent
    blocks; Ulysses' all-to-alls of dout and dq. Held to the allocator alone
    (tests/test_plan_mla.py); over CP read from latent.py."""
    q, o, lat, kv, wide, pad = _sizes(s, m)
    dims, u = latent_dims(m), _ulysses(cand)
    W = s.h * dims.kv_b_rows_per_head * dims.kv_lora_rank
    kernel = (3 * wide + 2 * q + wide) * e if pad else (2 * q + o) * e
    visit = kv * e + 4 * (q + o) + kernel
    acc = 4 * (q + W) + 4 * u * lat + 4 * s.N * s.h
    if cand.cp == 1:
        return visit + acc
    if cand.cp_comm == "allgather":
        return visit + acc + 4 * (cand.cp - 1) * lat + cand.cp * lat * e
    ring = cand.cp // u
    out = visit + acc + (4 * u * lat + min(ring - 1, 2) * u * lat * e if ring > 1 else 0)
    return out + (2 * (q + o) * e if u > 1 else 0)


def saved_after_peak(s, cand, e: int, m: ModelConfig) -> float:
    """Of the saved bytes, those made after attention_forward's peak: alone, the out
    (the padded kernel output's dv-wide copy); over CP the accumulator exists throughout."""
    return _sizes(s, m)[1] * e if cand.cp == 1 else 0


def core_inputs(s, e: int, m: ModelConfig) -> float:
    """q and the latent, which a block that saves nothing (a replayed or evaluated one)
    holds while its attention runs: to add to attention_forward there."""
    q, _, lat = _sizes(s, m)[:3]
    return (q + lat) * e


def forward_held(s, e: int, m: ModelConfig) -> float:
    """What Block.forward holds beside its MLP under 'full' (transients.block_forward):
    q, the latent and the attention's output."""
    q, o, lat = _sizes(s, m)[:3]
    return (q + o + lat) * e
