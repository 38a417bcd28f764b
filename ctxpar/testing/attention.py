"""References the attention tests hold every CP pattern and kernel to.

    out, lse = reference_attention(q, k, v, causal, scale)     # fp32, the full sequence
    torch.testing.assert_close(got, out, **tolerance(dtype, out))

Also: the shared inputs (``global_inputs``, ``B``, ``S_LOCAL``), the patterns each world
size runs (``PATTERNS``), the communication calls a pattern makes per layer, the
document-masked reference, and ``FlashOnCpu``: ctxpar's flash-attn adapter over CPU
stand-ins of flash-attn's functions (a backend that takes no explicit mask), and the
fp32 reference with gradients a block of query rows at a time for long sequences
(tools/gpu_check.py holds the GPU kernels to it).
"""
from __future__ import annotations

import torch

from ctxpar.context_parallel.documents import reference_mask
from ctxpar.context_parallel.kernels import FlashAttnBackend, MathBackend

B, S_LOCAL = 2, 8  # batch, tokens per rank

PATTERNS = {  # world -> [(comm, ulysses degree)]
    1: [("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 1)],
    2: [("ring", 1), ("allgather", 1), ("ulysses", 2), ("hybrid", 2), ("hybrid", 1)],
    3: [("ring", 1), ("allgather", 1)],  # no head count here divides over 3 for Ulysses
    4: [("ring", 1), ("allgather", 1), ("ulysses", 4), ("hybrid", 2)],
}


def tolerance(dtype, expected):
    """Why these tolerances. fp32: every pattern and the reference do the same math in fp32
    in another order (blockwise LSE merge, all-to-all regrouping, the kernels' tiling);
    values are O(1) and the differences seen are ~1e-6, so 1e-5 catches any real error (a
    missed or doubled block, a token in the wrong place, moves results by O(0.1)). bf16:
    both start from the same bf16 inputs, but the kernels round P, out and the gradients
    to bf16 (relative step 2^-8 = 4e-3), and a gradient sums tens of such terms as large
    as the tensor's largest entry (dv under MQA reaches ~10, where one bf16 step is 0.06).
    So: 2e-2 relative, plus 1e-2 of the tensor's max magnitude absolute (~2.5 bf16 steps
    there), still far below what a wrong mask or block does."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=1e-2 * max(1.0, expected.abs().max().item()), rtol=2e-2)


def reference_attention(q, k, v, causal, scale):
    """Plain softmax(q k^T * scale) v in fp32 over the full sequence; (out, lse)."""
    H = q.shape[2]
    kr = k.float().repeat_interleave(H // k.shape[2], dim=2)
    vr = v.float().repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kr) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhls,bshd->blhd", s.softmax(-1), vr), torch.logsumexp(s, -1)


def masked_reference(q, k, v, cus, causal, scale):
    """softmax over each token's own document (and its past, when causal), fp32; (out, lse)."""
    H, n = q.shape[2], q.shape[1]
    kr = k.float().repeat_interleave(H // k.shape[2], dim=2)
    vr = v.float().repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kr) * scale
    mask = torch.stack([reference_mask(cu.long(), n, causal) for cu in cus])  # (B, n, n)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhls,bshd->blhd", s.softmax(-1), vr), torch.logsumexp(s, -1)


def reference_attention_in_rows(q, k, v, dout, causal, scale, rows=None):
    """(out, lse, dq, dk, dv) in fp32 by ctxpar's math kernel, a block of query rows at a
    time (a (B, H, rows, S) fp32 score block, not (B, H, L, S)); causal for L = S."""
    B, L, H, D = q.shape
    S = k.shape[1]
    rows = rows or max(1, min(L, 2**28 // (B * H * S)))  # ~1 GiB per score block
    q, k, v, dout = (x.float() for x in (q, k, v, dout))
    m = MathBackend()  # fp32 and an explicit mask: the reference for every kernel
    out, lse = torch.empty_like(q), torch.empty(B, H, L, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    keys = torch.arange(S, device=q.device)
    for r0 in range(0, L, rows):
        r = slice(r0, min(L, r0 + rows))
        mask = keys[None, :] <= torch.arange(r.start, r.stop, device=q.device)[:, None] \
            if causal else None
        out[:, r], lse[:, :, r] = m.forward(q[:, r], k, v, False, scale, mask)
        g = m.backward(dout[:, r], q[:, r], k, v, out[:, r], lse[:, :, r], False, scale, mask)
        dq[:, r] = g[0]
        dk += g[1]
        dv += g[2]
    return out, lse, dq, dk, dv


def global_inputs(n, H, Hkv, D, dtype):
    """The full-sequence q, k, v, dout; the same on every rank and in the parent."""
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, n, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    return q, k, v, torch.randn(B, n, H, D, generator=gen).to(dtype)


def comm_ops_per_layer(comm, P, u=1, latent=False):
    """(forward, backward) communication calls of one attention call on P ranks (no LSE
    returned): ring P-1 KV steps, then P-1 KV + P dK,dV steps; all-gather one gather, then
    a gather and a reduce-scatter; Ulysses four all-to-alls each way (one per tensor: q, k,
    v, then out; dout, then dq, dk, dv); hybrid both. latent (MLA, latent_attention): the
    ring and all-gather the same with the latent in K,V's place; Ulysses three each way
    (q's all-to-all, the latent's all-gather, out's; dout's, dq's, the latent gradient's
    reduce-scatter)."""
    if P == 1:
        return 0, 0
    if latent and comm in ("ulysses", "hybrid"):
        a2a = 3 if comm == "ulysses" or u > 1 else 0
        if comm == "ulysses":
            return 3, 3
        fr, br = comm_ops_per_layer("ring", P // u)
        return a2a + fr, a2a + br
    ring = lambda r: (r - 1, 2 * r - 1) if r > 1 else (0, 0)  # noqa: E731
    if comm == "ring":
        return ring(P)
    if comm == "allgather":
        return 1, 2
    if comm == "ulysses":
        return 4, 4
    a2a = 4 if u > 1 else 0
    fr, br = ring(P // u)
    return a2a + fr, a2a + br


def _window(left, right):  # flash-attn's (-1, -1) is no window
    return None if (left, right) == (-1, -1) else (left, right)


def flash_attn_forward_v26(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                           window_size_right, softcap, alibi_slopes, return_softmax):
    """flash-attn >= 2.6's ``_flash_attn_forward`` signature over the math kernel, whose
    window is flash-attn 2's (bands.band_mask)."""
    assert softcap == 0.0
    out, lse = MathBackend().forward(q, k, v, causal, softmax_scale,
                                     window=_window(window_size_left, window_size_right))
    return out, lse, None, None


def flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                        softmax_scale, causal, window_size, deterministic, rng_state=None):
    """flash-attn's ``_flash_attn_backward`` signature (writes dq, dk, dv) over the math
    kernel."""
    for buf, g in zip((dq, dk, dv), MathBackend().backward(
            dout, q, k, v, out, softmax_lse, causal, softmax_scale,
            window=_window(*window_size))):
        buf.copy_(g)


class FlashOnCpu(FlashAttnBackend):
    """flash_attn's adapter over stand-ins of flash-attn's functions (the math kernel; the
    real ones need CUDA and the package), at any dtype: a backend that takes no explicit
    mask but flash-attn's window_size, as flash-attn on a GPU (so a window's blocks reach it
    as bands). tests/test_gpu.py runs it on CUDA too."""

    def __init__(self, device_types=("cpu",)):
        super().__init__(flash_attn_forward_v26, flash_attn_backward, device_types=device_types)

    def why_not(self, q):
        return ""


def ring_wire_dtype_runs(q, k, v, dout, group):
    """One causal zigzag ring attention forward + backward per ring_grad_dtype (fp32, bf16)
    on the full tensors q, k, v, dout sharded over `group`: {wire: (out, dq, dk, dv, bytes
    this rank sent in backward)}. Collective over group."""
    from ctxpar.context_parallel import context_parallel_attention, cp_stats, shard_sequence
    dout = shard_sequence(dout, 1, group, "zigzag")
    res = {}
    for wire in ("fp32", "bf16"):
        ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
        with cp_stats() as st:
            out = context_parallel_attention(ql, kl, vl, comm="ring", cp_group=group,
                                             causal=True, layout="zigzag",
                                             ring_grad_dtype=wire)
            out.backward(dout)
        res[wire] = (out.detach(), ql.grad, kl.grad, vl.grad, st.bwd_bytes_sent)
    return res
