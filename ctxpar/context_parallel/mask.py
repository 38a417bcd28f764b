"""What each query may see: one description every CP pattern, the block plan and the counters read.

    mask = AttentionMask(causal=True, sliding_window=4096, cu_seqlens=cu)
    out = context_parallel_attention(q, k, v, comm="ring", cp_group=g, mask=mask)
    mask = AttentionMask(causal=True, chunk_size=8192)            # Llama 4's chunked layers
    mask = AttentionMask(causal=True, sliding_window=128, sinks=s)  # gpt-oss, s (heads,)

Query at global position i sees key at position j iff all of these hold:

    causal          j <= i                     (else any j)
    sliding_window  i - j < sliding_window     transformers' ``sliding_window_overlay``
                                               (kv_idx > q_idx - sliding_window): the query
                                               itself counts, so it sees itself and the
                                               sliding_window - 1 keys before it; flash-attn's
                                               ``window_size=(sliding_window - 1, 0)``
    cu_seqlens      doc(i) == doc(j)           documents.py (the window runs inside each
                                               document: it never reaches a previous one)
    chunk_size      i // c == j // c           transformers' ``chunked_overlay`` (Llama 4's
                                               attention_chunk_size): fixed chunks of c
                                               tokens from position 0, i.e. documents cut
                                               every c tokens (inside any given documents)

Sinks (gpt-oss) hide nothing: each head h adds one more logit, sinks[h], with no value to
every query's softmax denominator (transformers' gpt-oss ``eager_attention_forward``
concatenates it as a last column and drops it after the softmax). With lse the
log-sum-exp over the visible keys, the result is

    out' = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)
    lse' = logaddexp(lse, sink)

applied once, after every block is merged (sinks.py), whatever the pattern.

A window is only defined on causal attention here (Mistral, Gemma, gpt-oss); a
bidirectional window is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionMask:
    """The mask of one attention call over the *full* (unsharded) sequence.

    causal: keys after the query are hidden (global positions, whatever the token layout).
    sliding_window: None = unlimited; else a query sees keys i - sliding_window < j <= i
        (transformers' ``sliding_window``, itself included).
    cu_seqlens: None, or document boundaries of the full sequence (flash-attn's varlen
        convention, int32): one 1-D tensor for the whole batch or a list of one per sample.
    chunk_size: None = no chunks; else a query sees only keys of its own chunk of
        chunk_size tokens (Llama 4's ``attention_chunk_size``), with or without causal.
    sinks: None, or a (heads,) float tensor of per-head sink logits over the *query*
        heads (gpt-oss' ``sinks`` parameter); differentiable, its gradient is this rank's
        share (its local queries; under Ulysses its heads), summed over the CP group by
        the usual gradient reduction like every other parameter's.
    """

    causal: bool = False
    sliding_window: Optional[int] = None
    cu_seqlens: object = None
    chunk_size: Optional[int] = None
    sinks: Optional[torch.Tensor] = None

    def __post_init__(self):
        for name in ("sliding_window", "chunk_size"):
            w = getattr(self, name)
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
                raise ValueError(f"{name}={w!r} must be a positive integer (or None)")
        w = self.sliding_window
        if w is not None and not self.causal:
            raise ValueError(f"sliding_window={w} needs causal=True (a bidirectional "
                             "window is not supported)")
        s = self.sinks
        if s is not None and (not isinstance(s, torch.Tensor) or s.dim() != 1
                              or not s.is_floating_point()):
            what = (f"shape {tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor)
                    else type(s).__name__)
            raise ValueError(f"sinks={what} must be a 1-D float tensor of one logit per "
                             "query head")

    @property
    def plain(self) -> bool:
        """True when nothing but causal (or full) decides the blocks: the fast block plan
        applies (sinks change no block)."""
        return (self.sliding_window is None and self.cu_seqlens is None
                and self.chunk_size is None)


def _pairs_before(x: int, window: Optional[int], chunk_size: Optional[int]) -> int:
    """Visible (query, key) pairs of the causal queries at positions [0, x): query i sees
    min(i + 1, window) keys, counted from its chunk's start under chunks."""
    def banded(m: int) -> int:  # sum over j < m of min(j + 1, window)
        if window is None or m <= window:
            return m * (m + 1) // 2
        return window * (window + 1) // 2 + (m - window) * window
    if chunk_size is None:
        return banded(x)
    return (x // chunk_size) * banded(chunk_size) + banded(x % chunk_size)


def visible_pairs(lo: int, hi: int, sliding_window: Optional[int] = None,
                  chunk_size: Optional[int] = None) -> int:
    """The exact count of visible (query, key) pairs of the causal queries at positions
    [lo, hi) of one sequence without documents (about (hi - lo) * w for a window w, c (c +
    1) / 2 per chunk of c, the triangle with no window): what the FLOP counters count, in
    closed form, for the planner and stats.square_pairs."""
    return _pairs_before(hi, sliding_window, chunk_size) \
        - _pairs_before(lo, sliding_window, chunk_size)


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]
                   ) -> torch.Tensor:
    """(Lq, Lk) bool: causal pairs (k <= q) that the window also leaves (q - k < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    vis = diff >= 0
    return vis if window is None else vis & (diff < window)


def with_chunks(cu: torch.Tensor, chunk_size: Optional[int]) -> torch.Tensor:
    """Document boundaries `cu` (int32, 0 ... n) with every multiple of chunk_size added:
    "same document and same chunk" is "same piece" of the union's cuts (both cut the
    sequence into intervals), so chunks reuse the whole document machinery."""
    if chunk_size is None:
        return cu
    n = int(cu[-1])
    cuts = torch.cat((cu.to(torch.int64), torch.arange(0, n, chunk_size)))
    return torch.unique(cuts).to(cu.dtype)  # sorted, n itself comes from cu


def dense_mask(seq_len: int, causal: bool, sliding_window: Optional[int] = None,
               cu: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None
               ) -> torch.Tensor:
    """(seq_len, seq_len) bool, True = visible: the whole mask, for tests and references."""
    pos = torch.arange(seq_len)
    vis = window_visible(pos, pos, sliding_window) if causal \
        else torch.ones(seq_len, seq_len, dtype=torch.bool)
    if cu is not None:
        ids = torch.searchsorted(cu.to(torch.int64)[1:], pos, right=True)
        vis = vis & (ids[:, None] == ids[None, :])
    if chunk_size is not None:
        vis = vis & (pos[:, None] // chunk_size == pos[None, :] // chunk_size)
    return vis
