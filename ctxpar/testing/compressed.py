"""DeepSeek-V4 attention around ctxpar's compressed cores, for tests and benchmarks.

    out, indices = csa_layer(attn, hidden, pos, cp_group=g, layout="zigzag", comm="ring")

``attn`` is a transformers ``DeepseekV4Attention`` of a "compressed_sparse_attention" layer
(it comes in as an argument; nothing here imports transformers): its own projections,
norms and RoPE make the core's inputs from the hidden states of the tokens at global
positions ``pos``, ``csa_attention`` runs the core over the CP group, and the output goes
back through the inverse RoPE and the grouped output projection, as
``DeepseekV4Attention.forward`` does, so the layer's output and every weight's gradient
compare with transformers' on the same weights (``close``: the tests' fp32 tolerance).
``sent_bytes`` counts, from the layout and the documents alone, what a compressed layer's
ranks send (``call_bytes``: one call, documents per sample).
"""
from __future__ import annotations

from typing import Callable, List

import torch

from ctxpar.context_parallel.comm import group_rank_and_size
from ctxpar.context_parallel.compressed_sparse import csa_attention
from ctxpar.context_parallel.csa_indexer import IndexerInputs
from ctxpar.context_parallel.halo import halo_tokens
from ctxpar.context_parallel.layouts import rank_positions


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 1e-5: relative, and absolute against the tensor's largest entry (the weights'
    gradients sum over every token)."""
    torch.testing.assert_close(got, want, rtol=1e-5,
                               atol=1e-5 * max(1.0, want.abs().max().item()))


def entry_rope(rotary: torch.nn.Module, apply_rope: Callable) -> Callable:
    """The compressor's RoPE at the entries' positions (x (B, T, d), positions (T,)):
    rotary a DeepseekV4RotaryEmbedding, apply_rope transformers' apply_rotary_pos_emb."""
    def rope(x, pos):
        cos, sin = rotary(x, position_ids=pos[None].expand(x.shape[0], -1),
                          layer_type="compress")
        return apply_rope(x.unsqueeze(1), cos, sin).squeeze(1)
    return rope


def csa_layer(attn, hidden: torch.Tensor, pos: torch.Tensor, apply_rope: Callable, *,
              cp_group=None, layout: str = "contiguous", comm: str = "ring",
              backend: str = "math", cu_seqlens=None, reset_positions: bool = True,
              tp_group=None, core_only: bool = False):
    """(DeepseekV4Attention's output (B, S, hidden) of the tokens at pos, the indexer's
    indices (B, S, k)); hidden (B, S, hidden) those tokens' hidden states; pos (S,) or
    (B, S) their RoPE positions (restarting at each document with reset_positions).
    tp_group: this rank's share of the attention heads (q, sinks) and of the indexer's
    heads (q, weights) over it, as a TP layer holds them; core_only: the core's output
    (B, S, heads, D) after the inverse RoPE, before the output projection."""
    cfg, comp = attn.config, attn.compressor
    indexer = comp.indexer
    B, S, _ = hidden.shape
    H, D, Hi, Di = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, \
        cfg.index_head_dim
    tp_rank, tp_size = group_rank_and_size(tp_group) if tp_group is not None else (0, 1)
    heads = slice(tp_rank * H // tp_size, (tp_rank + 1) * H // tp_size)
    index_heads = slice(tp_rank * Hi // tp_size, (tp_rank + 1) * Hi // tp_size)
    pos = pos if pos.dim() == 2 else pos[None].expand(B, -1)
    cos, sin = attn.compressor.rotary_emb(hidden, position_ids=pos,
                                          layer_type="compress")
    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(B, S, H, D))[:, :, heads]
    q = apply_rope(q, cos, sin, unsqueeze_dim=2)                          # (B, S, H, D)
    kv = apply_rope(attn.kv_norm(attn.kv_proj(hidden)).unsqueeze(2), cos, sin,
                    unsqueeze_dim=2).squeeze(2)                          # (B, S, D)
    index_q = apply_rope(indexer.q_b_proj(q_residual).view(B, S, Hi, Di)[:, :, index_heads],
                         cos, sin, unsqueeze_dim=2)
    index_weights = indexer.scorer.weights_proj(hidden).float()[..., index_heads] * Hi ** -0.5
    inputs = IndexerInputs(index_q, index_weights, indexer.kv_proj(hidden),
                           indexer.gate_proj(hidden), indexer.position_bias,
                           indexer.kv_norm.weight)
    out, indices = csa_attention(
        q, kv, comp.kv_proj(hidden), comp.gate_proj(hidden), comp.position_bias,
        comp.kv_norm.weight, attn.sinks[heads], inputs, sliding_window=cfg.sliding_window,
        compress_rate=comp.compress_rate, index_topk=cfg.index_topk,
        entry_rope=entry_rope(comp.rotary_emb, apply_rope), cp_group=cp_group,
        layout=layout, comm=comm, norm_eps=cfg.rms_norm_eps, backend=backend,
        return_indices=True, cu_seqlens=cu_seqlens, reset_positions=reset_positions,
        tp_group=tp_group)
    out = apply_rope(out, cos, -sin, unsqueeze_dim=2)                    # undo V's RoPE
    if core_only:
        return out, indices
    grouped = attn.o_a_proj(out.reshape(B, S, cfg.o_groups, -1)).flatten(2)
    return attn.o_b_proj(grouped), indices


def windows_by_rule(n: int, m: int, overlap: bool, cu=None) -> List[tuple]:
    """[(first position read, last position)] of every entry's window, in entry order,
    straight from the rule (compressed_windows.py): each document [s, e) cut into windows
    [s + w*m, s + (w+1)*m), CSA's overlap reading the previous window of the same
    document only."""
    bounds = [0, n] if cu is None else [int(c) for c in cu]
    return [(s + w * m - (m if overlap and w else 0), s + (w + 1) * m - 1)
            for s, e in zip(bounds[:-1], bounds[1:]) for w in range((e - s) // m)]


def sent_bytes(P: int, layout: str, S: int, rank: int, m: int, overlap: bool,
               window_tokens: tuple, batch: int, widths: List[int], element: int = 4,
               cu=None):
    """(forward, backward) bytes `rank` of P sends for a compressed layer, from the layout
    alone: for each compressor of entry width d in `widths` (the first the attention's,
    with a backward; the others the indexer's, forward only), the entries' all-gather
    (padded to the largest share, P - 1 copies) and its halo: the rows an entry reads that
    another rank than the one ending its window holds (windows_by_rule: documents cu, one
    tensor for the batch, or None), kv and gate of 2d (overlap) or d numbers each. Then
    the sliding window's K,V halo: window_tokens = (sent, received) tokens
    (halo.halo_tokens), K = V as two rows, its gradients back in fp32. Backward: the
    entries' reduce-scatter, the received halo rows' gradients back (fp32), the window's
    halo again and its gradients."""
    n = S * P
    pos = [rank_positions(n, r, P, layout).tolist() for r in range(P)]
    holder = {p: r for r in range(P) for p in pos[r]}
    wins = windows_by_rule(n, m, overlap, cu)
    share = max(sum(1 for _, end in wins if holder[end] == r) for r in range(P))
    remote = {(holder[end], q) for first, end in wins for q in range(first, end)
              if holder[q] != holder[end]}                     # (receiving rank, row)
    halo_sent = sum(1 for _, q in remote if holder[q] == rank)
    halo_recv = sum(1 for r, _ in remote if r == rank)
    window_sent, window_recv = window_tokens
    kv_rows = 2 * batch * widths[0] * element
    fwd = window_sent * kv_rows
    for d in widths:
        row = batch * 2 * (2 * d if overlap else d) * element
        fwd += (P - 1) * batch * share * d * element + halo_sent * row
    row = batch * 2 * (2 * widths[0] if overlap else widths[0]) * 4
    bwd = (P - 1) * batch * share * widths[0] * element + halo_recv * row + \
        (window_sent + window_recv) * kv_rows
    return fwd, bwd


def call_bytes(P: int, layout: str, S: int, rank: int, m: int, overlap: bool, batch: int,
               widths: List[int], sliding_window: int, cu=None):
    """sent_bytes of one core call with documents cu (per-sample boundary lists, or
    None); where the samples' documents differ, the sum of the sample-by-sample calls'
    (the cores run them one by one)."""
    calls = [(batch, None)] if cu is None else [(batch, cu[0])] \
        if all(c == cu[0] for c in cu) else [(1, c) for c in cu]
    fwd = bwd = 0
    for b, c in calls:
        window = halo_tokens(layout, rank, P, S, sliding_window=sliding_window,
                             cu_seqlens=None if c is None else torch.tensor(c))
        one = sent_bytes(P, layout, S, rank, m, overlap, window, b, widths, cu=c)
        fwd, bwd = fwd + one[0], bwd + one[1]
    return fwd, bwd
