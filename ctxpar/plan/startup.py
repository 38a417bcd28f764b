"""train.py's one look at its own layout: the planner's memory and time, and two warnings.

    plan: tp1 cp2 ring/zigzag pp1 dp2 z1 none mb8 on 1 x 4 cpu: 0.04 GB per rank (peak in
    the backward), predicted 26,000 tokens/s (cpu preset, ...)
    warning: the ring's chunk C = 4,096 tokens is below ... on the network: ...

Pure: the caller passes what it detected (the device's name and memory, the ranks per
node), so the tests can ask what an H100 cluster would be told.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import List, Optional, Tuple

from ..config import Config
from .candidate import Candidate
from .cluster import GPUS, GPU, Cluster
from .search import config_options, evaluate

# Device names (torch.cuda.get_device_name) -> preset: the first key found in the name.
NAME_KEYS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"))


def config_candidate(cfg: Config, world: Optional[int] = None) -> Candidate:
    """The candidate a config runs (its parallel, activation_checkpointing, ZeRO and memory
    keys); dp 'auto' is world // (tp cp pp), as init_parallel_state resolves it."""
    p = cfg.parallel
    dp = p.dp if isinstance(p.dp, int) else (world or 1) // (p.tp * p.cp * p.pp)
    z = (cfg.deepspeed.get("zero_optimization") or {}).get("stage", 0)
    u = p.ulysses or (p.cp if p.cp_comm == "ulysses" else 1)
    ckpt = cfg.activation_checkpointing
    return Candidate(p.tp, p.cp, p.pp, dp, p.cp_comm, u, p.layout, z, ckpt.mode,
                     ckpt.every_n_layers, cfg.train.micro_batch_size, p.ring_grad_dtype,
                     linear_cp=p.linear_cp, ep=p.ep, **config_options(cfg))


def preset_for(device_name: str) -> Optional[GPU]:
    """The preset of a CUDA device's name, or None when the planner has none for it."""
    for key, preset in NAME_KEYS:
        if key in device_name:
            return GPUS[preset]
    return None


def detect(device, local_ranks: int, cpu: Optional[GPU] = None) -> Tuple[Optional[GPU], str]:
    """(the GPU this rank runs on, with its real memory, or None; how it was found). On CPU,
    `cpu` (default the 'cpu' preset) shared by the machine's ranks."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gpu = preset_for(name)
        if gpu is None:
            return None, name
        memory = torch.cuda.get_device_properties(device).total_memory
        return replace(gpu, memory=float(memory)), f"{name}: the {gpu.name} preset"
    # CPU: the calibrated per-core rate, shared by the ranks of this machine; its memory
    # shared likewise.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = cpu or GPUS["cpu"]
    share = min(1.0, cores / local_ranks)
    return replace(cpu, flops=cpu.flops * share, overhead=cpu.overhead / share,
                   block_overhead=cpu.block_overhead / share,
                   linear_overhead=cpu.linear_overhead / share,
                   memory=ram / local_ranks), \
        f"cpu preset, {cores} cores for {local_ranks} ranks"


def local_ranks(world: int, device) -> int:
    """Ranks per node: the launcher's (torchrun, deepspeed, Slurm), else one node's worth."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(key, "")
        if v.isdigit() and int(v) > 0:
            return min(int(v), world)
    if device.type == "cuda":
        import torch
        return max(1, min(world, torch.cuda.device_count()))
    return world


def startup_report(cfg: Config, gpu: Optional[GPU], how: str, nodes: int,
                   per_node: int) -> Tuple[str, List[str]]:
    """(one line: this layout's predicted memory per rank and tokens/s; warnings)."""
    cand = config_candidate(cfg, nodes * per_node)
    known = gpu is not None
    cluster = Cluster(nodes, per_node, gpu if known else GPUS["h100"])
    plan = evaluate(cfg, cand, cluster)
    mem = plan.memory
    line = (f"plan: {cand.name()} on {nodes} x {per_node} ranks: {mem.peak / 1e9:.2f} GB "
            f"per rank predicted (tensors, as metrics.jsonl's peak_mem_model_bytes; peak "
            f"in the {mem.peak_phase})")
    if known:
        line += (f", {plan.tokens_per_s_per_gpu * cand.world:,.0f} tokens/s "
                 f"({plan.tokens_per_s_per_gpu:,.0f} per rank, MFU "
                 f"{100 * plan.mfu:.1f}%; {how}; bottleneck {plan.time.bottleneck()})")
    else:
        line += f"; no time prediction for {how} (presets: {', '.join(GPUS)})"
    warnings = []
    t = plan.time
    if known and t.ring_chunk and t.ring_chunk < t.thresholds["fwd"]:
        warnings.append(
            f"the ring's chunk C = {t.ring_chunk:,} tokens per step is below the "
            f"{t.thresholds['fwd']:,.0f} (forward) / {t.thresholds['bwd']:,.0f} (backward) "
            f"at which its K,V transfer hides on {t.cp_link} ({how}): "
            f"{t.cp_exposed:.3f} s of {t.total:.3f} s per step predicted exposed; fewer "
            f"ring ranks, Ulysses or hybrid hide more (python -m ctxpar.plan)")
    if known and mem.peak > gpu.memory:
        warnings.append(
            f"predicted memory {mem.peak / 1e9:.1f} GB per rank exceeds the device's "
            f"{gpu.memory / 1e9:.1f} GB ({how}); python -m ctxpar.plan --config ... "
            f"lists layouts that fit")
    return line, warnings


def print_prediction(cfg: Config, world: int, device) -> None:
    """Rank 0 of train.py: the line on stdout, each warning on stderr."""
    from ..components.cli import warn

    per_node = local_ranks(world, device)
    gpu, how = detect(device, per_node)
    try:
        line, warnings = startup_report(cfg, gpu, how, max(1, world // per_node), per_node)
    except Exception as e:  # a forecast must never stop a run; say why there is none
        warn(f"plan: no prediction for this layout ({type(e).__name__}: {e})")
        return
    print(line, flush=True)
    for w in warnings:
        warn(w)
