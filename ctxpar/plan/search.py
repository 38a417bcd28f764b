"""Every valid layout of a config on a cluster, each modelled (memory, time) and ranked.

Enumerated: tp dividing the GPUs of a node and the heads; cp dividing the sequence into
whole layout chunks, with each pattern (ring and all-gather with zigzag, striped and
contiguous; Ulysses when the heads per TP rank divide by cp; hybrid for each Ulysses
degree u with 1 < u < cp); pp dividing the layers; dp the rest of the world, dividing the
global batch with a micro-batch size; ZeRO stage 0-3 (pipelines: 0-1, as DeepSpeed's
pipeline engine allows); every activation checkpointing mode; for a mixture of experts
each parallel.ep dividing dp x cp and the experts (ep_sizes). config.validate is the
judge of validity: a layout the trainer would refuse is never proposed.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..config import CHECKPOINT_MODES, Config, ConfigError, validate
from ..config.layer_mixers import LAYER_MIXERS, has_linear_layers, layer_types
from ..config.layers import layer_attention
from ..config.parameters import active_parameters
from ..context_parallel.linear import LINEAR_CP_STRATEGIES
from ..components.metrics import flops_per_token
from . import counts
from .candidate import Candidate, apply_candidate
from .cluster import Cluster, PlanError
from .memory import Memory, memory
from .timing import StepTime, step_time

MEMORY_MARGIN = 0.9  # plan to 90% of the device: allocator fragmentation, NCCL, CUDA context
HOST_MARGIN = 0.8    # of the host: the OS, the data loader, pinned-memory rounding


@dataclass
class Plan:
    candidate: Candidate
    memory: Memory
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_options(cfg: Config) -> dict:
    """The memory options a config sets, as Candidate fields."""
    z = cfg.deepspeed.get("zero_optimization") or {}
    return dict(tiled_loss=cfg.memory.tiled_loss, tiled_mlp=cfg.memory.tiled_mlp,
                linear_tile=cfg.memory.linear_tile_tokens if cfg.memory.tiled_linear else 0,
                offload_activations=cfg.memory.offload_activations,
                offload_optimizer=(z.get("offload_optimizer") or {}).get("device") == "cpu")


def is_bf16(cfg: Config) -> bool:
    return bool((cfg.deepspeed.get("bf16") or {}).get("enabled"))


COUNTED_MIXERS = (None, "attention", "gated_delta", "kda", "mamba2")  # token mixers it counts


def check_modelled(cfg: Config) -> None:
    """PlanError (one line) for a model the counts do not describe, rather than a
    prediction that counts it as something else. Every layer type of config.layers is
    counted (attention with its gate, Gated DeltaNet, KDA, Mamba2, Nemotron-H's single-op
    blocks), and a mixture of experts in every MLP or in some beside dense ones
    (moe_layers.py, model.moe.layers), multi-head latent attention without windows
    (mla_layers.py), DeepSeek-V4's attention (compressed_layers.py); a new mixer starts
    here."""
    unknown = sorted({t for t in layer_types(cfg.model)
                      if LAYER_MIXERS.get(t, ("?",))[0] not in COUNTED_MIXERS})
    if unknown:
        raise PlanError(f"model.layer_types has {unknown} layers: the planner does not count "
                        f"them (no memory or time prediction)")
    if cfg.model.mla is not None and any(a.sliding_window or a.chunk_size
                                         for a in layer_attention(cfg.model)):
        raise PlanError("model.mla with windowed or chunked layers: the planner counts the "
                        "latent ring's full steps only (no memory or time prediction)")


def linear_strategies(cfg: Config, cp: int):
    """parallel.linear_cp's choices worth weighing: both strategies for a model with
    linear layers over CP (validation drops the ones a layout refuses), else the config's."""
    if cp > 1 and has_linear_layers(cfg.model):
        return LINEAR_CP_STRATEGIES
    return (cfg.parallel.linear_cp,)


def evaluate(cfg: Config, cand: Candidate, cluster: Cluster, **eff) -> Plan:
    """Memory and time of one layout."""
    check_modelled(cfg)
    bf16 = is_bf16(cfg)
    micro = cfg.train.global_batch_size // (cand.micro_batch * cand.dp)
    mem = memory(cfg, cand, bf16, micro, cluster.gpu.kind)
    t = step_time(cfg, cand, cluster, bf16, **eff)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    tps = tokens / t.total / cand.world
    m = cfg.model
    # a mixture of experts: the parameters a token runs (k of E experts), as train.py's MFU
    params = active_parameters(m) if m.moe is not None else counts.total_params(m)
    mfu = flops_per_token(params, m.n_layers, m.d_model, m.seq_len, m) * tps / cluster.gpu.flops
    return Plan(cand, mem, t, tps, mfu, fits(mem, cluster))


def fits(mem: Memory, cluster: Cluster) -> bool:
    """Within the device's memory (less the margin) and, with offloads, the host's: every
    GPU of a node offloads to the same host."""
    host = mem.host_total * cluster.gpus_per_node
    return mem.peak <= MEMORY_MARGIN * cluster.gpu.memory and \
        host <= HOST_MARGIN * cluster.gpu.host_memory


def candidates(cfg: Config, cluster: Cluster, micro_batches=(1, 2, 4, 8)) -> List[Candidate]:
    world = cluster.world
    opts = config_options(cfg)  # the config's memory options, kept for every layout
    out = []
    for tp in divisors(cluster.gpus_per_node):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for (comm, u, token_layout), linear, ep in itertools.product(
                        _cp_patterns(cp), linear_strategies(cfg, cp), ep_sizes(cfg, dp * cp)):
                    for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                        for act in CHECKPOINT_MODES:
                            for mb in micro_batches:
                                cand = Candidate(tp, cp, pp, dp, comm, u, token_layout, zero,
                                                 act, 2 if act == "every_n_layers" else 1, mb,
                                                 linear_cp=linear, ep=ep, **opts)
                                if _valid(cfg, cand):
                                    out.append(cand)
    return out


def ep_sizes(cfg: Config, dp_cp: int) -> List[int]:
    """parallel.ep's choices for a mixture of experts: the divisors of dp x cp that divide
    the experts (fewer experts a rank, more of its rows through the all-to-all);
    validation drops the layouts it refuses (16-bit ZeRO 0, ZeRO 3 with tp > 1). 1 without
    experts."""
    moe = cfg.model.moe
    if moe is None:
        return [1]
    return [d for d in divisors(dp_cp) if moe.num_experts % d == 0]


def _cp_patterns(cp: int):
    if cp == 1:
        return [("ring", 1, "zigzag")]
    out = [(c, 1, token_layout) for c in ("ring", "allgather")
           for token_layout in ("zigzag", "striped", "contiguous")]
    out.append(("ulysses", cp, "zigzag"))
    out += [("hybrid", u, "zigzag") for u in divisors(cp) if 1 < u < cp]
    return out


def refusal(cfg: Config, cand: Candidate) -> Optional[str]:
    """The config validation's one line refusing this layout, or None: it is valid."""
    try:
        validate(apply_candidate(cfg, cand), world_size=cand.world, check_paths=False)
    except ConfigError as e:
        return str(e)
    return None


def _valid(cfg: Config, cand: Candidate) -> bool:
    return refusal(cfg, cand) is None


def rank(plan: Plan) -> tuple:
    """The search's order: the fitting plans first, fastest first; among layouts of the
    same speed within 0.1% (speeds binned by ratio, whatever their size), the one that
    leaves the most memory free (e.g. ZeRO-2 over ZeRO-1 at the same time), then the
    faster."""
    tps = plan.tokens_per_s_per_gpu
    speed = round(math.log(max(tps, 1e-9)) / math.log1p(1e-3))
    return (not plan.fits, -speed, plan.memory.peak, -tps)


def search(cfg: Config, cluster: Cluster, top: Optional[int] = None, **eff) -> List[Plan]:
    """Every candidate's plan, the fitting ones first, each group fastest first (evaluate
    refuses a model the counts do not describe)."""
    cands = candidates(cfg, cluster)
    if not cands:
        raise PlanError(f"no layout of {cluster.world} GPUs ({cluster.nodes} x "
                        f"{cluster.gpus_per_node}) is valid for this model (heads "
                        f"{cfg.model.n_heads}, layers {cfg.model.n_layers}, seq_len "
                        f"{cfg.model.seq_len}, global batch {cfg.train.global_batch_size})")
    plans = [evaluate(cfg, cand, cluster, **eff) for cand in cands]
    plans.sort(key=rank)
    return plans[:top] if top else plans


# A memory option's config key, as a user would set it.
OPTION_KEYS = {"tiled_loss": "memory.tiled_loss", "tiled_mlp": "memory.tiled_mlp",
               "tiled_linear": "memory.tiled_linear",
               "linear_tile": "memory.tiled_linear",  # config_options' Candidate field
               "offload_activations": "memory.offload_activations",
               "offload_optimizer": "zero_optimization.offload_optimizer"}


def option_applies(cfg: Config, option: str) -> bool:
    """Whether a memory option (an OPTION_KEYS name) can change this model's plan: the
    tiled linear blocks only where it has linear layers."""
    return option not in ("tiled_linear", "linear_tile") or has_linear_layers(cfg.model)


def nothing_fits(plans: List[Plan], cluster: Cluster, off: Sequence[str] = ()) -> str:
    """One line: the smallest shortfall and what would close it (the device's, or the
    host's when every layout that fits the device offloads more than the host holds);
    off: the memory options the config leaves off, named as remedies."""
    device_ok = [p for p in plans if p.memory.peak <= MEMORY_MARGIN * cluster.gpu.memory]
    if device_ok:
        best = min(device_ok, key=lambda p: p.memory.host_total)
        need = best.memory.host_total * cluster.gpus_per_node / HOST_MARGIN
        return (f"nothing fits the host's {cluster.gpu.host_memory / 1e9:,.0f} GB per node: the "
                f"layout that offloads least ({best.candidate.name()}) needs {need / 1e9:,.0f} GB "
                f"per node ({cluster.gpus_per_node} GPUs offloading); --host-memory, fewer "
                f"offloads or more GPUs")
    best = min(plans, key=lambda p: p.memory.peak)
    need = best.memory.peak / MEMORY_MARGIN
    short = need - cluster.gpu.memory
    return (f"nothing fits in {cluster.gpu.memory / 1e9:.0f} GB per GPU: the smallest "
            f"layout ({best.candidate.name()}) needs {need / 1e9:.1f} GB "
            f"({short / 1e9:.1f} GB short, {best.memory.peak_phase}); more GPUs "
            f"(--nodes {cluster.nodes * 2}), a larger GPU, "
            + (f"the memory options ({', '.join(OPTION_KEYS[k] for k in off)}), " if off
               else "")
            + "or a shorter model.seq_len (--max-seq-len finds the longest that fits)")
