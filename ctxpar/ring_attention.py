"""Ring attention: exact softmax attention over a sequence sharded across a CP group.

Every rank keeps its queries; key/value blocks travel the ring (rank r sends to r+1 and
receives from r-1), so at step s rank r holds the KV of rank src = (r - s) mod P. Each
block's partial result is merged into the running (out, lse) with the log-sum-exp update
of seed 001 (ring-flash-attention's ``update_out_and_lse``), in fp32.

Backward is a second ring: K,V travel again; dK,dV accumulate in fp32 and travel *with*
them, so after P hops every rank's dK,dV arrive home complete. Each block's backward uses
the global out and lse saved by the forward, which makes the block gradients exact.
Communication is explicit P2P (comm.RingComm) and never part of the autograd graph.

Causal skip rules (which block of q/kv a step computes) are in ``block_plan``; the layouts
are in sharding.py. Overlap: the next block's transfer is started before computing on the
current one and waited for only after it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import List, NamedTuple, Optional

import torch

from .attention_backends import default_scale, get_backend
from .comm import RingComm, group_rank_and_size
from .sharding import check_layout

# ---------------------------------------------------------------- instrumentation


@dataclass
class RingStats:
    """Per-rank totals while a ``ring_stats()`` block is open (forward and backward apart).

    flops count attention matmuls only: forward 4*B*H*D per visible (query, key) pair the
    kernels compute (q k^T and p v), backward 2.5x that (recompute q k^T, then dv, dp,
    dq, dk). A causal diagonal block of L rows counts L(L+1)/2 pairs.
    """

    fwd_bytes_sent: int = 0
    fwd_bytes_recv: int = 0
    bwd_bytes_sent: int = 0
    bwd_bytes_recv: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_blocks: int = 0  # kernel calls
    bwd_blocks: int = 0

    def add(self, **deltas: int) -> None:
        for k, v in deltas.items():
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_ACTIVE_STATS: List[RingStats] = []  # open ring_stats() blocks; backward may run on another thread


@contextmanager
def ring_stats():
    """``with ring_stats() as st: ...`` counts bytes and attention FLOPs of this rank."""
    st = RingStats()
    _ACTIVE_STATS.append(st)
    try:
        yield st
    finally:
        _ACTIVE_STATS.remove(st)


def _record(**deltas: int) -> None:
    for st in _ACTIVE_STATS:
        st.add(**deltas)


# ---------------------------------------------------------------- what each step computes


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


# ---------------------------------------------------------------- the LSE merge


def merge_block_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-merge of (out, lse) and (block_out, block_lse).

    out (B, L, H, D) fp32, lse (B, H, L) fp32 (may be views into the full accumulators).
    Seed 001 / ring-flash-attention, without exponentiating a raw LSE:
        out <- out - sigmoid(block_lse - lse) * (out - block_out)
        lse <- logaddexp(lse, block_lse)
    logaddexp (not lse - logsigmoid(lse - block_lse)) keeps -inf - -inf out of it, and a
    row where both sides are -inf (no key seen yet) gets weight 0 instead of NaN.
    """
    block_lse = block_lse.float()
    w = torch.sigmoid(block_lse - lse).nan_to_num_(nan=0.0)  # (B, H, L)
    out.lerp_(block_out.float(), w.transpose(1, 2).unsqueeze(-1))  # out + w * (block - out)
    lse.copy_(torch.logaddexp(lse, block_lse))


# ---------------------------------------------------------------- forward and backward rings


class NoComm(NamedTuple):
    """Benchmarks only: run rank `rank`'s block schedule of a ring of `world_size` with the
    local KV standing in for every received block, so no byte moves. Times the ring's
    compute alone (overlap ratio), or one rank of a simulated ring; the result is wrong."""

    rank: int
    world_size: int


def ring_forward(q, k, v, group, causal, layout, scale, backend, no_comm=None):
    """(out (B,S,H,D) in q.dtype, lse (B,H,S) fp32) of this rank's queries."""
    rank, world = no_comm if no_comm is not None else group_rank_and_size(group)
    B, S, H, D = q.shape
    out = torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # (2, B, S, Hkv, D): one contiguous message per step
    comm = RingComm(group) if world > 1 and no_comm is None else None
    recv = torch.empty_like(kv) if comm else None
    for step in range(world):
        if comm and step + 1 < world:  # start moving the next block before computing
            comm.send_recv(kv, recv)
            comm.commit()
        blk = block_plan(layout, causal, rank, (rank - step) % world, S)
        if blk is not None:
            bo, bl = backend.forward(q[:, blk.q0:blk.q1], kv[0, :, blk.k0:blk.k1],
                                     kv[1, :, blk.k0:blk.k1], blk.causal, scale)
            merge_block_(out[:, blk.q0:blk.q1], lse[:, :, blk.q0:blk.q1], bo, bl)
            _record(fwd_flops=4 * B * H * D * blk.pairs(), fwd_blocks=1)
        if comm and step + 1 < world:
            comm.wait()
            kv, recv = recv, kv  # double buffer: the sent one is free again
    if comm:
        _record(fwd_bytes_sent=comm.bytes_sent, fwd_bytes_recv=comm.bytes_recv)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, group, causal, layout, scale, backend,
                  no_comm=None):
    """(dq, dk, dv) of this rank's q/k/v; dk/dv have k's kv_heads.

    Per step each rank sends the visiting KV on (not after the last step: P-1 sends, in
    k's dtype) and the fp32 dK,dV accumulator of that same block (every step: P sends,
    the last one carries each block's gradient home).
    """
    rank, world = no_comm if no_comm is not None else group_rank_and_size(group)
    B, S, H, D = q.shape
    dout = dout.contiguous()
    dq = torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))                                       # (2, B, S, Hkv, D)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    ring = world > 1 and no_comm is None
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
            qs, ks = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            grads = backend.backward(dout[:, qs], q[:, qs], kv[0, :, ks], kv[1, :, ks],
                                     out[:, qs], lse[:, :, qs], blk.causal, scale)
            dq[:, qs] += grads[0]
            _record(bwd_flops=10 * B * H * D * blk.pairs(), bwd_blocks=1)
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
        _record(bwd_bytes_sent=kv_comm.bytes_sent + dkv_comm.bytes_sent,
                bwd_bytes_recv=kv_comm.bytes_recv + dkv_comm.bytes_recv)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale, backend, no_comm):
        out, lse = ring_forward(q, k, v, group, causal, layout, scale, backend, no_comm)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, layout, scale, backend, no_comm)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------- public entry point


def _check_inputs(q, k, v, layout, backend_name):
    """Local checks only, with rank-independent messages: every rank raises the same error
    before any communication when the inputs are the same kind of wrong on every rank."""
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"ring_attention: {name} must be a 4-D tensor "
                             f"(batch, local_seq, heads, head_dim), got {shape}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"ring_attention: q, k, v must share one floating dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"ring_attention: q, k, v on different devices: "
                         f"{q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"ring_attention: k and v shapes differ: {tuple(k.shape)} vs "
                         f"{tuple(v.shape)}")
    (B, S, H, D), (Bk, Sk, Hkv, Dk) = q.shape, k.shape
    if (B, S, D) != (Bk, Sk, Dk):
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must "
                         "agree in batch, local_seq and head_dim")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"ring_attention: heads={H} is not a multiple of kv_heads={Hkv}")
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(f"ring_attention: layout 'zigzag' needs an even local_seq "
                         f"(two chunks per rank), got {S}")
    return get_backend(backend_name, q)


def _ring_attention(q, k, v, group=None, causal=False, layout="contiguous",
                    softmax_scale=None, backend="auto", return_lse=False, no_comm=None):
    kernel = _check_inputs(q, k, v, layout, backend)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), layout, scale, kernel,
                                    no_comm)
    return (out, lse) if return_lse else out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous",
                   softmax_scale: Optional[float] = None, backend: str = "auto",
                   return_lse: bool = False):
    """softmax(q k^T * scale) v over the full sequence, sharded across `group` (None = world).

    q: (batch, local_seq, heads, head_dim); k, v: (batch, local_seq, kv_heads, head_dim)
    with heads % kv_heads == 0 (GQA/MQA: only kv_heads travel the ring). The tokens each
    rank holds follow `layout` ('contiguous', 'zigzag', 'striped'; see sharding.py);
    `causal` masks by *global* position. backend: 'auto' (flash_attn > sdpa > math),
    'flash_attn', 'sdpa' or 'math'. softmax_scale defaults to head_dim ** -0.5.

    Returns out (batch, local_seq, heads, head_dim) in q's dtype, and with return_lse also
    lse (batch, heads, local_seq) fp32 (not differentiable). A group of one rank (or no
    process group at all) does plain attention without communication.

    Contract: local_seq (and every other shape) is the same on every rank of the group, as
    shard_sequence produces it. It is not verified across ranks, since that would cost a
    collective (and on GPU a host sync) on every call; the inputs are validated locally,
    before any communication, so inputs that are wrong alike everywhere raise the same
    ValueError on every rank and nobody is left waiting.
    """
    return _ring_attention(q, k, v, group, causal, layout, softmax_scale, backend,
                           return_lse)
