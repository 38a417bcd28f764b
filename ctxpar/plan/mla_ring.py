"""DeepSeek-V3's MLA layer over a CP ring: the latent on the wire against a ring of the
expanded K,V (a what-if; ctxpar builds only the latent ring). Predicted, not measured.

    python -m ctxpar.plan.mla_ring [--seq-len 131072] [--gpu h100]

For each placement of the ring (8 ranks of one node over NVLink; 8 ranks one per node over
the network, TP 8 inside each node) it prints one MLA layer's forward + backward on the
busiest rank (mla_layer_time): the attention kernel, kv_b_proj, the CP bytes a
rank sends and the seconds the ring does not hide, for both forms, and which is faster
and why. The latent moves R + dr numbers a token (576 for V3) and its fp32 gradient, but
expands every visiting block with kv_b_proj (2 R h (dn + dv) FLOPs a key row, 4x in
forward + backward); the expanded form moves h (dqk + dv) numbers a token (40,960 at 128
heads; TP splits them, not the latent) and applies kv_b_proj once to its own tokens.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

from ..config import ModelConfig
from ..config.layers import layer_attention
from ..config.mla import MLAConfig
from . import counts, mla_layers
from .candidate import Candidate
from .cluster import Cluster, gpu_preset
from .mla_timing import mla_cp_time
from .timing import ATTN_EFF, MM_EFF, head_pairs

# DeepSeek-V3's attention (its config.json): d 7168, 128 heads, q_lora_rank 1536,
# kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; the MLP does not enter the comparison
V3_MLA = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)


def deepseek_v3(seq_len: int) -> ModelConfig:
    return ModelConfig(vocab_size=129280, seq_len=seq_len, n_layers=61, d_model=7168,
                       n_heads=128, ffn_hidden=18432, mla=V3_MLA, tie_embeddings=False)


def mla_layer_time(m, cand: Candidate, cluster: Cluster, e: int, expanded: bool = False,
                   mm_eff: float = MM_EFF, attn_eff: float = ATTN_EFF) -> Dict[str, float]:
    """One MLA layer's attention, forward and backward without replay, on the busiest
    rank, as step_time counts it: the kernel's pairs, kv_b_proj (the latent: on every
    visiting block, 4x forward in all; expanded: once on the local tokens, 3x) and the CP
    traffic, all of it and what the ring does not hide. The what-if of the expanded ring
    (mla_layers' module docstring) against the latent one, term by term."""
    s, F = counts.rank_shapes(m, cand), cluster.gpu.flops
    g = counts.ring_grad_bytes(cand.ring_grad_dtype)
    attn = next(a for a in layer_attention(m) if a.token_mixer in ("mla", "dsa"))
    t_pairs = 4 * mla_layers.kernel_head_dim(m) * s.B * head_pairs(cand, s, m.seq_len, attn) \
        / (F * attn_eff)
    if expanded:
        t_kv, passes, hides = mla_layers.local_expansion_flops(m, s) / (F * mm_eff), 3, t_pairs
    else:
        t_kv = mla_layers.expansion_flops(m, cand, s) / (F * mm_eff)
        passes, hides = 4, t_pairs + t_kv
    total, exposed = mla_cp_time(m, cand, cluster, e, g, hides, 0.0, expanded) \
        if cand.cp > 1 else (0.0, 0.0)
    sent = mla_layers.mla_cp_bytes(m, cand.cp_comm, cand.cp, cand.ulysses, s.B, s.N // s.B,
                                   s.h, e, g, expanded)
    return {"attention": 3.5 * t_pairs, "kv_b_proj": passes * t_kv, "cp_exposed": exposed,
            "cp_total": total, "bytes": float(sum(sent)),
            "total": 3.5 * t_pairs + passes * t_kv + exposed}


def placements(gpu: str) -> List[Tuple[str, Cluster, Candidate]]:
    """(name, cluster, layout): cp8 inside a node; the same ring over 8 nodes; cp8 over 8
    nodes with tp8 in each (a rank's heads, and the expanded K,V, split 8 ways; the
    latent is not)."""
    h = gpu_preset(gpu)
    return [("cp8 on 8 GPUs of one node (NVLink)", Cluster(1, 8, h), Candidate(1, 8, 1, 1)),
            ("cp8 on 8 nodes, one GPU each (network)", Cluster(8, 1, h),
             Candidate(1, 8, 1, 1)),
            ("cp8 over 8 nodes, tp8 in each (network)", Cluster(8, 8, h),
             Candidate(8, 8, 1, 1))]


def compare(m: ModelConfig, cluster: Cluster, cand: Candidate, e: int = 2) -> str:
    """One line: both forms' per-layer seconds, bytes, the faster one and why."""
    lat, exp = (mla_layer_time(m, cand, cluster, e, expanded) for expanded in (False, True))

    def form(t):
        return (f"{1e3 * t['total']:.1f} ms (attention {1e3 * t['attention']:.1f}, kv_b_proj "
                f"{1e3 * t['kv_b_proj']:.1f}, CP {t['bytes'] / 1e9:.2f} GB sent, "
                f"{1e3 * t['cp_exposed']:.1f} not hidden)")
    extra = lat["kv_b_proj"] - exp["kv_b_proj"]
    saved = exp["cp_exposed"] - lat["cp_exposed"]
    costs = (f"the expanded K,V's transfers not hidden ({1e3 * saved:.1f} ms more) against "
             f"the latent's kv_b_proj on every visiting block ({1e3 * extra:.1f} ms more)")
    faster = "latent" if lat["total"] <= exp["total"] else "expanded"
    why = f"{faster} faster by {1e3 * abs(exp['total'] - lat['total']):.1f} ms: {costs}"
    return f"latent {form(lat)}; expanded {form(exp)}: {why}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--gpu", default="h100")
    a = ap.parse_args(argv)
    m = deepseek_v3(a.seq_len)
    print(f"DeepSeek-V3's MLA layer (128 heads, latent 512 + 64), {a.seq_len:,} tokens, bf16, "
          f"ring/zigzag, one layer forward + backward on the busiest rank (predicted):")
    for name, cluster, cand in placements(a.gpu):
        print(f"{name}: {compare(m, cluster, cand)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
