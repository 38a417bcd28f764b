"""The evaluation's head one tile of tokens at a time: per-token loss and greedy prediction
without the whole (tokens, V/tp) logits.

    losses, preds = tiled_eval_head(x, weight, labels, tp_group, tile_tokens="auto")

An evaluation needs each token's loss and, for answers scored by exact match, its argmax.
Made from whole logits that is (N, V/tp) in the model's dtype plus an fp32 exp of it, more
than a tiled-loss training step holds at long context. Here each tile's logits x_n W^T
(n, V/tp) exist only while that tile is worked on: the peak is one tile's logits and their
fp32 softmax (the tiled loss's tile size rule, ``loss_tile_tokens``), under no_grad.

Per token the numbers are those of the untiled path: the same vocab-parallel cross entropy
(tensor_parallel/cross_entropy.py) and vocab_parallel_argmax (first maximum wins, as
torch.argmax on the full row) on the same logits; only the matmul's blocking may differ
(fp32 rounding). Collective over tp_group: two all-reduces per tile for the loss, two for
the prediction, the same number of tiles on every rank of the group.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple, Union

import torch

from ctxpar.tensor_parallel.argmax import vocab_parallel_argmax
from ctxpar.tensor_parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy

from .tiled_loss import loss_tile_tokens


class HeadInputs(NamedTuple):
    """What a model hands an evaluation instead of logits: the final-normed hidden states
    (B, T/cp, d) and the head weight (V/tp, d)."""
    x: torch.Tensor
    weight: torch.Tensor


@torch.no_grad()
def tiled_eval_head(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    tp_group=None, tile_tokens: Union[int, str] = "auto",
                    ignore_index: int = IGNORE_INDEX) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-token fp32 losses (...), 0 where ignored; greedy global ids (...)).

    x (..., d) the head's input (replicated over TP); weight (V/tp, d) the head weight (the
    tied embedding or lm_head, no bias); labels (...) global ids, ``ignore_index`` = no loss.
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.shape[:-1] != labels.shape:
        raise ValueError(
            f"evaluation head: x {tuple(x.shape)}, head weight {tuple(weight.shape)} and "
            f"labels {tuple(labels.shape)} do not fit (x (..., d), weight (V/tp, d), "
            "labels (...))")
    rows, target = x.reshape(-1, x.shape[-1]), labels.reshape(-1)
    tile = loss_tile_tokens(rows.shape[0], weight.shape[0], weight.shape[1], tile_tokens)
    losses = torch.empty(target.shape, dtype=torch.float32, device=x.device)
    preds = torch.empty(target.shape, dtype=torch.long, device=x.device)
    for start in range(0, rows.shape[0], tile):
        end = min(start + tile, rows.shape[0])
        logits = rows[start:end] @ weight.t()  # (n, V/tp), this tile's only
        losses[start:end] = vocab_parallel_cross_entropy(logits, target[start:end], tp_group,
                                                         ignore_index)
        preds[start:end] = vocab_parallel_argmax(logits, tp_group)
        del logits
    return losses.view(labels.shape), preds.view(labels.shape)
