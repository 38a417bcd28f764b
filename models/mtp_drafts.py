"""Greedy decoding with model.mtp's depths as the draft (speculative decoding, as serving
engines use DeepSeek-V3's and Qwen3.5's MTP layers): each step verifies up to D drafted
tokens in one CP forward of the main model and drafts the next D with the MTP depths.

    out = generate_with_mtp_drafts(model, prompt, max_new_tokens, layout=..., cp_group=...,
                                   tp_group=..., eos_id=...)
    out.tokens, out.accepted   # the new tokens; drafts accepted at each step

A step, known tokens s (n of them) and drafts d_1..d_m:

    forward      s + drafts, right-padded to the layout's chunk count, through the main
                 model (no cache: every step is a prefill, exact under any layout)
    verify       y_j = argmax at position n-1+j; d_j is accepted while d_j == y_{j-1};
                 a accepted -> y_0..y_a are emitted (a + 1 tokens: the main model's own
                 choices, so the output is plain greedy decoding's)
    draft        depth k at position n+a-1 (the last position whose input is known) takes
                 the id t_{n+a+k-1} (y_a, then the previous depth's draft) and predicts
                 t_{n+a+k}: D block passes over the sequence (causal: the positions after
                 n+a-1 change nothing there)

Every step holds the whole sequence (no KV cache): O(n) per step, for measuring the drafts'
acceptance and checking exactness, not for speed. One prompt at a time (as transformers'
assisted decoding); greedy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from ctxpar.config import rotary_dim
from ctxpar.inference.cp_ops import num_chunks, sequence_positions, shard_sequence
from ctxpar.inference.cp_ops import group_rank_and_size
from ctxpar.inference.generation import check_prompts, full_logits, last_prompt_hidden

from .gpt import embed_tokens


@dataclass
class DraftOutput:
    tokens: List[int]
    """The new tokens (stopped before EOS, or at max_new_tokens)."""
    accepted: List[int] = field(default_factory=list)
    """Per step, how many of its drafts the main model accepted (0..D)."""
    used: List[int] = field(default_factory=list)
    """Per step, the accepted drafts that became output (max_new_tokens or EOS may cut
    some)."""

    @property
    def tokens_per_step(self) -> float:
        """New tokens per main-model forward (1 without drafts)."""
        return len(self.tokens) / max(len(self.accepted), 1)


def _hidden_at(x: torch.Tensor, positions: torch.Tensor, at: int, cp_group) -> torch.Tensor:
    """(B, T/cp, d) -> (B, d): the hidden state at global position `at` (one rank holds it)."""
    lengths = torch.full((x.shape[0],), at + 1, device=x.device)
    return last_prompt_hidden(x, positions, lengths, cp_group)


@torch.no_grad()
def generate_with_mtp_drafts(model, prompt: Sequence[int], max_new_tokens: int, *,
                             layout: str = "contiguous", cp_group=None, tp_group=None,
                             eos_id: Optional[int] = None,
                             max_positions: Optional[int] = None) -> DraftOutput:
    """Greedy new tokens for one prompt with MTP drafts (module docstring); collective over
    the TP x CP group, the same on every rank."""
    if model.mtp is None:
        raise ValueError("--draft mtp: the model has no MTP layers (model.mtp is null)")
    check_prompts([prompt], max_new_tokens, max_positions, model.cfg.vocab_size)
    device = next(model.parameters()).device
    chunks = num_chunks(group_rank_and_size(cp_group)[1], layout)
    depth, rot = model.cfg.mtp.depth, rotary_dim(model.cfg)
    seq, drafts, out = list(prompt), [], DraftOutput([])
    while len(out.tokens) < max_new_tokens:
        n = len(seq)
        full = seq + drafts
        t_pad = math.ceil(len(full) / chunks) * chunks
        tokens = torch.zeros((1, t_pad), dtype=torch.long, device=device)
        tokens[0, :len(full)] = torch.tensor(full, dtype=torch.long)
        positions = sequence_positions(t_pad, cp_group, layout, device)       # (T_pad/cp,)
        x = model.hidden_states(shard_sequence(tokens, 1, cp_group, layout), positions)
        # verify: the main model's choice after each known token and each draft
        ys = [int(full_logits(model, _hidden_at(x, positions, n - 1 + j, cp_group),
                              tp_group).argmax(-1)) for j in range(len(drafts) + 1)]
        a = 0
        while a < len(drafts) and drafts[a] == ys[a]:
            a += 1
        emitted = ys[:a + 1]
        stop, before = False, len(out.tokens)
        for y in emitted:
            if (eos_id is not None and y == eos_id) or len(out.tokens) == max_new_tokens:
                stop = True
                break
            out.tokens.append(y)
        out.accepted.append(a)
        # the drafts that became output (the budget or EOS may cut the accepted ones)
        out.used.append(max(0, min(a, len(out.tokens) - before - 1)))
        seq = seq + emitted
        if stop or len(out.tokens) >= max_new_tokens:
            break
        # draft: depth k at position last = n + a - 1, chained over the whole sequence
        last, drafts, h = n + a - 1, [], x
        for k in range(depth):
            known = seq + drafts                           # ids up to t_{last + k + 1}
            ids = torch.zeros((1, t_pad), dtype=torch.long, device=device)
            ahead = known[k + 1:last + k + 2]              # t_{i+k+1} for i = 0..last
            ids[0, :len(ahead)] = torch.tensor(ahead, dtype=torch.long)
            e = embed_tokens(model.embed, shard_sequence(ids, 1, cp_group, layout), model.cfg)
            h = model.mtp.depth_hidden(k, h, e, positions, rot)
            drafts.append(int(full_logits(model, _hidden_at(h, positions, last, cp_group),
                                          tp_group).argmax(-1)))
    return out
