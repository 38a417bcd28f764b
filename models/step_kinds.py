"""The kinds of optimizer step that every run's kind builds on (models/steps.py decides
which one runs): what a kind offers (TrainSteps, StepOutput), the micro-batches through
DeepSpeed's engine or its pipeline engine, and data.dynamic_cp's packs. The MoE kinds
(models/moe_steps.py) extend the first two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol

import torch

from . import dynamic_cp, gpt_pipe
from .loss import global_mean_loss, global_token_count, loss_for_backward


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


def micro_batch_step(engine, micro, n_tokens, state, gas: int, divisor: int) -> torch.Tensor:
    """One optimizer step without a pipeline: gas forward/backward passes, then the update.

    divisor: what DeepSpeed divides the gradient summed over dp x cp by
    (ctxpar/distributed/zero.py). Returns the global token-mean loss (models/loss.py).
    """
    loss_sum = torch.zeros((), device=n_tokens.device)
    for mb in micro:
        local = engine(mb["tokens"], mb["positions"], mb["labels"],  # sum of token losses
                       cu_seqlens=mb.get("cu_seqlens"))  # documents (data.document_mask)
        engine.backward(loss_for_backward(local, n_tokens, divisor, gas))
        engine.step()
        loss_sum += local.detach().float()
    return global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)


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
        n_tokens = global_token_count(torch.cat([mb["labels"].flatten() for mb in micro]),
                                      self.state.dp_cp_group)
        return micro, n_tokens

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        return StepOutput(micro_batch_step(self.engine, micro, n_tokens, self.state,
                                           self.gas, self.divisor).item())


class PipelineSteps(MicroBatchSteps):
    """The same micro-batches through DeepSpeed's pipeline engine (engine.train_batch)."""

    def run(self, inputs) -> StepOutput:
        micro, n_tokens = inputs
        return StepOutput(gpt_pipe.train_step(self.engine, micro, n_tokens, self.state).item())


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
        loss = dynamic_cp.train_step(self.engine, step, self.groups, self.state, self.layout,
                                     self.gas, self.divisor, self.device, self.rounds).item()
        # the balance, the CP sizes, the tokens so far (whole documents, not seq_len windows)
        extras = {**dynamic_cp.step_metrics(step), "tokens": self.stream.tokens_seen}
        return StepOutput(loss, step.lengths, extras)
