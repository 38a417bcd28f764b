"""``latent_attention``: multi-head latent attention (MLA) over a CP group, every comm.

    dims = LatentDims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128)                      # or LatentDims.from_config(cfg)
    out = latent_attention(q, latent, kv_b_proj.weight, dims, comm="ring", cp_group=g,
                           causal=True, layout="zigzag", softmax_scale=scaling)

q (B, s, H, dn + dr): [q_nope ; q_rot], RoPE applied; latent (B, s, R + dr):
[kv_a_layernorm(c_kv) ; k_rot], RoPE applied; kv_b_proj.weight (H (dn + dv), R) for these
H heads (a TP rank's rows). out (B, s, H, dv).

comm       what travels (latent.py, docs/parallelism.md)
ring       latent blocks over the P2P ring; backward the latent's fp32 gradient with them
allgather  the latent all-gathered once; its fp32 gradient reduce-scattered
ulysses    q all-to-all'd by heads (H/u each), the latent all-gathered (it has no heads to
           split), out all-to-all'd back; each rank expands only its heads with its rows of W
hybrid     Ulysses' exchange over ulysses_group, then the latent ring over ring_group

``expanded_attention(q, latent, expansion, ...)``: the same patterns with any expansion
(expansion.py), a latent (B, s, h, C) with kv heads, regrouped by heads under Ulysses as
K,V are: Gemma 4's k_proj x for its keys equal to values.

Masks, layouts, backends and the contract (same shapes on every rank, checked locally
before any communication) are context_parallel_attention's (api.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .arguments import CP_COMMS, cp_group_size, resolve_mask, world_group
from .comm import LOCAL, all_gather, group_rank_and_size, reduce_scatter
from .kernels import default_scale, get_backend, head_dims_kernel
from .latent import LatentAttention, LatentDims, MLAExpansion, latent_pattern
from .layouts import check_layout
from .mask import AttentionMask
from .ulysses import (HeadsToSeq, SeqToHeads, _lse_to_sequence, arrival_order, head_shard,
                      sequence_from_message, sequence_message, ulysses_kv_heads)


def _check_inputs(q, latent, weight, dims, comm, layout, ulysses, caller):
    """Local checks only, one line each, the same on every rank (api._check_inputs' rule)."""
    if comm not in CP_COMMS:
        raise ValueError(f"{caller}: unknown comm {comm!r}; choose one of {list(CP_COMMS)}")
    check_layout(layout)
    if not isinstance(dims, LatentDims):
        raise ValueError(f"{caller}: dims must be a LatentDims, got {type(dims).__name__}")
    for name, t, nd, what in (("q", q, 4, "(batch, local_seq, heads, qk_head_dim)"),
                              ("latent", latent, 3, "(batch, local_seq, latent_dim)"),
                              ("kv_b_weight", weight, 2, "(heads * (nope + v), kv_lora_rank)")):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{caller}: {name} must be a {nd}-D tensor {what}, got {shape}")
    if not (q.dtype == latent.dtype == weight.dtype) or not q.is_floating_point():
        raise ValueError(f"{caller}: q, latent, kv_b_weight must share one floating dtype, "
                         f"got {q.dtype}, {latent.dtype}, {weight.dtype}")
    if not (q.device == latent.device == weight.device):
        raise ValueError(f"{caller}: q, latent, kv_b_weight on different devices: "
                         f"{q.device}, {latent.device}, {weight.device}")
    B, S, H, D = q.shape
    if D != dims.qk_head_dim:
        raise ValueError(f"{caller}: q's head dim {D} != qk_nope_head_dim + qk_rope_head_dim "
                         f"= {dims.qk_head_dim}")
    if latent.shape != (B, S, dims.latent_dim):
        raise ValueError(f"{caller}: latent {tuple(latent.shape)} must be (batch, local_seq, "
                         f"kv_lora_rank + qk_rope_head_dim) = {(B, S, dims.latent_dim)}")
    if weight.shape != (H * dims.kv_b_rows_per_head, dims.kv_lora_rank):
        raise ValueError(f"{caller}: kv_b_weight {tuple(weight.shape)} must be (heads * "
                         f"(qk_nope_head_dim + v_head_dim), kv_lora_rank) = "
                         f"{(H * dims.kv_b_rows_per_head, dims.kv_lora_rank)}")
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq "
                         f"(two chunks per rank), got {S}")
    if H % ulysses != 0:
        raise ValueError(f"{caller}: heads={H} is not divisible by the Ulysses degree "
                         f"{ulysses} (comm={comm!r})")


class GatherLatent(torch.autograd.Function):
    """latent (B, s, C) -> (B, u s, C) of the Ulysses group, tokens ascending; backward
    reduce-scatters the gradient (every rank's heads used every token's latent)."""

    @staticmethod
    def forward(ctx, latent, group, order):
        ctx.args = (group, order)
        gathered, _ = all_gather(latent, group, "fwd")                   # (u, B, s, C)
        msg = gathered.transpose(1, 2).unsqueeze(3).contiguous()         # (u, s, B, 1, C)
        return sequence_from_message(msg, order).squeeze(2)

    @staticmethod
    def backward(ctx, grad):
        group, order = ctx.args
        u = group_rank_and_size(group)[1]
        msg = sequence_message(grad.unsqueeze(2), order, u)              # (u, s, B, 1, C)
        mine = reduce_scatter(msg, group, "bwd")                          # (s, B, 1, C)
        return mine.squeeze(2).transpose(0, 1), None, None


def latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
                     dims: LatentDims, *, comm: str = "ring", cp_group=None,
                     ulysses_group=None, ring_group=None, causal: bool = False,
                     layout: str = "contiguous", softmax_scale: Optional[float] = None,
                     backend: str = "auto", return_lse: bool = False, cu_seqlens=None,
                     mask: Optional[AttentionMask] = None):
    """softmax(q k^T * scale) v over the full sequence with k, v expanded from the latent
    block by block (latent.py); out (B, s, H, dv) in q's dtype, and with return_lse also lse
    (B, H, s) fp32. Groups, layout, causal, cu_seqlens, mask (windows, documents, chunks,
    sinks), backend: as context_parallel_attention. softmax_scale defaults to
    qk_head_dim ** -0.5 (YaRN's mscale is the caller's: DeepseekV3Attention.scaling).
    The ring's gradient travels in fp32 (exact); there is no ring_grad_dtype here.
    Every argument is checked before any communication (one ValueError line).
    """
    caller = "latent_attention"
    groups = _groups(comm, cp_group, ulysses_group, ring_group, caller)
    _check_inputs(q, latent, kv_b_weight, dims, comm, layout, groups[0], caller)
    return _expanded(q, latent, MLAExpansion(kv_b_weight, dims), comm, groups, causal,
                     layout, softmax_scale, backend, return_lse, cu_seqlens, mask, caller)


def expanded_attention(q: torch.Tensor, latent: torch.Tensor, expansion, *,
                       comm: str = "ring", cp_group=None, ulysses_group=None,
                       ring_group=None, layout: str = "contiguous",
                       softmax_scale: Optional[float] = None, backend: str = "auto",
                       return_lse: bool = False, mask: Optional[AttentionMask] = None,
                       held_latent=None):
    """latent_attention with any expansion (expansion.py): latent (B, s, h, C), one tensor
    per kv head on the wire, made into K (B, L, h, D), V (B, L, h, dv) where it arrives
    (Gemma 4's keys equal to values: models/attention.py). Under Ulysses the latent is
    regrouped by heads as K,V would be (h' = h, or lcm(h, u) replicated). held_latent: the
    exchange made before, once for several layers (ContextParallel.held_latent): under
    'ulysses' that regrouping (heads_latent), under 'allgather' every rank's latent
    (allgather.GatherSlots, (P, B, s, h, C)), nothing gathered again. q (B, s, H, D) with
    H % h == 0; the rest as latent_attention."""
    caller = "expanded_attention"
    groups = _groups(comm, cp_group, ulysses_group, ring_group, caller)
    if comm not in CP_COMMS:
        raise ValueError(f"{caller}: unknown comm {comm!r}; choose one of {list(CP_COMMS)}")
    check_layout(layout)
    if q.dim() != 4 or latent.dim() != 4 or latent.shape[:2] != q.shape[:2] \
            or q.shape[2] % latent.shape[2] or q.shape[2] % groups[0]:
        raise ValueError(f"{caller}: q (batch, local_seq, heads, D) {tuple(q.shape)} and "
                         f"latent (batch, local_seq, kv_heads, C) {tuple(latent.shape)} must "
                         f"agree in batch and local_seq, heads a multiple of kv_heads and of "
                         f"the Ulysses degree {groups[0]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq, got "
                         f"{q.shape[1]}")
    if held_latent is not None and comm not in ("ulysses", "allgather"):
        raise ValueError(f"{caller}: held_latent is Ulysses' or the all-gather's, not "
                         f"comm={comm!r}'s")
    return _expanded(q, latent, expansion, comm, groups, False, layout, softmax_scale,
                     backend, return_lse, None, mask, caller, held_latent)


def heads_latent(latent: torch.Tensor, group, layout: str) -> torch.Tensor:
    """latent (B, s, h, C) -> (B, u s, h'/u, C) regrouped by heads as expanded_attention's
    Ulysses regroups it (one all-to-all), for layers that attend with the same latent
    (Gemma 4's shared K/V; their gradients join before its one reverse all-to-all)."""
    u = group_rank_and_size(group)[1]
    if u == 1:
        return latent
    order = arrival_order(latent.shape[1], group, layout, latent.device)
    return SeqToHeads.apply(group, order, (ulysses_kv_heads(latent.shape[2], u),), latent)[0]


def _groups(comm, cp_group, ulysses_group, ring_group, caller):
    """(u, cp_group, ulysses_group, ring_group), None groups resolved (api's rule)."""
    if comm == "hybrid":
        ulysses_group = world_group(ulysses_group, caller, "ulysses_group")
        ring_group = world_group(ring_group, caller, "ring_group")
        return group_rank_and_size(ulysses_group)[1], cp_group, ulysses_group, ring_group
    cp_group = world_group(cp_group)
    u = group_rank_and_size(cp_group)[1] if comm == "ulysses" else 1
    return u, cp_group, ulysses_group, ring_group


def _expanded(q, latent, expansion, comm, groups, causal, layout, softmax_scale, backend,
              return_lse, cu_seqlens, mask, caller, held=None):
    """The patterns of latent.py with `expansion` (arguments already checked)."""
    u, cp_group, ulysses_group, ring_group = groups
    mask = resolve_mask(mask, causal, cu_seqlens, q,
                        cp_group_size(comm, cp_group, ulysses_group, ring_group), caller)
    kernel = head_dims_kernel(get_backend(backend, q), q, expansion.v_head_dim)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    pattern = latent_pattern("allgather" if comm == "allgather" else "ring",
                             None if mask.plain else mask,
                             held=comm == "allgather" and held is not None)
    if comm == "allgather" and held is not None:
        latent = held  # (P, B, s, ...): every rank's, gathered before
    if comm == "ulysses":
        ulysses_group, ring_group = cp_group, LOCAL  # the whole sequence, one local call
    if comm in ("ring", "allgather") or u == 1:
        group = cp_group if comm in ("ring", "allgather") else ring_group
        out, lse = LatentAttention.apply(q, latent, mask.sinks, pattern, group, mask.causal,
                                         layout, scale, kernel, expansion, *expansion.params)
        return (out, lse) if return_lse else out
    # Ulysses: H/u heads of every token here. MLA's latent has no heads, so it is gathered
    # whole and W's rows of this rank's head group expand it; a latent with kv heads is
    # regrouped by heads as K,V are.
    order = arrival_order(q.shape[1], ulysses_group, layout, q.device)
    qh, = SeqToHeads.apply(ulysses_group, order, (q.shape[2],), q)    # (B, u s, H/u, dqk)
    if held is not None:
        lat = held
    elif latent.dim() == 3:
        lat = GatherLatent.apply(latent, ulysses_group, order)         # (B, u s, R + dr)
    else:
        lat = heads_latent(latent, ulysses_group, layout)             # (B, u s, h'/u, C)
    expansion = expansion.heads_shard(ulysses_group)
    out_h, lse_h = LatentAttention.apply(qh, lat, head_shard(mask.sinks, ulysses_group),
                                         pattern, ring_group, mask.causal, layout, scale,
                                         kernel, expansion, *expansion.params)
    out = HeadsToSeq.apply(out_h, ulysses_group, order)                # (B, s, H, dv)
    if not return_lse:
        return out
    return out, _lse_to_sequence(lse_h, ulysses_group, order)
