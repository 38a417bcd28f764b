"""The planner's step time against train.py's measured one, layout by layout (CPU).

    python -m tools.benchmarks.bench_plan_calibration --save /tmp/calib.json  # docs/planner.md
    python -m tools.benchmarks.bench_plan_calibration --load a.json b.json       # refit over runs
    python -m tools.benchmarks.bench_plan_calibration --only ring --steps 8

Each layout runs train.py under torchrun (python -m torch.distributed.run; 2 ranks, one
core and one thread each, so that a rank's idle time is not lent to another, as on
GPUs) and its median step_time_s after --warmup steps is compared with what the planner
predicts for it on this machine (ctxpar.plan.startup.detect: the 'cpu' preset, shared by
the ranks). Two model sizes, both --set overrides of configs/tiny_cpu.yaml:
- compute-bound (seq 2048, d 256): the step is matmul and attention FLOPs, which pins the
  preset's FLOP/s;
- overhead-bound (configs/tiny_cpu.yaml itself, seq 256, d 64, 2 and 4 layers): the step
  is Python and op dispatch, which pins the preset's per-layer overhead.
The fit is the (FLOP/s, overhead) pair that minimises the squared log error over all
layouts; the table gives each layout's error at the preset's (rounded) values.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace

from ctxpar.config import load_config
from ctxpar.plan.cluster import GPUS, Cluster
from ctxpar.plan.search import evaluate
from ctxpar.plan.startup import detect, config_candidate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUIET = ["train.eval_interval=0", "logging.log_interval=1", "logging.wandb.mode=disabled"]
# A model whose step is mostly matmul and attention on 2 cores (not Python overhead).
BIG = ["model.seq_len=2048", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
       "model.n_layers=2", "train.micro_batch_size=1", "train.global_batch_size=4"]

LAYOUTS = {  # name: --set overrides (2 ranks)
    "dp2": BIG + ["parallel.cp=1", "parallel.dp=2"],
    "cp2 ring zigzag": BIG + ["parallel.cp=2", "parallel.dp=1"],
    "cp2 ring contiguous": BIG + ["parallel.cp=2", "parallel.dp=1",
                                  "parallel.layout=contiguous"],
    "cp2 allgather": BIG + ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=allgather"],
    "cp2 ulysses": BIG + ["parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=ulysses"],
    "tp2": BIG + ["parallel.tp=2", "parallel.cp=1", "parallel.dp=1"],
    "pp2": BIG + ["parallel.cp=1", "parallel.pp=2", "parallel.dp=1"],
    "cp2 full ckpt": BIG + ["parallel.cp=2", "parallel.dp=1", "activation_checkpointing.mode=full"],
    "cp2 selective ckpt": BIG + ["parallel.cp=2", "parallel.dp=1",
                                 "activation_checkpointing.mode=selective"],
    "dp2 micro-batch 2": BIG + ["parallel.cp=1", "parallel.dp=2", "train.micro_batch_size=2"],
    # the memory options, each beside the layout it is added to (the same run's drift)
    "cp2 vocab 8192": BIG + ["parallel.cp=2", "parallel.dp=1", "model.vocab_size=8192"],
    "cp2 vocab 8192 tiled loss": BIG + ["parallel.cp=2", "parallel.dp=1",
                                        "model.vocab_size=8192", "memory.tiled_loss=true"],
    "cp2 full ckpt tiled MLP": BIG + ["parallel.cp=2", "parallel.dp=1",
                                      "activation_checkpointing.mode=full",
                                      "memory.tiled_mlp=true"],
    "cp2 full ckpt activation offload": BIG + ["parallel.cp=2", "parallel.dp=1",
                                               "activation_checkpointing.mode=full",
                                               "memory.offload_activations=true"],
    "dp2 optimizer offload": BIG + ["parallel.cp=1", "parallel.dp=2",
                                    "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
    # configs/tiny_cpu.yaml (make train's model): overhead-bound
    "tiny cp2 dp1": ["parallel.cp=2", "parallel.dp=1"],
    "tiny dp2": ["parallel.cp=1", "parallel.dp=2"],
    "tiny tp2": ["parallel.tp=2", "parallel.cp=1", "parallel.dp=1"],
    "tiny cp2, 4 layers": ["parallel.cp=2", "parallel.dp=1", "model.n_layers=4"],
}


def measure(sets, steps, warmup, nproc):
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", "29655", os.path.join(ROOT, "train.py"), "--config",
               os.path.join(ROOT, "configs", "tiny_cpu.yaml"), "--set", *QUIET, *sets,
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


def predict(cfg, nproc, flops, overhead):
    """The planner's step time on this machine with the cpu preset at (flops, overhead)."""
    import torch
    gpu, _ = detect(torch.device("cpu"), nproc,
                    cpu=replace(GPUS["cpu"], flops=flops, overhead=overhead))
    return evaluate(cfg, config_candidate(cfg, nproc), Cluster(1, nproc, gpu)).time.total


def fit(cases, nproc):
    """(flops, overhead) minimising sum(log(predicted / measured)^2): a grid, then a finer
    grid around its best point."""
    def loss(f, o):
        return sum(math.log(predict(cfg, nproc, f, o) / m) ** 2 for cfg, m in cases)

    lf, lo = (9.5, 12.5), (-5.0, -0.5)
    best = None
    for _ in range(3):
        fs = [10 ** (lf[0] + (lf[1] - lf[0]) * i / 24) for i in range(25)]
        os_ = [0.0] + [10 ** (lo[0] + (lo[1] - lo[0]) * i / 24) for i in range(25)]
        best = min((loss(f, o), f, o) for f in fs for o in os_)
        _, f, o = best
        wf, wo = (lf[1] - lf[0]) / 8, (lo[1] - lo[0]) / 8
        lf = (math.log10(f) - wf, math.log10(f) + wf)
        lo = (math.log10(o) - wo, math.log10(o) + wo) if o > 0 else (lo[0] - 1, lo[0] + 1)
    return best[1], best[2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", default="", help="layouts whose name contains this")
    p.add_argument("--save", help="write the measurements (JSON) here")
    p.add_argument("--load", nargs="+", default=[],
                   help="measurements of earlier --save runs (fitted together): no runs")
    a = p.parse_args()

    runs = [json.load(open(path)) for path in a.load] or [{}]
    cases, names = [], []
    for i, measured in enumerate(runs):
        for name, sets in LAYOUTS.items():
            if a.only not in name:
                continue
            if name not in measured:
                measured[name] = measure(sets, a.steps, a.warmup, a.nproc)
                print(f"{name}: {measured[name]:.3f} s", flush=True)
            cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), QUIET + sets,
                              world_size=a.nproc, check_paths=False)
            cases.append((cfg, measured[name]))
            names.append(name if len(runs) == 1 else f"{name} (run {i + 1})")
    if a.save:
        with open(a.save, "w") as f:
            json.dump(runs[0], f, indent=1)

    f, o = fit(cases, a.nproc)
    cpu = GPUS["cpu"]
    print(f"\nfit: {f / 1e9:.1f} GFLOP/s per core, overhead {o * 1e3:.2f} ms per layer per "
          f"micro-batch; the preset: {cpu.flops / 1e9:.1f} GFLOP/s, "
          f"{cpu.overhead * 1e3:.2f} ms\n")
    print("| layout | measured step | predicted (preset) | error |")
    print("|---|---:|---:|---:|")
    for name, (cfg, m) in zip(names, cases):
        pred = predict(cfg, a.nproc, cpu.flops, cpu.overhead)
        print(f"| {name} | {m:.3f} s | {pred:.3f} s | {100 * (pred / m - 1):+.0f}% |")


if __name__ == "__main__":
    main()
