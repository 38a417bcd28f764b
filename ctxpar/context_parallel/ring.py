"""Ring attention (``comm="ring"``): K,V blocks travel a P2P ring, queries stay home.

Every rank keeps its queries; key/value blocks travel the ring (rank r sends to r+1 and
receives from r-1), so at step s rank r holds the KV of rank src = (r - s) mod P. Each
block's partial result is merged into the running (out, lse) with the log-sum-exp update
(merge.py), in fp32; the causal skip rules are blocks.block_plan.

Backward is a second ring: K,V travel again; dK,dV accumulate in fp32 and travel *with*
them, so after P hops every rank's dK,dV arrive home complete. Each block's backward uses
the global out and lse saved by the forward, which makes the block gradients exact.
Communication is explicit P2P (comm.RingComm) and never part of the autograd graph.

Overlap: the next block's transfer is started before computing on the current one and
waited for only after it. A group of one rank (or ``comm.LOCAL``) is one kernel call.

Copies: none of K,V. The first step sends the caller's k and v themselves (two P2P ops in
one batch, so no ``stack``); visiting blocks land in two alternating receive buffers, never
in k, v (autograd saved them). The backward slices of dout/q/out are views; the one slice
the kernels need contiguous (lse rows) is made once per distinct row range, not per step.
"""
from __future__ import annotations

import torch

from functools import partial

from .blocks import (QueryRows, backward_block, banded, forward_block_, ring_steps,
                     step_plan)
from .comm import NoComm, RingComm, group_rank_and_size
from .halo import halo_applies, halo_backward, halo_forward
from .merge import empty_accumulators
from .sinks import finish
from .stats import attention_flops, record, square_pairs


def _local_forward(q, k, v, causal, scale, kernel, sinks=None):
    """A rank alone: one kernel call over everything, no accumulators."""
    B, S, H, D = q.shape
    out, lse = kernel.forward(q, k, v, causal, scale)
    pairs = square_pairs(S, causal)
    record(fwd_flops=attention_flops(B, H, D, pairs, "fwd"), fwd_blocks=1)
    if sinks is not None:
        return finish(out, lse.float(), q.dtype, sinks)
    return out, lse.contiguous()  # kept for backward, sent by Ulysses: contiguous


class KVRing:
    """The visiting blocks of a ring: the caller's own tensors first, then those received.

    ``tensors`` is what one block is made of: (k, v) for attention, (latent,) for MLA
    (latent.py). Receive buffers alternate (two sets, one when a single hop is left), so
    what is being sent is never what is being written; the caller's tensors are only ever
    sent.
    """

    def __init__(self, tensors, comm, hops: int):
        self.kv = tuple(x.contiguous() for x in tensors)  # no-ops for projections' outputs
        self.comm, self.step = comm, 0
        n = min(hops, 2) if comm else 0
        self._bufs = [tuple(torch.empty_like(x) for x in self.kv) for _ in range(n)]
        self._recv = None

    def start(self) -> None:
        """Send the current blocks on and receive the next (one batch of P2P ops)."""
        self._recv = self._bufs[self.step % 2]
        for x, buf in zip(self.kv, self._recv):
            self.comm.send_recv(x, buf)
        self.comm.commit()

    def finish(self) -> None:
        self.comm.wait()
        self.kv, self._recv = self._recv, None
        self.step += 1


def ring_forward(q, k, v, group, causal, layout, scale, kernel, mask=None, sinks=None):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32) of this rank's queries.

    group: a process group, None (the world) or a comm.NoComm (the local KV stands in for
    every received block, no byte moves: the benchmark's compute-only ring).
    mask: None (plain causal or full) or the AttentionMask (mask.py; windows, documents).
    sinks: None or (H,) sink logits, applied once to the merged rows (sinks.py).
    """
    rank, world = group_rank_and_size(group)
    if world == 1 and mask is None:
        return _local_forward(q, k, v, causal, scale, kernel, sinks)
    if halo_applies(layout, mask, q.shape[1], world):  # short window or chunks: the halo
        return halo_forward(q, k, v, group, causal, layout, scale, kernel, mask, sinks)
    S = q.shape[1]
    out, lse = empty_accumulators(q)
    steps = ring_steps(layout, causal, S, world, mask)  # < world: the mask ends the ring early
    comm = None if isinstance(group, NoComm) or steps == 1 else RingComm(group)
    ring = KVRing((k, v), comm, steps - 1)
    bands = banded(kernel, q)
    for step in range(steps):
        if comm and step + 1 < steps:  # start moving the next block before computing
            ring.start()
        for b, blk in step_plan(layout, causal, rank, (rank - step) % world, S, world, mask,
                                bands):
            forward_block_(kernel, q, *ring.kv, blk, scale, out, lse, b)
        if comm and step + 1 < steps:
            ring.finish()
    if comm:
        record(fwd_bytes_sent=comm.bytes_sent, fwd_bytes_recv=comm.bytes_recv,
               fwd_comm_ops=comm.ops)
    return finish(out, lse, q.dtype, sinks)


def _local_backward(dout, q, k, v, out, lse, causal, scale, kernel):
    B, S, H, D = q.shape
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    pairs = square_pairs(S, causal)
    record(bwd_flops=attention_flops(B, H, D, pairs, "bwd"), bwd_blocks=1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel,
                  grad_dtype: torch.dtype = torch.float32, mask=None):
    """(dq, dk, dv) of this rank's q/k/v; dk/dv have k's kv_heads.

    With documents the ring stops after the last step any rank has work at
    (blocks.ring_steps), and each accumulator then goes straight to its block's owner.
    Per step each rank sends the visiting KV on (not after the last step: P-1 sends, in
    k's dtype) and the dK,dV accumulator of that same block (every step: P sends, the last
    one carries each block's gradient home). The accumulator travels in `grad_dtype`:
    fp32 (default) is exact; bf16 halves these bytes, the larger part of the backward's,
    at the price of one bf16 rounding of the running sum per hop (each rank still adds its
    block's gradient in fp32: received -> fp32, += grads, -> bf16 to send).
    """
    rank, world = group_rank_and_size(group)
    dout = dout.contiguous()  # a no-op for autograd's usual dout
    if world == 1 and mask is None:
        return _local_backward(dout, q, k, v, out, lse, causal, scale, kernel)
    if halo_applies(layout, mask, q.shape[1], world):
        return halo_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel,
                             mask, grad_dtype)
    S = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)  # (2,B,S,Hkv,D)
    steps = ring_steps(layout, causal, S, world, mask)  # < world: the mask ends the ring early
    ring = not isinstance(group, NoComm) and steps > 1
    kv_comm, dkv_comm = (RingComm(group), RingComm(group)) if ring else (None, None)
    kv = KVRing((k, v), kv_comm, steps - 1)
    exact = grad_dtype == torch.float32  # fp32 on the wire: swap buffers, never cast
    dkv_recv = torch.empty_like(dkv, dtype=grad_dtype) if ring else None
    dkv_send = None if exact or not ring else torch.empty_like(dkv_recv)
    rows = QueryRows(dout, q, out, lse)
    bands = banded(kernel, q)
    for step in range(steps):
        if kv_comm and step + 1 < steps:
            kv.start()
        grads = []
        for b, blk in step_plan(layout, causal, rank, (rank - step) % world, S, world, mask,
                                bands):
            qs, ks, g = backward_block(kernel, rows, *kv.kv, blk, scale, b)
            dq[b, qs] += g[0]
            grads.append((b, ks, g))
        if dkv_comm and step > 0:
            dkv_comm.wait()  # the accumulator of the block we hold, from rank - 1
            if exact:
                dkv, dkv_recv = dkv_recv, dkv
            else:
                dkv.copy_(dkv_recv)
        for b, ks, g in grads:
            dkv[0, b, ks] += g[1]
            dkv[1, b, ks] += g[2]
        grads = g = None  # this step's block gradients go before the next step's are made
        if dkv_comm:
            if not exact:  # the previous send completed with the wait above
                dkv_send.copy_(dkv)
            # On to the next rank; after the last step straight home to the block's owner
            # (rank - step): one hop when the ring went all the way round, more when
            # documents ended it early.
            hops = 1 if step + 1 < steps else world - step
            dkv_comm.send_recv(dkv if exact else dkv_send, dkv_recv, hops)
            dkv_comm.commit()
        if kv_comm and step + 1 < steps:
            kv.finish()
    if dkv_comm:
        dkv_comm.wait()  # our own block's dK,dV, complete after its P-th hop
        dkv = dkv_recv
        record(bwd_bytes_sent=kv_comm.bytes_sent + dkv_comm.bytes_sent,
               bwd_bytes_recv=kv_comm.bytes_recv + dkv_comm.bytes_recv,
               bwd_comm_ops=kv_comm.ops + dkv_comm.ops)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


PATTERN = (ring_forward, ring_backward)  # for blocks.BlockwiseAttention
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # parallel.ring_grad_dtype


def ring_pattern(grad_dtype: str = "fp32", mask=None):
    """The ring's (forward, backward) with dK,dV travelling in `grad_dtype` ('fp32'|'bf16'),
    planned by `mask` (an AttentionMask: windows, documents; mask.py) when given."""
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"ring_grad_dtype={grad_dtype!r} must be one of {list(GRAD_DTYPES)}")
    if grad_dtype == "fp32" and mask is None:
        return PATTERN
    return (partial(ring_forward, mask=mask),
            partial(ring_backward, grad_dtype=GRAD_DTYPES[grad_dtype], mask=mask))
