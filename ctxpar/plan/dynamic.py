"""Static or dynamic CP for a length distribution: the planner's step time of each.

    python -m ctxpar.plan --config X.yaml --nodes 1 --gpus-per-node 8 --documents 2048,1.2,128,131072

Steps of train.global_batch_size documents, lengths drawn log-normally (median, sigma,
clipped to [min, max] tokens) from a fixed seed, are placed both ways with the same cost
model (sequence_cost.SequenceCost: the planner's seconds of a sequence at a CP degree)
and the same tokens per rank (data.tokens_per_rank, default seq_len / cp):

    static   ctxpar/dynamic_cp/schedule.py's static_schedule at the config's cp: documents in
             order, packed into samples of cp x budget tokens (document masking), the
             samples dealt to the dp groups
    dynamic  its balanced schedule (ctxpar/dynamic_cp/balance.py) over dp x cp

Each is its Schedule.makespan (the waits included), averaged over the steps; the gradient
reduction and the optimizer are the same on both sides and left out. The advice is the
faster one; static is "cannot run" when a document exceeds cp x budget (it would be cut).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..config import Config
from ..dynamic_cp.balance import balanced_schedule
from ..dynamic_cp.schedule import ScheduleError, static_schedule
from ..dynamic_cp.stream import dynamic_cp_sizes_for
from .cluster import Cluster, PlanError
from .sequence_cost import SequenceCost


@dataclass(frozen=True)
class Comparison:
    static_s: Optional[float]     # None: static CP cannot hold the longest document
    dynamic_s: float
    work_balance: float           # dynamic's max / mean rank work, averaged
    size_shares: Dict[int, float]  # dynamic's documents per CP size, over all steps
    tokens_per_step: float

    @property
    def advice(self) -> str:
        if self.static_s is None or self.dynamic_s < self.static_s:
            return "dynamic"
        return "static"


def document_lengths(spec: str, count: int, steps: int, seed: int = 0) -> List[List[int]]:
    """`steps` lists of `count` lengths from 'median,sigma,min,max' (PlanError if bad)."""
    try:
        median, sigma, low, high = (float(x) for x in spec.split(","))
    except ValueError:
        raise PlanError(f"--documents {spec!r} must be MEDIAN,SIGMA,MIN,MAX "
                        f"(e.g. 2048,1.2,128,131072)") from None
    if not (median > 0 and sigma >= 0 and 1 <= low <= high):
        raise PlanError(f"--documents {spec!r}: need median > 0, sigma >= 0, 1 <= min <= max")
    rng = np.random.default_rng(seed)
    return [np.clip(rng.lognormal(np.log(median), sigma, count), low, high).astype(int)
            .tolist() for _ in range(steps)]


def compare(cfg: Config, cluster: Cluster, steps: List[List[int]]) -> Comparison:
    """The static and dynamic step time of the config's layout on cluster for `steps`."""
    p = cfg.parallel
    world = cluster.world // (p.tp * p.pp)
    budget = cfg.data.tokens_per_rank or cfg.model.seq_len // p.cp
    cost = SequenceCost(cfg, cluster)
    sizes = dynamic_cp_sizes_for(cfg, world)
    dyn, static, counts = [], [], {}
    try:
        for lengths in steps:
            s = balanced_schedule(lengths, world, budget, cost, cost.overhead, p.layout, sizes)
            dyn.append(s)
            for d in s.sizes:
                counts[d] = counts.get(d, 0) + 1
    except ScheduleError as e:
        raise PlanError(f"--documents: {e}") from None
    try:
        static = [static_schedule(lengths, world, budget, p.cp, cost, cost.overhead, p.layout,
                                  cost.pack).makespan() for lengths in steps]
    except ScheduleError:
        static = None  # a document longer than one static sample
    n = sum(counts.values())
    return Comparison(static_s=None if static is None else float(np.mean(static)),
                      dynamic_s=float(np.mean([s.makespan() for s in dyn])),
                      work_balance=float(np.mean([s.work_balance for s in dyn])),
                      size_shares={d: counts[d] / n for d in sorted(counts)},
                      tokens_per_step=float(np.mean([sum(x) for x in steps])))


def describe(cmp: Comparison, cfg: Config) -> str:
    """The CLI's lines: both step times and the advice."""
    p = cfg.parallel
    static = ("cannot run them (a document exceeds one sample of cp x tokens_per_rank)"
              if cmp.static_s is None else
              f"{cmp.static_s:.3f} s per step, {cmp.tokens_per_step / cmp.static_s:,.0f} "
              f"tokens/s")
    shares = ", ".join(f"cp{d} {100 * s:.0f}%" for d, s in cmp.size_shares.items())
    use = ("use dynamic CP (data.dynamic_cp: true)" if cmp.advice == "dynamic" else
           f"use static CP (cp {p.cp})")
    return (f"static cp{p.cp}: {static}\n"
            f"dynamic: {cmp.dynamic_s:.3f} s per step, "
            f"{cmp.tokens_per_step / cmp.dynamic_s:,.0f} tokens/s (max/mean rank work "
            f"{cmp.work_balance:.2f}; documents per CP size: {shares})\n{use}")
