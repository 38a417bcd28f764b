"""The field's GPU kernels for the linear mixers, behind kernels.py's interface.

Each is an optional package (setup.py extras "gpu"), called by keyword after reading its
signature (the attention kernels' ``_call_by_signature``: a parameter renamed or added
between releases is dropped or fails loudly, never guessed). Signatures as read from the
sources:

- fla (flash-linear-attention, fla-core 0.5.0 .. 0.6.0, fla/ops/gated_delta_rule/chunk.py):
  ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
  output_final_state=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
  allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
  [chunk_indices=None (0.6),] cp_context=None, **kwargs) -> (o, final_state)``.
  q, k (B, T, H, K), v (B, T, HV, V), HV % H == 0 with value head h reading key head
  h // (HV/H) (ctxpar's grouping); g, beta (B, T, HV); states (N, HV, K, V), the final one
  fp32; o in q's dtype. cu_seqlens needs B == 1: the rows are flattened into one sequence,
  each row's documents its sequences; a row's initial state goes to its first document and
  its final state is its last document's (indices made on the host), which is ctxpar's
  meaning of both. cu_seqlens int32 on the device, and the same on the host as
  cu_seqlens_cpu (without it fla builds its chunk index from the device tensor: a sync).
  Its own chunk size (64) is kept: the chunk size changes only rounding.
- fla's KDA (fla-core 0.6.0, fla/ops/kda/chunk.py): ``chunk_kda(q, k, v, g, beta,
  scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
  use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
  safe_gate=False, lower_bound=None, disable_recompute=False,
  return_intermediate_states=False, state_v_first=False, cu_seqlens=None,
  cu_seqlens_cpu=None, cp_context=None, use_graph=False, max_num_seqs=None, **kwargs)
  -> (o, final_state)``: chunk_gated_delta_rule's arguments and meaning, with g (B, T,
  HV, K) the log-decay per key channel, passed already computed (use_gate_in_kernel
  False: the gate's projections run in the model, differentiably).
- mamba_ssm (mamba-ssm v2.2.6.post3 .. v2.3.2.post1, mamba_ssm/ops/triton/ssd_combined.py;
  main adds state_dtype=None): ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size,
  D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
  dt_softplus=False, dt_limit=(0.0, inf), return_final_states=False,
  return_varlen_states=False) -> out or (out, final_states)``. final_states (b, H, P, N)
  fp32, with its gradient (dfinal_states) and dinitial_states. dt comes discretized (ssd_cp
  applies dt_bias, softplus and dt_limit itself). Documents as seq_idx (b, T) int32, each
  row made to start at 0: its state passing carries the initial state only into document
  0 (ssd_state_passing.py starts from ``seq_idx = 0``), i.e. into the row's first document.
- causal_conv1d (causal-conv1d v1.4 .. v1.6.1.post4, causal_conv1d/causal_conv1d_interface.py):
  ``causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
  return_final_states=False, final_states_out=None, activation=None) -> out``, x (B, C, T).
  seq_idx needs the channel-last layout (x.stride(1) == 1, strides 0 and 2 multiples of 8,
  C % 8 == 0: csrc/causal_conv1d.cpp) and excludes initial_states, so the halo is not
  passed as initial_states: conv.run_plan puts each run of consecutive positions after its
  K - 1 predecessors in one channel-last sequence, documents as seq_idx (a tap into another
  document reads zero; -1 on a zero row), and the runs' rows are picked from the output.

Segments: with segment_chunks (kernels.py's interface) and more tokens than one segment
of segment_chunks x chunk_size, each library is called once per segment through
lean.ChunkedScan (the entering state as initial_state, the final state asked for), which
saves the inputs and the states between segments and calls it again segment by segment,
last to first, in backward: the library's forward and backward tensors exist for one
segment at a time (the same chunks from the same states: the same results to rounding).

Passed over for torch (said in kernels.get_kernel's log line): fp32 for fla and mamba_ssm
(their Triton dots round fp32 to TF32; the torch kernel is exact), key head dim > 256
(fla's chunk_delta_h.py), odd head dims in 16-bit (fla's chunk_bwd_dv refuses them), fla's
gated backward on Hopper with a Triton it refuses (fla/ops/common/chunk_o.py, fla #640:
0.5.x with Triton >= 3.4, 0.6 with 3.4 <= Triton < 3.7.1) unless its tilelang backend is
installed; channels % 8 or a width outside 2..4 for causal_conv1d.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial

import importlib.util
import re
from importlib import metadata
from typing import NamedTuple, Optional, Tuple

import torch

from ..kernels import _call_by_signature, _import_failure
from .conv import run_plan
from .lean import chunked_scan, segment_tokens

HALF = (torch.float16, torch.bfloat16)


class _Library(ABC):
    """One optional package's kernel: `fn` injected (the dry run's stand-ins) or imported
    once; why_not(x, **dims) is '' when it can run x, else the reason in a few words."""

    name, dtypes = "", HALF

    def __init__(self, fn=None, device_types=("cuda",)):
        self._fn, self.injected = fn, fn is not None
        self.device_types = tuple(device_types)
        self.unavailable = ""  # why the package could not be loaded, once tried

    @abstractmethod
    def _import(self):
        """The library's function (each library's class imports its own)."""

    def _load(self):
        if self._fn is None:
            try:
                self._fn = self._import()
            except Exception as e:  # not installed, or a broken build / ABI mismatch
                self._fn, self.unavailable = False, _import_failure(e)
        return self._fn or None

    def _shape_why_not(self, **dims) -> str:
        return ""

    def why_not(self, x: torch.Tensor, **dims) -> str:
        if x.device.type not in self.device_types:
            return f"needs {'/'.join(self.device_types)}"
        if x.dtype not in self.dtypes:
            names = "/".join(str(d).replace("torch.", "") for d in self.dtypes)
            return f"needs {names}"
        why = self._shape_why_not(**dims)
        if why:
            return why
        if self._load() is None:
            return f"not usable ({self.unavailable})"
        return ""


def _version(package: str) -> Optional[Tuple[int, ...]]:
    try:
        return tuple(int(p) for p in re.findall(r"\d+", metadata.version(package))[:3])
    except metadata.PackageNotFoundError:
        return None


def fla_backward_refused(device) -> str:
    """fla's own check (fla/ops/common/chunk_o.py chunk_bwd_dqkwg, fla #640): on Hopper its
    gated backward raises with Triton >= 3.4 (0.5.x) or 3.4 <= Triton < 3.7.1 (0.6), unless
    its tilelang backend is installed. Found before the first step, not in the first
    backward."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return ""
    triton = _version("triton")
    fla = _version("fla-core") or _version("flash-linear-attention")
    if triton is None or triton < (3, 4, 0) or importlib.util.find_spec("tilelang"):
        return ""
    if fla is not None and fla >= (0, 6, 0) and triton >= (3, 7, 1):
        return ""
    return (f"its gated backward refuses Hopper with triton {'.'.join(map(str, triton))} "
            f"(fla #640): install tilelang or triton >= 3.7.1")


class FlatDocuments(NamedTuple):
    """R rows of documents as one sequence of N documents (fla's cu_seqlens needs B == 1)."""

    cu: torch.Tensor     # (N + 1,) int32 on the host: the documents' boundaries
    first: torch.Tensor  # (R,) the first document of each row
    last: torch.Tensor   # (R,) the last


def flatten_documents(host: torch.Tensor) -> FlatDocuments:
    """host (R, L) every token's document -> the flat boundaries (a row start is always one)."""
    R, L = host.shape
    start = torch.ones(R, L, dtype=torch.bool)
    start[:, 1:] = host[:, 1:] != host[:, :-1]
    starts = start.flatten().nonzero().squeeze(1)                       # (N,)
    first = torch.searchsorted(starts, torch.arange(R) * L)
    last = torch.cat([first[1:], torch.tensor([len(starts)])]) - 1
    cu = torch.cat([starts, torch.tensor([R * L])]).to(torch.int32)
    return FlatDocuments(cu, first, last)


class FlaGatedDelta(_Library):
    """flash-linear-attention's chunk_gated_delta_rule (module docstring)."""

    name = "fla"

    def _import(self):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule

    def _shape_why_not(self, key_dim: int = 0, value_dim: int = 0, **dims) -> str:
        if key_dim > 256:
            return f"key head dim {key_dim} > 256"
        if key_dim % 2 or value_dim % 2:
            return f"odd head dims (K={key_dim}, V={value_dim}) in 16-bit"
        return ""

    def why_not(self, x: torch.Tensor, **dims) -> str:
        why = super().why_not(x, **dims)
        return why or ("" if self.injected else fla_backward_refused(x.device))

    def __call__(self, q, k, v, g, beta, *, scale, initial_state, docs, chunk_size,
                 use_qk_l2norm_in_kernel, segment_chunks=None):
        """One call, or one per segment of segment_chunks chunks (module docstring)."""
        run = partial(self.call_once, scale, use_qk_l2norm_in_kernel)
        if segment_chunks is None or q.shape[1] <= segment_tokens(chunk_size, segment_chunks):
            return run(q, k, v, g, beta, initial_state, docs)
        return chunked_scan(run, (q, k, v, g, beta), (), initial_state, docs,
                            segment_tokens(chunk_size, segment_chunks))

    def call_once(self, scale, use_qk_l2norm_in_kernel, q, k, v, g, beta, initial_state,
                  docs):
        """The library over the rows' tokens at once: (o, final state)."""
        values = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if docs is None:  # batched rows, per-row states as they are
            return _call_by_signature(self._load(), values)
        R, L = v.shape[:2]
        flat = flatten_documents(docs.host)
        first, last = flat.first.to(q.device), flat.last.to(q.device)
        if initial_state is not None:  # (N, HV, K, V): the rows' states at their first docs
            values["initial_state"] = initial_state.new_zeros(
                len(flat.cu) - 1, *initial_state.shape[1:]).index_copy(0, first, initial_state)
        for name in ("q", "k", "v", "g", "beta"):  # (R, L, ...) -> (1, R*L, ...)
            values[name] = values[name].reshape(1, R * L, *values[name].shape[2:])
        values.update(cu_seqlens=flat.cu.to(q.device), cu_seqlens_cpu=flat.cu)
        o, final = _call_by_signature(self._load(), values)
        return o.view(R, L, *o.shape[2:]), final.index_select(0, last)


class FlaKDA(FlaGatedDelta):
    """flash-linear-attention's chunk_kda (module docstring): FlaGatedDelta's call, g
    (B, T, HV, K) per key channel, already -exp(A_log) softplus(f + dt_bias)."""

    def _import(self):
        from fla.ops.kda import chunk_kda
        return chunk_kda


class MambaSSD(_Library):
    """mamba_ssm's mamba_chunk_scan_combined (module docstring)."""

    name = "mamba_ssm"

    def _import(self):
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined

    def __call__(self, x, dt, A, B, C, D, initial_states, docs, chunk_size,
                 segment_chunks=None):
        """One call, or one per segment of segment_chunks chunks (module docstring)."""
        run = partial(self.call_once, chunk_size)
        if segment_chunks is None or x.shape[1] <= segment_tokens(chunk_size, segment_chunks):
            return run(x, dt, B, C, A, D, initial_states, docs)
        return chunked_scan(run, (x, dt, B, C), (A, D), initial_states, docs,
                            segment_tokens(chunk_size, segment_chunks))

    def call_once(self, chunk_size, x, dt, B, C, A, D, initial_states, docs):
        """The library over the rows' tokens at once: (y, final states)."""
        seq_idx = None
        if docs is not None:  # (b, T) int32, every row's first document 0
            seq_idx = (docs.device - docs.device[:, :1]).to(torch.int32)
        return _call_by_signature(self._load(), dict(
            x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D,
            initial_states=initial_states, seq_idx=seq_idx, return_final_states=True))


def _channel_last(x: torch.Tensor) -> torch.Tensor:
    """(B, E, C) whose transpose causal_conv1d takes as channel-last: stride(2) == 1, the
    other strides multiples of 8 (a split of in_proj's output may not be)."""
    ok = x.stride(2) == 1 and x.stride(1) % 8 == 0 and x.stride(0) % 8 == 0
    return x if ok else x.contiguous()


class CausalConv1dKernel(_Library):
    """causal-conv1d's causal_conv1d_fn over conv.run_plan's sequence (module docstring)."""

    name, dtypes = "causal_conv1d", (torch.float32, *HALF)

    def _import(self):
        from causal_conv1d import causal_conv1d_fn
        return causal_conv1d_fn

    def _shape_why_not(self, channels: int = 8, width: int = 4, **dims) -> str:
        if channels % 8:
            return f"channels {channels} not a multiple of 8 (its channel-last layout)"
        if not 2 <= width <= 4:
            return f"width {width} outside 2..4"
        return ""

    def __call__(self, x, halo, layout, rank, world, doc, weight, bias, activation):
        (B, S, C), K = x.shape, weight.shape[1]
        runs = run_plan(layout, S * world, rank, world, K)
        if runs.identity:  # one run from position 0: the rows as they are
            rows = _channel_last(x)
        else:
            rows = torch.cat([x, halo, x.new_zeros(B, 1, C)], dim=1)[:, runs.slots.to(x.device)]
        seq_idx = None
        if doc is not None:  # (B, E) int32: each place's document, -1 on a zero row
            where = runs.positions.to(x.device)
            seq_idx = torch.where(where >= 0, doc[:, where.clamp(min=0)], -1).to(torch.int32)
        out = _call_by_signature(self._load(), dict(
            x=rows.transpose(1, 2), weight=weight, bias=bias, seq_idx=seq_idx,
            activation=activation)).transpose(1, 2)                     # (B, E, C)
        return out if runs.identity else out[:, runs.keep.to(x.device)]
