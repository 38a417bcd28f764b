"""The log-sum-exp merge: combine attention over two disjoint key sets into attention over both.

Each pattern that splits a query row's keys into blocks (the ring, all-gather) computes
every block with a kernel that also returns the block's log-sum-exp, then folds it into a
running fp32 (out, lse) pair with ``merge_block_`` (seed 001; ring-flash-attention's
``update_out_and_lse``). The merged pair is exactly softmax attention over the union.
"""
from __future__ import annotations

import logging
from typing import Tuple

import torch

log = logging.getLogger(__name__)


def empty_accumulators(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a row that has seen no key: zeros (B, L, H, D) fp32, -inf (B, H, L) fp32."""
    B, L, H, D = q.shape
    out = torch.zeros(B, L, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def merge_block_eager_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                       block_lse: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-merge of (out, lse) and (block_out, block_lse).

    out (B, L, H, D) fp32, lse (B, H, L) fp32 (may be views into the full accumulators).
    Seed 001 / ring-flash-attention, without exponentiating a raw LSE:
        out <- out - sigmoid(block_lse - lse) * (out - block_out)
        lse <- logaddexp(lse, block_lse)
    logaddexp (not lse - logsigmoid(lse - block_lse)) keeps -inf - -inf out of it, and a
    row where both sides are -inf (no key seen yet) gets weight 0 instead of NaN.
    Eager, this is ~7 elementwise kernels and, for a 16-bit block, a full fp32 copy of it.
    """
    block_lse = block_lse.float()
    w = torch.sigmoid(block_lse - lse).nan_to_num_(nan=0.0)  # (B, H, L)
    out.lerp_(block_out.float(), w.transpose(1, 2).unsqueeze(-1))  # out + w * (block - out)
    lse.copy_(torch.logaddexp(lse, block_lse))


_compiled = None  # torch.compile of the eager merge: built on first CUDA use


def merge_block_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    """The merge above; on CUDA fused into one kernel by torch.compile (same fp32 math, the
    block upcast inside the kernel). On CPU the eager merge: measured faster there
    (docs/benchmarks.md: inductor's CPU code for it was 3-5x slower than eager)."""
    global _compiled
    if not out.is_cuda or _compiled is False:
        return merge_block_eager_(out, lse, block_out, block_lse)
    if _compiled is None:
        _compiled = torch.compile(merge_block_eager_, fullgraph=True)
    try:
        _compiled(out, lse, block_out, block_lse)
    except Exception as e:  # no triton, no compiler: say so once, then merge eagerly
        log.warning("fused LSE merge unavailable, merging eagerly (%s: %s)",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _compiled = False
        merge_block_eager_(out, lse, block_out, block_lse)
