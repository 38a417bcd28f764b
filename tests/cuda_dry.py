"""The CUDA path without a GPU: the real kernels' input rules and flash-attn stand-ins.

Imported by tests/cuda_dry_cases.py, in the process tests/fake_cuda.py starts: there this
CPU-only torch has a (fake) CUDA device. torch's FakeTensorMode makes tensors on device
"cuda" and runs the CUDA ops' meta kernels: shapes, dtypes and strides propagate, nothing
is computed. Around it:

- ``ContractMode`` (a dispatch mode above the fake mode) checks what the meta kernels do
  not: each CUDA attention kernel's input rules, cited from its source (RULES); no
  device-to-host copy of data the device computed (a host sync); no CPU tensor entering
  a CUDA op; no CPU-only kernel on CUDA tensors. It records which kernels ran, with their
  causal flag and scale. Host-side work (the document plan, index arithmetic on CPU
  tensors) runs for real on the CPU, as it does next to a GPU; data the host sent to the
  device (``.to("cuda")`` of a CPU tensor) keeps its values, so reading it back is allowed
  and counted (``host_syncs``).
- Stand-ins with the real signatures and return values for flash-attn 2.5, 2.6 and 2.7+
  (a torch.library custom op) and FlashAttention-4 >= 4.0.0.beta19, over shape-only ops
  that ContractMode checks like the real kernels (STANDINS). Each call records the
  (query, key) pairs the real kernel computes for its causal flag and window
  (``kernel_pairs``: the real argument rewrites and masks, from their sources).
- ``fake_cuda(monkeypatch)``: the two modes together, with the device queries a fake
  device cannot answer patched (said where).

Private torch APIs used (FakeTensorMode, TorchDispatchMode, unset_fake_temporarily,
WeakIdKeyDictionary): ``private_api_problem`` says why the cases skip if one moved.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import List, NamedTuple, Optional

import torch

from fake_cuda import private_api_problem

if not private_api_problem():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary
else:  # the cases skip with the reason; keep the module importable
    TorchDispatchMode = object


class ContractError(AssertionError):
    """A CUDA kernel got inputs its real implementation refuses or misreads."""


class HostSync(AssertionError):
    """Device data read on the host: a blocking device-to-host copy on a GPU."""


class DeviceMix(AssertionError):
    """A CPU tensor handed to an op on CUDA tensors."""


def _need(ok: bool, op: str, rule: str, where: str) -> None:
    if not ok:
        raise ContractError(f"{op}: {rule} ({where})")


# ------------------------------------------------------------------ the kernels' rules
# Each rule cites where the real kernel enforces (or silently assumes) it. Layouts: the
# aten sdpa ops take (B, H, L, D) and transpose to (B, L, H, D) for the kernel; flash-attn
# and FlashAttention-4 take (B, L, H, D).

ATEN_CUDA = "torch aten/src/ATen/native/transformers/cuda/"
TORCH_FLASH = ATEN_CUDA + "flash_attn/flash_api.cpp mha_fwd/mha_bwd"
TORCH_MEFF_FWD = ATEN_CUDA + "attention.cu _efficient_attention_forward"
TORCH_MEFF_BWD = (ATEN_CUDA + "attention_backward.cu _efficient_attention_backward; "
                  "mem_eff_attention/kernel_backward.h check_supported")
SDP_UTILS = ATEN_CUDA + "sdp_utils.cpp check_head_dim_size_mem_efficient"
FA2 = "flash-attn csrc/flash_attn/flash_api.cpp mha_fwd/mha_bwd (v2.8.3)"
FA4 = ("flash-attn-4 flash_attn/cute/interface.py _flash_attn_fwd/_flash_attn_bwd, "
       "_validate_head_dims (fa4-v4.0.0.beta27)")
HALF = (torch.float16, torch.bfloat16)


def _flash_inputs(op, q, k, v, src, bhld: bool, extra=()):
    """flash kernels (torch's copy and Dao's): fp16/bf16, one dtype, last dim contiguous,
    head_dim % 8 == 0 and <= 256, kv heads dividing q heads; returns (B, H, L, D).
    (flash-attn <= 2.6 padded head_dim to 8s itself; from 2.7 its kernel refuses others,
    as torch's does: "head_size must be a multiple of 8, this is ensured by padding!")"""
    if bhld:  # aten's (B, H, L, D) -> the kernel's (B, L, H, D)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    B, L, H, D = q.shape
    _need(q.dtype in HALF, op, f"dtype must be fp16/bf16, got {q.dtype}", src)
    for x in (k, v, *extra):
        _need(x.dtype == q.dtype, op, f"all inputs in q's dtype, got {x.dtype}", src)
    for x in (q, k, v, *extra):
        _need(x.stride(-1) == 1, op, f"last dim contiguous, got strides {x.stride()}", src)
    _need(D % 8 == 0, op, f"head_dim must be a multiple of 8 (pad), got {D}", src)
    _need(D <= 256, op, f"head_dim must be <= 256, got {D}", src)
    _need(k.shape[0] == B and k.shape[3] == D and v.shape == k.shape, op,
          f"k, v must be (B, S, Hkv, {D}), got {tuple(k.shape)}, {tuple(v.shape)}", src)
    _need(H % k.shape[2] == 0, op, f"kv heads {k.shape[2]} must divide {H}", src)
    return B, H, L, D


def _lse_rule(op, lse, shape, src, contiguous=True):
    _need(lse.dtype == torch.float32, op, f"lse must be fp32, got {lse.dtype}", src)
    _need(tuple(lse.shape) == tuple(shape), op,
          f"lse must be {tuple(shape)}, got {tuple(lse.shape)}", src)
    if contiguous:  # read through its pointer as a dense (B, H, L) array
        _need(lse.is_contiguous(), op, f"lse must be contiguous, got strides "
              f"{lse.stride()}", src)


def _aten_flash_fwd(op, a, kw):
    q, k, v = a[:3]
    _flash_inputs(op, q, k, v, TORCH_FLASH, True)
    _need(len(a) < 4 or a[3] == 0.0, op, "dropout must be 0 (LSE ring)", "ctxpar")


def _aten_flash_bwd(op, a, kw):
    dout, q, k, v, out, lse = a[:6]
    B, H, L, D = _flash_inputs(op, q, k, v, TORCH_FLASH, True,
                               extra=(dout.transpose(1, 2), out.transpose(1, 2)))
    _need(dout.shape == q.shape == out.shape, op, "dout and out must have q's shape",
          TORCH_FLASH)
    _lse_rule(op, lse, (B, H, L), TORCH_FLASH)
    _need(a[6] is None and a[7] is None and (a[8], a[9]) == (L, k.shape[2]), op,
          f"dense batch: cum_seq None, max_q={L}, max_k={k.shape[2]}", TORCH_FLASH)


def _meff_bias(op, bias, q, k, src):
    """attn_bias: None, or q's dtype, (B, H, L, S), last dim contiguous, the other strides
    multiples of 16 elements (attention.cu "invalid dtype for bias", "attn_bias: wrong
    shape"; kernel_forward.h check_supported "attn_bias is not correctly aligned"; torch's
    sdpa pads a bias to that, attention.cpp preprocess_mask)."""
    if bias is None:
        return
    B, H, L, _ = q.shape
    want = (B, H, L, k.shape[2])
    _need(bias.dtype == q.dtype, op, f"attn_bias in q's dtype, got {bias.dtype}", src)
    _need(tuple(bias.shape) == want, op, f"attn_bias {want}, got {tuple(bias.shape)}", src)
    _need(bias.stride(-1) == 1 and all(st % 16 == 0 for st in bias.stride()[:3]), op,
          f"attn_bias strides (16k, 16k, 16k, 1), got {bias.stride()}", src)


def _meff_inputs(op, q, k, v, src):
    B, H, L, D = q.shape
    _need(q.dtype in (*HALF, torch.float32), op, f"dtype fp16/bf16/fp32, got {q.dtype}", src)
    _need(k.dtype == v.dtype == q.dtype, op, "q, k, v in one dtype", src)
    _need(k.shape[1] == H and v.shape[1] == H, op,
          f"equal head counts for q, k, v, got {H}, {k.shape[1]}, {v.shape[1]}", src)
    for x in (q, k, v):
        _need(x.stride(-1) == 1, op, f"last dim contiguous, got strides {x.stride()}", src)
    align = 8 if q.dtype in HALF else 4  # 128 bits per GEMM operand row
    _need(D % align == 0 and k.shape[3] == D, op,
          f"head_dim a multiple of {align}, got {D}", SDP_UTILS)
    return B, H, L, D


def _aten_meff_fwd(op, a, kw):
    _meff_inputs(op, *a[:3], TORCH_MEFF_FWD)
    _meff_bias(op, a[3], *a[:2], TORCH_MEFF_FWD)
    _need(a[4] is True, op, "compute_log_sumexp=True (the merge needs the LSE)", "ctxpar")


def _aten_meff_bwd(op, a, kw):
    dout, q, k, v, bias, out, lse = a[:7]
    B, H, L, D = _meff_inputs(op, q, k, v, TORCH_MEFF_BWD)
    _meff_bias(op, bias, q, k, TORCH_MEFF_BWD)
    # The forward pads the LSE to 32 rows (kAlignLSE; torch/_meta_registrations.py
    # meta__efficient_attention_forward) and the backward reads it with strides B and H
    # that must be multiples of 8 ("LSE is not correctly aligned").
    _lse_rule(op, lse, (B, H, math.ceil(L / 32) * 32), TORCH_MEFF_BWD, contiguous=False)
    _need(lse.stride(-1) == 1 and lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0, op,
          f"lse strides must be (8k, 8k, 1), got {lse.stride()}", TORCH_MEFF_BWD)


def _window_rule(op, left, right, src):
    """window_size: ints, -1 = no limit (flash-attn 2's kernels; FlashAttention-4's stand-in
    passes its None as -1)."""
    for side in (left, right):
        _need(type(side) is int and side >= -1, op,
              f"window_size sides are ints >= -1, got ({left}, {right})", src)


def _fa2_fwd(op, a, kw, wi=5):  # wi: where the window's sides are (the custom op: 6)
    _flash_inputs(op, *a[:3], FA2, False)
    _window_rule(op, a[wi], a[wi + 1], FA2)


def _fa2_bwd(op, a, kw, wi=11):  # the custom op: 12
    dout, q, k, v, out, lse, dq, dk, dv = a[:9]
    _window_rule(op, a[wi], a[wi + 1], FA2)
    B, H, L, D = _flash_inputs(op, q, k, v, FA2, False, extra=(dout, out, dq, dk, dv))
    _need(dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, op,
          "dq, dk, dv must have q's, k's, v's shapes", FA2)
    _lse_rule(op, lse, (B, H, L), FA2)


def _fa4_inputs(op, q, k, v, src, extra=()):
    B, L, H, D = q.shape
    _need(q.dtype in HALF, op, f"inputs must be float16 or bfloat16, got {q.dtype}", src)
    for x in (k, v, *extra):
        _need(x.dtype == q.dtype, op, "q, k, v (out, dout) in one dtype", src)
    _need(H % k.shape[2] == 0, op, "num_head must be divisible by num_head_kv", src)
    align = 16 // q.element_size()  # sm90: 8 <= head_dim <= 256, multiple of 16 bytes
    _need(8 <= D <= 256 and D % align == 0, op, f"head_dim {D} not supported on SM90", src)
    return B, H, L, D


def _fa4_fwd(op, a, kw):
    _fa4_inputs(op, *a[:3], FA4)
    _window_rule(op, a[5], a[6], FA4)


def _fa4_bwd(op, a, kw):
    q, k, v, out, dout, lse = a[:6]
    _window_rule(op, a[8], a[9], FA4)
    B, H, L, D = _fa4_inputs(op, q, k, v, FA4, extra=(out, dout))
    _lse_rule(op, lse, (B, H, L), FA4, contiguous=False)  # it makes lse contiguous itself


RULES = {  # op name -> its rule; the stand-ins' ops are added below
    "aten::_scaled_dot_product_flash_attention": _aten_flash_fwd,
    "aten::_scaled_dot_product_flash_attention_backward": _aten_flash_bwd,
    "aten::_scaled_dot_product_efficient_attention": _aten_meff_fwd,
    "aten::_scaled_dot_product_efficient_attention_backward": _aten_meff_bwd,
}


class KernelCall(NamedTuple):
    op: str             # e.g. aten::_scaled_dot_product_flash_attention
    causal: bool
    scale: Optional[float]
    q_shape: tuple      # as the op got it
    dtype: torch.dtype
    window: tuple = (-1, -1)    # flash-attn's window_size as the op got it; -1: no limit
    masked: bool = False        # an attn_bias (the memory-efficient op)
    pairs: Optional[int] = None  # (query, key) pairs it computes per sample and head


def kernel_pairs(L: int, S: int, causal: bool, left: int, right: int,
                 flash_attn2: bool = True) -> int:
    """(query, key) pairs a flash kernel computes for an (L, S) block, from the sources.
    flash-attn 2 (flash_api.cpp mha_fwd/mha_bwd, v2.5 .. v2.8): a side >= seqlen_k becomes
    -1; seqlen_q == 1 drops causal; causal sets right 0; set_params_fprop then makes a -1
    side opposite a set one seqlen_k (both -1: every pair); mask.h apply_mask_local keeps
    row + S - L - left <= col < row + 1 + S - L + right. FlashAttention-4 (its stand-in
    passes _resolve_causal_local_window's result; cute/mask.py): the same bounds, a -1
    (None) side unlimited, causal (None, 0)."""
    if flash_attn2:
        left, right = (-1 if left >= S else left), (-1 if right >= S else right)
        causal = causal and L > 1
        right = 0 if causal else right
        if left < 0 and right < 0:
            return L * S
        left, right = (S if left < 0 else left), (S if right < 0 else right)
    elif causal:
        right = 0
    # plain Python: this runs inside the fake mode, where torch's results are fake
    return sum(max(0, (min(S, row + 1 + S - L + right) if right >= 0 else S)
                   - (max(0, row + S - L - left) if left >= 0 else 0)) for row in range(L))


def _aten_pairs(L, S, causal):  # torch's ops: causal is top-left aligned (row i: 0..i)
    return sum(min(i + 1, S) for i in range(L)) if causal else L * S


# op -> (position of q, of causal, of scale (None: the keyword-only `scale`), of the
# window's two sides (None: no window argument), of the attn_bias, of the key; layout)
_CALL_ARGS = {
    "aten::_scaled_dot_product_flash_attention": (0, 4, None, None, None, 1, "bhld"),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11, None, None, None, 2, "bhld"),
    "aten::_scaled_dot_product_efficient_attention": (0, 6, None, None, 3, 1, "bhld"),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11, None, None, 4, 2,
                                                                "bhld"),
    "ctxpar_dry::fa2_fwd": (0, 4, 3, 5, None, 1, "fa2"),
    "ctxpar_dry::fa2_bwd": (1, 10, 9, 11, None, 2, "fa2"),
    "ctxpar_dry::fa4_fwd": (0, 4, 3, 5, None, 1, "fa4"),
    "ctxpar_dry::fa4_bwd": (0, 7, 6, 8, None, 1, "fa4"),
    "ctxpar_dry::_flash_attn_forward": (0, 5, 4, 6, None, 1, "fa2"),
    "ctxpar_dry::_flash_attn_backward": (1, 11, 10, 12, None, 2, "fa2"),
}


def _kernel_call(name, a, kw) -> Optional[KernelCall]:
    """The kernel call's causal flag, scale, window and the pairs it computes, read from the
    op's own argument positions."""
    if name not in _CALL_ARGS:
        return None
    qi, ci, si, wi, bi, ki, kind = _CALL_ARGS[name]
    causal = a[ci] if len(a) > ci else kw.get("is_causal", False)
    scale = kw.get("scale") if si is None else a[si]
    window = (-1, -1) if wi is None else (a[wi], a[wi + 1])
    masked = bi is not None and a[bi] is not None
    q, k = a[qi], a[ki]
    if kind == "bhld":
        L, S = q.shape[2], k.shape[2]
        pairs = None if masked else _aten_pairs(L, S, causal)
    else:
        pairs = kernel_pairs(q.shape[1], k.shape[1], causal, *window, kind == "fa2")
    return KernelCall(name, causal, scale, tuple(q.shape), q.dtype, window, masked, pairs)


# ------------------------------------------------------------------ the dispatch mode

COPIES = {"aten::_to_copy", "aten::copy_", "aten::copy", "aten::_copy_from",
          "aten::_copy_from_and_resize"}


class ContractMode(TorchDispatchMode):
    """Above FakeTensorMode: host ops run for real, device ops are checked then faked.

    host_syncs counts reads of device data the host itself sent (allowed: its values are
    known); any other device-to-host read raises HostSync. kernels lists every attention
    kernel call (KernelCall); ops counts every op by name.
    """

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.kernels: List[KernelCall] = []
        self.host_syncs = 0
        self.twins = WeakIdKeyDictionary()  # device tensor -> the host tensor it copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name().split(".")[0]  # the op, without its overload
        self.ops[name] += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        dev = kwargs.get("device")
        dev = None if dev is None else torch.device(dev)  # where a factory/copy puts it
        if not fakes and (dev is None or dev.type == "cpu"):
            with unset_fake_temporarily():  # host work: real, on the CPU
                return func(*args, **kwargs)
        on_cuda = any(t.device.type == "cuda" for t in tensors) or (dev and dev.type == "cuda")
        if name in COPIES or name == "aten::_local_scalar_dense":
            return self._transfer(func, name, args, kwargs, dev)
        if on_cuda:
            if "_for_cpu" in name:
                raise ContractError(f"{name}: a CPU-only kernel on CUDA tensors")
            for t in tensors:
                if t.device.type == "cpu" and t.dim() > 0:
                    raise DeviceMix(f"{name}: a CPU tensor {tuple(t.shape)} {t.dtype} among "
                                    f"CUDA inputs")
            if name in RULES:
                RULES[name](name, args, kwargs)
                call = _kernel_call(name, args, kwargs)
                if call is not None:
                    self.kernels.append(call)
        out = func(*args, **kwargs)
        if func._schema.is_mutable:  # written on the device: what the host sent is stale
            for t in tensors:
                self.twins.pop(t, None)
        if name == "aten::_scaled_dot_product_flash_attention":
            out = (_cuda_layout(out[0]), *out[1:])
        elif name == "aten::_scaled_dot_product_flash_attention_backward":
            out = tuple(_cuda_layout(g) for g in out)
        return out

    def _transfer(self, func, name, args, kwargs, dev):
        """A copy between devices (or a scalar read): host -> device is fine, device -> host
        only of data the host sent (its twin), counted; a copy_ forgets the twin."""
        into = name in ("aten::copy_", "aten::copy")  # copy_(dst, src)
        src = args[1] if into else args[0]
        if name == "aten::_local_scalar_dense":
            dst_dev = torch.device("cpu")
        elif into or name.startswith("aten::_copy_from"):  # _copy_from(src, dst)
            dst_dev = args[0].device if into else args[1].device
        else:  # _to_copy(src, device=...)
            dst_dev = dev or src.device
        if src.device.type == "cuda" and dst_dev.type == "cpu":
            twin = self.twins.get(src)
            if twin is None:
                raise HostSync(f"{name}: reads a {tuple(src.shape)} {src.dtype} tensor the "
                               f"device computed (a blocking device-to-host copy)")
            self.host_syncs += 1
            with unset_fake_temporarily():
                a = (args[0], twin, *args[2:]) if into else (twin, *args[1:])
                return func(*a, **kwargs)
        out = func(*args, **kwargs)
        if name == "aten::_to_copy" and src.device.type == "cpu" and not isinstance(
                src, FakeTensor):
            with unset_fake_temporarily():  # host data sent to the device: values known
                self.twins[out] = src.to(out.dtype)
        elif into:
            self.twins.pop(args[0], None)  # overwritten on the device
        return out


def _cuda_layout(x):
    """The aten flash op's CUDA kernel returns (B, L, H, D) contiguous, transposed to
    (B, H, L, D) (attention.cu: output.transpose(1, 2)); its meta kernel returns q's
    layout. Give the fake output the real strides."""
    B, H, L, D = x.shape
    return torch.empty((B, L, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)


# ------------------------------------------------------------------ flash-attn stand-ins
# Shape-only ops standing for the compiled kernels (flash_attn_2_cuda.fwd/bwd, the CuTe
# kernels), checked by RULES like the real ones; the Python functions above them have the
# real signatures and return values, so kernels.py's adapters meet what they meet.

_LIB = torch.library.Library("ctxpar_dry", "DEF")
_LIB.define("fa2_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal, int left, "
            "int right) -> (Tensor, Tensor)")
_LIB.define("fa2_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, float scale, bool causal, int left, "
            "int right) -> Tensor")
_LIB.define("fa4_fwd(Tensor q, Tensor k, Tensor v, float scale, bool causal, int left, "
            "int right) -> (Tensor, Tensor)")
_LIB.define("fa4_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, "
            "float scale, bool causal, int left, int right) -> (Tensor, Tensor, Tensor)")


def _lse_like(q):  # (B, L, H, D) -> lse (B, H, L) fp32
    B, L, H, _ = q.shape
    return q.new_empty((B, H, L), dtype=torch.float32)


@torch.library.register_fake("ctxpar_dry::fa2_fwd", lib=_LIB)
def _(q, k, v, scale, causal, left, right):
    return torch.empty_like(q), _lse_like(q)


@torch.library.register_fake("ctxpar_dry::fa2_bwd", lib=_LIB)
def _(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, left, right):
    B, L, H, _ = q.shape
    return q.new_empty((B, H, math.ceil(L / 128) * 128), dtype=torch.float32)  # softmax_d


@torch.library.register_fake("ctxpar_dry::fa4_fwd", lib=_LIB)
def _(q, k, v, scale, causal, left, right):
    return torch.empty_like(q), _lse_like(q)


@torch.library.register_fake("ctxpar_dry::fa4_bwd", lib=_LIB)
def _(q, k, v, out, dout, lse, scale, causal, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


RULES.update({"ctxpar_dry::fa2_fwd": _fa2_fwd, "ctxpar_dry::fa2_bwd": _fa2_bwd,
              "ctxpar_dry::fa4_fwd": _fa4_fwd, "ctxpar_dry::fa4_bwd": _fa4_bwd})


def _maybe_contiguous(x):  # flash_attn_interface.py's own
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


# flash-attn 2.5 (flash_attn/flash_attn_interface.py at v2.5.9.post1): plain functions.
def fa25_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                 return_softmax):
    assert (dropout_p, alibi_slopes, return_softmax) == (0.0, None, False)
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse = torch.ops.ctxpar_dry.fa2_fwd(q, k, v, softmax_scale, causal,
                                                    window_size[0], window_size[1])
    return out, q, k, v, out, softmax_lse, None, None


def fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                  causal, window_size, alibi_slopes, deterministic, rng_state=None):
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    softmax_d = torch.ops.ctxpar_dry.fa2_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv,
                                             softmax_scale, causal, window_size[0],
                                             window_size[1])
    return dq, dk, dv, softmax_d


# flash-attn 2.6 (v2.6.3): softcap after window_size, still 8 values.
def fa26_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, return_softmax):
    assert softcap == 0.0
    return fa25_forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, return_softmax)


def fa26_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                  causal, window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softcap == 0.0
    return fa25_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                         softmax_scale, causal, window_size, alibi_slopes, deterministic,
                         rng_state)


# flash-attn 2.7+ (v2.7.0 .. v2.8.3): torch.library custom ops; the forward returns 4 values,
# the backward writes dq, dk, dv and returns softmax_d.
@torch.library.custom_op("ctxpar_dry::_flash_attn_forward", mutates_args=(),
                         device_types="cuda")
def fa27_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 softmax_scale: float, causal: bool, window_size_left: int,
                 window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                 return_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    raise RuntimeError("a stand-in: fake tensors only")


@fa27_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
      softcap, alibi_slopes, return_softmax):
    assert (dropout_p, softcap, alibi_slopes, return_softmax) == (0.0, 0.0, None, False)
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    out, lse = torch.ops.ctxpar_dry.fa2_fwd(q, k, v, softmax_scale, causal, window_size_left,
                                            window_size_right)
    return out, lse, q.new_empty((0,)), q.new_empty((2,), dtype=torch.int64)


@torch.library.custom_op("ctxpar_dry::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cuda")
def fa27_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                  dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], dropout_p: float,
                  softmax_scale: float, causal: bool, window_size_left: int,
                  window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                  rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    raise RuntimeError("a stand-in: fake tensors only")


@fa27_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
      window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
      rng_state=None):
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    return torch.ops.ctxpar_dry.fa2_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv,
                                        softmax_scale, causal, window_size_left,
                                        window_size_right)


RULES.update({"ctxpar_dry::_flash_attn_forward": lambda op, a, kw: _fa2_fwd(op, a, kw, 6),
              "ctxpar_dry::_flash_attn_backward": lambda op, a, kw: _fa2_bwd(op, a, kw, 12)})


def _fa4_window(causal, left, right):
    """FlashAttention-4's interface.py _resolve_causal_local_window (beta18 .. beta27), as
    (causal, left, right) with -1 for its None; a side it would read as a number must be
    an int >= 0 (a -1 there would be a real bound, not "no limit")."""
    for side in (left, right):
        assert side is None or (type(side) is int and side >= 0), (left, right)
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right == 0:
        causal, right = True, None
    elif left is not None or right is not None:
        causal = False
    return causal, -1 if left is None else left, -1 if right is None else right


# FlashAttention-4 >= 4.0.0.beta19 (flash_attn/cute/interface.py at fa4-v4.0.0.beta27): the
# forward returns (out, lse, p, row_max); every parameter as in the source.
def fa4_forward(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None,
                page_table=None, softmax_scale=None, causal=False, softcap=None,
                window_size_left=None, window_size_right=None, learnable_sink=None,
                tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                block_sparse_tensors=None, return_lse=False, out=None, lse=None,
                aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
                v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
                seqlen_k_per_split=None, disable_scheduler_metadata=False):
    assert return_lse and softmax_scale is not None and cu_seqlens_q is None
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    causal, left, right = _fa4_window(causal, window_size_left, window_size_right)
    o, l = torch.ops.ctxpar_dry.fa4_fwd(q, k, v, softmax_scale, causal, left, right)
    return o, l, None, None


def fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                 window_size_left=None, window_size_right=None, m_block_size=64,
                 n_block_size=128, num_threads=256, pack_gqa=False, num_stages_Q=2,
                 num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                 AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False,
                 cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None,
                 dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                 aux_scalars=None, block_sparse_tensors=None, dlse=None, learnable_sink=None):
    assert softmax_scale is not None
    causal, left, right = _fa4_window(causal, window_size_left, window_size_right)
    return torch.ops.ctxpar_dry.fa4_bwd(q, k, v, out, dout, lse, softmax_scale, causal, left,
                                        right)


STANDINS = {  # backend name -> (forward, backward) for kernels.FlashAttnBackend(...)
    "flash_attn 2.5": (fa25_forward, fa25_backward),
    "flash_attn 2.6": (fa26_forward, fa26_backward),
    "flash_attn 2.7+": (fa27_forward, fa27_backward),
    "flash_attn4 beta19+": (fa4_forward, fa4_backward),
}


# ------------------------------------------------------------------ the fake CUDA context


@contextlib.contextmanager
def fake_cuda(monkeypatch):
    """FakeTensorMode with ContractMode above it; yields the ContractMode.

    Device queries patched (there is no device to ask): get_device_capability says sm90
    (an H100/H200); torch.utils.checkpoint's per-device RNG states are empty (a fake
    device has no generator; nothing here draws random numbers on it). The fused merge
    is torch.compile, which does not run on fake tensors: the eager merge, the same math,
    runs instead (the compiled one is tested on real CPU tensors in test_cuda_dry.py).
    """
    import torch.utils.checkpoint as ckpt
    from ctxpar.context_parallel import merge
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(ckpt, "get_device_states", lambda *args: ([], []))
    monkeypatch.setattr(ckpt, "set_device_states", lambda *args, **kw: None)
    monkeypatch.setattr(merge, "_fused", merge.merge_block_eager_)
    mode = ContractMode()
    with FakeTensorMode(allow_non_fake_inputs=True), mode:
        yield mode
