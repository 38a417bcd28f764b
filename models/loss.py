"""The loss as the mean over every token of the global batch, under DeepSpeed's reduction.

Each rank has S_r, the sum of its token losses (already complete over TP: the
vocab-parallel loss all-reduces inside), and n_r, its count of labels != -100. The loss to
optimise is the global token mean  L = sum_r S_r / N,  N = sum_r n_r  over DP x CP (and
over the micro-batches of one optimizer step) -- not a mean of per-rank means, which would
weight a rank's tokens by 1/n_r.

DeepSpeed (mpu with get_sequence_data_parallel_*; see ctxpar/distributed/mpu.py) scales the
loss by 1/gas in engine.backward, sums gradients over the micro-batches, all-reduces them over
DP x CP and divides by dp (ZeRO 0-2; ZeRO-3 and the pipeline divide by dp x cp, and then
dp x cp replaces dp below: ctxpar/distributed/zero.py). So with

    L_r = S_r * dp * gas / N                                   (loss_for_backward)

the gradient it applies is (1/dp) sum_{dp,cp} sum_m (1/gas) dL_r/dθ = sum dS_r/dθ / N = dL/dθ.
N is the same number on every rank (one all-reduce of label counts), so the scaling is a
constant and a rank whose tokens are all ignored contributes S_r = 0 and no NaN.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ctxpar.tensor_parallel.cross_entropy import IGNORE_INDEX


def count_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """n_r: this rank's labels that count (fp32 scalar)."""
    return (labels != ignore_index).sum().to(torch.float32)


def global_token_count(labels: torch.Tensor, dp_cp_group=None,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """N = sum of n_r over DP x CP (TP ranks hold the same labels, so TP is not summed).

    With gradient accumulation, add the N of every micro-batch of the step before calling
    loss_for_backward: N must be the count over the whole optimizer step.
    """
    n = count_tokens(labels, ignore_index)
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        dist.all_reduce(n, group=dp_cp_group)
    return n


def loss_for_backward(loss_sum: torch.Tensor, n_tokens: torch.Tensor, divisor: int,
                      grad_accum_steps: int = 1) -> torch.Tensor:
    """L_r = S_r * divisor * gas / N: what to hand engine.backward (the module docstring).

    divisor is what DeepSpeed divides the gradients summed over dp x cp by
    (``ctxpar.distributed.zero.grad_divisor``): dp for ZeRO 0-2 without a pipeline; dp x cp
    for ZeRO-3 and for the pipeline engine (models/gpt_pipe.py), which average over dp x cp.
    """
    return loss_sum * (divisor * grad_accum_steps) / n_tokens.clamp(min=1.0)


@torch.no_grad()
def global_mean_loss(loss_sum: torch.Tensor, n_tokens: torch.Tensor,
                     dp_cp_group=None) -> torch.Tensor:
    """sum_r S_r / N over DP x CP: the true token-mean loss, the same on every rank (logging)."""
    total = loss_sum.detach().to(torch.float32).clone()
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        dist.all_reduce(total, group=dp_cp_group)
    return total / n_tokens.clamp(min=1.0)


def deepspeed_style_reduce_(params, dp_cp_group, dp_size: int) -> None:
    """What DeepSpeed does to gradients without ZeRO: all-reduce over DP x CP, divide by dp.

    For tests and for running without DeepSpeed (summed over CP, averaged over DP).
    """
    for p in params:
        if p.grad is None:
            continue
        if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
            dist.all_reduce(p.grad, group=dp_cp_group)
        p.grad.div_(dp_size)
