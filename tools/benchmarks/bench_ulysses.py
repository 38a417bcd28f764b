"""Ulysses side by side: ctxpar's against DeepSpeed-Ulysses, in the same ranks, same kernel.

Per (n, P, heads/kv heads) this spawns P local ranks (ctxpar/testing/distributed.py: gloo on
CPU) and times, in turn within every iteration so that a change of load hits all alike:
    ctxpar      context_parallel_attention(comm="ulysses", layout="contiguous")
    deepspeed   deepspeed.sequence.layer.DistributedAttention(local, group, scatter_idx=2,
                gather_idx=1), batch first, around the same fused kernel ctxpar calls
                (kernels.py's sdpa backend as an autograd Function). DeepSpeed refuses
                fewer kv heads than ranks, so there (GQA 8/2 at P = 4) its caller repeats
                the kv heads up to P first, as Megatron-DeepSpeed callers must; the
                repeat and its gradient sum are timed as part of its fwd+bwd.
    fused       one fused-kernel fwd+bwd over all n tokens (the one-process time)
    ratio       (per-rank fwd+bwd time, slowest rank) / (fused time / P): 1.0 = perfect
                scaling; what the all-to-alls and the regrouping copies cost on top.
Before timing, every rank checks that both produce the same output and input gradients
(reported as the largest difference; both compute the same kernel on the same tokens).

    python -m tools.benchmarks.bench_ulysses --seq-len 8192 --world-sizes 2 4 --heads 8 \\
        --kv-heads 8 2 --threads 1 --iters 7 --stat min --repeats 3
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ctxpar.context_parallel import context_parallel_attention
from ctxpar.context_parallel.kernels import default_scale, get_backend
from ctxpar.testing import run_distributed, save_results
from tools.benchmarks.attention_timing import (DTYPES, STATS, fused_fwd_bwd, make_inputs,
                                             timed)


class _FusedAttention(torch.autograd.Function):
    """DeepSpeed's local attention: the fused kernel ctxpar's Ulysses calls, (B, n, h, D)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = kernel.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale = ctx.args
        dq, dk, dv = kernel.backward(dout.contiguous(), q, k, v, out, lse, causal, scale)
        return dq, dk, dv, None, None, None


class _LocalAttention(torch.nn.Module):
    def __init__(self, kernel, causal, scale):
        super().__init__()
        self.args = (kernel, causal, scale)

    def forward(self, q, k, v):
        return _FusedAttention.apply(q, k, v, *self.args)


def _deepspeed_peer(a, kernel, scale, world):
    """fn(q, k, v) -> out through DeepSpeed's DistributedAttention over the world."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm

    init_deepspeed_comm()  # deepspeed.comm over this gloo world, without the CPU shm op
    attn = DistributedAttention(_LocalAttention(kernel, a.causal, scale), dist.group.WORLD,
                                scatter_idx=2, gather_idx=1)
    assert deepspeed.comm.get_world_size() == world

    def run(q, k, v):
        if k.shape[2] < world:  # DeepSpeed needs >= P kv heads: its caller repeats them
            k, v = (x.repeat_interleave(world // k.shape[2], dim=2) for x in (k, v))
        return attn(q, k, v, batch_dim_idx=0)
    return run


def _rank_main(rank, world, device, a, n, kv_heads) -> dict:
    a = argparse.Namespace(**{**vars(a), "kv_heads": kv_heads})  # this case's kv heads
    (q, k, v), dout = make_inputs(a, n // world, device, seed=rank)
    kernel, scale = get_backend(a.backend, q), default_scale(a.head_dim)
    deepspeed_attn = _deepspeed_peer(a, kernel, scale, world)
    peers = {
        "ctxpar": lambda q, k, v: context_parallel_attention(
            q, k, v, comm="ulysses", layout="contiguous", causal=a.causal, backend=a.backend),
        "deepspeed": deepspeed_attn,
    }

    def fwd_bwd(attend):
        for x in (q, k, v):
            x.grad = None
        attend(q, k, v).backward(dout)

    # Both compute the same kernel on the same gathered tokens: compare before timing.
    results = {}
    for name, attend in peers.items():
        for x in (q, k, v):
            x.grad = None
        out = attend(q, k, v)
        out.backward(dout)
        results[name] = [out.detach()] + [x.grad.clone() for x in (q, k, v)]
    max_diff = max((x - y).abs().max().item()
                   for x, y in zip(results["ctxpar"], results["deepspeed"]))

    fused, _ = fused_fwd_bwd(a, n, device)  # one process alone over all n tokens
    fns = {name: (lambda attend=attend: fwd_bwd(attend)) for name, attend in peers.items()}
    t = timed(dict(fns, fused=fused), device, a.iters, a.warmup, stat=STATS[a.stat])
    return dict(time_s={name: t[name] for name in peers}, fused_s=t["fused"],
                max_diff=max_diff, kernel=kernel.name)


def run(a, n, world, kv_heads, repeat) -> dict:
    ranks = run_distributed(_rank_main, world, torch.device("cpu"), a, n, kv_heads,
                            timeout=a.timeout, threads=a.threads)
    ideal = statistics.mean(r["fused_s"] for r in ranks) / world
    ratios = {name: max(r["time_s"][name] for r in ranks) / ideal
              for name in ranks[0]["time_s"]}
    return dict(n=n, P=world, heads=a.heads, kv_heads=kv_heads, repeat=repeat,
                ideal_ms=1e3 * ideal, ratio=ratios,
                time_ms={name: 1e3 * max(r["time_s"][name] for r in ranks) for name in ratios},
                max_diff=max(r["max_diff"] for r in ranks), kernel=ranks[0]["kernel"])


def _table(rows) -> str:
    lines = ["| n | P | heads/kv | run | ideal ms (fused/P) | ctxpar ms | deepspeed ms | "
             "ctxpar ratio | deepspeed ratio | ctxpar/deepspeed | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, d = r["ratio"]["ctxpar"], r["ratio"]["deepspeed"]
        lines.append(f"| {r['n']} | {r['P']} | {r['heads']}/{r['kv_heads']} | {r['repeat']} | "
                     f"{r['ideal_ms']:.1f} | {r['time_ms']['ctxpar']:.1f} | "
                     f"{r['time_ms']['deepspeed']:.1f} | {c:.3f} | {d:.3f} | {c / d:.3f} | "
                     f"{r['max_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192], help="total n")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--iters", type=int, default=6, help="a multiple of 6: every order of the three fns once (attention_timing.timed)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--stat", choices=sorted(STATS), default="median")
    p.add_argument("--repeats", type=int, default=1, help="fresh ranks per case")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default="runs/bench_ulysses.json", help="output file")
    a = p.parse_args(argv)
    rows = []
    for n in a.seq_len:
        for world in a.world_sizes:
            for kv in a.kv_heads:
                if a.heads % world or n % world or a.heads % kv:
                    print(f"skip P={world} heads {a.heads}/{kv} n={n}: does not divide",
                          flush=True)
                    continue
                for rep in range(1, a.repeats + 1):
                    rows.append(run(a, n, world, kv, rep))
                    print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
