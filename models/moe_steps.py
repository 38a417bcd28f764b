"""The optimizer step of a mixture of experts: the token loss plus the routers' losses.

Each micro-batch's forward leaves the model's RouterLosses (ctxpar/moe/aux.py): this
rank's share a_r of the load-balancing, z and sequence-level losses of the micro-batch's
tokens over DP x CP (the shares sum to the whole batch's). The step optimises

    L = (sum_r S_r) / N  +  (1/gas) sum_m A_m        (A_m: micro-batch m's router losses)

so each micro-batch backpropagates loss_for_backward(S_r) + a_r * divisor: DeepSpeed
scales by 1/gas, sums over the micro-batches and DP x CP and divides by the divisor,
leaving (1/gas) sum_m dA_m for the routers (models/loss.py's derivation for S_r). The
metrics line gets the losses (unweighted, the step's mean) and the routed assignments per
expert, max over mean, over the step (1.0: perfectly balanced). After the step's last
engine.step() the model's aux-free balance update gets the step's counts per layer (over
every rank and micro-batch: the same on every rank, GPT.update_router_biases).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ctxpar.moe.aux import moe_metrics

from . import gpt_pipe
from .loss import global_mean_loss, loss_for_backward
from .step_kinds import (MicroBatchSteps, PipelineSteps, StepOutput, add_indexer_sum,
                         indexer_metrics, mtp_inputs, mtp_metrics, pipeline_indexer_metrics,
                         pipeline_mtp_metrics)


class MoESteps(MicroBatchSteps):
    """MicroBatchSteps with the routers' losses (module docstring)."""

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        engine, gas, divisor = self.engine, self.gas, self.divisor
        loss_sum = torch.zeros((), device=n_tokens.device)
        aux = torch.zeros(3, device=n_tokens.device)
        counts = layer_counts = mtp_sums = index_sum = None
        for mb in micro:
            local = engine(mb["tokens"], mb["positions"], mb["labels"],
                           cu_seqlens=mb.get("cu_seqlens"), **mtp_inputs(mb))
            router = engine.module.router_losses
            engine.backward(loss_for_backward(local, n_tokens, divisor, gas)
                            + router.share * divisor)
            engine.step()
            loss_sum += local.detach().float()
            if "mtp_tokens" in mb:  # model.mtp (a dense MTP block beside MoE layers)
                sums = engine.module.mtp_loss_sums.float()
                mtp_sums = sums if mtp_sums is None else mtp_sums + sums
            index_sum = add_indexer_sum(index_sum, engine.module)  # model.dsa's KL
            aux += torch.stack([router.aux_loss, router.z_loss, router.seq_aux_loss]) / gas
            counts = router.tokens_per_expert if counts is None else \
                counts + router.tokens_per_expert
            layer_counts = router.layer_counts if layer_counts is None else \
                layer_counts + router.layer_counts
        engine.module.update_router_biases(layer_counts)  # after the step: aux-free balance
        loss = global_mean_loss(loss_sum, n_tokens, self.state.dp_cp_group)
        extras = moe_metrics(aux, counts)
        if mtp_sums is not None:
            extras.update(mtp_metrics(mtp_sums, micro[0], n_tokens, loss, self.state))
        if index_sum is not None:
            extras.update(indexer_metrics(index_sum, n_tokens, loss,
                                          engine.module.cfg.dsa.loss_weight, self.state))
        return StepOutput(loss.item(), extras=extras)


class MoEPipelineSteps(PipelineSteps):
    """PipelineSteps with the routers' losses: the last stage's loss adds them (every
    stage's layers' statistics travel with the activations: models/gpt_pipe.py), and their
    values reach every stage's metrics by a broadcast over the pipeline. After the step
    each stage moves its own layers' correction biases (GPTPipe.update_router_biases)."""

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        state = self.state
        loss = gpt_pipe.train_step(self.engine, micro, n_tokens, state)
        self.engine.module.update_router_biases()  # after the step: each stage its layers'
        router = self.engine.module.loss_fn.router  # the last stage's, None elsewhere
        E = self.engine.module.cfg.moe.num_experts
        values = torch.cat([router["values"], router["counts"]]) if state.is_pp_last_stage \
            else torch.zeros(3 + E, device=n_tokens.device)
        dist.broadcast(values, src=state.ranks("pp")[-1], group=state.pp_group)
        extras = moe_metrics(values[:3], values[3:])
        extras.update(pipeline_indexer_metrics(self.engine, n_tokens, loss, state))
        extras.update(pipeline_mtp_metrics(self.engine.module, micro, n_tokens, loss, state))
        return StepOutput(loss.item(), extras=extras)
