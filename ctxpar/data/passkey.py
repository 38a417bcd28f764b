"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"), byte-level.

One sample is exactly seq_len + 1 bytes of ASCII text (a byte is a token, ByteTokenizer):

    <filler ...>The pass key is 42. Remember it. <filler ...>What is the pass key? The pass key is 42
    |-- depth d --|                                                                               |- key -|

The needle sits at a random sentence boundary of the filler; the filler never contains a
digit, so the key's digits occur exactly twice: in the needle and as the answer at the very
end. Labels are -100 except at the key's last ``digits`` positions, so loss and accuracy
are on the answer only. Under context parallelism the answer is in the last chunk and the
needle usually in another rank's chunk: the task cannot be solved without attention
across CP shards. Chance (exact match of all digits) is 10**-digits.

Packed (``docs`` > 1, for document masking): one sample is ``docs`` documents back to
back, each its filler with its own needle and key; only the last ends with the question,
whose answer is the last document's key:

    <filler><needle k1><filler> | <filler><needle k2><filler> | ... | <filler><needle k><filler>Q k

Document lengths are random (each at least what it needs), so boundaries fall anywhere,
not on shard edges; ``documents(index)`` gives them (cu_seqlens over the inputs). With
data.document_mask the answer's attention sees only the last document's needle; without
it, every document's needle (all keys differ from the answer) competes.

Samples are a pure function of (seed, split, index): any rank can make any sample.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..tensor_parallel.cross_entropy import IGNORE_INDEX
from .indexed import DataError
from .tokenizer import ByteTokenizer

NEEDLE = "The pass key is {key}. Remember it. "
QUESTION = "What is the pass key? The pass key is "
# "The <noun> is <adjective>. " and two classics: 12*12 + 2 sentences, none with a digit.
NOUNS = ("grass", "sky", "sun", "sea", "road", "house", "tree", "river", "bird", "hill",
         "cloud", "stone")
ADJECTIVES = ("green", "blue", "yellow", "calm", "long", "old", "tall", "quiet", "warm",
              "bright", "grey", "small")
SENTENCES = tuple(f"The {n} is {a}. " for n in NOUNS for a in ADJECTIVES) + (
    "Here we go. ", "There and back again. ")
SPLITS = {"train": 0, "eval": 1}  # disjoint random streams for the same seed


def min_seq_len(digits: int) -> int:
    """Shortest seq_len that holds needle + question + key with 8 bytes of filler."""
    return len(NEEDLE.format(key="0" * digits)) + len(QUESTION) + digits - 1 + 8


def min_packed_seq_len(digits: int, docs: int) -> int:
    """Shortest seq_len for `docs` documents: the last as min_seq_len, each other one a
    needle and 8 bytes of filler."""
    return min_seq_len(digits) + (max(docs, 1) - 1) * (len(NEEDLE.format(key="0" * digits)) + 8)


def _document(rng, n_chars: int, needle: str, tail: str) -> Tuple[str, int]:
    """(filler with the needle at a random sentence boundary, then tail; the needle's offset),
    n_chars long."""
    n_filler = n_chars - len(needle) - len(tail)
    sentences, total = [], 0
    while total < n_filler:
        s = SENTENCES[int(rng.integers(len(SENTENCES)))]
        sentences.append(s)
        total += len(s)
    filler = "".join(sentences)[:n_filler]  # the last sentence may be cut short
    starts = np.cumsum([0] + [len(s) for s in sentences])
    depth = int(rng.choice(starts[starts <= n_filler]))
    return filler[:depth] + needle + filler[depth:] + tail, depth


class PasskeyTask:
    """``task[i] -> (inputs (T,), labels (T,))`` int64 numpy arrays; endless (any i >= 0).
    ``task.documents(i)``: the sample's document boundaries over its inputs (int32)."""

    def __init__(self, seq_len: int, digits: int = 2, seed: int = 0, split: str = "train",
                 docs: int = 1):
        if docs < 1 or seq_len < min_packed_seq_len(digits, docs):
            raise DataError(f"passkey with {digits} digits and {docs} document(s) per sample "
                            f"needs seq_len >= {min_packed_seq_len(digits, docs)}, got "
                            f"{seq_len}")
        self.seq_len, self.digits, self.seed, self.split = seq_len, digits, seed, split
        self.docs = docs
        self.vocab_size = ByteTokenizer.vocab_size
        self.fingerprint = {"kind": "passkey", "seq_len": seq_len, "digits": digits,
                            "seed": seed, "split": split}
        if docs > 1:  # (one document: the fingerprint of the unpacked task, as before)
            self.fingerprint["docs"] = docs

    def _key(self, rng) -> str:
        return f"{int(rng.integers(10 ** self.digits)):0{self.digits}d}"

    def sample(self, index: int) -> Tuple[str, str, int, List[int]]:
        """(text of seq_len+1 chars, the answer's key, its needle's char offset, document
        start offsets in the text) for sample index."""
        rng = np.random.default_rng([self.seed, SPLITS[self.split], index])
        key = self._key(rng)
        n = self.seq_len + 1
        lengths = [n]
        if self.docs > 1:  # random lengths, each document at least what it needs
            first = len(NEEDLE.format(key=key)) + 8
            spare = self.seq_len - min_packed_seq_len(self.digits, self.docs)
            extra = rng.multinomial(spare, [1 / self.docs] * self.docs)
            lengths = [first + int(e) for e in extra[:-1]]
            lengths.append(n - sum(lengths))
        parts, starts = [], [0]
        for length in lengths[:-1]:  # the other documents: a needle each, another key
            other = self._key(rng)
            while other == key:
                other = self._key(rng)
            parts.append(_document(rng, length, NEEDLE.format(key=other), "")[0])
            starts.append(starts[-1] + length)
        last, depth = _document(rng, lengths[-1], NEEDLE.format(key=key), QUESTION + key)
        text = "".join(parts) + last
        assert len(text) == n, (len(text), n)
        return text, key, starts[-1] + depth, starts

    def text(self, index: int) -> Tuple[str, str, int]:
        """(sample text of seq_len+1 chars, key, needle's char offset) for sample index."""
        return self.sample(index)[:3]

    def documents(self, index: int) -> np.ndarray:
        """cu_seqlens of sample index's inputs (T tokens): [0, starts..., T], int32."""
        return np.array([*self.sample(index)[3], self.seq_len], dtype=np.int32)

    def __getitem__(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        text, _, _ = self.text(index)
        tokens = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int64)
        inputs = tokens[:-1]                                     # (T,)
        labels = np.full(self.seq_len, IGNORE_INDEX, np.int64)  # (T,)
        labels[-self.digits:] = tokens[-self.digits:]  # predict key digit j from its prefix
        return inputs, labels


def passkey_correct(logits_or_preds: torch.Tensor, labels: torch.Tensor,
                    group=None) -> torch.Tensor:
    """Per-sample exact match of the argmax at every answer position: (B,) bool.

    logits (B, T, V) or predictions (B, T); labels (B, T) with IGNORE_INDEX off the answer.
    Teacher-forced: position t is judged given the true tokens before it, which for the
    key's digits is the same as greedy decoding when every earlier digit is right.
    Under CP each rank holds a shard of the positions: pass the CP group and the per-sample
    counts are summed over it, so every CP rank returns the same verdict. Samples with no
    answer position anywhere (not a passkey batch) count as wrong.
    """
    preds = logits_or_preds
    if preds.dim() == labels.dim() + 1:
        preds = preds.argmax(dim=-1)
    answer = labels != IGNORE_INDEX                                       # (B, T)
    counts = torch.stack([((preds != labels) & answer).sum(-1), answer.sum(-1)])  # (2, B)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    wrong, n_answer = counts
    return (n_answer > 0) & (wrong == 0)


def passkey_accuracy(logits_or_preds: torch.Tensor, labels: torch.Tensor, group=None) -> float:
    """Fraction of samples whose key is predicted exactly (see passkey_correct)."""
    return passkey_correct(logits_or_preds, labels, group).float().mean().item()
