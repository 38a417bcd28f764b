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
from typing import Any, Dict, Optional, Sequence

import torch

from ..config.layers import layer_attention
from ..context_parallel.mask import visible_pairs

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


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int,
                    model=None) -> float:
    """Training FLOPs per token: 6N for the weights (fwd+bwd) + causal attention.

    Attention scores and the value product are 2 matmuls of 2 d FLOPs per visible (query,
    key) pair forward, times 3 for fwd+bwd: 12 d per pair, T (T + 1) / 2 pairs a causal
    layer, about 6 L d T per token. With `model` (a ModelConfig) each layer counts its
    own pairs (config.layers.layer_attention: a window's about T w, chunks' c (c + 1) / 2
    each; mask.visible_pairs), MLA's at its own widths; layers without attention (Gated
    DeltaNet, Mamba2, MLP-only blocks) have none.
    """
    if model is None:
        return 6.0 * n_params + 6.0 * n_layers * d_model * seq_len
    # per visible pair, fwd + bwd: 3 x 2 x (scores' width + values' width); MLA's are
    # H (dn + dr) and H dv (model.mla), attention's about d each
    mla = model.mla
    width = {"attention": 12.0 * d_model,
             "mla": 6.0 * model.n_heads * (mla.qk_head_dim + mla.v_head_dim) if mla else 0}
    return 6.0 * n_params + sum(
        width[a.token_mixer] * visible_pairs(0, seq_len, a.sliding_window, a.chunk_size)
        for a in layer_attention(model) if a.token_mixer in width) / seq_len


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; on CPU the process's max resident set (Linux: KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_baseline(device: torch.device) -> int:
    """What peak_memory_bytes counts before the model exists: on CUDA the allocated bytes
    (about 0), on CPU the current resident set (the interpreter, torch, DeepSpeed and the
    data: no tensor the planner counts). Take it just before the model is built."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:  # pages: size resident shared ...
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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


class StepMetrics:
    """What a log line says about a step: throughput, MFU and memory, every
    logging.log_interval steps and at the last.

    peak_mem_bytes is the raw peak (CUDA: the allocator's tensor peak; CPU: the process's
    resident set, interpreter and libraries included). peak_mem_model_bytes is that peak
    above memory_baseline(), taken before the model was built: the figure comparable to the
    start line's "GB per rank predicted", which counts tensors only.
    """

    def __init__(self, cfg, n_params: int, world_size: int, device: torch.device,
                 baseline: int):
        m = cfg.model
        self.steps, self.interval = cfg.train.steps, cfg.logging.log_interval
        self.tokens_per_step = cfg.train.global_batch_size * m.seq_len
        self.n_params, self.n_layers, self.d_model = n_params, m.n_layers, m.d_model
        self.flops_per_step = flops_per_token(n_params, m.n_layers, m.d_model,
                                              m.seq_len, m) * self.tokens_per_step
        self.world_size, self.device, self.baseline = world_size, device, baseline
        self.peak_tflops = device_peak_tflops(device)

    def should_log(self, step: int) -> bool:
        return step % self.interval == 0 or step == self.steps

    def record(self, step: int, loss: float, lr: float, grad_norm: Optional[float],
               dt: float, lengths: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        """One metrics.jsonl line for a step that took dt seconds; lengths: the step's
        documents' tokens when it trained on whole documents (data.dynamic_cp), whose
        throughput and FLOPs count those (each document's attention at its own length)."""
        tokens, flops = self.tokens_per_step, self.flops_per_step
        if lengths is not None:
            tokens = int(sum(lengths))
            flops = sum(flops_per_token(self.n_params, self.n_layers, self.d_model, n) * n
                        for n in lengths)
        tflops = flops / dt / self.world_size / 1e12
        peak = peak_memory_bytes(self.device)
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": step * self.tokens_per_step,
                "tokens_per_s": tokens / dt, "step_time_s": dt,
                "tflops_per_device": tflops,
                "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                "peak_mem_bytes": peak, "peak_mem_model_bytes": max(0, peak - self.baseline)}


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
