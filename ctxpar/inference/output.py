"""What a generation returns and reads: the output record, the last prompt position's hidden
state gathered over CP, the full-vocabulary logits gathered over TP (generation.py's
cached decode and recompute.py's full forwards share them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from ..tensor_parallel import gather_from_tensor_model_parallel_region
from .cp_ops import group_rank_and_size
from .kv_cache import KVCache
from .sampling import sample


@dataclass
class GenerationOutput:
    tokens: List[List[int]]
    """Per prompt, the new tokens (stopped before EOS, or at max_new_tokens)."""
    logits: List[torch.Tensor] = field(default_factory=list)
    """With keep_logits: per step, the full-vocabulary fp32 logits (B, V) it sampled from."""
    cache: Optional[KVCache] = None
    """This rank's cache after the last step (sizes and bytes moved, for tests/benchmarks)."""
    prefill_s: float = 0.0
    """Seconds to the first new token (prefill and its sampling; host-synchronised there)."""
    decode_s: float = 0.0
    """Seconds of the decode steps after it."""
    decode_steps: int = 0
    """Decode forwards run (each feeds one token per row)."""

    def take(self, logits: torch.Tensor, sampling, generator, eos_id: Optional[int],
             done: torch.Tensor, keep_logits: bool = False) -> torch.Tensor:
        """One step's tokens (B,) sampled from logits (B, V): each row not done keeps its
        token unless it is EOS, which marks the row done (in place)."""
        if keep_logits:
            self.logits.append(logits)
        nxt = sample(logits, sampling, generator)                         # (B,)
        hit = nxt == eos_id if eos_id is not None else torch.zeros_like(done)
        for b in torch.nonzero(~done & ~hit).flatten().tolist():  # a host sync point
            self.tokens[b].append(int(nxt[b]))
        done |= hit
        return nxt


def full_logits(model, x: torch.Tensor, tp_group) -> torch.Tensor:
    """Hidden states (B, d) -> full-vocabulary fp32 logits (B, V), the same on every TP rank."""
    logits = model.lm_logits(x.unsqueeze(1))                             # (B, 1, V/tp)
    return gather_from_tensor_model_parallel_region(logits, tp_group)[:, 0].float()


def last_prompt_hidden(x: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                       cp_group) -> torch.Tensor:
    """The hidden state at each row's last prompt position: (B, T/cp, d) -> (B, d).

    One CP rank holds position len_b - 1 of row b; the others contribute zeros to a sum
    over CP, so every rank gets that rank's values exactly.
    """
    hit = positions.unsqueeze(0) == (lengths - 1).unsqueeze(1)           # (B, T/cp)
    rows = torch.arange(x.shape[0], device=x.device)
    last = torch.where(hit.any(1, keepdim=True), x[rows, hit.int().argmax(1)],
                       torch.zeros((), dtype=x.dtype, device=x.device))  # (B, d)
    if group_rank_and_size(cp_group)[1] > 1:
        dist.all_reduce(last, group=cp_group)
    return last
