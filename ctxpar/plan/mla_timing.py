"""MLA's layers over CP in the time model: the latent's (or the expanded K,V's) transfer
against the ring steps' compute, as timing.layer_cp_time does for K,V, and the thresholds
C* of its ring (timing's module docstring, at the latent's width)."""
from __future__ import annotations

from typing import Dict

from . import counts, dsa_layers, mla_layers
from .candidate import Candidate
from .cluster import Cluster


def ulysses_of(cand: Candidate) -> int:
    """Hybrid's Ulysses degree (1 for the other patterns' rings)."""
    return cand.ulysses if cand.cp_comm == "hybrid" else 1


def mla_thresholds(m, flops: float, bw: float, h: int, e: int, g: int, c: float, eff: float,
                   expanded: bool = False) -> Dict[str, float]:
    """thresholds for MLA's ring: a step sends C (R + dr) e bytes (backward with its fp32
    gradient) against c C^2 pairs at 2 (dqk + dv) h FLOPs each; the expanded form's K,V
    h (dqk + dv) numbers a token (its dK,dV in g). The kv_b_proj expansions, which add to
    the step's compute, are left out: the bound is the attention's alone."""
    w = mla_layers.ring_widths(m, h, expanded)
    pair = 2 * (2 * mla_layers.kernel_head_dim(m)) * h  # 4 h (dqk + dv) / 2
    fb = eff * flops / bw
    return {"fwd": fb * w * e / (pair * c),
            "bwd": fb * w * (e + (g if expanded else 4)) / (2.5 * pair * c)}


def mla_cp_time(m, cand: Candidate, cluster: Cluster, e: int, g: int,
                t_f_layer: float, attn_replay: float, expanded: bool = False):
    """layer_cp_time of an MLA layer: the same overlap rules (the ring's steps hide
    behind the step's attention and expansions, all-gather behind the local block,
    Ulysses' exchanges behind nothing) at the latent's bytes, or K,V's when expanded."""
    s = counts.rank_shapes(m, cand)
    f_cp, b_cp = mla_layers.mla_cp_bytes(m, cand.cp_comm, cand.cp, cand.ulysses, s.B,
                                         s.N // s.B, s.h, e, g, expanded)
    bw = cluster.link(cand.tp * cand.cp)
    cp_total = (f_cp * (1 + attn_replay) + b_cp) / bw
    if m.dsa is not None:  # the indexer key's pass (and the KL's): on the ring it hides
        # behind the scoring of each arriving block (2 Hi (D + 1) FLOPs a pair against
        # D e bytes a token); all-gather's waits as the latent's gather does
        x_f, x_b = dsa_layers.dsa_cp_bytes(m, cand.cp_comm, cand.cp, s.B, s.N // s.B, e)
        cp_total += (x_f * (1 + attn_replay) + x_b) / bw
        if cand.cp_comm == "allgather":
            f_cp, b_cp = f_cp + x_f, b_cp + x_b
    t_b_layer, u = 2.5 * t_f_layer, ulysses_of(cand)
    a_f = a_b = a2a = 0.0
    if u > 1:  # hybrid's Ulysses exchange inside, over NVLink when it fits
        a_f, a_b = mla_layers.ulysses_bytes(m, u, s.B, s.N // s.B, s.h, e, expanded)
        a2a = (a_f * (1 + attn_replay) + a_b) / cluster.link(cand.tp * u)
    if cand.cp_comm == "ring" or (cand.cp_comm == "hybrid" and cand.ring > 1):
        block, grad = mla_layers.ring_step_bytes(m, cand, s, e, g, expanded)
        steps = cand.ring
        fwd = max(0.0, block / bw - t_f_layer / steps) * (steps - 1)
        bwd = max(0.0, (block + grad) / bw - t_b_layer / steps) * (steps - 1) \
            + grad / bw  # the last gradient hop home waits
        return cp_total, fwd * (1 + attn_replay) + bwd + a2a
    if cand.cp_comm == "allgather":
        local = t_f_layer / cand.cp
        gather, scatter = f_cp / bw, (b_cp - f_cp) / bw
        return cp_total, (max(0.0, gather - local) * (1 + attn_replay)
                          + max(0.0, gather - 2.5 * local) + scatter)
    return cp_total, cp_total
