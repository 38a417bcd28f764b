"""DeepSeek-V4's attention (model.compressed_attention) under a layout: what one layer of each
type keeps for backward, from what models/compressed_attention.py and its cores
(ctxpar.context_parallel.compressed, compressed_sparse, compressor) save.

Per rank (counts.RankShapes): N = B T/P tokens, h = H/tp heads of width D (one K = V head),
Rq = q_lora_rank, g = o_groups/tp groups of o_lora_rank Ro, r = rotary_dim, m the layer's
compress rate, E = T // m the sequence's entries, n the windows this rank ends (its slabs',
compressor.slabs), e the activations' element size; 'c' = 4 + (e if e != 4) for a fp32
result that is cast back to e (both copies kept; in fp32 one tensor).

project_in   q_a_norm (a RMSNorm at Rq, its output q_b_proj's input), the queries'
             unweighted RMSNorm (q N h D e, its fp32 rstd N h 4; in bf16 also the fp32 copy
             of q and the cast rstd), kv_norm (its input and normed copy: RoPE keeps only
             cos/sin, none of its inputs); the compressors' projections read the block's
             normed x, the indexer runs without gradient (nothing saved)
core         q, kv, out (e) and lse (fp32, N h 4), the entries (B E D e, all-gathered);
             CSA's selection (int64 (N, index_topk + 2): rows, counts, starts) which the
             core's part holds beside autograd (compressed_sparse.EntrySelection)
compressor   per slab that ends windows: HCA the slab's rows with their halo, [kv ; gate]
             (B rows 2D e), CSA the two series' kv (B n 2m D e) and its first-window mask
             (E bools); the softmax over the slots (B n slots D c), the pooled fp32 entry,
             its rstd, the normed fp32 entry (B n (2D + 1) 4 + B n D 4), the entries'
             cos and sin (n r e)
project_out  -sin (T/P r/2 fp32, made per layer), o_a_proj's grouped input (N h D e),
             o_b_proj's (N g Ro e)

Step time (timing.step_time), per layer on the busiest rank:

pairs        every layer its window's (query, key) pairs (mask.visible_pairs at
             model.sliding_window); HCA adds each query's complete entries, (t + 1) // m at
             position t, CSA min(index_topk, (t + 1) // m) selected ones; 4 h D FLOPs a pair
             forward, 2.5x backward, as every attention (the sparse entries run as einsums
             at the same stated efficiency: a rough figure)
indexer      a CSA query scores every complete entry, 2 Hi (Di + 1) FLOPs each (replicated
             over TP), forward only; its projections are parameters (the matmul count) but
             get no gradient: 4 FLOPs a parameter and token fewer than the count assumes
compressors  their projections are parameters; the pooling (softmax over m slots, sum,
             norm) is elementwise and not counted
wire         (ctxpar.testing.compressed.sent_bytes' rule, slab by slab) forward: the
             window's K = V halo (comm_bytes.masked_cp_bytes at one K/V head, or the windowed
             ring where the halo does not fit), for each compressor (the attention's at D,
             CSA's indexer's at Di) the entries' all-gather, (P - 1) B share d e with share
             the most windows one rank ends, and the halo rows the rank sends, kv and gate
             (2 (2d) e a row with overlap, 2 d e without); backward: the entries'
             reduce-scatter, the received halo rows' gradients (fp32), the window's halo
             again and its gradients; the busiest rank's. The window's halo hides behind
             the local blocks as any halo (timing.layer_cp_time); the entries' gather and
             the compressors' halo run before the core and wait for nobody: exposed.

Checkpointing: 'full' keeps the block input (and CSA's selection); 'selective' the block input, the core and the
compressor (inside the core's call, never replayed); 'none' everything above.
Exact: tests/test_plan_v4.py (one process, fp32) against autograd's saved bytes.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..config import ModelConfig, rotary_dim
from ..config.layer_mixers import COMPRESSED_TYPES
from ..config.sections import resolved_head_dim

CSA = "compressed_sparse_attention"


def cast_bytes(e: int) -> int:
    """A fp32 result cast back to e: both kept (one tensor when e is 4)."""
    return 4 + (e if e != 4 else 0)


@lru_cache(maxsize=256)  # pure in its five numbers; the search asks the same per candidate
def slab_table(layout: str, P: int, T: int, rate: int, overlap: bool) -> tuple:
    """Per rank, ((rows, windows, halo, halo source rank) of each slab that ends windows,
    rows the slab's with its halo), from compressor.slabs of the sequence's windows."""
    from ..context_parallel.compressed_windows import document_windows
    from ..context_parallel.compressor import owner, slabs
    wins, S = document_windows(None, T, rate, False), T // P
    return tuple(tuple((sl.length + sl.halo, sl.windows, sl.halo,
                        owner(layout, P, S, sl.start - sl.halo)[0] if sl.halo else r)
                       for sl in slabs(layout, r, P, S, wins, overlap) if sl.windows)
                 for r in range(P))


def rank_windows(m: ModelConfig, kind: str, cand) -> tuple:
    """slab_table's slabs of the busiest rank (the most windows)."""
    table = slab_table(cand.token_layout, cand.cp, m.seq_len,
                       m.compressed_attention.rate(kind), kind == CSA)
    return max(table, key=lambda ws: sum(n for _, n, _, _ in ws))


def compressor_saved(s, e: int, cand, m: ModelConfig, kind: str) -> int:
    """Bytes one compressed layer's compressor keeps (module docstring: compressor)."""
    if kind not in COMPRESSED_TYPES:
        return 0
    D, rate, r = s.hd, m.compressed_attention.rate(kind), rotary_dim(m)
    slots = 2 * rate if kind == CSA else rate
    out = 0
    for rows, n, _, _ in rank_windows(m, kind, cand):
        kv = s.B * n * slots * D * e if kind == CSA else s.B * rows * 2 * D * e
        out += kv + s.B * n * slots * D * cast_bytes(e) + s.B * n * (2 * D + 1) * 4 + n * r * e
    if kind == CSA and out:
        out += m.seq_len // rate                     # the first-window mask (bool)
    return out


def core_saved(s, e: int, m: ModelConfig, kind: str) -> int:
    """Bytes the layer's core keeps (module docstring: core)."""
    out = s.N * (2 * s.h * s.hd * e + s.hd * e + 4 * s.h)
    if kind in COMPRESSED_TYPES:
        out += s.B * (m.seq_len // m.compressed_attention.rate(kind)) * s.hd * e
    return out + selection_kept(s, m, kind)


def selection_kept(s, m: ModelConfig, kind: str) -> int:
    """CSA's selection, int64 (N, index_topk + 2), which the core's part holds beside
    autograd's saved tensors: under 'full' too (a checkpointed forward keeps the graph's
    contexts, only their saved tensors go)."""
    return s.N * (m.compressed_attention.index_topk + 2) * 8 if kind == CSA else 0


def projections_saved(s, e: int, cand, m: ModelConfig, device: str, norm_saved) -> int:
    """Bytes project_in and project_out keep in mode 'none' (module docstring);
    norm_saved: counts.norm_saved."""
    ca = m.compressed_attention
    q_norm = norm_saved(replace(s, d=ca.q_lora_rank), e, "rmsnorm", device)
    kv_norm = norm_saved(replace(s, d=s.hd), e, "rmsnorm", device) - s.N * s.hd * e
    q = s.N * s.h * (s.hd * e + 4) + (s.N * s.h * (4 * s.hd + e) if e != 4 else 0)
    sin = (m.seq_len // cand.cp) * rotary_dim(m) // 2 * 4
    o = s.N * (s.h * s.hd + ca.o_groups // cand.tp * ca.o_lora_rank) * e
    return q_norm + kv_norm + q + sin + o


def attention_saved(s, e: int, cand, m: ModelConfig, kind: str, mode: str,
                    device: str, norm_saved) -> int:
    """Bytes one V4 attention keeps beyond its block's norm (beyond its input under
    'full') in `mode`; norm_saved: counts.norm_saved (the bottleneck's and kv's RMSNorms)."""
    if mode == "full":
        return selection_kept(s, m, kind)
    kept = core_saved(s, e, m, kind) + compressor_saved(s, e, cand, m, kind)
    if mode == "selective":
        return kept
    return kept + projections_saved(s, e, cand, m, device, norm_saved)


def rank_spans(T: int, P: int, layout: str, rank: int) -> list:
    """The [lo, hi) position ranges `rank` holds (contiguous: one slab; zigzag: two)."""
    S = T // P
    if layout == "contiguous" or P == 1:
        return [(rank * S, (rank + 1) * S)]
    c = S // 2
    return [(rank * c, (rank + 1) * c), ((2 * P - 1 - rank) * c, (2 * P - rank) * c)]


def entry_pairs(lo: int, hi: int, m: int, k=None) -> int:
    """Sum over queries lo <= t < hi of their entries, (t + 1) // m (at most k)."""
    def upto(n):  # sum_{u=1}^{n} min(k, u // m)
        cap = n if k is None else min(n, k * m - 1)
        q, r = divmod(cap, m)
        return m * q * (q - 1) // 2 + q * (r + 1) + (0 if k is None else max(0, n - cap) * k)
    return upto(hi) - upto(lo)


def layer_pairs(m: ModelConfig, cand, kind: str):
    """(attention pairs, indexer pairs) of one layer on the busiest rank (module
    docstring: pairs, indexer)."""
    from ..context_parallel.mask import visible_pairs
    ca, T, w = m.compressed_attention, m.seq_len, m.sliding_window
    best = (0, 0)
    for r in range(cand.cp):
        pairs = index = 0
        for lo, hi in rank_spans(T, cand.cp, cand.token_layout, r):
            pairs += visible_pairs(lo, hi, w)
            if kind in COMPRESSED_TYPES:
                rate = ca.rate(kind)
                pairs += entry_pairs(lo, hi, rate, ca.index_topk if kind == CSA else None)
                index += entry_pairs(lo, hi, rate) if kind == CSA else 0
        best = max(best, (pairs, index))
    return best


def attention_flops(m: ModelConfig, cand, s, kind: str):
    """(attention, indexer) forward FLOPs of one layer on the busiest rank."""
    pairs, index = layer_pairs(m, cand, kind)
    ca = m.compressed_attention
    return (4 * s.h * s.hd * s.B * pairs,
            2 * ca.index_n_heads * (ca.index_head_dim + 1) * s.B * index)


def stage_time(m: ModelConfig, cand, s, stage, t_attn_layers, attn_rate: float,
               mm_rate: float):
    """(each layer's attention forward seconds, the indexers' forward seconds, the matmul
    seconds the indexers' missing backward saves) of a stage (timing.step_time): the
    compressed layers' pairs and indexer in place of t_attn_layers' (their indexer's
    seconds included, as DSA's are, for the ring steps to hide behind); attn_rate and
    mm_rate: FLOP/s at the kernels' efficiencies."""
    if m.compressed_attention is None:
        return t_attn_layers, 0.0, 0.0
    flops = [attention_flops(m, cand, s, a.kind) if a.kind in COMPRESSED_TYPES else (0, 0)
             for a in stage]
    layers = [t if a.kind not in COMPRESSED_TYPES else (f + i) / attn_rate
              for t, a, (f, i) in zip(t_attn_layers, stage, flops)]
    index = sum(i for _, i in flops) / attn_rate
    csa = sum(a.kind == CSA for a in stage)
    return layers, index, csa * 4 * s.N * indexer_params(m) / mm_rate


def indexer_params(m: ModelConfig) -> int:
    """The parameters of one CSA layer's indexer (no gradient reaches them)."""
    ca, d, di = m.compressed_attention, m.d_model, m.compressed_attention.index_head_dim
    rate = ca.rate(CSA)
    return (rate * 2 * di + 2 * d * 2 * di + di + ca.q_lora_rank * ca.index_n_heads * di
            + d * ca.index_n_heads)


def compressor_wire(m: ModelConfig, cand, kind: str, B: int, e: int, rank: int):
    """(forward, backward) bytes `rank` sends for one compressed layer's compressors (the
    entries' gather and halo rows; module docstring: wire)."""
    P = cand.cp
    if P == 1 or kind not in COMPRESSED_TYPES:
        return 0, 0
    ca, csa = m.compressed_attention, kind == CSA
    per = slab_table(cand.token_layout, P, m.seq_len, ca.rate(kind), csa)
    share = max(sum(n for _, n, _, _ in sls) for sls in per)
    sent = recv = 0
    for r, sls in enumerate(per):
        for _, _, halo, src in sls:
            if src != r:
                sent += halo if src == rank else 0
                recv += halo if r == rank else 0
    D = resolved_head_dim(m)
    widths = [D] + ([ca.index_head_dim] if csa else [])
    fwd = sum((P - 1) * B * share * d * e + sent * B * 2 * (2 * d if csa else d) * e
              for d in widths)
    bwd = (P - 1) * B * share * D * e + recv * B * 2 * (2 * D if csa else D) * 4
    return fwd, bwd


def cp_parts(m: ModelConfig, cand, kind: str, B: int, e: int, window):
    """((window fwd, bwd), (compressors fwd, bwd)) bytes of the busiest rank in one
    compressed layer (module docstring: wire); window(rank) -> the window's (fwd, bwd)
    (comm_bytes.masked_cp_bytes at one K = V head)."""
    best = None
    for r in range(cand.cp):
        win, comp = window(r), compressor_wire(m, cand, kind, B, e, r)
        if best is None or sum(win) + sum(comp) > sum(best[0]) + sum(best[1]):
            best = (win, comp)
    return best


def model_line(cfg, plan, e: int) -> str:
    """One line for a DeepSeek-V4 model: its layer types, the entries a rank keeps per
    micro-batch, the head dim and the kernels that cannot take it (kv_layers.
    kernels_refusing: V4's 512 runs on the math kernel on CUDA), e the activations'
    element size; '' otherwise."""
    from ..config.layer_mixers import layer_types
    from .kv_layers import kernels_refusing
    m, cand = cfg.model, plan.candidate
    if m.compressed_attention is None:
        return ""
    ca, types = m.compressed_attention, layer_types(m)
    B = cand.micro_batch
    kept = sum(B * (m.seq_len // ca.rate(k)) * resolved_head_dim(m) * e for k in types
               if k in COMPRESSED_TYPES)
    counts_ = ", ".join(f"{types.count(k)} {k}" for k in
                        ("sliding_attention", CSA, "heavily_compressed_attention"))
    refusing = kernels_refusing(m)
    return (f"DeepSeek-V4 attention: {counts_} (compress rates {dict(ca.compress_rates)}, "
            f"index_topk {ca.index_topk}); their entries {kept / 1e9:.3f} GB a micro-batch "
            f"on a rank; " + (refusing or f"head dim {resolved_head_dim(m)}: every kernel "
                                          f"takes it"))
