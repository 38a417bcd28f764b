"""The conjugate communication ops of Megatron tensor parallelism (Shoeybi et al., 2019, §3).

A column-parallel layer needs its input replicated and its input gradient summed; a
row-parallel layer sums its partial outputs and passes the gradient through. Written as
autograd Functions, each pair is conjugate (one op's forward is the other's backward):

    f = copy_to_tensor_model_parallel_region      identity fwd, all-reduce bwd
    g = reduce_from_tensor_model_parallel_region  all-reduce fwd, identity bwd
    scatter_to_tensor_model_parallel_region       split last dim fwd, all-gather bwd
    gather_from_tensor_model_parallel_region      all-gather last dim fwd, split bwd

Every op takes the TP group explicitly and is the identity on a group of one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_size_of(group) -> int:
    """Size of a TP group; None means no TP (1)."""
    return dist.get_world_size(group) if group is not None else 1


def tp_rank_of(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if tp_size_of(group) == 1:
        return x
    x = x.contiguous().clone()  # never reduce into a tensor autograd may still hold
    dist.all_reduce(x, group=group)
    return x


def split_along(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """This rank's chunk of x along dim (x itself when the group has one rank)."""
    size = tp_size_of(group)
    if size == 1:
        return x
    assert x.shape[dim] % size == 0, f"dim {dim} of size {x.shape[dim]} not divisible by tp={size}"
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def gather_along(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """The TP ranks' chunks concatenated along dim (x itself when the group has one rank)."""
    size = tp_size_of(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if inplace and x.is_contiguous():  # the caller's fresh partial sum: no copy
            dist.all_reduce(x, group=group)
            ctx.mark_dirty(x)  # autograd refuses loudly if anything saved x for backward
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.group), None


class _SelectReplicatedRows(torch.autograd.Function):
    """W_r = W[rows of block b(r)] fwd; bwd: dW = sum over TP of the zero-padded dW_r."""

    @staticmethod
    def forward(ctx, weight, n_blocks, group):
        size = tp_size_of(group)
        ctx.group, ctx.n_blocks = group, n_blocks
        # tp ranks share each block: ranks [b*tp/n, (b+1)*tp/n) hold block b.
        ctx.block = dist.get_rank(group) * n_blocks // size if size > 1 else 0
        return weight.chunk(n_blocks, dim=0)[ctx.block]

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(grad.shape[0] * ctx.n_blocks, *grad.shape[1:])
        full.chunk(ctx.n_blocks, dim=0)[ctx.block].copy_(grad)
        return _all_reduce(full, ctx.group), None, None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """f: Y = X in forward; dX = sum over TP of dY in backward."""
    return _CopyToRegion.apply(x, group) if tp_size_of(group) > 1 else x


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group,
                                             inplace: bool = False) -> torch.Tensor:
    """g: Y = sum over TP of X in forward; dX = dY in backward.

    inplace=True reduces into x (a fresh matmul output only the caller holds), as Megatron
    does; the default leaves x untouched and returns a new tensor.
    """
    return _ReduceFromRegion.apply(x, group, inplace) if tp_size_of(group) > 1 else x


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Y = X[..., this rank's 1/tp of the last dim]; dX = all-gather of dY."""
    return _ScatterToRegion.apply(x, group) if tp_size_of(group) > 1 else x


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Y = [X_1 … X_p] along the last dim; dX = this rank's slice of dY."""
    return _GatherFromRegion.apply(x, group) if tp_size_of(group) > 1 else x


def select_replicated_rows(weight: torch.Tensor, n_blocks: int, group) -> torch.Tensor:
    """W_r = row block r*n/p of a weight replicated over TP; dW summed over TP.

    For kv heads fewer than tp: every TP rank holds all n_blocks kv heads' weight, uses
    the one its query heads attend with, and the backward all-reduce makes every copy's
    gradient the full one (consistent replicas; DeepSpeed counts it once in the norm).
    """
    size = tp_size_of(group)
    assert size % n_blocks == 0, f"{n_blocks} row blocks cannot be shared by tp={size} ranks"
    return _SelectReplicatedRows.apply(weight, n_blocks, group)
