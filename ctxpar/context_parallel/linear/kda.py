"""Kimi Delta Attention's chunked kernel in torch: the gated delta rule, a decay per key channel.

Kimi Linear (Kimi Team, 2025) replaces Gated DeltaNet's scalar decay per head by one per
key channel, g_t (d_k,) <= 0. Per value head a (d_k, d_v) state, D_t = diag(exp g_t):

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T      o_t = S_t^T (scale q_t)

(transformers' ``recurrent_kimi_delta_attention``: decay, then the delta update). Chunked
as gated_delta.py's kernel, with gc the cumulative log-decay per channel inside a chunk of
C tokens and S_0 the incoming state: the written values U solve
(I + strictly_lower(A)) U = beta V - beta (K * exp(gc) * from_start) S_0 with

    A[i, j]     = beta_i sum_d k_id k_jd exp(gc_id - gc_jd)     (j < i, same document)
    O           = (Q * exp(gc) * from_start) S_0 + intra U,  intra[i, j] the same product
                  of q_i and k_j (j <= i)
    S_C         = diag(exp(gc_C)) S_0 + (K * exp(gc_C - gc))^T U    (per channel)

The pairwise decayed products exp(gc_i - gc_j) cannot be factored as exp(gc_i) exp(-gc_j)
over a whole chunk (a strong gate sends exp(-gc_j) past fp32's range), nor materialised
per (i, j, channel) for the chunk (C x d_k values a token). As flash-linear-attention's
KDA (fla/ops/kda/chunk_intra.py), the chunk is cut into sub-chunks of at most 16 tokens:
inside one, the (i, j, channel) decays are made exactly, offset by offset (j = i - d);
between sub-chunks a < b, both factors take the reference point r = gc at the end of
sub-chunk a - 1 (i in a, j before a), so that
exp(gc_i - r) <= 1 and exp(r - gc_j) <= 1 (a factor that underflows means the product
does). Documents (``seq_idx``) and padding as gated_delta.py. Everything in fp32.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .gated_delta import chunk_scan, check_chunk_size, document_masks, l2norm, pad_seq_idx

SUB_CHUNK = 16  # the most tokens whose (i, j, channel) decays are made at once


def sub_chunk_size(chunk_size: int) -> int:
    """The largest divisor of chunk_size that is at most SUB_CHUNK."""
    return max(s for s in range(1, min(chunk_size, SUB_CHUNK) + 1) if chunk_size % s == 0)


def decayed_products(a: torch.Tensor, b: torch.Tensor, gc: torch.Tensor,
                     sub: int) -> torch.Tensor:
    """(..., C, C) lower-triangular (diagonal included): [i, j] = sum_d a_id b_jd
    exp(gc_id - gc_jd) for j <= i. a, b, gc (..., C, D) broadcastable, gc non-increasing
    along C; sub divides C (module docstring: exact inside sub-chunks, one offset i - j
    at a time, so that only the lower triangle is made; a reference point between them;
    every exp <= 1)."""
    C = gc.shape[-2]
    m = C // sub
    a_s, b_s, g_s = (x.unflatten(-2, (m, sub)) for x in (a, b, gc))    # (..., m, s, D)
    diag = 0
    for d in range(sub):  # inside a sub-chunk, the pairs d positions apart: exp <= 1
        decay = (g_s[..., d:, :] - g_s[..., :sub - d, :]).exp()          # (..., m, s-d, D)
        pairs = (a_s[..., d:, :] * b_s[..., :sub - d, :] * decay).sum(-1)  # (..., m, s-d)
        diag = diag + torch.diag_embed(pairs, offset=-d)                # (..., m, s, s)
    blocks = torch.eye(m, dtype=diag.dtype, device=diag.device)
    out = (diag[..., :, :, None, :] * blocks[:, None, :, None]).flatten(-2)  # (..., m, s, C)
    if m == 1:
        return out.flatten(-3, -2)
    ref = g_s[..., :-1, -1, :]                                           # (..., m-1, D)
    a_off = a_s[..., 1:, :, :] * (g_s[..., 1:, :, :] - ref[..., None, :]).exp()
    starts = torch.arange(1, m, device=gc.device)[:, None] * sub          # (m-1, 1)
    before = torch.arange(C, device=gc.device) < starts                 # (m-1, C)
    to_ref = (ref[..., None, :] - gc[..., None, :, :]).masked_fill(
        ~before[..., None], float("-inf")).exp()                        # (..., m-1, C, D)
    off = a_off @ (b[..., None, :, :] * to_ref).transpose(-1, -2)       # (..., m-1, s, C)
    out = out + F.pad(off, (0, 0, 0, 0, 1, 0))                          # sub-chunk 0: none
    return out.flatten(-3, -2)


def kda_fp32(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
             seq_idx: Optional[torch.Tensor], chunk_size: int,
             use_qk_l2norm_in_kernel: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o (B, T, Hv, Dv) fp32, final state (B, Hv, Dk, Dv) fp32); differentiable.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv % Hk == 0 (value head h reads key head
    h // (Hv / Hk), fla's GVA); g (B, T, Hv, Dk) log-decay per key channel (<= 0); beta
    (B, T, Hv); initial_state (B, Hv, Dk, Dv) or None (zeros); seq_idx (B, T) or None."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if Hk != Hv:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    # (B, H, T, D) and (B, H, T), fp32
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    # Padding tokens are no-ops: beta = 0 writes nothing, g = 0 decays nothing.
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)).view(B, Hv, N, C, -1) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad)).view(B, Hv, N, C)
    same, from_start, to_end = document_masks(pad_seq_idx(seq_idx, pad), B, N, C, q.device)

    gc = g.cumsum(-2)                                                   # (B, H, N, C, Dk)
    k_beta = k * beta[..., None]
    system, intra = (decayed_products(torch.stack([k_beta, q]), k, gc, sub_chunk_size(C))
                     * same).unbind(0)                                  # (B, H, N, C, C)
    gamma0 = gc.exp() * from_start[..., None]                           # (B, H, N, C, Dk)
    # The unit lower-triangular solve reads only the strictly lower part of `system`.
    written = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                            unitriangular=True)        # (B, H, N, C, Dv)
    reads = torch.linalg.solve_triangular(system, k_beta * gamma0, upper=False,
                                          unitriangular=True)          # (B, H, N, C, Dk)
    q_in = q * gamma0
    k_out = k * (gc[..., -1:, :] - gc).exp() * to_end[..., None]
    carry = gamma0[..., -1, :, None]                                    # (B, H, N, Dk, 1)

    return chunk_scan(written, reads, q_in, intra, carry, k_out, initial_state, T)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor, scale: Optional[float] = None,
             use_qk_l2norm_in_kernel: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of KDA, recurrently (decoding): (o (B, Hv, Dv) fp32, the next state
    (B, Hv, Dk, Dv) fp32). q, k (B, Hk, Dk); v (B, Hv, Dv); g (B, Hv, Dk); beta (B, Hv):
        S' = diag(exp g) S;  S_new = S' + beta k (v - S'^T k)^T;  o = S_new^T (scale q)"""
    Hk, Dk = k.shape[1:]
    Hv = v.shape[1]
    if Hk != Hv:
        q, k = (x.repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (Dk ** -0.5 if scale is None else scale)
    S = state.float() * g.exp()[..., None]
    delta = (v - (S * k[..., None]).sum(-2)) * beta[..., None]          # (B, Hv, Dv)
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, *, scale: Optional[float] = None,
              initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
              seq_idx: Optional[torch.Tensor] = None, chunk_size: int = 64,
              use_qk_l2norm_in_kernel: bool = False):
    """KDA on one process: (o (B, T, Hv, Dv) in q's dtype, final state (B, Hv, Dk, Dv)
    fp32 or None). Shapes as ``kda_fp32``; scale defaults to Dk ** -0.5 (fla's
    ``chunk_kda`` and transformers' default)."""
    check_chunk_size(chunk_size, "chunk_kda")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final = kda_fp32(q, k, v, g, beta, scale, initial_state, seq_idx, chunk_size,
                        use_qk_l2norm_in_kernel)
    return o.to(q.dtype), (final if output_final_state else None)
