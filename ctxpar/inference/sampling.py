"""Picking the next token from full-vocabulary logits: greedy, temperature, top-k, top-p.

Every rank of a TP x CP group holds the same full logits (bit-identical: the CP merge and
the TP gather give every rank the same values) and draws with its own generator seeded
identically, so every rank draws the same token with no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy (argmax, the lowest id among equal maxima); > 0 scales the logits."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1 = all)."""
    seed: int = 0
    """Seed of the sampling generator (the same on every rank)."""

    def check(self) -> None:
        """ValueError naming the option, for generate.py's one-line errors."""
        if not (self.temperature >= 0.0):
            raise ValueError(f"--temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k} must be >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device=None) -> Optional[torch.Generator]:
        if self.greedy:
            return None
        return torch.Generator(device=device or "cpu").manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, V) with the tokens outside top-k and outside the top-p nucleus at -inf.

    Nucleus (Holtzman et al. 2020): sort by probability, keep a token while the mass of
    the tokens before it is < top_p, so the most likely token always stays.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]            # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs                       # mass ahead of each
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids (B,) int64 from full-vocabulary logits (B, V)."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
