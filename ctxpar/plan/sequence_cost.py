"""The planner's seconds for one sequence of n tokens on d CP ranks: dynamic CP's cost model.

    cost = SequenceCost(cfg, cluster)     # the run's model, TP, CP pattern and layout
    cost(n, d)                            # seconds of the busiest of the d ranks
    cost.overhead                         # seconds paid once per packed sequence

cost(n, d) is timing.step_time of a run of one micro-batch of one sample of seq_len n
(padded to the layout's chunks over d ranks, as the packs are) at cp d (dp 1, pp 1): the
matmuls (linear in n / d), the attention's causal pairs of the busiest rank under the
layout (quadratic in n; a hybrid's linear layers linear in n: their kernels' FLOPs and the
device's linear_overhead per token and channel, timing.linear_elementwise), the TP
all-reduces, the CP traffic the pattern cannot hide and, with experts, their matmuls (the
active k of E) and the all-to-alls of each rank's n / d tokens' rows over the run's EP
group (parallel.ep: the same ranks whatever the pack's size, so the bytes per rank follow
the rank's tokens); the per-layer, per-micro-batch overhead (cluster.GPU.overhead) is left
out and given as ``overhead``, because a rank group runs all its documents of a step as
one packed sequence (document masking) and pays it once. Each document also pays the
device's block_overhead per attention layer at each ring step it crosses (its blocks'
kernel calls, merges and plans, the step's send and receive): d steps under the ring and
all-gather, d / u under hybrid, one under Ulysses (a whole document's heads on each rank).
What makes a short document dear under the ring (a linear mixer's layers run a pack's
documents in one kernel call whatever their count, so they add none). The gradient
reduction, the pipeline bubble and the optimizer are the step's, not a sequence's: not
counted here.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Tuple

from ..config import Config, ulysses_degree
from ..config.layers import layer_attention
from ..context_parallel.layouts import num_chunks
from .candidate import Candidate
from .cluster import Cluster
from .search import is_bf16
from .timing import ATTENTION, step_time


class SequenceCost:
    """Seconds of one sequence at a CP degree under cfg's model, TP degree, pattern
    (parallel.cp_comm: ring, allgather, ulysses, or hybrid of Ulysses degree
    parallel.ulysses) and token layout, on cluster's device."""

    def __init__(self, cfg: Config, cluster: Cluster):
        p = cfg.parallel
        self.cfg, self.cluster, self.bf16 = cfg, cluster, is_bf16(cfg)
        self.comm, self.layout, self.tp = p.cp_comm, p.layout, p.tp
        self.ulysses = ulysses_degree(p)  # hybrid: every size > 1 is u x a ring
        ac = cfg.activation_checkpointing
        self._cand = dict(tp=p.tp, pp=1, dp=1, cp_comm=p.cp_comm, token_layout=p.layout,
                          activation=ac.mode, every_n_layers=ac.every_n_layers,
                          micro_batch=1, ring_grad_dtype=p.ring_grad_dtype,
                          linear_cp=p.linear_cp, ep=p.ep,
                          tiled_loss=cfg.memory.tiled_loss, tiled_mlp=cfg.memory.tiled_mlp)
        self.overhead = cfg.model.n_layers * cluster.gpu.overhead
        # the layers whose documents cross ring steps (a linear mixer's do not: its
        # documents' states restart inside one kernel call, timing.linear_elementwise)
        self.attention_layers = sum(a.token_mixer in ATTENTION
                                    for a in layer_attention(cfg.model))
        self._seconds: Dict[Tuple[int, int], float] = {}

    def __call__(self, n: int, d: int) -> float:
        c = num_chunks(d, self.layout)
        n = -(-n // c) * c  # padded to the layout's chunks: what the d ranks hold
        key = (n, d)
        if key not in self._seconds:
            cfg = replace(self.cfg, model=replace(self.cfg.model, seq_len=n),
                          train=replace(self.cfg.train, global_batch_size=1))
            ulysses = (d if self.comm == "ulysses" else
                       self.ulysses if self.comm == "hybrid" and d > 1 else 1)
            cand = Candidate(cp=d, ulysses=ulysses, **self._cand)
            t = step_time(cfg, cand, self.cluster, self.bf16)
            steps = d // ulysses  # ring or all-gather blocks per document; Ulysses: one
            blocks = self.attention_layers * steps * self.cluster.gpu.block_overhead
            self._seconds[key] = t.compute + t.tp + t.cp_exposed + t.offload + t.moe + blocks
        return self._seconds[key]
