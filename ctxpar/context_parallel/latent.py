"""Multi-head latent attention (MLA; DeepSeek-V2/V3) over a CP group with the latent on the wire.

MLA's keys and values are made per head from one shared latent per token:

    latent = [c_kv (kv_lora_rank) ; k_rot (qk_rope_head_dim)]   # (B, S, R + dr), one "head"
    [k_nope ; v] = c_kv @ W^T, per head                          # W = kv_b_proj.weight
    k = [k_nope ; k_rot broadcast to every head]                 # (B, S, H, dn + dr)

so a block of the sequence's K,V is its latent block (576 values a token for V3's shape,
against H x (192 + 128) expanded: 40,960 at 128 heads). The patterns here move only
latent blocks and expand each one on the rank that holds it, just before its attention:

ring       latent blocks travel the P2P ring (ring.KVRing), each expanded for the block plan's
           key rows (blocks.step_plan: causal skips, zigzag / striped, documents, windows),
           merged by log-sum-exp (merge.py), finished with the sinks' term (sinks.py).
allgather  the latent gathered once (Llama 3's pattern at latent width), the local slot
           computed while it is in flight.

Backward (``LatentAttention``): saved are q, the latent, W, out and lse, never the
expanded K,V; each visiting block is expanded again, its kernel backward (with the global
out and lse: exact block shares) gives per-head dK, dV, and those fold straight back to
the latent's gradient

    d c_kv  = [dK_nope ; dV] @ W          (B, S, R)    per block, summed over heads by the matmul
    d k_rot = sum over heads of dK_rot    (B, S, dr)
    dW     += [dK_nope ; dV]^T @ c_kv     (H (dn + dv), R) on the rank that used the block

so what travels home with the ring (or is reduce-scattered) is the latent's fp32 gradient,
R + dr wide. dW is this rank's share (its queries' blocks); the CP gradient reduction, which
sums over CP like every replicated parameter's gradient, completes it. Ulysses and hybrid
(latent_api.py) run these patterns on the head-sharded queries with W's rows of those heads.

The short-window halo exchange (halo.py) is not used here: a window's ring stops after its
last step with work (blocks.ring_steps), moving whole latent blocks until then.
"""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch

from .blocks import QueryRows, backward_block, banded, forward_block_, ring_steps, step_plan
from .comm import NoComm, RingComm, all_gather, group_rank_and_size, reduce_scatter
from .expansion import LatentDims, MLAExpansion, block_index, expand_latent  # noqa: F401
from .ring import KVRing
from .sinks import finish, sinks_grad
from .stats import attention_flops, record, square_pairs


def _key_span(plan) -> Tuple[int, int]:
    """The key rows [lo, hi) a step's blocks touch: the only ones expanded."""
    return min(blk.k0 for _, blk in plan), max(blk.k1 for _, blk in plan)


def _shifted(blk, lo: int):
    """The block against keys expanded from row lo on (its mask and window are relative)."""
    return blk._replace(k0=blk.k0 - lo, k1=blk.k1 - lo)


def forward_visit_(kernel, q, latent, expansion, index, plan, scale, out, lse) -> None:
    """Every block of `plan` ([(samples, block)]) of q against the visiting latent (B, S,
    ...), merged into the fp32 (out (B, S, H, dv), lse (B, H, S)); expanded once. index:
    the visiting block's sequence places (S,) (expansion.block_index)."""
    if not plan:
        return
    lo, hi = _key_span(plan)
    k, v = expansion.expand(latent[:, lo:hi], index[lo:hi])
    for b, blk in plan:
        forward_block_(kernel, q, k, v, _shifted(blk, lo), scale, out, lse, b)


def backward_visit(kernel, rows: QueryRows, latent, expansion, index, plan, scale, dq,
                   dparams) -> Optional[Tuple[int, torch.Tensor]]:
    """The visiting latent's blocks in backward: adds into dq (B, S, H, dqk) and dparams
    (the expansion's parameters'), all fp32; returns (lo, d latent rows [lo, hi) fp32), or
    None when the plan is empty. Per-head dK, dV live for this one visit only."""
    if not plan:
        return None
    lo, hi = _key_span(plan)
    k, v = expansion.expand(latent[:, lo:hi], index[lo:hi])
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)   # (B, L, h, dqk)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)   # (B, L, h, dv)
    for b, blk in plan:
        qs, ks, g = backward_block(kernel, rows, k, v, _shifted(blk, lo), scale, b)
        dq[b, qs] += g[0]
        dk[b, ks] += g[1]
        dv[b, ks] += g[2]
    k = v = None
    return lo, expansion.fold(latent[:, lo:hi], index[lo:hi], dk, dv, dparams)


def _accumulators(q, v_head_dim) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, H, dv) fp32 zeros, lse (B, H, S) fp32 -inf): rows that saw no key yet."""
    B, S, H, _ = q.shape
    return (torch.zeros(B, S, H, v_head_dim, dtype=torch.float32, device=q.device),
            torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device))


def _param_grads(expansion) -> List[torch.Tensor]:
    return [torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            for p in expansion.params]


def _index(S, src, world, layout, device):
    return block_index(S, src, world, layout, 0, S, device)


def ring_forward(q, latent, expansion, group, causal, layout, scale, kernel, mask=None,
                 sinks=None):
    """(out (B, S, H, dv) in q.dtype, lse (B, H, S) fp32): latent blocks over the ring,
    rank r holding rank (r - step)'s at each step (ring.py's schedule and overlap)."""
    rank, world = group_rank_and_size(group)
    B, S, H, _ = q.shape
    if world == 1 and mask is None:  # alone (Ulysses' inner call): one kernel, no merge
        k, v = expansion.expand(latent, _index(S, 0, 1, layout, q.device))
        out, lse = kernel.forward(q, k, v, causal, scale)
        record(fwd_flops=attention_flops(B, H, (k.shape[3] + v.shape[3]) / 2,
                                         square_pairs(S, causal), "fwd"), fwd_blocks=1)
        # contiguous: a padded kernel's out is a view of its wider output (PaddedHeadDims),
        # whose whole storage autograd would otherwise keep
        return finish(out.contiguous(), lse.float().contiguous(), q.dtype, sinks)
    out, lse = _accumulators(q, expansion.v_head_dim)
    steps = ring_steps(layout, causal, S, world, mask)  # < world: the mask ends the ring early
    comm = None if isinstance(group, NoComm) or steps == 1 else RingComm(group)
    ring = KVRing((latent,), comm, steps - 1)
    bands = banded(kernel, q)
    for step in range(steps):
        if comm and step + 1 < steps:  # the next latent block moves while this one computes
            ring.start()
        src = (rank - step) % world
        plan = step_plan(layout, causal, rank, src, S, world, mask, bands)
        forward_visit_(kernel, q, ring.kv[0], expansion, _index(S, src, world, layout,
                                                                  q.device),
                       plan, scale, out, lse)
        if comm and step + 1 < steps:
            ring.finish()
    if comm:
        record(fwd_bytes_sent=comm.bytes_sent, fwd_bytes_recv=comm.bytes_recv,
               fwd_comm_ops=comm.ops)
    return finish(out, lse, q.dtype, sinks)


def ring_backward(dout, q, latent, expansion, out, lse, group, causal, layout, scale, kernel,
                  mask=None):
    """(dq, d latent, d params) of this rank: latent blocks travel again (P - 1 sends), and with
    each the fp32 gradient of that block's latent (P sends, the last one home), as
    ring.ring_backward's dK,dV accumulator does, at R + dr wide instead of 2 Hkv D."""
    rank, world = group_rank_and_size(group)
    dout, S = dout.contiguous(), q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dparams = _param_grads(expansion)
    dlat = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)  # (B, S, R + dr)
    steps = ring_steps(layout, causal, S, world, mask)
    ring = not isinstance(group, NoComm) and steps > 1
    lat_comm, dlat_comm = (RingComm(group), RingComm(group)) if ring else (None, None)
    blocks = KVRing((latent,), lat_comm, steps - 1)
    dlat_recv = torch.empty_like(dlat) if ring else None
    rows, bands = QueryRows(dout, q, out, lse), banded(kernel, q)
    for step in range(steps):
        if lat_comm and step + 1 < steps:
            blocks.start()
        src = (rank - step) % world
        plan = step_plan(layout, causal, rank, src, S, world, mask, bands)
        grad = backward_visit(kernel, rows, blocks.kv[0], expansion,
                              _index(S, src, world, layout, q.device), plan, scale, dq,
                              dparams)
        if dlat_comm and step > 0:
            dlat_comm.wait()  # the gradient of the latent block we hold, from rank - 1
            dlat, dlat_recv = dlat_recv, dlat
        if grad is not None:
            lo, g = grad
            dlat[:, lo:lo + g.shape[1]] += g
        grad = g = None
        if dlat_comm:  # on to the next rank; after the last step home (ring.ring_backward)
            hops = 1 if step + 1 < steps else world - step
            dlat_comm.send_recv(dlat, dlat_recv, hops)
            dlat_comm.commit()
        if lat_comm and step + 1 < steps:
            blocks.finish()
    if dlat_comm:
        dlat_comm.wait()  # our own block's latent gradient, complete
        dlat = dlat_recv
        record(bwd_bytes_sent=lat_comm.bytes_sent + dlat_comm.bytes_sent,
               bwd_bytes_recv=lat_comm.bytes_recv + dlat_comm.bytes_recv,
               bwd_comm_ops=lat_comm.ops + dlat_comm.ops)
    return dq.to(q.dtype), dlat.to(latent.dtype), dparams


def _slots(rank: int, world: int) -> List[int]:
    return [rank] + [s for s in range(world) if s != rank]  # the local slot first


def allgather_forward(q, latent, expansion, group, causal, layout, scale, kernel,
                      mask=None, sinks=None, held=False):
    """(out, lse): the latent all-gathered once (in group-rank order, asynchronously; the
    local slot computed while it lands), every visible slot expanded and merged. held: the
    latent is already every rank's (P, B, S, ...) (allgather.GatherSlots), nothing sent."""
    rank, world = group_rank_and_size(group)
    S, bands = q.shape[1], banded(kernel, q)
    if held:
        gathered, work, latent = latent, None, latent[rank]
    else:
        gathered, work = all_gather(latent, group, "fwd", async_op=True)  # (P, B, S, ...)
    out, lse = _accumulators(q, expansion.v_head_dim)
    for src in _slots(rank, world):
        plan = step_plan(layout, causal, rank, src, S, world, mask, bands)
        if plan and src != rank and work is not None:
            work.wait()
            work = None
        slot = latent if src == rank else gathered[src]  # ours before the gather lands
        forward_visit_(kernel, q, slot, expansion, _index(S, src, world, layout, q.device),
                       plan, scale, out, lse)
    if work is not None:  # every remote slot was invisible: the collective still completes
        work.wait()
    return finish(out, lse, q.dtype, sinks)


def allgather_backward(dout, q, latent, expansion, out, lse, group, causal, layout, scale,
                       kernel, mask=None, held=False):
    """(dq, d latent, d params): the latent gathered again (one layer's at a time, not every
    layer's kept), each slot's fp32 latent gradient reduce-scattered home. held: every
    slot's gradient returned (P, B, S, ...), GatherSlots reduce-scattering their sum."""
    rank, world = group_rank_and_size(group)
    dout, S, bands = dout.contiguous(), q.shape[1], banded(kernel, q)
    if held:
        gathered, work, latent = latent, None, latent[rank]
    else:
        gathered, work = all_gather(latent, group, "bwd", async_op=True)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dparams = _param_grads(expansion)
    dlat = torch.zeros((world, *latent.shape), dtype=torch.float32, device=q.device)
    rows = QueryRows(dout, q, out, lse)
    for src in _slots(rank, world):
        plan = step_plan(layout, causal, rank, src, S, world, mask, bands)
        if plan and src != rank and work is not None:
            work.wait()
            work = None
        slot = latent if src == rank else gathered[src]
        grad = backward_visit(kernel, rows, slot, expansion,
                              _index(S, src, world, layout, q.device), plan, scale, dq,
                              dparams)
        if grad is not None:
            lo, g = grad
            dlat[src, :, lo:lo + g.shape[1]] += g
        grad = g = None
    if work is not None:
        work.wait()
    if not held:
        dlat = reduce_scatter(dlat, group, "bwd")                      # (B, S, R + dr) fp32
    return dq.to(q.dtype), dlat.to(latent.dtype), dparams


PATTERNS = {"ring": (ring_forward, ring_backward),
            "allgather": (allgather_forward, allgather_backward)}


def latent_pattern(comm: str, mask=None, held=False):
    """(forward, backward) of 'ring' or 'allgather', planned by `mask` when given; held:
    the all-gather's over a latent gathered before (allgather_forward)."""
    forward, backward = PATTERNS[comm]
    kw = {**({} if mask is None else dict(mask=mask)), **(dict(held=True) if held else {})}
    return (partial(forward, **kw), partial(backward, **kw)) if kw else (forward, backward)


class LatentAttention(torch.autograd.Function):
    """(out (B, S, H, dv), lse (B, H, S) fp32, not differentiable) of a latent pattern.

    apply(q, latent, sinks, pattern, group, causal, layout, scale, kernel, expansion,
    *expansion.params): the parameters are inputs so that autograd routes their gradients.
    Saved for backward: q, the latent, the parameters, out, lse, sinks: never the expanded
    K,V, which backward makes again block by block. Gradients: dq, the latent's (its rows:
    this rank's tokens, complete), dsinks and the parameters' (this rank's shares).
    """

    @staticmethod
    def forward(ctx, q, latent, sinks, pattern, group, causal, layout, scale, kernel,
                expansion, *params):
        forward_fn, ctx.backward_fn = pattern
        out, lse = forward_fn(q, latent, expansion, group, causal, layout, scale, kernel,
                              sinks=sinks)
        ctx.save_for_backward(q, latent, out, lse, sinks, *params)
        ctx.args = (group, causal, layout, scale, kernel)
        ctx.expansion = expansion
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, latent, out, lse, sinks, *_ = ctx.saved_tensors
        dq, dlat, dparams = ctx.backward_fn(dout, q, latent, ctx.expansion, out, lse,
                                            *ctx.args)
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[2] else None
        dparams = [g.to(p.dtype) for g, p in zip(dparams, ctx.expansion.params)]
        return (dq, dlat, dsinks, None, None, None, None, None, None, None, *dparams)
