"""A sliding-window layer under the ring: the halo exchange against its ideal and the full mask.

    python -m tools.benchmarks.bench_window --seq-len 32768 --window 1024 --world 4

Simulates a P-rank ring in this one process (comm.NoComm groups: every rank's schedule,
nothing sent; the compute is what the halo changes, its traffic is window - 1 tokens) and
times one forward + backward of context_parallel_attention per rank, under the layout
--layout (contiguous by default: one neighbour, docs/parallelism.md):
    window      the ring with AttentionMask(causal, sliding_window=w): halo.py's exchange,
                each rank's banded blocks plus one block against the previous rank's tail
    ideal       one process's windowed attention over all n tokens (the same call on a
                group of one), divided by P: perfect scaling of the windowed work
    full        the same ring with the full causal mask: what CP without windows computes
time = the slowest rank (the ring waits for it). Reported: window / ideal (1.0 = perfect)
and full / window (what the window saves). Process CPU time (--clock cpu, the default) is
immune to other jobs on a shared machine; --stat min keeps each fn's least disturbed run.
With --bytes the same windowed call also runs on P real gloo ranks once, for the bytes
cp_stats() counts per rank (the halo) next to the full ring's (ctxpar.plan.comm_bytes.cp_bytes).
"""
from __future__ import annotations

import argparse
import time

import torch

from ctxpar.context_parallel import (LOCAL, AttentionMask, NoComm, context_parallel_attention,
                                     cp_stats)
from ctxpar.plan.comm_bytes import cp_bytes
from ctxpar.testing import run_distributed, save_results
from tools.benchmarks.attention_timing import DTYPES, STATS


def make_inputs(a, seq: int, seed: int):
    """q, k, v (1, seq, h, D) requiring grad, and dout."""
    g = torch.Generator().manual_seed(seed)

    def mk(h):
        return torch.randn(1, seq, h, a.head_dim, generator=g).to(DTYPES[a.dtype])

    q, k, v = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads)
    return [x.requires_grad_() for x in (q, k, v)], mk(a.heads)


def fwd_bwd(inputs, group, mask, layout, backend):
    """fn() = one forward + backward of the ring over `group` with `mask`."""
    (q, k, v), dout = inputs

    def fn():
        for x in (q, k, v):
            x.grad = None
        out = context_parallel_attention(q, k, v, comm="ring", cp_group=group, mask=mask,
                                         layout=layout, backend=backend)
        out.backward(dout)
    return fn


def interleaved(fns: dict, iters: int, warmup: int, clock, stat) -> dict:
    """stat of each fn's seconds over iters rounds after warmup rounds; every round runs
    each fn once, so a load change on a shared machine hits all of them alike."""
    times = {name: [] for name in fns}
    for it in range(warmup + iters):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            if it >= warmup:
                times[name].append(clock() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def simulate(a, n: int) -> dict:
    torch.set_num_threads(a.threads)
    P, window = a.world, AttentionMask(causal=True, sliding_window=a.window)
    full = AttentionMask(causal=True)
    local = make_inputs(a, n // P, seed=0)  # every rank's shard: values do not change time
    fns = {f"window{r}": fwd_bwd(local, NoComm(r, P), window, a.layout, a.backend)
           for r in range(P)}
    fns.update({f"full{r}": fwd_bwd(local, NoComm(r, P), full, a.layout, a.backend)
                for r in range(P)})
    fns["single"] = fwd_bwd(make_inputs(a, n, seed=1), LOCAL, window, a.layout, a.backend)
    flops = {}
    for name, fn in fns.items():
        with cp_stats() as st:
            fn()
        flops[name] = st.fwd_flops + st.bwd_flops
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    t = interleaved(fns, a.iters, a.warmup, clock, STATS[a.stat])
    win = [t[f"window{r}"] for r in range(P)]
    ful = [t[f"full{r}"] for r in range(P)]
    ideal = t["single"] / P
    return dict(n=n, P=P, window=a.window, layout=a.layout, clock=clock.__name__,
                window_ms_per_rank=[1e3 * x for x in win], full_ms_per_rank=[1e3 * x for x in ful],
                single_ms=1e3 * t["single"], ideal_ms=1e3 * ideal,
                window_over_ideal=max(win) / ideal, full_over_window=max(ful) / max(win),
                gflop_window_max=max(flops[f"window{r}"] for r in range(P)) / 1e9,
                gflop_single=flops["single"] / 1e9,
                gflop_full_max=max(flops[f"full{r}"] for r in range(P)) / 1e9)


def _bytes_rank(rank, world, device, a, n) -> dict:
    inputs = make_inputs(a, n // world, seed=rank)
    fn = fwd_bwd(inputs, None, AttentionMask(causal=True, sliding_window=a.window),
                 a.layout, a.backend)
    with cp_stats() as st:
        fn()
    return st.as_dict()


def measure_bytes(a, n: int) -> dict:
    ranks = run_distributed(_bytes_rank, a.world, torch.device("cpu"), a, n, timeout=1800,
                            threads=1)
    (q, _, _), _ = make_inputs(a, 1, 0)
    # the ring without a window: P - 1 blocks of K,V forward, P - 1 again and P hops of
    # the fp32 dK,dV backward (the planner's formula, asserted against cp_stats in tests)
    full = cp_bytes("ring", a.world, 1, 1, n // a.world, a.heads, a.kv_heads, a.head_dim,
                    q.element_size())
    return dict(mib_sent_per_rank_window=max(r["fwd_bytes_sent"] + r["bwd_bytes_sent"]
                                             for r in ranks) / 2**20,
                comm_ops_window=max(r["fwd_comm_ops"] + r["bwd_comm_ops"] for r in ranks),
                mib_sent_per_rank_full=sum(full) / 2**20)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[32768], help="total n")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--stat", choices=sorted(STATS), default="min")
    p.add_argument("--bytes", action="store_true", help="also count bytes on real ranks")
    p.add_argument("--json", default="runs/bench/window.json")
    a = p.parse_args(argv)
    rows = []
    for n in a.seq_len:
        row = simulate(a, n)
        if a.bytes:
            row.update(measure_bytes(a, n))
        rows.append(row)
        print(f"n={n} P={a.world} window={a.window} {a.layout}: windowed ring "
              f"{max(row['window_ms_per_rank']):.0f} ms/rank (max), ideal "
              f"{row['ideal_ms']:.0f} ms -> {row['window_over_ideal']:.3f}x ideal; full causal "
              f"ring {max(row['full_ms_per_rank']):.0f} ms -> {row['full_over_window']:.2f}x "
              f"slower than the window"
              + (f"; MiB sent per rank {row['mib_sent_per_rank_window']:.2f} (full ring "
                 f"{row['mib_sent_per_rank_full']:.1f})" if a.bytes else ""), flush=True)
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
