"""Which part of (local queries) x (one rank's keys) a pattern computes, and computing it.

Patterns that keep each rank's queries and bring it every rank's K,V (the ring step by
step, all-gather all at once) compute the same blocks: ``block_plan`` says which rows and
columns of (queries of `rank`) x (keys of `src`) are causally visible under a layout, and
``forward_block_`` / ``backward_block`` run one kernel call on them (kernels.py), merge
the forward into the running (out, lse) (merge.py) and count FLOPs (stats.py).
``BlockwiseAttention`` is their one autograd wrapper. Ulysses computes one block over
the whole (gathered) sequence, so it plans nothing (and reuses the ring on one rank).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import torch

from .documents import doc_plan
from .kernels import block_kernel
from .layouts import rank_positions
from .merge import merge_block_
from .sinks import sinks_grad
from .stats import attention_flops, record


class Block(NamedTuple):
    """Rows [q0, q1) of the local queries against rows [k0, k1) of the visiting kv."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool  # the kernel's top-left causal mask; only ever on square blocks

    def pairs(self) -> int:  # (query, key) pairs the kernel evaluates
        L, S = self.q1 - self.q0, self.k1 - self.k0
        return L * (L + 1) // 2 if self.causal else L * S


def block_plan(layout: str, causal: bool, rank: int, src: int, local_seq: int) -> Optional[Block]:
    """The part of (local q) x (kv of rank `src`) that is visible; None = skip the step.

    contiguous  src < rank: all visible; src == rank: causal; src > rank: all future, skip.
    zigzag      (rank holds chunks rank and 2P-1-rank, each local_seq/2 long)
                src < rank: every query sees the kv's first chunk only (the second is later
                than both of ours); src > rank: only our second chunk sees kv, all of it.
    striped     q_i is at i*P+rank, k_j at j*P+src. src < rank: visible iff j <= i, the
                plain causal mask incl. the diagonal; src > rank: iff j < i, so drop the
                first query and the last key and use the causal kernel (seed 001).
    The diagonal (src == rank) is causal in every layout: local order is global order.
    """
    S = local_seq
    if not causal:
        return Block(0, S, 0, S, False)
    if src == rank:
        return Block(0, S, 0, S, True)
    if layout == "contiguous":
        return Block(0, S, 0, S, False) if src < rank else None
    if layout == "zigzag":
        h = S // 2
        return Block(0, S, 0, h, False) if src < rank else Block(h, S, 0, S, False)
    if src < rank:  # striped
        return Block(0, S, 0, S, True)
    return Block(1, S, 0, S - 1, True) if S > 1 else None


def step_plan(layout, causal, rank, src, S, world, mask=None, banded=False):
    """[(samples, block)] this rank computes against the keys of rank `src`: one block for
    the whole batch (block_plan); with an AttentionMask (mask.py) of documents, windows or
    both, the sub-blocks with a visible pair (documents.doc_plan): per document the two
    sides share, per sample, or for the whole batch when there are no documents. banded:
    the kernel takes flash-attn's window_size (``banded(kernel, q)``), so a window's
    blocks are bands (bands.py), not masked tiles."""
    if mask is None or mask.plain:
        blk = block_plan(layout, causal, rank, src, S)
        return [] if blk is None else [(slice(None), blk)]
    banded = banded and mask.sliding_window is not None  # the same plan otherwise
    return _mask_step_plan(layout, causal, rank, src, S, world, mask_key(mask), banded)


def banded(kernel, q: torch.Tensor) -> bool:
    """Whether `kernel` skips a window's hidden pairs itself (flash-attn's window_size):
    then the plan hands it whole bands; else tiles of rows, each with its mask."""
    return kernel.native_window(q)


def ring_steps(layout, causal, S, world, mask=None) -> int:
    """How many ring steps carry work for some rank: all `world` for a plain mask; else
    1 + the last step at which any rank's queries see a key it then holds (every CP rank
    has the same mask, so all agree without talking)."""
    if mask is None or mask.plain:
        return world
    return _mask_ring_steps(layout, causal, S, world, mask_key(mask))


def mask_key(mask):
    """(window, per-sample boundaries or None): hashable, for the plan caches. The API
    has already folded chunks into the boundaries (mask.with_chunks)."""
    if mask.chunk_size is not None and mask.cu_seqlens is None:
        raise ValueError(f"chunk_size={mask.chunk_size} reaches the block plan unfolded: "
                         "context_parallel_attention folds chunks into cu_seqlens")
    docs = None if mask.cu_seqlens is None \
        else tuple(tuple(cu.tolist()) for cu in mask.cu_seqlens)
    return mask.sliding_window, docs


def sample_bounds(docs, n: int):
    """[(samples, boundaries)]: the whole batch at once when every sample has the same
    boundaries (none, or chunks alone), else one entry per sample."""
    if docs is None:
        return [(slice(None), torch.tensor([0, n]))]
    if len(set(docs)) == 1:
        return [(slice(None), torch.tensor(docs[0]))]
    return [(slice(b, b + 1), torch.tensor(cu)) for b, cu in enumerate(docs)]


# Plans depend only on the mask and shapes: made once per micro-batch for every layer,
# forward and backward (a few small tensor ops per document otherwise).
@lru_cache(maxsize=4096)
def _mask_step_plan(layout, causal, rank, src, S, world, key, banded=False):
    window, docs = key
    q_pos = rank_positions(S * world, rank, world, layout)
    k_pos = q_pos if src == rank else rank_positions(S * world, src, world, layout)
    return [(b, blk) for b, cu in sample_bounds(docs, S * world)
            for blk in doc_plan(cu, q_pos, k_pos, causal, window, banded)]


@lru_cache(maxsize=256)
def _mask_ring_steps(layout, causal, S, world, key) -> int:
    return 1 + max(s for r in range(world) for s in range(world)
                   if s == 0 or _mask_step_plan(layout, causal, r, (r - s) % world, S, world,
                                                key))


def _kernel_for(kernel, blk, q: torch.Tensor):
    """(kernel, its mask or window keyword) for one block: a documents.DocBlock's explicit
    mask, on the math kernel where `kernel` takes none, or its flash-attn window, on the
    math kernel where `kernel` takes none (kernels.block_kernel; the plan gives bands only
    to kernels that take them); plain Blocks keep `kernel`. The plan, mask included, is
    made on the host (documents.py); the mask goes to q's device here, where the host plan
    meets the device kernel (a host-to-device copy of the masked block's (L, S) bools, no
    synchronisation)."""
    window = getattr(blk, "window", None)
    if window is not None:
        return block_kernel(kernel, q, windowed=True), {"window": window}
    mask = getattr(blk, "mask", None)
    if mask is None:
        return kernel, {}
    mask = mask.to(q.device, non_blocking=True)
    return block_kernel(kernel, q, masked=True), {"mask": mask}


def forward_block_(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: Block,
                   scale: float, out: torch.Tensor, lse: torch.Tensor,
                   b: slice = slice(None)) -> None:
    """Attention of q[b, blk rows] over k/v[b, blk rows], merged into the fp32 (out, lse).

    q (B, S, H, D); k, v (B, S_kv, Hkv, D); out (B, S, H, D) fp32; lse (B, H, S) fp32;
    b the samples (all, or one when each sample has its own document plan).
    """
    qs, ks = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
    kernel, kw = _kernel_for(kernel, blk, q)
    bo, bl = kernel.forward(q[b, qs], k[b, ks], v[b, ks], blk.causal, scale, **kw)
    merge_block_(out[b, qs], lse[b, :, qs], bo, bl)
    B, _, H, _ = bo.shape
    D = (q.shape[3] + v.shape[3]) / 2  # MLA: q k^T at q's head dim, p v at v's
    record(fwd_flops=attention_flops(B, H, D, blk.pairs(), "fwd"), fwd_blocks=1)


class QueryRows:
    """dout, q, out and lse of the local queries, sliced by a block's query rows.

    Every block of a backward pass uses one of very few row ranges (all rows, or zigzag's
    second half, or striped's all-but-first), so each slice is made once per range and
    reused on every step: dout/q/out are views; lse rows are made contiguous once (the
    kernels need a contiguous lse, and a strided one silently gives wrong gradients).
    """

    def __init__(self, dout, q, out, lse):
        self.full = (dout, q, out, lse)
        self._cache = {}

    def __call__(self, qs: slice, b: slice = slice(None)):
        key = (b.start, b.stop, qs.start, qs.stop)
        if key not in self._cache:
            dout, q, out, lse = self.full
            self._cache[key] = (dout[b, qs], q[b, qs], out[b, qs],
                                lse[b, :, qs].float().contiguous())
        return self._cache[key]


def backward_block(kernel, rows: QueryRows, k, v, blk: Block, scale: float,
                   b: slice = slice(None)
                   ) -> Tuple[slice, slice, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(query rows, key rows, (dq, dk, dv) of the block) given the *global* out and lse.

    With the merged out and lse the block's softmax is already normalised by the whole
    row, so the block's gradients are exactly its share of the full gradient; the caller
    adds them into its accumulators (dq rows qs; dk, dv rows ks of the visiting kv).
    """
    qs, ks = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
    dout, q, out, lse = rows(qs, b)
    B, _, H, _ = q.shape
    D = (q.shape[3] + v.shape[3]) / 2  # MLA: q k^T at q's head dim, p v at v's
    kernel, kw = _kernel_for(kernel, blk, q)
    grads = kernel.backward(dout, q, k[b, ks], v[b, ks], out, lse, blk.causal, scale, **kw)
    record(bwd_flops=attention_flops(B, H, D, blk.pairs(), "bwd"), bwd_blocks=1)
    return qs, ks, grads


class BlockwiseAttention(torch.autograd.Function):
    """(out, lse) of a blockwise pattern; lse is returned but not differentiable.

    ``pattern`` is its (forward, backward) pair of functions (ring.py, allgather.py):
        forward(q, k, v, group, causal, layout, scale, kernel, sinks=) -> (out, lse)
        backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel) -> dq, dk, dv
    sinks: None or (H,) sink logits over q's heads, applied by the forward to the merged
    rows (sinks.py); the saved out and lse include them, which makes the pattern's
    backward exact as it is, and the sinks' gradient is this rank's rows' share.
    Saved for backward: q, k, v, out, lse (the local shards; nothing gathered), sinks.
    """

    @staticmethod
    def forward(ctx, q, k, v, pattern, group, causal, layout, scale, kernel, sinks=None):
        forward_fn, ctx.backward_fn = pattern
        out, lse = forward_fn(q, k, v, group, causal, layout, scale, kernel, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, causal, layout, scale, kernel)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(dout, q, k, v, out, lse, *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[9] else None
        return dq, dk, dv, None, None, None, None, None, None, dsinks
