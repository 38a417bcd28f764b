"""Cross entropy over vocab-split logits, never gathering the full vocabulary (Megatron).

With logits split as z = [z_1 … z_p] over TP and a target t:

    loss = log sum_j exp(z_j - m) - (z_t - m),   m = max_j z_j

m is all-reduced with MAX; the target logit z_t (non-zero on the one rank owning t) and
the local sums of exp are all-reduced together with SUM. The gradient is
softmax(z)_i - 1[i = t] on each rank's own slice, so backward needs no communication.
Targets equal to ``ignore_index`` give loss 0 and gradient 0.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import tp_rank_of, tp_size_of

IGNORE_INDEX = -100  # torch's convention: labels to leave out of the loss and its count


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        # logits: (..., V/tp) any float dtype; target: (...) global vocabulary ids.
        ctx.dtype = logits.dtype
        vocab_per_rank, rank, tp = logits.shape[-1], tp_rank_of(group), tp_size_of(group)

        z_max = logits.max(dim=-1).values.float()  # (...); the cast of a max is exact
        if tp > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        # fp32 by type promotion, in one pass: no separate fp32 copy of bf16 logits. A new
        # tensor: the caller's logits are untouched.
        z = logits - z_max.unsqueeze(-1)

        valid = target != ignore_index
        local_t = target - rank * vocab_per_rank
        mine = valid & (local_t >= 0) & (local_t < vocab_per_rank)
        local_t = local_t.masked_fill(~mine, 0)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)

        exp_z = z.exp_()  # (..., V/tp), reused as the softmax numerator
        both = torch.stack([z_t, exp_z.sum(dim=-1)])  # (2, ...): one all-reduce for both
        if tp > 1:
            dist.all_reduce(both, group=group)
        z_t, sum_exp = both[0], both[1]

        loss = (torch.log(sum_exp) - z_t).masked_fill(~valid, 0.0)  # (...)
        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        # d loss / d z_i = softmax_i - 1[i = t]; written into the saved softmax (Megatron
        # does the same: the full-vocab buffer is the largest activation of the model).
        grad = softmax
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """loss = logsumexp(z) - z_t per token, z split over TP; (..., V/tp), (...) -> (...) fp32."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, ignore_index)
