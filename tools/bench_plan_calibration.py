"""The planner's step time against train.py's measured one, layout by layout (CPU).

    python tools/bench_plan_calibration.py                 # the docs/planner.md table
    python tools/bench_plan_calibration.py --steps 8 --only ring

Each layout runs train.py under torchrun (python -m torch.distributed.run; 2 ranks, one
core and one thread each, so a rank's idle time is not lent to another) on a
compute-bound CPU model (--set overrides of configs/tiny_cpu.yaml), and the median
step_time_s of its steps after the first --warmup is compared with what the planner
predicts for that layout on this machine (ctxpar.plan.startup.detect: the 'cpu' preset's
per-core FLOP/s shared by the ranks). "implied" is the per-core FLOP/s that would make
the prediction exact: the preset's value is their median (one parameter fitted), and the
error column is what is left.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ctxpar.config import load_config  # noqa: E402
from ctxpar.plan.cluster import GPUS, Cluster  # noqa: E402
from ctxpar.plan.search import evaluate  # noqa: E402
from ctxpar.plan.startup import detect, own_layout  # noqa: E402

# A model whose step is mostly matmul and attention on 2 cores (not Python overhead).
MODEL = ["model.seq_len=2048", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
         "model.n_layers=2", "train.micro_batch_size=1", "train.global_batch_size=4",
         "train.eval_interval=0", "logging.log_interval=1", "logging.wandb.mode=disabled"]

LAYOUTS = {  # name: --set overrides of the layout (2 ranks: one core each, like GPUs)
    "dp2": ["parallel.cp=1", "parallel.dp=2"],
    "cp2 ring zigzag": ["parallel.cp=2", "parallel.dp=1"],
    "cp2 ring contiguous": ["parallel.cp=2", "parallel.dp=1", "parallel.layout=contiguous"],
    "cp2 allgather": ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=allgather"],
    "cp2 ulysses": ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=ulysses"],
    "tp2": ["parallel.tp=2", "parallel.cp=1", "parallel.dp=1"],
    "pp2": ["parallel.cp=1", "parallel.pp=2", "parallel.dp=1"],
    "cp2 full ckpt": ["parallel.cp=2", "parallel.dp=1", "checkpointing.activation=full"],
    "cp2 selective ckpt": ["parallel.cp=2", "parallel.dp=1",
                           "checkpointing.activation=selective"],
    "dp2 micro-batch 2": ["parallel.cp=1", "parallel.dp=2", "train.micro_batch_size=2"],
}


def measure(sets, steps, warmup, nproc):
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", "29655",
               os.path.join(ROOT, "train.py"), "--config",
               os.path.join(ROOT, "configs", "tiny_cpu.yaml"), "--set", *sets,
               f"train.steps={steps}", f"logging.run_dir={run_dir}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   WANDB_MODE="disabled")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(sets)}: train.py failed:\n{proc.stderr[-3000:]}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return statistics.median(times)


def implied_flops(cfg, gpu, nproc, measured):
    """The preset's per-core FLOP/s at which the planner predicts `measured` exactly
    (bisection in log space: compute and the pipeline bubble scale as 1/F, the
    communication terms do not)."""
    lay = own_layout(cfg)
    share = gpu.flops / GPUS["cpu"].flops  # cores per rank (detect's share)
    lo, hi = 1e8, 1e13
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        t = evaluate(cfg, lay, Cluster(1, nproc, replace(gpu, flops=mid * share))).time.total
        lo, hi = (lo, mid) if t < measured else (mid, hi)
    return (lo * hi) ** 0.5


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", default="", help="layouts whose name contains this")
    a = p.parse_args()
    import torch

    rows, implied = [], []
    for name, sets in LAYOUTS.items():
        if a.only not in name:
            continue
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), MODEL + sets,
                          world_size=a.nproc, check_paths=False)
        gpu, how = detect(torch.device("cpu"), a.nproc)
        plan = evaluate(cfg, own_layout(cfg), Cluster(1, a.nproc, gpu))
        predicted = plan.time.total
        measured = measure(MODEL + sets, a.steps, a.warmup, a.nproc)
        fit = implied_flops(cfg, gpu, a.nproc, measured)
        implied.append(fit)
        rows.append((name, measured, predicted, fit))
        print(f"{name}: measured {measured:.3f} s, predicted {predicted:.3f} s "
              f"({100 * (predicted / measured - 1):+.0f}%), implied {fit / 1e9:.1f} GFLOP/s",
              flush=True)
    print(f"\n{how}; preset cpu.flops = {GPUS['cpu'].flops / 1e9:.1f} GFLOP/s per core; "
          f"median implied {statistics.median(implied) / 1e9:.1f}\n")
    print("| layout | measured step | predicted | error | implied GFLOP/s per core |")
    print("|---|---:|---:|---:|---:|")
    for name, meas, pred, fit in rows:
        print(f"| {name} | {meas:.3f} s | {pred:.3f} s | {100 * (pred / meas - 1):+.0f}% | "
              f"{fit / 1e9:.1f} |")


if __name__ == "__main__":
    main()
