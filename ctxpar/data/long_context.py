"""Long-context tasks: a needle at chosen lengths x depths, and RULER-style retrieval and
tracking, made with any tokenizer from filler or held-out tokens (no downloads).

    haystack = Haystack.filler(tokenizer, seed=0)           # or Haystack.tokens(ids)
    t = make_task("needle", tokenizer, haystack, length=4096, depth=0.5, seed=3)
    t.prompt   # token ids, exactly `length` of them, ending with the question
    t.answers  # the strings a correct completion contains (score: the share found)

Tasks (RULER, Hsieh et al. 2024, its names; the needle is passkey.py's sentence, so a
model trained on the passkey task is asked in the form it knows):

    needle              one key in the haystack at `depth` (0 = start, 1 = just before
                        the question); answer: the key
    multikey            `n` keys for different names, one asked; the others distract
    multivalue          `n` keys for the same name; answer: all of them
    multiquery          `n` keys for different names, all asked
    variable_tracking   VAR X1 = value, then a chain VAR X2 = VAR X1 ... over the
                        haystack; answer: every name holding the value

Every task is a pure function of (name, tokenizer, haystack, length, depth, seed, n):
any rank makes the same prompt. Needles go in at whole-token boundaries of the haystack;
a filler haystack (digit-free sentences) never contains a key by accident.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from .indexed import DataError
from .passkey import NEEDLE, QUESTION, SENTENCES

TASKS = ("needle", "multikey", "multivalue", "multiquery", "variable_tracking")
# Digit-free names (the keys are digits) that appear in no filler sentence.
NAMES = ("apple", "piano", "tiger", "violet", "canyon", "harbor", "lantern", "meadow",
         "orchid", "quartz", "saddle", "walnut")
VARIABLES = ("QX", "RB", "TM", "ZK", "WP", "JD", "LF", "HN")


@dataclass(frozen=True)
class Task:
    name: str
    prompt: List[int]      # token ids, exactly the task's length
    answers: List[str]     # what a correct completion contains
    length: int
    depth: float

    def score(self, completion: str) -> float:
        """RULER's string match: the share of answers the completion contains."""
        return sum(a in completion for a in self.answers) / len(self.answers)


class Haystack:
    """Where needles hide: an endless stream of filler sentences, or given token ids."""

    def __init__(self, tokenizer, ids: Sequence[int] = None, seed: int = 0):
        self.tokenizer, self.ids, self.seed = tokenizer, ids, seed

    @classmethod
    def filler(cls, tokenizer, seed: int = 0) -> "Haystack":
        return cls(tokenizer, None, seed)

    @classmethod
    def tokens(cls, tokenizer, ids: Sequence[int]) -> "Haystack":
        """Held-out token ids (e.g. the eval split of the run's corpus), used from the start."""
        return cls(tokenizer, [int(i) for i in ids])

    def take(self, n: int, rng) -> Tuple[List[int], List[int]]:
        """(n token ids of haystack, the offsets a needle may go in at: sentence starts of
        filler, any token of given ids)."""
        if self.ids is not None:
            if n > len(self.ids):
                raise DataError(f"the held-out haystack has {len(self.ids)} tokens; a task "
                                f"needs {n}: give shorter --lengths or more held-out text")
            return self.ids[:n], list(range(n + 1))
        out: List[int] = []
        starts = [0]
        while len(out) < n:
            out += self.tokenizer.encode(SENTENCES[int(rng.integers(len(SENTENCES)))])
            starts.append(len(out))
        return out[:n], [p for p in starts if p <= n] + [n]


def _key(rng, digits: int) -> str:
    return f"{int(rng.integers(10 ** digits)):0{digits}d}"


def _distinct_keys(rng, n: int, digits: int) -> List[str]:
    keys: List[str] = []
    while len(keys) < n:
        k = _key(rng, digits)
        if k not in keys:
            keys.append(k)
    return keys


def _needles(name: str, rng, n: int, digits: int):
    """(needle sentences in order, question, answers) of one task."""
    if name == "needle":
        key = _key(rng, digits)
        return [NEEDLE.format(key=key)], QUESTION, [key]
    if name in ("multikey", "multiquery", "multivalue"):
        names = list(rng.choice(len(NAMES), size=n, replace=False))
        keys = _distinct_keys(rng, n, digits)
        if name == "multivalue":
            who = NAMES[names[0]]
            needles = [f"One pass key of {who} is {k}. " for k in keys]
            return needles, f"What are all the pass keys of {who}? They are ", keys
        needles = [f"The pass key of {NAMES[i]} is {k}. " for i, k in zip(names, keys)]
        if name == "multikey":
            asked = int(rng.integers(n))
            who = NAMES[names[asked]]
            return needles, f"What is the pass key of {who}? It is ", [keys[asked]]
        asked = ", ".join(NAMES[i] for i in names)
        return needles, f"What are the pass keys of {asked}? They are ", keys
    if name == "variable_tracking":
        value, chain = _key(rng, max(digits, 5)), list(VARIABLES[:max(n, 2)])
        needles = [f"VAR {chain[0]} = {value}. "]
        needles += [f"VAR {b} = VAR {a}. " for a, b in zip(chain, chain[1:])]
        return needles, f"Which variables hold the value {value}? They are: ", chain
    raise DataError(f"unknown task {name!r}; choose from {list(TASKS)}")


def make_task(name: str, tokenizer, haystack: Haystack, length: int, depth: float = 0.5,
              seed: int = 0, n: int = 4, digits: int = 2) -> Task:
    """Task `name` in exactly `length` tokens: needles at `depth` of the haystack (one
    needle; several spread from `depth` to the end, in order; each at the sentence start
    before its point), the question last."""
    if not 0.0 <= depth <= 1.0:
        raise DataError(f"depth={depth} must be in [0, 1]")
    rng = np.random.default_rng([seed, TASKS.index(name) if name in TASKS else 99,
                                 length, int(round(depth * 1000))])
    needles, question, answers = _needles(name, rng, n, digits)
    pieces = [tokenizer.encode(s) for s in needles]
    q = tokenizer.encode(question)
    bos = list(getattr(tokenizer, "bos_ids", []))  # the prompt starts as a document does
    n_hay = length - len(bos) - sum(map(len, pieces)) - len(q)
    if n_hay < 0:
        raise DataError(f"task {name!r} needs more than length={length} tokens "
                        f"({length - n_hay} without any haystack)")
    hay, starts = haystack.take(n_hay, rng)
    # Insertion points: the first at depth, the others evenly after it (chains in order),
    # each moved back to the haystack's nearest sentence start.
    first = int(round(depth * n_hay))
    want = [first + (n_hay - first) * j // len(pieces) for j in range(len(pieces))]
    spots = [max(p for p in starts if p <= w) for w in want]
    prompt, at = bos, 0
    for spot, piece in zip(spots, pieces):
        prompt += hay[at:spot] + piece
        at = spot
    prompt += hay[at:] + q
    assert len(prompt) == length, (len(prompt), length)
    return Task(name, prompt, answers, length, depth)
