"""The linear mixers' GPU libraries on the fake CUDA device: their rules and stand-ins.

Imported by tests/cuda_dry_linear_cases.py in the fake-CUDA process (tests/fake_cuda.py),
beside tests/cuda_dry.py's attention kernels. Each library function has a stand-in with
its real signature, its own Python-side checks and its real return values (shapes,
dtypes, layouts), over shape-only ops whose input rules ContractMode enforces like the
compiled kernels (added to cuda_dry.RULES, each citing its source); every call is
recorded in CALLS with the arguments ctxpar passed (initial state, final state asked for,
cu_seqlens / seq_idx and where they live) for the cases to assert.

- fla-core 0.6.0 fla/ops/gated_delta_rule/chunk.py chunk_gated_delta_rule
- fla-core 0.6.0 fla/ops/kda/chunk.py chunk_kda
- mamba-ssm 2.3.2.post1 mamba_ssm/ops/triton/ssd_combined.py mamba_chunk_scan_combined
- causal-conv1d 1.6.1.post4 causal_conv1d/causal_conv1d_interface.py causal_conv1d_fn and
  csrc/causal_conv1d.cpp
"""
from __future__ import annotations

from functools import partial
from typing import List, NamedTuple

import torch

import cuda_dry as dry
from cuda_dry import HALF, _need

FLA = "fla-core 0.6.0 fla/ops/gated_delta_rule/chunk.py, common/chunk_delta_h.py, chunk_o.py"
KDA = "fla-core 0.6.0 fla/ops/kda/chunk.py chunk_kda"
MAMBA = "mamba-ssm 2.3.2.post1 ssd_combined.py _mamba_chunk_scan_combined_fwd"
CONV = "causal-conv1d 1.6.1.post4 csrc/causal_conv1d.cpp causal_conv1d_fwd/bwd"


class LinearCall(NamedTuple):
    library: str   # fla, fla_kda, mamba_ssm, causal_conv1d
    args: dict     # what ctxpar passed: shapes, dtypes, flags, where the documents live


CALLS: List[LinearCall] = []


def _desc(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.device.type)


# ------------------------------------------------------------------ the kernels' rules

def _gdn_rule(op, a, kw, per_channel: bool = False):
    q, k, v, g, beta, h0, cu = a[:7]
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    _need(k.shape == q.shape and v.shape[:2] == (B, T), op, "q, k (B, T, H, K), v (B, T, HV, V)",
          FLA)
    _need(HV % H == 0, op, f"HV={HV} divisible by H={H}", FLA)
    _need(tuple(beta.shape) == (B, T, HV), op, "beta (B, T, HV)", FLA)
    if per_channel:  # KDA's gate: one log-decay per key channel
        _need(tuple(g.shape) == (B, T, HV, K), op, f"g (B, T, HV, K), got {tuple(g.shape)}",
              KDA)
    else:
        _need(tuple(g.shape) == (B, T, HV), op, "g (B, T, HV)", FLA)
    _need(K <= 256, op, f"head dim K={K} <= 256", FLA)
    if q.dtype in HALF:  # chunk_bwd_dv: odd K/V tails miscompile in 16-bit
        _need(K % 2 == 0 and V % 2 == 0, op, f"even K and V in 16-bit, got {K}, {V}", FLA)
    for x in (k, v):
        _need(x.dtype == q.dtype, op, f"q, k, v in one dtype, got {x.dtype}", "ctxpar")
    N = B
    if cu is not None:
        _need(B == 1 and cu.dim() == 1 and cu.dtype in (torch.int32, torch.int64), op,
              f"cu_seqlens (N+1,) int with batch 1, got {_desc(cu)} and B={B}", FLA)
        N = cu.shape[0] - 1
    if h0 is not None:
        _need(tuple(h0.shape) == (N, HV, K, V), op,
              f"initial_state ({N}, {HV}, {K}, {V}), got {tuple(h0.shape)}", FLA)


def _ssd_rule(op, a, kw):
    x, dt, A, B, C, D, h0, seq_idx = a[:8]
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    _need(H % G == 0 and tuple(B.shape) == (b, T, G, N) and C.shape == B.shape, op,
          "B, C (b, T, G, N), G dividing H", MAMBA)
    _need(tuple(dt.shape) == (b, T, H) and tuple(A.shape) == (H,), op, "dt (b, T, H), A (H,)",
          MAMBA)
    _need(D is None or tuple(D.shape) in ((H,), (H, P)), op, "D (H,) or (H, P)", MAMBA)
    _need(h0 is None or tuple(h0.shape) == (b, H, P, N), op, "initial_states (b, H, P, N)",
          MAMBA)
    if seq_idx is not None:  # its kernels compare it with ints: int32 as ctxpar's contract
        _need(tuple(seq_idx.shape) == (b, T) and seq_idx.dtype == torch.int32, op,
              f"seq_idx (b, T) int32, got {_desc(seq_idx)}", MAMBA)


def _conv_rule(op, a, kw):
    x, weight, bias, seq_idx = a[:4]
    B, C, T = x.shape
    for t in (x, weight):
        _need(t.dtype in (torch.float32, *HALF), op, f"fp32/fp16/bf16, got {t.dtype}", CONV)
    _need(x.stride(2) == 1 or x.stride(1) == 1, op, "x (B, C, T) with T or C contiguous", CONV)
    last = x.stride(1) == 1 and x.stride(2) != 1
    if last:
        _need(C % 8 == 0, op, f"channel dim divisible by 8 (channel last), got {C}", CONV)
        _need(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, op,
              f"channel-last strides 0 and 2 multiples of 8, got {x.stride()}", CONV)
    _need(2 <= weight.shape[1] <= 4 and weight.shape[0] == C, op, "weight (C, 2..4)", CONV)
    _need(bias is None or (bias.dtype == weight.dtype and bias.stride(-1) == 1), op,
          "bias in weight's dtype, contiguous", CONV)
    if seq_idx is not None:
        _need(last, op, "seq_idx only with the channel-last layout", CONV)
        _need(seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
              and tuple(seq_idx.shape) == (B, T), op,
              f"seq_idx (B, T) int32 contiguous, got {_desc(seq_idx)}", CONV)


# ------------------------------------------------------------------ shape-only ops

_LIB = torch.library.Library("ctxpar_dry_linear", "DEF")
_LIB.define("gdn_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? h0, "
            "Tensor? cu_seqlens) -> (Tensor, Tensor)")
_LIB.define("gdn_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? h0, "
            "Tensor? cu_seqlens, Tensor do, Tensor dht) -> (Tensor, Tensor, Tensor, Tensor, "
            "Tensor, Tensor)")
_LIB.define("kda_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? h0, "
            "Tensor? cu_seqlens) -> (Tensor, Tensor)")
_LIB.define("kda_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? h0, "
            "Tensor? cu_seqlens, Tensor do, Tensor dht) -> (Tensor, Tensor, Tensor, Tensor, "
            "Tensor, Tensor)")
_LIB.define("ssd_fwd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
            "Tensor? h0, Tensor? seq_idx) -> (Tensor, Tensor)")
_LIB.define("ssd_bwd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, "
            "Tensor? h0, Tensor? seq_idx, Tensor dout, Tensor dfinal) -> (Tensor, Tensor, "
            "Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("conv_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx) -> Tensor")
_LIB.define("conv_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx, Tensor dout) "
            "-> (Tensor, Tensor, Tensor)")


def _states(q, v, h0, cu):
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    return q.new_empty((N, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)


@torch.library.register_fake("ctxpar_dry_linear::gdn_fwd", lib=_LIB)
@torch.library.register_fake("ctxpar_dry_linear::kda_fwd", lib=_LIB)
def _(q, k, v, g, beta, h0, cu_seqlens):
    return v.new_empty(v.shape, dtype=q.dtype), _states(q, v, h0, cu_seqlens)


@torch.library.register_fake("ctxpar_dry_linear::gdn_bwd", lib=_LIB)
@torch.library.register_fake("ctxpar_dry_linear::kda_bwd", lib=_LIB)
def _(q, k, v, g, beta, h0, cu_seqlens, do, dht):
    dh0 = _states(q, v, h0, cu_seqlens)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(g, dtype=torch.float32), torch.empty_like(beta), dh0)


@torch.library.register_fake("ctxpar_dry_linear::ssd_fwd", lib=_LIB)
def _(x, dt, A, B, C, D, h0, seq_idx):
    b, T, H, P = x.shape
    return torch.empty_like(x), x.new_empty((b, H, P, B.shape[3]), dtype=torch.float32)


@torch.library.register_fake("ctxpar_dry_linear::ssd_bwd", lib=_LIB)
def _(x, dt, A, B, C, D, h0, seq_idx, dout, dfinal):
    D_ = torch.empty_like(A) if D is None else torch.empty_like(D)
    return (torch.empty_like(x), torch.empty_like(dt), torch.empty_like(A),
            torch.empty_like(B), torch.empty_like(C), D_, torch.empty_like(dfinal))


@torch.library.register_fake("ctxpar_dry_linear::conv_fwd", lib=_LIB)
def _(x, weight, bias, seq_idx):
    return torch.empty_like(x)  # x's layout: channel-last in, channel-last out


@torch.library.register_fake("ctxpar_dry_linear::conv_bwd", lib=_LIB)
def _(x, weight, bias, seq_idx, dout):
    db = weight.new_empty((weight.shape[0] if bias is not None else 0,))
    return torch.empty_like(x), torch.empty_like(weight), db


_OPS = torch.ops.ctxpar_dry_linear
_kda_rule = partial(_gdn_rule, per_channel=True)
dry.RULES.update({"ctxpar_dry_linear::gdn_fwd": _gdn_rule, "ctxpar_dry_linear::gdn_bwd": _gdn_rule,
                  "ctxpar_dry_linear::kda_fwd": _kda_rule, "ctxpar_dry_linear::kda_bwd": _kda_rule,
                  "ctxpar_dry_linear::ssd_fwd": _ssd_rule, "ctxpar_dry_linear::ssd_bwd": _ssd_rule,
                  "ctxpar_dry_linear::conv_fwd": _conv_rule,
                  "ctxpar_dry_linear::conv_bwd": _conv_rule})


# ------------------------------------------------------------------ autograd around them

class _GatedDelta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu):
        ctx.save_for_backward(q, k, v, g, beta, h0, cu)
        return _OPS.gdn_fwd(q, k, v, g, beta, h0, cu)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu = ctx.saved_tensors
        dht = torch.zeros_like(_states(q, v, h0, cu)) if dht is None else dht
        *grads, dh0 = _OPS.gdn_bwd(q, k, v, g, beta, h0, cu, do, dht)
        return (*grads, None if h0 is None else dh0, None)


class _KDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu):
        ctx.save_for_backward(q, k, v, g, beta, h0, cu)
        return _OPS.kda_fwd(q, k, v, g, beta, h0, cu)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu = ctx.saved_tensors
        dht = torch.zeros_like(_states(q, v, h0, cu)) if dht is None else dht
        *grads, dh0 = _OPS.kda_bwd(q, k, v, g, beta, h0, cu, do, dht)
        return (*grads, None if h0 is None else dh0, None)


class _SSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, h0, seq_idx):
        ctx.save_for_backward(x, dt, A, B, C, D, h0, seq_idx)
        return _OPS.ssd_fwd(x, dt, A, B, C, D, h0, seq_idx)

    @staticmethod
    def backward(ctx, dout, dfinal):
        x, dt, A, B, C, D, h0, seq_idx = ctx.saved_tensors
        b, _, H, P = x.shape
        dfinal = x.new_zeros((b, H, P, B.shape[3]), dtype=torch.float32) if dfinal is None \
            else dfinal
        dx, ddt, dA, dB, dC, dD, dh0 = _OPS.ssd_bwd(x, dt, A, B, C, D, h0, seq_idx, dout, dfinal)
        return dx, ddt, dA, dB, dC, (None if D is None else dD), (None if h0 is None else dh0), \
            None


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx):
        ctx.save_for_backward(x, weight, bias, seq_idx)
        return _OPS.conv_fwd(x, weight, bias, seq_idx)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seq_idx = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:  # interface.py backward
            dout = dout.contiguous()
        dx, dw, db = _OPS.conv_bwd(x, weight, bias, seq_idx, dout)
        return dx, dw, (None if bias is None else db), None


# ------------------------------------------------------------------ the stand-ins

def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):
    if q.shape[2] != k.shape[2]:  # chunk.py's own checks
        raise ValueError("q and k must have the same number of heads")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`.")
    if cu_seqlens is not None and cu_seqlens_cpu is None and chunk_indices is None:
        cu_seqlens.cpu()  # prepare_chunk_indices: repeat_interleave of device counts (a sync)
    CALLS.append(LinearCall("fla", dict(
        q=_desc(q), v=_desc(v), initial_state=_desc(initial_state),
        output_final_state=output_final_state, cu_seqlens=_desc(cu_seqlens),
        cu_seqlens_cpu=_desc(cu_seqlens_cpu), l2norm=use_qk_l2norm_in_kernel, scale=scale)))
    o, final = _GatedDelta.apply(q, k, v, g, beta, initial_state, cu_seqlens)
    return o, (final if output_final_state else None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, **kwargs):
    if cu_seqlens is not None:  # chunk.py's own checks
        if q.shape[0] != 1:
            raise ValueError("The batch size is expected to be 1 when using `cu_seqlens`.")
        if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
            raise ValueError("The number of initial states is expected to be equal to the "
                             "number of input sequences")
        if cu_seqlens_cpu is None:
            cu_seqlens.cpu()  # its chunk indices from device counts (a sync)
    if initial_state is not None:
        assert initial_state.dtype == torch.float32, "initial_state must be in float32."
    if use_gate_in_kernel and kwargs.get("A_log") is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`")
    if kwargs.get("chunk_size", 64) not in (32, 64):
        raise ValueError("`chunk_size` must be either 32 or 64 for KDA")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    assert q.shape == k.shape, "q and k must have the same shape"
    CALLS.append(LinearCall("fla_kda", dict(
        q=_desc(q), v=_desc(v), g=_desc(g), initial_state=_desc(initial_state),
        output_final_state=output_final_state, cu_seqlens=_desc(cu_seqlens),
        cu_seqlens_cpu=_desc(cu_seqlens_cpu), l2norm=use_qk_l2norm_in_kernel, scale=scale,
        gate_in_kernel=use_gate_in_kernel, kwargs=sorted(kwargs))))
    o, final = _KDA.apply(q, k, v, g, beta, initial_state, cu_seqlens)
    return o, (final if output_final_state else None)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    CALLS.append(LinearCall("mamba_ssm", dict(
        x=_desc(x), dt=_desc(dt), initial_states=_desc(initial_states),
        seq_idx=_desc(seq_idx), return_final_states=return_final_states,
        dt_softplus=dt_softplus, chunk_size=chunk_size)))
    out, final = _SSD.apply(x, dt, A, B, C, D, initial_states, seq_idx)
    return (out, final) if return_final_states else out


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    if x.stride(2) != 1 and x.stride(1) != 1:  # CausalConv1dFn.forward's own handling
        x = x.contiguous()
    if seq_idx is not None:
        assert initial_states is None and not return_final_states
        seq_idx = seq_idx.contiguous()
    CALLS.append(LinearCall("causal_conv1d", dict(
        x=_desc(x), x_stride=x.stride(), seq_idx=_desc(seq_idx), activation=activation,
        initial_states=_desc(initial_states))))
    return _Conv.apply(x, weight, bias, seq_idx)


def install(monkeypatch):
    """kernels.KERNELS' GPU entries over the stand-ins (CUDA only, as the real ones); the
    torch implementations refuse to run (a case fails if one is reached). CALLS cleared."""
    from ctxpar.context_parallel.linear import gpu_kernels, kernels
    CALLS.clear()
    for op, impl in (("gated_delta", gpu_kernels.FlaGatedDelta(chunk_gated_delta_rule)),
                     ("kda", gpu_kernels.FlaKDA(chunk_kda)),
                     ("ssd", gpu_kernels.MambaSSD(mamba_chunk_scan_combined)),
                     ("conv", gpu_kernels.CausalConv1dKernel(causal_conv1d_fn))):
        monkeypatch.setitem(kernels.KERNELS[op], impl.name, impl)

    def refuse(*args, **kwargs):
        raise AssertionError("a linear mixer's torch kernel ran on CUDA")
    for cls in (kernels.TorchGatedDelta, kernels.TorchKDA, kernels.TorchSSD,
                kernels.TorchConv):
        monkeypatch.setattr(cls, "__call__", refuse)
