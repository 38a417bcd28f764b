"""Gated DeltaNet's chunked kernel in torch: an initial state in, the final state out, resets.

Gated Delta Networks (Yang, Kautz, Hatamizadeh): per value head a (d_k, d_v) state

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T     o_t = S_t^T (scale q_t)

Chunked form (the WY / UT transform of DeltaNet, as flash-linear-attention's
``chunk_gated_delta_rule`` and transformers' ``torch_chunk_gated_delta_rule``): inside a
chunk of C tokens with incoming state S_0, the decayed products between positions are
Gamma[i, j] = exp(gc_i - gc_j) (gc the cumulative log-decay inside the chunk) for j <= i
in the same document, 0 otherwise, and Gamma0[i] = exp(gc_i) while position i is still
in the document S_0 belongs to. The written values U solve one unit lower-triangular
system, (I + strictly_lower(diag(beta) K K^T * Gamma)) U = beta V - beta Gamma0 K S_0,
after which

    O     = (Q * Gamma0) S_0 + (Q K^T * Gamma) U
    S_C   = Gamma0[C-1] S_0 + (K * Gamma[C-1, :])^T U

and only the state crosses chunks: one (d_k, d_v) matmul chain per chunk, sequentially.

Documents: ``seq_idx`` (B, T), mamba_ssm's name, gives each token's document; the state
is carried between consecutive tokens of one document and is zero before a token whose
document differs from its predecessor's. ``initial_state`` is the state before token 0
(its document continues from it). The resets are masks on Gamma and Gamma0 (no padding of
documents, the same shapes whatever the documents): a one-token document is a row whose
Gamma has only its diagonal.

Everything runs in fp32 whatever the inputs' dtype; ``gated_delta_fp32`` is the
interface the CP strategies call (fp32 out, any value width: state passing widens v).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (flash-linear-attention's, in fp32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_chunk_size(chunk_size, caller: str) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{caller}: chunk_size={chunk_size!r} must be a positive integer")


def document_masks(seq_idx: Optional[torch.Tensor], B: int, N: int, C: int,
                   device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(same (B, 1, N, C, C) causal and same document, from_start (B, 1, N, C): still in the
    document of the state entering the chunk, to_end (B, 1, N, C): in the document of the
    chunk's last token), as bool, for the (B, H, N, C, ...) chunked tensors.

    seq_idx (B, N*C) already padded (padding repeats the last document)."""
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    if seq_idx is None:
        ones = torch.ones(B, 1, N, C, dtype=torch.bool, device=device)
        return causal.expand(B, 1, N, C, C), ones, ones
    ids = seq_idx.view(B, 1, N, C)
    before = torch.cat([seq_idx[:, :1], seq_idx[:, :-1]], dim=1).view(B, 1, N, C)[..., :1]
    same = (ids[..., :, None] == ids[..., None, :]) & causal
    return same, ids == before, ids == ids[..., -1:]


def pad_seq_idx(seq_idx: Optional[torch.Tensor], pad: int) -> Optional[torch.Tensor]:
    """seq_idx (B, T) -> (B, T + pad), the padding in the last token's document."""
    if seq_idx is None or pad == 0:
        return seq_idx
    return torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], dim=1)


def gated_delta_fp32(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                     seq_idx: Optional[torch.Tensor], chunk_size: int,
                     use_qk_l2norm_in_kernel: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o (B, T, Hv, Dv) fp32, final state (B, Hv, Dk, Dv) fp32); differentiable.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv) with Hv % Hk == 0 (value head h reads key head
    h // (Hv / Hk), Qwen3-Next's grouping); g (B, T, Hv) log-decay (<= 0); beta (B, T, Hv);
    initial_state (B, Hv, Dk, Dv) or None (zeros); seq_idx (B, T) int or None."""
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
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(B, Hv, N, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).view(B, Hv, N, C) for x in (g, beta))
    same, from_start, to_end = document_masks(pad_seq_idx(seq_idx, pad), B, N, C, q.device)

    gc = g.cumsum(-1)                                                   # (B, H, N, C)
    gamma = (gc[..., :, None] - gc[..., None, :]).masked_fill(~same, float("-inf")).exp()
    gamma0 = gc.exp() * from_start                                      # (B, H, N, C)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * gamma                     # (B, H, N, C, C)
    # The unit lower-triangular solve reads only the strictly lower part of `system`.
    written = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                            unitriangular=True)        # (B, H, N, C, Dv)
    reads = torch.linalg.solve_triangular(system, k_beta * gamma0[..., None], upper=False,
                                          unitriangular=True)          # (B, H, N, C, Dk)
    intra = (q @ k.transpose(-1, -2)) * gamma                           # (B, H, N, C, C)
    q_in = q * gamma0[..., None]
    k_out = k * ((gc[..., -1:] - gc).exp() * to_end)[..., None]
    carry = gamma0[..., -1, None, None]                                 # (B, H, N, 1, 1)

    return chunk_scan(written, reads, q_in, intra, carry, k_out, initial_state, T)


def chunk_scan(written, reads, q_in, intra, carry, k_out, initial_state, T: int):
    """The delta rule's scan over chunks, GDN's and KDA's (kda.py): only the fp32 state
    (B, H, Dk, Dv) crosses chunks; each chunk's per-head tensors (B, H, N, C, *) were made
    in parallel beforehand, carry the decay over a whole chunk (per head, or per key
    channel). Returns (o (B, T, H, Dv), the final state)."""
    B, Hv, N, C, Dv = written.shape
    Dk = reads.shape[-1]
    S = (torch.zeros(B, Hv, Dk, Dv, device=written.device) if initial_state is None
         else initial_state.float())
    outs = []
    # The chunks as views through unbind, not x[:, :, i]: a slice's backward writes its
    # gradient into a zero tensor of the whole input, once per chunk (quadratic in T);
    # unbind's stacks the chunks' gradients once.
    per_chunk = zip(*(x.unbind(2) for x in (written, reads, q_in, intra, carry, k_out)))
    for w_i, r_i, q_i, a_i, c_i, k_i in per_chunk:  # the scan: only the state crosses
        u = w_i - r_i @ S                                               # (B, H, C, Dv)
        outs.append(q_i @ S + a_i @ u)
        S = S * c_i + k_i.transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).view(B, Hv, N * C, Dv)[:, :, :T]
    return o.transpose(1, 2), S


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, scale: Optional[float] = None,
                     use_qk_l2norm_in_kernel: bool = False
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, recurrently (decoding): (o (B, Hv, Dv) fp32, the
    next state (B, Hv, Dk, Dv) fp32).

    q, k (B, Hk, Dk); v (B, Hv, Dv); g, beta (B, Hv); state (B, Hv, Dk, Dv) fp32:
        S' = exp(g) S;  S_new = S' + beta k (v - S'^T k)^T;  o = S_new^T (scale q)
    which is exp(g) (I - beta k k^T) S + beta k v^T, the chunked form's recurrence."""
    Hk, Dk = k.shape[1:]
    Hv = v.shape[1]
    if Hk != Hv:
        q, k = (x.repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (Dk ** -0.5 if scale is None else scale)
    S = state.float() * g.exp()[..., None, None]
    delta = (v - (S * k[..., None]).sum(-2)) * beta[..., None]          # (B, Hv, Dv)
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, *,
                           scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False,
                           seq_idx: Optional[torch.Tensor] = None, chunk_size: int = 64,
                           use_qk_l2norm_in_kernel: bool = False):
    """The gated delta rule on one process: (o (B, T, Hv, Dv) in q's dtype, final state
    (B, Hv, Dk, Dv) fp32 or None). Shapes as ``gated_delta_fp32``; scale defaults to
    Dk ** -0.5 (flash-linear-attention's and transformers' default)."""
    check_chunk_size(chunk_size, "chunk_gated_delta_rule")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final = gated_delta_fp32(q, k, v, g, beta, scale, initial_state, seq_idx, chunk_size,
                                use_qk_l2norm_in_kernel)
    return o.to(q.dtype), (final if output_final_state else None)
