"""Per-block attention kernels that return the log-sum-exp: flash_attn, sdpa, math.

One interface, public layout (B, S, H, D):

    out, lse = backend.forward(q, k, v, causal, scale)    # out (B, L, H, D) in q's dtype
                                                          # lse (B, H, L) fp32 (maybe strided)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale)

A block may also carry ``mask=`` (an (L, S) bool, True = visible) where ``takes_mask(q)``,
or ``window=(left, right)`` (flash-attn's window_size, bottom-right aligned: bands.py)
where ``native_window(q)``; ``block_kernel`` sends any other such block to math.

q has H heads, k/v have Hkv heads (H % Hkv == 0, GQA/MQA); dk/dv come back at Hkv heads.
``causal=True`` means the top-left-aligned mask of the fused kernels (query i sees keys
0..i), which is the true causal mask only for square blocks: the ring uses it only there.
``backward`` takes the *merged* (global) out and lse of the ring, not this block's: with
them, softmax(q k^T) of the block is already normalised by the full row, so the block's
dq/dk/dv are exactly its share of the full gradient (ring-flash-attention does the same).

- flash_attn: Dao's ``flash_attn_interface._flash_attn_forward/_backward`` (CUDA, fp16/bf16,
  native GQA, a window as ``window_size``). Their signatures changed across 2.x releases;
  they are called by keyword after reading the signature, see ``_call_by_signature``.
- sdpa: PyTorch's fused kernels. CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+
  backward), a mask as its attn_mask. CUDA: ``_scaled_dot_product_flash_attention`` for
  fp16/bf16, else ``_scaled_dot_product_efficient_attention`` (+ backwards); a masked
  block (a window's tile, a rare document block) on the memory-efficient op in every
  dtype, the mask as its attn_bias (the flash op takes none). They want (B, H, S, D) and, on
  CUDA, head_dim a multiple of 8 (zero-padded here, which changes neither q k^T nor the
  kept columns of out). GQA: the flash kernels (CPU and CUDA) take Hkv < H natively and
  return dK/dV at Hkv heads; only the memory-efficient kernel (fp32 on CUDA) needs K,V
  expanded to H heads and dK/dV summed back (``native_gqa``).
- flash_attn4: FlashAttention-4 (``pip install flash-attn-4[cu13]``, CuTe DSL kernels in
  ``flash_attn.cute.interface``): CUDA sm90+ (Hopper, Blackwell), fp16/bf16, head_dim 64,
  96 or 128, native GQA, a window as ``window_size_left/right``; each new shape
  JIT-compiles on first call (seconds). Chosen by name only: ``auto`` does not prefer it
  until it has been run and timed on a GPU here.
- math: plain torch in fp32, O(L*S) memory. The reference; any device, any dtype, masks
  and windows (the latter with flash-attn 2's exact semantics, bands.band_mask).

Unequal head dims (MLA: q, k at qk_nope + qk_rope = 192, v at 128): the math kernel takes
them as they are; every fused kernel here wants one head dim for q, k and v (torch's CPU
flash op raises "Q/K/V should have the same head size"; flash-attn 2 and CUDA's flash op
likewise), so ``head_dims_kernel`` wraps it in ``PaddedHeadDims``: the narrower side is
zero-padded to the wider (v, out and dout at 192 for MLA: the p v product then costs
192/128 of its exact FLOPs, and the kernel's out buffer is that much wider), which
changes neither q k^T nor the kept columns.

``get_backend("auto", q)`` picks flash_attn > sdpa > math and logs once per device and
dtype which kernel it chose and why the faster ones were passed over (a flash-attn that
is installed but fails to import, e.g. an ABI mismatch with torch, is a warning).

One file past 400 lines on purpose: the four kernels answer the one interface above and
``get_backend`` chooses among them, so they are read, and checked, side by side.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Callable, Dict, Optional, Set, Tuple

import torch
import torch.nn.functional as F

from .bands import band_mask

aten = torch.ops.aten
log = logging.getLogger(__name__)


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, H, D): query head h uses kv head h // (H / Hkv)."""
    groups = heads // x.shape[2]
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def reduce_kv_grad(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, S, H, D) -> (B, S, Hkv, D): sum the gradient over the heads sharing a kv head.

    The sum runs in fp32 (in bf16 each add would round again); with H == Hkv there is
    nothing to sum and dx comes back as it is (the ring accumulates it into fp32 anyway).
    """
    B, S, H, D = dx.shape
    if H == kv_heads:
        return dx
    return dx.float().view(B, S, kv_heads, H // kv_heads, D).sum(dim=3)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """flash-attn needs only stride(-1) == 1 (its own ``maybe_contiguous``): the ring's
    row slices and (B, S, H, D) views pass without a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _mask_bias(mask: torch.Tensor, q: torch.Tensor, align: int = 1) -> torch.Tensor:
    """(L, S) bool visible-mask -> the additive (L, S) bias in q's dtype the sdpa ops take
    (the CPU flash op refuses bool masks), its rows `align`-element aligned: a view of an
    (L, S rounded up to align) tensor, as torch's own sdpa pads a bias for the
    memory-efficient kernel (attention.cpp preprocess_mask, alignment 16)."""
    L, S = mask.shape
    bias = torch.zeros((L, -(-S // align) * align), dtype=q.dtype, device=q.device)
    bias[:, :S].masked_fill_(~mask, float("-inf"))
    return bias[:, :S]


def _pad_head_dim(x: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    pad = -x.shape[-1] % multiple
    return F.pad(x, (0, pad)) if pad else x


class MathBackend:
    """softmax(q k^T * scale) v in fp32 with plain ops: slow, exact, runs everywhere."""

    name = "math"

    def available(self, q: torch.Tensor) -> bool:
        return True

    def takes_mask(self, q: torch.Tensor) -> bool:
        return True

    def native_window(self, q: torch.Tensor) -> bool:
        """It runs a window block (forward's window=), but computes every pair of it: the
        plan gives it tiles with masks instead (blocks.banded)."""
        return False

    def _scores(self, q, k, causal, scale, mask=None, window=None):  # (B, H, L, S) fp32
        s = torch.einsum("blhd,bshd->bhls", q.float(), expand_kv(k, q.shape[2]).float()) * scale
        if causal:  # top-left aligned, like the fused kernels
            L, S = s.shape[-2:]
            s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device=s.device).triu(1),
                              float("-inf"))
        if window is not None:  # flash-attn's window_size, bottom-right aligned
            mask = band_mask(*s.shape[-2:], window, device=s.device)
        if mask is not None:  # (L, S) bool, True = visible (document masking)
            s = s.masked_fill(~mask, float("-inf"))
        return s

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        s = self._scores(q, k, causal, scale, mask, window)
        lse = torch.logsumexp(s, dim=-1)                                # (B, H, L)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row seeing no key: 0
        out = torch.einsum("bhls,bshd->blhd", p, expand_kv(v, q.shape[2]).float())
        return out.to(q.dtype), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        H, Hkv = q.shape[2], k.shape[2]
        p = torch.exp(self._scores(q, k, causal, scale, mask, window)
                      - lse.float().unsqueeze(-1))                      # (B, H, L, S)
        do = dout.float()
        dv = torch.einsum("bhls,blhd->bshd", p, do)
        dp = torch.einsum("blhd,bshd->bhls", do, expand_kv(v, H).float())
        # softmax backward: dS = P * (dP - rowsum(dO * O)), with the global O
        delta = (do * out.float()).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, H, L, 1)
        ds = p * (dp - delta) * scale
        dq = torch.einsum("bhls,bshd->blhd", ds, expand_kv(k, H).float())
        dk = torch.einsum("bhls,blhd->bshd", ds, q.float())
        return dq, reduce_kv_grad(dk, Hkv), reduce_kv_grad(dv, Hkv)


# The largest head dim of Dao's flash-attn 2 and of torch's CUDA flash SDPA op: a larger
# one (Gemma 4's full layers, 512) runs on the math kernel there (ctxpar/plan/kv_layers.py)
FUSED_MAX_HEAD_DIM = 256


class SdpaBackend:
    """PyTorch's fused flash / memory-efficient kernels that expose logsumexp."""

    name = "sdpa"

    def available(self, q: torch.Tensor) -> bool:
        if q.device.type == "cpu":
            return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        if q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] > FUSED_MAX_HEAD_DIM:
            return False  # CUDA's flash op takes head dims <= 256
        return q.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def takes_mask(self, q: torch.Tensor) -> bool:
        """An explicit (L, S) mask with LSE: the CPU flash op's attn_mask; on CUDA the
        memory-efficient op's attn_bias (the flash op with LSE takes no mask)."""
        return q.device.type in ("cpu", "cuda")

    def native_window(self, q: torch.Tensor) -> bool:
        return False  # no window argument: a window's blocks come as masked tiles

    @staticmethod
    def native_gqa(q: torch.Tensor) -> bool:
        """Whether the kernel chosen for q takes K,V at Hkv heads itself: the CPU flash op and
        CUDA's flash op do (torch's sdpa docs: GQA "works only for Flash_attention and math";
        their backward returns dK/dV at Hkv), CUDA's memory-efficient op (fp32) does not."""
        return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)

    @classmethod
    def _bhsd(cls, q: torch.Tensor, *xs: torch.Tensor):  # (B,S,h,D) -> (B,h',S,D) views
        H = q.shape[2]
        expand = (lambda x: x) if cls.native_gqa(q) else (lambda x: expand_kv(x, H))
        return [expand(x).transpose(1, 2) for x in xs]

    def forward(self, q, k, v, causal, scale, mask=None):
        D, L = q.shape[3], q.shape[1]
        if mask is not None and q.device.type != "cpu":
            return self._masked_forward(q, k, v, causal, scale, mask)
        qt, kt, vt = q.transpose(1, 2), *self._bhsd(q, k, v)
        if mask is not None:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, attn_mask=_mask_bias(mask, q), scale=scale)
            # A row that sees no key comes back as out 0, lse 0: make its lse -inf, so that
            # merging it changes nothing.
            lse = lse.masked_fill(~mask.any(dim=1), float("-inf"))
            return out[..., :D].transpose(1, 2), lse[..., :L].float()
        if q.device.type == "cpu":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, scale=scale)
        elif q.dtype in (torch.float16, torch.bfloat16):
            out, lse = aten._scaled_dot_product_flash_attention(
                _pad_head_dim(qt), _pad_head_dim(kt), _pad_head_dim(vt), 0.0, causal,
                scale=scale)[:2]
        else:  # fp32 on CUDA: the memory-efficient kernel; lse padded to 32 rows (not ROCm)
            out, lse = aten._scaled_dot_product_efficient_attention(
                _pad_head_dim(qt), _pad_head_dim(kt), _pad_head_dim(vt), None, True, 0.0,
                causal, scale=scale)[:2]
        # CPU lse has strides (H*L, 1, H); the merge reads it as it is, and whoever keeps or
        # sends a block's lse makes it contiguous (ring._local_forward), not every block.
        return out[..., :D].transpose(1, 2), lse[..., :L].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        Hkv, D = k.shape[2], q.shape[3]
        L, S = q.shape[1], k.shape[1]
        if mask is not None and q.device.type != "cpu":
            return self._masked_backward(dout, q, k, v, out, lse, causal, scale, mask)
        qt, kt, vt = q.transpose(1, 2), *self._bhsd(q, k, v)
        dot, ot = dout.transpose(1, 2), out.transpose(1, 2)
        lse = lse.float().contiguous()  # a strided lse gives wrong gradients (torch CP notes)
        if q.device.type == "cpu":
            bias = None if mask is None else _mask_bias(mask, q)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, attn_mask=bias, scale=scale)
        elif q.dtype in (torch.float16, torch.bfloat16):
            # dropout 0: the philox seed/offset are never read; cum_seq None = dense batch.
            seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
            offset = torch.zeros((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                _pad_head_dim(dot), _pad_head_dim(qt), _pad_head_dim(kt), _pad_head_dim(vt),
                _pad_head_dim(ot), lse, None, None, L, S, 0.0, causal, seed, offset,
                scale=scale)
        else:
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            if not torch.version.hip:  # CUDA's forward pads lse to 32 rows; ROCm's does not
                lse = F.pad(lse, (0, -L % 32))  # (torch/_meta_registrations.py)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                _pad_head_dim(dot), _pad_head_dim(qt), _pad_head_dim(kt), _pad_head_dim(vt),
                None, _pad_head_dim(ot), lse, seed, seed, 0.0, [True, True, True, False],
                causal, scale=scale)
        dq, dk, dv = (g[..., :D].transpose(1, 2) for g in (dq, dk, dv))  # (B, S, h, D)
        return dq, reduce_kv_grad(dk, Hkv), reduce_kv_grad(dv, Hkv)  # no-ops when native

    # A masked block on CUDA: the memory-efficient op, which takes an additive attn_bias
    # with the LSE in every dtype; K,V expanded to H heads (it has no GQA), the (L, S) bias
    # broadcast over batch and heads (strides 0), its rows 16-element aligned (kernel
    # check "attn_bias is not correctly aligned"). The bias is (rows, keys) of one block:
    # a window's tile, never the sequence's (documents._tile_plan).
    @staticmethod
    def _bias(mask, q, k):
        B, L, H, _ = q.shape
        return _mask_bias(mask, q, align=16).expand(B, H, L, k.shape[1])

    def _masked_forward(self, q, k, v, causal, scale, mask):
        D, L, H = q.shape[3], q.shape[1], q.shape[2]
        qt, kt, vt = (_pad_head_dim(x.transpose(1, 2)) for x in (q, expand_kv(k, H),
                                                                 expand_kv(v, H)))
        out, lse = aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, self._bias(mask, q, k), True, 0.0, causal, scale=scale)[:2]
        # A row that sees no key: out 0 and lse -inf, so that merging it changes nothing.
        blind = ~mask.any(dim=1)  # (L,)
        lse = lse[..., :L].float().masked_fill(blind, float("-inf"))
        out = out[..., :D].transpose(1, 2).masked_fill(blind[:, None, None], 0.0)
        return out, lse

    def _masked_backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        Hkv, D, L, H = k.shape[2], q.shape[3], q.shape[1], q.shape[2]
        qt, kt, vt, dot, ot = (_pad_head_dim(x.transpose(1, 2)) for x in (
            q, expand_kv(k, H), expand_kv(v, H), dout, out))
        lse = lse.float().contiguous()
        if not torch.version.hip:  # the LSE padded to 32 rows, as its forward returns it
            lse = F.pad(lse, (0, -L % 32))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dot, qt, kt, vt, self._bias(mask, q, k), ot, lse, seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale)
        dq, dk, dv = (g[..., :D].transpose(1, 2) for g in (dq, dk, dv))
        return dq, reduce_kv_grad(dk, Hkv), reduce_kv_grad(dv, Hkv)


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable):
    """fn's parameters, read once per function (not on every block of every ring step)."""
    return inspect.signature(getattr(fn, "_init_fn", fn)).parameters


def qualified_name(fn: Callable) -> str:
    """A printable name for a plain function or a torch.library custom op (flash-attn >= 2.7
    wraps its kernels in CustomOpDef objects, which have no ``__name__``)."""
    for attr in ("_qualname", "__qualname__", "__name__", "name"):
        name = getattr(fn, attr, None)
        if isinstance(name, str):
            return name
    return repr(fn)


def _import_failure(e: Exception) -> str:
    """Why an optional kernel package cannot be used, in one line; logged as a warning when
    the package is there but broken (anything but 'not installed')."""
    reason = f"{type(e).__name__}: {e}".splitlines()[0]
    if not isinstance(e, ModuleNotFoundError):
        log.warning("kernel package present but unusable (%s)", reason)
    return reason


def _call_by_signature(fn: Callable, values: Dict[str, object]):
    """Call fn with the entries of `values` its signature names, all by keyword.

    flash-attn renamed and added parameters across 2.x (window_size -> window_size_left/
    right, softcap, alibi_slopes, rng_state...), and >= 2.6 wraps the function in a
    torch.library custom op whose original function is ``_init_fn``. A required parameter
    we do not know is an unsupported version: fail loudly rather than guess. The linear
    mixers' GPU kernels (linear/gpu_kernels.py) are called the same way.
    """
    params = _parameters(fn)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    missing = [n for n, p in params.items() if n not in values and p.kind not in variadic
               and p.default is inspect.Parameter.empty]  # fla's **kwargs is no requirement
    if missing:
        raise RuntimeError(f"unsupported kernel package version: {qualified_name(fn)} "
                           f"requires {missing}")
    return fn(**{n: values[n] for n in params if n in values})


def _takes_window(fn: Callable) -> bool:
    return any(name in _parameters(fn) for name in ("window_size", "window_size_left"))


def _windowed(fn: Callable, window):
    """fn itself, after checking it can take `window` (_call_by_signature would drop a
    parameter fn lacks, and the window with it: wrong results, not an error)."""
    if window is not None and not _takes_window(fn):
        raise RuntimeError(f"{qualified_name(fn)} takes no window_size (flash-attn < 2.3); "
                           f"a window's blocks need masks there (block_kernel)")
    return fn


class FlashAttnBackend:
    """Dao's flash-attn 2 kernels (CUDA only, fp16/bf16); GQA handled by the kernel."""

    name = "flash_attn"

    def __init__(self, forward_fn: Optional[Callable] = None,
                 backward_fn: Optional[Callable] = None, device_types=("cuda",)):
        # Injected functions (tests) replace the import; device_types says where they run.
        self._fns = (forward_fn, backward_fn) if forward_fn is not None else None
        self.device_types = tuple(device_types)
        self.unavailable = ""  # why the package could not be loaded, once tried

    def _load(self):
        if self._fns is None:
            try:
                # A FlashAttention-4-only install makes `flash_attn` a namespace package
                # without this module: that is "absent", not a crash.
                from flash_attn import flash_attn_interface as fa
                self._fns = (fa._flash_attn_forward, fa._flash_attn_backward)
            except Exception as e:  # ImportError, or a broken CUDA build / ABI mismatch
                self._fns, self.unavailable = (None, None), _import_failure(e)
        return self._fns

    def why_not(self, q: torch.Tensor) -> str:
        """'' when the backend can run q, else the reason in a few words."""
        if q.shape[-1] > FUSED_MAX_HEAD_DIM:  # Gemma 4's full layers, 512
            return f"head_dim {q.shape[-1]} > {FUSED_MAX_HEAD_DIM}"
        if q.device.type not in self.device_types:
            return f"needs {'/'.join(self.device_types)}"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return "needs fp16/bf16"
        if self._load()[0] is None:
            return f"not usable ({self.unavailable})"
        return ""

    def available(self, q: torch.Tensor) -> bool:
        return not self.why_not(q)

    def takes_mask(self, q: torch.Tensor) -> bool:
        return False  # dense, causal and windowed blocks

    def native_window(self, q: torch.Tensor) -> bool:
        """Whether the installed kernels take a window (flash-attn >= 2.3's window_size,
        2.7's window_size_left/right, FlashAttention-4's): they skip its hidden tiles
        themselves. An older flash-attn gets a window's blocks as masked tiles (math)."""
        return all(fn is not None and _takes_window(fn) for fn in self._load())

    @staticmethod
    def _options(causal, scale, window=None):
        left, right = (-1, -1) if window is None else window  # -1: no limit that side
        return dict(dropout_p=0.0, softmax_scale=scale, causal=causal,
                    window_size=(left, right), window_size_left=left, window_size_right=right,
                    softcap=0.0, alibi_slopes=None, return_softmax=False, deterministic=False,
                    rng_state=None)

    def forward(self, q, k, v, causal, scale, window=None):
        D, L = q.shape[3], q.shape[1]
        qp, kp, vp = (last_dim_contiguous(_pad_head_dim(x)) for x in (q, k, v))
        res = _call_by_signature(_windowed(self._load()[0], window), dict(
            q=qp, k=kp, v=vp, **self._options(causal, scale, window)))
        # <= 2.6 (plain functions): (out, q, k, v, out_padded, softmax_lse, S_dmask,
        #   rng_state); >= 2.7 (the torch.library op flash_attn::_flash_attn_forward):
        #   (out, softmax_lse, S_dmask, rng_state). flash_attn/flash_attn_interface.py at
        #   v2.5.9.post1, v2.6.3 and v2.7.0..v2.8.3.
        out, lse = res[0], (res[5] if len(res) == 8 else res[1])
        return out[..., :D], lse[..., :L].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        D = q.shape[3]
        dop, qp, kp, vp, op = (last_dim_contiguous(_pad_head_dim(x))
                               for x in (dout, q, k, v, out))
        dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
        _call_by_signature(_windowed(self._load()[1], window), dict(
            dout=dop, q=qp, k=kp, v=vp, out=op, softmax_lse=lse.float().contiguous(),
            dq=dq, dk=dk, dv=dv, **self._options(causal, scale, window)))  # into dq/dk/dv
        return dq[..., :D], dk[..., :D], dv[..., :D]


class FlashAttn4Backend(FlashAttnBackend):
    """FlashAttention-4 (flash-attn-4: ``flash_attn.cute.interface``), CUDA sm90+.

    ``_flash_attn_fwd(q, k, v, ..., softmax_scale, causal, ..., return_lse=True)`` returns
    (out, lse) up to 4.0.0.beta18 and (out, lse, p, row_max) from 4.0.0.beta19 on (p and
    row_max are None unless it is asked for gathered-KV scores); lse is (B, H, L) fp32.
    ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, ...)`` returns
    (dq, dk, dv) at k's heads (native GQA). Both take (B, S, H, D) with only the last dim
    contiguous, like flash-attn 2, and ``window_size_left/right`` (None = no limit),
    bottom-right aligned as flash-attn 2's (flash_attn/cute/interface.py and mask.py, tags
    fa4-v4.0.0.beta18, beta19 and beta27).
    """

    name = "flash_attn4"
    HEAD_DIMS = (64, 96, 128)  # the head dims its forward and backward kernels are built for

    def _load(self):
        if self._fns is None:
            try:
                from flash_attn.cute import interface as fa4
                self._fns = (fa4._flash_attn_fwd, fa4._flash_attn_bwd)
            except Exception as e:  # not installed, or no CUDA / CuTe DSL
                self._fns, self.unavailable = (None, None), _import_failure(e)
        return self._fns

    def why_not(self, q: torch.Tensor) -> str:
        if q.shape[-1] not in self.HEAD_DIMS:
            return f"head_dim {q.shape[-1]} not in {self.HEAD_DIMS}"
        if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (9, 0):
            return "needs sm90+ (Hopper, Blackwell)"
        return super().why_not(q)

    @staticmethod
    def _window(window):
        """window_size_left/right: None is "no limit" here (its -1 would be a number)."""
        left, right = (-1, -1) if window is None else window
        return dict(window_size_left=None if left < 0 else left,
                    window_size_right=None if right < 0 else right)

    def forward(self, q, k, v, causal, scale, window=None):
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        res = _call_by_signature(_windowed(self._load()[0], window), dict(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal, return_lse=True,
            **self._window(window)))
        out, lse = res[0], res[1]  # beta19+ returns (out, lse, p, row_max), before (out, lse)
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        dout, q, k, v, out = (last_dim_contiguous(x) for x in (dout, q, k, v, out))
        dq, dk, dv = _call_by_signature(_windowed(self._load()[1], window), dict(
            q=q, k=k, v=v, out=out, dout=dout, lse=lse.float().contiguous(),
            softmax_scale=scale, causal=causal, **self._window(window)))
        return dq, dk, dv


BACKENDS = {b.name: b for b in (FlashAttnBackend(), FlashAttn4Backend(), SdpaBackend(),
                                MathBackend())}
AUTO_ORDER = ("flash_attn", "sdpa", "math")  # flash_attn4 joins once timed on a GPU here
_LOGGED: Set[Tuple[str, torch.dtype]] = set()


def choose_auto(q: torch.Tensor):
    """(backend, reason): the first of AUTO_ORDER that can run q, and why the ones before it
    could not."""
    passed = []
    for name in AUTO_ORDER:
        backend = BACKENDS[name]
        why = backend.why_not(q) if hasattr(backend, "why_not") else (
            "" if backend.available(q) else "cannot run it")
        if not why:
            return backend, "; ".join(passed) or "the fastest kernel for it"
        passed.append(f"{name}: {why}")
    raise AssertionError("the math backend runs everything")


def get_backend(name: str, q: torch.Tensor):
    """Resolve 'auto' (flash_attn > sdpa > math) or check that a named backend can run q."""
    if name == "auto":
        backend, reason = choose_auto(q)
        key = (q.device.type, q.dtype)
        if key not in _LOGGED:  # once per process, device and dtype
            _LOGGED.add(key)
            log.info("attention backend auto -> %s for %s %s (%s)", backend.name,
                     q.device.type, str(q.dtype).replace("torch.", ""), reason)
        return backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{['auto', *BACKENDS]}")
    backend = BACKENDS[name]
    if not backend.available(q):
        hint = f" ({backend.why_not(q)})" if hasattr(backend, "why_not") else ""
        raise ValueError(f"attention backend {name!r} cannot run {q.dtype} tensors on "
                         f"{q.device.type}{hint}")
    return backend


def block_kernel(kernel, q: torch.Tensor, masked: bool = False, windowed: bool = False):
    """The kernel for one block: `kernel`, unless the block needs an explicit mask (a
    window's tile on a kernel without windows, document masking's rare irregular blocks:
    documents.py) or a flash-attn window that `kernel` cannot take on q's device: then the
    math kernel, exact on every device."""
    if (masked and not kernel.takes_mask(q)) or (windowed and not kernel.native_window(q)):
        return BACKENDS["math"]
    return kernel


class PaddedHeadDims:
    """`kernel` (one that needs q, k, v at one head dim) on q, k at Dqk and v at Dv != Dqk:
    the narrower side zero-padded to the wider, the padding's columns dropped again.

    Dv < Dqk (MLA): v, and in backward out and dout, padded to Dqk; the padded columns of
    out are zero and of dv are dropped, and rowsum(dout * out) (the softmax backward's row
    term) is unchanged since the padding of both is zero. Dv > Dqk: q and k padded to Dv,
    which leaves q k^T as it is. Everything else (masks, windows) is the kernel's own.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = kernel.name

    def __getattr__(self, attr):  # available, takes_mask, native_window: the kernel's
        return getattr(self.kernel, attr)

    @staticmethod
    def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
        return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))

    def forward(self, q, k, v, causal, scale, **kw):
        Dqk, Dv = q.shape[-1], v.shape[-1]
        D = max(Dqk, Dv)
        out, lse = self.kernel.forward(self._pad(q, D), self._pad(k, D), self._pad(v, D),
                                       causal, scale, **kw)
        return out[..., :Dv], lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, **kw):
        Dqk, Dv = q.shape[-1], v.shape[-1]
        D = max(Dqk, Dv)
        dq, dk, dv = self.kernel.backward(*(self._pad(x, D) for x in (dout, q, k, v, out)),
                                          lse, causal, scale, **kw)
        return dq[..., :Dqk], dk[..., :Dqk], dv[..., :Dv]


def head_dims_kernel(kernel, q: torch.Tensor, v_head_dim: int):
    """`kernel` itself when it runs q's and v's head dims as they are (equal ones, or the
    math kernel); else `kernel` behind PaddedHeadDims."""
    if v_head_dim == q.shape[-1] or isinstance(kernel, MathBackend):
        return kernel
    return PaddedHeadDims(kernel)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
