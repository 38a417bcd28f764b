"""The lightning indexer's training loss over a CP group (DeepSeek-V3.2 report, section 2.1).

Per query s, over its set T(s) (dense warm-up: every visible token; sparse stage: its
selected tokens), with p the main attention's distribution summed over heads and
L1-normalised (main detached) and I the indexer's scores:

    p[s, t] = (1/H) sum_h exp(score_h(s, t) - lse_h(s))        lse_h: the main attention's
    KL[s]   = sum_t p log p - sum_t p I + psum * LSE_t(I)       psum = sum_t p (= 1)

Forward, one pass over the blocks (dsa_stream: the latent and the indexer key travel
together): per tile the main scores in the absorbed form (dsa_attention.absorb) and the
indexer's (dsa_indexer.tile_index_scores), accumulating sum p log p, sum p I, psum, and
the indexer's LSE by logaddexp: its log-softmax through its own LSE merge, so p and I
never exist beyond one tile. Backward, a second pass: dKL/dI = psum softmax(I) - p, then
through I = sum_h w_h relu(scale q_h . k) to the indexer's q, weights (this rank's rows)
and keys (their fp32 gradient travels home with the blocks, as the latent's does).

Under TP (tp_group): the main heads' p and the indexer heads' I are this rank's heads'
partial sums, all-reduced over TP per tile before use; the gradients of index_q and
index_weights are then this rank's heads', and index_k's a partial sum over heads that
the caller reduces over TP (as for any input of a head-split layer).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dsa_attention import _probabilities
from .dsa_indexer import RunningTopK, tile_index_scores
from .dsa_pairs import key_grad, pair_dot, pair_values, scatter_keys_, tile_keys
from .dsa_stream import stream_blocks, stream_blocks_back


class _Pass:
    """What both passes share: the inputs, the tiles of a block, p and I of a tile."""

    def __init__(self, qa, main_lse, index_q, index_weights, tiles, scale, index_scale,
                 heads_total, tp_group):
        self.qa, self.row_lse = qa, main_lse.transpose(1, 2)                  # (B, s, H)
        self.index_q, self.index_weights, self.tiles = index_q, index_weights, tiles
        self.scale, self.index_scale = scale, index_scale
        self.heads_total, self.tp_group = heads_total, tp_group

    def p_and_i(self, tile, latent, index_k):
        """(p (B, Q, K), I (B, Q, K) with 0 where invalid, valid (B|1, Q, K))."""
        i = tile_index_scores(self.index_q, self.index_weights, index_k, tile,
                              self.index_scale, self.tp_group)
        return self.p(tile, latent), i.masked_fill(~tile.valid, 0.0), tile.valid

    def p(self, tile, latent):
        """The main attention's p (B, Q, K) of a tile, summed over every head / H_total."""
        keys = tile_keys(latent, tile).float()
        scores = pair_dot(self.qa[:, tile.qs].float(), keys) * self.scale     # (B, Q, H, K)
        scores.masked_fill_(~tile.valid[:, :, None], float("-inf"))
        p = _probabilities(scores, self.row_lse[:, tile.qs]).sum(2)           # (B, Q, K)
        if self.tp_group is not None:
            dist.all_reduce(p, group=self.tp_group)
        return p / self.heads_total


def kl_forward(ps: _Pass, latent, index_k, group, comm):
    """(kl (B, s) fp32, psum (B, s), index lse (B, s)): one pass over the blocks."""
    B, s = ps.qa.shape[:2]
    # fp64 sums: KL is a small difference of O(1) terms (sum p I against LSE(I))
    zeros = lambda: torch.zeros(B, s, dtype=torch.float64, device=ps.qa.device)  # noqa: E731
    plogp, pi, psum = zeros(), zeros(), zeros()
    lse = torch.full((B, s), float("-inf"), dtype=torch.float64, device=ps.qa.device)

    def visit(src, blocks):
        for tile in ps.tiles(src):
            p, i, valid = (x.double() for x in ps.p_and_i(tile, blocks[1], blocks[0]))
            valid = valid.bool()
            qs = tile.qs
            plogp[:, qs] += torch.xlogy(p, p).sum(-1)
            pi[:, qs] += (p * i).sum(-1)
            psum[:, qs] += p.sum(-1)
            lse[:, qs] = torch.logaddexp(lse[:, qs],
                                         i.masked_fill(~valid, float("-inf")).logsumexp(-1))

    stream_blocks((index_k, latent), group, comm, visit)
    kl = plogp - pi + torch.where(psum > 0, psum * lse, 0.0)
    return kl.float(), psum.float(), lse.float()


def kl_backward(dkl, ps: _Pass, latent, index_k, psum, lse, group, comm):
    """(d index_q, d index_weights, d index_k), fp32: the second pass."""
    diq = torch.zeros(ps.index_q.shape, dtype=torch.float32, device=dkl.device)
    dw = torch.zeros(ps.index_weights.shape, dtype=torch.float32, device=dkl.device)

    def visit(src, blocks):
        grad = None
        for tile in ps.tiles(src):
            p, i, valid = ps.p_and_i(tile, blocks[1], blocks[0])
            qs = tile.qs
            soft = (i - lse[:, qs, None]).exp().masked_fill(~valid, 0.0)
            di = dkl[:, qs, None] * (psum[:, qs, None] * soft - p)            # (B, Q, K)
            keys = tile_keys(blocks[0], tile).float()
            iq = ps.index_q[:, qs].float()
            dots = pair_dot(iq, keys) * ps.index_scale                        # (B, Q, Hi, K)
            dw[:, qs] += torch.einsum("bqk,bqhk->bqh", di, dots.relu())
            dr = di[:, :, None] * ps.index_weights[:, qs, :, None].float() * (dots > 0)
            diq[:, qs] += pair_values(dr, keys) * ps.index_scale
            g = key_grad(dr, iq, dense=tile.rows is None) * ps.index_scale
            grad = torch.zeros(index_k.shape, dtype=torch.float32, device=dkl.device) \
                if grad is None else grad
            scatter_keys_(grad, tile, g)
        return grad

    dk = stream_blocks_back((index_k, latent), group, comm, visit)
    return diq, dw, dk


class IndexerKL(torch.autograd.Function):
    """kl (B, s) fp32 of the indexer against the detached main attention; gradients to
    index_q, index_k, index_weights only."""

    @staticmethod
    def forward(ctx, index_q, index_k, index_weights, qa, latent, main_lse, tiles, group,
                comm, scale, index_scale, heads_total, tp_group):
        ps = _Pass(qa, main_lse, index_q, index_weights, tiles, scale, index_scale,
                   heads_total, tp_group)
        kl, psum, lse = kl_forward(ps, latent, index_k, group, comm)
        ctx.save_for_backward(index_q, index_k, index_weights, qa, latent, main_lse, psum, lse)
        ctx.args = (tiles, scale, index_scale, heads_total, tp_group, group, comm)
        return kl

    @staticmethod
    def backward(ctx, dkl):
        index_q, index_k, index_weights, qa, latent, main_lse, psum, lse = ctx.saved_tensors
        tiles, scale, index_scale, heads_total, tp_group, group, comm = ctx.args
        ps = _Pass(qa, main_lse, index_q, index_weights, tiles, scale, index_scale,
                   heads_total, tp_group)
        diq, dw, dk = kl_backward(dkl.float(), ps, latent, index_k, psum, lse, group, comm)
        return (diq.to(index_q.dtype), dk.to(index_k.dtype), dw.to(index_weights.dtype),
                *([None] * 10))


def main_topk_recall(ps: _Pass, latent, indices, positions, k: int, group, comm):
    """(B, s) fp32: the share of each query's top-k keys by the main attention's p
    (streamed as the indexer's top-k, dsa_indexer.RunningTopK) that `indices` holds."""
    B, s = ps.qa.shape[:2]
    top = RunningTopK(B, s, k, positions.n, ps.qa.device)

    def visit(src, blocks):
        for tile in ps.tiles(src):
            top.add(tile, ps.p(tile, blocks[0]), positions.pos[src][tile.ks])

    stream_blocks((latent,), group, comm, visit)
    main = top.positions()                                                    # (B, s, k)
    mine = indices.sort(-1).values
    at = torch.searchsorted(mine, main.clamp_min(0)).clamp_max(mine.shape[-1] - 1)
    hit = (torch.gather(mine, -1, at) == main) & (main >= 0)
    return hit.sum(-1).float() / (main >= 0).sum(-1).clamp_min(1).float()
