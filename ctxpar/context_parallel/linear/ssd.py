"""Mamba2's chunked SSD in torch: an initial state in, the final state out, document resets.

Mamba2 (Dao and Gu, Transformers are SSMs): per head a (head_dim P, state N) state with a
scalar decay per token,

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t + D x_t

State Space Duality's chunked form (mamba_ssm's ``mamba_chunk_scan_combined``, transformers'
``Mamba2Mixer.torch_forward``): inside a chunk, with L[i, j] = exp(Acum_i - Acum_j) for
j <= i in one document (Acum the cumulative dt*A inside the chunk), the chunk's own tokens
give y = (C B^T * L) (dt x); the state entering the chunk adds exp(Acum_i) C_i h_0 while
position i is still in h_0's document; the chunk hands on
h_C = exp(Acum_{C-1}) h_0 + sum_j exp(Acum_{C-1} - Acum_j) dt_j x_j B_j^T (same document).

Documents: ``seq_idx`` (B, T) as mamba_ssm's (non-decreasing document indices); the state
is zero before a token whose document differs from its predecessor's; ``initial_states``
is the state before token 0. Everything in fp32; ``ssd_fp32`` is what the CP strategies
call, on dt already through dt_bias, softplus and dt_limit (``discretize_dt``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .gated_delta import check_chunk_size, document_masks, pad_seq_idx


def discretize_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], dt_softplus: bool,
                  dt_limit: Tuple[float, float]) -> torch.Tensor:
    """(B, T, H) fp32: clamp(softplus(dt + dt_bias)) as mamba_ssm applies it."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


class SSDParts(NamedTuple):
    """What the chunked SSD computes before any state enters (ssd_parts): every chunk's own
    output, the state it hands on from zero, how it carries a state through, and how a
    state entering it reaches its tokens."""
    y_diag: torch.Tensor          # (b, nc, L, H, P) the chunks' own tokens' output
    chunk_states: torch.Tensor    # (b, nc, H, P, N) each chunk's state from zero
    carry: torch.Tensor           # (b, H, nc, 1, 1) decay of a state through each chunk
    from_start: torch.Tensor      # (b, H, nc, L) decay from the chunk's start, same document
    C: torch.Tensor               # (b, nc, L, H, N)
    T: int


def ssd_parts(x, dt, A, B, C, seq_idx: Optional[torch.Tensor], chunk_size: int) -> SSDParts:
    """The state-independent part of the chunked SSD (ssd_fp32's arguments), fp32."""
    b, T, H, P = x.shape
    G = B.shape[2]
    x, dt = x.float(), dt.float()
    B, C = (t.float().repeat_interleave(H // G, dim=2) for t in (B, C))  # (b, T, H, N)
    xdt = x * dt[..., None]
    dA = (dt * A.float()).transpose(1, 2)                               # (b, H, T)
    L = chunk_size
    pad = (-T) % L
    nc = (T + pad) // L
    # Padding tokens are no-ops: dt = 0 writes nothing and decays nothing.
    xdt, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)).view(b, nc, L, H, -1) for t in (xdt, B, C))
    dA = F.pad(dA, (0, pad)).view(b, H, nc, L)
    same, from_start, to_end = document_masks(pad_seq_idx(seq_idx, pad), b, nc, L, x.device)

    Acum = dA.cumsum(-1)                                                # (b, H, nc, L)
    decay = (Acum[..., :, None] - Acum[..., None, :]).masked_fill(~same, float("-inf")).exp()
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay           # (b, H, nc, L, L)
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)
    to_end_decay = (Acum[..., -1:] - Acum).exp() * to_end               # (b, H, nc, L)
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end_decay, xdt)
    from_start_decay = Acum.exp() * from_start                          # (b, H, nc, L)
    return SSDParts(y_diag, chunk_states, from_start_decay[..., -1, None, None],
                    from_start_decay, C, T)


def ssd_scan(parts: SSDParts, h: torch.Tensor, outputs: bool = True):
    """The chunks in order from state h (b, H, P, N) fp32: (y (b, T, H, P) without D, or
    None when outputs is False: only the state, nc cheap updates; the final state)."""
    y_off = []
    # The chunks through unbind (one gradient stack), not C[:, c] (a whole-size zero
    # gradient per chunk: quadratic in T), as gated_delta.py's scan.
    per_chunk = zip(parts.C.unbind(1), parts.from_start.unbind(2), parts.carry.unbind(2),
                    parts.chunk_states.unbind(1))
    for C_c, start_c, carry_c, state_c in per_chunk:  # the scan: only the state crosses
        if outputs:
            y_off.append(torch.einsum("blhn,bhpn,bhl->blhp", C_c, h, start_c))
        h = h * carry_c + state_c
    if not outputs:
        return None, h
    b, nc, L, H, P = parts.y_diag.shape
    return (parts.y_diag + torch.stack(y_off, dim=1)).reshape(b, nc * L, H, P)[:, :parts.T], h


def ssd_fp32(x, dt, A, B, C, D: Optional[torch.Tensor], initial_states: Optional[torch.Tensor],
             seq_idx: Optional[torch.Tensor], chunk_size: int
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y (b, T, H, P) fp32, final state (b, H, P, N) fp32); differentiable.

    x (b, T, H, P); dt (b, T, H) discretized; A (H,) (negative); B, C (b, T, G, N) with
    H % G == 0 (head h reads group h // (H / G)); D (H,) or None; initial_states
    (b, H, P, N) or None; seq_idx (b, T) int or None."""
    b, T, H, P = x.shape
    N = B.shape[3]
    x = x.float()  # one fp32 copy for both x dt and D x
    parts = ssd_parts(x, dt, A, B, C, seq_idx, chunk_size)
    h = (torch.zeros(b, H, P, N, device=x.device) if initial_states is None
         else initial_states.float())
    y, h = ssd_scan(parts, h)
    if D is not None:
        y = y + x * D.float()[:, None]
    return y, h


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, state: torch.Tensor, D: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba2's SSD, recurrently (decoding): (y (b, H, P) fp32, the next
    state (b, H, P, N) fp32).

    x (b, H, P); dt (b, H) already discretized (discretize_dt); A (H,); B, C (b, G, N),
    H % G == 0; state (b, H, P, N):  h = exp(dt A) h + (dt x) B^T;  y = h C + D x."""
    H, G = x.shape[1], B.shape[1]
    B, C = (t.float().repeat_interleave(H // G, dim=1) for t in (B, C))  # (b, H, N)
    x, dt = x.float(), dt.float()
    h = state.float() * (dt * A.float()).exp()[..., None, None]
    h = h + (x * dt[..., None])[..., None] * B[:, :, None, :]
    y = (h * C[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + x * D.float()[:, None]
    return y, h


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, chunk_size: int, D: Optional[torch.Tensor] = None,
                   dt_bias: Optional[torch.Tensor] = None,
                   initial_states: Optional[torch.Tensor] = None,
                   seq_idx: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                   dt_limit: Tuple[float, float] = (0.0, math.inf),
                   return_final_states: bool = False):
    """Mamba2's SSD on one process, mamba_ssm's ``mamba_chunk_scan_combined`` signature
    (without z: the gate belongs to the norm after it): y (b, T, H, P) in x's dtype, and
    with return_final_states also the final state (b, H, P, N) fp32."""
    check_chunk_size(chunk_size, "ssd_chunk_scan")
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    y, final = ssd_fp32(x, dt, A, B, C, D, initial_states, seq_idx, chunk_size)
    return (y.to(x.dtype), final) if return_final_states else y.to(x.dtype)
