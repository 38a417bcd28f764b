"""The router's choice: each token's top-k experts and their weights, from its logits.

    softmax   p = softmax(logits) over every expert in fp32; the k largest (Mixtral,
              Qwen-MoE; with norm_topk this is also gpt-oss's softmax over the k logits)
    sigmoid   p = sigmoid(logits) per expert; the k largest (DeepSeek-V3)
    sqrtsoftplus  p = sqrt(softplus(logits)) per expert; the k largest (DeepSeek-V4's
              scoring_func)

norm_topk divides the k weights by their sum (transformers' norm_topk_prob). Weights come
back in fp32; ties go to the lower expert index (torch.topk's order on CPU and CUDA).

DeepSeek-V3's choice (transformers' DeepseekV3TopkRouter, the rule of its
``e_score_correction_bias``) is made on p + bias, the weights taken from p without it:

    bias                 (E,) per expert, no gradient: the aux-free balance
                         (``balance_bias_update``) moves it between steps
    n_group, topk_group  group-limited routing: the E experts in n_group groups of
                         consecutive experts, each group scored by the sum of its two best
                         p + bias; the k experts are chosen among the topk_group best groups
    scaling              the k weights times routed_scaling_factor (after norm_topk)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..config.moe import MOE_SCORES


def router_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """p from the fp32 logits (N, E) by the router's score (module docstring)."""
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    if score == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    raise ValueError(f"model.moe.score={score!r} must be one of {', '.join(MOE_SCORES)}")


def route(logits: torch.Tensor, top_k: int, score: str = "softmax", norm_topk: bool = True,
          bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0, experts: Optional[torch.Tensor] = None
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) -> (weights (N, k) fp32, experts (N, k) int64); experts given (a hash
    layer's table lookup, DeepSeek-V4's HashRouter): only their weights are made."""
    logits = logits.float()
    probs = router_scores(logits, score)
    if experts is None:
        choice = probs.detach() if bias is None else probs.detach() + bias.float()
        if n_group > 1:
            choice = _best_groups_only(choice, n_group, topk_group)
        experts = torch.topk(choice, top_k, dim=-1).indices           # (N, k)
    weights = probs.gather(1, experts)                                # (N, k)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * scaling if scaling != 1.0 else weights), experts


def _best_groups_only(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice (N, E) with the experts outside each token's topk_group best groups at -inf
    (a group's score: the sum of its two best choices, as DeepSeek-V3's)."""
    N, E = choice.shape
    groups = choice.view(N, n_group, E // n_group)                    # (N, G, E/G)
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)          # (N, G)
    best = torch.topk(group_scores, topk_group, dim=-1).indices       # (N, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)


@torch.no_grad()
def balance_bias_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balance (Wang et al., "Auxiliary-Loss-Free Load
    Balancing Strategy for Mixture-of-Experts"): after a step, each expert's bias moves by
    rate towards the mean load, bias_e += rate * sign(mean_e' c_e' - c_e), from counts (E,)
    the step's assignments to each expert (the same on every rank: the global batch's)."""
    counts = counts.float()
    bias.add_(rate * torch.sign(counts.mean() - counts).to(bias.dtype))
