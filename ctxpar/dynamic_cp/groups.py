"""Dynamic CP's process groups: one per tile of the DP x CP ranks, built once at start.

The schedule (ctxpar/dynamic_cp/schedule.py) numbers the ranks of a DP x CP group 0..W-1 in
ascending global rank (the rank grid's order: with the default tp-cp-dp-pp, position =
dp_rank x cp + cp_rank) and runs each document on a tile of contiguous positions
(cp_tiles). Every TP (and PP) coordinate has its own DP x CP group, so each tile is a
process group per coordinate: the same positions of each DP x CP group.

torch.distributed.new_group is collective over the whole world, so every rank creates
every group in one order (the grid's DP x CP groups in order, their tiles in cp_tiles'
order, under hybrid each tile followed by its Ulysses and ring groups) and keeps those it
belongs to. A rank set is made once: one the ParallelState already has (a CP, DP x CP,
Ulysses or ring group) reuses that group, one an earlier tile made reuses it (the rule
depends on the rank lists only, so every rank skips the same ones); a group of one rank
is LOCAL, no group at all.

Hybrid CP (parallel.cp_comm 'hybrid', Ulysses degree u) runs a tile of d = k x u ranks
as parallel_state's hybrid CP group of d: position p of the tile is Ulysses rank p % u of
the u contiguous positions holding it (aligned at multiples of u: the same rank sets in
every tile) and ring rank p // u of the k positions at its offset modulo u, so that cp
rank = ring rank x u + Ulysses rank. At d = u the ring is LOCAL (pure Ulysses, exactly);
at d = 1 both are, the plain local attention of the other patterns' one-rank packs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch.distributed as dist

from ..context_parallel.comm import LOCAL, group_rank_and_size
from .schedule import cp_tiles
from ..distributed.parallel_state import ParallelState

Tile = Tuple[int, int]  # (first position, size)


def tile_ranks(dp_cp_groups: List[List[int]], sizes: Sequence[int]) -> List[Tuple[Tile, List[int]]]:
    """Every multi-rank tile of every DP x CP group as global ranks, in creation order;
    pure (the group-membership tests' exact lists)."""
    return [((first, size), group[first:first + size])
            for group in dp_cp_groups
            for first, size in cp_tiles(len(group), sizes) if size > 1]


def hybrid_ranks(ranks: List[int], ulysses: int) -> Tuple[List[List[int]], List[List[int]]]:
    """A hybrid tile's (Ulysses groups, ring groups) from its ranks (k x u of them): u
    contiguous ranks each, and the k ranks at each offset modulo u; pure."""
    if len(ranks) % ulysses:
        raise ValueError(f"a hybrid tile of {len(ranks)} ranks is not a multiple of the "
                         f"Ulysses degree {ulysses}")
    return ([ranks[j:j + ulysses] for j in range(0, len(ranks), ulysses)],
            [ranks[i::ulysses] for i in range(ulysses)])


def dynamic_group_ranks(dp_cp_groups: List[List[int]], sizes: Sequence[int],
                        ulysses: Optional[int] = None) -> List[List[int]]:
    """Every rank set of more than one rank that dynamic CP makes a group of, each once, in
    creation order: the tiles (tile_ranks) and, under hybrid (ulysses = u), each tile's
    Ulysses and ring groups after it; pure."""
    out, seen = [], set()
    for _, ranks in tile_ranks(dp_cp_groups, sizes):
        sets = [ranks]
        if ulysses is not None:
            sets += [g for family in hybrid_ranks(ranks, ulysses) for g in family]
        for g in sets:
            if len(g) > 1 and tuple(g) not in seen:
                seen.add(tuple(g))
                out.append(g)
    return out


class TileGroups(NamedTuple):
    """What GPT.use_cp_group takes for a tile: its group (LOCAL for one rank) and, under
    hybrid, this rank's Ulysses and ring groups in it (None otherwise)."""

    cp_group: object
    ulysses_group: object = None
    ring_group: object = None

    @property
    def ulysses(self) -> int:
        """The Ulysses degree of the tile's token layout (layouts.py; 1 but under hybrid)."""
        return 1 if self.ulysses_group is None else group_rank_and_size(self.ulysses_group)[1]


@dataclass(frozen=True)
class DynamicCPGroups:
    """This rank's groups for dynamic CP: its position in its DP x CP group and the process
    group of each tile holding it (under hybrid, also its Ulysses and ring groups there)."""

    position: int                   # this rank's position in its DP x CP group
    world: int                      # the DP x CP group's size (the schedule's world)
    groups: Dict[Tile, object] = field(repr=False)  # (first, size) -> group, size 1: LOCAL
    hybrid: Dict[Tile, Tuple[object, object]] = field(repr=False, default_factory=dict)

    def group(self, first: int, size: int):
        """The process group of tile (first, size), which must hold this rank."""
        if not first <= self.position < first + size:
            raise ValueError(f"rank at position {self.position} is not in the tile of "
                             f"{size} ranks from {first}")
        return self.groups[(first, size)]

    def tile_groups(self, first: int, size: int) -> TileGroups:
        """The groups the model runs tile (first, size) over (GPT.use_cp_group)."""
        return TileGroups(self.group(first, size), *self.hybrid.get((first, size), ()))


def build_dynamic_cp_groups(state: ParallelState, sizes: Sequence[int],
                            ulysses: Optional[int] = None) -> DynamicCPGroups:
    """Create the groups of every tile of the CP sizes `sizes` (collective: call on all
    ranks, with the same sizes, after init_parallel_state); ulysses: hybrid's Ulysses
    degree u (every size but 1 a multiple of it), None for the other patterns."""
    mine_dp_cp = state.ranks("dp_cp")
    position, world = mine_dp_cp.index(state.rank), len(mine_dp_cp)
    families = ("cp", "dp_cp", "ulysses", "ring")
    existing = {tuple(state.ranks(f)): getattr(state, f"{f}_group") for f in families}
    reused = {tuple(g) for f in families for g in state.groups[f]}
    made: Dict[Tuple[int, ...], object] = {}
    for ranks in dynamic_group_ranks(state.groups["dp_cp"], sizes, ulysses):
        key = tuple(ranks)
        if key in reused:
            pg = existing.get(key)                     # ours, or another rank's to skip
        else:
            pg = dist.new_group(ranks) if len(ranks) < state.world_size else dist.group.WORLD
        if state.rank in ranks:
            made[key] = pg

    def group_of(ranks: List[int]):
        return LOCAL if len(ranks) == 1 else made[tuple(ranks)]

    groups: Dict[Tile, object] = {}
    hybrid: Dict[Tile, Tuple[object, object]] = {}
    for first, size in cp_tiles(world, {1, *sizes}):  # the one-rank tile always
        if not first <= position < first + size:
            continue
        ranks = mine_dp_cp[first:first + size]
        groups[(first, size)] = group_of(ranks)
        if ulysses is not None:
            u = 1 if size == 1 else ulysses
            ulysses_sets, ring_sets = hybrid_ranks(ranks, u)
            p = position - first                      # cp rank = ring rank x u + Ulysses rank
            hybrid[(first, size)] = (group_of(ulysses_sets[p // u]), group_of(ring_sets[p % u]))
    return DynamicCPGroups(position, world, groups, hybrid)
