"""The router's auxiliary losses over the tokens of every rank, exactly.

transformers' load_balancing_loss_func (Mixtral, Qwen-MoE, gpt-oss) over the rows of every
MoE layer of a forward pass (L layers x N tokens, R = L N rows):

    A = E * sum_e (c_e / R) (P_e / R)     c_e: top-k assignments to expert e (no gradient)
                                          P_e: sum over rows of softmax(logits)_e

Under DP x CP the rows are spread over the ranks: c_e, R and the loss's value need every
rank's, and a per-rank loss averaged would not be A (a product of two sums). So c_e and R
are all-reduced (counts, no gradient) and each rank keeps the differentiable share

    a_r = E * sum_e (c_e / R) (P_e,r / R)        sum over ranks of a_r = A

whose gradients, summed over the ranks by the usual gradient reduction, are exactly A's.
The z-loss (mean over rows of logsumexp(logits)^2) splits the same way, and so does
DeepSeek's sequence-level balance loss (seq_aux.py: its counts per sequence over CP).
``losses`` returns each rank's share for backward and the global values for the metrics.

Dynamic CP (models/dynamic_cp.py) runs a step as packs, each rank its own number, each
backpropagated before the next, so no collective per forward: the step's rows R are
known before it starts (its tokens x the MoE layers), the rows of a pack's padding are
left out (``valid``), and ``pack_share`` gives the z-loss's share z_r / R of the pack and
its statistics summed; after the step one all-reduce of those gives the exact values
(``step_values``: the load-balancing loss's value for the metrics, the counts for the
aux-free bias). The load-balancing loss's gradient needs the step's counts before any
backward: refused with dynamic CP (config/moe.py), as is the sequence-level loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from .seq_aux import SequenceBalance


@dataclass
class RouterLosses:
    share: torch.Tensor        # this rank's differentiable share (sum over ranks = total)
    aux_loss: torch.Tensor     # the load-balancing loss A of the whole batch (unweighted)
    z_loss: torch.Tensor       # the z-loss of the whole batch (unweighted)
    tokens_per_expert: torch.Tensor  # (E,) assignments over the batch and layers
    layer_counts: torch.Tensor       # (L, E) assignments over the batch, per MoE layer
    seq_aux_loss: torch.Tensor       # DeepSeek's sequence-level balance loss (unweighted)


class RouterStats:
    """What each MoE layer of one forward pass adds (its logits and chosen experts)."""

    def __init__(self, num_experts: int, score: str = "softmax", sequences: bool = False):
        """sequences: keep what DeepSeek's sequence-level balance loss needs (seq_aux.py),
        from the router's ``score`` ('softmax' or 'sigmoid')."""
        self.num_experts = num_experts
        self.seq = SequenceBalance(num_experts, score) if sequences else None
        self.batch = 0                 # this rank's sample rows
        self.layer_counts: List[torch.Tensor] = []  # per layer (E,) fp32, this rank
        self.prob_sums: List[torch.Tensor] = []   # per layer (E,), differentiable
        self.z_sums: List[torch.Tensor] = []      # per layer (), differentiable
        self.rows = 0
        self.carried_seq = None   # unpack's: the stages' sequence-level share (pipeline)
        self.valid = None         # (N,) bool: the rows that count (not a pack's padding)

    def add(self, logits: torch.Tensor, experts: torch.Tensor, batch: int = 1) -> None:
        """One layer's router logits (N, E) and its chosen experts (N, k) of batch rows."""
        logits = logits.float()
        if self.valid is not None:  # a dynamic-CP pack's real tokens (no sequence loss)
            logits, experts = logits[self.valid], experts[self.valid]
        self.batch = batch
        if self.seq is not None:
            self.seq.add(logits, experts, batch)
        self.layer_counts.append(
            torch.bincount(experts.reshape(-1), minlength=self.num_experts).float())
        self.prob_sums.append(torch.softmax(logits, dim=-1).sum(dim=0))
        self.z_sums.append(torch.logsumexp(logits, dim=-1).square().sum())
        self.rows += logits.shape[0]

    def packed(self, carried: torch.Tensor, seq_share=None) -> torch.Tensor:
        """carried (2E + 3,) fp32 [probability sums (E), z sum, sequence-level share,
        counts (E), rows] of an earlier pipeline stage's layers (zeros on the first) plus
        this forward's: what a stage hands on with its activations, so the last stage's
        loss sees every layer's (the first E + 2 entries carry the routers' gradients back;
        counts and rows none). seq_share: this forward's layers' share of the
        sequence-level loss (SequenceBalance.share, a sum over layers, so the stages'
        shares add up to pp 1's)."""
        if self.rows == 0:  # no MoE layer ran
            return carried
        seq = self.layer_counts[0].new_zeros(()) if seq_share is None else seq_share
        own = torch.cat([torch.stack(self.prob_sums).sum(0),
                         torch.stack(self.z_sums).sum().view(1), seq.view(1),
                         torch.stack(self.layer_counts).sum(0).detach(),
                         self.layer_counts[0].new_tensor([self.rows])])
        return carried + own

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_experts: int) -> "RouterStats":
        """The RouterStats of every layer a packed tensor has summed, as one layer
        (``losses`` sums over the layers: the same load-balancing and z losses; the
        sequence-level share as the stages computed it)."""
        E, stats = num_experts, cls(num_experts)
        stats.prob_sums, stats.z_sums = [packed[:E]], [packed[E]]
        stats.carried_seq = packed[E + 1]
        stats.layer_counts = [packed[E + 2:2 * E + 2].detach()]
        stats.rows = float(packed[-1].detach())
        return stats

    def losses(self, aux_coef: float, z_coef: float, group=None, seq_coef: float = 0.0,
               cp_group=None) -> RouterLosses:
        """Collective over `group` (the ranks holding the batch's tokens: DP x CP) and, with
        the sequence-level loss, over cp_group: the weighted share aux_coef a_r + z_coef z_r
        + seq_coef s_r and the global values."""
        E, L = self.num_experts, len(self.layer_counts)
        per_layer = torch.stack(self.layer_counts)                 # (L, E)
        counts = torch.cat([per_layer.reshape(-1),
                            per_layer.new_tensor([self.rows, self.batch])])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        per_layer, rows = counts[:L * E].view(L, E), counts[L * E].clamp(min=1.0)
        cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        sequences = counts[L * E + 1] / cp                         # each row on cp ranks
        counts = per_layer.sum(0)                                  # (E,) over the layers
        prob = torch.stack(self.prob_sums).sum(0)                 # (E,) this rank's rows
        aux_share = E * (counts / rows * prob / rows).sum()
        z_share = torch.stack(self.z_sums).sum() / rows
        seq_share = (self.seq.share(sequences, cp_group) if self.seq is not None
                     else self.carried_seq if self.carried_seq is not None
                     else z_share.new_zeros(()))
        values = torch.stack([aux_share.detach(), z_share.detach(), seq_share.detach()])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
        share = aux_coef * aux_share + z_coef * z_share + seq_coef * seq_share
        return RouterLosses(share, values[0], values[1], counts, per_layer, values[2])

    def pack_share(self, z_coef: float, step_rows: float):
        """Dynamic CP, no collective: (this pack's z-loss share z_coef z_r / R with R =
        step_rows, the step's rows over every rank and pack; its statistics (E + 2 + L E,)
        detached: [probability sums (E), z sum, rows, counts per layer (L E)])."""
        z = torch.stack(self.z_sums).sum()
        summary = torch.cat([torch.stack(self.prob_sums).sum(0).detach(), z.detach().view(1),
                             z.new_tensor([self.rows]),
                             torch.stack(self.layer_counts).reshape(-1)])
        return z_coef * z / step_rows, summary


def step_values(summary: torch.Tensor, num_experts: int):
    """From pack_share's summaries summed over the step's packs and ranks: (load-balancing
    loss A, z-loss, assignments per expert (E,), per layer (L, E)), exactly the values
    ``losses`` gives for the step's tokens as one batch."""
    E = num_experts
    prob, z, rows = summary[:E], summary[E], summary[E + 1].clamp(min=1.0)
    per_layer = summary[E + 2:].view(-1, E)
    counts = per_layer.sum(0)
    return E * (counts / rows * prob / rows).sum(), z / rows, counts, per_layer


def moe_metrics(aux: torch.Tensor, counts: torch.Tensor) -> dict:
    """The metrics line's MoE fields: the step's load-balancing, z and sequence-level losses
    (unweighted, the mean over its micro-batches) and the routed assignments per expert,
    max over mean."""
    return {"moe_aux_loss": aux[0].item(), "moe_z_loss": aux[1].item(),
            "moe_seq_aux_loss": aux[2].item(),
            "moe_expert_load": (counts.max() / counts.mean().clamp(min=1)).item()}
