"""The kinds of optimizer step, decided once per run: train.py's loop runs any of them alike.

    steps = training_steps(cfg, engine, state, data, ds_config, device, dynamic)
    out = steps.run(steps.next_step())   # StepOutput: the loss and what the metrics add
    steps.stream.state_dict()            # the data position a checkpoint saves

    MicroBatchSteps  gas micro-batches of the DP/CP sample stream, forward and backward each
                     through DeepSpeed's engine, then the update
    PipelineSteps    the same micro-batches through DeepSpeed's pipeline engine (pp > 1:
                     models/gpt_pipe.py)
    DynamicSteps     data.dynamic_cp: whole documents, each pack on its own rank group
                     (models/dynamic_cp.py, ctxpar/dynamic_cp/)
    MoESteps         model.moe: MicroBatchSteps plus the routers' auxiliary losses
                     (models/moe_steps.py; MoEPipelineSteps the same through the pipeline)

The first three and what every kind offers (TrainSteps, StepOutput) are in
models/step_kinds.py, the MoE kinds on top of them; this file only decides.

Every kind returns the global token-mean loss (models/loss.py) on every rank. A new kind
(another schedule) is a class beside them with the same two methods, its metrics in
StepOutput.extras, and a line here: the loop does not change.
"""
from __future__ import annotations

from ctxpar.config import ulysses_degree
from ctxpar.distributed.zero import grad_divisor
from ctxpar.dynamic_cp.groups import build_dynamic_cp_groups

from .moe_steps import MoEPipelineSteps, MoESteps
from .step_kinds import DynamicSteps, MicroBatchSteps, PipelineSteps, TrainSteps


def training_steps(cfg, engine, state, data, ds_config, device, dynamic=None) -> TrainSteps:
    """The run's kind of step. dynamic: data.dynamic_cp's DynamicStream (made before any
    collective, so a document no rank group holds exits 2 first); its rank groups are made
    here, collectively, once."""
    pipelined = cfg.parallel.pp > 1
    gas = ds_config["gradient_accumulation_steps"]
    divisor = grad_divisor(state, ds_config, pipelined)
    if dynamic is not None:
        hybrid = ulysses_degree(cfg.parallel) if cfg.parallel.cp_comm == "hybrid" else None
        groups = build_dynamic_cp_groups(state, dynamic.sizes, ulysses=hybrid)
        zero_stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        return DynamicSteps(engine, dynamic, groups, state, cfg.parallel.layout, gas, divisor,
                            device, rounds=zero_stage >= 2 or cfg.parallel.ep > 1)
    kind = PipelineSteps if pipelined else MicroBatchSteps
    if cfg.model.moe is not None:  # the routers' losses beside the token loss
        kind = MoEPipelineSteps if pipelined else MoESteps
    return kind(engine, data.train_stream(state), state, gas, divisor, device)
