"""The GPT of a train.py run, for inference: its checkpoint's weights on a tp x cp grid.

    cfg = load_run_config(ckpt, layout_overrides(args.set, world), world_size=world)
    model, state = start_model(cfg, inspect_checkpoint(ckpt.path), "bf16")

What generate.py and tools/long_context_eval.py share; decoding itself is ctxpar.inference's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ctxpar.components.cli import fail, show_ctxpar_logs
from ctxpar.distributed.parallel_state import (default_backend, init_distributed,
                                               init_parallel_state, local_device)
from ctxpar.inference.checkpoint import CheckpointError, load_weights_

from .gpt import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def layout_overrides(user_sets, world: int):
    """The generation grid: tp (default 1) x cp (default world / tp), dp = pp = 1, ep 1
    (every expert of a mixture of experts on every rank, whatever ep the run trained
    with: its ep need not fit this grid), then the user's --set (which may name tp, cp,
    ep, layout, attention_backend...). Prefill runs the ring whatever parallel.cp_comm the
    run trained with (the weights do not depend on it, and a hybrid or Ulysses degree need
    not fit this grid)."""
    given = dict(s.split("=", 1) for s in user_sets if "=" in s)
    for key in ("parallel.pp", "parallel.dp"):
        if given.get(key, "1") != "1":
            raise ValueError(f"--set {key}={given[key]}: generate.py runs tp x cp ranks only "
                             f"(dp = pp = 1; a pipeline-trained checkpoint loads at pp=1)")
    tp = given.get("parallel.tp", "1")
    tp = int(tp) if tp.isdigit() and int(tp) > 0 else 1  # a bad value: config load names it
    return [f"parallel.tp={tp}", f"parallel.cp={max(1, world // tp)}",
            "parallel.pp=1", "parallel.dp=1", "parallel.ep=1"] + list(user_sets) + [
            "parallel.cp_comm=ring", "parallel.ulysses=null"]


def start_model(cfg, files, dtype: str):
    """(model in eval mode with the checkpoint's weights, parallel state): the process
    group and the tp x cp grid of cfg (pp = dp = 1), a mixture of experts' E/ep experts on
    each rank of its EP group (parallel.ep, folded over the CP ranks), on this rank's
    device. A weights file that does not fit the model exits 2 on every rank (the same
    files, the same verdict)."""
    device = local_device()
    init_distributed(default_backend(device))
    state = init_parallel_state(tp=cfg.parallel.tp, cp=cfg.parallel.cp, pp=1, dp=1,
                                order=cfg.parallel.order, ep=cfg.parallel.ep)
    show_ctxpar_logs(dist.get_rank() == 0)  # e.g. the attention kernel 'auto' chose, and why
    model = GPT.from_config(cfg, state, device=device, dtype=DTYPES[dtype]).eval()
    try:
        load_weights_(model, files, state.tp_group)
    except CheckpointError as e:
        fail(str(e))
    return model, state
