"""ctxpar's training entrypoint: long-context GPT pretraining with TP x CP x PP x DP.

    deepspeed --num_gpus 8 train.py --config configs/gpt1b_32k_3d.yaml
    torchrun --nproc_per_node 4 train.py --config configs/tiny_cpu.yaml --set train.steps=20
    srun python train.py --config configs/gpt7b_128k_3d.yaml      (rank/world from SLURM_*)

Top to bottom: config -> distributed -> ParallelState -> GPT -> deepspeed.initialize -> loop.
The loop asks each component whether its moment has come: the Evaluator
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
from functools import partial

import torch
import torch.distributed as dist

from ctxpar import checkpoint as ckpt
from ctxpar.components.cli import add_launcher_args, fail, show_ctxpar_logs, warn
from ctxpar.components.known_warnings import filter_known_warnings
from ctxpar.components.checkpointer import Checkpointer
from ctxpar.components.evaluation import Evaluator
from ctxpar.components.long_context import LongContextEval
from ctxpar.components.metrics import (MetricsLogger, StepMetrics, StepTimer, WandbError,
                                       init_wandb, memory_baseline)
from ctxpar.config import (ConfigError, deepspeed_config, dump_config, load_config, to_dict,
                           ulysses_degree)
from ctxpar.config.parameters import parameter_specs
from ctxpar.config.run_dir import check_run_dir
from ctxpar.data import DataError, build_data, load_tokenizer
from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
from ctxpar.dynamic_cp.groups import build_dynamic_cp_groups
from ctxpar.distributed.grad_norm import record_fp32_grad_norm
from ctxpar.distributed.mpu import DeepSpeedMPU
from ctxpar.distributed.parallel_state import (default_backend, init_distributed,
                                               init_parallel_state, launcher_env, local_device)
from ctxpar.distributed.zero import grad_divisor, partition_for_zero3
from ctxpar.memory import optimizer as optimizer_offload
from ctxpar.plan.startup import print_prediction
from models.options import ModelGroups

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


def lr_lambda(cfg):
    """Linear warmup to train.lr, then cosine decay to train.min_lr at train.steps."""
    t = cfg.train

    def factor(step):
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return (t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))) / t.lr
    return factor


def param_groups(model, weight_decay):
    """No weight decay on norms and biases (1-D tensors), as in GPT-2/Megatron.

    Under ZeRO-3 a parameter is a flat partition: its true shape is ``ds_shape``.
    """
    def matrix(p):
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for p in model.parameters() if p.requires_grad and matrix(p)]
    other = [p for p in model.parameters() if p.requires_grad and not matrix(p)]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": other, "weight_decay": 0.0}]


def finite(loss: float, grad_norm) -> bool:
    return math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))


def offload_metrics(model) -> dict:
    """memory.offload_activations: the most activation bytes this rank held on the host at
    once so far (ctxpar/memory/offload.py's counters), for metrics.jsonl and wandb."""
    off = getattr(model, "offload", None)
    return {} if off is None else {"offload_host_bytes": off.stats()["peak_host_bytes"]}


def train_step(engine, micro, n_tokens, state, gas, divisor) -> torch.Tensor:
    """One optimizer step without a pipeline: gas forward/backward passes, then the update.

    divisor: what DeepSpeed divides the gradient summed over dp x cp by
    (ctxpar/distributed/zero.py).
    Returns the global token-mean loss (models/loss.py; with pp > 1, models/gpt_pipe.py).
    """
    from models.loss import global_mean_loss, loss_for_backward

    loss_sum = torch.zeros((), device=n_tokens.device)
    for mb in micro:
        local = engine(mb["tokens"], mb["positions"], mb["labels"],  # sum of token losses
                       cu_seqlens=mb.get("cu_seqlens"))  # documents (data.document_mask)
        engine.backward(loss_for_backward(local, n_tokens, divisor, gas))
        engine.step()
        loss_sum += local.detach().float()
    return global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)


def check_inputs(args, world: int):
    """Config, run dir, data paths and the checkpoint to resume or start from: pure checks,
    the same verdict on every rank, so bad input exits 2 with one line before any collective.
    Returns (cfg, data, save_dir, resume point or None, init_from weights or None, the
    long-context tasks or None)."""
    try:
        cfg = load_config(args.config, args.set, world_size=world)
        check_run_dir(cfg)  # a path through a file, a read-only place: nothing created
        data = build_data(cfg)  # opens token files / builds the passkey task; no collectives
        long_context = LongContextEval(cfg, load_tokenizer(cfg.data.tokenizer)) \
            if cfg.long_context_eval.tasks else None  # every prompt made now
    except (ConfigError, DataError) as e:
        fail(str(e))
    if (cfg.data.document_mask and cfg.parallel.cp > 1 and cfg.parallel.layout != "striped"
            and cfg.parallel.cp_comm != "ulysses"):  # Ulysses: every rank the whole sequence
        warn(f"data.document_mask with parallel.layout={cfg.parallel.layout!r}: ranks' "
             f"attention work is unbalanced with documents (docs/benchmarks.md: documents); "
             f"layout 'striped' keeps it balanced")
    run_dir = cfg.logging.run_dir
    save_dir = cfg.checkpoint.save_dir or os.path.join(run_dir, "checkpoints")
    problem = ckpt.resume_problem(save_dir, args.resume)  # a missing tag: before DeepSpeed
    if problem:
        fail(problem)
    try:  # is the checkpoint sound (its manifest), and on this layout? file reads only
        resume_from = ckpt.resume_point(save_dir, args.resume, cfg, world, on_skip=warn)
        if cfg.model.family is not None:  # the export's family must hold the model
            ckpt.family_config(cfg.model)
        init = ckpt.check_init_from(cfg) if cfg.model.init_from and resume_from is None else None
    except ckpt.CheckpointError as e:
        fail(str(e))
    return cfg, data, save_dir, resume_from, init, long_context


def parallel_state(cfg):
    """The config's rank grid and its process groups (collective over the world)."""
    p = cfg.parallel
    return init_parallel_state(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, order=p.order,
                               ulysses=ulysses_degree(p))


def build_model(cfg, state, gas: int, device):
    """This rank's model: the GPT, or with pp > 1 its pipeline stage (DeepSpeed's pipeline
    grid, derived from the same order string, is then the mpu:
    ctxpar/distributed/pipeline_parallel.py). The same init for every layout."""
    from models import gpt_pipe
    from models.gpt import GPT

    if cfg.parallel.pp > 1:
        return gpt_pipe.GPTPipe.from_config(cfg, state, gas, device=device)
    return GPT.from_config(cfg, state, device=device)


def initialize_engine(model, cfg, state, ds_config, device):
    """ZeRO-3's partitioning over dp x cp, AdamW and its schedule, and DeepSpeed's engine
    over them. Returns (engine, scheduler)."""
    import deepspeed

    pipelined = cfg.parallel.pp > 1
    partition_for_zero3(model, state, ds_config)  # ZeRO-3: over dp x cp (distributed/zero.py)
    # AdamW; under ZeRO-Offload DeepSpeedCPUAdam on GPUs, torch's on CPU runs (the rule:
    # ctxpar/memory/optimizer.py)
    optimizer = optimizer_offload.build_optimizer(
        param_groups(model, cfg.train.weight_decay), cfg.train, ds_config, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config,
                                           mpu=None if pipelined else DeepSpeedMPU(state))
    record_fp32_grad_norm(engine, state)  # fp32 ZeRO-0 records none (distributed/grad_norm.py)
    return engine, scheduler


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


def open_logger(cfg, rank0: bool, start_step: int) -> MetricsLogger:
    """Rank 0 records the run: config.yaml, wandb (a warning, not a stop, when it cannot
    start) and metrics.jsonl with the progress bar; other ranks get a silent logger."""
    run_dir, wandb_run = cfg.logging.run_dir, None
    if rank0:
        dump_config(cfg, run_dir)
        try:
            wandb_run = init_wandb(cfg.logging, run_dir, to_dict(cfg))
        except WandbError as e:
            print(f"warning: {e}; continuing without wandb", file=sys.stderr, flush=True)
    return MetricsLogger(run_dir, cfg.train.steps, start_step, enabled=rank0,
                         wandb_run=wandb_run)


def main(argv=None) -> int:
    args = parse_args(argv)
    filter_known_warnings()  # DeepSpeed's deprecated torch calls, not the user's business
    launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK from torchrun/deepspeed or srun
    world = int(os.environ["WORLD_SIZE"])
    cfg, data, save_dir, resume_from, init, long_context = check_inputs(args, world)  # 1. exit 2
    dynamic = dynamic_stream(cfg, data, world) if cfg.data.dynamic_cp else None
    device, state, rank0 = start_distributed(cfg, world)         # 2. the grid
    torch.manual_seed(cfg.train.seed)

    # 3. The model (same init for every layout) and the DeepSpeed engine.
    from models import dynamic_cp, gpt_pipe
    from models.gpt import GPT
    from models.loss import global_token_count

    pipelined = cfg.parallel.pp > 1
    ds_config = deepspeed_config(cfg, state.dp_size)
    gas = ds_config["gradient_accumulation_steps"]
    memory_line = optimizer_offload.describe(cfg, ds_config, device)  # the options that are on
    if rank0 and memory_line:
        print(memory_line, flush=True)
    baseline = memory_baseline(device)  # before the model: what the prediction leaves out
    model = build_model(cfg, state, gas, device)  # with pp > 1 this rank's pipeline stage
    if init is not None:  # model.init_from: a Hugging Face folder's weights or a ctxpar checkpoint's
        init_msg = ckpt.load_initial_weights(model, cfg, state, init)
    # DeepSpeed writes this into every checkpoint: how TP slices join into full tensors
    # (ds_to_universal), so the checkpoint can be resumed on another layout.
    # every layer at this TP: names and TP attributes
    meta = GPT(cfg.model, ModelGroups(tp_group=state.tp_group, cp_group=state.cp_group),
               device=torch.device("meta"))
    model.universal_checkpoint_info = ckpt.universal_checkpoint_info(
        meta, cfg.model.n_layers, cfg.model.tie_embeddings, pipelined)
    if resume_from is not None:
        resume_from.configure(ds_config)  # a layout change loads DeepSpeed's universal format
    n_params = sum(spec.numel() for spec in parameter_specs(cfg.model))  # the whole model
    divisor = grad_divisor(state, ds_config, pipelined)
    zero_stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    engine, scheduler = initialize_engine(model, cfg, state, ds_config, device)
    train_stream = data.train_stream(state) if dynamic is None else dynamic
    if dynamic is not None:  # every rank group the schedule may use, once
        hybrid = ulysses_degree(cfg.parallel) if cfg.parallel.cp_comm == "hybrid" else None
        groups = build_dynamic_cp_groups(state, dynamic.sizes, ulysses=hybrid)

    # 4. Resume, record the run, and the components that decide when to evaluate and save.
    start_step = 0
    if resume_from is not None:
        client = ckpt.restore(engine, resume_from, cfg, state, meta)  # resharded if changed
        start_step = client["step"]
        train_stream.load_state_dict(client["data"])
    if start_step >= cfg.train.steps:  # e.g. `make train` run twice: say so, train nothing
        if rank0:
            print(f"nothing to train: {os.path.join(save_dir, resume_from.tag)} is at step "
                  f"{start_step} of train.steps={cfg.train.steps} (--resume none or another "
                  f"logging.run_dir starts over)", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    logger = open_logger(cfg, rank0, start_step)
    if init is not None:
        logger.write(init_msg)
    if start_step:
        logger.write(f"resumed from {os.path.join(save_dir, resume_from.tag)} at step {start_step}")
        if resume_from.universal:
            logger.write(resume_from.describe_changes())
    metrics = StepMetrics(cfg, n_params, state.world_size, device, baseline)
    forward = (partial(gpt_pipe.pipeline_logits, engine.module, state, head_inputs=True)
               if pipelined else None)
    evaluator = Evaluator(cfg, data, state, device, forward, long_context)
    checkpointer = Checkpointer(engine, save_dir, cfg.checkpoint.save_interval,
                                ckpt.checkpoint_meta(cfg, state.dp_size), train_stream)
    if evaluator.should_evaluate(start_step, start=True):  # train.eval_at_start
        evaluator.run(engine.module, start_step, logger)

    # 5. The loop: gas micro-batches per optimizer step, loss = global token mean.
    timer = StepTimer(device)
    guard = ckpt.PreemptionGuard(device)  # SIGTERM/SIGUSR1: finish the step, save, exit 0
    step, loss, stopped = start_step, float("nan"), False
    while step < cfg.train.steps:
        if dynamic is not None:  # whole documents, each on its rank group (models/dynamic_cp.py)
            this_step = dynamic.next_step()
            loss = dynamic_cp.train_step(engine, this_step, groups, state, cfg.parallel.layout,
                                         gas, divisor, device, rounds=zero_stage >= 2).item()
        else:
            # Every rank reads its DP rank's micro-batches (all stages, for N; the pipeline
            # feeds the first stage's inputs and the last stage's labels from them).
            micro = [train_stream.next_microbatch(device) for _ in range(gas)]
            # N: non-ignored tokens of the whole step over DP x CP (models/loss.py), one
            # all-reduce for the step, not one per micro-batch.
            n_tokens = global_token_count(torch.cat([mb["labels"].flatten() for mb in micro]),
                                          state.dp_cp_group)
            loss = (gpt_pipe.train_step(engine, micro, n_tokens, state) if pipelined
                    else train_step(engine, micro, n_tokens, state, gas, divisor)).item()
        step += 1
        last = step == cfg.train.steps
        grad_norm = engine.get_global_grad_norm()  # before clipping; None: not recorded
        grad_norm = float(grad_norm) if grad_norm is not None else None
        if not finite(loss, grad_norm):
            logger.write(f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; "
                         f"stopping without saving (last complete checkpoint: "
                         f"{checkpointer.latest()})")
            logger.close()
            return EXIT_NON_FINITE
        dt = timer.lap()
        lengths = None if dynamic is None else this_step.lengths
        row = metrics.record(step, loss, scheduler.get_last_lr()[0], grad_norm, dt, lengths)
        if dynamic is not None:  # the balance, the CP sizes, the tokens so far
            row.update(dynamic_cp.step_metrics(this_step), tokens=dynamic.tokens_seen)
        if metrics.should_log(step):
            logger.log({**row, **offload_metrics(model)})
        logger.advance(step, loss, row["tokens_per_s"])
        if evaluator.should_evaluate(step):
            evaluator.run(engine.module, step, logger)
        stopped = guard.should_stop() and not last  # collective: all ranks stop alike
        saved = checkpointer.save(step, last_step=last, force=stopped)
        timer.lap()  # evaluation and saving are not step time
        if stopped:
            logger.write(f"step {step}: {guard.reason}: stopping with a complete checkpoint "
                         f"{saved}; --resume auto continues from it")
            break

    guard.close()
    logger.close()
    if rank0 and stopped:
        print(f"stopped at step {step} of {cfg.train.steps} ({guard.reason})", flush=True)
    elif rank0:
        print(f"done: {step} steps, final loss {loss:.4f}{evaluator.summary()}; metrics in "
              f"{os.path.join(cfg.logging.run_dir, 'metrics.jsonl')}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
