"""The kinds of optimizer step that every run's kind builds on (models/steps.py decides
which one runs): what a kind offers (TrainSteps, StepOutput), the micro-batches through
DeepSpeed's engine or its pipeline engine, and data.dynamic_cp's packs. The MoE kinds
(models/moe_steps.py) extend the first two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

import torch
import torch.distributed as dist

from . import dynamic_cp, gpt_pipe
from .dsa_pipe import pipeline_step_sums
from .loss import count_tokens, global_mean_loss, global_token_count, loss_for_backward
from .mtp import mtp_loss_weights
from .mtp_pipe import last_stage_mtp_sums


@dataclass
class StepOutput:
    loss: float                           # the global token-mean loss of the step
    lengths: Optional[List[int]] = None   # whole documents' tokens (throughput and FLOPs)
    extras: Dict[str, Any] = field(default_factory=dict)  # added to the metrics line


class TrainSteps(Protocol):
    stream: Any  # the data stream whose position each checkpoint saves and a resume restores

    def next_step(self) -> Any:
        """This rank's inputs of the next step (reads the stream)."""

    def run(self, inputs) -> StepOutput:
        """Forward, backward and the optimizer update of one step (collective)."""


def mtp_inputs(mb) -> Dict[str, Any]:
    """model.mtp's forward arguments of a micro-batch (none without model.mtp)."""
    if "mtp_tokens" not in mb:
        return {}
    return {k: mb[k] for k in ("mtp_tokens", "mtp_labels", "mtp_weights")}


def count_step_tokens(micro, state) -> torch.Tensor:
    """N, the non-ignored labels of the whole step over DP x CP (0-d); with model.mtp
    (D + 1,): N and each depth's N_k, one all-reduce for all."""
    labels = torch.cat([mb["labels"].flatten() for mb in micro])
    if "mtp_labels" not in micro[0]:
        return global_token_count(labels, state.dp_cp_group)
    depth = micro[0]["mtp_labels"].shape[1]
    counts = torch.stack([count_tokens(labels)] + [
        sum(count_tokens(mb["mtp_labels"][:, k]) for mb in micro) for k in range(depth)])
    if state.dp_cp_group is not None and dist.get_world_size(state.dp_cp_group) > 1:
        dist.all_reduce(counts, group=state.dp_cp_group)
    return counts


def attach_mtp_weights(micro, counts: torch.Tensor, mtp_cfg) -> torch.Tensor:
    """Hand each micro-batch the depths' loss weights lambda/D * N/N_k (models/mtp.py) as
    "mtp_weights" and the N_k as "mtp_counts"; returns N (counts[0])."""
    if counts.dim() == 0:
        return counts
    weights = mtp_loss_weights(mtp_cfg.depth, mtp_cfg.loss_weight, counts[0], counts[1:])
    for mb in micro:
        mb["mtp_weights"], mb["mtp_counts"] = weights, counts[1:]
    return counts[0]


def mtp_metrics(mtp_sums: torch.Tensor, mb, n_tokens: torch.Tensor, loss: torch.Tensor,
                state) -> Dict[str, float]:
    """The metrics line's MTP fields: each depth's global token-mean loss (mtp_loss_k) and
    the LM loss alone (lm_loss; ``loss`` is what is optimised, LM + lambda/D sum_k)."""
    total = mtp_sums.clone()  # (D,) this rank's sums over the step's micro-batches
    if state.dp_cp_group is not None and dist.get_world_size(state.dp_cp_group) > 1:
        dist.all_reduce(total, group=state.dp_cp_group)
    counts, weights = mb["mtp_counts"], mb["mtp_weights"]
    per_depth = total / counts.clamp(min=1.0)
    added = (weights * total).sum() / n_tokens.clamp(min=1.0)  # lambda/D sum_k S_k / N_k
    return {"lm_loss": (loss - added).item(),
            **{f"mtp_loss_{k + 1}": v.item() for k, v in enumerate(per_depth)}}


def indexer_metrics(index_sum: torch.Tensor, n_tokens: torch.Tensor, loss: torch.Tensor,
                    weight: float, state) -> Dict[str, float]:
    """The metrics line's DSA fields (model.dsa under dense_warmup or sparse): the
    indexer's KL summed over its layers as a token mean over the step's labels
    (indexer_loss), the LM loss alone (lm_loss; ``loss`` adds loss_weight x it) and, under
    dense_warmup, the mean over queries and layers of the share of the dense attention's
    top-k the indexer selects (indexer_recall). index_sum: (KL, recall sum, queries)."""
    total = index_sum.clone()  # this rank's sums over the step's micro-batches
    if state.dp_cp_group is not None and dist.get_world_size(state.dp_cp_group) > 1:
        dist.all_reduce(total, group=state.dp_cp_group)
    mean = total[0] / n_tokens.clamp(min=1.0)
    out = {"indexer_loss": mean.item(), "lm_loss": (loss - weight * mean).item()}
    if total[2] > 0:
        out["indexer_recall"] = (total[1] / total[2]).item()
    return out


def add_indexer_sum(total, module):
    """total + the model's last forward's indexer sums (GPT.indexer_sums; None when it
    has none)."""
    new = module.indexer_sums
    if new is None:
        return total
    return new.float() if total is None else total + new.float()


def micro_batch_step(engine, micro, n_tokens, state, gas: int, divisor: int):
    """One optimizer step without a pipeline: gas forward/backward passes, then the update.

    divisor: what DeepSpeed divides the gradient summed over dp x cp by
    (ctxpar/distributed/zero.py). Returns the global token-mean loss (models/loss.py) and,
    with model.mtp, the metrics' MTP fields.
    """
    loss_sum = torch.zeros((), device=n_tokens.device)
    mtp_sums = index_sum = None
    for mb in micro:
        local = engine(mb["tokens"], mb["positions"], mb["labels"],  # sum of token losses
                       cu_seqlens=mb.get("cu_seqlens"),  # documents (data.document_mask)
                       **mtp_inputs(mb))  # model.mtp's shifted ids and targets
        engine.backward(loss_for_backward(local, n_tokens, divisor, gas))
        engine.step()
        loss_sum += local.detach().float()
        if "mtp_tokens" in mb:
            sums = engine.module.mtp_loss_sums.float()
            mtp_sums = sums if mtp_sums is None else mtp_sums + sums
        index_sum = add_indexer_sum(index_sum, engine.module)
    loss = global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)
    extras = {} if mtp_sums is None else mtp_metrics(mtp_sums, micro[0], n_tokens, loss, state)
    if index_sum is not None:
        extras.update(indexer_metrics(index_sum, n_tokens, loss,
                                      engine.module.cfg.dsa.loss_weight, state))
    return loss, extras


class MicroBatchSteps:
    """gas micro-batches per step from the DP/CP sample stream (ctxpar/data/loader.py)."""

    def __init__(self, engine, stream, state, gas: int, divisor: int, device):
        self.engine, self.stream, self.state = engine, stream, state
        self.gas, self.divisor, self.device = gas, divisor, device

    def next_step(self):
        """(micro-batches, N): every rank reads its DP rank's micro-batches (every pipeline
        stage too: the first feeds the inputs, the last the labels); N, the non-ignored
        tokens of the whole step over DP x CP (one all-reduce per step)."""
        micro = [self.stream.next_microbatch(self.device) for _ in range(self.gas)]
        counts = count_step_tokens(micro, self.state)  # N (and model.mtp's N_k)
        if counts.dim() == 0:
            return micro, counts
        return micro, attach_mtp_weights(micro, counts, self.engine.module.cfg.mtp)

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        loss, extras = micro_batch_step(self.engine, micro, n_tokens, self.state, self.gas,
                                        self.divisor)
        return StepOutput(loss.item(), extras=extras)


def pipeline_mtp_metrics(module, micro, n_tokens, loss, state) -> Dict[str, float]:
    """model.mtp's metrics under the pipeline, the same on every stage (none without)."""
    if "mtp_tokens" not in micro[0]:
        return {}
    sums = last_stage_mtp_sums(module.loss_fn.mtp, state, module.cfg.mtp.depth,
                               n_tokens.device)
    return mtp_metrics(sums, micro[0], n_tokens, loss, state)


class PipelineSteps(MicroBatchSteps):
    """The same micro-batches through DeepSpeed's pipeline engine (engine.train_batch)."""

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        loss = gpt_pipe.train_step(self.engine, micro, n_tokens, self.state)
        return StepOutput(loss.item(), extras={
            **pipeline_indexer_metrics(self.engine, n_tokens, loss, self.state),
            **pipeline_mtp_metrics(self.engine.module, micro, n_tokens, loss, self.state)})


def pipeline_indexer_metrics(engine, n_tokens, loss, state) -> Dict[str, float]:
    """Under model.dsa's loss through the pipeline, the metrics' DSA fields on every stage
    (the last stage's sums broadcast over pp: models/dsa_pipe.py); else none."""
    loss_fn = engine.module.loss_fn
    if loss_fn.indexer is None:
        return {}
    sums = pipeline_step_sums(loss_fn, state, n_tokens.device)
    return indexer_metrics(sums, n_tokens, loss, loss_fn.indexer.weight, state)


class DynamicSteps:
    """data.dynamic_cp: each step's whole documents, each pack on the rank group of its CP
    size; `groups` every such group, built once (ctxpar/dynamic_cp/groups.py)."""

    def __init__(self, engine, stream, groups, state, layout: str, gas: int, divisor: int,
                 device, rounds: bool):
        self.engine, self.stream, self.groups, self.state = engine, stream, groups, state
        self.layout, self.gas, self.divisor, self.device = layout, gas, divisor, device
        self.rounds = rounds  # ZeRO 2 and 3: the packs in rounds (models/dynamic_cp.py)

    def next_step(self):
        return self.stream.next_step()  # a DynamicStep: documents, schedule, token count

    def run(self, step) -> StepOutput:
        loss, more = dynamic_cp.train_step(self.engine, step, self.groups, self.state,
                                           self.layout, self.gas, self.divisor, self.device,
                                           self.rounds)
        loss = loss.item()
        # the balance, the CP sizes, the tokens so far (whole documents, not seq_len
        # windows); the routers' metrics and the step's CPU seconds (train_step's)
        extras = {**dynamic_cp.step_metrics(step), "tokens": self.stream.tokens_seen, **more}
        return StepOutput(loss, step.lengths, extras)
