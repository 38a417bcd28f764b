"""A step's schedule balanced toward its work bound, and documents exchanged between steps.

    plan = balanced_schedule(lengths, world, budget, cost, overhead, layout, sizes)
    bound = work_bound(lengths, world, budget, cost, overhead, layout, sizes)
    plan.makespan() / bound          # how far the schedule is from the ideal, >= 1

The work bound of a step is the least its W ranks can take: every document at the CP
size of least total work (d x cost(n, d) rank-seconds; the smallest size that holds it,
unless the cost model says otherwise) and the fewest packs' overheads (a multi-rank
document is a pack of its own on each of its ranks; the one-rank documents fill packs of
the budget), all of it spread evenly over the W ranks; and never less than the slowest
document's own time at its fastest size. No schedule of the step's documents under the
cost model ends earlier.

``balanced_schedule`` starts from schedule.py's placement (each document its smallest CP
size, LPT) and, while its makespan is more than ``tolerance`` above the bound, gives one
document the next larger allowed size (more ranks, less time each, a little more work),
the change that shortens the makespan most among the dearest documents; it stops when no
such change shortens it. Documents that fit one rank but dominate it (an n^2 attention
near the budget) are what it splits; the tiles and the fill of the one-rank documents
are schedule.py's. Pure and deterministic, as schedule().

``exchange_documents`` lets a step trade documents with the other steps of its window
(data.dynamic_cp_window steps): the window's documents, longest first, dealt to its steps
in snake order (step 0, 1, ..., K-1, K-1, ..., 0, ...), so every step gets the same count
and a like mix of long and short ones, and no step is left with several long documents
and too few short ones to fill its ranks' waits. By length, not by the cost model's
seconds (the same order wherever a document's work grows with its length): the data
order then depends on the lengths and indices alone, not on the layout or the machine,
so runs on different layouts train on the same steps, and a run resumed inside a window
draws what the uninterrupted one did. The data order changes only inside a window.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..context_parallel.layouts import num_chunks
from .schedule import Cost, Schedule, cp_size_for, schedule


def sizes_for(n: int, budget: int, sizes: Sequence[int], layout: str) -> List[int]:
    """The allowed sizes a document of n tokens may take: those that hold it within the
    budget and give each of the layout's chunks at least one of its tokens."""
    first = cp_size_for(n, budget, sizes, layout)
    return [d for d in sorted(sizes) if d == first or (d > first and n >= num_chunks(d, layout))]


def least_work(n: int, budget: int, sizes: Sequence[int], layout: str, cost: Cost):
    """(size, rank-seconds) of a document of n tokens at the size of least total work
    d x cost(n, d) among sizes_for's (the smallest on ties)."""
    return min(((d, d * cost(n, d)) for d in sizes_for(n, budget, sizes, layout)),
               key=lambda dw: (dw[1], dw[0]))


def work_bound(lengths: Sequence[int], world: int, budget: int, cost: Cost,
               overhead: float, layout: str, sizes: Sequence[int]) -> float:
    """The step's lower bound in seconds (module docstring): the documents' least work
    and the fewest packs' overheads (a multi-rank document's own pack on each of its
    ranks, the one-rank documents' tokens in packs of `budget`) over `world` ranks; at
    least the slowest document alone at its fastest size, plus one overhead."""
    total, slowest, one_rank = 0.0, 0.0, 0
    for n in lengths:
        d, work = least_work(n, budget, sizes, layout, cost)
        total += work + (d * overhead if d > 1 else 0.0)
        one_rank += n if d == 1 else 0
        slowest = max(slowest, min(cost(n, d) for d in sizes_for(n, budget, sizes, layout)))
    total += -(-one_rank // budget) * overhead
    return max(total / world, slowest + overhead)


def balanced_schedule(lengths: Sequence[int], world: int, budget: int, cost: Cost,
                      overhead: float, layout: str, sizes: Sequence[int],
                      tolerance: float = 0.03, candidates: int = 16) -> Schedule:
    """schedule() with documents given more ranks while that shortens the makespan (module
    docstring); tolerance: stop within this fraction of the work bound; candidates: the
    dearest documents tried each round."""
    sizes = sorted(set(sizes))
    bound = work_bound(lengths, world, budget, cost, overhead, layout, sizes)
    doc_sizes = [cp_size_for(int(n), budget, sizes, layout) for n in lengths]
    best = schedule(lengths, world, budget, cost, overhead, layout, sizes, doc_sizes)
    for _ in range(2 * len(lengths)):
        span = best.makespan()
        if span <= (1 + tolerance) * bound:
            break
        dearest = sorted(range(len(lengths)),
                         key=lambda i: (-cost(int(lengths[i]), doc_sizes[i]), i))[:candidates]
        tried: Optional[tuple] = None
        for i in dearest:
            bigger = next((d for d in sizes_for(int(lengths[i]), budget, sizes, layout)
                           if d > doc_sizes[i]), None)
            if bigger is None:
                continue
            trial = doc_sizes[:i] + [bigger] + doc_sizes[i + 1:]
            plan = schedule(lengths, world, budget, cost, overhead, layout, sizes, trial)
            if tried is None or plan.makespan() < tried[0].makespan():
                tried = (plan, trial)
        if tried is None or tried[0].makespan() >= span * (1 - 1e-9):
            break
        best, doc_sizes = tried
    return best


def exchange_documents(picks: List[np.ndarray], lengths: np.ndarray) -> List[np.ndarray]:
    """The window's steps' documents (each an array of document ids; lengths[id] a
    document's tokens) dealt again in snake order, longest first (module docstring): as
    many per step as before, each step's ids in ascending order of their place in the
    window."""
    counts = [len(p) for p in picks]
    if len(set(counts)) != 1:
        raise ValueError(f"exchange_documents: steps of unequal sizes {counts}")
    pool = np.concatenate(picks)
    order = sorted(range(len(pool)), key=lambda j: (-int(lengths[pool[j]]), j))
    k = len(picks)
    steps: List[List[int]] = [[] for _ in range(k)]
    for rank, j in enumerate(order):
        lap, pos = divmod(rank, k)
        steps[pos if lap % 2 == 0 else k - 1 - pos].append(j)
    return [pool[np.sort(np.asarray(s, dtype=np.int64))] for s in steps]
