"""The LM head and the vocab-parallel cross entropy one tile of tokens at a time.

The untiled loss holds (N, V/tp) logits and, for backward, their (N, V/tp) fp32 softmax
(N = B * T/cp tokens of a rank): 16K tokens x 128K vocabulary is 8.4 GB, the largest
activation of a long-context rank. Here the rows of x (N, d) are cut into tiles of n
tokens; each tile's logits x_n W^T (n, V/tp) exist only while that tile is worked on.

reduction 'sum' (the models' loss): the gradients are made in forward, for a unit upstream
gradient, as ALST's TiledFusedLogitsLoss and Liger-Kernel's fused linear cross entropy do:

    forward   per tile: logits, softmax over the whole vocabulary, the tile's loss,
              g = softmax - 1[i = t] (0 for ignored labels), dx_n = g W, dW += g^T x_n
              (three matmuls per tile); keep dx (N, d) and dW (V/tp, d) fp32, not x or W
    backward  dx and dW times the upstream gradient (a token mean, a loss scale, the
              accumulation of micro-batches: exact), in place

At TP > 1 each row's softmax needs the log-sum-exp over every rank's vocabulary slice
before any gradient: the forward makes all tiles' slice statistics, combines them over TP
once for the call (tensor_parallel/cross_entropy.py: an all-reduce MAX, then one SUM),
then makes each tile's logits again for g (four matmuls per tile, two all-reduces per
call instead of two per tile).

reduction 'none' (per-token losses, any per-token upstream gradient): forward makes the
per-token loss and fp32 log-sum-exp lse the same way and saves x, W, labels, lse; backward
makes each tile's logits again and g = (exp(z - lse) - 1[i = t]) * dloss per row.

W is the head weight (V/tp, d): the tied embedding or the untied lm_head; x enters through
f (copy_to_tensor_model_parallel_region), so dx is all-reduced over TP once for the whole
x, not per tile. dW is accumulated in fp32 over the tiles and cast once to W's dtype: one
rounding like the untiled matmul's. Each tile reuses one (n, V/tp) scratch buffer (two for
bf16: the logits in x's dtype, the softmax in fp32).

Bytes per rank, N tokens, n per tile, v = V/tp, b = bytes of x's and W's dtype (4 fp32,
2 bf16); the untiled loss for comparison:

                    tiled 'sum'                          untiled
    forward to      N*d*b (dx) + v*d*4 (dW, fp32)        N*d*b (x) + N*v*4 (softmax)
    backward                                             + N*10 (target columns)
    forward peak    n*v*4 (fp32: exp made in place);     N*v*b (logits) + N*v*4 (exp)
                    bf16: n*v*(2 + 4) + v*d*2 (a tile's
                    dW product before the fp32 sum)
    backward        nothing new (fp32: dW becomes the    N*v*4 (softmax, made the grad
                    head's gradient; bf16: its cast)     in place); bf16: + N*v*2 (cast)

The held fp32 dW is the price of three matmuls instead of four: v*d*4 from forward to
backward (2 GiB for Llama-3-8B's head at tp 1), as ALST and Liger hold; 'none' holds
x (N*d*b), labels (N*8) and lse (N*4) instead. On a pipeline's last stage DeepSpeed also
holds the stage's output until the next micro-batch: the untiled logits (N*v*b), here x
and W (nothing new).

The auto tile size (``loss_tile_tokens``) keeps n*V/tp close to N*d, at least 512 tokens.
"""
from __future__ import annotations

import math
from typing import Union

import torch

from ctxpar.tensor_parallel.cross_entropy import (IGNORE_INDEX, LocalStats, local_softmax_stats,
                                                  reduce_softmax_stats, softmax_grad_,
                                                  target_columns)
from ctxpar.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, tp_size_of

TILE_FLOOR = 512  # fewest tokens an 'auto' tile gets (docs/memory.md, "Tile sizes")
REDUCTIONS = ("none", "sum")


def loss_tile_tokens(rows: int, vocab_per_rank: int, d_model: int,
                     setting: Union[int, str] = "auto") -> int:
    """Tokens per loss tile for ``rows`` tokens on a rank (the planner calls this too).

    'auto': the budget is Liger-Kernel's fused linear cross entropy rule, a tile's logits
    about as many numbers as the hidden states, n = next power of two of
    ceil(rows / ceil(V/tp / d)); then at least TILE_FLOOR tokens (a tile reads the whole
    (V/tp, d) weight three times, so shorter tiles are bound by that read, not by their
    FLOPs), and at most rows. An integer is used as is (at most rows).
    16K tokens, V/tp 128K, d 4096: 512 tokens per tile, 32 tiles.
    """
    rows = max(rows, 1)
    if setting == "auto":
        ratio = math.ceil(vocab_per_rank / d_model)  # tile logits per hidden-state number
        n = max(TILE_FLOOR, 1 << (math.ceil(rows / ratio) - 1).bit_length())
    else:
        n = int(setting)
    return max(1, min(n, rows))


def _scratch(x: torch.Tensor, rows: int, vocab_per_rank: int):
    """(n, V/tp) tiles reused by every tile: the logits (and the gradient) in x's dtype and
    an fp32 one for the softmax; one buffer serves both when x is fp32."""
    buf = x.new_empty(rows, vocab_per_rank)
    return buf, buf if buf.dtype == torch.float32 else torch.empty_like(buf, dtype=torch.float32)


def _add_tile_grads(g32, g, x_t, weight, grad_x_t, grad_w):
    """One tile's gradient (n, V/tp) -> dx_t = g W into grad_x_t, dW += g^T x_t (fp32)."""
    if g is not g32:
        g.copy_(g32)  # in x's dtype for the matmuls
    if grad_x_t is not None:
        torch.mm(g, weight, out=grad_x_t)  # (n, d)
    if grad_w is not None:
        if weight.dtype == torch.float32:
            grad_w.addmm_(g.t(), x_t)  # (V/tp, d)
        else:
            grad_w += g.t() @ x_t


def _recomputed_grads(x, weight, target, lse, scale, group, ignore_index, tile, want_x, want_w):
    """Per tile: the logits again, g = (exp(z - lse) - 1[i = t]) * scale (0 for ignored
    labels), dx and the fp32 dW sum. scale: per token (N,) or a 0-d tensor."""
    n_rows, vocab_per_rank = x.shape[0], weight.shape[0]
    grad_x = torch.empty_like(x) if want_x else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32,
                         device=weight.device) if want_w else None
    buf, buf32 = _scratch(x, min(tile, n_rows), vocab_per_rank)
    for s in range(0, n_rows, tile):
        e = min(s + tile, n_rows)
        logits = torch.mm(x[s:e], weight.t(), out=buf[:e - s])
        probs = buf32[:e - s].copy_(logits) if buf32 is not buf else logits
        probs.sub_(lse[s:e].unsqueeze(-1)).exp_()  # softmax = exp(z - lse)
        cols = target_columns(target[s:e], vocab_per_rank, group, ignore_index)
        g32 = softmax_grad_(probs, cols, scale[s:e] if scale.dim() else scale)
        _add_tile_grads(g32, buf[:e - s], x[s:e], weight,
                        grad_x[s:e] if want_x else None, grad_w)
    return grad_x, grad_w


def _tile_stats(x, weight, target, group, ignore_index, tile):
    """The per-token loss and lse (N,) fp32: each tile's statistics on this rank's slice,
    combined over TP once for all rows."""
    n_rows, vocab_per_rank = x.shape[0], weight.shape[0]
    z_max, sum_exp, z_t = (torch.empty(n_rows, dtype=torch.float32, device=x.device)
                           for _ in range(3))
    buf, buf32 = _scratch(x, min(tile, n_rows), vocab_per_rank)
    for s in range(0, n_rows, tile):
        e = min(s + tile, n_rows)
        logits = torch.mm(x[s:e], weight.t(), out=buf[:e - s])
        z = buf32[:e - s].copy_(logits) if buf32 is not buf else logits
        cols = target_columns(target[s:e], vocab_per_rank, group, ignore_index)
        z_max[s:e], sum_exp[s:e], z_t[s:e] = local_softmax_stats(z, cols)
    lse, z_t = reduce_softmax_stats(LocalStats(z_max, sum_exp, z_t), group)
    valid = target != ignore_index
    return (lse - z_t).masked_fill(~valid, 0.0), lse


class _TiledVocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses; backward recomputes each tile's logits (four matmuls per tile)."""

    @staticmethod
    def forward(ctx, x, weight, target, group, ignore_index, tile):
        # x (N, d), weight (V/tp, d), target (N,) global ids -> per-token loss (N,) fp32.
        loss, lse = _tile_stats(x, weight, target, group, ignore_index, tile)
        # The parameter itself, never a view: ZeRO-3 swaps its .data between gathered and
        # partitioned, and a saved view would pin the gathered copy from forward to backward.
        ctx.save_for_backward(x, weight, target, lse)
        ctx.group, ctx.ignore_index, ctx.tile = group, ignore_index, tile
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x, grad_w = _recomputed_grads(x, weight, target, lse, grad_loss, ctx.group,
                                           ctx.ignore_index, ctx.tile, want_x, want_w)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), \
            None, None, None, None


class _TiledVocabParallelCrossEntropySum(torch.autograd.Function):
    """The sum of the losses, its gradients made in forward for a unit upstream gradient
    (three matmuls per tile at TP 1) and scaled by the real one in backward."""

    @staticmethod
    def forward(ctx, x, weight, target, group, ignore_index, tile, want_x, want_w):
        n_rows, vocab_per_rank = x.shape[0], weight.shape[0]
        one = torch.ones((), dtype=torch.float32, device=x.device)
        if tp_size_of(group) > 1:
            # The softmax needs the lse over every rank's slice before any gradient: stats
            # of all tiles, one reduction, then the tiles again for the gradients.
            loss, lse = _tile_stats(x, weight, target, group, ignore_index, tile)
            grad_x, grad_w = _recomputed_grads(x, weight, target, lse, one, group,
                                               ignore_index, tile, want_x, want_w)
            total = loss.sum()
        else:
            grad_x = torch.empty_like(x) if want_x else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32,
                                 device=weight.device) if want_w else None
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            buf, buf32 = _scratch(x, min(tile, n_rows), vocab_per_rank)
            for s in range(0, n_rows, tile):
                e = min(s + tile, n_rows)
                logits = torch.mm(x[s:e], weight.t(), out=buf[:e - s])  # (n, V)
                z = buf32[:e - s].copy_(logits) if buf32 is not buf else logits
                cols = target_columns(target[s:e], vocab_per_rank, group, ignore_index)
                st = local_softmax_stats(z, cols)  # z is now exp(z - max)
                lse = st.z_max + torch.log(st.sum_exp)
                total += (lse - st.z_t).masked_fill(~cols.valid, 0.0).sum()
                if want_x or want_w:
                    g32 = softmax_grad_(z.div_(st.sum_exp.unsqueeze(-1)), cols, one)
                    _add_tile_grads(g32, buf[:e - s], x[s:e], weight,
                                    grad_x[s:e] if want_x else None, grad_w)
        # dx (N, d) in x's dtype and dW (V/tp, d) fp32 wait here for backward: no x, no W.
        # Held on ctx rather than saved: backward scales them in place and lets them go.
        ctx.grads, ctx.w_dtype = (grad_x, grad_w), weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("tiled loss (reduction 'sum'): a second backward through one "
                               "forward; its gradients were handed out by the first")
        grad_x, grad_w = ctx.grads  # for a unit upstream gradient
        ctx.grads = None
        if grad_x is not None:
            grad_x = grad_x.mul_(grad_total)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def tiled_vocab_parallel_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                                       target: torch.Tensor, tp_group=None,
                                       tile_tokens: Union[int, str] = "auto",
                                       ignore_index: int = IGNORE_INDEX,
                                       reduction: str = "none") -> torch.Tensor:
    """loss = logsumexp(x W^T) - (x W^T)_t per token, W split by vocabulary rows over TP,
    the logits made one tile of tokens at a time (module docstring).

    x (..., d) the head's input (replicated over TP); weight (V/tp, d) the head weight;
    target (...) global ids, ``ignore_index`` = no loss. reduction 'none': (...) fp32, exact
    under any per-token upstream gradient (backward recomputes the logits); 'sum': their
    fp32 sum (0-d), the gradients made in forward and scaled by the upstream gradient in
    backward. Identical on the ranks of a TP group; equals
    vocab_parallel_cross_entropy(parallel_lm_logits(x, W), t) (summed for 'sum').
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.shape[:-1] != target.shape:
        raise ValueError(
            f"tiled loss: x {tuple(x.shape)}, head weight {tuple(weight.shape)} and labels "
            f"{tuple(target.shape)} do not fit (x (..., d), weight (V/tp, d), labels (...)); "
            "under ZeRO-3 call the model through its DeepSpeed engine, which gathers the weight")
    if reduction not in REDUCTIONS:
        raise ValueError(f"tiled loss: reduction {reduction!r} is not one of {REDUCTIONS}")
    grad_on = torch.is_grad_enabled()
    want_x, want_w = grad_on and x.requires_grad, grad_on and weight.requires_grad
    x = copy_to_tensor_model_parallel_region(x, tp_group)  # f: dx all-reduced once, in backward
    rows = x.reshape(-1, x.shape[-1])  # (N, d)
    tile = loss_tile_tokens(rows.shape[0], weight.shape[0], weight.shape[1], tile_tokens)
    if reduction == "sum":
        return _TiledVocabParallelCrossEntropySum.apply(
            rows, weight, target.reshape(-1), tp_group, ignore_index, tile, want_x, want_w)
    loss = _TiledVocabParallelCrossEntropy.apply(rows, weight, target.reshape(-1), tp_group,
                                                 ignore_index, tile)
    return loss.view(target.shape)
