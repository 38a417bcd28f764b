"""One optimizer step of data.dynamic_cp through GPT and DeepSpeed (train.py's loop).

Each rank runs its packs of the step's schedule (ctxpar/data/dynamic_cp.py) in the
schedule's order: the model's CP group set to the pack's rank group, forward, backward.
DeepSpeed accumulates the gradients locally (managed_gradient_accumulation false, which
ctxpar's deepspeed section sets for dynamic CP), so ranks with different numbers of packs
never meet in a collective outside their groups; engine.step() then reduces over DP x CP
once, unchanged, and updates. The loss is models/loss.py's: L_r = S_r x divisor x gas / N
with N the step's label count, which every rank knows from the schedule (no all-reduce).
"""
from __future__ import annotations

import torch

from ctxpar.data.dynamic_batch import pack_sequence, shard_pack

from .loss import global_mean_loss, loss_for_backward


def train_step(engine, step, groups, state, layout: str, gas: int, divisor: int,
               device) -> torch.Tensor:
    """step: a DynamicStep; groups: build_dynamic_cp_groups' (ctxpar/distributed/
    dynamic_groups.py). Returns the global token-mean loss (collective over DP x CP)."""
    model = engine.module
    n_tokens = torch.tensor(float(step.n_tokens), device=device)
    loss_sum = torch.zeros((), device=device)
    packs = step.schedule.packs_of(groups.position)
    for pack in packs:
        group = groups.group(pack.first, pack.size)
        model.use_cp_group(group)
        local = shard_pack(pack_sequence([step.documents[i] for i in pack.docs], pack.length),
                           group, layout)
        out = engine(*(local[k].to(device) for k in ("tokens", "positions", "labels")),
                     cu_seqlens=local["cu_seqlens"])  # sum of this rank's token losses
        engine.backward(loss_for_backward(out, n_tokens, divisor, gas))
        loss_sum += out.detach().float()
    if not packs:  # a rank the schedule left idle joins the reduction with zero gradients
        engine.backward(sum(p.sum() for p in model.parameters()) * 0.0)
    model.use_cp_group(state.cp_group)  # evaluation and checkpoints see the run's group
    engine.step()
    return global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)


def step_metrics(step) -> dict:
    """What a metrics line adds for a dynamic step: its tokens, the balance (max / mean of
    the ranks' estimated work) and the share of documents per CP size."""
    return {"step_tokens": step.n_tokens, "work_max_over_mean": step.schedule.work_balance,
            "cp_size_share": {str(d): s for d, s in step.schedule.size_shares().items()}}
