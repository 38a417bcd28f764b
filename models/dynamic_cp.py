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
A mixture of experts adds each pack's z-loss share over the step's rows (known too) and
sums its routers' statistics; one all-reduce after the step gives their exact values and
the aux-free bias update (ctxpar/moe/aux.py, pack_share). Under parallel.ep > 1 the packs
run in rounds, so that every rank of an EP group runs one pack (or an empty one) at a
time and their all-to-alls pair up layer by layer (padding rows are routed and sent, and
left out of the statistics).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ctxpar.config.moe import moe_layer_indices
from ctxpar.dynamic_cp.batch import pack_sequence, shard_pack
from ctxpar.dynamic_cp.schedule import padded_length
from ctxpar.moe.aux import moe_metrics, step_values

from .loss import global_mean_loss, loss_for_backward


def pack_inputs(model, tile, documents, length: int, layout: str) -> dict:
    """This rank's share of one pack, the model switched to the pack's groups: `tile` is
    DynamicCPGroups.tile_groups' (the group, and under hybrid its Ulysses and ring groups),
    documents the pack's stored documents, length its padded length (shard_pack's dict)."""
    model.use_cp_group(*tile)
    return shard_pack(pack_sequence(documents, length), tile.cp_group, layout, tile.ulysses)


def train_step(engine, step, groups, state, layout: str, gas: int, divisor: int,
               device, rounds: bool = False):
    """step: a DynamicStep; groups: build_dynamic_cp_groups' (ctxpar/dynamic_cp/groups.py).
    rounds (ZeRO 2 and 3, whose every backward, and under ZeRO 3 every forward, is
    collective over DP x CP; and experts over EP, whose all-to-alls pair the ranks of an
    EP group layer by layer): the packs in Schedule.slots' rounds, an empty pack where a
    rank has none. Returns (the global token-mean loss, the routers' metrics and
    step_cpu_s: the step's process CPU seconds summed over DP x CP, a figure that other
    work on the machine changes far less than the wall clock's) (collective)."""
    cpu = time.process_time()
    model = engine.module
    n_tokens = torch.tensor(float(step.n_tokens), device=device)
    loss_sum = torch.zeros((), device=device)
    router = None
    if model.cfg.moe is not None:  # the step's rows: its tokens through every MoE layer
        layers = len(moe_layer_indices(model.cfg.moe, model.cfg.n_layers))
        model.router_step_rows = float(step.n_tokens * layers)
        router = torch.zeros(model.cfg.moe.num_experts + 2
                             + layers * model.cfg.moe.num_experts, device=device)
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
        loss = loss_for_backward(out, n_tokens, divisor, gas)
        if router is not None:  # the z-loss's share of the step, scaled as the token loss
            share, summary = model.router_pack
            loss, router = loss + share * (divisor * gas), router + summary
        engine.backward(loss)
        loss_sum += out.detach().float()
    # evaluation and checkpoints see the run's groups
    model.use_cp_group(state.cp_group, state.ulysses_group, state.ring_group)
    engine.step()
    extras = {} if router is None else router_step(model, router, state)
    cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64, device=device)
    if state.dp_cp_group is not None and dist.get_world_size(state.dp_cp_group) > 1:
        dist.all_reduce(cpu, group=state.dp_cp_group)
    extras["step_cpu_s"] = float(cpu)
    return global_mean_loss(loss_sum, n_tokens, state.dp_cp_group), extras


def router_step(model, summary: torch.Tensor, state) -> dict:
    """After a MoE step: the routers' statistics summed over DP x CP (one all-reduce), the
    aux-free bias update from the step's counts, the metrics line's MoE fields."""
    model.router_step_rows = model.router_pack = None
    model._router_stats(training=False)  # the layers let go of the last pack's statistics
    if state.dp_cp_group is not None and dist.get_world_size(state.dp_cp_group) > 1:
        dist.all_reduce(summary, group=state.dp_cp_group)
    aux, z, counts, per_layer = step_values(summary, model.cfg.moe.num_experts)
    model.update_router_biases(per_layer)
    return moe_metrics(torch.stack([aux, z, torch.zeros_like(z)]), counts)


def step_metrics(step) -> dict:
    """What a metrics line adds for a dynamic step: its tokens; the schedule's balance
    (max / mean of the ranks' estimated seconds, their waits for a group included), its
    predicted seconds and the step's work bound (balance.work_bound: the total work over
    the ranks, the least any schedule takes) with their ratio; the ranks' work alone,
    max over mean; the share of documents per CP size."""
    plan = step.schedule
    span, mean = plan.makespan(), sum(plan.rank_work) / plan.world
    return {"step_tokens": step.n_tokens, "work_max_over_mean": plan.work_balance,
            "schedule_max_over_mean": span / mean if mean > 0 else 1.0,
            "predicted_s": span, "bound_s": step.bound,
            "predicted_over_bound": span / step.bound if step.bound > 0 else 1.0,
            "cp_size_share": {str(d): s for d, s in plan.size_shares().items()}}
