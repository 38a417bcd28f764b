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

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..config import Config, ConfigError, load_config
from ..context_parallel.layouts import LAYOUTS
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
    # static CP under the other token layouts the config may take (add_layouts)
    other_static: Dict[str, Optional[float]] = field(default_factory=dict)

    @property
    def best_static(self) -> Optional[Tuple[Optional[str], float]]:
        """(layout, seconds) of the fastest static CP; layout None: the config's."""
        sides = [(None, self.static_s), *self.other_static.items()]
        sides = [(k, v) for k, v in sides if v is not None]
        return min(sides, key=lambda kv: kv[1]) if sides else None

    @property
    def advice(self) -> str:
        best = self.best_static
        if best is None or self.dynamic_s < best[1]:
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
    world, budget = world_and_budget(cfg, cluster)
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
    static = static_seconds(cfg, cluster, steps, cost)
    n = sum(counts.values())
    return Comparison(static_s=static,
                      dynamic_s=float(np.mean([s.makespan() for s in dyn])),
                      work_balance=float(np.mean([s.work_balance for s in dyn])),
                      size_shares={d: counts[d] / n for d in sorted(counts)},
                      tokens_per_step=float(np.mean([sum(x) for x in steps])))


def world_and_budget(cfg: Config, cluster: Cluster) -> Tuple[int, int]:
    """The DP x CP ranks the documents are placed over, and the tokens each holds."""
    p = cfg.parallel
    return (cluster.world // (p.tp * p.pp),
            cfg.data.tokens_per_rank or cfg.model.seq_len // p.cp)


def static_seconds(cfg: Config, cluster: Cluster, steps: List[List[int]],
                   cost: Optional[SequenceCost] = None) -> Optional[float]:
    """Static CP's mean step seconds at the config's cp and layout (cost: the config's
    SequenceCost when the caller has it); None when a document exceeds one sample of
    cp x tokens_per_rank (it would be cut)."""
    p = cfg.parallel
    world, budget = world_and_budget(cfg, cluster)
    cost = cost or SequenceCost(cfg, cluster)
    try:
        return float(np.mean([static_schedule(lengths, world, budget, p.cp, cost,
                                              cost.overhead, p.layout, cost.pack)
                              .makespan() for lengths in steps]))
    except ScheduleError:
        return None


def other_layouts(path: str, sets: Optional[List[str]], cfg: Config) -> Dict[str, Config]:
    """The config at each other token layout its validation accepts (a linear mixer's
    state passing takes no striped layout; hybrid CP none either)."""
    out = {}
    for layout in LAYOUTS:
        if layout != cfg.parallel.layout:
            try:
                out[layout] = load_config(path, [*(sets or []), f"parallel.layout={layout}"],
                                          check_paths=False)
            except ConfigError:
                pass  # the config refuses it: not a static CP this model can run
    return out


def add_layouts(cmp: Comparison, others: Dict[str, Config], cluster: Cluster,
                steps: List[List[int]]) -> Comparison:
    """cmp with static CP under each of the other layouts' configs (those the config's
    validation accepts: a linear mixer's state passing takes no striped layout)."""
    return replace(cmp, other_static={k: static_seconds(c, cluster, steps)
                                      for k, c in others.items()})


def describe(cmp: Comparison, cfg: Config) -> str:
    """The CLI's lines: both step times and the advice."""
    p = cfg.parallel

    def static(seconds):
        return ("cannot run them (a document exceeds one sample of cp x tokens_per_rank)"
                if seconds is None else
                f"{seconds:.3f} s per step, {cmp.tokens_per_step / seconds:,.0f} tokens/s")
    shares = ", ".join(f"cp{d} {100 * s:.0f}%" for d, s in cmp.size_shares.items())
    best = cmp.best_static
    layout = f", parallel.layout: {best[0]}" if best is not None and best[0] else ""
    use = ("use dynamic CP (data.dynamic_cp: true)" if cmp.advice == "dynamic" else
           f"use static CP (cp {p.cp}{layout})")
    others = "".join(f"static cp{p.cp} {k}: {static(v)}\n"
                     for k, v in cmp.other_static.items())
    return (f"static cp{p.cp}{' ' + p.layout if cmp.other_static else ''}: "
            f"{static(cmp.static_s)}\n{others}"
            f"dynamic: {cmp.dynamic_s:.3f} s per step, "
            f"{cmp.tokens_per_step / cmp.dynamic_s:,.0f} tokens/s (max/mean rank work "
            f"{cmp.work_balance:.2f}; documents per CP size: {shares})\n{use}")
