"""`--max-seq-len`'s own choices, run: the planner's prediction against train.py's peak (CPU).

    python -m tools.benchmarks.bench_max_seq_len                       # every case: the docs table
    python -m tools.benchmarks.bench_max_seq_len --only d384 --save /tmp/longest.json
    python -m tools.benchmarks.bench_max_seq_len --load /tmp/longest.json

Each case asks the planner for the longest context of a model on 2 CPU ranks with a memory
budget (`python -m ctxpar.plan ... --gpu cpu --memory B --max-seq-len --write X.yaml`),
then runs the written config with train.py (2 ranks, 2 steps) and measures its peak as
tools/benchmarks/bench_plan_memory.py does (resident set per phase with glibc's mmap threshold
lowered, above a negligible model's run on the same layout), against the planner's
prediction for that config minus its prediction for the negligible run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile

from ctxpar.testing.results import measure_missing
from tools.benchmarks.memory_probe import TINY, describe, measure

BASE = ["train.global_batch_size=1", "train.micro_batch_size=1", "parallel.dp=1"]
D384 = ["model.d_model=384", "model.n_heads=6", "model.n_kv_heads=6", "model.n_layers=2",
        "model.vocab_size=8000"]  # the model of docs/memory.md's longest-context example
D256 = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=4",
        "model.vocab_size=16000"]
TILED = ["--options", "tiled_loss,tiled_mlp"]
# name: (the model's --set, the budget per rank in bytes, more planner arguments)
CASES = {
    "d384 L2 V8000, 0.15 GB, tiled": (D384, 1.5e8, TILED),
    "d384 L2 V8000, 0.3 GB, tiled": (D384, 3e8, TILED),
    "d384 L2 V8000, 0.3 GB, tiled, tp 1": (D384, 3e8, TILED + ["--tp", "1"]),
    "d384 L2 V8000, 0.3 GB, tiled, tp 2": (D384, 3e8, TILED + ["--tp", "2"]),
    "d256 L4 V16000 GQA, 0.2 GB, all options": (D256, 2e8, []),
    "d256 L4 V16000 GQA, 0.2 GB, no options": (D256, 2e8, ["--options", "none"]),
}


def plan(model_sets, budget: float, extra, path: str, nproc: int) -> str:
    """Run the planner in this process; it writes `path`; returns its last line."""
    from ctxpar.plan.__main__ import main as plan_main
    argv = ["--config", TINY, "--set", *BASE, *model_sets, "--nodes", "1", "--gpus-per-node",
            str(nproc), "--gpu", "cpu", "--memory", str(budget), "--max-seq-len",
            "--write", path, *extra]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan_main(argv)
    if rc:
        raise SystemExit(f"planner failed ({rc}): {' '.join(argv)}")
    return [ln for ln in out.getvalue().splitlines() if ln.startswith("longest seq_len")][-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="cases whose name contains this")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--save", help="write the measurements (JSON) here")
    p.add_argument("--load", help="a --save file: the table without running")
    a = p.parse_args()
    results = json.load(open(a.load)) if a.load else {}
    with tempfile.TemporaryDirectory() as d:
        def run(name, case):
            model_sets, budget, extra = case
            path = os.path.join(d, "longest.yaml")
            line = plan(model_sets, budget, extra, path, a.nproc)
            return {**measure(name, [], a.nproc, config=path), "budget": budget, "choice": line}

        measure_missing(CASES, results, run,
                        lambda name, r: f"{name}: {r['choice']}; {describe(r)}",
                        only=a.only, save=a.save)
    print("\n| case | planner's choice | measured | predicted | error | predicted peak phase |")
    print("|---|---|---:|---:|---:|---|")
    for name, r in results.items():
        if a.only in name:
            err = 100 * (r["predicted"] / r["measured"] - 1)
            choice = r["choice"].replace("longest seq_len: ", "")
            print(f"| {name} | {choice} | {r['measured'] / 1e6:,.0f} MB | "
                  f"{r['predicted'] / 1e6:,.0f} MB | {err:+.1f}% | {r['predicted_phase']} |")


if __name__ == "__main__":
    main()
