"""Dynamic context parallelism: each step, every document gets a CP degree and a rank group.

A step draws ``docs_per_step`` whole documents (``step_documents``: a function of the
seed and the step). ``schedule`` then gives document i of n tokens the smallest CP size d
whose ranks hold it (its length padded to the layout's chunks, over d, within the
per-rank token ``budget``): short documents stay on one rank, no CP at all. The world of
W = dp x cp ranks is cut, for every size d, into the tiles of d contiguous ranks
[k d, (k+1) d), k < W // d (``cp_tiles``: any d from 1 to W, not only powers of two;
the process groups are built once at start, ctxpar/dynamic_cp/groups.py).
Documents are placed longest-processing-time first (Graham's LPT), by the cost model's
seconds, descending. A document of size d >= 2 runs alone (at its smallest size, with
every size allowed, it holds more than (d - 1) x budget tokens, so no two would fit one
group anyway; balance.py may give it more ranks than that, still alone), on the
tile of its size whose ranks are free first (list scheduling: the group waits for its
slowest rank). The one-rank documents
then fill the time ranks wait for a group where they fit, else go after the groups of
the rank that would finish them earliest, packed together: one packed sequence (document
masking, positions restarting at each document) of at most `budget` tokens, a new one
when the rank's packs there are full. Every ``Pack`` runs forward and backward before
the next (gradient accumulation inside the step), so a rank holds one pack's activations
at a time.

Each rank runs the packs it belongs to in the schedule's order (the groups in the order
they were placed, each rank's one-rank packs where it placed them): one total order every
rank follows, so groups that share a rank never wait on each other in a cycle, and
nobody waits for a one-rank pack. Pure and deterministic: the same lengths give the same
schedule on every rank, with no communication; the loss's token count is the sum of the
lengths, known everywhere.

The cost model is a callable cost(n, d) -> seconds of the busiest of d ranks for one
document of n tokens, plus ``overhead`` seconds per pack (the planner's,
ctxpar/plan/sequence_cost.py); a pack costs the sum of its documents' costs and one
overhead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..context_parallel.layouts import num_chunks

Cost = Callable[[int, int], float]


class ScheduleError(ValueError):
    """Documents no layout of the rank budgets can hold, in one line."""


def cp_tiles(world: int, sizes: Sequence[int]) -> List[Tuple[int, int]]:
    """(first rank, size) of every rank group the schedule may use, sizes ascending."""
    return [(k * d, d) for d in sorted(set(sizes)) for k in range(world // d)]


def padded_length(tokens: int, size: int, layout: str) -> int:
    """tokens rounded up to a whole number of the layout's chunks over size ranks."""
    c = num_chunks(size, layout)
    return -(-tokens // c) * c


def cp_size_for(tokens: int, budget: int, sizes: Sequence[int], layout: str) -> int:
    """The smallest size whose ranks hold a sequence of `tokens` within `budget` each."""
    for d in sorted(sizes):
        if padded_length(tokens, d, layout) // d <= budget:
            return d
    d = max(sizes)
    raise ScheduleError(f"a document of {tokens} tokens does not fit {d} ranks of "
                        f"{budget} tokens each (data.tokens_per_rank={budget}, "
                        f"{padded_length(tokens, d, layout) // d} needed)")


@dataclass(frozen=True)
class Pack:
    """The documents one rank group runs as one packed sequence."""

    first: int                 # first rank (position in the DP x CP group)
    size: int                  # the CP degree
    docs: Tuple[int, ...]      # ascending indices into the step's documents
    tokens: int                # the documents' tokens
    length: int                # padded to the layout's chunks; length // size per rank
    seconds: float             # the cost model's estimate of this pack

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass(frozen=True)
class Schedule:
    """Where a step's documents run: the packs in execution order, each rank's work."""

    world: int
    budget: int
    sizes: Tuple[int, ...]     # each document's CP size
    packs: Tuple[Pack, ...]
    rank_work: Tuple[float, ...]  # estimated seconds per rank (its packs' sum)

    def packs_of(self, rank: int) -> List[Pack]:
        """The packs `rank` takes part in, in the order every rank runs them."""
        return [p for p in self.packs if rank in p.ranks]

    @property
    def work_balance(self) -> float:
        """max / mean of the ranks' estimated work (1.0: perfectly balanced)."""
        mean = sum(self.rank_work) / self.world
        return max(self.rank_work) / mean if mean > 0 else 1.0

    def size_shares(self) -> Dict[int, float]:
        """The share of the step's documents at each CP size."""
        n = len(self.sizes)
        return {d: self.sizes.count(d) / n for d in sorted(set(self.sizes))}

    def slots(self) -> List[List[Optional[Pack]]]:
        """The packs as rounds in which every rank runs one pack or none (None), each pack
        in one round on all its ranks, in the packs' order: what a run needs whose every
        backward (ZeRO 2 and 3) or forward (ZeRO 3) is collective over all the ranks, so
        that a rank with nothing to run in a round runs an empty pack."""
        next_free, rounds = [0] * self.world, []
        for p in self.packs:
            k = max(next_free[r] for r in p.ranks)
            while len(rounds) <= k:
                rounds.append([None] * self.world)
            for r in p.ranks:
                rounds[k][r], next_free[r] = p, k + 1
        return rounds

    def makespan(self) -> float:
        """Estimated step seconds with the waits: each pack starts when all its ranks are
        done with their earlier packs (the execution order), and the step ends with the
        last rank."""
        ready = [0.0] * self.world
        for p in self.packs:
            end = max(ready[r] for r in p.ranks) + p.seconds
            for r in p.ranks:
                ready[r] = end
        return max(ready)


def _check(lengths: Sequence[int], world: int, budget: int, sizes) -> List[int]:
    if world < 1 or budget < 1:
        raise ScheduleError(f"world={world} and budget={budget} must be >= 1")
    bad = [d for d in sizes if not 1 <= d <= world]
    if bad:
        raise ScheduleError(f"CP sizes {bad} are not within 1..{world}")
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 1:
        raise ScheduleError(f"documents need >= 1 token each, got {len(lengths)} documents "
                            f"(shortest {min(lengths) if lengths else None})")
    return lengths


def schedule(lengths: Sequence[int], world: int, budget: int, cost: Cost,
             overhead: float = 0.0, layout: str = "zigzag",
             sizes: Optional[Sequence[int]] = None,
             doc_sizes: Optional[Sequence[int]] = None) -> Schedule:
    """Each document's CP size and place (the module docstring). sizes: the CP degrees
    allowed (default 1..world); ScheduleError when a document fits none of them.
    doc_sizes: each document's CP size when the caller chose it (balance.py may give a
    document more ranks than it needs, never fewer), else the smallest that holds it."""
    sizes = sorted(set(range(1, world + 1) if sizes is None else sizes))
    lengths = _check(lengths, world, budget, sizes)
    size_of = [cp_size_for(n, budget, sizes, layout) for n in lengths]
    if doc_sizes is not None:
        if any(d < m or d not in sizes for d, m in zip(doc_sizes, size_of)):
            raise ScheduleError(f"CP sizes {list(doc_sizes)} are not allowed sizes at least "
                                f"each document's smallest {size_of}")
        size_of = [int(d) for d in doc_sizes]
    seconds = [cost(n, d) for n, d in zip(lengths, size_of)]
    tiles = cp_tiles(world, sizes)
    lpt = sorted(range(len(lengths)), key=lambda i: (-seconds[i], i))
    ready, work, groups = [0.0] * world, [0.0] * world, []
    # gaps[r]: [seconds left, the group it precedes, its packs]: where rank r waits
    gaps: List[List[list]] = [[] for _ in range(world)]
    # Groups first: list scheduling, each document on the tile of its size that ends it
    # earliest; its ranks wait for the slowest of them, then run it together.
    for i in (i for i in lpt if size_of[i] > 1):
        d = size_of[i]
        first = min((t for t, size in tiles if size == d),
                    key=lambda t: (max(ready[t:t + d]), t))
        start = max(ready[first:first + d])
        for r in range(first, first + d):
            if start > ready[r]:
                gaps[r].append([start - ready[r], len(groups), []])
            ready[r], work[r] = start + overhead + seconds[i], work[r] + overhead + seconds[i]
        groups.append(Pack(first, d, (i,), lengths[i], padded_length(lengths[i], d, layout),
                           overhead + seconds[i]))
    # Then the one-rank documents, packed (first pack with room in the budget) into a
    # rank's wait before a group where one fits, else after the groups of the rank that
    # ends them earliest.
    tail: List[List[list]] = [[] for _ in range(world)]  # per rank: its last packs
    for i in (i for i in lpt if size_of[i] == 1):
        n, sec, best = lengths[i], seconds[i], None
        for r in range(world):
            fits = lambda p: padded_length(p[1] + n, 1, layout) <= budget  # noqa: E731
            spot = next(((g, p, sec) for g in gaps[r] for p in g[2]
                         if fits(p) and g[0] >= sec), None) \
                or next(((g, None, sec + overhead) for g in gaps[r]
                         if g[0] >= sec + overhead), None) \
                or next(((None, p, sec) for p in tail[r] if fits(p)), None) \
                or (None, None, sec + overhead)
            end = ready[r] + (spot[2] if spot[0] is None else 0.0)
            key = (spot[0] is None, end)  # a wait it fills is free: those first
            if best is None or key < best[0]:
                best = (key, r, spot)
        (_, end), r, (gap, pack, extra) = best
        if pack is None:
            pack = [[], 0]
            (gap[2] if gap is not None else tail[r]).append(pack)
        if gap is not None:
            gap[0] -= extra
        pack[0].append(i)
        pack[1] += n
        ready[r], work[r] = end, work[r] + extra

    def one_rank(r, p):
        return Pack(r, 1, tuple(sorted(p[0])), p[1], padded_length(p[1], 1, layout),
                    overhead + sum(seconds[j] for j in p[0]))
    out = []
    for k, group in enumerate(groups):
        out += [one_rank(r, p) for r in range(world) for g in gaps[r] if g[1] == k
                for p in g[2]]
        out.append(group)
    out += [one_rank(r, p) for r in range(world) for p in tail[r]]
    return Schedule(world, budget, tuple(size_of), tuple(out), tuple(work))


def static_schedule(lengths: Sequence[int], world: int, budget: int, cp_size: int,
                    cost: Cost, overhead: float = 0.0, layout: str = "zigzag",
                    pack_cost: Optional[Callable[[List[int], int], float]] = None
                    ) -> Schedule:
    """Static CP on the same documents, for comparison: documents in order packed into
    samples of at most cp_size x budget tokens (padded), every sample split over a group of
    cp_size ranks, samples dealt to the world // cp_size groups in turn (what the
    fixed-seq_len stream does, without cutting documents). pack_cost(lengths, cp_size):
    a sample's seconds where the layout decides which ranks hold each document
    (SequenceCost.pack); without it every document is priced over all cp_size ranks,
    cost(n, cp_size) (the striped layout's placement)."""
    lengths = _check(lengths, world, budget, [cp_size])
    groups = world // cp_size
    samples: List[List[int]] = [[]]
    for i, n in enumerate(lengths):
        cp_size_for(n, budget, [cp_size], layout)  # raises when it cannot fit at all
        held = sum(lengths[j] for j in samples[-1])
        if samples[-1] and padded_length(held + n, cp_size, layout) > cp_size * budget:
            samples.append([])
        samples[-1].append(i)
    work = [0.0] * world
    out = []
    for s, docs in enumerate(samples):
        first = (s % groups) * cp_size
        held = [lengths[j] for j in docs]
        secs = overhead + (pack_cost(held, cp_size) if pack_cost is not None
                           else sum(cost(n, cp_size) for n in held))
        tokens = sum(lengths[j] for j in docs)
        out.append(Pack(first, cp_size, tuple(docs), tokens,
                        padded_length(tokens, cp_size, layout), secs))
        for r in range(first, first + cp_size):
            work[r] += secs
    return Schedule(world, budget, tuple([cp_size] * len(lengths)), tuple(out), tuple(work))


def step_documents(n_docs: int, docs_per_step: int, seed: int, step: int) -> np.ndarray:
    """The indices of the documents step `step` trains on: global document g = step x
    docs_per_step + j is position g mod n_docs of epoch g // n_docs's permutation, seeded
    by (seed, epoch). A function of the seed and the step only, so a resumed run draws
    what the uninterrupted one would."""
    g = np.arange(step * docs_per_step, (step + 1) * docs_per_step, dtype=np.int64)
    epochs, pos = np.divmod(g, n_docs)
    out = np.empty(docs_per_step, dtype=np.int64)
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(n_docs)
        out[epochs == e] = perm[pos[epochs == e]]
    return out
