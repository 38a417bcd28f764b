"""All-gather attention (``comm="allgather"``, Llama 3's CP): gather K,V once, keep queries home.

Forward: every rank all-gathers the stacked K,V of the CP group at KV-head width (with
GQA only Hkv heads travel, which is why Llama 3 chose it), in group-rank order, so slot
src holds the tokens of ``rank_positions(.., src, ..)``. Then the local queries attend to
every slot with the ring's causal block plan (blocks.step_plan: invisible blocks are
skipped, the diagonal one is causal; with documents, chunks or a window one block per
shared piece) and the blocks merge by log-sum-exp (then the sinks' term, sinks.py),
exactly as the ring would, only without waiting step by step. Overlap: the gather is
asynchronous and the diagonal block, which needs only the local K,V, is computed while it
is in flight.

Backward: K,V are gathered again (holding every layer's gathered K,V until its backward
would cost P x the local K,V per layer; one layer's at a time is the peak instead), the
local block is computed during that gather, and the fp32 dK,dV of every slot are
reduce-scattered home (summing P contributions in fp32, as the ring's accumulator does).

Every rank holds the whole sequence's K,V (2 x n x Hkv x D) while its attention runs:
the memory the ring avoids. Except under a causal window short enough for the ring's
halo exchange (halo.py: contiguous or zigzag): the only visible remote keys are then the
neighbours' last window-1 tokens, and gathering just those is that exchange, which
all-gather then runs as well (the same bytes, no gathered sequence). See
docs/parallelism.md for bytes and when to choose it.

Held slots (GatherSlots, held_forward): K,V gathered once for several layers attending
with them (Gemma 4's shared K/V: a producer and its consumers), no gather in their
forward or backward; their slots' gradients summed by autograd, reduce-scattered once.
"""
from __future__ import annotations

import torch

from functools import partial

from .blocks import QueryRows, backward_block, banded, forward_block_, step_plan
from .comm import all_gather, group_rank_and_size, reduce_scatter
from .halo import halo_applies, halo_backward, halo_forward
from .merge import empty_accumulators
from .sinks import finish


def _visible_slots(kv, gathered, work, rank: int, world: int, layout: str, causal: bool,
                   mask=None, bands=False):
    """(src, samples, block, K,V of rank src) for every block with a visible pair, the
    local slot first (its K,V are here before the gather lands); waits for the gather only
    when a remote slot is needed, and before returning in any case (the collective
    completes). kv (2, B, S, Hkv, D) local; gathered (P, 2, B, S, Hkv, D) in group-rank
    order; mask: None (plain causal or full) or the AttentionMask (mask.py) to plan by;
    bands: plan a window as flash-attn window calls (blocks.banded). kv and gathered[src]
    may also be (k, v) pairs (held_forward's slots)."""
    S = kv[0].shape[1]
    for src in [rank] + [s for s in range(world) if s != rank]:
        for b, blk in step_plan(layout, causal, rank, src, S, world, mask, bands):
            if src != rank and work is not None:
                work.wait()
                work = None
            yield src, b, blk, (kv if src == rank else gathered[src])
    if work is not None:  # every remote block was invisible
        work.wait()


def allgather_forward(q, k, v, group, causal, layout, scale, kernel, mask=None, sinks=None):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32) of this rank's queries."""
    rank, world = group_rank_and_size(group)
    if halo_applies(layout, mask, q.shape[1], world):  # only rank - 1's tail is visible
        return halo_forward(q, k, v, group, causal, layout, scale, kernel, mask, sinks)
    kv = torch.stack((k, v))                                       # (2, B, S, Hkv, D)
    gathered, work = all_gather(kv, group, "fwd", async_op=True)   # (P, 2, B, S, Hkv, D)
    out, lse = empty_accumulators(q)
    for _, b, blk, slot in _visible_slots(kv, gathered, work, rank, world, layout, causal,
                                          mask, banded(kernel, q)):
        forward_block_(kernel, q, slot[0], slot[1], blk, scale, out, lse, b)
    return finish(out, lse, q.dtype, sinks)


def allgather_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel,
                       mask=None):
    """(dq, dk, dv) of this rank's q/k/v; dk/dv have k's kv_heads."""
    rank, world = group_rank_and_size(group)
    dout = dout.contiguous()
    if halo_applies(layout, mask, q.shape[1], world):
        return halo_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel,
                             mask)
    kv = torch.stack((k, v))
    gathered, work = all_gather(kv, group, "bwd", async_op=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((world, *kv.shape), dtype=torch.float32, device=q.device)
    rows = QueryRows(dout, q, out, lse)
    for src, b, blk, slot in _visible_slots(kv, gathered, work, rank, world, layout, causal,
                                            mask, banded(kernel, q)):
        qs, ks, g = backward_block(kernel, rows, slot[0], slot[1], blk, scale, b)
        dq[b, qs] += g[0]
        dkv[src, 0, b, ks] += g[1]
        dkv[src, 1, b, ks] += g[2]
        g = None  # this block's gradients go before the next block's are made
    dkv = reduce_scatter(dkv, group, "bwd")                        # (2, B, S, Hkv, D) fp32
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class GatherSlots(torch.autograd.Function):
    """x (...) -> (P, ...), every rank's x in group-rank order, held for several layers
    (Gemma 4's shared K/V: a producer's K,V gathered once, its consumers attending with the
    same slots); backward the slots' summed gradient reduce-scattered home in fp32."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, "fwd")[0]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad.float(), ctx.group, "bwd").to(grad.dtype), None


def held_forward(q, k_slots, v_slots, group, causal, layout, scale, kernel, mask=None,
                 sinks=None):
    """allgather_forward over K,V slots gathered before (GatherSlots: k_slots, v_slots
    (P, B, S, Hkv, D)): no collective."""
    rank, world = group_rank_and_size(group)
    slots = list(zip(k_slots, v_slots))  # (k, v) of each rank
    out, lse = empty_accumulators(q)
    for _, b, blk, slot in _visible_slots(slots[rank], slots, None, rank, world, layout,
                                          causal, mask, banded(kernel, q)):
        forward_block_(kernel, q, slot[0], slot[1], blk, scale, out, lse, b)
    return finish(out, lse, q.dtype, sinks)


def held_backward(dout, q, k_slots, v_slots, out, lse, group, causal, layout, scale, kernel,
                  mask=None):
    """(dq, dk slots, dv slots (P, B, S, Hkv, D)): every slot's gradient, which GatherSlots
    sums over the layers holding it before its one reduce-scatter."""
    rank, world = group_rank_and_size(group)
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=q.device)
              for t in (k_slots, v_slots))
    rows, slots = QueryRows(dout, q, out, lse), list(zip(k_slots, v_slots))
    for src, b, blk, slot in _visible_slots(slots[rank], slots, None, rank, world, layout,
                                            causal, mask, banded(kernel, q)):
        qs, ks, g = backward_block(kernel, rows, slot[0], slot[1], blk, scale, b)
        dq[b, qs] += g[0]
        dk[src, b, ks] += g[1]
        dv[src, b, ks] += g[2]
        g = None
    return dq.to(q.dtype), dk.to(k_slots.dtype), dv.to(v_slots.dtype)


PATTERN = (allgather_forward, allgather_backward)  # for blocks.BlockwiseAttention


def allgather_pattern(mask=None, held=False):
    """The all-gather's (forward, backward), planned by `mask` (an AttentionMask with
    validated per-sample cu_seqlens, mask.py) when given; held: over slots gathered before
    (held_forward)."""
    forward, backward = (held_forward, held_backward) if held else PATTERN
    if mask is None:
        return forward, backward
    return partial(forward, mask=mask), partial(backward, mask=mask)
