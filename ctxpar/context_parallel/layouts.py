"""Which tokens of the sequence each context-parallel rank holds: contiguous, zigzag, striped.

With n tokens and P ranks, every rank holds m = n/P of them:

    contiguous  rank r: [r*m, (r+1)*m)                      simple; causal work unbalanced
    zigzag      2P chunks of n/(2P); rank r: chunks r and 2P-1-r (an early and a late one),
                so every rank does the same causal work (ring-flash-attention's zigzag)
    striped     token t on rank t mod P (Brandon et al., Striped Attention; seed 001)

Positions within a rank are ascending for every layout, which is what lets the ring use a
plain causal kernel on the diagonal block. ``gather_sequence`` is the inverse of
``shard_sequence`` and differentiable.

**Hybrid CP (Ulysses degree u > 1).** The CP group factors into r = P/u ring ranks of u
Ulysses ranks each, Ulysses innermost: cp rank c = ring_rank*u + ulysses_rank. The layout
is then applied twice: over the r ring ranks (ring rank j holds the layout's shard j of
n/r tokens, ascending), and again over the u Ulysses ranks *within* that shard (by index
in it). After the Ulysses all-to-all every Ulysses rank of ring rank j holds exactly
shard j (at H/u heads), so the ring's block plan applies unchanged over r ranks, and
u = 1 (the ring) or r = 1 (pure Ulysses) is the plain layout over P. For contiguous and
zigzag the two-level layout *is* the plain one over P (zigzag: ring rank j's chunks j and
2r-1-j are u chunks each, and the inner zigzag picks chunk j*u+i and its mirror 2P-1-
(j*u+i)); for striped, cp rank (j, i) holds the tokens t = j + r*i (mod P), the plain
striped layout of rank j + r*i. Divisibility is the plain layout's over P in every case.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .comm import group_rank_and_size

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {list(LAYOUTS)}")


def num_chunks(world_size: int, layout: str) -> int:
    """Equal chunks a sequence is cut into: 2P for zigzag, P otherwise (n must divide)."""
    check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def _check_divisible(seq_len: int, world_size: int, layout: str) -> None:
    parts = num_chunks(world_size, layout)
    if seq_len % parts != 0:
        need = f"2P = {parts}" if layout == "zigzag" else f"P = {parts}"
        raise ValueError(f"sequence length n={seq_len} is not divisible by {need} for layout "
                         f"{layout!r} with P={world_size} context-parallel ranks")


def layout_rank(rank: int, world_size: int, layout: str, ulysses: int = 1) -> int:
    """The rank of the plain layout over P whose tokens cp rank `rank` holds (see above):
    `rank` itself unless striped with 1 < u < P, then ring_rank + r * ulysses_rank."""
    if ulysses < 1 or world_size % ulysses:
        raise ValueError(f"Ulysses degree u={ulysses} must be >= 1 and divide the "
                         f"{world_size} context-parallel ranks")
    if layout != "striped" or ulysses in (1, world_size):
        return rank
    ring_rank, ulysses_rank = divmod(rank, ulysses)
    return ring_rank + (world_size // ulysses) * ulysses_rank


def rank_positions(seq_len: int, rank: int, world_size: int, layout: str,
                   device: Optional[torch.device] = None, ulysses: int = 1) -> torch.Tensor:
    """Global positions (ascending LongTensor of length n/P) held by `rank`; no processes."""
    check_layout(layout)
    _check_divisible(seq_len, world_size, layout)
    rank = layout_rank(rank, world_size, layout, ulysses)
    m = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * m, (rank + 1) * m, device=device)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size, device=device)
    c = m // 2  # zigzag chunk
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * world_size - 1 - rank) * c,
                                   (2 * world_size - rank) * c, device=device)])


def sequence_positions(seq_len: int, group=None, layout: str = "contiguous",
                       device: Optional[torch.device] = None, ulysses: int = 1) -> torch.Tensor:
    """Global positions this rank of `group` holds (e.g. for RoPE and the loss targets)."""
    rank, world = group_rank_and_size(group)
    return rank_positions(seq_len, rank, world, layout, device, ulysses)


def shard_sequence(x: torch.Tensor, dim: int, group=None, layout: str = "contiguous",
                   ulysses: int = 1) -> torch.Tensor:
    """This rank's part of the full tensor x (identical on every rank) along `dim`."""
    check_layout(layout)
    rank, world = group_rank_and_size(group)
    dim = dim % x.dim()
    n = x.shape[dim]
    _check_divisible(n, world, layout)
    rank = layout_rank(rank, world, layout, ulysses)
    m = n // world
    if layout == "contiguous":
        return x.narrow(dim, rank * m, m)
    if layout == "striped":  # (.., n, ..) -> (.., n/P, P, ..): token t = i*P + r
        return x.unflatten(dim, (m, world)).select(dim + 1, rank)
    c = m // 2
    return torch.cat([x.narrow(dim, rank * c, c),
                      x.narrow(dim, (2 * world - 1 - rank) * c, c)], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """all_gather the shards and put every token back at its global position.

    Backward returns this rank's shard of the incoming gradient: the gathered tensor is
    assumed to feed the same (replicated) computation on every rank, so each rank already
    holds the full gradient and no reduction is needed.
    """

    @staticmethod
    def forward(ctx, x_local, dim, group, layout, ulysses):
        ctx.args = (dim, group, layout, ulysses)
        rank, world = group_rank_and_size(group)
        if world == 1:
            return x_local.clone()
        parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format)
                 for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        stacked = torch.cat(parts, dim=dim)  # rank order: positions of rank 0, rank 1, ...
        if layout == "contiguous":
            return stacked
        n = stacked.shape[dim]
        order = torch.cat([rank_positions(n, r, world, layout, stacked.device, ulysses)
                           for r in range(world)])
        return torch.empty_like(stacked).index_copy_(dim, order, stacked)

    @staticmethod
    def backward(ctx, grad):
        return shard_sequence(grad, *ctx.args), None, None, None, None


def gather_sequence(x_local: torch.Tensor, dim: int, group=None, layout: str = "contiguous",
                    ulysses: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence: the full tensor on every rank (differentiable)."""
    check_layout(layout)
    return _GatherSequence.apply(x_local, dim % x_local.dim(), group, layout, ulysses)


def ulysses_arrival_positions(shard_len: int, ulysses: int, layout: str,
                              device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Where the tokens gathered by a Ulysses all-to-all sit in the shard they make up.

    Ulysses rank i holds the layout's shard i of the shard_len tokens (layout over u, by
    index in the ring rank's shard; the whole sequence when r = 1); the all-to-all
    delivers them in rank order, so gathered token a sits at returned[a]. None when that
    is already ascending order (contiguous, or u = 1).
    """
    if layout == "contiguous" or ulysses == 1:
        return None
    return torch.cat([rank_positions(shard_len, i, ulysses, layout, device)
                      for i in range(ulysses)])
