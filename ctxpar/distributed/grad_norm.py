"""The global gradient norm on every DeepSpeed engine, including the fp32 ZeRO-0 one.

``engine.get_global_grad_norm()`` is what train.py logs as ``grad_norm``, the number a
user watches for divergence. DeepSpeed 0.19.8 records it in its ZeRO 1-3 optimizers and
its bf16/fp16 wrappers, but the fp32 ZeRO-0 engine steps the bare torch optimizer: its
clipping (``engine.clip_fp32_gradients`` -> runtime/utils.py ``clip_grad_norm_``) computes
a norm and drops it, and without clipping nothing computes one, so ``None`` is returned.
Under a pipeline that path's norm is also wrong: it asks the grid's
``get_model_parallel_rank()``, the position in pipe x model, so it drops every later
stage's replicated parameters (norms) and counts the tied embedding twice.

``record_fp32_grad_norm`` fixes both for that one engine kind: it replaces the engine's
clipping method with one that computes the right norm, clips by it and records it, and
registers a step pre-hook on the torch optimizer that records the norm when no clipping
ran (``gradient_clipping: 0``; then the gradients the hook sees are the unclipped ones).
Every other engine is left alone: its own norm is right.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def global_grad_norm(parameters, model_parallel_group, tp_rank: int,
                     ep_group=None) -> torch.Tensor:
    """L2 norm of the reduced gradients of the whole model, every parameter counted once.

    TP-split parameters (``tensor_model_parallel``) count on every TP rank (their shards),
    replicated ones on TP rank 0 only, the tied copy DeepSpeed's pipeline marks
    ``ds_pipe_replicated`` (the later stage's) not at all. Squares are summed over
    ``model_parallel_group``: the TP group, or with a pipeline pipe x model (every stage and
    TP rank of this dp x cp coordinate). Gradients are already reduced over dp x cp, so
    every dp x cp rank gets the same number. Under expert parallelism (ep_group) each EP
    rank holds other experts: their squares are summed over the EP group first.
    """
    from deepspeed.runtime.utils import is_model_parallel_parameter

    parameters = list(parameters)
    sq, experts = (torch.zeros((), dtype=torch.float32, device=parameters[0].device)
                   for _ in range(2))
    for p in parameters:
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if tp_rank == 0 or is_model_parallel_parameter(p):
            own = experts if getattr(p, "expert_shard", (0, 1))[1] > 1 else sq
            own += p.grad.detach().float().pow(2).sum()
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(experts, group=ep_group)
    sq = sq + experts
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(sq, group=model_parallel_group)
    return sq.sqrt()


def record_fp32_grad_norm(engine, state) -> None:
    """Make an fp32 ZeRO-0 engine clip by, and report, the true global gradient norm.

    state: this rank's ParallelState (its TP and EP groups); a pipeline engine's norm is
    summed over the pipeline grid's pipe x model group instead. For any other engine (ZeRO >= 1,
    bf16, fp16) this does nothing.
    """
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        return
    from deepspeed.pipe import PipelineModule

    if isinstance(engine.module, PipelineModule):
        grid = engine.module.mpu()  # DeepSpeed's PipelineParallelGrid
        model_parallel_group, tp_rank = grid.get_model_parallel_group(), \
            grid.get_slice_parallel_rank()
    else:
        model_parallel_group, tp_rank = state.tp_group, state.tp_rank
    # a stage's EP group lies inside its dp x cp: the experts' squares summed over it first
    ep_group = state.ep_group if state.ep_size > 1 else None
    params = [p for p in engine.module.parameters() if p.requires_grad]
    clipped_this_step = [False]

    def norm() -> torch.Tensor:
        return global_grad_norm(params, model_parallel_group, tp_rank, ep_group)

    def clip_fp32_gradients():  # called by engine._take_model_step when clipping > 0
        total = norm()
        coef = torch.clamp(engine.gradient_clipping() / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
        engine._global_grad_norm = total.item()
        clipped_this_step[0] = True

    def record_unclipped(optimizer, args, kwargs):  # right before every optimizer.step()
        if not clipped_this_step[0]:
            engine._global_grad_norm = norm().item()
        clipped_this_step[0] = False

    engine.clip_fp32_gradients = clip_fp32_gradients
    engine.optimizer.register_step_pre_hook(record_unclipped)
