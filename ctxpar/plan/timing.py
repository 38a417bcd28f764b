"""Step time of a layout: compute at a stated efficiency, plus what communication cannot hide.

Per micro-batch and pipeline stage (the most loaded rank):
- matmuls: 2 FLOPs per parameter of the stage per local token forward, 4 backward, and a
  forward's worth again for the blocks checkpointing replays (full: the whole block;
  selective: the projections; every_n_layers: the replayed blocks), at ``mm_eff`` x peak;
- attention: 4 * heads * head_dim FLOPs per (query, key) pair forward, 2.5x that backward
  (context_parallel/stats.py), pairs of the busiest rank under the layout (zigzag and
  striped balanced, contiguous not), each layer its own (config.layers.layer_attention: a
  window's or chunks' visible pairs, mask.visible_pairs: about n w for a window w), a
  forward again when full checkpointing replays it, at ``attn_eff`` x peak;
- per-op overhead: the device's seconds per layer per micro-batch that are neither FLOPs
  nor bytes (cluster.GPU.overhead: fitted on CPU, 0 for GPUs until measured);
- TP: two all-reduces of N d e bytes forward and two backward per block (and the replayed
  forward's), over NVLink, not overlapped;
- CP: the bytes of comm_bytes.cp_bytes. The ring overlaps each step's transfer with the step's
  compute and exposes only max(0, transfer - compute) per step (Ring Attention's overlap condition C >= F/B,
  generalised below); all-gather hides its gather behind the local block only; Ulysses'
  all-to-alls wait for nobody and hide behind nothing; hybrid is both; a windowed or
  chunked layer whose reach fits the neighbours' slabs exchanges a halo instead
  (comm_bytes.masked_cp_bytes: window - 1 tokens a neighbour, independent of n) behind its
  local blocks, and a ring that the window ends early takes fewer steps;
- the memory options (docs/memory.md): the tiled loss makes its gradients in forward, three
  head matmuls per tile as untiled at TP 1, four at TP > 1 (the logits again once the
  log-sum-exp over TP is known); the tiled MLP runs its forward again in backward (2 FLOPs
  per MLP parameter per token; a MoE layer's routed experts, k a token, and their
  all-to-alls again, except in a replayed block whose recompute skips them:
  moe_layers.recompute_skipping_layers); activation offload copies each layer's saved activations
  to the host in forward and back in backward over ``pcie``: on CUDA on side streams,
  exposed only where a layer's copy outlasts the layer's compute, on CPU not overlapped;
- MoE (moe_layers.py): the matmuls of the active parameters (each token's k of E experts
  and the dense ones); the all-to-alls of the routed rows, 2 N k d e forward and backward
  each, (ep - 1)/ep of them off the rank (balanced routing), over the EP group's link, not
  overlapped; the experts' gradients reduced over their expert-data-parallel group;
- MLA (mla_layers.py): the attention at dqk for the scores and dv for the values; kv_b_proj
  on every visiting latent block (forward, 3x backward) instead of once per token; the
  latent's bytes (R + dr a token, its gradient fp32) behind the ring steps (mla_timing.py);
  step_time(expanded=True) prices a ring of the expanded K,V instead (a what-if);
- DeepSeek-V4 (compressed_layers.py): a compressed layer's window pairs and entries (HCA
  all complete ones, CSA its top-k), its indexer's scores forward only, the entries'
  all-gather and the compressors' halo exposed before the core;
then the pipeline (1F1B: (m + pp - 1) micro-batch slots for m micro-batches) and the data
parallel reduction of the gradients over dp x cp (all-reduce, or ZeRO's reduce-scatter +
all-gather, twice the parameters' all-gathers under ZeRO-3), not overlapped; optimizer
offload adds, per step, the gradient partition's copy to the host (fp32) and the
parameters' back (psi/D each) over ``pcie`` and the host's Adam over every GPU's
partition of the node at ``host_adam`` parameters/s.

Generalised threshold: a ring step carries C = T/r tokens of K,V (r ring ranks) at Hkv/tp
heads. It computes c * C^2 pairs (c = 1 for contiguous's full blocks, 1/2 for zigzag's half
blocks and striped's triangles)
at 4 h hd FLOPs each (at eff x F FLOP/s), and sends 2 C hk hd e bytes at B bytes/s, so
the transfer hides when
    forward:  C >= (eff F / B) * (hk/h) * (e/2) / c
    backward: C >= (eff F / B) * (hk/h) * (e + g) / (5 c)      (g: the dK,dV dtype's bytes)
which for MHA, bf16, c = 1, eff = 1 is the seed's C >= F/B (a slower kernel hides more).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, NamedTuple

from ..config import GATED_MLPS, Config
from ..config.layers import LayerAttention, layer_attention
from ..config.layer_mixers import COMPRESSED_TYPES, LINEAR_MIXERS
from ..context_parallel.mask import visible_pairs
from . import comm_bytes, compressed_layers, counts, dsa_layers, mla_layers
from .mla_timing import mla_cp_time, mla_thresholds, ulysses_of
from .kv_layers import exchange_held, wire_tensors
from .linear_layers import linear_shapes, mixer_cp_bytes, mixer_flops
from .linear_tiles import mixer_params
from .moe_layers import (all_to_all_bytes, idle_expert_params, mixed_mlps, moe_layers,
                         recompute_skipping_layers)
from .candidate import Candidate
from .cluster import Cluster

ATTENTION = ("attention", "mla", "dsa", "compressed")  # the token mixers with (query, key) pairs
MM_EFF = 0.55    # matmul efficiency of peak (Megatron-style dense layers on H100, bf16)
ATTN_EFF = 0.45  # flash attention forward + backward (FA2/FA3 report 35-75% on H100)


@dataclass
class StepTime:
    compute: float
    tp: float
    cp_exposed: float
    cp_total: float
    bubble: float
    dp: float
    micro_batches: int
    overhead: float = 0.0               # the device's per-layer, per-micro-batch cost
    offload: float = 0.0                # offload copies not hidden, and the host's Adam
    moe: float = 0.0                    # the experts' all-to-alls (not overlapped)
    ring_chunk: int = 0                 # C, tokens per ring step
    thresholds: Dict[str, float] = field(default_factory=dict)  # C* fwd / bwd
    cp_link: str = ""

    @property
    def total(self) -> float:
        return self.compute + self.overhead + self.tp + self.cp_exposed + self.bubble \
            + self.dp + self.offload + self.moe

    def bottleneck(self) -> str:
        parts = {"compute": self.compute, "per-op overhead": self.overhead,
                 "TP all-reduces": self.tp,
                 f"CP traffic not hidden ({self.cp_link})": self.cp_exposed,
                 "pipeline bubble": self.bubble, "DP gradient reduction": self.dp,
                 "offload copies and host Adam": self.offload,
                 "MoE all-to-alls": self.moe}
        name, t = max(parts.items(), key=lambda kv: kv[1])
        return f"{name} ({100 * t / self.total:.0f}%)"


@lru_cache(maxsize=4096)  # pure in its five numbers; the search asks the same ones per candidate
def rank_pairs(T: int, ranks: int, layout: str, sliding_window=None, chunk_size=None) -> int:
    """Causal (query, key) pairs of the busiest of `ranks` ring ranks (all its steps),
    under a sliding window and/or chunks when given: mask.visible_pairs of the positions
    it holds (contiguous: one slab; zigzag: two; striped: an equal share)."""
    def pairs(lo, hi):
        return visible_pairs(lo, hi, sliding_window, chunk_size)
    if ranks == 1:
        return pairs(0, T)
    s = T // ranks
    if layout == "contiguous":
        return max(pairs(r * s, (r + 1) * s) for r in range(ranks))
    if layout == "zigzag":
        c = s // 2
        return max(pairs(r * c, (r + 1) * c) + pairs((2 * ranks - 1 - r) * c,
                                                      (2 * ranks - r) * c)
                   for r in range(ranks))
    return (pairs(0, T) + ranks - 1) // ranks  # striped: equal shares


def dsa_attention_time(m, cand: Candidate, s) -> float:
    """Forward FLOPs of a DSA layer's sparse attention on the busiest rank: its selected
    pairs (a window of index_topk's count) at the absorbed form's width (dsa_layers)."""
    pairs = s.h * rank_pairs(m.seq_len, cand.cp, cand.token_layout, m.dsa.index_topk)
    return 4 * dsa_layers.kernel_head_dim(m) * s.B * pairs


def indexer_time(m, cand: Candidate, s):
    """(forward, backward) FLOPs of one DSA layer's indexer on the busiest rank: every
    visible pair scored, the KL pass over its set (dsa_layers.indexer_flops)."""
    return dsa_layers.indexer_flops(
        m, cand.tp, s.B, rank_pairs(m.seq_len, cand.cp, cand.token_layout),
        rank_pairs(m.seq_len, cand.cp, cand.token_layout, m.dsa.index_topk))


def stage_block_params(m, cand: Candidate) -> int:
    """The blocks' parameters on one rank of the stage with the most (every block alike:
    the first stage, which holds one more when pp does not divide the layers), each block
    its own (layer types; dense and MoE MLPs) and every expert counted."""
    if m.layer_types is None and not mixed_mlps(m):
        return -(-m.n_layers // cand.pp) * counts.block_params(m, cand.tp)
    return max(counts.stage_block_params(m, cand.tp, cand.pp, st) for st in range(cand.pp))


def stage_attention(m, pp: int) -> List[LayerAttention]:
    """The layers' attention (config.layers.layer_attention) of the pipeline stage with
    the most attention pairs (the first stages hold one more layer when pp does not
    divide the layers; windows make layers unequal)."""
    kinds, start, stages = layer_attention(m), 0, []
    for st in range(pp):
        n = counts.stage_layers(m, pp, st)
        stages.append(kinds[start:start + n])
        start += n
    return max(stages, key=lambda layers: (sum(rank_pairs(m.seq_len, 1, "contiguous",
                                                          a.sliding_window, a.chunk_size)
                                               for a in layers), len(layers)))


def head_pairs(cand: Candidate, s, T: int, attn: LayerAttention) -> int:
    """(head, query, key) triples the busiest rank computes in one layer's attention
    (none in a layer without attention: linear mixers, MLP-only blocks)."""
    if attn.token_mixer not in ATTENTION:
        return 0
    w, c = attn.sliding_window, attn.chunk_size
    if cand.cp_comm == "ulysses" and cand.cp > 1:  # all T tokens of h/cp heads
        return s.h // cand.cp * rank_pairs(T, 1, cand.token_layout, w, c)
    if cand.cp_comm == "hybrid":  # the ring over r ranks of u*s tokens, h/u heads
        return s.h // cand.ulysses * rank_pairs(T, cand.ring, cand.token_layout, w, c)
    return s.h * rank_pairs(T, cand.cp, cand.token_layout, w, c)


def thresholds(flops: float, bw: float, h: int, hk: int, e: int, g: int, c: float,
               eff: float) -> Dict[str, float]:
    """Tokens per ring step above which the step's K,V transfer hides (module docstring)."""
    fb = eff * flops / bw
    return {"fwd": fb * (hk / h) * (e / 2) / c, "bwd": fb * (hk / h) * (e + g) / (5 * c)}


def cp_time(cfg: Config, cand: Candidate, cluster: Cluster, e: int, g: int,
            stage: List[LayerAttention], t_attn_layers: List[float], attn_replay: float,
            attn_eff: float, expanded: bool = False):
    """(all CP seconds, those not hidden, the ring's tokens per step C, its C* fwd/bwd) per
    micro-batch, the sum of layer_cp_time over the stage's layers (stage: their
    attention; t_attn_layers: each one's attention forward seconds)."""
    if cand.cp == 1:
        return 0.0, 0.0, 0, {}
    total = exposed = 0.0
    done = {}  # (kind, window, chunk, shared-KV role) -> the layer's (total, exposed)
    for attn, t_f in zip(stage, t_attn_layers):
        key = (attn.kind, attn.sliding_window, attn.chunk_size, attn.kv_source is not None,
               attn.keeps_shared_kv)
        if attn.token_mixer is None:
            continue  # an MLP-only block: nothing over CP
        if key not in done:
            done[key] = layer_cp_time(cfg, cand, cluster, e, g, attn, t_f, attn_replay,
                                      expanded) \
                if attn.token_mixer in ATTENTION else \
                linear_cp_time(cfg, cand, cluster, e, attn.kind, attn_replay)
        total, exposed = total + done[key][0], exposed + done[key][1]
    if cand.cp_comm == "ring" or (cand.cp_comm == "hybrid" and cand.ring > 1):
        # Pairs per step: zigzag's half blocks and striped's triangles ~C^2/2, contiguous
        # full blocks (its busiest rank's steps).
        s = counts.rank_shapes(cfg.model, cand)
        c = 1.0 if cand.token_layout == "contiguous" else 0.5
        bw = cluster.link(cand.tp * cand.cp)
        thr = mla_thresholds(cfg.model, cluster.gpu.flops, bw, s.h // ulysses_of(cand), e,
                             g, c, attn_eff, expanded) if cfg.model.mla is not None else \
            thresholds(cluster.gpu.flops, bw, s.h, s.hk, e, g, c, attn_eff)
        return total, exposed, cfg.model.seq_len // cand.ring, thr
    return total, exposed, 0, {}


def layer_cp_time(cfg: Config, cand: Candidate, cluster: Cluster, e: int, g: int,
                  attn: LayerAttention, t_f_layer: float, attn_replay: float,
                  expanded: bool = False):
    """(all CP seconds, those not hidden) of one layer per micro-batch: bytes over the CP
    group's slowest link; the ring (and hybrid's ring) hides each step's transfer behind
    the step's compute, all-gather its gather behind the local block, Ulysses nothing
    (module docstring); a halo exchange (a short window or chunks, comm_bytes.masked_cp_bytes)
    hides its K,V tails behind the local blocks, and its dK,dV going back wait. MLA: the
    latent's blocks (or, expanded, K,V at its widths: mla_layers.mla_cp_bytes)."""
    m, s = cfg.model, counts.rank_shapes(cfg.model, cand, attn.kind)  # its K/V heads
    if m.mla is not None:
        return mla_cp_time(m, cand, cluster, e, g, t_f_layer, attn_replay, expanded)
    if m.compressed_attention is not None and attn.kind in COMPRESSED_TYPES:
        (wf, wb), (cf, cb) = comm_bytes.compressed_cp_parts(m, cand, e, attn)
        bw = cluster.link(cand.tp * cand.cp)
        fwd = max(0.0, wf / bw - t_f_layer)  # the window's halo behind the local blocks
        bwd = max(0.0, wf / bw - 2.5 * t_f_layer) + (wb - wf) / bw
        return (((wf + cf) * (1 + attn_replay) + wb + cb) / bw,  # the compressors': exposed
                fwd * (1 + attn_replay) + bwd + (cf * (1 + attn_replay) + cb) / bw)
    f_cp, b_cp = comm_bytes.layer_cp_bytes(m, cand, e, attn)
    bw = cluster.link(cand.tp * cand.cp)
    cp_total = (f_cp * (1 + attn_replay) + b_cp) / bw
    r, t_b_layer = cand.ring, 2.5 * t_f_layer
    u = cand.ulysses if cand.cp_comm == "hybrid" else 1
    a_f = a_b = a2a = 0.0
    if u > 1:  # the Ulysses all-to-alls inside, over NVLink when they fit
        a_f, a_b = comm_bytes.cp_bytes("ulysses", u, u, s.B, s.N // s.B, s.h, s.hk, s.hd, e,
                                   kv_tensors=wire_tensors(m, attn, cand))
        a2a = (a_f * (1 + attn_replay) + a_b) / cluster.link(cand.tp * u)
    if comm_bytes.halo_received(m, cand, attn) >= 0:
        kv, both = (f_cp - a_f) / bw, (b_cp - a_b) / bw  # the halo's own bytes
        fwd = max(0.0, kv - t_f_layer)
        bwd = max(0.0, kv - t_b_layer) + both - kv  # dK,dV back after the halo's blocks
        return cp_total, fwd * (1 + attn_replay) + bwd + a2a
    if cand.cp_comm == "ring" or (cand.cp_comm == "hybrid" and r > 1):
        hk = counts.ulysses_kv_heads(s.hk, u) if u > 1 else s.hk
        n = wire_tensors(m, attn, cand)  # K, V; or k_proj x (its gradient fp32)
        kv_step = n * s.B * (s.N // s.B) * u * (hk // u) * s.hd * e
        dkv_step = n * s.B * (s.N // s.B) * u * (hk // u) * s.hd * (g if n == 2 else 4)
        steps = 1 + round((f_cp - a_f) / kv_step)  # < r: a window ends the ring early
        fwd = max(0.0, kv_step / bw - t_f_layer / steps) * (steps - 1)
        bwd = max(0.0, (kv_step + dkv_step) / bw - t_b_layer / steps) * (steps - 1) \
            + dkv_step / bw  # the last dK,dV hop home waits
        return cp_total, fwd * (1 + attn_replay) + bwd + a2a
    if cand.cp_comm == "allgather":
        local = t_f_layer / cand.cp  # the local block, computed while the gather runs
        # backward: gather again + RS; a shared-KV producer's slots are held: RS alone
        # (no halo here: that returned above)
        held = attn.keeps_shared_kv and exchange_held(m, attn, cand, halo=False)
        again = 0 if held else f_cp
        gather, scatter = f_cp / bw, (b_cp - again) / bw
        return cp_total, (max(0.0, gather - local) * (1 + attn_replay)
                          + (max(0.0, gather - 2.5 * local) if again else 0.0) + scatter)
    return cp_total, cp_total  # ulysses: nothing to hide behind


def linear_cp_time(cfg: Config, cand: Candidate, cluster: Cluster, e: int, kind: str,
                   replay: float):
    """(all CP seconds, those not hidden) of one linear layer per micro-batch: the conv's
    halo, then state passing's fp32 summaries (an all-gather forward, a reduce-scatter
    backward) or heads' all-to-alls (linear_layers.mixer_cp_bytes), over the CP group's
    slowest link; none hides (each waits for the kernel before it or feeds the one
    after), a replayed forward's again."""
    s = counts.rank_shapes(cfg.model, cand)
    sh = linear_shapes(cfg.model, kind, cand.tp)
    fwd, bwd = mixer_cp_bytes(kind, sh, s.B, s.N // s.B, e, cand.cp, cand.linear_cp,
                              cand.token_layout)
    t = (fwd * (1 + replay) + bwd) / cluster.link(cand.tp * cand.cp)
    return t, t


def linear_compute(m, cand: Candidate, s, stage: List[LayerAttention]) -> float:
    """Forward FLOPs of the stage's linear mixers' chunked kernels (linear_layers)."""
    return sum(mixer_flops(a.kind, linear_shapes(m, a.kind, cand.tp), s.N, cand.linear_cp,
                           cand.cp) for a in stage if a.token_mixer in LINEAR_MIXERS)


def linear_elementwise(m, cand: Candidate, s, stage: List[LayerAttention],
                       per_channel: float) -> float:
    """Seconds (forward + backward) of the stage's linear mixers' work that is not their
    kernels' FLOPs: each local token's conv channels at the device's linear_overhead."""
    if not per_channel:
        return 0.0
    return per_channel * s.N * sum(linear_shapes(m, a.kind, cand.tp).conv_channels
                                   for a in stage if a.token_mixer in LINEAR_MIXERS)


def offload_time(cfg: Config, cand: Candidate, cluster: Cluster, e: int, layers: int,
                 compute: float) -> float:
    """Activation offload's copies per micro-batch not hidden behind the compute (CUDA:
    side streams, a layer's copy against its forward and backward; CPU: not overlapped)."""
    m = cfg.model
    offload = 0.0
    if cand.offload_activations and cand.activation != "none":
        act = counts.activations(m, cand, e, layers, tiled_mlp=cand.tiled_mlp,
                                 device=cluster.gpu.kind)
        copy = sum(act.layers) / cluster.gpu.pcie  # one way, all layers
        if cluster.gpu.kind == "cuda":  # side streams: hidden behind each layer's compute
            c, f = copy / layers, compute / layers / 3  # a layer's copy; its forward
            offload = layers * (max(0.0, c - f) + max(0.0, c - 2 * f))  # backward ~ 2 f
        else:
            offload = 2 * copy
    return offload


class MicroCompute(NamedTuple):
    """One micro-batch's compute on the busiest stage, and what the collectives need."""

    seconds: float               # matmuls, attention, linear mixers, expansions, indexers
    attn_layers: List[float]     # each layer's attention forward seconds (the ring hides)
    moe_layers: int              # the stage's MoE layers
    routed_again: float          # MoE layers whose routed experts run again (replay)


def micro_compute(cfg: Config, cand: Candidate, cluster: Cluster, s, stage, layers: int,
                  replay: float, attn_replay: float, mm_eff: float, attn_eff: float,
                  expanded: bool) -> MicroCompute:
    """The compute of one micro-batch on the busiest stage (the module docstring's
    matmuls, attention, linear mixers, MLA's expansions, DSA's and V4's indexers)."""
    m, F = cfg.model, cluster.gpu.flops
    head = 2 * s.N * m.d_model * s.V  # logits matmul (not a lookup, unlike the embedding)
    mlp_p = (3 if m.mlp in GATED_MLPS else 2) * s.d * s.f  # the MLP's weights on a rank
    # a MoE's tokens each run k of E experts: the active parameters (moe_layers), whatever
    # ep (under EP a rank runs E/ep experts over the N k ep / E rows of each, balanced)
    blocks = stage_block_params(m, cand) - idle_expert_params(m, cand.tp, layers)
    # a tiled MLP runs its forward again in backward: a dense block its MLP, a MoE block
    # its routed experts (k of them a token; the router and the shared expert run once),
    # but a replayed block's recompute skips its tiled experts where the block keeps
    # nothing of their output (moe_layers.recompute_skipping_layers): the tiles' replay
    # takes the recompute's place, nothing more than untiled
    n_moe = moe_layers(m, 0, layers) if m.moe is not None else 0
    routed_p = m.moe.top_k * (3 if m.mlp in GATED_MLPS else 2) * s.d \
        * ((m.moe.expert_hidden or s.f * cand.tp) // cand.tp) if n_moe else 0
    routed_again = n_moe - replay * recompute_skipping_layers(m, 0, layers) if n_moe else 0
    mm = (2 * s.N * blocks) * (3 + replay) \
        + (4 if cand.tiled_loss and cand.tp > 1 else 3) * head \
        + (2 * s.N * ((layers - n_moe) * mlp_p + routed_again * routed_p) if cand.tiled_mlp
           else 0)

    def sparse(a):  # a DSA layer attending over the indexer's selection
        return a.token_mixer == "dsa" and dsa_layers.sparse_attention(m)

    # Attention FLOPs (forward) of the busiest rank: head-pairs it computes, per layer of
    # the busiest stage (a window's or chunks' visible pairs only).
    hd = mla_layers.kernel_head_dim(m) if m.mla is not None else s.hd
    t_attn_layers = [4 * hd * s.B * head_pairs(cand, s, m.seq_len, a) / (F * attn_eff)
                     if not sparse(a) else dsa_attention_time(m, cand, s) / (F * attn_eff)
                     for a in stage]
    # DeepSeek-V4: entries, indexer (forward only; 0s, and t_attn_layers as is, otherwise)
    t_attn_layers, t_v4_index, t_v4_mm = compressed_layers.stage_time(
        m, cand, s, stage, t_attn_layers, F * attn_eff, F * mm_eff)
    t_attn_f = sum(t_attn_layers) - t_v4_index
    t_mm = mm / (F * mm_eff)
    t_expand = 0.0
    if m.mla is not None and not expanded:  # kv_b_proj on the visiting blocks, not once
        # (DSA's sparse attention absorbs kv_b_proj into q and out instead: dsa_layers)
        mla = sum(a.token_mixer in ("mla", "dsa") and not sparse(a) for a in stage)
        t_one = mla_layers.expansion_flops(m, cand, s) / (F * mm_eff)
        t_mm -= mla * mla_layers.local_expansion_flops(m, s) * (3 + replay) / (F * mm_eff)
        t_expand = mla * t_one * (1 + 3 + attn_replay)  # forward, 3x backward, replayed
        t_attn_layers = [t + t_one if a.token_mixer in ("mla", "dsa") and not sparse(a)
                         else t for t, a in zip(t_attn_layers, stage)]  # a ring step hides
    t_index_f = t_index_b = 0.0
    if m.dsa is not None:  # the lightning indexer of each DSA layer (dsa_layers)
        t_index_f, t_index_b = (f / (F * attn_eff) for f in indexer_time(m, cand, s))
        dsa = [a.token_mixer == "dsa" for a in stage]
        t_attn_layers = [t + t_index_f * d for t, d in zip(t_attn_layers, dsa)]
        t_index_f, t_index_b = t_index_f * sum(dsa), t_index_b * sum(dsa)
    t_index_f, t_mm = t_index_f + t_v4_index, t_mm - t_v4_mm
    # the linear mixers' chunked kernels, at the attention kernels' efficiency: backward
    # twice the forward, a replayed forward again
    t_linear = linear_compute(m, cand, s, stage) / (F * attn_eff)
    # tiled linear blocks (memory.tiled_linear): each tile's forward again in backward,
    # projections and kernel; at cp > 1 the summary pass too (forward, again, backward)
    tiles = (1 + (4 if cand.cp > 1 else 0)) if cand.linear_tile else 0
    t_mm += tiles * 2 * s.N * sum(mixer_params(a.kind, linear_shapes(m, a.kind, cand.tp), s.d)
                                  for a in stage if a.token_mixer in LINEAR_MIXERS) \
        / (F * mm_eff)
    compute = t_mm + t_attn_f * (1 + 2.5 + attn_replay) + t_linear * (3 + attn_replay + tiles) \
        + linear_elementwise(m, cand, s, stage, cluster.gpu.linear_overhead) \
        * (1 + (attn_replay + tiles) / 3) + t_expand + t_index_f * (1 + attn_replay) + t_index_b
    return MicroCompute(compute, t_attn_layers, n_moe, routed_again)


def dp_time(cfg: Config, cand: Candidate, cluster: Cluster, e: int, psi: int) -> float:
    """The DP x CP gradient reduction (ring all-reduce, or ZeRO's reduce-scatter +
    all-gather) of the stage's psi parameters; the experts' over their expert-data-parallel
    group."""
    D = cand.dp * cand.cp
    dp = 0.0
    experts = counts.stage_experts(cfg.model, cand.tp, cand.pp, 0, cand.ep) \
        if cand.ep > 1 else 0
    if D > 1:
        factor = 2 * (D - 1) / D * (1.5 if cand.zero == 3 else 1.0)
        dp = factor * (psi - experts) * e / cluster.link(cand.world // cand.pp)
    X = D // cand.ep  # the experts' gradients: over their expert-data-parallel group
    if experts and X > 1:
        dp += 2 * (X - 1) / X * experts * e / cluster.link(cand.world // cand.pp)
    return dp


def step_time(cfg: Config, cand: Candidate, cluster: Cluster, bf16: bool,
              mm_eff: float = MM_EFF, attn_eff: float = ATTN_EFF,
              expanded: bool = False) -> StepTime:
    """One step of the most loaded rank, term by term (the module docstring's list);
    expanded: MLA's what-if ring of expanded K,V (mla_layers) instead of the latent."""
    m = cfg.model
    e = 2 if bf16 else 4
    g = counts.ring_grad_bytes(cand.ring_grad_dtype)
    s = counts.rank_shapes(m, cand)
    micro = cfg.train.global_batch_size // (cand.micro_batch * cand.dp)
    layers = -(-m.n_layers // cand.pp)
    replay = {"none": 0.0, "selective": 1.0, "full": 1.0,
              "every_n_layers": 1.0 / cand.every_n_layers}[cand.activation]
    attn_replay = 0.0 if cand.activation == "selective" else replay
    stage = stage_attention(m, cand.pp)
    psi = max(counts.stage_params(m, cand.tp, cand.pp, st, cand.ep) for st in {0, cand.pp - 1})
    c = micro_compute(cfg, cand, cluster, s, stage, layers, replay, attn_replay, mm_eff,
                      attn_eff, expanded)

    # TP: 4 all-reduces per block (+2 per replayed forward) over NVLink.
    f_tp, b_tp = comm_bytes.tp_bytes_per_layer(s, e, cand.tp)
    tp = layers * (f_tp * (1 + replay) + b_tp) / cluster.gpu.nvlink if cand.tp > 1 else 0.0

    cp_total, cp_exposed, chunk, thr = cp_time(cfg, cand, cluster, e, g, stage,
                                               c.attn_layers, attn_replay, attn_eff, expanded)

    # the experts' all-to-alls (moe_layers.all_to_all_bytes) over the EP group (tp x ep
    # adjacent ranks: ep folds over CP's ranks first), a replayed MLP's again (a tiled
    # one's too: each tile's forward runs again in backward, and the recompute skips the
    # tiles where the compute above does); they wait for the router and feed the experts:
    # nothing hides them
    a_f, a_b = all_to_all_bytes(s.N, s.d, e, m, cand.ep) if m.moe is not None else (0, 0)
    again = c.moe_layers * replay + (c.routed_again if cand.tiled_mlp else 0)
    moe = (c.moe_layers * (a_f + a_b) + again * a_f) / cluster.link(cand.tp * cand.ep) \
        if a_f else 0.0

    overhead = layers * cluster.gpu.overhead
    offload = offload_time(cfg, cand, cluster, e, layers, c.seconds)
    t_micro = c.seconds + overhead + tp + cp_exposed + offload + moe
    bubble = (cand.pp - 1) * t_micro if cand.pp > 1 else 0.0
    step_offload = offload * micro
    if cand.offload_optimizer:
        part = psi / (cand.dp * cand.cp)  # this GPU's partition of the parameters
        step_offload += part * (4 + e) / cluster.gpu.pcie \
            + part * min(cluster.gpus_per_node, cand.world) / cluster.gpu.host_adam
    return StepTime(compute=c.seconds * micro, overhead=overhead * micro, tp=tp * micro,
                    offload=step_offload, cp_exposed=cp_exposed * micro, moe=moe * micro,
                    cp_total=cp_total * micro, bubble=bubble,
                    dp=dp_time(cfg, cand, cluster, e, psi), micro_batches=micro,
                    ring_chunk=chunk, thresholds=thr,
                    cp_link=cluster.link_name(cand.tp * cand.cp) if cand.cp > 1 else "-")
