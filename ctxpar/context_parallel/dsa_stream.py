"""Every rank's blocks brought to this rank one at a time, for the DSA passes.

    stream_blocks(tensors, group, comm, visit)            # visit(src, blocks)
    grad = stream_blocks_back(tensors, group, comm, visit)  # visit(src, blocks) -> fp32 or None

comm="ring": the blocks travel the P2P ring (ring.KVRing: the next block moves while this
one is visited); backward, the fp32 gradient of the block held travels with it and,
after the last step, home (latent.ring_backward's schedule: P - 1 block sends, P gradient
sends). comm="allgather": all gathered once (the local slot visited while they land);
backward, every slot's gradient reduce-scattered home. One rank (or comm.LOCAL): the
local block only. The order of visits is the local block first, then rank - 1, rank - 2,
...: the result of each pass does not depend on it (top-k and LSE merges are exact).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .comm import NoComm, RingComm, all_gather, group_rank_and_size, reduce_scatter
from .ring import KVRing
from .stats import record


def _alone(group) -> bool:
    return isinstance(group, NoComm) or group_rank_and_size(group)[1] == 1


def stream_blocks(tensors: Sequence[torch.Tensor], group, comm: str,
                  visit: Callable[[int, tuple], None]) -> None:
    """visit(src, (block of each tensor of rank src)) for every rank src of the group."""
    rank, world = group_rank_and_size(group)
    if _alone(group):
        for src in range(world):  # a NoComm world: the local blocks stand in for all
            visit((rank - src) % world, tuple(tensors))
        return
    if comm == "allgather":  # the local block visited while the gathers land
        gathered = [all_gather(x, group, "fwd", async_op=True) for x in tensors]
        visit(rank, tuple(tensors))
        for _, work in gathered:
            work.wait()
        for src in range(1, world):
            visit((rank - src) % world, tuple(g[(rank - src) % world] for g, _ in gathered))
        return
    ring = RingComm(group)
    blocks = KVRing(tensors, ring, world - 1)
    for step in range(world):
        if step + 1 < world:
            blocks.start()
        visit((rank - step) % world, blocks.kv)
        if step + 1 < world:
            blocks.finish()
    record(fwd_bytes_sent=ring.bytes_sent, fwd_bytes_recv=ring.bytes_recv,
           fwd_comm_ops=ring.ops)


def stream_blocks_back(tensors: Sequence[torch.Tensor], group, comm: str,
                       visit: Callable[[int, tuple], Optional[torch.Tensor]]
                       ) -> torch.Tensor:
    """The fp32 gradient (B, s, C) of tensors[0] of this rank, summed over every rank's
    visit of it; visit(src, blocks) returns its (B, s, C) fp32 gradient of src's block,
    or None (nothing: skipped)."""
    rank, world = group_rank_and_size(group)
    x = tensors[0]
    if _alone(group):
        grad = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for src in range(world):
            g = visit((rank - src) % world, tuple(tensors))
            if g is not None and src == 0:  # a NoComm world keeps only its own block's
                grad += g
        return grad
    if comm == "allgather":
        gathered = [all_gather(t, group, "bwd")[0] for t in tensors]
        grads = torch.zeros((world, *x.shape), dtype=torch.float32, device=x.device)
        for src in range(world):
            blocks = tuple(tensors) if src == rank else tuple(g[src] for g in gathered)
            g = visit(src, blocks)
            if g is not None:
                grads[src] += g
        return reduce_scatter(grads, group, "bwd")
    ring, grad_ring = RingComm(group), RingComm(group)
    blocks = KVRing(tensors, ring, world - 1)
    grad = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    recv = torch.empty_like(grad)
    for step in range(world):
        if step + 1 < world:
            blocks.start()
        g = visit((rank - step) % world, blocks.kv)
        if step > 0:
            grad_ring.wait()  # the gradient so far of the block we hold, from rank - 1
            grad, recv = recv, grad
        if g is not None:
            grad += g
        g = None
        grad_ring.send_recv(grad, recv, 1 if step + 1 < world else world - step)
        grad_ring.commit()
        if step + 1 < world:
            blocks.finish()
    grad_ring.wait()  # our own block's gradient, complete
    record(bwd_bytes_sent=ring.bytes_sent + grad_ring.bytes_sent,
           bwd_bytes_recv=ring.bytes_recv + grad_ring.bytes_recv,
           bwd_comm_ops=ring.ops + grad_ring.ops)
    return recv
