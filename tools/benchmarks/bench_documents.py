"""Packed documents under CP: per-rank balance of the masked work, and a masked ring step.

    python -m tools.benchmarks.bench_documents balance --seq-len 32768 131072 --world 8 --samples 20
    python -m tools.benchmarks.bench_documents step --seq-len 16384 --doc-len 1024 --world 2

balance: for document lengths drawn log-normally (mean --mean-len tokens, sigma --sigma)
and packed into samples of n tokens (the last document cut at n), count the (query, key)
pairs each of P ranks' kernels evaluate under the ring's document plan
(context_parallel/documents.py), for every layout, and report max/mean over ranks (1.0 =
perfect balance), the worst sample and the mean over --samples samples, and the pairs
evaluated over the documents' causal pairs sum(len (len + 1) / 2) (1.0 = no wasted work).
No processes and no attention: the plan is the work.

step: P local gloo ranks (1 thread each) time one causal zigzag ring forward + backward
with documents of --doc-len tokens against the same call without documents (process CPU
time, median of --iters), with the FLOPs cp_stats counts for both.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ctxpar.context_parallel import LAYOUTS, rank_positions
from ctxpar.context_parallel.documents import doc_plan
from ctxpar.testing import run_distributed, save_results


def packed_boundaries(n: int, mean_len: float, sigma: float, gen) -> torch.Tensor:
    """cu_seqlens of one sample: log-normal document lengths (mean mean_len) until n."""
    mu = torch.log(torch.tensor(mean_len)) - sigma ** 2 / 2  # E[exp(N(mu, s))] = mean_len
    cuts, pos = [0], 0
    while pos < n:
        pos = min(n, pos + max(1, int(torch.exp(mu + sigma * torch.randn((), generator=gen)))))
        cuts.append(pos)
    return torch.tensor(cuts, dtype=torch.int64)


def rank_work(cu: torch.Tensor, n: int, world: int, layout: str) -> list:
    """Pairs each rank's kernels evaluate over all ring steps (causal)."""
    work = []
    for r in range(world):
        q_pos = rank_positions(n, r, world, layout)
        work.append(sum(blk.pairs() for s in range(world)
                        for blk in doc_plan(cu, q_pos, rank_positions(n, s, world, layout),
                                            True)))
    return work


def balance(a):
    rows = []
    print(f"{'n':>7} {'P':>2} {'layout':>10} {'max/mean (mean)':>15} {'worst':>6} "
          f"{'pairs / sum len^2/2':>19} {'docs/sample':>11}")
    for n in a.seq_len:
        gen = torch.Generator().manual_seed(0)
        samples = [packed_boundaries(n, a.mean_len, a.sigma, gen) for _ in range(a.samples)]
        for layout in LAYOUTS:
            ratios, overheads = [], []
            for cu in samples:
                w = rank_work(cu, n, a.world, layout)
                ratios.append(max(w) / statistics.mean(w))
                lens = torch.diff(cu)
                overheads.append(sum(w) / int((lens * (lens + 1) // 2).sum()))
            row = dict(n=n, world=a.world, layout=layout, mean_len=a.mean_len, sigma=a.sigma,
                       max_over_mean=statistics.mean(ratios), worst=max(ratios),
                       pairs_over_documents=statistics.mean(overheads),
                       docs_per_sample=statistics.mean(len(cu) - 1 for cu in samples))
            rows.append(row)
            print(f"{n:>7} {a.world:>2} {layout:>10} {row['max_over_mean']:>15.3f} "
                  f"{row['worst']:>6.3f} {row['pairs_over_documents']:>19.3f} "
                  f"{row['docs_per_sample']:>11.1f}")
    save_results(a.json, a, rows)


def _step_rank(rank, world, device, n, doc_len, heads, head_dim, iters):
    from ctxpar.context_parallel import cp_stats, ring_attention, shard_sequence

    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, n // world, heads, head_dim, generator=g) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    cu = torch.arange(0, n + 1, doc_len, dtype=torch.int32)
    if cu[-1] != n:
        cu = torch.cat([cu, torch.tensor([n], dtype=torch.int32)])
    out = {}
    for name, docs in (("unmasked", None), ("masked", cu)):
        def step():
            o = ring_attention(q, k, v, causal=True, layout="zigzag", cu_seqlens=docs)
            o.backward(dout)
        step()  # warmup
        with cp_stats() as st:
            step()
        times = []
        for _ in range(iters):
            t = time.process_time()
            step()
            times.append(time.process_time() - t)
        out[name] = dict(time_s=statistics.median(times), flops=st.fwd_flops + st.bwd_flops)
    return out


def step(a):
    rows = []
    for n in a.seq_len:
        ranks = run_distributed(_step_rank, a.world, torch.device("cpu"), n, a.doc_len,
                                a.heads, a.head_dim, a.iters, timeout=3600)
        t = {m: max(r[m]["time_s"] for r in ranks) for m in ("unmasked", "masked")}
        f = {m: sum(r[m]["flops"] for r in ranks) for m in ("unmasked", "masked")}
        row = dict(n=n, world=a.world, doc_len=a.doc_len, time_unmasked_s=t["unmasked"],
                   time_masked_s=t["masked"], flops_unmasked=f["unmasked"],
                   flops_masked=f["masked"], time_ratio=t["masked"] / t["unmasked"],
                   flop_ratio=f["masked"] / f["unmasked"])
        row["time_over_flop_ratio"] = row["time_ratio"] / row["flop_ratio"]
        rows.append(row)
        print(f"n={n} P={a.world} docs of {a.doc_len}: time {t['unmasked']:.2f} -> "
              f"{t['masked']:.2f} s ({row['time_ratio']:.3f}x), FLOPs {row['flop_ratio']:.3f}x, "
              f"time ratio / FLOP ratio {row['time_over_flop_ratio']:.2f}")
    save_results(a.json, a, rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("balance")
    b.add_argument("--seq-len", type=int, nargs="+", default=[32768, 131072])
    b.add_argument("--world", type=int, default=8)
    b.add_argument("--mean-len", type=float, default=2048)
    b.add_argument("--sigma", type=float, default=1.0)
    b.add_argument("--samples", type=int, default=20)
    b.add_argument("--json", default="runs/bench/documents_balance.json")
    s = sub.add_parser("step")
    s.add_argument("--seq-len", type=int, nargs="+", default=[16384])
    s.add_argument("--doc-len", type=int, default=1024)
    s.add_argument("--world", type=int, default=2)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--iters", type=int, default=3)
    s.add_argument("--json", default="runs/bench/documents_step.json")
    a = ap.parse_args(argv)
    balance(a) if a.what == "balance" else step(a)


if __name__ == "__main__":
    main()
