"""What each query may see: one description every CP pattern, the block plan and the counters read.

    mask = AttentionMask(causal=True, sliding_window=4096, cu_seqlens=cu)
    out = context_parallel_attention(q, k, v, comm="ring", cp_group=g, mask=mask)

Query at global position i sees key at position j iff all of these hold:

    causal          j <= i                     (else any j)
    sliding_window  i - j < sliding_window     transformers' ``sliding_window_overlay``
                                               (kv_idx > q_idx - sliding_window): the query
                                               itself counts, so it sees itself and the
                                               sliding_window - 1 keys before it; flash-attn's
                                               ``window_size=(sliding_window - 1, 0)``
    cu_seqlens      doc(i) == doc(j)           documents.py (the window runs inside each
                                               document: it never reaches a previous one)

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
    """

    causal: bool = False
    sliding_window: Optional[int] = None
    cu_seqlens: object = None

    def __post_init__(self):
        w = self.sliding_window
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
                raise ValueError(f"sliding_window={w!r} must be a positive integer (or None)")
            if not self.causal:
                raise ValueError(f"sliding_window={w} needs causal=True (a bidirectional "
                                 "window is not supported)")

    @property
    def plain(self) -> bool:
        """True when the mask is only causal or only full: the fast block plan applies."""
        return self.sliding_window is None and self.cu_seqlens is None


def window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]
                   ) -> torch.Tensor:
    """(Lq, Lk) bool: causal pairs (k <= q) that the window also leaves (q - k < window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    vis = diff >= 0
    return vis if window is None else vis & (diff < window)


def dense_mask(seq_len: int, causal: bool, sliding_window: Optional[int] = None,
               cu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(seq_len, seq_len) bool, True = visible: the whole mask, for tests and references."""
    pos = torch.arange(seq_len)
    vis = window_visible(pos, pos, sliding_window) if causal \
        else torch.ones(seq_len, seq_len, dtype=torch.bool)
    if cu is not None:
        ids = torch.searchsorted(cu.to(torch.int64)[1:], pos, right=True)
        vis = vis & (ids[:, None] == ids[None, :])
    return vis
