"""RingComm: post a send to the next rank and a receive from the previous one, wait later.

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

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


def group_rank_and_size(group=None) -> Tuple[int, int]:
    """(rank in group, group size); a process with no process group is rank 0 of 1."""
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
        self.bytes_sent = 0  # cumulative, for ring_stats() and the benchmark
        self.bytes_recv = 0

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor) -> None:
        """Queue send(to_send -> next) and recv(prev -> recv_buf), the caller's double buffer.

        Both must be contiguous (P2P sends raw storage). Nothing moves before commit().
        """
        if not (to_send.is_contiguous() and recv_buf.is_contiguous()):
            raise ValueError("RingComm.send_recv needs contiguous tensors "
                             f"(send strides {tuple(to_send.stride())}, "
                             f"recv strides {tuple(recv_buf.stride())})")
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_rank, group=self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_buf, self.recv_rank, group=self.group))
        self.bytes_sent += to_send.numel() * to_send.element_size()
        self.bytes_recv += recv_buf.numel() * recv_buf.element_size()

    def commit(self) -> None:
        """Start every queued op at once (one batch, so sends and receives cannot deadlock)."""
        assert self._reqs is None, "commit() twice without wait()"
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)
            self._ops = []

    def wait(self) -> None:
        """Block until the committed batch has completed (both directions)."""
        assert self._reqs is not None, "wait() without commit()"
        for req in self._reqs:
            req.wait()
        self._reqs = None
