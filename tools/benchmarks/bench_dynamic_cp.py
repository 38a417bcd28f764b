"""Dynamic CP against static CP (and static DP where it fits) on the same documents: tokens/s.

    python -m tools.benchmarks.bench_dynamic_cp --world 4 --docs 32 --steps 3 \\
        --min-len 128 --max-len 16384 --tokens-per-rank 4096

Documents: lengths drawn log-normally (median --median-len, sigma --sigma), clipped to
[--min-len, --max-len] tokens, --docs per step, the same for every side (seeded by step);
random token ids. Every side runs on --world local gloo ranks (one thread each) the model
of --config (default configs/tiny_cpu.yaml, fp32, no DeepSpeed): a step is every pack of
the side's schedule, forward and backward on its rank group (document masking, positions
restarting per document), then the gradients all-reduced over the ranks in one flat
buffer (the DP x CP reduction every side shares). Wall clock between barriers on rank 0 over --steps steps
after one warmup step: tokens/s is their tokens over their time, speedups are of the
total time of the steps a side ran, and each side is compared with dynamic CP on the
same steps. The sides, all at --tokens-per-rank tokens per rank:

    dynamic     ctxpar/dynamic_cp/schedule.py's schedule: each document its smallest CP size,
                placed by the planner's cost model for this machine (--layout)
    static-cp   static_schedule at cp = world: documents in order, packed into samples of
                world x budget tokens, each over all ranks (--static-layout)
    static-dp   static_schedule at cp = 1: samples of budget tokens per rank (only when
                every document fits one rank: --max-len below the budget)

The work bound: one process alone times each step's documents on one rank (no CP, the
budget lifted), one pack after another; that work spread perfectly over min(--world,
cores) cores is a step time no schedule of these documents reaches on this machine, since
CP only adds work. static-cp's time over it is the most any schedule could gain over it.

Prints tokens/s per side, dynamic over each, and the planner's estimated step times
(Schedule.makespan) beside the measured ones; --json keeps the rows, step by step.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from ctxpar.testing import run_distributed, save_results
from tools.benchmarks.dynamic_cp_runs import run_config as _config, train_pack as _train_pack


def step_lengths(a, step: int) -> list:
    rng = np.random.default_rng([a.seed, step])
    return np.clip(rng.lognormal(np.log(a.median_len), a.sigma, a.docs), a.min_len,
                   a.max_len).astype(int).tolist()


def _plans(cfg, a, lengths, world):
    from ctxpar.dynamic_cp.schedule import ScheduleError, schedule, static_schedule
    from ctxpar.dynamic_cp.stream import dynamic_cp_sizes_for
    from ctxpar.plan.cluster import Cluster
    from ctxpar.plan.sequence_cost import SequenceCost
    from ctxpar.plan.startup import detect

    import torch
    gpu, _ = detect(torch.device("cpu"), world)
    cost = SequenceCost(cfg, Cluster(1, world, gpu))
    out = {"dynamic": (schedule(lengths, world, a.tokens_per_rank, cost, cost.overhead,
                                a.layout, dynamic_cp_sizes_for(cfg, world)), a.layout),
           "static-cp": (static_schedule(lengths, world, a.tokens_per_rank, world, cost,
                                         cost.overhead, a.static_layout,
                                         lambda ns, d: cost.pack(ns, d, a.static_layout)),
                         a.static_layout)}
    try:
        out["static-dp"] = (static_schedule(lengths, world, a.tokens_per_rank, 1, cost,
                                            cost.overhead, a.layout), a.layout)
    except ScheduleError:
        pass  # a document longer than one rank's budget: static DP cannot run it
    return out


def _work(rank, world, a):
    """Seconds per step of one rank running all the step's documents alone on the
    machine, packed up to the longest (the budget lifted): their work without CP."""
    from ctxpar import init_parallel_state
    from ctxpar.dynamic_cp.schedule import padded_length, schedule
    from ctxpar.dynamic_cp.groups import TileGroups
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions

    cfg = _config(a, 1, "parallel.cp_comm=ring", "parallel.ulysses=null")  # no CP at all
    state = init_parallel_state(cp=1)
    tile = TileGroups(state.cp_group)
    model = GPT(cfg.model, ModelGroups.from_state(state),
                ModelOptions(layout=a.layout, cp_comm=cfg.parallel.cp_comm, seed=1))
    out = {}
    for s in range(a.steps + 1):
        lengths = step_lengths(a, s)
        longest = max(padded_length(n, 1, a.layout) for n in lengths)
        plan = schedule(lengths, 1, longest, lambda n, d: float(n), 0.0, a.layout, [1])
        t0 = time.perf_counter()
        for pack in plan.packs:
            _train_pack(model, tile, a.layout, pack, s, lengths)
        if s > 0:  # step 0 warms up
            out[s] = time.perf_counter() - t0
    return out


def _rank(rank, world, a):
    import torch
    import torch.distributed as dist

    from ctxpar import init_parallel_state
    from ctxpar.config.sections import ulysses_degree
    from ctxpar.dynamic_cp.stream import dynamic_cp_sizes_for
    from ctxpar.dynamic_cp.groups import build_dynamic_cp_groups
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions

    cfg = _config(a, world)
    u = ulysses_degree(cfg.parallel)
    state = init_parallel_state(cp=world, ulysses=u)
    hybrid = u if cfg.parallel.cp_comm == "hybrid" else None
    groups = build_dynamic_cp_groups(state, dynamic_cp_sizes_for(cfg, world), ulysses=hybrid)
    for tile in sorted(groups.groups):  # connect every group before anything is timed
        if tile[1] > 1:
            dist.barrier(group=groups.groups[tile])
    times = {}
    for s in range(a.steps + 1):
        lengths = step_lengths(a, s)
        for side, (plan, layout) in _plans(cfg, a, lengths, world).items():
            model = GPT(cfg.model, ModelGroups.from_state(state),
                        ModelOptions(layout=layout, cp_comm=cfg.parallel.cp_comm, seed=1))
            dist.barrier()
            t0 = time.perf_counter()
            for pack in plan.packs_of(groups.position):
                _train_pack(model, groups.tile_groups(pack.first, pack.size), layout, pack,
                            s, lengths)
            # one flat all-reduce of the gradients, as DeepSpeed's reduce bucket does
            grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                     for p in model.parameters()]
            dist.all_reduce(torch.cat([g.flatten() for g in grads]))
            dist.barrier()
            if s > 0:  # step 0 warms up
                times.setdefault(side, {})[s] = time.perf_counter() - t0
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--docs", type=int, default=32, help="documents per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--median-len", type=float, default=1024)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--layout", default="zigzag", help="dynamic CP's token layout")
    ap.add_argument("--static-layout", default="striped",
                    help="static CP's (striped: balanced with documents)")
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-work-bound", dest="work_bound", action="store_false",
                    help="skip timing the documents' one-rank work")
    ap.add_argument("--json", default="runs/bench/dynamic_cp.json")
    a = ap.parse_args(argv)
    ranks = run_distributed(_rank, a.world, a, timeout=24 * 3600)
    work = run_distributed(_work, 1, a, timeout=24 * 3600)[0] if a.work_bound else None
    cfg = _config(a, a.world)
    estimates = {}
    for s in range(1, a.steps + 1):
        for side, (plan, _) in _plans(cfg, a, step_lengths(a, s), a.world).items():
            estimates.setdefault(side, {})[s] = plan.makespan()
    dyn_t, dyn_e = ranks[0]["dynamic"], estimates["dynamic"]
    rows = []
    for side, times in ranks[0].items():
        steps = sorted(times)  # static-dp runs only the steps whose documents fit a rank
        t, e = sum(times.values()), sum(estimates[side].values())
        rows.append(dict(side=side, steps=steps, tokens_per_s=sum(
            sum(step_lengths(a, s)) for s in steps) / t, seconds=t, estimated_seconds=e,
            dynamic_speedup=t / sum(dyn_t[s] for s in steps),
            estimated_speedup=e / sum(dyn_e[s] for s in steps),
            steps_s=[times[s] for s in steps],
            estimated_steps_s=[estimates[side][s] for s in steps]))
        r = rows[-1]
        print(f"{side:>11}: {r['tokens_per_s']:>8,.0f} tokens/s over steps {steps} "
              f"({t:.2f} s; estimated {e:.2f} s), dynamic {r['dynamic_speedup']:.2f}x "
              f"faster on them (estimated {r['estimated_speedup']:.2f}x)")
    if work:
        cores = min(a.world, len(os.sched_getaffinity(0)))
        bound = sum(work.values()) / cores
        rows.append(dict(side="work-bound", seconds=bound, cores=cores, steps_s=[
            work[s] / cores for s in sorted(work)]))
        print(f"work bound: {bound:.2f} s (one rank's {sum(work.values()):.2f} s over "
              f"{cores} cores); dynamic at {sum(dyn_t.values()) / bound:.2f}x of it, "
              f"static-cp at {sum(ranks[0]['static-cp'].values()) / bound:.2f}x")
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
