"""Do the demo configs demonstrate? Train each configs/tiny_cpu*.yaml and check it learns.

    python -m tools.benchmarks.bench_demos                          # every configs/tiny_cpu*.yaml
    python -m tools.benchmarks.bench_demos configs/tiny_cpu_4d.yaml --min-accuracy 0.8 \\
        --max-seconds 180

Each config runs from scratch with the command `make train` uses (the DeepSpeed launcher,
--num_gpus NPROC, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1), into its own run directory under
--out (`--resume none --set logging.run_dir=...`, nothing else changed). The script reads
the run's metrics.jsonl and prints the passkey accuracy at every eval, the final loss and
the wall time, as a Markdown table for docs/benchmarks.md. It exits 1 if a config's final
accuracy is below --min-accuracy (or its wall time above --max-seconds, when given), 2 on
bad arguments. Wall time includes start-up and depends on the machine's load: the load
average is printed before and after.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List

from ctxpar.distributed.parallel_state import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launcher(nproc: int, config: str, run_dir: str) -> List[str]:
    """`make train`'s command (Makefile), fresh run directory, no resume."""
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [deepspeed, "--num_gpus", str(nproc), "--master_port", str(free_port()),
            "train.py", "--config", config, "--resume", "none",
            "--set", f"logging.run_dir={run_dir}"]


def run_demo(config: str, nproc: int, out: str) -> Dict:
    """Train config from scratch; its eval curve, final loss and wall time."""
    name = os.path.splitext(os.path.basename(config))[0]
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start empty
    os.makedirs(run_dir)
    log = os.path.join(out, f"{name}.log")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(launcher(nproc, config, run_dir), cwd=ROOT, env=env,
                             stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    rows = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        rows = [json.loads(line) for line in open(metrics)]
    steps = [r for r in rows if "loss" in r]
    return {"config": config, "rc": rc, "wall_s": wall, "log": log,
            "curve": [(r["step"], r["eval_accuracy"], r.get("eval_loss"))
                      for r in rows if "eval_accuracy" in r],
            "final_loss": steps[-1]["loss"] if steps else None,
            "steps": steps[-1]["step"] if steps else 0,
            # training alone: the logged steps' time (each row times one step of log_interval)
            "steps_per_s": len(steps) / sum(r["step_time_s"] for r in steps) if steps else None}


def verdict(result: Dict, min_accuracy: float, max_seconds) -> List[str]:
    """What is wrong with one run (empty: it meets the bar)."""
    if result["rc"] != 0:
        return [f"exited {result['rc']} (see {result['log']})"]
    if not result["curve"]:
        return ["no passkey evaluation in metrics.jsonl (is data.kind passkey?)"]
    problems = []
    final = result["curve"][-1][1]
    if final < min_accuracy:
        problems.append(f"final accuracy {final:.3f} < {min_accuracy}")
    if max_seconds is not None and result["wall_s"] > max_seconds:
        problems.append(f"wall time {result['wall_s']:.0f} s > {max_seconds} s")
    return problems


def report(result: Dict) -> str:
    """A Markdown block: the eval curve and the run's figures."""
    lines = [f"{result['config']}: {result['steps']} steps, final loss "
             f"{result['final_loss']:.4f}, wall {result['wall_s']:.0f} s "
             f"(training ~{result['steps_per_s'] or 0:.2f} steps/s)", "",
             "| step | " + " | ".join(str(s) for s, _, _ in result["curve"]) + " |",
             "|---|" + "---:|" * len(result["curve"]),
             "| accuracy | " + " | ".join(f"{a:.3f}" for _, a, _ in result["curve"]) + " |"]
    if all(loss is not None for _, _, loss in result["curve"]):
        lines.append("| eval loss (answer digits) | "
                     + " | ".join(f"{loss:.2f}" for _, _, loss in result["curve"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="*", help="default: configs/tiny_cpu*.yaml")
    p.add_argument("--nproc", type=int, default=4, help="processes, as make train's NPROC")
    p.add_argument("--min-accuracy", type=float, default=0.8,
                   help="final passkey accuracy each config must reach (default 0.8)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="fail a config whose wall time is longer (default: report only)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_demos"),
                   help="run directories and launcher logs")
    args = p.parse_args(argv)
    configs = args.configs or sorted(glob.glob(os.path.join(ROOT, "configs", "tiny_cpu*.yaml")))
    missing = [c for c in configs if not os.path.isfile(c)]
    if missing:
        print(f"bench_demos: error: config file does not exist: {', '.join(missing)}",
              file=sys.stderr)
        return 2
    failed = 0
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for config in configs:
        config = os.path.relpath(os.path.abspath(config), ROOT)
        print(f"\n== {config} (nproc {args.nproc})", flush=True)
        result = run_demo(config, args.nproc, os.path.abspath(args.out))
        problems = verdict(result, args.min_accuracy, args.max_seconds)
        if result["curve"]:
            print(report(result))
        print(f"{config}: " + ("; ".join(problems) if problems else
                                f"meets the bar (accuracy >= {args.min_accuracy})"), flush=True)
        failed += bool(problems)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
