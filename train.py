"""ctxpar's training entrypoint: long-context GPT pretraining with TP x CP x PP x DP.

    deepspeed --num_gpus 8 train.py --config configs/gpt1b_32k_3d.yaml
    torchrun --nproc_per_node 4 train.py --config configs/tiny_cpu.yaml --set train.steps=20
    srun python train.py --config configs/gpt7b_128k_3d.yaml      (rank/world from SLURM_*)

Top to bottom: config -> distributed -> ParallelState -> GPT -> deepspeed.initialize -> loop.
The kind of step (micro-batches, the pipeline, dynamic CP's documents) is decided once
(models/steps.py); the loop runs it and asks each component whether its moment has come: the Evaluator
(ctxpar/components/evaluation.py), the Checkpointer (components/checkpointer.py),
StepMetrics (components/metrics.py) and the PreemptionGuard (ctxpar/checkpoint).
Bad input (config, layout vs world size, data paths) exits with code 2 and one line on
every rank, before any collective, so no rank is left waiting.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ctxpar import checkpoint as ckpt
from ctxpar.checkpoint.names import pipeline_ties_embedding
from ctxpar.components.checkpointer import Checkpointer
from ctxpar.components.cli import add_launcher_args, fail, show_ctxpar_logs, warn
from ctxpar.components.evaluation import Evaluator, eval_shortfall
from ctxpar.components.known_warnings import filter_known_warnings
from ctxpar.components.long_context import LongContextEval
from ctxpar.components.metrics import (MetricsLogger, StepMetrics, StepTimer, WandbError,
                                       init_wandb, memory_baseline)
from ctxpar.config import ConfigError, deepspeed_config, dump_config, load_config, to_dict
from ctxpar.config.parameters import active_parameters
from ctxpar.config.run_dir import check_run_dir
from ctxpar.data import DataError, build_data, load_tokenizer
from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
from ctxpar.distributed.parallel_state import (default_backend, init_distributed, launcher_env,
                                               local_device, shutdown_distributed)
from ctxpar.memory import optimizer as optimizer_offload
from ctxpar.plan.startup import print_prediction
from models.gpt import GPT
from models.gpt_pipe import pipeline_logits
from models.options import ModelGroups
from models.steps import training_steps
from models.training import build_model, initialize_engine, parallel_state

EXIT_NON_FINITE = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides, e.g. --set parallel.cp=4 train.steps=10")
    p.add_argument("--resume", default="auto",
                   help="'auto' (latest complete checkpoint in save_dir, if any), 'none', "
                        "or a checkpoint tag such as step_00000100")
    add_launcher_args(p)
    return p.parse_args(argv)


def finite(loss: float, grad_norm) -> bool:
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def offload_metrics(model) -> dict:
    """memory.offload_activations: the most activation bytes this rank held on the host at
    once so far (ctxpar/memory/offload.py's counters), for metrics.jsonl and wandb."""
    off = getattr(model, "offload", None)
    return {} if off is None else {"offload_host_bytes": off.stats()["peak_host_bytes"]}


@dataclass
class RunInputs:
    """What check_inputs found: the same on every rank, before any collective."""
    cfg: Any
    data: Any                 # build_data's: the token files or the passkey task
    save_dir: str
    resume_from: Any          # the checkpoint to resume (ckpt.ResumePoint) or None
    init: Any                 # model.init_from's weights (when not resuming) or None
    long_context: Any         # train.py's long-context evaluation tasks or None
    dynamic: Any              # data.dynamic_cp's DynamicStream or None


def check_inputs(args, world: int) -> RunInputs:
    """Config, run dir, data paths and the checkpoint to resume or start from: pure checks,
    the same verdict on every rank, so bad input exits 2 with one line before any collective."""
    try:
        cfg = load_config(args.config, args.set, world_size=world)
        check_run_dir(cfg)  # a path through a file, a read-only place: nothing created
        data = build_data(cfg)  # opens token files / builds the passkey task; no collectives
        long_context = LongContextEval(cfg, load_tokenizer(cfg.data.tokenizer)) \
            if cfg.long_context_eval.tasks else None  # every prompt made now
    except (ConfigError, DataError) as e:
        fail(str(e))
    for line in data.warnings:  # e.g. a token file too old to say which tokenizer made it
        warn(line)
    short = eval_shortfall(cfg, data)  # train.eval_samples past the held-out windows
    if short:
        warn(short)
    if (cfg.data.document_mask and cfg.parallel.cp > 1 and cfg.parallel.layout != "striped"
            and cfg.parallel.cp_comm != "ulysses"):  # Ulysses: every rank the whole sequence
        warn(f"data.document_mask with parallel.layout={cfg.parallel.layout!r}: ranks' "
             f"attention work is unbalanced with documents (docs/benchmarks.md: documents); "
             f"layout 'striped' keeps it balanced")
    save_dir = cfg.checkpoint.save_dir or os.path.join(cfg.logging.run_dir, "checkpoints")
    problem = ckpt.resume_problem(save_dir, args.resume)  # a missing tag: before DeepSpeed
    if problem:
        fail(problem)
    try:  # is the checkpoint sound (its manifest), and on this layout? file reads only
        resume_from = ckpt.resume_point(save_dir, args.resume, cfg, world, on_skip=warn)
        if cfg.model.family is not None:  # the export's family must hold the model, and
            ckpt.check_exportable(cfg.model)  # its config.json read back as this model
        init = ckpt.check_init_from(cfg) if cfg.model.init_from and resume_from is None else None
    except ckpt.CheckpointError as e:
        fail(str(e))
    dynamic = dynamic_stream(cfg, data, world) if cfg.data.dynamic_cp else None
    return RunInputs(cfg, data, save_dir, resume_from, init, long_context, dynamic)


def dynamic_stream(cfg, data, world: int):
    """data.dynamic_cp's stream over the dp x cp ranks, its cost model the planner's for
    this machine; file reads only: a document no rank group holds exits 2 here."""
    from ctxpar.dynamic_cp.stream import DynamicStream
    from ctxpar.plan.cluster import GPUS, Cluster
    from ctxpar.plan.sequence_cost import SequenceCost
    from ctxpar.plan.startup import detect, local_ranks

    device = local_device()
    per_node = local_ranks(world, device)
    gpu, _ = detect(device, per_node)
    cost = SequenceCost(cfg, Cluster(max(1, world // per_node), per_node, gpu or GPUS["h100"]))
    try:
        stream = DynamicStream(cfg, data.train_source, world // cfg.parallel.tp, cost)
        stream.check_lengths()
    except DataError as e:
        fail(str(e))
    return stream


def start_distributed(cfg, world: int):
    """The process group, the rank grid and DeepSpeed's comm; rank 0 prints the planner's
    prediction for this layout. Returns (device, state, rank0)."""
    device = local_device()
    init_distributed(default_backend(device))
    state = parallel_state(cfg)
    init_deepspeed_comm()  # without DeepSpeed's CPU shm op (distributed/deepspeed_comm.py)
    rank0 = dist.get_rank() == 0
    show_ctxpar_logs(rank0)  # e.g. the attention kernel 'auto' chose, and why
    if rank0:  # the planner's prediction for this layout, before anything is allocated
        print_prediction(cfg, world, device)
    return device, state, rank0


def open_logger(cfg, rank0: bool, start_step: int, lines=()) -> MetricsLogger:
    """Rank 0 records the run: config.yaml, wandb (a warning, not a stop, when it cannot
    start) and metrics.jsonl with the progress bar, the lines above it first; other ranks
    get a silent logger."""
    run_dir, wandb_run = cfg.logging.run_dir, None
    if rank0:
        dump_config(cfg, run_dir)
        try:
            wandb_run = init_wandb(cfg.logging, run_dir, to_dict(cfg))
        except WandbError as e:
            print(f"warning: {e}; continuing without wandb", file=sys.stderr, flush=True)
    logger = MetricsLogger(run_dir, cfg.train.steps, start_step, enabled=rank0,
                           wandb_run=wandb_run)
    for line in lines:  # where the weights came from, what a resume changed
        logger.write(line)
    return logger


@dataclass
class Training:
    """What a step needs and what records it, built once on every rank (collective)."""
    engine: Any
    scheduler: Any
    steps: Any                # models/steps.py: the run's kind of step
    whole_model: Any          # every layer at this TP on the meta device (names, resharding)
    n_params: float  # active per token (models with experts: parameters.active_parameters)
    baseline: int             # memory_baseline(): what the prediction leaves out


def build_training(run: RunInputs, state, device, rank0: bool):
    """The model (the same init for every layout, model.init_from's weights on it),
    DeepSpeed's engine and the run's kind of step. Returns (Training, init line or None)."""
    cfg, pipelined = run.cfg, run.cfg.parallel.pp > 1
    ds_config = deepspeed_config(cfg, state.dp_size)
    memory_line = optimizer_offload.describe(cfg, ds_config, device)  # the options that are on
    if rank0 and memory_line:
        print(memory_line, flush=True)
    baseline = memory_baseline(device)  # before the model: what the prediction leaves out
    model = build_model(cfg, state, ds_config["gradient_accumulation_steps"], device)
    init_line = None  # model.init_from: a Hugging Face folder's or a ctxpar checkpoint's
    if run.init is not None:
        init_line = ckpt.load_initial_weights(model, cfg, state, run.init)
    # DeepSpeed writes this into every checkpoint: how TP slices join into full tensors
    # (ds_to_universal), so the checkpoint can be resumed on another layout.
    whole = GPT(cfg.model, ModelGroups(tp_group=state.tp_group, cp_group=state.cp_group),
                device=torch.device("meta"))
    model.universal_checkpoint_info = ckpt.universal_checkpoint_info(
        whole, cfg.model.n_layers, pipeline_ties_embedding(cfg.model), pipelined)
    if run.resume_from is not None:
        run.resume_from.configure(ds_config)  # a layout change loads DeepSpeed's universal format
    n_params = active_parameters(cfg.model)  # the whole model's (a MoE's routed experts: k / E)
    engine, scheduler = initialize_engine(model, cfg, state, ds_config, device)
    steps = training_steps(cfg, engine, state, run.data, ds_config, device, run.dynamic)
    return Training(engine, scheduler, steps, whole, n_params, baseline), init_line


def resume(training: Training, run: RunInputs, state, logger_lines: list) -> int:
    """Load run.resume_from into the engine (resharded if the layout changed) and the data
    stream's position; the step to start from (0 for a new run)."""
    if run.resume_from is None:
        return 0
    client = ckpt.restore(training.engine, run.resume_from, run.cfg, state, training.whole_model)
    training.steps.stream.load_state_dict(client["data"])
    path = os.path.join(run.save_dir, run.resume_from.tag)
    logger_lines.append(f"resumed from {path} at step {client['step']}")
    if run.resume_from.universal:
        logger_lines.append(run.resume_from.describe_changes())
    return client["step"]


def nothing_to_train(run: RunInputs, start_step: int, rank0: bool) -> int:
    """The checkpoint found is at train.steps already (e.g. `make train` run twice)."""
    if rank0:
        print(f"nothing to train: {os.path.join(run.save_dir, run.resume_from.tag)} is at step "
              f"{start_step} of train.steps={run.cfg.train.steps} (--resume none or another "
              f"logging.run_dir starts over)", flush=True)
    shutdown_distributed()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    filter_known_warnings()  # DeepSpeed's deprecated torch calls, not the user's business
    launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK from torchrun/deepspeed or srun
    world = int(os.environ["WORLD_SIZE"])
    run = check_inputs(args, world)                       # 1. bad input exits 2, every rank
    cfg = run.cfg
    device, state, rank0 = start_distributed(cfg, world)  # 2. the grid
    torch.manual_seed(cfg.train.seed)
    t, init_line = build_training(run, state, device, rank0)  # 3. model, engine, kind of step
    engine, steps = t.engine, t.steps

    # 4. Resume, record the run, and the components that decide when to evaluate and save.
    lines = [init_line] if init_line else []
    start_step = resume(t, run, state, lines)
    if start_step >= cfg.train.steps:
        return nothing_to_train(run, start_step, rank0)
    logger = open_logger(cfg, rank0, start_step, lines)
    metrics = StepMetrics(cfg, t.n_params, state.world_size, device, t.baseline)
    forward = (partial(pipeline_logits, engine.module, state, head_inputs=True)
               if cfg.parallel.pp > 1 else None)
    evaluator = Evaluator(cfg, run.data, state, device, forward, run.long_context)
    checkpointer = Checkpointer(engine, run.save_dir, cfg.checkpoint.save_interval,
                                ckpt.checkpoint_meta(cfg, state.dp_size), steps.stream)
    if evaluator.should_evaluate(start_step, start=True):  # train.eval_at_start
        evaluator.run(engine.module, start_step, logger)

    # 5. The loop: one optimizer step of the run's kind, then who records, evaluates, saves.
    timer = StepTimer(device)
    guard = ckpt.PreemptionGuard(device)  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    step, loss, stopped = start_step, float("nan"), False
    while step < cfg.train.steps and not stopped:
        out = steps.run(steps.next_step())
        step, loss = step + 1, out.loss
        last = step == cfg.train.steps
        grad_norm = engine.get_global_grad_norm()  # before clipping; None: not recorded
        grad_norm = float(grad_norm) if grad_norm is not None else None
        if not finite(loss, grad_norm):
            return stop_non_finite(logger, step, loss, grad_norm, checkpointer)
        row = metrics.record(step, loss, t.scheduler.get_last_lr()[0], grad_norm,
                             timer.lap(), out.lengths)
        row.update(out.extras)
        if metrics.should_log(step):
            logger.log({**row, **offload_metrics(engine.module)})
        logger.advance(step, loss, row["tokens_per_s"])
        if evaluator.should_evaluate(step):
            evaluator.run(engine.module, step, logger)
        stopped = guard.should_stop() and not last  # collective: all ranks stop alike
        saved = checkpointer.save(step, last_step=last, force=stopped)
        timer.lap()  # evaluation and saving are not step time
    if stopped:
        logger.write(f"step {step}: {guard.reason}: stopping with a complete checkpoint "
                     f"{saved}; --resume auto continues from it")
    return finish(cfg, guard, logger, evaluator, step, loss, stopped, rank0)


def stop_non_finite(logger, step: int, loss: float, grad_norm, checkpointer) -> int:
    """A NaN or inf loss or grad norm: stop at once, save nothing (exit 3)."""
    logger.write(f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; stopping "
                 f"without saving (last complete checkpoint: {checkpointer.latest()})")
    logger.close()
    shutdown_distributed()  # every rank saw the same reduced loss and grad norm
    return EXIT_NON_FINITE


def finish(cfg, guard, logger, evaluator, step: int, loss: float, stopped: bool,
           rank0: bool) -> int:
    """The run's last line on rank 0, then every rank leaves the process group."""
    guard.close()
    logger.close()
    if rank0 and stopped:
        print(f"stopped at step {step} of {cfg.train.steps} ({guard.reason})", flush=True)
    elif rank0:
        print(f"done: {step} steps, final loss {loss:.4f}{evaluator.summary()}; metrics in "
              f"{os.path.join(cfg.logging.run_dir, 'metrics.jsonl')}", flush=True)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
