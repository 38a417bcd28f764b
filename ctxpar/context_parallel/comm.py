"""Communication of context-parallel attention: the P2P ring and the three collectives.

Every call takes its group explicitly: a process group, None (the world), or a ``NoComm``
stand-in with which nothing is sent (benchmarks, and ``LOCAL`` for a rank alone).
Collectives record their bytes in stats.py at the minimum an algorithm needs.

RingComm: post a send to the next rank and a receive from the previous one, wait later.

The shape is ring-flash-attention's ``RingComm``: ``send_recv`` only queues two P2P ops,
``commit`` starts them all with one ``dist.batch_isend_irecv`` (asynchronous on gloo and
NCCL alike), ``wait`` blocks on them. A ring step therefore reads

    comm.send_recv(kv, recv_buf); comm.commit()   # transfer of the next block starts
    ... attention on the current block ...        # overlaps with the transfer
    comm.wait(); kv, recv_buf = recv_buf, kv       # double buffer: swap, never copy

Peers are *global* ranks (``dist.get_global_rank``) because P2POp wants them even inside a
subgroup. Nothing here synchronises a device: the same calls run on gloo (CPU tests) and
NCCL (GPU ring), where the ops are ordered on the communicator's stream.
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .stats import record_comm

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for these names;
# older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


class NoComm(NamedTuple):
    """A group in which nothing moves: rank `rank` of `world_size` runs its own schedule
    with its local data standing in for every remote piece. For benchmarks (compute alone,
    or one rank of a simulated group: the result is then wrong) and, as ``LOCAL``, for a
    rank alone, where it is exact."""

    rank: int
    world_size: int


LOCAL = NoComm(0, 1)  # no group at all: plain local attention


def group_rank_and_size(group=None) -> Tuple[int, int]:
    """(rank in group, group size); a process with no process group is rank 0 of 1."""
    if isinstance(group, NoComm):
        return group.rank, group.world_size
    if group is None:
        if not dist.is_initialized():
            return 0, 1
        group = dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


class RingComm:
    """Point-to-point ring over ``group``: send to rank+1, receive from rank-1 (group ranks)."""

    def __init__(self, group=None):
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.world_size = group_rank_and_size(self.group)
        self.send_rank = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self.recv_rank = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self._ops: List[dist.P2POp] = []
        self._reqs: Optional[list] = None
        self.bytes_sent = 0  # cumulative, for cp_stats() and the benchmark
        self.bytes_recv = 0
        self.ops = 0  # committed batches

    def _peers(self, hops: int) -> Tuple[int, int]:
        """Global ranks of (rank + hops, rank - hops) in the group."""
        if hops == 1:
            return self.send_rank, self.recv_rank
        return (dist.get_global_rank(self.group, (self.rank + hops) % self.world_size),
                dist.get_global_rank(self.group, (self.rank - hops) % self.world_size))

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor, hops: int = 1) -> None:
        """Queue send(to_send -> rank+hops) and recv(rank-hops -> recv_buf), the caller's
        double buffer (hops > 1: a shortcut home, e.g. a ring stopped early).

        Both must be contiguous (P2P sends raw storage). Nothing moves before commit().
        """
        if not (to_send.is_contiguous() and recv_buf.is_contiguous()):
            raise ValueError("RingComm.send_recv needs contiguous tensors "
                             f"(send strides {tuple(to_send.stride())}, "
                             f"recv strides {tuple(recv_buf.stride())})")
        send_rank, recv_rank = self._peers(hops)
        self._ops.append(dist.P2POp(dist.isend, to_send, send_rank, group=self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_buf, recv_rank, group=self.group))
        self.bytes_sent += to_send.numel() * to_send.element_size()
        self.bytes_recv += recv_buf.numel() * recv_buf.element_size()

    def commit(self) -> None:
        """Start every queued op at once (one batch, so sends and receives cannot deadlock)."""
        assert self._reqs is None, "commit() twice without wait()"
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)
            self._ops = []
            self.ops += 1

    def wait(self) -> None:
        """Block until the committed batch has completed (both directions)."""
        assert self._reqs is not None, "wait() without commit()"
        for req in self._reqs:
            req.wait()
        self._reqs = None


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def all_gather(x: torch.Tensor, group, phase: str, async_op: bool = False):
    """(out (P, *x.shape) with every rank's x in group-rank order, work or None).

    With async_op the caller must ``work.wait()`` before reading other ranks' slots; its
    own slot, x itself, can be used at once. Bytes: (P-1)*|x| each way.
    """
    rank, world = group_rank_and_size(group)
    x = x.contiguous()
    if world == 1:
        return x.unsqueeze(0), None
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    if isinstance(group, NoComm):  # the same write, the local x in every slot
        out.copy_(x.expand_as(out))
        return out, None
    # The concatenated form (P*x0, ...): gloo accepts no other.
    work = _all_gather_single(out.flatten(0, 1), x, group=group, async_op=async_op)
    record_comm(phase, (world - 1) * _nbytes(x), (world - 1) * _nbytes(x))
    return out, work


def reduce_scatter(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """x (P, *shape), slot p for rank p -> (shape): the sum over ranks of their slot for us.

    Bytes: (P-1)*|x|/P each way (reduce-scatter's minimum); sums in x's dtype.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return x[0]
    if isinstance(group, NoComm):
        return x[rank].clone()
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.flatten(0, 1), op=dist.ReduceOp.SUM, group=group)
    record_comm(phase, (world - 1) * _nbytes(out), (world - 1) * _nbytes(out))
    return out


def all_to_all(xs: Iterable[torch.Tensor], group, phase: str) -> List[torch.Tensor]:
    """Each x (P, ...) contiguous, piece p for rank p -> (P, ...) with piece p from rank p.

    One all-to-all per tensor, each into its own buffer, all started before any is waited
    for (asynchronous on gloo and NCCL alike): a receiver gets every tensor whole and
    contiguous, where one joint message would hand it strided slices (Ulysses' q, k, v: a
    kernel reads those slower). xs may be a generator: the tensor after one is then made
    (packed) while that one is in flight. Bytes: (P-1)/P*|x| each way per x.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return list(xs)
    if isinstance(group, NoComm):
        return [x.clone() for x in xs]
    outs, works, sent, sends = [], [], 0, []
    for x in xs:
        assert x.is_contiguous() and x.shape[0] == world, (x.shape, world)
        sends.append(x)  # alive until its all-to-all is waited for, whatever the backend
        outs.append(torch.empty_like(x))
        works.append(dist.all_to_all_single(outs[-1], x, group=group, async_op=True))
        sent += (world - 1) * _nbytes(x) // world  # the piece for ourselves stays
    for work in works:
        work.wait()
    record_comm(phase, sent, sent, ops=len(outs))
    return outs


def _peer(group, rank: int) -> int:
    return dist.get_global_rank(dist.group.WORLD if group is None else group, rank)


def exchange(group, sends, recvs, phase: str):
    """Start one P2P batch of sends [(peer, tensor)] and receives [(peer, tensor)], peers
    as group ranks; returns the requests (none on a NoComm group: nothing moves). The
    halos' exchange (halo.py, linear/conv.py): wait_all(requests) before reading."""
    if isinstance(group, NoComm) or not (sends or recvs):
        return []
    ops = [dist.P2POp(dist.isend, t, _peer(group, p), group=group) for p, t in sends] \
        + [dist.P2POp(dist.irecv, t, _peer(group, p), group=group) for p, t in recvs]
    record_comm(phase, sum(_nbytes(t) for _, t in sends), sum(_nbytes(t) for _, t in recvs))
    return dist.batch_isend_irecv(ops)


def wait_all(reqs) -> None:
    for req in reqs:
        req.wait()
