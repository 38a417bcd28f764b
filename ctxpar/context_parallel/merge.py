"""The log-sum-exp merge: combine attention over two disjoint key sets into attention over both.

Each pattern that splits a query row's keys into blocks (the ring, all-gather) computes
every block with a kernel that also returns the block's log-sum-exp, then folds it into a
running fp32 (out, lse) pair with ``merge_block_`` (seed 001; ring-flash-attention's
``update_out_and_lse``). The merged pair is exactly softmax attention over the union.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

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


class FusedMerge:
    """The eager merge compiled by torch.compile into one kernel (same fp32 math, the block
    upcast inside the kernel), or the eager merge where it cannot be.

    Every (block length, batch, dtype, stride) a run meets is a configuration dynamo may
    compile. dynamic=True: block lengths and strides are symbolic from the first call, so
    what recompiles is the dtype and a dimension of size 1 (a handful per run). Not
    fullgraph: past dynamo's recompile limit (8 unless this torch takes a limit per call,
    then 64) a new configuration runs eagerly while the compiled ones keep running.
    (fullgraph=True made the limit an error, and that error turned the merge eager for
    the rest of the process.) A compiler that fails before its first success (no triton,
    no C++ compiler) makes the merge eager for good, said once.
    """

    def __init__(self, backend: str = "inductor", recompile_limit: int = 64):
        import inspect
        kw = dict(dynamic=True, backend=backend)
        if "recompile_limit" in inspect.signature(torch.compile).parameters:  # newer torch
            kw["recompile_limit"] = recompile_limit
        self.fn = torch.compile(merge_block_eager_, **kw)
        self.worked = False      # a call went through the compiled function
        self.disabled = False    # the compiler failed before any success: eager from now on
        self.failures = 0        # calls that fell back to eager after a success

    def __call__(self, out, lse, block_out, block_lse) -> None:
        if self.disabled:
            return merge_block_eager_(out, lse, block_out, block_lse)
        try:
            self.fn(out, lse, block_out, block_lse)
            self.worked = True
        except torch.OutOfMemoryError:
            raise  # the run is out of memory, not the compiler out of luck
        except Exception as e:  # compilation fails before anything is written
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if not self.worked:
                self.disabled = True
                log.warning("fused LSE merge unavailable, merging eagerly (%s)", why)
            else:
                if not self.failures:
                    log.warning("fused LSE merge failed on a new shape or dtype, merging it "
                                "eagerly (%s); the compiled ones stay in use", why)
                self.failures += 1
            merge_block_eager_(out, lse, block_out, block_lse)


_fused: Optional[FusedMerge] = None  # built on the first CUDA merge


def merge_block_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    """The merge above; on CUDA fused into one kernel (FusedMerge). On CPU the eager merge:
    measured faster there (docs/benchmarks.md: inductor's CPU code for it was 3-5x slower
    than eager)."""
    global _fused
    if not out.is_cuda:
        return merge_block_eager_(out, lse, block_out, block_lse)
    if _fused is None:
        _fused = FusedMerge()
    _fused(out, lse, block_out, block_lse)
