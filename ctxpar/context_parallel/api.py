"""One entry point for attention over a CP group: ``context_parallel_attention(comm=...)``.

    out = context_parallel_attention(q, k, v, comm="ring", cp_group=g, causal=True,
                                     layout="zigzag")
    out, lse = context_parallel_attention(q, k, v, comm="hybrid", ulysses_group=u_g,
                                          ring_group=r_g, causal=True, layout="zigzag",
                                          return_lse=True)

comm       group(s) used                 what travels (details: docs/parallelism.md)
ring       cp_group                      K,V blocks over a P2P ring (ring.py)
allgather  cp_group                      K,V all-gathered once, dK,dV reduce-scattered
ulysses    cp_group (= the Ulysses one)  all-to-all sequence <-> heads around one kernel
hybrid     ulysses_group, ring_group     Ulysses inside each ring rank, the ring across

Every pattern is exact, forward and backward, for every layout, causal or not, MHA, GQA
and MQA. ``ContextParallel`` bundles the choice and the groups for a model; its
``latent_attention`` runs MLA the same ways with the latent on the wire (latent_api.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import allgather, ring
from .arguments import CP_COMMS, cp_group_size, resolve_mask, world_group
from .blocks import BlockwiseAttention
from .comm import LOCAL, group_rank_and_size
from .halo import halo_applies
from .hybrid import hybrid_attention
from .kernels import default_scale, get_backend
from .latent import LatentDims
from .latent_api import expanded_attention, heads_latent, latent_attention
from .layouts import check_layout, gather_sequence
from .mask import AttentionMask
from .ulysses import head_shard, ulysses_attention, ulysses_heads_kv


def _check_inputs(q, k, v, comm, layout, ulysses, caller):
    """Local checks only, with rank-independent messages: every rank raises the same error
    before any communication when the inputs are the same kind of wrong on every rank."""
    if comm not in CP_COMMS:
        raise ValueError(f"{caller}: unknown comm {comm!r}; choose one of {list(CP_COMMS)}")
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{caller}: {name} must be a 4-D tensor "
                             f"(batch, local_seq, heads, head_dim), got {shape}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{caller}: q, k, v must share one floating dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{caller}: q, k, v on different devices: "
                         f"{q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{caller}: k and v shapes differ: {tuple(k.shape)} vs "
                         f"{tuple(v.shape)}")
    (B, S, H, D), (Bk, Sk, Hkv, Dk) = q.shape, k.shape
    if (B, S, D) != (Bk, Sk, Dk):
        raise ValueError(f"{caller}: q {tuple(q.shape)} and k/v {tuple(k.shape)} must "
                         "agree in batch, local_seq and head_dim")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{caller}: heads={H} is not a multiple of kv_heads={Hkv}")
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq "
                         f"(two chunks per rank), got {S}")
    if H % ulysses != 0:
        raise ValueError(f"{caller}: heads={H} is not divisible by the Ulysses degree "
                         f"{ulysses} (comm={comm!r})")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               comm: str, cp_group=None, ulysses_group=None, ring_group=None,
                               causal: bool = False, layout: str = "contiguous",
                               softmax_scale: Optional[float] = None, backend: str = "auto",
                               return_lse: bool = False, ring_grad_dtype: str = "fp32",
                               cu_seqlens=None, mask: Optional[AttentionMask] = None,
                               held_kv=None):
    """softmax(q k^T * scale) v over the full sequence, sharded across a CP group.

    Longer than the others: the one public entry checks every argument here, before any
    collective, then hands the pattern its groups and mask.

    q: (batch, local_seq, heads, head_dim); k, v: (batch, local_seq, kv_heads, head_dim)
    with heads % kv_heads == 0. The tokens each rank holds follow `layout` ('contiguous',
    'zigzag', 'striped'; layouts.py, two-level under 'hybrid'); `causal` masks by *global*
    position. comm: 'ring', 'allgather', 'ulysses' over cp_group, or 'hybrid' over
    ulysses_group (inner, cp rank % u) x ring_group (outer, cp rank // u). A group left at
    None is the world, for every comm; hybrid's two groups cannot both be a world of more
    than one rank, so there a None group is refused (ValueError) unless the world is one
    process. backend: 'auto' (flash_attn > sdpa > math),
    'flash_attn', 'sdpa' or 'math'. softmax_scale defaults to head_dim ** -0.5.
    Groups may also be comm.NoComm stand-ins (benchmarks: nothing is sent).
    ring_grad_dtype: 'fp32' (exact) or 'bf16', the dtype the ring's travelling dK,dV
    accumulator crosses the links in (comm 'ring' and the ring part of 'hybrid').
    cu_seqlens: document boundaries in the *full* sequence (flash-attn's varlen convention:
    int32, 0 = cu[0] < cu[1] < ... < cu[-1] = full length), one 1-D tensor for the whole
    batch or a list of one per sample; tokens then attend only inside their document
    (documents.py), with every comm and backend: one dense or causal kernel call per
    document a block shares (the rare irregular block: an explicit mask, on the math
    kernel where the backend takes none).
    mask: the whole description instead of `causal` and `cu_seqlens` (mask.AttentionMask:
    causal, sliding_window, cu_seqlens, chunk_size, sinks); give one form or the other, not
    both. Blocks with no visible pair get no kernel call and the ring stops after the last
    step with one. A window reaches flash_attn and flash_attn4 as their window_size (one
    call per band, bands.py), the other backends as tiles of rows with a mask each (sdpa's
    attn_mask / attn_bias, math). Chunks are documents cut every chunk_size tokens
    (inside any given ones); sinks (heads,) join every row's softmax after the merge
    (sinks.py), on every comm and backend, and get this rank's share of their gradient.

    held_kv: K,V the pattern's exchange made before, once for every layer attending with
    them (Gemma 4's shared K/V; ContextParallel.held_kv): under 'ulysses' regrouped by heads
    (ulysses_heads_kv's), under 'allgather' every rank's slots (allgather.GatherSlots,
    (P, 2, B, S, Hkv, D)); only q and out travel, and no K,V are gathered again.

    Returns out (batch, local_seq, heads, head_dim) in q's dtype, and with return_lse also
    lse (batch, heads, local_seq) fp32 (not differentiable).

    Contract: local_seq (and every other shape) is the same on every rank of the group, as
    shard_sequence produces it. It is not verified across ranks, since that would cost a
    collective (and on GPU a host sync) on every call; the inputs are validated locally,
    before any communication, so inputs that are wrong alike everywhere raise the same
    ValueError on every rank and nobody is left waiting.
    """
    caller = "context_parallel_attention"
    if comm == "hybrid":
        ulysses_group = world_group(ulysses_group, caller, "ulysses_group")
        ring_group = world_group(ring_group, caller, "ring_group")
        u = group_rank_and_size(ulysses_group)[1]
    else:
        cp_group = world_group(cp_group)
        u = group_rank_and_size(cp_group)[1] if comm == "ulysses" else 1
    _check_inputs(q, k, v, comm, layout, u, caller)
    mask = resolve_mask(mask, causal, cu_seqlens, q,
                        cp_group_size(comm, cp_group, ulysses_group, ring_group), caller)
    causal, sinks = mask.causal, mask.sinks
    plan_mask = None if mask.plain else mask  # None: the plain causal / full block plan
    if held_kv is not None and comm not in ("ulysses", "allgather"):
        raise ValueError(f"{caller}: held_kv (K,V exchanged before) is Ulysses' or the "
                         f"all-gather's, not comm={comm!r}'s")
    if ring_grad_dtype != "fp32" and comm not in ("ring", "hybrid"):
        raise ValueError(f"{caller}: ring_grad_dtype={ring_grad_dtype!r} applies to the "
                         f"ring's dK,dV (comm 'ring' or 'hybrid'), not comm={comm!r}")
    kernel = get_backend(backend, q)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    lse = None
    if comm in ("ring", "allgather"):
        pattern = ring.ring_pattern(ring_grad_dtype, plan_mask) if comm == "ring" \
            else allgather.allgather_pattern(plan_mask, held=held_kv is not None)
        if held_kv is not None:  # the slots: (P, B, S, Hkv, D) each
            k, v = held_kv[:, 0], held_kv[:, 1]
        out, lse = BlockwiseAttention.apply(q, k, v, pattern, cp_group, causal, layout, scale,
                                            kernel, sinks)
    elif comm == "ulysses":
        local_pattern = ring.ring_pattern("fp32", plan_mask)  # the mask's blocks only
        head_sinks = head_shard(sinks, cp_group)

        def local(qh, kh, vh):  # the whole sequence of H/u heads: one kernel call
            return BlockwiseAttention.apply(qh, kh, vh, local_pattern, LOCAL, causal, layout,
                                            scale, kernel, head_sinks)
        out, lse = ulysses_attention(q, k, v, cp_group, layout, local, return_lse, held_kv)
    else:
        out, lse = hybrid_attention(q, k, v, ulysses_group, ring_group, causal, layout, scale,
                                    kernel, return_lse, ring_grad_dtype, plan_mask,
                                    head_shard(sinks, ulysses_group))
    return (out, lse) if return_lse else out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                   causal: bool = False, layout: str = "contiguous",
                   softmax_scale: Optional[float] = None, backend: str = "auto",
                   return_lse: bool = False, cu_seqlens=None,
                   mask: Optional[AttentionMask] = None):
    """``context_parallel_attention(comm="ring", cp_group=group, ...)``: K,V blocks travel
    a P2P ring over `group` (None = the world; no process group at all = plain attention)."""
    return context_parallel_attention(q, k, v, comm="ring", cp_group=group, causal=causal,
                                      layout=layout, softmax_scale=softmax_scale,
                                      backend=backend, return_lse=return_lse,
                                      cu_seqlens=cu_seqlens, mask=mask)


@dataclass(frozen=True)
class ContextParallel:
    """How a model's attention talks over CP: the pattern, its groups, the token layout.

    The data must be cut with the same layout (and, for 'hybrid', the Ulysses degree of
    ulysses_group: the two-level layout of layouts.py), as the CP-aware loader does.
    """

    comm: str = "ring"
    cp_group: object = None
    ulysses_group: object = None
    ring_group: object = None
    layout: str = "contiguous"
    ring_grad_dtype: str = "fp32"  # the ring's dK,dV on the wire (ring, hybrid)

    def __post_init__(self):
        if self.comm not in CP_COMMS:
            raise ValueError(f"cp_comm={self.comm!r} must be one of {list(CP_COMMS)}")
        check_layout(self.layout)
        if self.ring_grad_dtype not in ring.GRAD_DTYPES:
            raise ValueError(f"ring_grad_dtype={self.ring_grad_dtype!r} must be one of "
                             f"{list(ring.GRAD_DTYPES)}")

    @classmethod
    def from_state(cls, state, comm: str, layout: str,
                   ring_grad_dtype: str = "fp32") -> "ContextParallel":
        """The groups of a ParallelState (its ulysses/ring sub-groups for 'hybrid')."""
        return cls(comm, state.cp_group, state.ulysses_group, state.ring_group, layout,
                   ring_grad_dtype)

    def attention(self, q, k, v, *, causal: bool = False, backend: str = "auto",
                  softmax_scale: Optional[float] = None, return_lse: bool = False,
                  cu_seqlens=None, mask: Optional[AttentionMask] = None, held_kv=None):
        return context_parallel_attention(
            q, k, v, comm=self.comm, cp_group=self.cp_group, ulysses_group=self.ulysses_group,
            ring_group=self.ring_group, causal=causal, layout=self.layout,
            softmax_scale=softmax_scale, backend=backend, return_lse=return_lse,
            ring_grad_dtype=self.ring_grad_dtype, cu_seqlens=cu_seqlens, mask=mask,
            held_kv=held_kv)

    def held_kv(self, k, v, mask: Optional[AttentionMask] = None):
        """K,V exchanged once for several layers (attention's held_kv: Gemma 4's shared K/V),
        or None where each layer's own exchange is what this pattern does: under 'ulysses'
        regrouped by heads (ulysses_heads_kv, the bytes of the local K,V); under
        'allgather' gathered (P x the local K,V held from the producer's forward to its
        backward, instead of one layer's at a time), unless a short window's halo is the
        exchange (halo.py); the ring and hybrid move K,V per layer (docs/parallelism.md,
        Gemma 4's K/V on the wire)."""
        if self.comm == "ulysses":
            return ulysses_heads_kv(k, v, world_group(self.cp_group), self.layout)
        if self.comm == "allgather" and not self._halo(mask, k.shape[1]):
            return allgather.GatherSlots.apply(torch.stack((k, v)), world_group(self.cp_group))
        return None

    @property
    def size(self) -> int:
        """The CP degree (ulysses x ring under 'hybrid')."""
        return cp_group_size(self.comm, self.cp_group, self.ulysses_group, self.ring_group)

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole sequence's positions (T,) or (B, T) from each rank's (T/cp,) or
        (B, T/cp): one all-gather, tokens put back in sequence order; under 'hybrid' over
        the Ulysses group (the ring rank's shard, the layout over u) then the ring's."""
        if self.comm == "hybrid":
            shard = gather_sequence(positions, -1, self.ulysses_group, self.layout)
            return gather_sequence(shard, -1, self.ring_group, self.layout).detach()
        return gather_sequence(positions, -1, world_group(self.cp_group), self.layout).detach()

    def expanded_attention(self, q, latent, expansion, *, backend: str = "auto",
                           softmax_scale: Optional[float] = None,
                           mask: Optional[AttentionMask] = None, held_latent=None):
        """One tensor per token on the wire, K,V made where it arrives (latent_api's
        expanded_attention; Gemma 4's keys equal to values)."""
        return expanded_attention(
            q, latent, expansion, comm=self.comm, cp_group=self.cp_group,
            ulysses_group=self.ulysses_group, ring_group=self.ring_group, layout=self.layout,
            softmax_scale=softmax_scale, backend=backend, mask=mask,
            held_latent=held_latent)

    def held_latent(self, latent):
        """expanded_attention's latent exchanged once for several layers (held_kv's rule):
        under 'ulysses' regrouped by heads (latent_api.heads_latent), under 'allgather'
        every rank's (GatherSlots, (P, B, S, h, C)); None for the ring and hybrid."""
        if self.comm == "ulysses":
            return heads_latent(latent, world_group(self.cp_group), self.layout)
        if self.comm == "allgather":
            return allgather.GatherSlots.apply(latent, world_group(self.cp_group))
        return None

    def _halo(self, mask, local_seq: int) -> bool:
        world = group_rank_and_size(world_group(self.cp_group))[1]
        plan = None if mask is None or mask.plain else mask
        return halo_applies(self.layout, plan, local_seq, world)

    def latent_attention(self, q, latent, kv_b_weight, dims: LatentDims, *,
                         causal: bool = False, backend: str = "auto",
                         softmax_scale: Optional[float] = None, return_lse: bool = False,
                         cu_seqlens=None, mask: Optional[AttentionMask] = None):
        """MLA over these groups and layout: latent_attention (latent_api.py), the latent
        on the wire. Its gradient always travels in fp32 (ring_grad_dtype is for dK,dV)."""
        return latent_attention(
            q, latent, kv_b_weight, dims, comm=self.comm, cp_group=self.cp_group,
            ulysses_group=self.ulysses_group, ring_group=self.ring_group, causal=causal,
            layout=self.layout, softmax_scale=softmax_scale, backend=backend,
            return_lse=return_lse, cu_seqlens=cu_seqlens, mask=mask)
