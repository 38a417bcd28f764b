"""DeepSeek's sequence-level balance loss, exact when a sequence is split over CP ranks.

DeepSeek-V3 (eqs. 17-20), per sequence of T tokens and per MoE layer, k of E experts:

    s'_t,e = s_t,e / sum_e' s_t,e'     each token's scores normalised (sigmoid or softmax)
    f_e    = E / (k T) * c_e           c_e: the sequence's tokens choosing e (no gradient)
    P_e    = (1/T) sum_t s'_t,e
    L_seq  = sum_e f_e P_e

averaged over the micro-batch's sequences and summed over the MoE layers (DeepSeek's
MoEGate adds each layer's), times model.moe.seq_aux_loss_coef. A sequence is a sample row:
the documents packed in a row are one sequence, as in DeepSeek's code (its bsz rows).

Under CP a row's T tokens sit on the ranks of its CP group: c_e and T are all-reduced over
CP (counts, no gradient) and each rank keeps the differentiable share sum_e f_e P_e,r (P
over its own tokens), whose sum over the CP ranks is L_seq. Over DP each rank holds whole
rows. Divided by S, the micro-batch's sequences on every rank, the shares of all DP x CP
ranks sum to the mean of L_seq over the sequences, and their gradients, summed by the usual
reduction, are its gradient (as aux.py's shares).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .router import router_scores


class SequenceBalance:
    """Each MoE layer's per-row counts and normalised score sums of one forward pass."""

    def __init__(self, num_experts: int, score: str):
        self.num_experts, self.score = num_experts, score
        self.counts: List[torch.Tensor] = []      # per layer (B, E), this rank's tokens
        self.score_sums: List[torch.Tensor] = []  # per layer (B, E), differentiable
        self.tokens, self.top_k = 0, 1            # per row on this rank (T/cp); k

    def add(self, logits: torch.Tensor, experts: torch.Tensor, batch: int) -> None:
        """One layer's fp32 logits (B T/cp, E) and chosen experts (B T/cp, k), B rows."""
        E, k = self.num_experts, experts.shape[1]
        s = router_scores(logits, self.score)
        s = s / s.sum(dim=-1, keepdim=True)                        # (B T/cp, E)
        self.score_sums.append(s.view(batch, -1, E).sum(dim=1))    # (B, E)
        chosen = experts.reshape(batch, -1)                        # (B, T/cp k)
        self.counts.append(torch.zeros(batch, E, device=logits.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=logits.device)))
        self.tokens, self.top_k = chosen.shape[1] // k, k

    def share(self, sequences: torch.Tensor, cp_group=None) -> torch.Tensor:
        """This rank's share of the mean over the S = sequences rows (collective over
        cp_group): sum over layers and rows of sum_e f_e P_e,r, over S."""
        E, L = self.num_experts, len(self.counts)
        counts = torch.stack(self.counts)                          # (L, B, E)
        flat = torch.cat([counts.reshape(-1), counts.new_tensor([self.tokens])])
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(flat, group=cp_group)
        T = flat[-1]                                               # the rows' whole length
        f = E / (self.top_k * T) * flat[:-1].view(L, -1, E)         # (L, B, E)
        P = torch.stack(self.score_sums) / T                       # (L, B, E) my tokens'
        return (f * P).sum() / sequences
