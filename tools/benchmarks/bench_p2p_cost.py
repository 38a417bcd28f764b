"""What moving the ring's bytes costs a rank by itself: process CPU time and wall time of
paired isend/irecv between 2 local ranks (gloo on CPU), no attention.

    python -m tools.benchmarks.bench_p2p_cost --mib 8 --messages 8      # fp32 MHA ring, n 8192, P 2

Compare with bench_ring_attention.py's "overlap" column (time / time without the
communication) at the same bytes: what the transfers cost beyond their own CPU time is
the compute they slow down on shared cores. A rank waiting for its peer costs ~no CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ctxpar.testing import run_distributed


def exchange(rank, world, device, mib, messages, reps):
    peer = 1 - rank
    send = [torch.randn(int(mib * 2 ** 18), device=device) for _ in range(messages)]
    recv = [torch.empty_like(b) for b in send]
    runs = []
    for r in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        for b, rb in zip(send, recv):
            ops = [dist.P2POp(dist.isend, b, peer), dist.P2POp(dist.irecv, rb, peer)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if r:
            runs.append((time.process_time() - c0, time.perf_counter() - w0))
    return (statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=8.0, help="MiB per message")
    p.add_argument("--messages", type=int, default=8, help="messages each way")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    per_rank = run_distributed(exchange, 2, torch.device("cpu"), a.mib, a.messages, a.reps,
                               timeout=3600)
    for rank, (cpu, wall) in enumerate(per_rank):
        print(f"rank {rank}: {a.messages} x {a.mib:g} MiB sent and received: process CPU "
              f"{cpu * 1e3:.0f} ms, wall {wall * 1e3:.0f} ms (median of {a.reps})")


if __name__ == "__main__":
    main()
