"""One rank of the memory benchmarks: train.py with DeepSpeed's engine phases marked.

    torchrun --nproc_per_node 2 tools/benchmarks/phase_peaks.py OUT_DIR --config X.yaml ...

Run by tools/benchmarks/memory_probe.py under torchrun, one process per rank. Each rank
runs train.py as its own program (runpy, its arguments after OUT_DIR) with the resident
set's high-water mark (VmHWM of /proc/self/status) read and reset (`echo 5 >
/proc/self/clear_refs`) at the boundaries of DeepSpeed's engine.forward / backward / step
and torch's AdamW step, so each phase has its own peak; writes OUT_DIR/rank<R>.json.
"""
from __future__ import annotations

import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "train.py")


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
    """train.py with argv, run as its own program in this process (runpy), DeepSpeed's
    engine phases marked; writes rank<R>.json."""
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
    sys.argv = [TRAIN] + list(argv)
    try:
        runpy.run_path(TRAIN, run_name="__main__")
        rc = 0
    except SystemExit as e:  # train.py ends with sys.exit(main())
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    rec.mark("end")
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"peaks": rec.peaks, "at_end": rec.at_end,
                   "offload": getattr(rec, "offload", None)}, f)
    return rc


if __name__ == "__main__":
    sys.exit(rank_entry(sys.argv[1], sys.argv[2:]))
