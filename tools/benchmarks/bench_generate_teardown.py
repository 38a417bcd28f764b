"""Stress CP generation's teardown: `torchrun --nproc_per_node 2 generate.py` again and again,
several at once on a loaded machine, and count the runs that do not exit 0.

    python -m tools.benchmarks.bench_generate_teardown --run-dir runs/tiny_cpu --runs 50 \
        --parallel 3 --busy 1

Each run answers one prompt at cp 2 (the ring's prefill, the LSE-merged decode) and leaves
through generate.py's teardown. --parallel runs go at a time and --busy spinning processes
load the cores besides, the conditions under which a rank once died after printing a
correct answer ("terminate called without an active exception", SIGABRT: docs/
parallelism.md, "Leaving cleanly"). Prints one line per failed run (its exit code and
the stderr line that says why) and a summary; exits 1 if any run failed. Results:
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ctxpar.distributed.parallel_state import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The ring holds every block of the sequence and the pass key is"


def one_run(args) -> subprocess.CompletedProcess:
    """torchrun generate.py once (cp 2, greedy)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(ROOT, "generate.py"),
           "--run-dir", args.run_dir, "--prompt", PROMPT,
           "--max-new-tokens", str(args.max_new_tokens), *args.generate_args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout)


def why(proc: subprocess.CompletedProcess) -> str:
    """The stderr line that says why a run failed (ctxpar's, or the abort's)."""
    lines = proc.stderr.splitlines()
    for key in ("terminate called", "error:", "Error", "exitcode"):
        hit = [ln for ln in lines if key in ln]
        if hit:
            return hit[0].strip()
    return lines[-1].strip() if lines else "(no stderr)"


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def stress(args) -> int:
    """The number of runs that did not exit 0 (each printed)."""
    busy = [mp.Process(target=_spin, args=(args.timeout * args.runs,), daemon=True)
            for _ in range(args.busy)]
    for p in busy:
        p.start()
    failed, start = 0, time.perf_counter()
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for i, proc in enumerate(pool.map(lambda _: one_run(args), range(args.runs)), 1):
                if proc.returncode != 0:
                    failed += 1
                    print(f"run {i}: exit {proc.returncode}: {why(proc)}", flush=True)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    print(f"{args.runs} runs of torchrun --nproc_per_node 2 generate.py ({args.parallel} at "
          f"a time, {args.busy} busy processes): {args.runs - failed} exited 0, {failed} did "
          f"not; {time.perf_counter() - start:.0f} s", flush=True)
    return failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="a train.py run directory")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--parallel", type=int, default=3, help="runs at a time")
    p.add_argument("--busy", type=int, default=1, help="spinning processes besides")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("generate_args", nargs="*", help="more generate.py flags (after --)")
    args = p.parse_args(argv)
    return 1 if stress(args) else 0


if __name__ == "__main__":
    sys.exit(main())
