"""The no-cache reference that cached and CP decoding are held to.

    tokens, logits = reference_generate(model, prompts, new)     # (B, new, V) logits

``model(tokens, positions) -> logits`` on one process (any language model with that call).
"""
from __future__ import annotations

import torch

from ctxpar.inference import SamplingParams, sample

MIN_GAP = 1e-3  # greedy parity needs top-1 above top-2 by far more than the tolerance


@torch.no_grad()
def reference_generate(model, prompts, new, sampling=SamplingParams(), min_gap=MIN_GAP):
    """Tokens and per-step logits (B, V) from full forwards of each row, no cache.

    Greedy: asserts each step's top-1 logit leads by more than min_gap (so parity with it
    cannot hinge on rounding)."""
    seqs = [list(p) for p in prompts]
    gen, steps = sampling.generator(), []
    for _ in range(new):
        logits = torch.stack([model(torch.tensor([s]), torch.arange(len(s)))[0, -1]
                              for s in seqs])                              # (B, V)
        if sampling.greedy:
            top2 = logits.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > min_gap, "near-tie: parity would hinge on rounding"
        nxt = sample(logits, sampling, gen)
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)
        steps.append(logits)
    return [s[len(p):] for s, p in zip(seqs, prompts)], torch.stack(steps)
