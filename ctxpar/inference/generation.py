"""Generation with a CP-sharded KV cache: ring prefill of the prompts, then decode steps.

    out = generate(model, prompts, max_new_tokens=32, layout="zigzag",
                   cp_group=state.cp_group, tp_group=state.tp_group,
                   sampling=SamplingParams(), eos_id=0, max_positions=cfg.model.seq_len)
    out.tokens     # per prompt, the new token ids (up to and without EOS)

Collective over the TP x CP group: every rank passes the same prompts and gets the same
tokens. A batch of prompts of different lengths is right-padded to a common length T_pad
that the layout's chunk count (P, or 2P for zigzag) divides. Padding on the right is exact
with the plain causal ring: a prompt token never sees a later position, so never a pad;
the pad slots are marked invalid in the cache and no decode query sees them. Each row
then decodes at its own positions: row b's i-th new token sits at position len_b + i
(RoPE on global positions, as in training).

Prefill runs the model's own CP attention (the training ring, any layout) on the rank's
layout shard and keeps K,V in the cache; the first new token comes from the hidden state
at each row's last prompt position, which one rank holds (summed over CP with zeros from
the others: exact). A decode step runs the whole model on one token per row, replicated
over CP (split over TP as in training); only attention is CP-sharded (decode.py). A
hybrid model's Gated DeltaNet and Mamba2 layers prefill through their training CP op and
then step recurrently from the state every rank holds (linear_cache.py). A model whose
layers have no decode cache (DeepSeek-V4's compressed attention) generates by full
forwards instead (recompute.py).
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch

from .cp_ops import group_rank_and_size, num_chunks, sequence_positions, shard_sequence
from .kv_cache import KVCache, decode_capacity
from .output import GenerationOutput, full_logits, last_prompt_hidden
from .recompute import generate_by_recompute, needs_recompute
from .sampling import SamplingParams


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  max_positions: Optional[int], vocab_size: Optional[int] = None) -> None:
    """ValueError (one line, naming the prompt) for input generation cannot take."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (it needs at least one token)")
        if vocab_size is not None and max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token id {max(p)} >= model.vocab_size="
                             f"{vocab_size} (a tokenizer the model was not trained with?)")
        # The last new token is never fed back: the model sees len + max_new - 1 positions.
        if max_positions is not None and len(p) + max_new_tokens - 1 > max_positions:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with --max-new-tokens="
                             f"{max_new_tokens} it needs {len(p) + max_new_tokens - 1} "
                             f"positions > model.seq_len={max_positions}, the trained limit")


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             layout: str = "contiguous", cp_group=None, tp_group=None,
             sampling: SamplingParams = SamplingParams(), eos_id: Optional[int] = None,
             max_positions: Optional[int] = None, keep_logits: bool = False,
             pad_id: int = 0) -> GenerationOutput:
    """New tokens for every prompt (lists of ids); see the module docstring.

    model: a ctxpar.interfaces.CausalLM (models.gpt.GPT is one) built with this cp_group,
    tp_group and layout. Stops a row at
    eos_id (not included) and the batch when every row stopped or after max_new_tokens.
    """
    check_prompts(prompts, max_new_tokens, max_positions, model.cfg.vocab_size)
    if needs_recompute(model):  # no decode cache for its layers: a full forward a token
        return generate_by_recompute(model, prompts, max_new_tokens, layout=layout,
                                     cp_group=cp_group, tp_group=tp_group, sampling=sampling,
                                     eos_id=eos_id, keep_logits=keep_logits, pad_id=pad_id)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    cp = group_rank_and_size(cp_group)[1]
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)      # (B,)
    chunks = num_chunks(cp, layout)
    t_pad = math.ceil(int(lengths.max()) / chunks) * chunks
    tokens = torch.full((B, t_pad), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)

    # Prefill: this rank's layout shard of the padded prompts, through the training ring.
    positions = sequence_positions(t_pad, cp_group, layout, device)     # (T_pad/cp,)
    cache = KVCache.for_model(model, B, decode_capacity(t_pad, max_new_tokens - 1, cp),
                              cp_group)
    cache.begin_prefill(positions.unsqueeze(0) < lengths.unsqueeze(1),   # (B, T_pad/cp)
                        positions, lengths)
    x = model.hidden_states(shard_sequence(tokens, 1, cp_group, layout), positions,
                            kv_cache=cache)                               # (B, T_pad/cp, d)
    logits = full_logits(model, last_prompt_hidden(x, positions, lengths, cp_group), tp_group)

    generator = sampling.generator(device)
    out = GenerationOutput(tokens=[[] for _ in range(B)], cache=cache)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        nxt = out.take(logits, sampling, generator, eos_id, done, keep_logits)  # (B,)
        if step == 0:
            out.prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        # Decode: row b's token at position len_b + step; its K,V kept by one CP rank.
        cache.begin_decode(lengths + step)  # each row's new token's position
        x = model.hidden_states(nxt.unsqueeze(1), (lengths + step).unsqueeze(1),
                                kv_cache=cache)                            # (B, 1, d)
        logits = full_logits(model, x[:, 0], tp_group)
        out.decode_steps += 1
    out.decode_s = time.perf_counter() - t0
    return out
