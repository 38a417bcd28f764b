"""Sparse MLA over each query's selected tokens, over a CP group (DeepSeek sparse attention).

MLA in its single-latent form (DeepSeek-V2 section 2.1.2's weight absorption): with
W = kv_b_proj.weight split per head into W_k (dn, R) and W_v (dv, R),

    qa_h = [q_nope_h @ W_k_h ; q_rot_h]             (B, s, H, R + dr)   ``absorb``
    score(s, t) = scale * qa_h(s) . latent(t)        = q_h . k_h(t) of the expanded form
    o_h = sum_t p_h(s, t) c_kv(t)                    (B, s, H, R)
    out_h = o_h @ W_v_h^T                            (B, s, H, dv)       ``values_out``

so the keys and values of a token are its latent row itself, shared by every head: a
query's selected tokens are gathered as latent rows (R + dr each), never expanded. absorb
and values_out are plain autograd (their gradients reach q and W); ``SparseLatentCore``
is the attention between them: latent blocks travel (dsa_stream), each visiting block is
used only at the (query, key) pairs its queries selected (dsa_pairs.Selection), merged by
log-sum-exp (merge.py). Backward visits the same pairs with the global out and lse
(blocks.backward_block's rule), the latent's fp32 gradient travelling home with the blocks.
A block none of a tile's queries selected costs nothing; one none of the rank's queries
selected is counted in cp_stats as a skipped block.
"""
from __future__ import annotations

import torch

from .dsa_pairs import Selection, key_grad, pair_dot, pair_values, scatter_keys_, tile_keys
from .dsa_stream import stream_blocks, stream_blocks_back
from .merge import merge_block_
from .stats import attention_flops, record


def _head_weights(weight, dims, heads):
    """(W_k (H, dn, R), W_v (H, dv, R)) of kv_b_proj.weight (H (dn + dv), R)."""
    w = weight.unflatten(0, (heads, dims.kv_b_rows_per_head))
    return w.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=1)


def absorb(q: torch.Tensor, weight: torch.Tensor, dims) -> torch.Tensor:
    """q (B, s, H, dn + dr) -> qa (B, s, H, R + dr) = [q_nope W_k ; q_rot] per head."""
    w_k, _ = _head_weights(weight, dims, q.shape[2])
    q_nope, q_rot = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    return torch.cat((torch.einsum("bshd,hdr->bshr", q_nope, w_k), q_rot), dim=-1)


def values_out(o_latent: torch.Tensor, weight: torch.Tensor, dims) -> torch.Tensor:
    """o (B, s, H, R) -> out (B, s, H, dv) = o W_v^T per head."""
    _, w_v = _head_weights(weight, dims, o_latent.shape[2])
    return torch.einsum("bshr,hvr->bshv", o_latent, w_v)


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse) (B, Q, H, K) with lse (B, Q, H); 0 at -inf scores, also where the
    row saw no key at all (lse -inf)."""
    return (scores - lse[..., None]).exp().nan_to_num_(nan=0.0)


def _tile_scores(qa, keys, tile, scale):
    scores = pair_dot(qa[:, tile.qs].float(), keys) * scale                 # (B, Q, H, K)
    return scores.masked_fill_(~tile.valid[:, :, None], float("-inf"))


def _flops(qa, r: int, tile, phase: str) -> int:
    B, _, H, C = qa.shape
    return attention_flops(1, H, (C + r) / 2, int(tile.valid.sum()) * (B // tile.valid.shape[0]),
                           phase)


def sparse_forward(qa, latent, sel: Selection, group, comm, r: int, scale: float,
                   q_tile: int):
    """(o (B, s, H, R) fp32, lse (B, H, s) fp32) of the selected pairs, blocks streamed."""
    B, s, H, _ = qa.shape
    out = torch.zeros(B, s, H, r, dtype=torch.float32, device=qa.device)
    lse = torch.full((B, H, s), float("-inf"), dtype=torch.float32, device=qa.device)

    def visit(src, blocks):
        used = False
        for tile in sel.tiles(src, q_tile):
            keys = tile_keys(blocks[0], tile).float()                        # (B, Q, K, C)
            scores = _tile_scores(qa, keys, tile, scale)
            tile_lse = scores.logsumexp(-1)                                   # (B, Q, H)
            p = _probabilities(scores, tile_lse)
            merge_block_(out[:, tile.qs], lse[:, :, tile.qs], pair_values(p, keys[..., :r]),
                         tile_lse.transpose(1, 2))
            record(fwd_flops=_flops(qa, r, tile, "fwd"), fwd_blocks=1)
            used = True
        if not used:
            record(fwd_blocks_skipped=1)

    stream_blocks((latent,), group, comm, visit)
    return out, lse


def sparse_backward(do, qa, latent, out, lse, sel: Selection, group, comm, r: int,
                    scale: float, q_tile: int):
    """(d qa fp32, d latent fp32) of the same pairs, exact block shares by the global lse."""
    delta = (do * out).sum(-1)                                                # (B, s, H)
    dqa = torch.zeros(qa.shape, dtype=torch.float32, device=qa.device)
    row_lse = lse.transpose(1, 2)                                             # (B, s, H)

    def visit(src, blocks):
        grad = None
        for tile in sel.tiles(src, q_tile):
            keys = tile_keys(blocks[0], tile).float()
            qs, qt, dt = tile.qs, qa[:, tile.qs].float(), do[:, tile.qs]
            p = _probabilities(_tile_scores(qa, keys, tile, scale), row_lse[:, qs])
            ds = p * (pair_dot(dt, keys[..., :r]) - delta[:, qs, :, None])     # (B, Q, H, K)
            dqa[:, qs] += pair_values(ds, keys) * scale
            g = key_grad(ds, qt, dense=False) * scale                         # (B, Q, K, C)
            g[..., :r] += key_grad(p, dt, dense=False)
            grad = torch.zeros(latent.shape, dtype=torch.float32, device=latent.device) \
                if grad is None else grad
            scatter_keys_(grad, tile, g)
            record(bwd_flops=_flops(qa, r, tile, "bwd"), bwd_blocks=1)
        if grad is None:
            record(bwd_blocks_skipped=1)
        return grad

    dlat = stream_blocks_back((latent,), group, comm, visit)
    return dqa, dlat


class SparseLatentCore(torch.autograd.Function):
    """(o (B, s, H, R) in qa's dtype, lse (B, H, s) fp32, not differentiable) of attention
    of qa over the selected latent rows. Saved: qa, the latent, o, lse and the Selection
    (int tensors); the gathered rows are made again in backward."""

    @staticmethod
    def forward(ctx, qa, latent, sel, group, comm, r, scale, q_tile):
        out, lse = sparse_forward(qa, latent, sel, group, comm, r, scale, q_tile)
        ctx.save_for_backward(qa, latent, out, lse)
        ctx.args = (sel, group, comm, r, scale, q_tile)
        ctx.mark_non_differentiable(lse)
        return out.to(qa.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qa, latent, out, lse = ctx.saved_tensors
        dqa, dlat = sparse_backward(dout.float(), qa, latent, out, lse, *ctx.args)
        return dqa.to(qa.dtype), dlat.to(latent.dtype), None, None, None, None, None, None
