"""The LM head and the vocab-parallel cross entropy one tile of tokens at a time.

The untiled loss holds (N, V/tp) logits and, for backward, their (N, V/tp) fp32 softmax
(N = B * T/cp tokens of a rank): 16K tokens x 128K vocabulary is 8.4 GB, the largest
activation of a long-context rank. Here the rows of x (N, d) are cut into tiles of n
tokens; each tile's logits x_n W^T (n, V/tp) exist only while that tile is worked on:

    forward   per tile: logits, the vocab-parallel loss (TP all-reduces MAX, then SUM of
              (z_t, sum exp), as tensor_parallel/cross_entropy.py); keep the token's loss
              and its fp32 log-sum-exp lse; save x, W, labels, lse (no logits)
    backward  per tile: recompute the logits, g = (exp(logits - lse) - 1[i = t]) * dloss
              (0 for ignored labels), dx_n = g W, dW += g^T x_n

Recomputing costs one more (N, d) x (d, V/tp) matmul in backward (the head's FLOPs go
from 3 to 4 matmuls). W is the head weight (V/tp, d): the tied embedding or the untied
lm_head; x enters through f (copy_to_tensor_model_parallel_region), so dx is all-reduced
over TP once for the whole x, not per tile. dW is accumulated in fp32 over the tiles and
cast once to W's dtype: one rounding like the untiled matmul's, where bf16 accumulation
would round once per tile. Each tile reuses one (n, V/tp) scratch buffer (two for bf16).

Bytes per rank, N tokens, n per tile, v = V/tp, b = bytes of x's and W's dtype (4 fp32,
2 bf16); the untiled loss for comparison:

                    tiled                               untiled
    saved for bwd   N*d*b (x) + N*8 (labels)            N*d*b (x) + N*v*4 (softmax)
                    + N*4 (lse)                         + N*10 (target columns)
    forward peak    n*v*4 (fp32: exp made in place);    N*v*b (logits) + N*v*4 (exp)
                    bf16: n*v*(2 + 4)
                    + N*8 (loss, lse)
    backward peak   n*v*4 (fp32); bf16: n*v*(2 + 4)     N*v*4 (softmax, made the grad
                    + N*d*b (dx)                        in place); bf16: + N*v*2 (cast)
                    + bf16: v*d*(4 + 2) (fp32 dW        + N*d*b (dx)
                      accumulator, each tile's product)

dW itself (v*d*b) and, over TP, the f all-reduce's copy of dx (N*d*b) are the same in both.
On a pipeline's last stage DeepSpeed also holds the stage's output until the next
micro-batch: the untiled logits (N*v*b), here x and W (nothing new).

The auto tile size (``loss_tile_tokens``) keeps n*V/tp close to N*d: the fp32 tile buffers
about the size of the hidden states.
"""
from __future__ import annotations

import math
from typing import Union

import torch

from ctxpar.tensor_parallel.cross_entropy import (IGNORE_INDEX, softmax_grad_, softmax_stats,
                                                  target_columns)
from ctxpar.tensor_parallel.mappings import copy_to_tensor_model_parallel_region


def loss_tile_tokens(rows: int, vocab_per_rank: int, d_model: int,
                     setting: Union[int, str] = "auto") -> int:
    """Tokens per loss tile for ``rows`` tokens on a rank (the planner calls this too).

    'auto' is Liger-Kernel's fused linear cross entropy rule: the logits of a tile hold about
    as many numbers as the hidden states, so n = next power of two of
    ceil(rows / ceil(V/tp / d)), at most rows. An integer is used as is (at most rows).
    16K tokens, V/tp 128K, d 4096: 512 tokens per tile, 32 tiles.
    """
    rows = max(rows, 1)
    if setting == "auto":
        ratio = math.ceil(vocab_per_rank / d_model)  # tile logits per hidden-state number
        n = 1 << (math.ceil(rows / ratio) - 1).bit_length()  # next power of two
    else:
        n = int(setting)
    return max(1, min(n, rows))


class _TiledVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, ignore_index, tile):
        # x (N, d), weight (V/tp, d), target (N,) global ids -> per-token loss (N,) fp32.
        n_rows = x.shape[0]
        loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        buf = x.new_empty(min(tile, n_rows), weight.shape[0])  # (n, V/tp), every tile's
        for s in range(0, n_rows, tile):
            e = min(s + tile, n_rows)
            logits = torch.mm(x[s:e], weight.t(), out=buf[:e - s])
            # fp32: exp(z - m) is made in buf itself; bf16: into a new fp32 tile.
            st = softmax_stats(logits, target[s:e], group, ignore_index, inplace=True)
            loss[s:e] = st.loss
            lse[s:e] = st.z_max + torch.log(st.sum_exp)
            del logits, st
        # The parameter itself, never a view: ZeRO-3 swaps its .data between gathered and
        # partitioned, and a saved view would pin the gathered copy from forward to backward.
        ctx.save_for_backward(x, weight, target, lse)
        ctx.group, ctx.ignore_index, ctx.tile = group, ignore_index, tile
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, target, lse = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(x) if want_x else None
        # fp32 accumulator: one rounding to W's dtype at the end (module docstring).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32,
                             device=weight.device) if want_w else None
        n_rows, vocab_per_rank = x.shape[0], weight.shape[0]
        # (n, V/tp) scratch for every tile: the logits and the gradient in x's dtype, and
        # for bf16/fp16 an fp32 tile for the softmax (one buffer when x is fp32).
        buf = x.new_empty(min(ctx.tile, n_rows), vocab_per_rank)
        buf32 = buf if buf.dtype == torch.float32 else torch.empty_like(buf, dtype=torch.float32)
        for s in range(0, n_rows, ctx.tile):
            e = min(s + ctx.tile, n_rows)
            logits = torch.mm(x[s:e], weight.t(), out=buf[:e - s])  # recomputed
            probs = buf32[:e - s].copy_(logits) if buf32 is not buf else logits
            probs.sub_(lse[s:e].unsqueeze(-1)).exp_()  # softmax = exp(z - lse)
            cols = target_columns(target[s:e], vocab_per_rank, ctx.group, ctx.ignore_index)
            grad = softmax_grad_(probs, cols, grad_loss[s:e])  # (n, V/tp) fp32
            g = buf[:e - s].copy_(grad) if buf32 is not buf else grad  # in x's dtype
            if want_x:
                torch.mm(g, weight, out=grad_x[s:e])  # (n, d)
            if want_w:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(g.t(), x[s:e])  # (V/tp, d)
                else:
                    grad_w += g.t() @ x[s:e]
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


def tiled_vocab_parallel_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                                       target: torch.Tensor, tp_group=None,
                                       tile_tokens: Union[int, str] = "auto",
                                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """loss = logsumexp(x W^T) - (x W^T)_t per token, W split by vocabulary rows over TP,
    the logits made one tile of tokens at a time (module docstring).

    x (..., d) the head's input (replicated over TP); weight (V/tp, d) the head weight;
    target (...) global ids, ``ignore_index`` = no loss -> (...) fp32, identical on the
    ranks of a TP group; equals vocab_parallel_cross_entropy(parallel_lm_logits(x, W), t).
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.shape[:-1] != target.shape:
        raise ValueError(
            f"tiled loss: x {tuple(x.shape)}, head weight {tuple(weight.shape)} and labels "
            f"{tuple(target.shape)} do not fit (x (..., d), weight (V/tp, d), labels (...)); "
            "under ZeRO-3 call the model through its DeepSpeed engine, which gathers the weight")
    x = copy_to_tensor_model_parallel_region(x, tp_group)  # f: dx all-reduced once, in backward
    rows = x.reshape(-1, x.shape[-1])  # (N, d)
    tile = loss_tile_tokens(rows.shape[0], weight.shape[0], weight.shape[1], tile_tokens)
    loss = _TiledVocabParallelCrossEntropy.apply(rows, weight, target.reshape(-1), tp_group,
                                                 ignore_index, tile)
    return loss.view(target.shape)
