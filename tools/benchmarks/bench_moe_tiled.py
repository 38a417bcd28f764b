"""Peak memory and time of a MoE layer with its experts tiled along the sequence (CPU).

    python -m tools.benchmarks.bench_moe_tiled   # the docs/benchmarks.md figures (fp32)
    python -m tools.benchmarks.bench_moe_tiled --tokens 4096 --tiles 512 1024 --recompute on

One process, one thread, fp32: models/moe.py's MoE (the router, the routed experts, no
shared expert, ep 1) over x (1, --tokens, d), forward and backward of a fixed output
gradient, untiled and with memory.tiled_mlp at each --tiles size (the router over all
tokens, each tile dispatched, computed and combined inside its own activation checkpoint:
models/moe.py's docstring). --recompute: without ('off'), with ('on') or both ('both',
the default) the layer's block recompute as activation checkpointing runs it: x + moe(x)
(the block's residual) inside a non-reentrant checkpoint whose recompute skips the tiles'
experts (Block.recompute_context's context_fn, models/block.py). Defaults: 16,384
tokens, top-4 of 16 experts, d 256, each expert SwiGLU of width 512: the untiled layer's
N k (d + 2f) rows of dispatch buffers and expert intermediates are what tiling cuts.

Peak bytes: ctxpar.testing.memory.LiveBytes (every tensor an op makes on a new storage,
tracked until freed: activations, gradients and temporaries of the step, not the
parameters or x), exact and the same on every run. Time: the median of --reps
forward+backward steps after a warm-up, wall and process CPU seconds; each row against
the untiled layer of the same recompute setting. --json keeps the rows.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint

from ctxpar.config import ModelConfig
from ctxpar.config.moe import MoEConfig
from ctxpar.testing.memory import LiveBytes
from models.moe import MoE

MiB = 2 ** 20


def build(tile, recompute: bool, a):
    """(step function): one forward + backward of the MoE layer, tiled at `tile` or not,
    inside the block's recompute or not."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=a.d_model, n_heads=4, n_layers=1,
                      seq_len=a.tokens, mlp="swiglu",
                      moe=MoEConfig(num_experts=a.experts, top_k=a.top_k,
                                    expert_hidden=a.expert_hidden))
    moe = MoE(cfg, tile=tile)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, a.tokens, a.d_model, requires_grad=True)
    dy = torch.randn(1, a.tokens, a.d_model)

    def block(h):  # the channel mixer's half of models/block.py's Block (norm left out)
        return h + moe(h)

    def contexts():  # Block.recompute_context for a block without post-MLP norm
        return nullcontext(), moe.output_unread_context() or nullcontext()

    def step():
        out = checkpoint(block, x, use_reentrant=False, context_fn=contexts) if recompute \
            else block(x)
        out.backward(dy)
        x.grad = None
        moe.zero_grad(set_to_none=True)
    return step


def measure(tile, recompute: bool, a) -> dict:
    step = build(tile, recompute, a)
    step()  # warm-up
    with LiveBytes() as live:
        step()
    wall, cpu = [], []
    for _ in range(a.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return dict(tile=tile or "untiled", recompute=recompute, peak=live.peak,
                wall=statistics.median(wall), cpu=statistics.median(cpu))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-hidden", type=int, default=512)
    ap.add_argument("--tiles", type=int, nargs="+", default=[2048])
    ap.add_argument("--recompute", choices=["off", "on", "both"], default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    settings = {"off": [False], "on": [True], "both": [False, True]}[a.recompute]
    rows = [measure(tile, rc, a) for rc in settings for tile in [None, *a.tiles]]
    print(f"MoE layer: {a.tokens} tokens, top-{a.top_k} of {a.experts} experts, d {a.d_model}, "
          f"expert SwiGLU {a.expert_hidden}, fp32, 1 thread")
    print("| experts | block recompute | peak live MiB | vs untiled | fwd+bwd wall s | "
          "vs untiled | CPU s | vs untiled |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next(b for b in rows if b["tile"] == "untiled" and b["recompute"] == r["recompute"])
        name = "untiled" if r["tile"] == "untiled" else f"tiles of {r['tile']}"
        print(f"| {name} | {'on' if r['recompute'] else 'off'} | {r['peak'] / MiB:.1f} | "
              f"{r['peak'] / base['peak']:.3f} | {r['wall']:.3f} | "
              f"{r['wall'] / base['wall']:.2f} | {r['cpu']:.3f} | {r['cpu'] / base['cpu']:.2f} |")
    if a.json:
        import json
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
