"""A dynamic-CP pack as a micro-batch: its documents packed, padded and cut to this rank.

A document of m stored tokens (EOS last, ctxpar/data/indexed.py) trains on m - 1 inputs
and m - 1 next-token labels: ``document_tokens`` is that count, the length the schedule
places. A pack's documents go back to back in the schedule's order, then padding to the
pack's length (the layout's chunks over its ranks) as one more document whose labels are
ignored; attention stays inside each document and RoPE positions restart at each
(document masking, Megatron's reset_attention_mask and reset_position_ids).

    full = pack_sequence([dataset[i] for i in step_docs[list(pack.docs)]], pack.length)
    tile = groups.tile_groups(pack.first, pack.size)   # and model.use_cp_group(*tile)
    local = shard_pack(full, tile.cp_group, layout, tile.ulysses)
    loss_sum = model(local["tokens"], local["positions"], local["labels"],
                     cu_seqlens=local["cu_seqlens"])
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np
import torch

from ..context_parallel.documents import document_positions
from ..context_parallel.layouts import sequence_positions, shard_sequence
from ..data.passkey import IGNORE_INDEX


def document_tokens(stored: np.ndarray) -> np.ndarray:
    """Inputs (and labels) per document from the stored lengths (EOS included): m - 1."""
    return np.asarray(stored, dtype=np.int64) - 1


def pack_sequence(documents: Sequence[np.ndarray], length: int,
                  pad_id: int = 0) -> Dict[str, torch.Tensor]:
    """tokens, labels (1, length) int64 and cu_seqlens (int32, the documents' boundaries
    and the padding's) of documents (each its stored tokens, EOS last) packed in order."""
    inputs = [torch.as_tensor(np.asarray(d[:-1], dtype=np.int64)) for d in documents]
    labels = [torch.as_tensor(np.asarray(d[1:], dtype=np.int64)) for d in documents]
    n = sum(len(x) for x in inputs)
    if n > length:
        raise ValueError(f"pack_sequence: {n} tokens do not fit a pack of {length}")
    bounds = np.cumsum([0] + [len(x) for x in inputs] + ([length - n] if length > n else []))
    tokens = torch.cat(inputs + [torch.full((length - n,), pad_id, dtype=torch.int64)])
    labels = torch.cat(labels + [torch.full((length - n,), IGNORE_INDEX, dtype=torch.int64)])
    return {"tokens": tokens[None], "labels": labels[None],
            "cu_seqlens": torch.as_tensor(bounds, dtype=torch.int32)}


def shard_pack(full: Dict[str, torch.Tensor], group, layout: str,
               ulysses: int = 1) -> Dict[str, torch.Tensor]:
    """This rank's share of a packed sequence over the pack's group (LOCAL for one rank):
    tokens, labels (1, length/size), positions restarting at each document (1, length/size),
    and cu_seqlens as a one-sample list (the attention's, on the host). ulysses: hybrid's
    Ulysses degree in the group (its two-level layout, layouts.py), 1 otherwise."""
    length = full["tokens"].shape[1]
    cu = full["cu_seqlens"]
    return {"tokens": shard_sequence(full["tokens"], 1, group, layout, ulysses),
            "labels": shard_sequence(full["labels"], 1, group, layout, ulysses),
            "positions": document_positions(
                [cu], sequence_positions(length, group, layout, ulysses=ulysses)),
            "cu_seqlens": [cu]}
