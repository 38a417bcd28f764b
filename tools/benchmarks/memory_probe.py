"""train.py's measured memory per rank against the planner's, for one layout (CPU).

    r = measure("z3", ["deepspeed.zero_stage=3"], nproc=2)   # both runs, both predictions
    describe(r)   # 'measured 12.3 MB (backward), predicted 12.1 MB (backward)'

Used by bench_plan_memory.py and bench_max_seq_len.py (their docstrings say what is
measured: each layout's run above a negligible model's, both under glibc's lowered mmap
threshold; the per-rank program is phase_peaks.py); no command of its own.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASE_PEAKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "phase_peaks.py")

TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
QUIET = ["train.eval_interval=0", "train.eval_samples=1", "logging.log_interval=1",
         "logging.wandb.mode=disabled",
         "train.steps=2", "checkpoint.save_interval=0"]
NEGLIGIBLE = ["model.d_model=16", "model.seq_len=128", "model.vocab_size=256",
              "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
              "model.ffn_hidden=32"]


def negligible(sets) -> list:
    """NEGLIGIBLE for a layout: a hybrid's one layer of its first type (its fields stay
    valid)."""
    types = [s.split("=", 1)[1] for s in sets if s.startswith("model.layer_types=")]
    first = types[-1].strip("[]").split(",")[0].strip() if types else ""
    return NEGLIGIBLE + ([f"model.layer_types=[{first}]"] if first else [])


def run(sets, nproc: int, port: int = 29657, config: str = TINY, mmap_threshold: int = 131072):
    """Per rank: {"peaks": {phase: bytes}, "at_end": ...} of one train.py run; glibc's
    mmap threshold: blocks above it are their own mappings, unmapped when freed (below
    it they come from the heap, whose freed holes stay resident)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(port), PHASE_PEAKS, d,
               "--config", config, "--set", *QUIET, *sets, f"logging.run_dir={d}/run"]
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   WANDB_MODE="disabled", MALLOC_MMAP_THRESHOLD_=str(mmap_threshold),
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
    pred, pred0 = predict(sets, nproc, config), predict(sets + negligible(sets), nproc, config)
    return dict(predicted=pred.same_ram() - pred0.same_ram(), predicted_phase=pred.peak_phase,
                phases={p.name: p.total for p in pred.phases}, device=pred.peak,
                host=pred.host_total)


def measure(name, sets, nproc, config: str = TINY, mmap_threshold: int = 131072):
    """(measured, predicted, predicted phase, measured phase): above the negligible run."""
    big = run(sets, nproc, config=config, mmap_threshold=mmap_threshold)
    base = run(sets + negligible(sets), nproc, config=config, mmap_threshold=mmap_threshold)
    rows = []
    def training(peaks):  # the steps: not the imports, nor the final eval and teardown
        return {k: v for k, v in peaks.items() if k not in ("import", "end")}
    for r in range(nproc):
        b = max(training(base[r]["peaks"]).values())
        phase, peak = max(training(big[r]["peaks"]).items(), key=lambda kv: kv[1])
        rows.append((peak - b, phase))
    measured, phase = max(rows)
    out = dict(name=name, measured=measured, mmap_threshold=mmap_threshold, measured_phase=phase, ranks=[r[0] for r in rows],
               **predicted(sets, nproc, config))
    counters = [r.get("offload") for r in big if r.get("offload")]
    if counters:  # the offloader's own count of host bytes and restored device bytes
        out["offload"] = max(counters, key=lambda c: c["peak_host_bytes"])
    return out


def describe(r: dict) -> str:
    """'measured 12.3 MB (phase), predicted 12.1 MB (phase)'."""
    return (f"measured {r['measured'] / 1e6:.1f} MB ({r['measured_phase']}), "
            f"predicted {r['predicted'] / 1e6:.1f} MB ({r['predicted_phase']})")
