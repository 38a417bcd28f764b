"""The planner's memory per rank against train.py's measured peak, layout by layout (CPU).

    python tools/bench_plan_memory.py                      # every layout: the docs table
    python tools/bench_plan_memory.py --only z3 --save /tmp/mem.json
    python tools/bench_plan_memory.py --load /tmp/mem.json # the table again, no runs

Each layout runs train.py (torchrun, 2 ranks as local processes, 2 steps, fp32, real
DeepSpeed) twice: with its model and with a negligible one (same layout and keys, d 16,
seq_len 64, vocab 64, 1 layer). glibc is told to return freed memory
(MALLOC_MMAP_THRESHOLD_=131072: every block above 128 KiB is its own mapping, unmapped
when freed), so the resident set follows the live tensors.

What is measured, per rank: the resident set's high-water mark (VmHWM of
/proc/self/status), read and reset (`echo 5 > /proc/self/clear_refs`) at the boundaries
of DeepSpeed's engine.forward / backward / step, so each phase has its own peak; the
rank's peak is the largest (equal to what resource.getrusage's ru_maxrss would say
without the resets, which is what train.py logs as peak_mem_bytes on CPU). The layout's
figure is max over ranks of (peak - the negligible run's peak on the same rank): the
interpreter, torch, DeepSpeed and gloo are in both and cancel.

What is predicted: ctxpar.plan.startup's numbers for that config on device 'cpu' (the
start line train.py prints), minus its prediction for the negligible run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
QUIET = ["train.eval_interval=0", "train.eval_samples=1", "logging.log_interval=1", "logging.wandb.mode=disabled",
         "train.steps=2", "checkpointing.save_interval=0"]
NEGLIGIBLE = ["model.d_model=16", "model.seq_len=128", "model.vocab_size=256",
              "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
              "model.ffn_hidden=32"]


# ------------------------------------------------------------------ one rank (under torchrun)


def _status_bytes(key: str) -> int:
    """VmHWM (the resident set's high-water mark) or VmRSS (now) of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PhasePeaks:
    """The resident set's peak per phase: mark(name) closes the segment since the last
    mark under `name` (keeping the largest of repeated phases) and starts a new one."""

    def __init__(self):
        self.peaks, self.at_end = {}, {}

    def mark(self, name: str) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), _status_bytes("VmHWM"))
        self.at_end[name] = _status_bytes("VmRSS")  # the resident set as the phase ends
        _reset_hwm()


def rank_entry(out_dir: str, argv) -> int:
    """train.main(argv) with DeepSpeed's engine phases marked; writes rank<R>.json."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    rec = PhasePeaks()
    rec.mark("import")
    import torch
    targets = [(DeepSpeedEngine, n, n) for n in ("forward", "backward", "step")]
    targets.append((torch.optim.AdamW, "step", "adam"))
    for cls, attr, name in targets:
        orig = getattr(cls, attr)

        def wrapped(self, *a, _orig=orig, _name=name, **k):
            rec.mark(f"before {_name}")
            out = _orig(self, *a, **k)
            rec.mark(_name)
            return out
        setattr(cls, attr, wrapped)
    import train
    rc = train.main(argv)
    rec.mark("end")
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"peaks": rec.peaks, "at_end": rec.at_end}, f)
    return rc


# ------------------------------------------------------------------ the driver


def run(sets, nproc: int, port: int = 29657):
    """Per rank: {phase: peak bytes} of one train.py run with these overrides."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(port), os.path.abspath(__file__), "--rank-entry", d,
               "--config", TINY, "--set", *QUIET, *sets, f"logging.run_dir={d}/run"]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   WANDB_MODE="disabled", MALLOC_MMAP_THRESHOLD_="131072",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(sets)}: train.py failed:\n{proc.stderr[-3000:]}")
        ranks = []
        for r in range(nproc):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        return ranks, proc.stdout


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-entry":
        sys.exit(rank_entry(sys.argv[2], sys.argv[3:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    ranks, out = run(a.set, a.nproc)
    print(out)
    print(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
