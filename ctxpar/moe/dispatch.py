"""Tokens to their experts and back, over an expert-parallel group (dropless).

Each of the ep ranks holds E/ep consecutive experts (rank r: experts r E/ep ...). With
every token's k choices:

    1. sort the N k (token, expert) assignments by expert; c_e per expert
    2. exchange the counts (an all-to-all of ep x E/ep integers): each rank learns how many
       rows it receives from each rank for each of its experts (a host sync: the splits of
       step 3 are sizes)
    3. all-to-all the rows with those splits (backward: the gradients by the reverse
       splits); regroup them by local expert
    4. run_experts(rows, counts per local expert) -> rows out
    5. the reverse all-to-all; each assignment's row weighted by its router weight and
       summed into its token

Nothing is dropped or padded (but the assignments a capacity factor dropped before, -1:
capacity.py): the bytes sent are the routed rows' (moe_stats counts them),
and an expert with no rows runs on an empty slice, its weights' gradient zero. Rows a rank
keeps for its own experts travel through the all-to-all's local slot, not the network.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.distributed as dist

_STATS = {"dispatch_calls": 0, "rows_sent": 0, "bytes_sent": 0}


def reset_moe_stats() -> None:
    for k in _STATS:
        _STATS[k] = 0


def moe_stats() -> Dict[str, int]:
    """Rows and bytes this rank sent to other ranks' experts (forward, both all-to-alls),
    since reset_moe_stats."""
    return dict(_STATS)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by splits; backward sends the gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                     num_experts: int, run_experts: Callable, ep_group=None,
                     scale_input: bool = False) -> torch.Tensor:
    """x (N, d), weights (N, k) fp32, experts (N, k) -> (N, d): sum_j w_j expert_j(x), or
    with scale_input sum_j expert_j(w_j x) (Llama 4: each assignment's row sent scaled).

    An expert index -1 is an assignment dropped (capacity.py): not sent, adding nothing.
    run_experts(rows (M, d), counts (E/ep,) ints) -> (M, d): this rank's experts over rows
    grouped by local expert, counts[i] rows for local expert i."""
    N, k = experts.shape
    ep = _group_size(ep_group)
    flat = experts.reshape(-1)
    key = flat.masked_fill(flat < 0, num_experts)                 # dropped ones sort last
    order = torch.argsort(key, stable=True)                       # assignments by expert
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]   # (E,)
    per = k  # assignments per row of src: rows x shared by a token's k, or one each
    if scale_input:  # (N k, d): each assignment's own row w_j x
        x, per = (x.unsqueeze(1) * weights.unsqueeze(-1).to(x.dtype)).reshape(N * k, -1), 1
    if ep == 1:
        sizes = counts.tolist()                                   # the one host sync
        order = order[:sum(sizes)]                                # the kept assignments
        out = run_experts(x[order // per], sizes)                 # (M, d) by expert
    else:
        order, out = _over_ep(x, order, per, counts, num_experts, run_experts, ep_group)
    y = out.new_zeros((N * k, out.shape[1])).index_copy(0, order, out)  # assignment order
    if scale_input:
        return y.view(N, k, -1).sum(dim=1)
    y = y.view(N, k, -1) * weights.unsqueeze(-1).to(y.dtype)
    return y.sum(dim=1)


def _over_ep(x, order, k, counts, num_experts, run_experts, group):
    """Steps 2-5 of the module docstring for the assignments in ``order`` (by expert, the
    dropped ones last): (the kept ones' order, their rows out)."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    local = num_experts // ep
    send = counts.view(ep, local)                                 # [dest rank, its expert]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # [source rank, my expert]
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    order = order[:sum(in_splits)]                                # the kept assignments
    rows = x[order // k]                                          # (M, d) by expert
    got = _all_to_all(rows, out_splits, in_splits, group)        # by source, then expert
    # regroup by my expert: the local expert of each received row, stably sorted
    expert_of = torch.repeat_interleave(
        torch.arange(local, device=rows.device).repeat(ep), recv.reshape(-1))
    regroup = torch.argsort(expert_of, stable=True)
    out = run_experts(got[regroup], recv.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, regroup, out)      # by source, then expert
    sent = sum(n for i, n in enumerate(in_splits) if i != me)        # rows out, then
    sent += sum(n for i, n in enumerate(out_splits) if i != me)      # results back
    _STATS["dispatch_calls"] += 1
    _STATS["rows_sent"] += sent
    _STATS["bytes_sent"] += sent * rows.shape[1] * rows.element_size()
    return order, _all_to_all(back, in_splits, out_splits, group)
