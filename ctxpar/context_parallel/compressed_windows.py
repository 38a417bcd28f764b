"""The compressed windows of DeepSeek-V4's compressors, packed documents included: which
entries a sequence has, where each one's tokens are, and which entries a query sees.

Without documents the sequence of n tokens has n // m windows [w*m, (w+1)*m) (a trailing
partial window makes no entry), as transformers' compressors cut it. With packed documents
(``cu_seqlens``, flash-attn's varlen boundaries of the full sequence) the windows restart
at each document's start, so that every document is compressed exactly as transformers'
``DeepseekV4Attention`` run on that document alone:

    document d = [s_d, e_d) has (e_d - s_d) // m windows [s_d + w*m, s_d + (w+1)*m)
    CSA's overlap (the previous window's series) stops at the document's first window
    a query at t in document d sees that document's windows w < (t - s_d + 1) // m only

An entry never mixes documents, a document shorter than m has none, and entries are
numbered in position order over the whole sequence (document by document), which is the
order of their windows' last tokens too: the rank ending a window makes its entry
(compressor.py). Each entry is RoPE-rotated at its window's first position as the model
counts positions: s_d + w*m, or w*m when positions restart at each document
(``reset_positions``, documents.document_positions), so that q . entry sees the same
relative distance as the model's q and kv.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from .documents import doc_ids


class Windows(NamedTuple):
    """The complete windows of one sequence (all samples of the batch share them), in
    entry order."""

    starts: torch.Tensor      # (N,) int64 global position of each window's first token
    first: torch.Tensor       # (N,) bool: its document's first window (no previous one)
    positions: torch.Tensor   # (N,) int64 RoPE position of the entry
    m: int

    def ending_in(self, start: int, length: int) -> Tuple[int, int]:
        """(first entry id, count) of the windows whose last token lies in
        [start, start + length)."""
        ends = self.starts + (self.m - 1)
        lo = int(torch.searchsorted(ends, start))
        return lo, int(torch.searchsorted(ends, start + length)) - lo

    def reach(self, entry: int, overlap: bool) -> int:
        """The first position entry `entry` reads: its window's, or with overlap (CSA)
        the previous window's of the same document."""
        back = self.m if overlap and not bool(self.first[entry]) else 0
        return int(self.starts[entry]) - back


def document_windows(cu: Optional[torch.Tensor], n: int, m: int,
                     reset_positions: bool = True) -> Windows:
    """The windows of a sequence of n tokens (cu: int64 boundaries 0 ... n, or None for
    one document); reset_positions: RoPE positions restart at each document."""
    cu = torch.tensor([0, n]) if cu is None else cu.to("cpu", torch.int64)
    starts, first, positions = [], [], []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        w = torch.arange((e - s) // m) * m                 # offsets in the document
        starts.append(s + w)
        first.append(w == 0)
        positions.append(w if reset_positions else s + w)
    return Windows(torch.cat(starts), torch.cat(first), torch.cat(positions), m)


def entry_ranges(cu: Optional[torch.Tensor], q_pos: torch.Tensor, m: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) (L,) int64: the query at global position t sees the entries lo <= w < hi,
    its document's complete windows before it (transformers' block_bias per document:
    w < (t - s_d + 1) // m counted in the document)."""
    q_pos = q_pos.to("cpu", torch.int64)
    if cu is None:
        return torch.zeros_like(q_pos), (q_pos + 1) // m
    cu = cu.to("cpu", torch.int64)
    before = torch.cat((cu.new_zeros(1), ((cu[1:] - cu[:-1]) // m).cumsum(0)))
    d = doc_ids(cu, q_pos)
    lo = before[d]
    return lo, lo + (q_pos - cu[d] + 1) // m


def visible(lo: torch.Tensor, hi: torch.Tensor, entries: int) -> torch.Tensor:
    """(L, entries) bool: lo <= w < hi per query row."""
    w = torch.arange(entries)[None, :]
    return (w >= lo[:, None]) & (w < hi[:, None])


def split_samples(docs: Optional[List[torch.Tensor]]) -> bool:
    """True when the samples' documents (validated boundaries) differ: the cores then run
    sample by sample (the entries, and so their count and visibility, are one set per
    call)."""
    return docs is not None and len({tuple(cu.tolist()) for cu in docs}) > 1
