"""What the parity tests share around a model: a seeded random batch, and an optimizer that
keeps the gradients it is handed (after DeepSpeed's reductions) for the test to compare."""
from __future__ import annotations

import torch


def random_batch(vocab: int, batch: int, n: int, seed: int = 11):
    """(tokens, labels) (batch, n) of random ids below vocab, a fifth of the labels -100
    (ignored), the same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    labels = torch.randint(0, vocab, (batch, n), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return tokens, labels


class RecordingSGD(torch.optim.SGD):
    """SGD keeping the gradients its step is handed (``grads``, by parameter)."""

    def step(self, closure=None):
        self.grads = {p: p.grad.detach().clone() for g in self.param_groups
                      for p in g["params"] if p.grad is not None}
        return super().step(closure)
