"""DeepSpeed's pipeline engine on ctxpar's grid: the topology, and a correct clipping norm.

DeepSpeed's pipeline engine takes its groups from a ``ProcessTopology`` with the named
axes 'pipe', 'data' and 'model' (deepspeed/runtime/pipe/topology.py): row-major, the
**last axis innermost**, the reverse of ctxpar's order string (first name innermost).
ctxpar's grid stays the one source of truth; the topology is derived from the order:

    order tp-cp-dp-pp  ->  axes ['pipe', 'data', 'model'], dims [pp, dp*cp, tp]
                           data coordinate = dp_rank * cp + cp_rank (dp outer, cp inner)

so every global rank has the same place in both, DeepSpeed's 'model' groups are ctxpar's
TP groups, its 'pipe' groups ctxpar's PP groups and its 'data' groups ctxpar's dp x cp
groups (what gradients must be reduced over). DeepSpeed has a single 'data' axis, so dp
and cp must be adjacent in the order (axes of size 1 in between do not count); any other
order raises ``ValueError`` (config validation reports it before any process starts).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from .parallel_state import parse_order

DS_AXIS = {"pp": "pipe", "tp": "model"}  # dp and cp become DeepSpeed's one 'data' axis


def pipeline_axes(order: str, sizes: Dict[str, int]) -> Tuple[List[str], List[int]]:
    """DeepSpeed topology axes and dims (outermost first) that reproduce ctxpar's grid.

    sizes: the degrees {'tp', 'cp', 'pp', 'dp'}. Pure; raises ValueError when dp and cp
    are separated by an axis of size > 1.
    """
    outer_first = list(reversed(parse_order(order)))
    kept = [n for n in outer_first if sizes[n] > 1]  # size-1 axes can sit anywhere
    if "dp" in kept and "cp" in kept and abs(kept.index("dp") - kept.index("cp")) != 1:
        raise ValueError(
            f"parallel.order={order!r} puts {kept[min(kept.index('dp'), kept.index('cp')) + 1]} "
            f"between dp and cp: DeepSpeed's pipeline reduces gradients over one 'data' axis "
            f"(dp x cp), so dp and cp must be adjacent, e.g. 'tp-cp-dp-pp'")
    # 'data' goes where the outer of dp and cp of size > 1 is; the other is folded into it
    anchor = next((n for n in kept if n in ("dp", "cp")), "dp")
    axes, dims = [], []
    for name in outer_first:
        if name in ("dp", "cp"):
            if name == anchor:
                axes.append("data")
                dims.append(sizes["dp"] * sizes["cp"])
            continue
        axes.append(DS_AXIS[name])
        dims.append(sizes[name])
    return axes, dims


def pipeline_topology(order: str, sizes: Dict[str, int]):
    """The deepspeed ProcessTopology equal to ctxpar's grid for this order (pure)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    axes, dims = pipeline_axes(order, sizes)
    return ProcessTopology(axes=axes, dims=dims)


@torch.no_grad()
def pipeline_grad_norm(parameters, grid, tp_rank: int) -> torch.Tensor:
    """The global L2 norm of the gradients of a pipelined model, every stage counted once.

    Each parameter counts on one rank: TP-split ones on every TP rank (their shards),
    replicated ones on TP rank 0, and the copy of a tied weight that DeepSpeed marks
    ``ds_pipe_replicated`` (the later stage's) not at all. The squares are summed over the
    grid's model-parallel group, pipe x model (every stage x every TP rank of this dp x cp
    coordinate). The gradients are already reduced, so every dp x cp rank agrees.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    parameters = list(parameters)
    sq = torch.zeros((), dtype=torch.float32, device=parameters[0].device)
    for p in parameters:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if tp_rank == 0 or is_model_parallel_parameter(p):
            sq += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(sq, group=grid.get_model_parallel_group())
    return sq.sqrt()


def use_pipeline_grad_clipping(engine) -> None:
    """Make a ZeRO-0 fp32 pipeline engine clip by the true global gradient norm.

    DeepSpeed 0.19.8's fp32 path (``engine.clip_fp32_gradients`` -> runtime/utils.py
    ``clip_grad_norm_``) counts a replicated parameter only where
    ``mpu.get_model_parallel_rank() == 0``; with a pipeline the mpu is the pipeline grid,
    whose model-parallel group spans every stage, so only stage 0's replicated parameters
    (norms) are counted and a tied embedding is counted twice. ZeRO-1 and the bf16/fp16
    optimizers use the TP rank and skip ``ds_pipe_replicated`` copies and need nothing.
    This replaces the engine's method (same place, same call) and records the norm for
    ``engine.get_global_grad_norm()``; for any other engine it does nothing.
    """
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        return  # not the fp32 ZeRO-0 path: DeepSpeed's own norm is right
    grid = engine.module.mpu()
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def clip_fp32_gradients():
        norm = pipeline_grad_norm(params, grid, grid.get_slice_parallel_rank())
        coef = torch.clamp(engine.gradient_clipping() / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
        engine._global_grad_norm = norm.item()

    engine.clip_fp32_gradients = clip_fp32_gradients
