"""Per-rank counters of context-parallel attention: bytes moved, attention FLOPs, kernel calls.

    with cp_stats() as st:           # ring_stats() is the same function, under its old name
        out = context_parallel_attention(q, k, v, comm="ulysses", ...)
        out.backward(dout)
    st.fwd_bytes_sent, st.bwd_flops, st.fwd_comm_ops, ...

Every pattern counts the same way, so patterns can be compared (docs/parallelism.md has the
formulas; tests/test_context_parallel.py asserts them):

- bytes: what this rank puts on (sent) and takes off (recv) the wire, at the minimum an
  algorithm needs: a P2P message once; an all-gather of b bytes per rank (P-1)*b each way;
  a reduce-scatter to b bytes per rank (P-1)*b each way; an all-to-all of b bytes per rank
  (P-1)/P*b each way. No-communication runs (comm.NoComm) count no bytes.
- flops: attention matmuls only, forward 4*B*H*D per visible (query, key) pair a kernel
  computes (q k^T and p v), backward 2.5x that (recompute q k^T, then dv, dp, dq, dk). A
  causal diagonal block of L rows counts L(L+1)/2 pairs; an explicitly masked block (a
  window's tile, mask.py) or a flash-attn window call (bands.py) only its visible ones, so
  the total is the mask's exact count.
- blocks: kernel calls (DeepSeek sparse attention: tiles of selected pairs, which count
  only those pairs; blocks_skipped: visiting blocks none of the rank's queries selected,
  dsa_attention.py); comm_ops: communication calls (one batched P2P exchange, one
  collective), the "collectives per layer" of the docs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import List

from .mask import visible_pairs


@dataclass
class CPStats:
    """Per-rank totals while a ``cp_stats()`` block is open (forward and backward apart)."""

    fwd_bytes_sent: int = 0
    fwd_bytes_recv: int = 0
    bwd_bytes_sent: int = 0
    bwd_bytes_recv: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_blocks: int = 0  # kernel calls
    bwd_blocks: int = 0
    fwd_comm_ops: int = 0  # P2P batches and collectives issued
    bwd_comm_ops: int = 0
    fwd_blocks_skipped: int = 0  # visiting blocks no local query selected (sparse attention)
    bwd_blocks_skipped: int = 0

    def add(self, **deltas: int) -> None:
        for k, v in deltas.items():
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


RingStats = CPStats  # the name before all-gather, Ulysses and hybrid CP existed

_ACTIVE: List[CPStats] = []  # open cp_stats() blocks; backward may run on another thread


@contextmanager
def cp_stats():
    """``with cp_stats() as st: ...`` counts this rank's bytes, FLOPs and calls (CPStats)."""
    st = CPStats()
    _ACTIVE.append(st)
    try:
        yield st
    finally:
        # by identity: a block nested in another can hold equal counts (remove() would
        # take the outer one out)
        del _ACTIVE[next(i for i, open_ in enumerate(_ACTIVE) if open_ is st)]


ring_stats = cp_stats


def record(**deltas: int) -> None:
    """Add to every open cp_stats() block (nothing to do when none is open)."""
    for st in _ACTIVE:
        st.add(**deltas)


def record_comm(phase: str, sent: int, recv: int, ops: int = 1) -> None:
    """Bytes and calls of one communication step in phase 'fwd' or 'bwd'."""
    record(**{f"{phase}_bytes_sent": sent, f"{phase}_bytes_recv": recv,
              f"{phase}_comm_ops": ops})


def square_pairs(S: int, causal: bool) -> int:
    """Visible (query, key) pairs of S queries over the same S keys, with no other mask:
    the lower triangle with its diagonal when causal, all S * S otherwise."""
    return visible_pairs(0, S) if causal else S * S


def attention_flops(batch: int, heads: int, head_dim: float, pairs: int, phase: str) -> int:
    """Matmul FLOPs of attention over `pairs` (query, key) pairs (see the module docstring).
    head_dim: the mean of q's and v's head dims where they differ (MLA: q k^T runs at
    q's, p v at v's), so 4 * head_dim is always an integer."""
    per_pair = int(4 * batch * heads * head_dim)
    return per_pair * pairs if phase == "fwd" else per_pair * pairs * 5 // 2
