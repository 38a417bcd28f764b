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
"""
from __future__ import annotations

import torch

from .blocks import backward_block, block_plan, forward_block_
from .comm import NoComm, RingComm, group_rank_and_size
from .merge import empty_accumulators
from .stats import attention_flops, record


def _local_forward(q, k, v, causal, scale, kernel):
    """A rank alone: one kernel call over everything, no accumulators."""
    B, S, H, D = q.shape
    out, lse = kernel.forward(q, k, v, causal, scale)
    pairs = S * (S + 1) // 2 if causal else S * S
    record(fwd_flops=attention_flops(B, H, D, pairs, "fwd"), fwd_blocks=1)
    return out, lse


def ring_forward(q, k, v, group, causal, layout, scale, kernel):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32) of this rank's queries.

    group: a process group, None (the world) or a comm.NoComm (the local KV stands in for
    every received block, no byte moves: the benchmark's compute-only ring).
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return _local_forward(q, k, v, causal, scale, kernel)
    S = q.shape[1]
    out, lse = empty_accumulators(q)
    kv = torch.stack((k, v))  # (2, B, S, Hkv, D): one contiguous message per step
    comm = None if isinstance(group, NoComm) else RingComm(group)
    recv = torch.empty_like(kv) if comm else None
    for step in range(world):
        if comm and step + 1 < world:  # start moving the next block before computing
            comm.send_recv(kv, recv)
            comm.commit()
        blk = block_plan(layout, causal, rank, (rank - step) % world, S)
        if blk is not None:
            forward_block_(kernel, q, kv[0], kv[1], blk, scale, out, lse)
        if comm and step + 1 < world:
            comm.wait()
            kv, recv = recv, kv  # double buffer: the sent one is free again
    if comm:
        record(fwd_bytes_sent=comm.bytes_sent, fwd_bytes_recv=comm.bytes_recv,
               fwd_comm_ops=comm.ops)
    return out.to(q.dtype), lse


def _local_backward(dout, q, k, v, out, lse, causal, scale, kernel):
    B, S, H, D = q.shape
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    pairs = S * (S + 1) // 2 if causal else S * S
    record(bwd_flops=attention_flops(B, H, D, pairs, "bwd"), bwd_blocks=1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward(dout, q, k, v, out, lse, group, causal, layout, scale, kernel):
    """(dq, dk, dv) of this rank's q/k/v; dk/dv have k's kv_heads.

    Per step each rank sends the visiting KV on (not after the last step: P-1 sends, in
    k's dtype) and the fp32 dK,dV accumulator of that same block (every step: P sends,
    the last one carries each block's gradient home).
    """
    rank, world = group_rank_and_size(group)
    dout = dout.contiguous()
    if world == 1:
        return _local_backward(dout, q, k, v, out, lse, causal, scale, kernel)
    S = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))                                       # (2, B, S, Hkv, D)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    ring = not isinstance(group, NoComm)
    kv_comm, dkv_comm = (RingComm(group), RingComm(group)) if ring else (None, None)
    kv_recv = torch.empty_like(kv) if ring else None
    dkv_recv = torch.empty_like(dkv) if ring else None
    for step in range(world):
        if kv_comm and step + 1 < world:
            kv_comm.send_recv(kv, kv_recv)
            kv_comm.commit()
        blk = block_plan(layout, causal, rank, (rank - step) % world, S)
        grads = None
        if blk is not None:
            qs, ks, grads = backward_block(kernel, dout, q, kv[0], kv[1], out, lse, blk, scale)
            dq[:, qs] += grads[0]
        if dkv_comm and step > 0:
            dkv_comm.wait()  # the accumulator of the block we hold, from rank - 1
            dkv, dkv_recv = dkv_recv, dkv
        if grads is not None:
            dkv[0, :, ks] += grads[1]
            dkv[1, :, ks] += grads[2]
        if dkv_comm:
            dkv_comm.send_recv(dkv, dkv_recv)
            dkv_comm.commit()
        if kv_comm and step + 1 < world:
            kv_comm.wait()
            kv, kv_recv = kv_recv, kv
    if dkv_comm:
        dkv_comm.wait()  # our own block's dK,dV, complete after its P-th hop
        dkv = dkv_recv
        record(bwd_bytes_sent=kv_comm.bytes_sent + dkv_comm.bytes_sent,
               bwd_bytes_recv=kv_comm.bytes_recv + dkv_comm.bytes_recv,
               bwd_comm_ops=kv_comm.ops + dkv_comm.ops)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


PATTERN = (ring_forward, ring_backward)  # for blocks.BlockwiseAttention
