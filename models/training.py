"""Training the GPT on the rank grid: what train.py and verify.py both build.

    state = parallel_state(cfg)                                  # collective over the world
    model = build_model(cfg, state, gas, device)                 # GPT, or a pipeline stage
    engine, scheduler = initialize_engine(model, cfg, state, ds_config, device)

The kinds of optimizer step that run on the engine are in models/steps.py.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ctxpar.config import ulysses_degree
from ctxpar.distributed.grad_norm import record_fp32_grad_norm
from ctxpar.distributed.mpu import DeepSpeedMPU
from ctxpar.distributed.parallel_state import init_parallel_state
from ctxpar.distributed.zero import partition_for_zero3, zero_stage
from ctxpar.memory import optimizer as optimizer_offload


def parallel_state(cfg):
    """The config's rank grid and its process groups (collective over the world)."""
    p = cfg.parallel
    return init_parallel_state(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, order=p.order,
                               ulysses=ulysses_degree(p), ep=p.ep)


def build_model(cfg, state, gas: int, device):
    """This rank's model: the GPT, or with pp > 1 its pipeline stage (DeepSpeed's pipeline
    grid, derived from the same order string, is then the mpu:
    ctxpar/distributed/pipeline_parallel.py). The same init for every layout."""
    from . import gpt_pipe
    from .gpt import GPT

    if cfg.parallel.pp > 1:
        return gpt_pipe.GPTPipe.from_config(cfg, state, gas, device=device)
    return GPT.from_config(cfg, state, device=device)


def lr_lambda(cfg):
    """Linear warmup to train.lr, then cosine decay to train.min_lr at train.steps."""
    t = cfg.train

    def factor(step):
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return (t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))) / t.lr
    return factor


def param_groups(model, weight_decay, split_experts: bool = True,
                 expert_group: Optional[str] = None):
    """No weight decay on norms and biases (1-D tensors, and the experts' (E, n) stacks of
    biases, marked ``stacked_bias``), as in GPT-2/Megatron.

    With split_experts a mixture of experts' expert tensors form groups of their own after
    those two, the same groups at every ep, so an optimizer state resumes on another ep
    group by group; under ep > 1 they are DeepSpeed's MoE groups (``moe``, and ``name`` the
    EP group's name: ZeRO 1/2 partition them over their expert-data-parallel group). A
    pipeline at ep 1 keeps them in the first two: ZeRO computes its norm group by group
    over every stage, so every stage needs the same groups, and a stage without experts
    would have none (at ep > 1 config asks every stage to hold a MoE layer:
    ctxpar/config/moe.py). Empty groups are left out (DeepSpeed drops them, not the scheduler).
    Under ZeRO-3 a parameter is a flat partition: its true shape is ``ds_shape``.
    """
    def matrix(p):
        return len(getattr(p, "ds_shape", p.shape)) >= 2 and not getattr(p, "stacked_bias",
                                                                          False)

    def is_expert(p):
        return split_experts and getattr(p, "expert_shard", None) is not None

    groups = []
    for experts in (False, True):
        params = [p for p in model.parameters() if p.requires_grad and is_expert(p) == experts]
        prefix = "experts_" if experts else ""
        for decay in (True, False):
            group = {"name": prefix + ("decay" if decay else "no_decay"),
                     "params": [p for p in params if matrix(p) == decay],
                     "weight_decay": weight_decay if decay else 0.0}
            if experts and expert_group is not None:
                group.update(moe=True, name=expert_group)
            if group["params"]:
                groups.append(group)
    return groups


def initialize_engine(model, cfg, state, ds_config, device):
    """ZeRO-3's partitioning over dp x cp, expert parallelism's groups, AdamW and its
    schedule, and DeepSpeed's engine over them. Returns (engine, scheduler)."""
    import deepspeed

    from ctxpar.distributed.expert_parallel import prepare_expert_parallel

    pipelined = cfg.parallel.pp > 1
    expert_group = None
    if state.ep_size > 1:  # experts reduced over their EDP group (distributed/expert_parallel.py)
        expert_group = prepare_expert_parallel(model, state, cfg.model.moe.num_experts,
                                               zero_stage(ds_config))
    # ZeRO-3: over dp x cp (distributed/zero.py), the experts over their EDP group
    partition_for_zero3(model, state, ds_config)
    # a pipeline at ep 1 keeps the experts in the dense groups (param_groups)
    groups = param_groups(model, cfg.train.weight_decay, not pipelined or state.ep_size > 1,
                          expert_group)
    # AdamW; under ZeRO-Offload DeepSpeedCPUAdam on GPUs, torch's on CPU runs (the rule:
    # ctxpar/memory/optimizer.py)
    optimizer = optimizer_offload.build_optimizer(groups, cfg.train, ds_config, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config,
                                           mpu=None if pipelined else DeepSpeedMPU(state))
    record_fp32_grad_norm(engine, state)  # fp32 ZeRO-0 records none (distributed/grad_norm.py)
    return engine, scheduler
