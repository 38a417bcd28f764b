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
would round once per tile. Bytes per rank, b = bytes of x's dtype, bw of W's:

    saved for backward      N*d*b (x, as the untiled head) + N*8 (labels) + N*4 (lse)
                            instead of N*V/tp*4 (softmax) + N*10 (target columns)
    forward, per tile       n*V/tp*4 (fp32 logits, made exp in place) or, for bf16,
                            n*V/tp*(2 + 4) (the bf16 tile and its fp32 exp)
                            + N*8 (loss and lse of all tokens)
    backward, per tile      n*V/tp*4 (fp32), n*V/tp*(4 + b) otherwise (the fp32 grad and
                            its cast for the matmuls)
                            + N*d*b (dx) + V/tp*d*4 (dW accumulator; only when bw != 4, then
                            also V/tp*d*bw for each tile's product and the final cast)

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
        for s in range(0, n_rows, tile):
            e = min(s + tile, n_rows)
            logits = torch.mm(x[s:e], weight.t())  # (n, V/tp): this tile's only
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
        for s in range(0, n_rows, ctx.tile):
            e = min(s + ctx.tile, n_rows)
            logits = torch.mm(x[s:e], weight.t())  # (n, V/tp), recomputed
            probs = logits.float() if logits.dtype != torch.float32 else logits
            del logits  # the bf16 tile is not needed past its fp32 copy
            probs.sub_(lse[s:e].unsqueeze(-1)).exp_()  # softmax = exp(z - lse)
            cols = target_columns(target[s:e], vocab_per_rank, ctx.group, ctx.ignore_index)
            g = softmax_grad_(probs, cols, grad_loss[s:e]).to(x.dtype)  # (n, V/tp)
            del probs
            if want_x:
                torch.mm(g, weight, out=grad_x[s:e])  # (n, d)
            if want_w:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(g.t(), x[s:e])  # (V/tp, d)
                else:
                    grad_w += g.t() @ x[s:e]
            del g
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
