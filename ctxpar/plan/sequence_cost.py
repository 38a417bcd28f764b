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

``pack(lengths, d)`` prices static CP's sample of documents in order over d ranks: under
the striped layout (and Ulysses, whose ranks see every token, and hybrid CP) each
document is laid over all d ranks, the sum of cost(n, d); under contiguous and zigzag with
the ring or the all-gather, the sample is cut into the layout's chunks and each document
lies on the ranks whose chunks hold it: a short one on one rank (cost(n, 1): no ring step
of its own), a long one on the k ranks it crosses (cost(n, k)), the busiest rank's
documents deciding, plus the sample's CP traffic (the ring carries every token's K,V and
a linear mixer's state at every step) for the tokens of one-rank documents, whose
attention is done before the ring starts and hides none of it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

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
        self._traffic: Dict[Tuple[int, int], float] = {}  # CP seconds, hidden or not

    def __call__(self, n: int, d: int) -> float:
        return self._seconds[self._priced(n, d)]

    def traffic(self, n: int, d: int) -> float:
        """The CP seconds of one sequence of n tokens over d ranks, hidden or not."""
        return self._traffic[self._priced(n, d)]

    def _priced(self, n: int, d: int) -> Tuple[int, int]:
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
            self._traffic[key] = t.cp_total
        return key

    def pack(self, lengths: Sequence[int], d: int, layout: Optional[str] = None) -> float:
        """Seconds of static CP's sample of these documents (in order) over d ranks under
        layout (default the config's), without ``overhead`` (the module docstring)."""
        layout = layout or self.layout
        if d == 1 or layout == "striped" or self.comm not in ("ring", "allgather"):
            return sum(self(n, d) for n in lengths)
        ranks = holding_ranks(lengths, d, layout)
        work = [0.0] * d
        for n, held in zip(lengths, ranks):
            for r in held:
                work[r] += self(n, len(held))
        total = sum(lengths)
        alone = sum(n for n, held in zip(lengths, ranks) if len(held) == 1)
        return max(work) + self.traffic(total, d) * alone / total


def holding_ranks(lengths: Sequence[int], d: int, layout: str) -> List[Tuple[int, ...]]:
    """The ranks whose chunks hold each document of a sample packed in order (padded to
    the layout's chunks) over d ranks under contiguous or zigzag."""
    c = num_chunks(d, layout)
    total = sum(lengths)
    size = -(-total // c)  # tokens per chunk
    owner = [k if k < d else 2 * d - 1 - k for k in range(c)]  # contiguous: c == d
    out, start = [], 0
    for n in lengths:
        first, last = start // size, (start + n - 1) // size
        out.append(tuple(sorted({owner[k] for k in range(first, last + 1)})))
        start += n
    return out
