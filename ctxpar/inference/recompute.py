"""Generation without a decode cache: every new token reruns the sequence through the CP forward.

    out = generate_by_recompute(model, prompts, 32, layout="zigzag", cp_group=g, ...)

For models whose layers have no decode cache yet (DeepSeek-V4's compressed attention:
its compressors' partial windows and entries would be the cache; models/compressed_attention.py).
Each step right-pads every row (prompt and the tokens generated so far) to a common
length the layout's chunks divide, runs the model's training forward over the CP group
(the same ring, compressors and indexer as training: exact), and samples each row's next
token from the hidden state at its last position (output.last_prompt_hidden). Right
padding is exact: a real token never sees a later position, so never a pad (a compressed
entry becomes visible only after its window ends). The cost is one full forward per
new token (transformers' ``use_cache=False``), which is what generate.py says at start.
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch

from .cp_ops import group_rank_and_size, num_chunks, sequence_positions, shard_sequence
from .output import GenerationOutput, full_logits, last_prompt_hidden
from .sampling import SamplingParams


def needs_recompute(model) -> bool:
    """Whether the model's layers have no decode cache (DeepSeek-V4's attention)."""
    return getattr(model.cfg, "compressed_attention", None) is not None


def min_slab(model) -> int:
    """The fewest tokens a rank's slab may hold for the model's compressed layers over CP:
    twice the largest compression rate (CSA's overlapping windows reach 2m back)."""
    ca = getattr(model.cfg, "compressed_attention", None)
    return 2 * max(ca.compress_rates.values(), default=1) if ca is not None else 1


def generate_by_recompute(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                          layout: str = "contiguous", cp_group=None, tp_group=None,
                          sampling: SamplingParams = SamplingParams(),
                          eos_id: Optional[int] = None, keep_logits: bool = False,
                          pad_id: int = 0):
    """generation.generate's output (tokens, logits, times; no cache) by full forwards."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    cp = group_rank_and_size(cp_group)[1]
    chunks = num_chunks(cp, layout)
    rows = [list(p) for p in prompts]
    generator = sampling.generator(device)
    out = GenerationOutput(tokens=[[] for _ in rows])
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        lengths = torch.tensor([len(r) for r in rows], device=device)           # (B,)
        floor = chunks * min_slab(model) if cp > 1 else 1
        t_pad = max(math.ceil(int(lengths.max()) / chunks) * chunks, floor)
        tokens = torch.full((len(rows), t_pad), pad_id, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            tokens[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        positions = sequence_positions(t_pad, cp_group, layout, device)           # (T/cp,)
        x = model.hidden_states(shard_sequence(tokens, 1, cp_group, layout), positions)
        logits = full_logits(model, last_prompt_hidden(x, positions, lengths, cp_group),
                             tp_group)
        nxt = out.take(logits, sampling, generator, eos_id, done, keep_logits)  # (B,)
        for b, r in enumerate(rows):
            r.append(int(nxt[b]))
        if step == 0:
            out.prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
        else:
            out.decode_steps += 1
        if bool(done.all()):
            break
    out.decode_s = time.perf_counter() - t0
    return out
