"""model.mtp under the pipeline (parallel.pp > 1): the MTP depths on the last stage.

    embedding | blocks | final norm | head | MTPPipe [| the embedding's copy]

Depth k at position i needs, as at pp 1 (models/mtp.py): h^0, the final-normed hidden
state (the head's input); the embedding of the id k ahead; the shifted ids and targets,
the positions and the documents' boundaries. On the last stage they come from:

    h^0, the head's weight   the head hands on (x, weight) instead of the logits (as under
                             memory.tiled_loss), so the loss makes every depth's logits
                             with the same weight (tied: the embedding's copy)
    the embedding            a TiedLayerSpec of the first stage's: the tied head's own copy,
                             or under an untied head one more copy on the last stage (its
                             forward hands its input on). DeepSpeed all-reduces the tied
                             gradient between the stages, so the embedding's gradient is the
                             sum of the input lookup's, the head's and the depths' lookups',
                             as GPT's single weight gets
    ids, targets, positions, the 'labels' side of each micro-batch, which only the last stage
    documents                loads from the data iterator (stage_labels): every rank reads
                             the same micro-batches, so nothing crosses the pipeline

MTPPipe only holds the depths' parameters (under GPT's names, mtp.layers.{k}.*) and hands
its input on; the last stage's loss (TokenMeanLoss with an MTPLoss) runs them and adds
sum_k w_k S_k to the LM's sum, w_k = lambda/D N/N_k of the step (models/mtp.py): the
step's loss is LM + lambda/D sum_k S_k/N_k over dp x cp, exactly as at pp 1. The layers
from the head on stay on the last stage whatever parallel.pp_partition gives
(ctxpar/config/pipeline_stages.py keep_on_last_stage, which the config's checks read
too).

Under model.mtp.moe each depth's experts are one more MoE layer of the model, as at pp 1
(models/gpt.py _moe_layers): the depths share one RouterStats per micro-batch, which the
loss adds to the routers' statistics the stages carried (RouterStats.packed, after every
block's, before TokenMeanLoss takes the routers' losses), with their share of the
sequence-level loss; each depth's assignments of the step move its own correction bias
(GPTPipe.update_router_biases, the last stage's layers after its blocks). The pipeline
with experts split over EP (parallel.ep > 1) and model.mtp is refused at load
(ctxpar/config/mtp.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ctxpar.config import ModelConfig, rotary_dim
from ctxpar.context_parallel.documents import unpack_cu_seqlens
from ctxpar.moe import RouterStats
from ctxpar.tensor_parallel import parallel_lm_logits

from .gpt import cap_logits, embed_tokens
from .moe import MoE
from .mtp import MTP
from .options import LayerArgs


class MTPPipe(nn.Module):
    """The MTP depths on the last stage; hands its input (the head's (x, weight)) on."""

    gpt_prefix = ""  # parameters 'mtp.layers.{k}.*', as in GPT

    def __init__(self, cfg: ModelConfig, args: LayerArgs):
        super().__init__()
        self.mtp = MTP(cfg, args)

    def forward(self, inputs):
        return inputs


def hand_on(module: nn.Module, inputs):
    """The embedding's copy on the last stage under an untied head: read by the loss only."""
    return inputs


def mtp_tail(cfg: ModelConfig, args: LayerArgs, embedding: type, tp_group, **kw) -> list:
    """The layers after the head under model.mtp (none without): MTPPipe and, under an
    untied head, a TiedLayerSpec of the embedding (``embedding``, the first stage's class)."""
    if cfg.mtp is None:
        return []
    tail: list = [LayerSpec(MTPPipe, cfg, args)]
    if not cfg.tie_embeddings:
        tail.append(TiedLayerSpec("embed", embedding, cfg, tp_group, forward_fn=hand_on,
                                  tied_weight_attr=["embed.weight"], **kw))
    return tail


def stage_labels(mb: Dict[str, torch.Tensor], documents: tuple) -> tuple:
    """The last stage's side of a micro-batch under model.mtp: (labels, positions,
    mtp_tokens, mtp_labels[, packed document boundaries]); documents: the first stage's
    packed boundaries, () without (gpt_pipe.stage_inputs)."""
    return (mb["labels"], mb["positions"], mb["mtp_tokens"], mb["mtp_labels"], *documents)


class MTPLoss:
    """The last stage's LM + MTP sum of token losses (TokenMeanLoss calls it per
    micro-batch): S + sum_k w_k S_k, as GPT.forward's sum at pp 1. ``sums`` keeps the
    step's S_k on this rank for the metrics (mtp_loss_k)."""

    def __init__(self, cfg: ModelConfig, tp_group, tiled_loss: bool,
                 router_groups: tuple = (None, 1)):
        """router_groups: (the CP group, dp), for the sequence-level loss's share (as
        gpt_pipe.BlockPipe's)."""
        self.cfg, self.tp_group, self.tiled_loss = cfg, tp_group, tiled_loss
        self.cp_group, self.dp_size = router_groups
        self.mtp: Optional[MTP] = None      # the last stage's depths (bind)
        self.embed: Optional[nn.Module] = None  # and its copy of the embedding
        self.weights: Optional[torch.Tensor] = None  # (D,) w_k of the step
        self.sums = torch.zeros(cfg.mtp.depth)
        # model.mtp.moe: the depths' MoE layers, this micro-batch's statistics, and each
        # depth's assignments per expert over the step (D, E) for the bias update
        self.moe_layers: List[MoE] = []
        self.stats: Optional[RouterStats] = None
        self.step_counts: Optional[torch.Tensor] = None

    def bind(self, mtp: MTP, embed: nn.Module) -> None:
        self.mtp, self.embed = mtp, embed
        self.moe_layers = [layer.block.mlp for layer in mtp.layers
                           if isinstance(layer.block.mlp, MoE)]

    def begin_step(self, micro: List[Dict[str, torch.Tensor]], device) -> None:
        """The step's weights (models/step_kinds.py attach_mtp_weights); sums afresh."""
        self.weights = micro[0]["mtp_weights"].to(device)
        self.sums = torch.zeros(self.cfg.mtp.depth, device=device)

    def loss_sum(self, outputs, labels: tuple, token_sum) -> torch.Tensor:
        """outputs: the head's (x (B, T/cp, d), weight (V/tp, d)); labels: stage_labels';
        token_sum(head output, targets): TokenMeanLoss's sum over the logits (or the tiled
        loss's over (x, weight))."""
        assert self.mtp is not None and self.weights is not None, "bind and begin_step first"
        x, weight = outputs
        labels, positions, mtp_tokens, mtp_labels, *docs = labels

        def head_sum(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if self.tiled_loss:
                return token_sum((h, weight), targets)
            return token_sum(cap_logits(parallel_lm_logits(h, weight, self.tp_group),
                                        self.cfg), targets)

        if self.moe_layers:  # one RouterStats for every depth, as at pp 1
            moe = self.cfg.moe
            self.stats = RouterStats(moe.num_experts, moe.score, moe.seq_aux_loss_coef > 0)
            for mlp in self.moe_layers:
                mlp.stats = self.stats
        embeds = embed_tokens(self.embed.embed, mtp_tokens, self.cfg)  # (B, D, T/cp, d)
        cu = unpack_cu_seqlens(docs[0]) if docs else None
        sums = self.mtp.loss_sums(x, embeds, positions, rotary_dim(self.cfg), cu, mtp_labels,
                                  head_sum)  # (D,)
        self.sums += sums.detach()
        return head_sum(x, labels) + (self.weights * sums).sum()

    def add_router_stats(self, carried: torch.Tensor, batch: int) -> torch.Tensor:
        """The routers' statistics the stages carried (RouterStats.packed) plus the
        depths' of the last loss_sum (under model.mtp.moe; else carried), their counts
        added to the step's and their share of the sequence-level loss over the B dp rows
        of the micro-batch (as gpt_pipe.BlockPipe._after_moe's)."""
        stats, self.stats = self.stats, None
        if stats is None:
            return carried
        counts = torch.stack(stats.layer_counts)  # (D, E)
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        seq = None if stats.seq is None else \
            stats.seq.share(counts.new_tensor(float(batch * self.dp_size)), self.cp_group)
        return stats.packed(carried, seq)


@torch.no_grad()
def last_stage_mtp_sums(mtp_loss: MTPLoss, state, depth: int, device) -> torch.Tensor:
    """(D,) this rank's S_k of the step, the last stage's, broadcast over the pipeline
    (collective over pp) so that every stage logs the same mtp_loss_k."""
    sums = mtp_loss.sums.clone() if state.is_pp_last_stage else \
        torch.zeros(depth, device=device)
    dist.broadcast(sums, src=state.ranks("pp")[-1], group=state.pp_group)
    return sums
