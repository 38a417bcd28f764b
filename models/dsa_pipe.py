"""model.dsa through the pipeline (models/gpt_pipe.py): what DeepSeek sparse attention hands
on in the pipe tuple, after the routers' statistics:

    selection      (B, T/cp, k) int64   the top-k of the layer before, only into a GLM-5
                                        'shared' layer (model.dsa.indexer_types)
    indexer sums   (3,) fp32            [KL sum, recall sum, recall queries] of the layers
                                        so far, under stage dense_warmup / sparse

The last stage's loss adds loss_weight x the KL sum, as GPT.forward adds it at pp 1, and
the KL's gradient travels back with the activations' to each stage's indexers (the sums
start on the first stage as zeros requiring grad, as the routers' statistics do:
DeepSpeed's pipeline engine back-propagates every float tensor a stage sends and sends no
gradient for integer ones). The recall entries are detached (a metric).

A shared layer reads its selection from the tuple, also from a layer of its own stage:
under DeepSpeed's 1F1B schedule a stage runs a later micro-batch's forward before an
earlier one's backward, and a block recomputed in backward (activation checkpointing)
must attend over its own micro-batch's selection, not whatever the layer before holds by
then. So a selection crosses a stage boundary exactly when the boundary falls between a
producer and its shared consumer.

Under 'dense_warmup' every parameter but the indexers' is frozen and the indexers read
their input detached, so no trainable parameter lies before any hidden state: the hidden
states a stage sends carry no gradient. DeepSpeed's pipeline engine still
back-propagates every float tensor a stage sends and sends back the gradient of every
float tensor a stage received. ``warmup_stage`` gives it both without a backward through
the frozen blocks: a stage runs on its received hidden state detached, hands it a zero
gradient through the indexer sums (the exact gradient of every trainable parameter
before it: none flows), and sends its own as a leaf requiring grad.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ctxpar.config import ModelConfig
from ctxpar.config.dsa import indexer_loss_travels


class _ZeroGradient(torch.autograd.Function):
    """(3,) zeros to add to the indexer sums, whose gradient to x is zeros: x's link to
    the loss under the dense warm-up (the module docstring)."""

    @staticmethod
    def forward(ctx, x):
        ctx.like = (x.shape, x.dtype, x.device)
        return torch.zeros(3, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device)


def warmup_stage(run, inputs, last_stage: bool):
    """A stage's forward ``run`` under the dense warm-up in training (module docstring):
    the received hidden state inputs[0] detached and linked to the sums (last in the
    tuple) by a zero gradient; the hidden state sent on a leaf requiring grad."""
    x = inputs[0] if isinstance(inputs, tuple) else None
    if x is not None and x.is_floating_point() and x.requires_grad:
        inputs = (x.detach(), *inputs[1:-1], inputs[-1] + _ZeroGradient.apply(x))
    out = run(inputs)
    if last_stage:
        return out
    return (out[0].detach().requires_grad_(), *out[1:])


class CarriedSelection:
    """What a shared DSA layer in the pipeline follows (models/dsa.py DSA.follow): the
    selection the pipe tuple brought for the micro-batch being run."""

    selection: Optional[torch.Tensor] = None


class DSATail:
    """The DSA part of the pipe tuple around each layer (the module docstring), from the
    config alone, so every stage agrees on it."""

    def __init__(self, cfg: ModelConfig):
        dsa, self.n_layers = cfg.dsa, cfg.n_layers
        selects = dsa is not None and dsa.stage != "dense_warmup"  # the warm-up is dense
        self.shared = [selects and not dsa.layer_has_indexer(i) for i in range(cfg.n_layers)]
        self.sums = indexer_loss_travels(dsa)  # the indexer's loss travels
        self.warmup = dsa is not None and dsa.stage == "dense_warmup"

    def takes_selection(self, layer: int) -> bool:
        """Whether the tuple into layer (n_layers: the final norm) holds a selection."""
        return layer < self.n_layers and self.shared[layer]

    def size(self, layer: int) -> int:
        """How many tensors the DSA tail of the tuple into layer holds."""
        return int(self.takes_selection(layer)) + int(self.sums)

    def start(self, device) -> tuple:
        """The first stage's tail (layer 0 has its own indexer: no selection)."""
        return (torch.zeros(3, device=device, requires_grad=True),) if self.sums else ()

    def split(self, inputs: tuple, layer: int):
        """The tuple into layer -> (the rest, selection or None, sums or None)."""
        n = self.size(layer)
        rest, tail = (inputs[:-n], list(inputs[-n:])) if n else (inputs, [])
        sums = tail.pop() if self.sums else None
        return rest, (tail[0] if tail else None), sums

    def after(self, layer: int, mixer, sums) -> tuple:
        """The tail out of layer after its forward: its selection when the next layer is
        shared, and the sums plus its indexer's KL (and recall) when they travel."""
        out = (mixer.selection,) if self.takes_selection(layer + 1) else ()
        if sums is None:
            return out
        kl, recall = getattr(mixer, "indexer_loss", None), getattr(mixer, "indexer_recall", None)
        if kl is not None:
            zeros = torch.zeros(2, device=kl.device)
            sums = sums + torch.cat((kl.reshape(1).float(), zeros if recall is None
                                     else recall.detach().float().to(kl.device)))
        return (*out, sums)


def run_with_selection(run, holder: Optional[CarriedSelection], selection):
    """run (a block's forward) with the shared layer's holder set to this micro-batch's
    selection first, also when activation checkpointing replays it in backward."""
    if holder is None:
        return run

    def replayable(*args, **kwargs):
        holder.selection = selection
        return run(*args, **kwargs)
    return replayable


class IndexerLoss:
    """The last stage's part of the indexer's loss (TokenMeanLoss): loss_weight x the KL
    sum added to the token-loss sum S, and the step's sums kept for the metrics."""

    def __init__(self, cfg: ModelConfig):
        self.weight = cfg.dsa.loss_weight
        self.step_sums: Optional[torch.Tensor] = None

    def begin_step(self) -> None:
        self.step_sums = None

    def add(self, loss_sum: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        kept = sums.detach().float()
        self.step_sums = kept if self.step_sums is None else self.step_sums + kept
        return loss_sum + self.weight * sums[0]


def indexer_loss_of(cfg: ModelConfig) -> Optional[IndexerLoss]:
    """The last stage's IndexerLoss, or None when the indexer's loss does not travel."""
    return IndexerLoss(cfg) if DSATail(cfg).sums else None


def pipeline_step_sums(loss_fn, state, device) -> torch.Tensor:
    """The step's (KL, recall sum, queries) of this rank's (tp, cp, dp) position, on every
    stage: the last stage's broadcast over the pipeline (collective over pp)."""
    index = loss_fn.indexer
    sums = index.step_sums if state.is_pp_last_stage else None
    sums = torch.zeros(3, device=device) if sums is None else sums.clone()
    dist.broadcast(sums, src=state.ranks("pp")[-1], group=state.pp_group)
    return sums


def send_selection(tail: DSATail, next_layer: int, out, dst: int) -> None:
    """pipeline_logits' stage boundary: the selection, when the next stage's first layer is
    a shared one (it ends the tuple's DSA tail before the sums)."""
    if tail.takes_selection(next_layer):
        dist.send(out[-1 - int(tail.sums)].contiguous(), dst=dst)


def recv_tail(tail: DSATail, layer: int, x: torch.Tensor, top_k: int, seq_len: int,
              src: int) -> tuple:
    """pipeline_logits' receiving side: the DSA tail into this stage's first layer (the
    selection (B, T/cp, min(top_k, seq_len)) from the stage before; zero sums)."""
    out = ()
    if tail.takes_selection(layer):
        selection = torch.empty(*x.shape[:2], min(top_k, seq_len), dtype=torch.int64,
                                device=x.device)
        dist.recv(selection, src=src)
        out = (selection,)
    return (*out, torch.zeros(3, device=x.device)) if tail.sums else out
