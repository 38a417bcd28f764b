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
The z-loss (mean over rows of logsumexp(logits)^2) splits the same way. ``losses`` returns
each rank's share for backward and the global values for the metrics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist


@dataclass
class RouterLosses:
    share: torch.Tensor        # this rank's differentiable share (sum over ranks = total)
    aux_loss: torch.Tensor     # the load-balancing loss A of the whole batch (unweighted)
    z_loss: torch.Tensor       # the z-loss of the whole batch (unweighted)
    tokens_per_expert: torch.Tensor  # (E,) assignments over the batch and layers


class RouterStats:
    """What each MoE layer of one forward pass adds (its logits and chosen experts)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.counts = None             # (E,) fp32 assignments, this rank
        self.prob_sums: List[torch.Tensor] = []   # per layer (E,), differentiable
        self.z_sums: List[torch.Tensor] = []      # per layer (), differentiable
        self.rows = 0

    def add(self, logits: torch.Tensor, experts: torch.Tensor) -> None:
        """One layer's router logits (N, E) and its chosen experts (N, k)."""
        logits = logits.float()
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).float()
        self.counts = counts if self.counts is None else self.counts + counts
        self.prob_sums.append(torch.softmax(logits, dim=-1).sum(dim=0))
        self.z_sums.append(torch.logsumexp(logits, dim=-1).square().sum())
        self.rows += logits.shape[0]

    def packed(self, carried: torch.Tensor) -> torch.Tensor:
        """carried (2E + 2,) fp32 [probability sums (E), z sum, counts (E), rows] of an
        earlier pipeline stage's layers (zeros on the first) plus this forward's: what a
        stage hands on with its activations, so the last stage's loss sees every layer's
        (the first E + 1 entries carry the routers' gradients back; counts and rows none)."""
        if self.rows == 0:  # no MoE layer ran
            return carried
        own = torch.cat([torch.stack(self.prob_sums).sum(0),
                         torch.stack(self.z_sums).sum().view(1),
                         self.counts.detach(), self.counts.new_tensor([self.rows])])
        return carried + own

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_experts: int) -> "RouterStats":
        """The RouterStats of every layer a packed tensor has summed (``losses`` works on
        it as on the layers' own)."""
        E, stats = num_experts, cls(num_experts)
        stats.prob_sums, stats.z_sums = [packed[:E]], [packed[E]]
        stats.counts, stats.rows = packed[E + 1:2 * E + 1].detach(), float(packed[-1].detach())
        return stats

    def losses(self, aux_coef: float, z_coef: float, group=None) -> RouterLosses:
        """Collective over `group` (the ranks holding the batch's tokens: DP x CP): the
        weighted share aux_coef a_r + z_coef z_r and the global values."""
        E = self.num_experts
        counts = torch.cat([self.counts, self.counts.new_tensor([self.rows])])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        counts, rows = counts[:E], counts[E].clamp(min=1.0)
        prob = torch.stack(self.prob_sums).sum(0)                 # (E,) this rank's rows
        aux_share = E * (counts / rows * prob / rows).sum()
        z_share = torch.stack(self.z_sums).sum() / rows
        values = torch.stack([aux_share.detach(), z_share.detach()])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
        return RouterLosses(aux_coef * aux_share + z_coef * z_share, values[0], values[1],
                            counts)
