"""Cross entropy over vocab-split logits, never gathering the full vocabulary (Megatron).

With logits split as z = [z_1 … z_p] over TP and a target t:

    loss = log sum_j exp(z_j - m) - (z_t - m),   m = max_j z_j

m is all-reduced with MAX; the target logit z_t (non-zero on the one rank owning t) and
the local sums of exp are all-reduced together with SUM. The gradient is
softmax(z)_i - 1[i = t] on each rank's own slice, so backward needs no communication.
Targets equal to ``ignore_index`` give loss 0 and gradient 0.

The two steps are written once here (``softmax_stats``, ``softmax_grad_``) and shared with
the tiled loss (ctxpar/memory/tiled_loss.py), which applies them one tile of tokens at a time.
The tiled loss takes each tile's statistics on this rank's slice alone
(``local_softmax_stats``) and combines the whole call's rows over TP at once
(``reduce_softmax_stats``): two all-reduces per call instead of two per tile.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import torch.distributed as dist

from .mappings import tp_rank_of, tp_size_of

IGNORE_INDEX = -100  # torch's convention: labels to leave out of the loss and its count


class TargetColumns(NamedTuple):
    """Where each token's target sits in this rank's vocabulary slice; all shaped like target."""
    local_t: torch.Tensor  # int64: the target's column on this rank (0 where not mine)
    mine: torch.Tensor     # bool: counted and owned by this rank
    valid: torch.Tensor    # bool: target != ignore_index


def target_columns(target: torch.Tensor, vocab_per_rank: int, group,
                   ignore_index: int = IGNORE_INDEX) -> TargetColumns:
    """Global vocabulary ids (...) -> their columns in rank r's slice [r*V/tp, (r+1)*V/tp)."""
    valid = target != ignore_index
    local_t = target - tp_rank_of(group) * vocab_per_rank
    mine = valid & (local_t >= 0) & (local_t < vocab_per_rank)
    return TargetColumns(local_t.masked_fill(~mine, 0), mine, valid)


class SoftmaxStats(NamedTuple):
    exp_z: torch.Tensor    # (..., V/tp) fp32: exp(z - m), the softmax numerator
    sum_exp: torch.Tensor  # (...) fp32: sum over the whole vocabulary (all TP ranks)
    z_max: torch.Tensor    # (...) fp32: m, the max over the whole vocabulary
    loss: torch.Tensor     # (...) fp32: log sum exp(z - m) - (z_t - m), 0 where ignored
    cols: TargetColumns


def softmax_stats(logits: torch.Tensor, target: torch.Tensor, group,
                  ignore_index: int = IGNORE_INDEX, inplace: bool = False) -> SoftmaxStats:
    """The forward of the vocab-parallel loss with its two TP all-reduces (module docstring).

    logits (..., V/tp) any float dtype, target (...) global ids. fp32 by type promotion in
    one pass: no separate fp32 copy of bf16 logits. ``inplace`` lets fp32 logits become
    exp_z (the caller's own scratch tile); otherwise the caller's logits are untouched.
    """
    cols = target_columns(target, logits.shape[-1], group, ignore_index)
    z_max = logits.max(dim=-1).values.float()  # (...); the cast of a max is exact
    if tp_size_of(group) > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    if inplace and logits.dtype == torch.float32:
        z = logits.sub_(z_max.unsqueeze(-1))
    else:
        z = logits - z_max.unsqueeze(-1)
    z_t = z.gather(-1, cols.local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~cols.mine, 0.0)
    exp_z = z.exp_()  # (..., V/tp)
    both = torch.stack([z_t, exp_z.sum(dim=-1)])  # (2, ...): one all-reduce for both
    if tp_size_of(group) > 1:
        dist.all_reduce(both, group=group)
    z_t, sum_exp = both[0], both[1]
    loss = (torch.log(sum_exp) - z_t).masked_fill(~cols.valid, 0.0)  # (...)
    return SoftmaxStats(exp_z, sum_exp, z_max, loss, cols)


class LocalStats(NamedTuple):
    """One rank's statistics over its own vocabulary slice; all (...) fp32."""
    z_max: torch.Tensor    # max of this slice's logits
    sum_exp: torch.Tensor  # sum of exp(z - z_max) over this slice
    z_t: torch.Tensor      # the target logit where this rank owns it, else 0


def local_softmax_stats(logits: torch.Tensor, cols: TargetColumns) -> LocalStats:
    """In place: fp32 logits (..., V/tp) -> exp(z - z_max) of this slice; returns the
    slice's statistics, no communication (the caller reduces them over TP)."""
    z_t = logits.gather(-1, cols.local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~cols.mine, 0.0)
    z_max = logits.max(dim=-1).values
    sum_exp = logits.sub_(z_max.unsqueeze(-1)).exp_().sum(dim=-1)
    return LocalStats(z_max, sum_exp, z_t)


def reduce_softmax_stats(st: LocalStats, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's slice statistics (...) -> (log-sum-exp over the whole vocabulary, the
    target logit), fp32, identical on the TP ranks: an all-reduce MAX of the maxima, then
    one SUM of the rescaled sums and the target logits together."""
    if tp_size_of(group) == 1:
        return st.z_max + torch.log(st.sum_exp), st.z_t
    z_max = st.z_max.clone()
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    both = torch.stack([st.sum_exp * torch.exp(st.z_max - z_max), st.z_t])  # (2, ...)
    dist.all_reduce(both, group=group)
    return z_max + torch.log(both[0]), both[1]


def softmax_grad_(softmax: torch.Tensor, cols: TargetColumns,
                  grad_loss: torch.Tensor) -> torch.Tensor:
    """In place: softmax (..., V/tp) fp32 -> d loss / d z = (softmax - 1[i = t]) * grad_loss,
    0 on ignored tokens. Megatron writes it into the saved softmax too: the full-vocab buffer
    is the largest activation of the model."""
    softmax.scatter_add_(-1, cols.local_t.unsqueeze(-1),
                         -cols.mine.to(softmax.dtype).unsqueeze(-1))
    return softmax.mul_((grad_loss * cols.valid).unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        # logits: (..., V/tp) any float dtype; target: (...) global vocabulary ids.
        ctx.dtype = logits.dtype
        s = softmax_stats(logits, target, group, ignore_index)
        softmax = s.exp_z.div_(s.sum_exp.unsqueeze(-1))  # (..., V/tp) fp32, kept for backward
        ctx.save_for_backward(softmax, *s.cols)
        return s.loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, *cols = ctx.saved_tensors
        grad = softmax_grad_(softmax, TargetColumns(*cols), grad_loss)
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """loss = logsumexp(z) - z_t per token, z split over TP; (..., V/tp), (...) -> (...) fp32."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, ignore_index)
