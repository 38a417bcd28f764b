"""What the attention benchmarks share: dtypes, statistics, interleaved timing, inputs, and
the single-process ideal (one fused kernel fwd+bwd over all n tokens).

Used by bench_ring_attention.py, bench_ulysses.py and bench_window.py; no command of its own.
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch

from ctxpar.context_parallel.kernels import default_scale, get_backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATS = {"median": statistics.median, "min": min}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous: time only finished work
        torch.cuda.synchronize(device)


def timed(fns: dict, device, iters: int, warmup: int, clock=time.perf_counter,
           stat=statistics.median) -> dict:
    """stat (median, or min) of each fn()'s seconds over iters runs, after warmup runs. The
    fns take turns within every iteration, so a load change on a shared machine hits all
    of them alike; min keeps each fn's least disturbed run. The turn order goes through
    the permutations of the fns, one per iteration, so that no fn always runs right
    after the same other one (a rotation would keep the cyclic order): on CPU what ran
    just before can cost the next fn page faults (the fused kernel over all n tokens
    frees more than a rank's fwd+bwd touches), a bias as large as the 1-3% differences
    these benchmarks compare. len(fns)! iterations (6 for 3 fns) run every order once."""
    times = {name: [] for name in fns}
    orders = list(itertools.permutations(fns))
    for it in range(warmup + iters):
        for name in orders[it % len(orders)]:
            fn = fns[name]
            _sync(device)
            t0 = clock()
            fn()
            _sync(device)
            if it >= warmup:
                times[name].append(clock() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def make_inputs(a, seq, device, seed):
    torch.manual_seed(seed)  # generated on the device: 128K tokens would crawl on a CPU

    def mk(h):  # (B, seq, h, D)
        return torch.randn(a.batch, seq, h, a.head_dim, device=device, dtype=DTYPES[a.dtype])

    q, k, v = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads)
    return [x.requires_grad_() for x in (q, k, v)], mk(a.heads)


def fused_fwd_bwd(a, n, device):
    """fn() = one fused kernel fwd+bwd over all n tokens (the single-process ideal)."""
    (q, k, v), dout = make_inputs(a, n, device, seed=1)
    kernel, scale = get_backend(a.backend, q), default_scale(a.head_dim)

    def fused():
        out, lse = kernel.forward(q, k, v, a.causal, scale)
        kernel.backward(dout, q, k, v, out, lse, a.causal, scale)
    return fused, kernel.name
