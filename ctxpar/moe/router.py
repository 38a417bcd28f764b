"""The router's choice: each token's top-k experts and their weights, from its logits.

    softmax   p = softmax(logits) over every expert in fp32; the k largest (Mixtral,
              Qwen-MoE; with norm_topk this is also gpt-oss's softmax over the k logits)
    sigmoid   p = sigmoid(logits) per expert; the k largest (DeepSeek-V3)

norm_topk divides the k weights by their sum (transformers' norm_topk_prob). Weights come
back in fp32; ties go to the lower expert index (torch.topk's order on CPU and CUDA)."""
from __future__ import annotations

from typing import Tuple

import torch


def route(logits: torch.Tensor, top_k: int, score: str = "softmax",
          norm_topk: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) -> (weights (N, k) fp32, experts (N, k) int64)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
