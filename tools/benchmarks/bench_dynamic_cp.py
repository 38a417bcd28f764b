"""Dynamic CP against static CP (and static DP where it fits) on the same documents: tokens/s.

    python -m tools.benchmarks.bench_dynamic_cp --world 4 --docs 32 --steps 3 \\
        --min-len 128 --max-len 16384 --tokens-per-rank 4096

Documents: lengths drawn log-normally (median --median-len, sigma --sigma), clipped to
[--min-len, --max-len] tokens, --docs per step, the same for every side (seeded by step);
random token ids. Every side runs on --world local gloo ranks (one thread each) the model
of --config (default configs/tiny_cpu.yaml, fp32, no DeepSpeed): a step is every pack of
the side's schedule, forward and backward on its rank group (document masking, positions
restarting per document), then the gradients all-reduced over the ranks (the DP x CP
reduction every side shares). Wall clock between barriers on rank 0 over --steps steps
after one warmup step: tokens/s is their tokens over their time, speedups are of the
median step. The sides, all at --tokens-per-rank tokens per rank:

    dynamic     ctxpar/data/dynamic_cp.py's schedule: each document its smallest CP size,
                placed by the planner's cost model for this machine (--layout)
    static-cp   static_schedule at cp = world: documents in order, packed into samples of
                world x budget tokens, each over all ranks (--static-layout)
    static-dp   static_schedule at cp = 1: samples of budget tokens per rank (only when
                every document fits one rank: --max-len below the budget)

Prints tokens/s per side, dynamic over each, and the planner's estimated step times
(Schedule.makespan) beside the measured ones; --json keeps the rows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ctxpar.testing import run_distributed, save_results


def step_lengths(a, step: int) -> list:
    rng = np.random.default_rng([a.seed, step])
    return np.clip(rng.lognormal(np.log(a.median_len), a.sigma, a.docs), a.min_len,
                   a.max_len).astype(int).tolist()


def _document(step: int, i: int, n: int, vocab: int) -> np.ndarray:
    """Document i of a step: n inputs and their labels (n + 1 stored tokens)."""
    return np.random.default_rng([step, i]).integers(1, vocab, n + 1)


def _plans(cfg, a, lengths, world):
    from ctxpar.data.dynamic_cp import ScheduleError, schedule, static_schedule
    from ctxpar.plan.cluster import Cluster
    from ctxpar.plan.sequence_cost import SequenceCost
    from ctxpar.plan.startup import detect

    import torch
    gpu, _ = detect(torch.device("cpu"), world)
    cost = SequenceCost(cfg, Cluster(1, world, gpu))
    out = {"dynamic": (schedule(lengths, world, a.tokens_per_rank, cost, cost.overhead,
                                a.layout), a.layout),
           "static-cp": (static_schedule(lengths, world, a.tokens_per_rank, world, cost,
                                         cost.overhead, a.static_layout), a.static_layout)}
    try:
        out["static-dp"] = (static_schedule(lengths, world, a.tokens_per_rank, 1, cost,
                                            cost.overhead, a.layout), a.layout)
    except ScheduleError:
        pass  # a document longer than one rank's budget: static DP cannot run it
    return out


def _rank(rank, world, a):
    import torch
    import torch.distributed as dist

    from ctxpar import init_parallel_state
    from ctxpar.config import load_config
    from ctxpar.data.dynamic_batch import pack_sequence, shard_pack
    from ctxpar.distributed.dynamic_groups import build_dynamic_cp_groups
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions

    cfg = load_config(a.config, overrides=[f"parallel.cp={world}", "parallel.dp=1",
                                           "parallel.tp=1", "parallel.pp=1", *a.set],
                      world_size=world)
    state = init_parallel_state(cp=world)
    groups = build_dynamic_cp_groups(state, range(1, world + 1))
    for tile in sorted(groups.groups):  # connect every group before anything is timed
        if tile[1] > 1:
            dist.barrier(group=groups.groups[tile])
    times = {}
    for s in range(a.steps + 1):
        lengths = step_lengths(a, s)
        for side, (plan, layout) in _plans(cfg, a, lengths, world).items():
            model = GPT(cfg.model, ModelGroups(cp_group=state.cp_group),
                        ModelOptions(layout=layout, cp_comm=cfg.parallel.cp_comm, seed=1))
            dist.barrier()
            t0 = time.perf_counter()
            for pack in plan.packs_of(groups.position):
                group = groups.group(pack.first, pack.size)
                model.use_cp_group(group)
                docs = [_document(s, i, lengths[i], cfg.model.vocab_size) for i in pack.docs]
                local = shard_pack(pack_sequence(docs, pack.length), group, layout)
                loss = model(local["tokens"], local["positions"], local["labels"],
                             cu_seqlens=local["cu_seqlens"])
                (loss / sum(lengths)).backward()
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            dist.barrier()
            if s > 0:  # step 0 warms up
                times.setdefault(side, []).append(time.perf_counter() - t0)
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
    ap.add_argument("--json", default="runs/bench/dynamic_cp.json")
    a = ap.parse_args(argv)
    ranks = run_distributed(_rank, a.world, a, timeout=24 * 3600)
    tokens = [sum(step_lengths(a, s)) for s in range(1, a.steps + 1)]
    rows = []
    from ctxpar.config import load_config
    cfg = load_config(a.config, overrides=[f"parallel.cp={a.world}", "parallel.dp=1",
                                           "parallel.tp=1", "parallel.pp=1", *a.set],
                      world_size=a.world)
    estimates = {}
    for s in range(1, a.steps + 1):
        for side, (plan, _) in _plans(cfg, a, step_lengths(a, s), a.world).items():
            estimates.setdefault(side, []).append(plan.makespan())
    for side, times in ranks[0].items():
        t = statistics.median(times)
        rows.append(dict(side=side, step_s=t, tokens_per_s=sum(tokens) / sum(times),
                         estimated_step_s=statistics.median(estimates[side])))
    dyn = next(r for r in rows if r["side"] == "dynamic")
    for r in rows:
        r["dynamic_speedup"] = r["step_s"] / dyn["step_s"]
        r["estimated_speedup"] = r["estimated_step_s"] / dyn["estimated_step_s"]
        print(f"{r['side']:>10}: {r['tokens_per_s']:>10,.0f} tokens/s ({r['step_s']:.2f} s "
              f"per step, median), dynamic {r['dynamic_speedup']:.2f}x faster "
              f"(estimated {r['estimated_speedup']:.2f}x)")
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
