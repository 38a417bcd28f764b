"""Dynamic CP's process groups: one per tile of the DP x CP ranks, built once at start.

The schedule (ctxpar/data/dynamic_cp.py) numbers the ranks of a DP x CP group 0..W-1 in
ascending global rank (the rank grid's order: with the default tp-cp-dp-pp, position =
dp_rank x cp + cp_rank) and runs each document on a tile of contiguous positions
(cp_tiles). Every TP (and PP) coordinate has its own DP x CP group, so each tile is a
process group per coordinate: the same positions of each DP x CP group.

torch.distributed.new_group is collective over the whole world, so every rank creates
every group in one order (the grid's DP x CP groups in order, their tiles in cp_tiles'
order) and keeps those it belongs to. A tile whose ranks are those of a CP group or of
the whole DP x CP group reuses that group (the rule depends on the rank lists only, so
every rank skips the same ones); a tile of one rank is LOCAL, no group at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch.distributed as dist

from ..context_parallel.comm import LOCAL
from ..data.dynamic_cp import cp_tiles
from .parallel_state import ParallelState

Tile = Tuple[int, int]  # (first position, size)


def tile_ranks(dp_cp_groups: List[List[int]], sizes: Sequence[int]) -> List[Tuple[Tile, List[int]]]:
    """Every multi-rank tile of every DP x CP group as global ranks, in creation order;
    pure (the group-membership tests' exact lists)."""
    return [((first, size), group[first:first + size])
            for group in dp_cp_groups
            for first, size in cp_tiles(len(group), sizes) if size > 1]


@dataclass(frozen=True)
class DynamicCPGroups:
    """This rank's groups for dynamic CP: its position in its DP x CP group and the process
    group of each tile holding it."""

    position: int                   # this rank's position in its DP x CP group
    world: int                      # the DP x CP group's size (the schedule's world)
    groups: Dict[Tile, object] = field(repr=False)  # (first, size) -> group, size 1: LOCAL

    def group(self, first: int, size: int):
        """The process group of tile (first, size), which must hold this rank."""
        if not first <= self.position < first + size:
            raise ValueError(f"rank at position {self.position} is not in the tile of "
                             f"{size} ranks from {first}")
        return self.groups[(first, size)]


def build_dynamic_cp_groups(state: ParallelState, sizes: Sequence[int]) -> DynamicCPGroups:
    """Create the groups of every tile of the CP sizes `sizes` (collective: call on all
    ranks, with the same sizes, after init_parallel_state)."""
    mine_dp_cp = state.ranks("dp_cp")
    position, world = mine_dp_cp.index(state.rank), len(mine_dp_cp)
    existing = {tuple(state.ranks("cp")): state.cp_group, tuple(mine_dp_cp): state.dp_cp_group}
    reused = {tuple(g) for family in ("cp", "dp_cp") for g in state.groups[family]}
    groups: Dict[Tile, object] = {(position, 1): LOCAL}
    for tile, ranks in tile_ranks(state.groups["dp_cp"], sizes):
        key = tuple(ranks)
        if key in reused:
            pg = existing.get(key)                     # ours, or another rank's to skip
        else:
            pg = dist.new_group(ranks) if len(ranks) < state.world_size else dist.group.WORLD
        if state.rank in ranks:
            groups[tile] = pg
    return DynamicCPGroups(position, world, groups)
