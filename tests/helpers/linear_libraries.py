"""The three GPU libraries' functions as they behave, in plain torch on the CPU.

Each has the real signature (fla-core 0.6.0, mamba-ssm 2.3.2.post1, causal-conv1d 1.6.1)
and the real semantics of what ctxpar relies on, computed one sequence or document at a
time with ctxpar's own fp32 math, so that a test of ctxpar's adapters (gpu_kernels.py:
flattening rows into fla's cu_seqlens, each row's states at its first and last document,
mamba's seq_idx made to start at 0, causal-conv1d's run sequence and seq_idx) checks the
adapters, not the math:

- fla (chunk_gated_delta_rule, chunk_kda): cu_seqlens needs B == 1 and N initial states; each sequence starts from its own.
- mamba_ssm: the initial state reaches only document 0 (its state passing starts from
  seq_idx 0), the state restarts where seq_idx changes; final states after the last token.
- causal_conv1d: x (B, C, T); with seq_idx the channel-last layout and no initial_states;
  a tap into another document reads zero, a token with seq_idx < 0 outputs zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ctxpar.context_parallel.linear.gated_delta import gated_delta_fp32
from ctxpar.context_parallel.linear.kda import kda_fp32
from ctxpar.context_parallel.linear.ssd import discretize_dt, ssd_fp32


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):
    return _delta_rule(gated_delta_fp32, q, k, v, g, beta, scale, initial_state,
                       output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, disable_recompute=False, return_intermediate_states=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
              use_graph=False, max_num_seqs=None, **kwargs):
    assert not use_gate_in_kernel and g.dim() == 4  # the gate computed outside (ctxpar's)
    return _delta_rule(kda_fp32, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)


def _delta_rule(kernel, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu):
    """fla's chunk_gated_delta_rule and chunk_kda: per sequence of cu_seqlens, its own
    chunk of 16 (ctxpar's callers use other chunks: the results differ by rounding)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    run = lambda sl, h0: kernel(  # noqa: E731
        q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale, h0, None, 16,
        use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        o, final = run(slice(None), initial_state)
    else:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int32, (q.shape, cu_seqlens.dtype)
        assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
        cu = cu_seqlens_cpu.tolist()
        assert initial_state is None or initial_state.shape[0] == len(cu) - 1
        parts = [run(slice(a, b), None if initial_state is None else initial_state[n:n + 1])
                 for n, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        o, final = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
    return o.to(q.dtype), (final if output_final_state else None)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    assert z is None and cu_seqlens is None and not return_varlen_states
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    if seq_idx is None:
        y, final = ssd_fp32(x, dt, A, B, C, D, initial_states, None, chunk_size)
    else:
        assert seq_idx.dtype == torch.int32
        ys, finals = [], []
        for b in range(x.shape[0]):
            ids = seq_idx[b]
            starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]] + [len(ids)]
            h, row = None, []
            for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
                h0 = initial_states[b:b + 1] if (i == 0 and int(ids[0]) == 0
                                                 and initial_states is not None) else None
                y, h = ssd_fp32(x[b:b + 1, s:e], dt[b:b + 1, s:e], A, B[b:b + 1, s:e],
                                C[b:b + 1, s:e], D, h0, None, chunk_size)
                row.append(y)
            ys.append(torch.cat(row, 1))
            finals.append(h)
        y, final = torch.cat(ys), torch.cat(finals)
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    Bsz, C, T = x.shape
    K = weight.shape[1]
    if seq_idx is not None:
        assert x.stride(1) == 1 and initial_states is None and seq_idx.dtype == torch.int32
    xf = x.float()
    out = 0.0 if bias is None else bias.float()[:, None]
    for d in range(K):  # tap d reads t - d (zeros before the start), as conv.conv_rows adds
        tap = F.pad(xf, (d, 0))[..., :T]
        if seq_idx is not None:
            tap = tap * (F.pad(seq_idx, (d, 0), value=-2)[..., :T] == seq_idx)[:, None]
        out = out + tap * weight[:, K - 1 - d, None].float()
    out = F.silu(out) if activation in ("silu", "swish") else out
    if seq_idx is not None:
        out = out * (seq_idx >= 0)[:, None]
    return out.to(x.dtype)
