"""ctxpar's tiled loss and tiled MLP beside DeepSpeed's ALST pieces on the same inputs.

    python -m tools.benchmarks.bench_alst                 # the docs/benchmarks.md table (CPU, fp32)
    python -m tools.benchmarks.bench_alst --reps 5 --rows loss-32k mlp

One process, one thread, fp32. Each row builds one set of inputs and weights and runs, in
turn, the untiled layers, ctxpar's tiled function and DeepSpeed's
(deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss / TiledMLP) at the
shard counts named in the row; every run's loss (or output), dx and weight gradients are
asserted equal to the untiled ones. The loss is back-propagated from 1 (DeepSpeed's tiled
loss scales only dx by the upstream gradient, not the head's dW).

Peak: ctxpar.testing.memory.LiveBytes, the bytes of every storage an op makes during one forward
+ backward that Python still holds, at their highest: activations, gradients (the
parameters' .grad included, set to None between steps) and temporaries above the inputs
and weights. Time: process CPU seconds per token of one forward + backward, the minimum
over --reps rounds, each round running every contender once in turn (interleaved), so a
burst of load on the shared machine hits all of them alike.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.memory.tiled_loss import loss_tile_tokens, tiled_vocab_parallel_cross_entropy
from ctxpar.memory.tiled_mlp import mlp_tile_tokens
from ctxpar.testing.memory import LiveBytes
from models.mlp import MLP

MiB = 2 ** 20
# name: (kind, tokens, d, vocab or ffn, DeepSpeed shard counts, run the untiled layers)
ROWS = {
    "loss-32k": ("loss", 4096, 512, 32000, ("default", "equal"), True),
    "loss-128k": ("loss", 1024, 512, 128256, ("default", "equal"), True),
    "mlp": ("mlp", 8192, 512, 4096, ("default", 8), True),
    "loss-32k-long": ("loss", 16384, 512, 32000, ("default", "equal"), False),
}


def alst_loss_shards(tokens: int, vocab: int) -> int:
    """ALST's rule for the loss: as many shards as GiB of fp32 logits (at least one)."""
    return max(1, math.ceil(tokens * vocab * 4 / 2 ** 30))


def loss_contenders(tokens, d, vocab, shard_specs, untiled, tile="auto"):
    """{label: step} for the head + loss; step() -> (loss, dx, dW). shard_specs: 'default'
    (ALST's rule), 'equal' (ctxpar's tile) or a count."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=g)
    x = torch.randn(1, tokens, d, generator=g).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens), generator=g)
    y[0, torch.rand(tokens, generator=g) < 0.1] = -100
    tile = loss_tile_tokens(tokens, vocab, d, tile)

    def fn(module, xs, ys):
        return F.cross_entropy(module(xs).view(-1, vocab), ys.reshape(-1), reduction="sum",
                               ignore_index=-100)

    def run(body):
        def step():
            x.grad, head.weight.grad = None, None
            loss = body()
            loss.backward()
            return loss.detach(), x.grad, head.weight.grad
        return step

    out = {}
    if untiled:
        out["untiled"] = run(lambda: fn(head, x, y))
    out[f"ctxpar (tile {tile})"] = run(lambda: tiled_vocab_parallel_cross_entropy(
        x, head.weight, y, None, tile, reduction="sum"))
    for spec in shard_specs:
        shards = {"default": alst_loss_shards(tokens, vocab),
                  "equal": math.ceil(tokens / tile)}.get(spec, spec)
        out[f"DeepSpeed ({shards} shards, {spec})"] = run(
            lambda s=shards: TiledFusedLogitsLoss.apply(fn, head, x, y, None, s,
                                                        [head.weight], "sum"))
    return out


def mlp_contenders(tokens, d, ffn, shard_specs, untiled):
    """{label: step} for the SwiGLU MLP; step() -> (y, dx, the weights' grads).
    shard_specs: 'default' (ALST's ceil(T / d)) or a count (ctxpar at the equal tile too)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    cfg = ModelConfig(vocab_size=128, seq_len=tokens, n_layers=1, d_model=d, n_heads=4,
                      ffn_hidden=ffn)
    plain = MLP(cfg, None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.02, generator=g)
    x = torch.randn(1, tokens, d, generator=g).requires_grad_()
    dy = torch.randn(1, tokens, d, generator=g)
    tile = mlp_tile_tokens(tokens, d, ffn)
    params = list(plain.parameters())

    def run(module_fn, tile_tokens=None):
        def step():
            x.grad = None
            for p in params:
                p.grad = None
            plain.tile_tokens = tile_tokens  # the same weights, tiled by ctxpar or not
            out = module_fn()
            out.backward(dy)
            return out.detach(), x.grad, *[p.grad for p in params]
        return step

    def alst(shards):
        return TiledMLP.apply(lambda m, xs: m(xs), plain, x, shards, params)

    out = {}
    if untiled:
        out["untiled"] = run(lambda: plain(x))
    out[f"ctxpar (tile {tile})"] = run(lambda: plain(x), tile)
    for spec in shard_specs:
        if spec == "default":
            shards = math.ceil(tokens / d)  # ALST's ceil(T / d)
        else:
            shards = spec
            t = math.ceil(tokens / shards)
            out[f"ctxpar (tile {t})"] = run(lambda: plain(x), t)
        out[f"DeepSpeed ({shards} shards, {spec if spec == 'default' else 'equal'})"] = \
            run(lambda s=shards: alst(s))
    return out


def peaks(steps, name=""):
    """{label: peak live bytes of one step}, after asserting every contender's results equal
    the first's (fp32, sums in other orders: rtol 1e-4, atol 1e-5 of the largest entry)."""
    ref, peak = None, {}
    for label, step in steps.items():
        step()  # warm-up: first-call allocations, thread pools
        with LiveBytes() as live:
            got = step()
        peak[label] = live.peak
        if ref is None:
            ref = [t.clone() for t in got]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()),
                                       msg=f"{name} {label}")
        del got
    return peak


def bench_row(name, reps):
    kind, tokens, d, width, specs, untiled = ROWS[name]
    make = loss_contenders if kind == "loss" else mlp_contenders
    steps = make(tokens, d, width, specs, untiled)
    peak, cpu = peaks(steps, name), {k: [] for k in steps}
    for _ in range(reps):
        for label, step in steps.items():
            c0 = time.process_time()
            step()
            cpu[label].append(time.process_time() - c0)
    return {label: (peak[label], min(cpu[label]) / tokens) for label in steps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"fp32, 1 thread, min of {args.reps} interleaved rounds; load average before "
          f"{os.getloadavg()[0]:.1f}")
    print("| row | contender | peak MiB | CPU us/token | time / ctxpar |\n|---|---|---:|---:|---:|")
    for name in args.rows:
        res = bench_row(name, args.reps)
        base = next(v[1] for k, v in res.items() if k.startswith("ctxpar"))
        for label, (pk, t) in res.items():
            if label.startswith("ctxpar"):
                base = t
            print(f"| {name} | {label} | {pk / MiB:.0f} | {t * 1e6:.1f} | {t / base:.2f} |",
                  flush=True)
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
