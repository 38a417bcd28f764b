"""Peak memory and time of the tiled MLP on an MLP-bound rank; activation offload's device bytes.

    python -m tools.benchmarks.bench_tiled_mlp  # the docs/benchmarks.md figures (CPU, fp32)
    python -m tools.benchmarks.bench_tiled_mlp --rss  # also each case's peak RSS, fresh process
    python -m tools.benchmarks.bench_tiled_mlp --tokens 4096 --ffn 8192 --layers 2

Cases, one process, 1 thread, fp32, SwiGLU (d 256, ffn 4096, 8192 tokens by default, where
the MLP's four (tokens, ffn) intermediates are 64x the (tokens, d) block input):
  mlp      the MLP alone, forward + backward of x (1, tokens, d)
  gpt      a GPT rank (tp = cp = 1), full checkpointing: the replayed block's MLP is its peak
each untiled, tiled 'auto' and tiled at a fixed size. Then the GPT with offload on and off:
bytes saved for backward on the device after the forward, and the offloader's counters
(--offload-layers blocks).

Peak bytes: a TorchDispatchMode sees every tensor an op makes on a new storage (not a view
or an out= of an input) and tracks it until Python frees it (weakref.finalize on the
storage): the live bytes allocated during the step, i.e. activations, gradients and
temporaries (not the parameters, inputs or optimizer). Exact and the same on every run. --rss cross-checks it in a fresh process per
case with MALLOC_MMAP_THRESHOLD_=131072 (every large buffer its own mmap, returned to the
OS when freed): after a warm-up step, the high-water mark VmHWM reset (/proc/self/clear_refs)
and the step's peak RSS minus its RSS before.
Time: median of --reps forward+backward steps, wall and process CPU seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from ctxpar.config import MemoryConfig, ModelConfig
from ctxpar.memory.tiled_mlp import mlp_tile_tokens
from ctxpar.testing.memory import LiveBytes
from models.gpt import GPT
from models.mlp import MLP
from models.options import ModelOptions

MiB = 2 ** 20


def build(case: str, tile, args, offload: bool = False):
    """(step function, the modules' parameters); step() runs one forward + backward."""
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.tokens, n_layers=args.layers,
                      d_model=args.d_model, n_heads=args.heads, ffn_hidden=args.ffn)
    if case == "mlp":
        mlp = MLP(cfg, None, tile_tokens=tile)
        for p in mlp.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(1, args.tokens, args.d_model, requires_grad=True)
        dy = torch.randn(1, args.tokens, args.d_model)

        def step():
            mlp(x).backward(dy)
            x.grad = None
            mlp.zero_grad(set_to_none=True)
        return step, mlp
    memory = MemoryConfig(tiled_mlp=tile is not None, mlp_tile_tokens=tile or "auto",
                          offload_activations=offload)
    model = GPT(cfg, options=ModelOptions(activation_checkpointing="full", memory=memory, seed=0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(args.tokens)

    def step():
        model(tokens, positions, labels).backward()
        model.zero_grad(set_to_none=True)
    return step, model


def measure(case: str, tile, args) -> dict:
    step, _ = build(case, tile, args)
    step()  # warm-up (first-call allocations)
    with LiveBytes() as live:
        step()
    wall, cpu = [], []
    for _ in range(args.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return dict(peak=live.peak, wall=statistics.median(wall), cpu=statistics.median(cpu))


def rss_peak(case: str, tile, args) -> int:
    """Peak RSS minus RSS before the step, in a fresh process (module docstring)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", json.dumps([case, tile]),
           *args.argv]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    return int(subprocess.run(cmd, env=env, check=True, capture_output=True,
                              text=True).stdout.split()[-1])


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def rss_child(spec: str, args) -> None:
    case, tile = json.loads(spec)
    step, _ = build(case, tile, args)
    step()  # warm-up: code pages and the kernels' per-shape caches are in RSS from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the high-water mark VmHWM to the current RSS
    before = _status_kib("VmRSS:")
    step()
    print((_status_kib("VmHWM:") - before) * 1024)


def offload_figures(args) -> dict:
    """Saved bytes on the device after the GPT's forward, offload off and on."""
    from ctxpar.testing import saved_tensor_bytes
    args = argparse.Namespace(**{**vars(args), "layers": args.offload_layers})
    out = {}
    for offload in (False, True):
        _, model = build("gpt", None, args, offload=offload)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
        with saved_tensor_bytes(model.parameters()) as seen:
            loss = model(tokens, torch.arange(args.tokens), torch.roll(tokens, -1, dims=1))
        stats = dict(model.offload.stats()) if offload else {}
        loss.backward()
        if offload:
            stats.update(backward_peak=model.offload.peak_device_bytes)
        out[offload] = dict(device_saved=sum(seen.values()), **stats)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--offload-layers", type=int, default=4)
    ap.add_argument("--fixed-tile", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    args.argv = [a for i, a in enumerate(argv)  # passed on to --rss children
                 if a not in ("--rss",) and not a.startswith("--rss-child")
                 and (i == 0 or argv[i - 1] != "--rss-child")]
    torch.set_num_threads(1)
    if args.rss_child:
        return rss_child(args.rss_child, args)
    auto = mlp_tile_tokens(args.tokens, args.d_model, args.ffn, "auto")
    print(f"fp32 SwiGLU d {args.d_model}, ffn {args.ffn}, {args.tokens} tokens "
          f"(auto tile {auto} tokens); gpt: {args.layers} layers, {args.heads} heads, "
          f"vocab {args.vocab}, full checkpointing; torch {torch.__version__}, 1 thread")
    print("| case | MLP | peak live MiB | vs untiled | " + ("peak RSS MiB | " if args.rss else "")
          + "fwd+bwd wall s | CPU s |")
    print("|---|---|---:|---:|" + ("---:|" if args.rss else "") + "---:|---:|")
    for case in ("mlp", "gpt"):
        base = None
        for label, tile in (("untiled", None), (f"tiled auto ({auto})", "auto"),
                            (f"tiled {args.fixed_tile}", args.fixed_tile)):
            r = measure(case, tile, args)
            base = base or r["peak"]
            rss = f" {rss_peak(case, tile, args) / MiB:.1f} |" if args.rss else ""
            print(f"| {case} | {label} | {r['peak'] / MiB:.1f} | {r['peak'] / base:.3f} |{rss} "
                  f"{r['wall']:.3f} | {r['cpu']:.3f} |")
    off = offload_figures(args)
    on = off[True]
    # With offload the layers' saves pass through its hooks, not the counting ones: on the
    # device are what is saved outside the layers plus what the offloader left there.
    print(f"\nGPT, {args.offload_layers} layers, full checkpointing, untiled: saved for "
          f"backward on the device after the "
          f"forward: offload off {off[False]['device_saved'] / MiB:.2f} MiB, "
          f"on {(on['device_saved'] + on['kept_bytes']) / MiB:.2f} MiB")
    print(f"offload counters after the forward: host {on['host_bytes'] / MiB:.2f} MiB, "
          f"device {on['device_bytes'] / MiB:.2f} MiB, kept on device "
          f"{on['kept_bytes'] / MiB:.2f} MiB; backward: at most "
          f"{on['backward_peak'] / MiB:.2f} MiB restored at once")


if __name__ == "__main__":
    main()
