"""Benchmark context-parallel attention, every pattern: real ranks or a simulated group.

--comm picks the patterns (ring, allgather, ulysses, hybrid; default all; hybrid's inner
degree is --ulysses). Ranks mode (default) spawns P local processes
(ctxpar/testing/distributed.py: gloo on CPU, NCCL on GPUs) per (n, P, pattern) and times
one fwd+bwd of context_parallel_attention per iteration on every rank:
    time        wall time per fwd+bwd (median, or --stat min, over --iters), per rank
    ideal       (one fused attention fwd+bwd over all n tokens) / P, measured in the same
                processes, in the same iterations, under the same load: every rank runs
                the fused kernel too (so at P > cores both sides share the cores alike)
    time/ideal  slowest rank over ideal: 1.0 = perfect scaling, what communication, the
                merges and load imbalance cost on top
    peak mem    extra memory of one fwd+bwd over the inputs already allocated:
                CUDA: torch.cuda.max_memory_allocated() - memory_allocated() before;
                CPU: growth of getrusage(RUSAGE_SELF).ru_maxrss (process high-water mark;
                tracemalloc does not see torch's allocator)
    bytes       sent per rank, forward + backward (ctxpar.cp_stats)
    overlap     time / time(same schedule, communication skipped: comm.NoComm groups);
                1.0 means the communication costs nothing on top of the compute
    allocs      tensors one fwd+bwd allocates on a rank (aten calls that return new memory,
                ctxpar/context_parallel/allocations.py), and per ring step (/ P)
--clock cpu times every fn by its process's CPU time instead (all threads, gloo's too):
what compute and communication *cost* a rank, without the waits for a rank that the
machine's other jobs descheduled; the honest measure on a shared machine.
--simulate-ranks P runs every rank's schedule of each pattern in this one process on one
device (NoComm groups, no communication) and reports the decomposition efficiency
    (time of one fused attention fwd+bwd over n) / P  /  max over ranks of time(rank's work)
i.e. what is lost to smaller kernels, LSE merges, regrouping copies and load imbalance.

    python -m tools.benchmarks.bench_ring_attention --seq-len 8192 --world-sizes 2 --threads 1
    python -m tools.benchmarks.bench_ring_attention --device cuda --dtype bf16 \\
        --seq-len 32768 131072 --simulate-ranks 8 --heads 32 --kv-heads 8 --head-dim 128 --ulysses 8
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from ctxpar.context_parallel import (CP_COMMS, NoComm, context_parallel_attention,
                                     cp_stats)
from ctxpar.testing import run_distributed, save_results
from tools.benchmarks.attention_timing import (DTYPES, STATS, _sync, fused_fwd_bwd, make_inputs,
                                             timed)

def _fwd_bwd(q, k, v, dout, a, comm, groups):
    for x in (q, k, v):
        x.grad = None
    out = context_parallel_attention(q, k, v, comm=comm, **groups, causal=a.causal,
                                     layout=a.layout, backend=a.backend)
    out.backward(dout)


def _nocomm_groups(comm, rank, world, u):
    """The same schedule with nothing sent (comm.NoComm stand-ins)."""
    if comm == "hybrid":
        return dict(ulysses_group=NoComm(rank % u, u), ring_group=NoComm(rank // u, world // u))
    return dict(cp_group=NoComm(rank, world))


def _peak_mem(fn, device) -> int:
    """Bytes of extra memory one call of fn needs (see the module docstring)."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024  # KiB on Linux


def _allocations(q, k, v, dout, a, comm, groups) -> dict:
    """Allocating aten calls (count, bytes) of one forward and one backward."""
    from ctxpar.context_parallel.allocations import count_allocations
    for x in (q, k, v):
        x.grad = None
    with count_allocations() as fwd:
        out = context_parallel_attention(q, k, v, comm=comm, **groups, causal=a.causal,
                                         layout=a.layout, backend=a.backend)
    with count_allocations() as bwd:
        out.backward(dout)
    return dict(allocs_fwd=fwd.count, allocs_bwd=bwd.count, alloc_bytes_fwd=fwd.bytes,
                alloc_bytes_bwd=bwd.bytes, alloc_ops=dict(fwd.ops + bwd.ops))


def runnable(a, comm, world) -> str:
    """'' if the pattern runs on `world` ranks with these heads, else why not."""
    u = world if comm == "ulysses" else a.ulysses if comm == "hybrid" else 1
    if world % u:
        return f"ulysses {u} does not divide P={world}"
    if a.heads % u:
        return f"{a.heads} heads do not divide over ulysses {u}"
    return ""


# ------------------------------------------------------------------ real ranks


def _rank_main(rank, world, device, a, n, comm) -> dict:
    u = a.ulysses if comm == "hybrid" else 1
    if comm == "hybrid":
        from ctxpar import init_parallel_state
        st = init_parallel_state(cp=world, ulysses=u)
        groups = dict(ulysses_group=st.ulysses_group, ring_group=st.ring_group)
    else:
        groups = dict(cp_group=None)
    (q, k, v), dout = make_inputs(a, n // world, device, seed=rank)
    real = lambda: _fwd_bwd(q, k, v, dout, a, comm, groups)  # noqa: E731
    alone = lambda: _fwd_bwd(q, k, v, dout, a, comm,  # noqa: E731
                             _nocomm_groups(comm, rank, world, u))
    mem = _peak_mem(real, device)  # first call: also the warmup of the pattern
    with cp_stats() as st:
        real()
    allocs = _allocations(q, k, v, dout, a, comm, groups)
    fused, _ = fused_fwd_bwd(a, n, device)
    clock = time.process_time if a.clock == "cpu" and device.type == "cpu" \
        else time.perf_counter
    t = timed(dict(real=real, alone=alone, fused=fused), device, a.iters, a.warmup, clock,
               STATS[a.stat])
    return dict(time_s=t["real"], time_nocomm_s=t["alone"], time_fused_s=t["fused"],
                peak_mem_bytes=mem, **allocs, **st.as_dict())


def run_ranks(a, n: int, world: int, comm: str) -> dict:
    # Same cores in total for every P, unless --threads says otherwise.
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    ranks = run_distributed(_rank_main, world, torch.device(a.device), a, n, comm,
                            timeout=a.timeout, device_type=a.device, threads=threads)
    t_max = max(r["time_s"] for r in ranks)
    ideal = statistics.mean(r["time_fused_s"] for r in ranks) / world
    return dict(mode="ranks", comm=comm, n=n, P=world, threads_per_rank=threads, clock=a.clock,
                ulysses=a.ulysses if comm == "hybrid" else None,
                time_ms_max=1e3 * t_max, ideal_ms=1e3 * ideal, time_over_ideal=t_max / ideal,
                time_ms_per_rank=[1e3 * r["time_s"] for r in ranks],
                peak_mem_mib_max=max(r["peak_mem_bytes"] for r in ranks) / 2**20,
                mib_sent_per_rank=max(r["fwd_bytes_sent"] + r["bwd_bytes_sent"]
                                      for r in ranks) / 2**20,
                overlap_ratio=t_max / max(r["time_nocomm_s"] for r in ranks),
                allocs_per_step=max(r["allocs_fwd"] + r["allocs_bwd"] for r in ranks) / world,
                alloc_mib_per_step=max(r["alloc_bytes_fwd"] + r["alloc_bytes_bwd"]
                                       for r in ranks) / world / 2**20,
                gflop_per_rank=[(r["fwd_flops"] + r["bwd_flops"]) / 1e9 for r in ranks],
                per_rank=ranks)


# ------------------------------------------------------------------ simulated group


def run_simulated(a, n: int, world: int, comm: str) -> dict:
    device = torch.device(a.device)
    if device.type == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    # --clock cpu: this process's CPU time, immune to other jobs sharing the cores (one
    # process, no communication: CPU time is the work). CUDA: always wall + synchronize.
    clock = time.process_time if a.clock == "cpu" and device.type == "cpu" else time.perf_counter
    u = world if comm == "ulysses" else a.ulysses if comm == "hybrid" else 1
    (q, k, v), dout = make_inputs(a, n // world, device, seed=0)
    fused, kernel_name = fused_fwd_bwd(a, n, device)
    # Every rank's schedule; its data is the same local shard (values do not change time).
    fns = {r: (lambda r=r: _fwd_bwd(q, k, v, dout, a, comm, _nocomm_groups(comm, r, world, u)))
           for r in range(world)}
    t = timed(dict(fns, full=fused), device, a.iters, a.warmup, clock, STATS[a.stat])
    rank_times, t_full = [t[r] for r in range(world)], t["full"]
    return dict(mode="simulated", comm=comm, n=n, P=world, backend=kernel_name,
                ulysses=a.ulysses if comm == "hybrid" else None, clock=clock.__name__,
                time_ms_max=1e3 * max(rank_times), time_ms_min=1e3 * min(rank_times),
                time_ms_per_rank=[1e3 * t for t in rank_times],
                fused_full_ms=1e3 * t_full,
                decomposition_efficiency=(t_full / world) / max(rank_times))


# ------------------------------------------------------------------ driver


def _name(r) -> str:
    return f"hybrid u{r['ulysses']}xr{r['P'] // r['ulysses']}" if r["comm"] == "hybrid" \
        else r["comm"]


def _table(rows) -> str:
    lines = ["| comm | mode | n | P | time/rank ms (max) | ideal ms (fused/P) | time/ideal | "
             "peak mem MiB | MiB sent/rank | overlap time/time(no comm) | allocs/step "
             "(MiB) | decomposition eff. |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] == "ranks":
            mode = "ranks" + (" (cpu clock)" if r["clock"] == "cpu" else "")
            lines.append(f"| {_name(r)} | {mode} | {r['n']} | {r['P']} | {r['time_ms_max']:.1f} | "
                         f"{r['ideal_ms']:.1f} | {r['time_over_ideal']:.3f} | "
                         f"{r['peak_mem_mib_max']:.1f} | {r['mib_sent_per_rank']:.2f} | "
                         f"{r['overlap_ratio']:.3f} | {r['allocs_per_step']:.1f} "
                         f"({r['alloc_mib_per_step']:.1f}) | |")
        else:
            lines.append(f"| {_name(r)} | simulated | {r['n']} | {r['P']} | "
                         f"{r['time_ms_max']:.1f} (min {r['time_ms_min']:.1f}) | "
                         f"{r['fused_full_ms'] / r['P']:.1f} | "
                         f"{1 / r['decomposition_efficiency']:.3f} | | | | | "
                         f"{r['decomposition_efficiency']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--comm", nargs="+", choices=CP_COMMS, default=list(CP_COMMS))
    p.add_argument("--ulysses", type=int, default=2, help="hybrid: the inner Ulysses degree")
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192], help="total n")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    p.add_argument("--simulate-ranks", type=int, default=0,
                   help="P > 0: simulate a P-rank group in one process instead of spawning")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default="zigzag")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per process (0: cores / P in ranks mode, all when "
                        "simulating); 1 is the stable choice on a shared machine")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="on CPU: wall time, or process CPU time (see above)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--stat", choices=sorted(STATS), default="median",
                   help="per fn over the iterations; min = the least disturbed run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default="runs/bench_ring_attention.json", help="output file")
    a = p.parse_args(argv)
    if a.device == "cuda" and not a.simulate_ranks and torch.cuda.device_count() < max(
            a.world_sizes):
        p.error("ranks mode on CUDA needs one GPU per rank; use --simulate-ranks")

    rows = []
    for n in a.seq_len:
        for world in [a.simulate_ranks] if a.simulate_ranks else a.world_sizes:
            for comm in a.comm:
                why = runnable(a, comm, world)
                if why:
                    print(f"skip {comm} at P={world}: {why}", flush=True)
                    continue
                rows.append(run_simulated(a, n, world, comm) if a.simulate_ranks
                            else run_ranks(a, n, world, comm))
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    save_results(a.json, a, rows,
                 cuda=torch.cuda.get_device_name() if a.device == "cuda" else None)

if __name__ == "__main__":
    main()
