"""The shifted inputs of model.mtp's depths, cut from the whole sample the data pipeline
holds, so no CP rank asks another for them (whatever the layout, ids and targets of any
position are already on every rank before sharding: no communication, exact).

Depth k (1..D) at position i needs the id t_{i+k} (the embedding it mixes with h^{k-1}_i)
and the target t_{i+k+1}. With inputs t_0..t_{T-1} and labels[i] = t_{i+1} (-100 where
not trained on):

    mtp_tokens[:, k-1, i] = tokens[:, i+k]        0 where i+k >= T
    mtp_labels[:, k-1, i] = labels[:, i+k]        -100 where i+k >= T, or where t_{i+k+1}
                                                  is not in position i's document
                                                  (i+k+1 >= that document's end in
                                                  cu_seqlens, the sample's end counting
                                                  as one)

A label the LM loss ignores at i+k stays ignored (the same target). Masked positions are
the last k+1 of a document (the last k of a sample without documents): under causal,
document-masked attention no counted position sees them, so their (filler) ids change no
counted loss. Then ``shard_sequence`` on the last dim gives each rank its positions'
(B, D, T/cp), in the CP layout's order (loader.shard_batch).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

IGNORE_INDEX = -100


def document_ends(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(T,) the end (exclusive) of the document each position lies in."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[1:], lengths)[:seq_len]


def mtp_inputs(tokens: torch.Tensor, labels: torch.Tensor, depth: int,
               cu_seqlens: Optional[Sequence[torch.Tensor]] = None):
    """tokens, labels (B, T) -> (mtp_tokens, mtp_labels) (B, D, T) int64 (module
    docstring). cu_seqlens: each sample's document boundaries [0, ..., T] (None: one
    document per sample)."""
    B, T = tokens.shape
    i = torch.arange(T)
    out_tokens: List[torch.Tensor] = []
    out_labels: List[torch.Tensor] = []
    if cu_seqlens is None:
        ends = torch.full((B, T), T, dtype=torch.long)
    else:
        ends = torch.stack([document_ends(c, T) for c in cu_seqlens])  # (B, T)
    for k in range(1, depth + 1):
        ahead = (i + k).clamp(max=T - 1)  # (T,) i+k, held in range; masked below
        inside = (i + k < T).expand(B, T)
        out_tokens.append(torch.where(inside, tokens[:, ahead], 0))
        kept = inside & (i + k + 1 < ends) if cu_seqlens is not None else inside
        out_labels.append(torch.where(kept, labels[:, ahead], IGNORE_INDEX))
    return torch.stack(out_tokens, 1), torch.stack(out_labels, 1)
