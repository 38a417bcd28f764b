"""The short causal convolution before the mixers, over a CP group: a halo of K - 1 tokens.

Gated DeltaNet (Qwen3-Next) and Mamba2 run a depthwise causal conv1d of kernel K (4) over
the projected channels before the mixer: the output at position p reads x at p-K+1 .. p
(weight (channels, K) as transformers' ``conv1d.weight.squeeze(1)``, tap K-1 on p itself).
Under CP a rank therefore needs the K - 1 positions before each run of consecutive
positions it holds, from whichever ranks hold them (as halo.py's sliding-window halo):

    contiguous  rank r: the last K-1 tokens of rank r-1 (one message, none on rank 0)
    zigzag      chunk r: chunk r-1's tail from rank r-1; chunk 2P-1-r: chunk 2P-2-r's tail
                from rank r+1 (rank P-1: its own first chunk, no message)
    striped     token t's K-1 predecessors are on the K-1 ranks before it: whole shards
                from min(K-1, P-1) ranks, proportional to n (the heads strategy's all-to-all
                moves as much; the halo is for contiguous and zigzag)

The plan is derived from the layout's positions for any of them (shards shorter than K-1
reach further back). Backward sends the halo's gradient back to its owner, who adds it to
the rows it sent. Bytes: K-1 tokens x channels in x's dtype per neighbour, each way,
independent of n (contiguous, zigzag); counted in cp_stats().

Documents: a tap that reads a position of another document reads zero, so the window
restarts at every document start wherever it falls (causal-conv1d's ``seq_idx``), and
a one-token document sees only itself. The convolution runs in fp32, out in x's dtype, or
on causal-conv1d's kernel (kernels.py), which reads only its own sequence: run_plan puts
each run of a rank's positions after its K - 1 predecessors for it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from ..comm import exchange, wait_all
from ..layouts import rank_positions

ACTIVATIONS = (None, "silu", "swish")


class HaloPlan(NamedTuple):
    """One rank's conv halo: sends [(peer, local rows)], receives [(peer, count)] in
    ascending peer order (the halo's rows: each peer's positions ascending), and index
    (S, K): the row of [local rows, halo rows, one zero row] that tap d of local row i
    reads (position p_i - d; the zero row before position 0)."""

    sends: List[Tuple[int, torch.Tensor]]
    recvs: List[Tuple[int, int]]
    index: torch.Tensor
    positions: torch.Tensor  # (S,) the local rows' global positions


def _needed(layout: str, n: int, rank: int, world: int, K: int, owner: torch.Tensor):
    """Ascending positions rank's taps read that other ranks hold."""
    pos = rank_positions(n, rank, world, layout)
    reads = (pos[:, None] - torch.arange(1, K)).flatten()
    reads = torch.unique(reads[reads >= 0])
    return reads[owner[reads] != rank]


@lru_cache(maxsize=256)
def halo_plan(layout: str, n: int, rank: int, world: int, K: int) -> HaloPlan:
    """The halo of a conv of kernel K for `rank` of `world` under `layout` (host work O(n),
    once per shape)."""
    owner, row = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long)
    for r in range(world):
        pos = rank_positions(n, r, world, layout)
        owner[pos], row[pos] = r, torch.arange(len(pos))
    need = _needed(layout, n, rank, world, K, owner)
    recvs = [(s, int((owner[need] == s).sum())) for s in range(world)
             if s != rank and bool((owner[need] == s).any())]
    sends = []
    for t in range(world):
        if t != rank:
            theirs = _needed(layout, n, t, world, K, owner)
            mine = theirs[owner[theirs] == rank]
            if len(mine):
                sends.append((t, row[mine]))
    pos = rank_positions(n, rank, world, layout)
    halo_pos = torch.cat([need[owner[need] == s] for s, _ in recvs] or [need[:0]])
    slot = torch.full((n,), -1, dtype=torch.long)
    slot[pos] = torch.arange(len(pos))
    slot[halo_pos] = len(pos) + torch.arange(len(halo_pos))
    taps = pos[:, None] - torch.arange(K)                               # (S, K)
    index = torch.where(taps >= 0, slot[taps.clamp(min=0)], len(pos) + len(halo_pos))
    return HaloPlan(sends, recvs, index, pos)


class RunPlan(NamedTuple):
    """One sequence for a conv kernel that reads only its own rows (causal-conv1d): every
    run of consecutive positions this rank holds, preceded by its K - 1 predecessors.

    slots (E,): the row of [local rows, halo rows, one zero row] at each place (the zero
    row before position 0; the first run's leading ones are left out: the kernel pads
    zeros there itself); positions (E,): its global position, -1 for a zero row; keep
    (S,): where each local row is; identity: the sequence is the local rows as they are
    (one run from position 0, as on one process)."""

    slots: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    identity: bool


@lru_cache(maxsize=256)
def run_plan(layout: str, n: int, rank: int, world: int, K: int) -> RunPlan:
    """halo_plan's taps as runs: contiguous one run, zigzag two, striped one per token."""
    plan = halo_plan(layout, n, rank, world, K)
    pos, S = plan.positions, len(plan.positions)
    start = torch.ones(S, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    run = start.cumsum(0) - 1                                           # (S,) run of each row
    drop = max(0, K - 1 - int(pos[0]))  # the first run's predecessors before position 0
    keep = torch.arange(S) + (K - 1) * (run + 1) - drop
    E = S + (K - 1) * int(start.sum()) - drop
    zero = S + sum(count for _, count in plan.recvs)                    # the zero row
    slots = torch.full((E,), zero, dtype=torch.long)
    positions = torch.full((E,), -1, dtype=torch.long)
    slots[keep], positions[keep] = torch.arange(S), pos
    first = start.nonzero().squeeze(1)                                  # (runs,) rows
    back = torch.arange(K - 1, 0, -1)                                   # taps d = K-1 .. 1
    where = keep[first][:, None] - back                                 # (runs, K-1)
    valid = where >= 0
    slots[where[valid]] = plan.index[first][:, back][valid]
    before = pos[first][:, None] - back
    positions[where[valid]] = before[valid].clamp(min=-1)
    identity = E == S and bool((keep == torch.arange(S)).all())
    return RunPlan(slots, positions, keep, identity)


class HaloExchange(torch.autograd.Function):
    """x (B, S, C) -> the halo (B, sum of counts, C) in x's dtype; backward returns the
    halo's gradient to its owners, added to the rows they sent."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, group):
        ctx.plan, ctx.group, ctx.shape = plan, group, x.shape
        B, _, C = x.shape
        # the plan's rows are host tensors: moved to x's device (no CPU index in a CUDA op)
        sends = [(p, x[:, rows.to(x.device)].contiguous()) for p, rows in plan.sends]
        recvs = [(p, x.new_zeros(B, count, C)) for p, count in plan.recvs]
        wait_all(exchange(group, sends, recvs, "fwd"))
        return torch.cat([t for _, t in recvs], dim=1) if recvs else x.new_zeros(B, 0, C)

    @staticmethod
    def backward(ctx, dhalo):
        plan, (B, S, C) = ctx.plan, ctx.shape
        parts = dhalo.split([count for _, count in plan.recvs], dim=1) if plan.recvs else []
        sends = [(p, part.contiguous()) for (p, _), part in zip(plan.recvs, parts)]
        recvs = [(p, dhalo.new_zeros(B, len(rows), C)) for p, rows in plan.sends]
        wait_all(exchange(ctx.group, sends, recvs, "bwd"))
        dx = dhalo.new_zeros(B, S, C)
        for (_, rows), (_, got) in zip(plan.sends, recvs):
            dx.index_add_(1, rows.to(dx.device), got)
        return dx, None, None


def tap_mask(doc: Optional[torch.Tensor], positions: torch.Tensor,
             K: int) -> Optional[torch.Tensor]:
    """(B, S, K) bool: tap d of the token at positions[i] reads its own document; doc
    (B, n) is every position's document (None: one document, no mask)."""
    if doc is None:
        return None
    taps = positions[:, None] - torch.arange(K, device=positions.device)
    return doc[:, taps.clamp(min=0)] == doc[:, positions][:, :, None]


def conv_rows(rows: torch.Tensor, index: torch.Tensor, mask: Optional[torch.Tensor],
              weight: torch.Tensor, bias: Optional[torch.Tensor],
              activation: Optional[str]) -> torch.Tensor:
    """(B, S, C) fp32: sum over taps d of weight[:, K-1-d] * rows[:, index[:, d]] (masked),
    plus bias, through the activation. rows (B, R, C) end with a zero row."""
    K = weight.shape[1]
    w = weight.float()
    out = 0.0 if bias is None else bias.float()
    for d in range(K):
        tap = rows[:, index[:, d]]                                      # (B, S, C)
        if mask is not None:
            tap = tap * mask[:, :, d, None]
        out = out + tap * w[:, K - 1 - d]
    return F.silu(out) if activation in ("silu", "swish") else out


def conv_step(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor], activation: Optional[str]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decoded token through the causal conv: (out (B, C) fp32, the next window).

    window (B, K-1, C): the conv inputs of the K-1 positions before x, oldest first (zeros
    before position 0); x (B, C) the new position's input. The taps add in conv_rows'
    order (the token itself first), so a step gives what the chunked conv gives there."""
    K = weight.shape[1]
    rows = torch.cat([window, x[:, None]], dim=1)                      # (B, K, C)
    w = weight.float()
    out = 0.0 if bias is None else bias.float()
    for d in range(K):
        out = out + rows[:, K - 1 - d].float() * w[:, K - 1 - d]
    out = F.silu(out) if activation in ("silu", "swish") else out
    return out, rows[:, 1:]
