"""data.dynamic_cp's stream: each step's whole documents, their schedule, this rank's packs.

    stream = DynamicStream(cfg, source, world, cost)      # file reads only; DataError
    stream.check_lengths()                                # a document too long: DataError
    step = stream.next_step()           # documents, schedule, token count of the step
    for pack in step.schedule.packs_of(groups.position): ...   # train.py
    client_state["data"] = stream.state_dict()            # the step (and tokens so far)

The training documents are those of the token file wholly inside the train split's
windows (TokenWindows' first..first + n_windows; the held-out windows stay held out), of
at least two stored tokens (one input, one label). Step s trains on step_documents(s)
of them: a function of train.seed and the step, so the state is the step alone. With
data.dynamic_cp_window = K > 1 the K steps of each window trade documents
(balance.exchange_documents, a function of the window's lengths): the state is still
the step, and a run resumed inside a window deals the window again as it was dealt.

data.dynamic_cp_schedule picks the placement: 'balanced' (balance.balanced_schedule) or
'static' (schedule.static_schedule at parallel.cp: static CP's packing of the same
documents in the step's order; what the balanced schedule is compared with, exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from ..config import ulysses_degree
from .batch import document_tokens
from .balance import balanced_schedule, exchange_documents, work_bound
from .schedule import Schedule, ScheduleError, cp_size_for, static_schedule, step_documents
from ..data.indexed import DataError


def dynamic_cp_sizes(world: int, comm: str, heads_per_rank: int,
                     ulysses: int = 1) -> List[int]:
    """The CP sizes the schedule may use: 1..world; under Ulysses those dividing the heads
    (each rank takes heads / size of them); under hybrid 1 (no CP) and the multiples of
    the Ulysses degree `ulysses` (parallel.ulysses: u Ulysses ranks around a ring of
    size / u, the ring of one rank at size u)."""
    if comm == "hybrid":
        return [d for d in range(1, world + 1) if d == 1 or d % ulysses == 0]
    return [d for d in range(1, world + 1) if comm != "ulysses" or heads_per_rank % d == 0]


def dynamic_cp_sizes_for(cfg, world: int) -> List[int]:
    """dynamic_cp_sizes for cfg's pattern, heads per TP rank and Ulysses degree over a
    DP x CP group of `world` ranks: what the stream, the planner and the benchmark use."""
    p = cfg.parallel
    return dynamic_cp_sizes(world, p.cp_comm, cfg.model.n_heads // p.tp, ulysses_degree(p))


@dataclass(frozen=True)
class DynamicStep:
    documents: List[np.ndarray]   # the step's documents, stored tokens (EOS last)
    lengths: List[int]            # their inputs (= labels): the schedule's lengths
    schedule: Schedule
    n_tokens: int                 # labels of the step: the loss's token count
    bound: float                  # the step's work bound, seconds (balance.work_bound)


class DynamicStream:
    """The documents and the schedule of every step, the same on every rank."""

    def __init__(self, cfg, source, world: int, cost):
        p, data = cfg.parallel, cfg.data
        self.budget = data.tokens_per_rank or cfg.model.seq_len // p.cp
        self.layout, self.world, self.cost = p.layout, world, cost
        self.per_step, self.seed = cfg.train.global_batch_size, cfg.train.seed
        self.sizes = dynamic_cp_sizes_for(cfg, world)
        self.static_cp = p.cp if data.dynamic_cp_schedule == "static" else None
        self.window = data.dynamic_cp_window
        self._dealt = (None, None)  # (first step of the window, its steps' documents)
        ds = source.data
        lo, hi = source.first * source.seq_len, (source.first + source.n_windows) \
            * source.seq_len + 1
        offsets = ds.doc_offsets
        inside = (offsets[:-1] >= lo) & (offsets[1:] <= hi) & (np.diff(offsets) >= 2)
        self.dataset, self.ids = ds, np.flatnonzero(inside)
        if len(self.ids) == 0:
            raise DataError(f"{ds.prefix}.idx: no document of >= 2 tokens lies wholly in the "
                            f"train split (data.dynamic_cp trains on whole documents)")
        self.lengths = document_tokens(np.diff(offsets)[self.ids])
        self.step, self.tokens_seen = 0, 0

    def check_lengths(self) -> None:
        """DataError (one line) when a training document fits no rank group."""
        longest = int(self.lengths.argmax())
        try:
            cp_size_for(int(self.lengths[longest]), self.budget,
                        [self.static_cp] if self.static_cp else self.sizes, self.layout)
        except ScheduleError as e:
            raise DataError(f"{self.dataset.prefix}.idx: document {self.ids[longest]}, the "
                            f"longest: {e}") from None

    def step_picks(self, step: int) -> np.ndarray:
        """Indices into self.ids of step `step`'s documents: step_documents', traded
        within the step's window when data.dynamic_cp_window > 1."""
        if self.window == 1:
            return step_documents(len(self.ids), self.per_step, self.seed, step)
        first = step - step % self.window
        if self._dealt[0] != first:
            picks = [step_documents(len(self.ids), self.per_step, self.seed, s)
                     for s in range(first, first + self.window)]
            self._dealt = (first, exchange_documents(picks, self.lengths))
        return self._dealt[1][step - first]

    def plan(self, lengths: List[int]) -> Schedule:
        """The step's schedule under data.dynamic_cp_schedule."""
        overhead = getattr(self.cost, "overhead", 0.0)
        if self.static_cp:
            return static_schedule(lengths, self.world, self.budget, self.static_cp,
                                   self.cost, overhead, self.layout,
                                   getattr(self.cost, "pack", None))
        return balanced_schedule(lengths, self.world, self.budget, self.cost, overhead,
                                 self.layout, self.sizes)

    def next_step(self) -> DynamicStep:
        pick = self.step_picks(self.step)
        self.step += 1
        lengths = self.lengths[pick]
        self.tokens_seen += int(lengths.sum())
        bound = work_bound(lengths.tolist(), self.world, self.budget, self.cost,
                           getattr(self.cost, "overhead", 0.0), self.layout, self.sizes)
        return DynamicStep([self.dataset[int(i)] for i in self.ids[pick]], lengths.tolist(),
                           self.plan(lengths.tolist()), int(lengths.sum()), bound)

    def state_dict(self) -> Dict:
        return {"kind": "dynamic_cp", "step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: Dict) -> None:
        if state.get("kind") != "dynamic_cp":
            raise DataError(f"the checkpoint's data position {state} is not a dynamic_cp "
                            f"stream's (data.dynamic_cp changed since it was saved?)")
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
