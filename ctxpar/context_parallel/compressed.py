"""DeepSeek-V4's heavily compressed attention (HCA) core over a CP group.

    out = hca_attention(q, kv, compress_kv, compress_gate, position_bias, norm_weight,
                        sinks, sliding_window=128, compress_rate=128, entry_rope=rope,
                        cp_group=g, layout="zigzag")

Each query at global position t attends, in one softmax with the per-head sinks, to

    the sliding window   the shared K=V head kv at positions t - sliding_window < j <= t
    the entries          every complete compressed entry w with w < (t + 1) // m
                         (transformers' ``block_bias``: a window counts once it is closed)

and with packed documents (cu_seqlens) only its own document's keys and entries, each
document compressed and counted from its own start (compressed_windows.py), so that every
document equals transformers run on it alone; samples whose documents differ run one by
one.

exactly as transformers' ``DeepseekV4Attention`` with its ``DeepseekV4HCACompressor``
(eager_attention_forward with the sinks). Under CP the window is the ring's halo exchange
(halo.py, through ring.py or allgather.py's sliding-window plan), the entries are made by
the ranks holding their windows and all-gathered (compressor.py: why a gather, not a ring),
and the entries' block is one local kernel call with the visibility mask above.

Both parts are one autograd Function: the pattern's forward gives the window's (out, lse),
the entries' block merges into it by log-sum-exp (merge.py), then the sinks' term is
applied once (sinks.py). Backward hands the *merged* (out, lse) to the pattern's backward
and to the entries' block: each is then exactly its share of the whole softmax's
gradient, which a merge of ``context_parallel_attention(return_lse=True)`` outputs could
not give (its lse carries no gradient). K = V: the key and value gradients are summed.
The entries' block is a part handed to that Function: ``VisibleEntries`` here, CSA's
``SelectedEntries`` (compressed_sparse.py: each query's selected entries only).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch

from . import allgather, ring
from .arguments import world_group
from .blocks import QueryRows, backward_block, forward_block_
from .compressor import COMPRESS_LAYOUTS, check_compressor, check_slabs, compressed_entries
from .comm import group_rank_and_size
from .compressed_windows import entry_ranges, split_samples, visible
from .documents import DocBlock, check_cu_seqlens
from .kernels import default_scale, get_backend
from .layouts import rank_positions
from .mask import AttentionMask
from .sinks import finish, sinks_grad

COMPRESS_COMMS = ("ring", "allgather")


class VisibleEntries(NamedTuple):
    """HCA's entries part: every entry a query can see, one local kernel call with the
    (L, T) visibility mask (shared by the batch; compressed_windows.visible)."""

    visible: torch.Tensor  # (L, T) bool

    def forward_(self, kernel, q, entries, scale, out, lse) -> None:
        """Merge the entries' (out, lse) into the running fp32 (out, lse), in place."""
        e = entries.unsqueeze(2)                                           # (B, T, 1, D)
        forward_block_(kernel, q, e, e, self._block(q, entries), scale, out, lse)

    def backward(self, kernel, dout, q, entries, out, lse, scale):
        """(dq, dentries) fp32, their share of the merged softmax's gradient."""
        e = entries.unsqueeze(2)
        _, _, (dq, de_k, de_v) = backward_block(kernel, QueryRows(dout, q, out, lse), e, e,
                                                self._block(q, entries), scale)
        return dq.float(), (de_k.float() + de_v.float()).squeeze(2)

    def _block(self, q, entries) -> DocBlock:
        return DocBlock(0, q.shape[1], 0, entries.shape[1], False, self.visible)


class CompressedCore(torch.autograd.Function):
    """(out, lse) of q over [the window's keys ; the entries] with the sinks; lse is not
    differentiable. kv (B, S, D) the shared K=V head; entries (B, T, D); part the entries'
    block (VisibleEntries for HCA, compressed_sparse.SelectedEntries for CSA)."""

    @staticmethod
    def forward(ctx, q, kv, entries, sinks, pattern, group, layout, scale, kernel, part):
        forward_fn, ctx.backward_fn = pattern
        k = kv.unsqueeze(2)                                                # (B, S, 1, D)
        out, lse = forward_fn(q, k, k, group, True, layout, scale, kernel)
        out, lse = out.float(), lse.clone()
        if entries.shape[1]:
            part.forward_(kernel, q, entries, scale, out, lse)
        out, lse = finish(out, lse, q.dtype, sinks)
        ctx.save_for_backward(q, kv, entries, out, lse, sinks)
        ctx.args = (group, True, layout, scale, kernel)
        ctx.part = part
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, entries, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        k = kv.unsqueeze(2)
        dq, dk, dv = ctx.backward_fn(dout, q, k, k, out, lse, *ctx.args)
        dq, dkv = dq.float(), (dk.float() + dv.float()).squeeze(2)
        dentries = torch.zeros(entries.shape, dtype=torch.float32, device=q.device)
        if entries.shape[1]:
            dq2, dentries = ctx.part.backward(ctx.args[4], dout, q, entries, out, lse,
                                              ctx.args[3])
            dq += dq2
        dsinks = sinks_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return (dq.to(q.dtype), dkv.to(kv.dtype), dentries.to(entries.dtype), dsinks,
                None, None, None, None, None, None)


def check_core(q, kv, compressor, sliding_window, m, layout, comm, world, overlap,
               cu_seqlens, caller) -> Optional[List[torch.Tensor]]:
    """Local checks, rank-independent messages: raised on every rank before any
    communication. compressor = (kv, gate, position_bias, norm_weight). Returns the
    documents' validated per-sample boundaries (int64), or None."""
    if comm not in COMPRESS_COMMS:
        raise ValueError(f"{caller}: comm={comm!r} must be one of {list(COMPRESS_COMMS)}")
    if layout not in COMPRESS_LAYOUTS:
        raise ValueError(f"{caller}: layout={layout!r} must be one of "
                         f"{list(COMPRESS_LAYOUTS)} (a compressed window needs consecutive "
                         "tokens on a rank)")
    for name, v in (("compress_rate", m), ("sliding_window", sliding_window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{caller}: {name}={v!r} must be a positive integer")
    if q.dim() != 4 or kv.dim() != 3:
        raise ValueError(f"{caller}: q (batch, local_seq, heads, head_dim) and kv (batch, "
                         f"local_seq, head_dim) expected, got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}")
    B, S, _, D = q.shape
    C = 2 * D if overlap else D  # CSA's compressor: two series per token
    if tuple(kv.shape) != (B, S, D):
        raise ValueError(f"{caller}: kv must be (batch, local_seq, head_dim) = {(B, S, D)}, "
                         f"got {tuple(kv.shape)}")
    check_compressor(compressor, (B, S), m, C, D, "", caller)
    if layout == "zigzag" and S % 2:
        raise ValueError(f"{caller}: layout 'zigzag' needs an even local_seq, got {S}")
    check_slabs(layout, S, m, world, overlap, caller)
    return None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, S * world, B, caller)


def compressed_attention(q, kv, compressor, sinks, part: Callable, *, overlap: bool,
                         sliding_window: int, compress_rate: int, entry_rope: Callable,
                         cp_group, layout: str, comm: str, norm_eps: float,
                         softmax_scale: Optional[float], backend: str, cu_seqlens,
                         reset_positions: bool, caller: str):
    """(out, lse) of the window + the entries + the sinks (hca_attention, and CSA's
    csa_attention): checks, the entries, then CompressedCore with the entries' block
    part(lo, hi, entry count) -> VisibleEntries or SelectedEntries, lo <= w < hi the
    entries each local query sees (compressed_windows.entry_ranges). Documents the same
    for every sample (split_samples otherwise)."""
    group = world_group(cp_group)
    rank, world = group_rank_and_size(group)
    docs = check_core(q, kv, compressor, sliding_window, compress_rate, layout, comm,
                      world, overlap, cu_seqlens, caller)
    mask = AttentionMask(causal=True, sliding_window=sliding_window, cu_seqlens=docs)
    pattern = ring.ring_pattern("fp32", mask) if comm == "ring" \
        else allgather.allgather_pattern(mask)
    kernel = get_backend(backend, q)
    scale = default_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    cu = None if docs is None else docs[0]
    entries = compressed_entries(*compressor, norm_eps, compress_rate, entry_rope, layout,
                                 group, overlap, caller=caller, cu=cu,
                                 reset_positions=reset_positions)
    q_pos = rank_positions(q.shape[1] * world, rank, world, layout)
    lo, hi = entry_ranges(cu, q_pos, compress_rate)
    return CompressedCore.apply(q, kv, entries, sinks, pattern, group, layout, scale,
                                kernel, part(lo, hi, entries.shape[1]))


def hca_attention(q: torch.Tensor, kv: torch.Tensor, compress_kv: torch.Tensor,
                  compress_gate: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, sinks: Optional[torch.Tensor], *,
                  sliding_window: int, compress_rate: int, entry_rope: Callable,
                  cp_group=None, layout: str = "contiguous", comm: str = "ring",
                  norm_eps: float = 1e-6, softmax_scale: Optional[float] = None,
                  backend: str = "auto", return_lse: bool = False, cu_seqlens=None,
                  reset_positions: bool = True):
    """V4's HCA attention core of this rank's queries (module docstring).

    q (B, S, H, D) RoPE applied; kv (B, S, D) the shared K=V head, RoPE applied;
    compress_kv, compress_gate (B, S, D) the compressor's kv_proj and gate_proj of the
    local hidden states; position_bias (m, D) and norm_weight (D,) its parameters (fp32);
    sinks (H,) or None; entry_rope(entries (B, T, D), positions (T,)) -> (B, T, D) the
    compressor's RoPE at the entries' positions w * m. Tokens follow `layout`
    ('contiguous' or 'zigzag'; each slab at least m tokens when P > 1); the sliding window
    goes through `comm` ('ring' or 'allgather': both run the halo exchange when the window
    fits in a neighbour's slab). softmax_scale defaults to D ** -0.5. cu_seqlens: packed
    documents (documents.py's convention: one int32 tensor or one per sample): windows,
    entries and the sliding window stay inside each document (compressed_windows.py);
    reset_positions: the entries' RoPE positions restart at each document, as the
    caller's q and kv positions must then (False: global positions).
    Returns out (B, S, H, D), and with return_lse the merged lse (B, H, S) fp32 too.
    """
    caller, m = "hca_attention", compress_rate
    world = group_rank_and_size(world_group(cp_group))[1]
    compressor = (compress_kv, compress_gate, position_bias, norm_weight)
    docs = check_core(q, kv, compressor, sliding_window, m, layout, comm, world, False,
                  cu_seqlens, caller)
    kw = dict(sliding_window=sliding_window, compress_rate=m, entry_rope=entry_rope,
              cp_group=cp_group, layout=layout, comm=comm, norm_eps=norm_eps,
              softmax_scale=softmax_scale, backend=backend, reset_positions=reset_positions)
    if split_samples(docs):
        outs = [hca_attention(q[b:b + 1], kv[b:b + 1], compress_kv[b:b + 1],
                              compress_gate[b:b + 1], position_bias, norm_weight, sinks,
                              cu_seqlens=cu.to(torch.int32), return_lse=True, **kw)
                for b, cu in enumerate(docs)]
        out, lse = (torch.cat(parts) for parts in zip(*outs))
    else:
        out, lse = compressed_attention(
            q, kv, compressor, sinks,
            lambda lo, hi, count: VisibleEntries(visible(lo, hi, count)), overlap=False,
            cu_seqlens=cu_seqlens, caller=caller, **kw)
    return (out, lse) if return_lse else out
