"""Peak memory and time of one forward + backward with and without memory.tiled_loss.

    python -m tools.benchmarks.bench_tiled_loss  # vocab 32000, 4096 tokens, d 128
    python -m tools.benchmarks.bench_tiled_loss --tiles auto 256 1024 --d-model 256 --repeats 5

A logits-bound rank: a one-layer fp32 GPT (tp = cp = 1) whose (tokens, V) logits dwarf
everything else; a first row runs the same model with a negligible vocabulary (128), the
baseline the loss adds to. Each setting runs in a fresh process started with
MALLOC_MMAP_THRESHOLD_=131072, so glibc serves every buffer above 128 KiB by mmap and
returns it to the kernel on free: the resident set then follows the live bytes. The child
builds the model, runs one warm-up step (gradients stay allocated: set_to_none=False),
reads its resident set, resets the kernel's high-water mark (``/proc/self/clear_refs``
"5"), runs the measured steps and reports VmHWM - VmRSS: the peak of what one step adds
above the model, its gradients and the inputs. Time is the median step, wall clock and
this process's CPU seconds (steadier on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from models.options import ModelOptions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MMAP_THRESHOLD = 131072
BASELINE_VOCAB = 128


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child(args) -> dict:
    """One setting, in this (fresh) process: peak bytes above the step's start, seconds."""
    import torch

    from ctxpar.config import MemoryConfig, ModelConfig
    from models.gpt import GPT

    torch.set_num_threads(args.threads)
    vocab = BASELINE_VOCAB if args.tile == "baseline" else args.vocab
    cfg = ModelConfig(vocab_size=vocab, seq_len=args.tokens, n_layers=1,
                      d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.heads)
    tiled = args.tile not in ("none", "baseline")
    memory = MemoryConfig(tiled_loss=tiled, loss_tile_tokens=int(args.tile)
                          if args.tile.isdigit() else "auto")
    model = GPT(cfg, options=ModelOptions(memory=memory, seed=0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(cfg.seq_len)

    def step():
        model.zero_grad(set_to_none=False)
        model(tokens, positions, labels).backward()

    step()  # warm-up: gradients, thread pools, first-touch pages
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    wall, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"peak_bytes": (_status_kib("VmHWM") - base) * 1024,
            "step_s": statistics.median(wall), "step_cpu_s": statistics.median(cpu)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (batch 1)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tiles", nargs="+", default=["auto"],
                    help="tiled settings to measure besides the untiled loss: auto or N")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        args.tile = args.child
        print(json.dumps(child(args)))
        return

    from ctxpar.memory.tiled_loss import loss_tile_tokens

    logits = args.tokens * args.vocab * 4
    print(f"one-layer GPT fp32, vocab {args.vocab}, {args.tokens} tokens, d_model "
          f"{args.d_model}, {args.threads} thread(s), median of {args.repeats} steps; "
          f"fp32 logits {logits / 2**20:.0f} MiB")
    print("| loss | tile tokens | peak above step start | MiB | step s | step CPU s |\n"
          "|---|---:|---:|---:|---:|---:|")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "PYTHONPATH": ROOT}
    for setting in ["baseline", "none", *args.tiles]:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", setting,
               *(argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        tile = "-" if setting in ("none", "baseline") else loss_tile_tokens(
            args.tokens, args.vocab, args.d_model, int(setting) if setting.isdigit() else setting)
        name = {"none": "untiled", "baseline": f"untiled, vocab {BASELINE_VOCAB} (baseline)"
                }.get(setting, f"tiled ({setting})")
        print(f"| {name} | {tile} | {r['peak_bytes']:,} | {r['peak_bytes'] / 2**20:.1f} | "
              f"{r['step_s']:.3f} | {r['step_cpu_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
