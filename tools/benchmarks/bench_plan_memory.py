"""The planner's memory per rank against train.py's measured peak, layout by layout (CPU).

    python -m tools.benchmarks.bench_plan_memory                      # every layout: the docs table
    python -m tools.benchmarks.bench_plan_memory --only z3 --save /tmp/mem.json
    python -m tools.benchmarks.bench_plan_memory --load /tmp/mem.json # the table again, no runs

Each layout runs train.py (torchrun, 2 ranks as local processes, 2 steps, fp32, real
DeepSpeed) twice: with its model and with a negligible one (same layout and keys, d 16,
seq_len 64, vocab 64, 1 layer). glibc is told to return freed memory
(MALLOC_MMAP_THRESHOLD_=131072: every block above 128 KiB is its own mapping, unmapped
when freed), so the resident set follows the live tensors.

What is measured, per rank: the resident set's high-water mark (VmHWM of
/proc/self/status), read and reset (`echo 5 > /proc/self/clear_refs`) at the boundaries
of DeepSpeed's engine.forward / backward / step, so each phase has its own peak; the
rank's peak is the largest over the training steps (the imports before and the final
evaluation and teardown after are left out: the planner models a step; with them it is
what resource.getrusage's ru_maxrss says, train.py's peak_mem_bytes on CPU). The layout's
figure is max over ranks of (peak - the negligible run's peak on the same rank): the
interpreter, torch, DeepSpeed and gloo are in both and cancel.

Offloads: on CPU the "host" copies are in the same RAM, so the figure compared is the
prediction's device + host bytes at each phase (Memory.same_ram); the offloader's own
counters (host bytes, restored device bytes) are recorded beside it.

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

from ctxpar.testing.results import measure_missing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
QUIET = ["train.eval_interval=0", "train.eval_samples=1", "logging.log_interval=1",
         "logging.wandb.mode=disabled",
         "train.steps=2", "checkpoint.save_interval=0"]
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
    def offload_stats(engine):  # the activation offloader's counters, if the model has one
        off = getattr(engine.module, "offload", None)
        if off is not None:
            rec.offload = off.stats()
    orig_step = DeepSpeedEngine.step

    def step_and_count(self, *a, **k):
        out = orig_step(self, *a, **k)
        offload_stats(self)
        return out
    DeepSpeedEngine.step = step_and_count
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
        json.dump({"peaks": rec.peaks, "at_end": rec.at_end,
                   "offload": getattr(rec, "offload", None)}, f)
    return rc


# ------------------------------------------------------------------ the driver

# 2 ranks each; what dominates differs (activations, model state, logits), as do the ZeRO
# stage, the checkpointing mode and the memory options.
ACT = ["model.seq_len=8192", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
       "model.vocab_size=256", "parallel.tp=1", "parallel.cp=2", "parallel.dp=1",
       "train.micro_batch_size=1", "train.global_batch_size=1"]
STATE = ["model.seq_len=128", "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=8",
         "model.n_layers=4", "model.vocab_size=256", "train.micro_batch_size=1"]
LAYOUTS = {  # name: --set overrides
    "activations: cp2 ring, none, z1": ACT + ["model.n_layers=4"],
    "activations: cp2 ring, full, z1": ACT + ["model.n_layers=8",
                                              "activation_checkpointing.mode=full"],
    "activations: cp2 ring, selective, z1": ACT + ["model.n_layers=4",
                                                   "activation_checkpointing.mode=selective"],
    "model state: dp2 z0": STATE + ["parallel.cp=1", "parallel.dp=2",
                                    "train.global_batch_size=2",
                                    "deepspeed.zero_optimization.stage=0"],
    "model state: tp2 z1 selective": STATE + [
        "model.seq_len=1024", "parallel.tp=2", "parallel.cp=1", "parallel.dp=1",
        "train.global_batch_size=1", "activation_checkpointing.mode=selective"],
    "model state: dp2 z2, 1M-element bucket": STATE + [
        "parallel.cp=1", "parallel.dp=2", "train.global_batch_size=2",
        "deepspeed.zero_optimization.stage=2",
        "deepspeed.zero_optimization.reduce_bucket_size=1000000"],
    "model state: cp2 z3": STATE + ["parallel.cp=2", "parallel.dp=1",
                                    "train.global_batch_size=1",
                                    "deepspeed.zero_optimization.stage=3"],
    "logits: cp2, vocab 32000": ACT + ["model.n_layers=2", "model.vocab_size=32000"],
    "logits: cp2, vocab 32000, tiled loss": ACT + ["model.n_layers=2",
                                                   "model.vocab_size=32000",
                                                   "memory.tiled_loss=true"],
    "activations: cp2 ring, none, tiled MLP": ACT + ["model.n_layers=4",
                                                     "memory.tiled_mlp=true"],
    "activations: cp2 ring, full, activation offload": ACT + [
        "model.n_layers=8", "activation_checkpointing.mode=full",
        "memory.offload_activations=true"],
    "model state: dp2 z1, optimizer offload": STATE + [
        "parallel.cp=1", "parallel.dp=2", "train.global_batch_size=2",
        "deepspeed.zero_optimization.stage=1",
        "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
}


def run(sets, nproc: int, port: int = 29657, config: str = TINY):
    """Per rank: {"peaks": {phase: bytes}, "at_end": ...} of one train.py run."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(port), os.path.abspath(__file__), "--rank-entry", d,
               "--config", config, "--set", *QUIET, *sets, f"logging.run_dir={d}/run"]
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
        return ranks


def predict(sets, nproc: int, config: str = TINY):
    """The start line's memory per rank on this machine (device 'cpu') and its phase;
    with offloads host and device are this one RAM: Memory.same_ram adds the host's."""
    import torch
    from ctxpar.config import load_config
    from ctxpar.plan.cluster import Cluster
    from ctxpar.plan.search import evaluate
    from ctxpar.plan.startup import detect, config_candidate
    cfg = load_config(config, QUIET + sets, world_size=nproc, check_paths=False)
    gpu, _ = detect(torch.device("cpu"), nproc)
    return evaluate(cfg, config_candidate(cfg, nproc), Cluster(1, nproc, gpu)).memory


def predicted(sets, nproc: int, config: str = TINY) -> dict:
    """The prediction's fields of a result (recomputed by --load: the model may move)."""
    pred, pred0 = predict(sets, nproc, config), predict(sets + NEGLIGIBLE, nproc, config)
    return dict(predicted=pred.same_ram() - pred0.same_ram(), predicted_phase=pred.peak_phase,
                phases={p.name: p.total for p in pred.phases}, device=pred.peak,
                host=pred.host_total)


def measure(name, sets, nproc, config: str = TINY):
    """(measured, predicted, predicted phase, measured phase): above the negligible run."""
    big, base = run(sets, nproc, config=config), run(sets + NEGLIGIBLE, nproc, config=config)
    rows = []
    def training(peaks):  # the steps: not the imports, nor the final eval and teardown
        return {k: v for k, v in peaks.items() if k not in ("import", "end")}
    for r in range(nproc):
        b = max(training(base[r]["peaks"]).values())
        phase, peak = max(training(big[r]["peaks"]).items(), key=lambda kv: kv[1])
        rows.append((peak - b, phase))
    measured, phase = max(rows)
    out = dict(name=name, measured=measured, measured_phase=phase, ranks=[r[0] for r in rows],
               **predicted(sets, nproc, config))
    counters = [r.get("offload") for r in big if r.get("offload")]
    if counters:  # the offloader's own count of host bytes and restored device bytes
        out["offload"] = max(counters, key=lambda c: c["peak_host_bytes"])
    return out


def describe(r: dict) -> str:
    """'measured 12.3 MB (phase), predicted 12.1 MB (phase)'."""
    return (f"measured {r['measured'] / 1e6:.1f} MB ({r['measured_phase']}), "
            f"predicted {r['predicted'] / 1e6:.1f} MB ({r['predicted_phase']})")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-entry":
        sys.exit(rank_entry(sys.argv[2], sys.argv[3:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="layouts whose name contains this")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--save", help="write the measurements (JSON) here")
    p.add_argument("--load", help="a --save file: the table without running")
    a = p.parse_args()
    results = json.load(open(a.load)) if a.load else {}
    for name, r in results.items():  # the current model's predictions for old measurements
        if name in LAYOUTS:
            r.update(predicted(LAYOUTS[name], a.nproc))
    measure_missing(LAYOUTS, results, lambda name, sets: measure(name, sets, a.nproc),
                    lambda name, r: f"{name}: {describe(r)}", only=a.only, save=a.save)
    print("\n| layout | measured | predicted | error | predicted peak phase |")
    print("|---|---:|---:|---:|---|")
    for name, r in results.items():
        if a.only in name:
            err = 100 * (r["predicted"] / r["measured"] - 1)
            print(f"| {name} | {r['measured'] / 1e6:,.0f} MB | {r['predicted'] / 1e6:,.0f} MB | "
                  f"{err:+.1f}% | {r['predicted_phase']} |")


if __name__ == "__main__":
    main()
