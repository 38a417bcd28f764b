"""Training metrics: metrics.jsonl, a tqdm bar, wandb, FLOPs/MFU and peak memory.

Only rank 0 writes; every other rank gets a logger that does nothing, so train.py calls it
unconditionally. wandb is optional at import and never blocks: offline by default, a
one-line error if it is missing or if online mode has no API key.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any, Dict, Optional

import torch

# Dense bf16 tensor-core peaks (TFLOP/s) for MFU; unknown devices (CPUs) report no MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def device_peak_tflops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_TFLOPS.items():
        if key in name:
            return peak
    return None


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights (fwd+bwd) + causal attention.

    Attention scores and the value product are 2 matmuls of 2·T·d FLOPs per token per
    layer forward, halved by the causal mask, times 3 for fwd+bwd: 6·L·d·T.
    """
    return 6.0 * n_params + 6.0 * n_layers * d_model * seq_len


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; on CPU the process's max resident set (Linux: KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class WandbError(RuntimeError):
    """wandb cannot be used as configured (missing package, no key for online mode)."""


def init_wandb(cfg_logging, run_dir: str, config: Dict[str, Any]):
    """Start a wandb run (rank 0 only) or return None for mode 'disabled'."""
    mode = cfg_logging.wandb.mode
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        raise WandbError("logging.wandb.mode={!r} but wandb is not installed: "
                         "pip install wandb, or set logging.wandb.mode=disabled".format(mode))
    if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _has_netrc_key()):
        raise WandbError("logging.wandb.mode='online' but no wandb API key is configured: "
                         "run `wandb login`, set WANDB_API_KEY, or use mode=offline")
    os.makedirs(run_dir, exist_ok=True)
    return wandb.init(project=cfg_logging.wandb.project,
                      name=cfg_logging.wandb.name or os.path.basename(os.path.abspath(run_dir)),
                      dir=run_dir, mode=mode, config=config)  # one run per process


def _has_netrc_key() -> bool:
    path = os.path.expanduser("~/.netrc")
    return os.path.isfile(path) and "api.wandb.ai" in open(path).read()


class MetricsLogger:
    """Rank 0: one JSON line per log step to <run_dir>/metrics.jsonl, a tqdm bar, wandb."""

    def __init__(self, run_dir: str, total_steps: int, start_step: int = 0,
                 enabled: bool = True, wandb_run=None):
        self.enabled = enabled
        self.wandb = wandb_run
        self.bar = None
        self.file = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        from tqdm import tqdm
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        file=sys.stdout, mininterval=1.0)

    def log(self, metrics: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        metrics = {k: v for k, v in metrics.items() if v is not None}
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"},
                           step=metrics["step"])

    def advance(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(step - self.bar.n)

    def write(self, line: str) -> None:
        """A line above the progress bar (rank 0 only: other ranks have no bar)."""
        if self.bar is not None:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class StepTimer:
    """Wall time of a step; on CUDA synchronises first so the figure is real."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        dt, self.t0 = t - self.t0, t
        return dt
