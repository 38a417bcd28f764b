"""Benchmark ring attention: real ranks (gloo on CPU, NCCL on GPUs) or a simulated ring.

Ranks mode (default) spawns P local processes joined through a FileStore and times one
fwd+bwd of ring_attention per iteration on every rank:
    time        wall time per fwd+bwd (median over --iters), per rank
    peak mem    extra memory of one fwd+bwd over the inputs already allocated:
                CUDA: torch.cuda.max_memory_allocated() - memory_allocated() before;
                CPU: growth of getrusage(RUSAGE_SELF).ru_maxrss (process high-water mark;
                tracemalloc does not see torch's allocator)
    bytes       sent per rank, forward + backward (ctxpar.ring_stats)
    overlap     time(ring) / time(same block schedule, communication skipped): 1.0 means
                the transfers are completely hidden behind the attention compute
--simulate-ranks P runs every rank's block schedule of a P-ring in this one process on one
device (no communication) and reports the decomposition efficiency
    (time of one fused attention fwd+bwd over n) / P  /  max over ranks of time(rank's work)
i.e. what is lost to smaller kernels, LSE merges and load imbalance (1.0 = none).

    python tools/bench_ring_attention.py --seq-len 2048 4096 --world-sizes 1 2 4
    python tools/bench_ring_attention.py --device cuda --dtype bf16 --seq-len 32768 131072 \\
        --simulate-ranks 8 --heads 32 --kv-heads 8 --head-dim 128
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ctxpar.context_parallel import NoComm, ring_attention, ring_stats  # noqa: E402
from ctxpar.context_parallel.kernels import default_scale, get_backend  # noqa: E402
from bench_ranks import save_results, spawn_ranks  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous: time only finished work
        torch.cuda.synchronize(device)


def _timed(fns: dict, device, iters: int, warmup: int, clock=time.perf_counter) -> dict:
    """Median seconds of each fn() over iters runs, after warmup runs. The fns take turns
    within every iteration, so a load change on a shared machine hits all of them alike."""
    times = {name: [] for name in fns}
    for it in range(warmup + iters):
        for name, fn in fns.items():
            _sync(device)
            t0 = clock()
            fn()
            _sync(device)
            if it >= warmup:
                times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _inputs(a, seq, device, seed):
    torch.manual_seed(seed)  # generated on the device: 128K tokens would crawl on a CPU

    def mk(h):  # (B, seq, h, D)
        return torch.randn(a.batch, seq, h, a.head_dim, device=device, dtype=DTYPES[a.dtype])

    q, k, v = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads)
    return [x.requires_grad_() for x in (q, k, v)], mk(a.heads)


def _fwd_bwd(q, k, v, dout, a, group=None, no_comm=None):
    for x in (q, k, v):
        x.grad = None
    out = ring_attention(q, k, v, no_comm or group, causal=a.causal, layout=a.layout,
                         backend=a.backend)
    out.backward(dout)


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


# ------------------------------------------------------------------ real ranks


def _rank_main(rank, world, device, a, n) -> dict:
    (q, k, v), dout = _inputs(a, n // world, device, seed=rank)
    ring = lambda: _fwd_bwd(q, k, v, dout, a)  # noqa: E731
    alone = lambda: _fwd_bwd(q, k, v, dout, a, no_comm=NoComm(rank, world))  # noqa: E731
    mem = _peak_mem(ring, device)  # first call: also the warmup of the ring
    with ring_stats() as st:
        ring()
    t = _timed(dict(ring=ring, alone=alone), device, a.iters, a.warmup)
    return dict(time_s=t["ring"], time_nocomm_s=t["alone"], peak_mem_bytes=mem,
                **st.as_dict())


def run_ranks(a, n: int, world: int) -> dict:
    # Same cores in total for every P, unless --threads says otherwise.
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    ranks = spawn_ranks(_rank_main, world, a.device, threads, a, n, timeout=a.timeout)
    t_max = max(r["time_s"] for r in ranks)
    return dict(mode="ranks", n=n, P=world, threads_per_rank=threads,
                time_ms_max=1e3 * t_max,
                time_ms_mean=1e3 * statistics.mean(r["time_s"] for r in ranks),
                peak_mem_mib_max=max(r["peak_mem_bytes"] for r in ranks) / 2**20,
                mib_sent_per_rank=max(r["fwd_bytes_sent"] + r["bwd_bytes_sent"]
                                      for r in ranks) / 2**20,
                overlap_ratio=t_max / max(r["time_nocomm_s"] for r in ranks),
                gflop_per_rank=[(r["fwd_flops"] + r["bwd_flops"]) / 1e9 for r in ranks],
                per_rank=ranks)


# ------------------------------------------------------------------ simulated ring


def run_simulated(a, n: int, world: int) -> dict:
    device = torch.device(a.device)
    if device.type == "cpu" and a.threads:
        torch.set_num_threads(a.threads)
    # --clock cpu: this process's CPU time, immune to other jobs sharing the cores (one
    # process, no communication: CPU time is the work). CUDA: always wall + synchronize.
    clock = time.process_time if a.clock == "cpu" and device.type == "cpu" else time.perf_counter
    (q, k, v), dout = _inputs(a, n // world, device, seed=0)
    (fq, fk, fv), fdout = _inputs(a, n, device, seed=1)  # the whole sequence, one kernel
    kernel = get_backend(a.backend, fq)
    scale = default_scale(a.head_dim)  # the ring's own default

    def fused():
        out, lse = kernel.forward(fq, fk, fv, a.causal, scale)
        kernel.backward(fdout, fq, fk, fv, out, lse, a.causal, scale)

    # Every rank's schedule; its data is the same local shard (values do not change time).
    fns = {r: (lambda r=r: _fwd_bwd(q, k, v, dout, a, no_comm=NoComm(r, world)))
           for r in range(world)}
    t = _timed(dict(fns, full=fused), device, a.iters, a.warmup, clock)
    rank_times, t_full = [t[r] for r in range(world)], t["full"]
    return dict(mode="simulated", n=n, P=world, backend=kernel.name, clock=clock.__name__,
                time_ms_max=1e3 * max(rank_times), time_ms_min=1e3 * min(rank_times),
                time_ms_per_rank=[1e3 * t for t in rank_times],
                fused_full_ms=1e3 * t_full,
                decomposition_efficiency=(t_full / world) / max(rank_times))


# ------------------------------------------------------------------ driver


def _table(rows) -> str:
    lines = ["| mode | n | P | time/rank ms (max) | peak mem MiB | MiB sent/rank | overlap "
             "time(ring)/time(no comm) | decomposition eff. |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] == "ranks":
            lines.append(f"| ranks | {r['n']} | {r['P']} | {r['time_ms_max']:.1f} | "
                         f"{r['peak_mem_mib_max']:.1f} | {r['mib_sent_per_rank']:.2f} | "
                         f"{r['overlap_ratio']:.2f} | |")
        else:
            lines.append(f"| simulated | {r['n']} | {r['P']} | {r['time_ms_max']:.1f} "
                         f"(min {r['time_ms_min']:.1f}; fused n: {r['fused_full_ms']:.1f}) "
                         f"| | | | {r['decomposition_efficiency']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048, 4096], help="total n")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--simulate-ranks", type=int, default=0,
                   help="P > 0: simulate a P-ring in one process instead of spawning ranks")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
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
                   help="--simulate-ranks on CPU: wall time, or process CPU time")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default="runs/bench_ring_attention.json", help="output file")
    a = p.parse_args(argv)
    if a.device == "cuda" and not a.simulate_ranks and torch.cuda.device_count() < max(
            a.world_sizes):
        p.error("ranks mode on CUDA needs one GPU per rank; use --simulate-ranks")

    rows = []
    for n in a.seq_len:
        if a.simulate_ranks:
            rows.append(run_simulated(a, n, a.simulate_ranks))
        else:
            rows.extend(run_ranks(a, n, w) for w in a.world_sizes)
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    save_results(a.json, a, rows,
                 cuda=torch.cuda.get_device_name() if a.device == "cuda" else None)


if __name__ == "__main__":
    main()
