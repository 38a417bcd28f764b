"""One optimizer step of data.dynamic_cp through GPT and DeepSpeed (train.py's loop).

Each rank runs its packs of the step's schedule (ctxpar/dynamic_cp/schedule.py) in the
schedule's order: the model's CP group set to the pack's rank group, forward, backward.
DeepSpeed's managed_gradient_accumulation is false (ctxpar's deepspeed section sets it
for dynamic CP): under ZeRO 0 and 1 the gradients accumulate locally, so ranks with
different numbers of packs never meet in a collective outside their groups, and
engine.step() reduces over DP x CP once, unchanged, and updates. ZeRO 2 reduces in every
backward and ZeRO 3 gathers in every forward, over all the DP x CP ranks: there the packs
run in rounds (Schedule.slots), each rank one pack per round, an empty one (padding, no
loss) where it has none. The loss is models/loss.py's: L_r = S_r x divisor x gas / N
with N the step's label count, which every rank knows from the schedule (no all-reduce).
"""
from __future__ import annotations

import torch

from ctxpar.dynamic_cp.batch import pack_sequence, shard_pack
from ctxpar.dynamic_cp.schedule import padded_length

from .loss import global_mean_loss, loss_for_backward


def pack_inputs(model, tile, documents, length: int, layout: str) -> dict:
    """This rank's share of one pack, the model switched to the pack's groups: `tile` is
    DynamicCPGroups.tile_groups' (the group, and under hybrid its Ulysses and ring groups),
    documents the pack's stored documents, length its padded length (shard_pack's dict)."""
    model.use_cp_group(*tile)
    return shard_pack(pack_sequence(documents, length), tile.cp_group, layout, tile.ulysses)


def train_step(engine, step, groups, state, layout: str, gas: int, divisor: int,
               device, rounds: bool = False) -> torch.Tensor:
    """step: a DynamicStep; groups: build_dynamic_cp_groups' (ctxpar/distributed/
    dynamic_groups.py). rounds (ZeRO 2 and 3, whose every backward, and under ZeRO 3
    every forward, is collective over DP x CP): the packs in Schedule.slots' rounds, an
    empty pack where a rank has none. Returns the global token-mean loss (collective)."""
    model = engine.module
    n_tokens = torch.tensor(float(step.n_tokens), device=device)
    loss_sum = torch.zeros((), device=device)
    if rounds:
        packs = [row[groups.position] for row in step.schedule.slots()]
    else:
        packs = step.schedule.packs_of(groups.position)
        if not packs:  # a rank the schedule left idle joins the reduction with zeros
            engine.backward(sum(p.sum() for p in model.parameters()) * 0.0)
    for pack in packs:
        if pack is None:  # nothing in this round: a pack of ignored padding
            tile = groups.tile_groups(groups.position, 1)
            documents, length = [], padded_length(1, 1, layout)
        else:
            tile = groups.tile_groups(pack.first, pack.size)
            documents, length = [step.documents[i] for i in pack.docs], pack.length
        local = pack_inputs(model, tile, documents, length, layout)
        out = engine(*(local[k].to(device) for k in ("tokens", "positions", "labels")),
                     cu_seqlens=local["cu_seqlens"])  # sum of this rank's token losses
        engine.backward(loss_for_backward(out, n_tokens, divisor, gas))
        loss_sum += out.detach().float()
    # evaluation and checkpoints see the run's groups
    model.use_cp_group(state.cp_group, state.ulysses_group, state.ring_group)
    engine.step()
    return global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)


def step_metrics(step) -> dict:
    """What a metrics line adds for a dynamic step: its tokens, the balance (max / mean of
    the ranks' estimated work) and the share of documents per CP size."""
    return {"step_tokens": step.n_tokens, "work_max_over_mean": step.schedule.work_balance,
            "cp_size_share": {str(d): s for d, s in step.schedule.size_shares().items()}}
