"""One training step of a GPT on one rank of a parallel grid, for the parity tests."""
from __future__ import annotations

import torch


def grid_step(model, st, tokens: torch.Tensor, labels: torch.Tensor, rows: slice,
              layout: str, cu_seqlens=None) -> dict:
    """This rank's rows of (tokens, labels) (B, T), sharded over CP in `layout`: the
    whole logits (gathered over TP and CP, no grad), then the token-mean loss's backward
    with the gradients reduced as DeepSpeed does over DP x CP. {rows, logits, loss}."""
    from ctxpar import gather_sequence, sequence_positions, shard_sequence
    from ctxpar.tensor_parallel import gather_from_tensor_model_parallel_region
    from models.loss import (deepspeed_style_reduce_, global_mean_loss, global_token_count,
                             loss_for_backward)
    tok, lab = (shard_sequence(t[rows], 1, st.cp_group, layout) for t in (tokens, labels))
    pos = sequence_positions(tokens.shape[1], st.cp_group, layout)
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(
            model(tok, pos, cu_seqlens=cu_seqlens), st.tp_group)
        logits = gather_sequence(logits, 1, st.cp_group, layout)
    n_tokens = global_token_count(lab, st.dp_cp_group)
    loss_sum = model(tok, pos, lab, cu_seqlens=cu_seqlens)
    loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
    deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
    return dict(rows=rows, logits=logits,
                loss=global_mean_loss(loss_sum, n_tokens, st.dp_cp_group))
