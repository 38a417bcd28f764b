"""The local kernels of the linear mixers behind one interface: torch, or the field's GPU kernels.

Every CP strategy runs a local chunked pass (state passing: one over its segments; heads:
one over the whole sequence of this rank's heads; the conv: over its tokens and halo).
Each op has a torch implementation (the chunked fp32 code: any device, any dtype, the
reference; run through lean.py's ChunkedScan, which saves the inputs and recomputes the
chunks in backward, as the GPU libraries do) and a GPU library's (gpu_kernels.py: CUDA
tensors, the library installed, a dtype and shape it takes):

    op           torch                          GPU (setup.py extras "gpu")
    gated_delta  lean.gated_delta_lean          fla: flash-linear-attention's
                                                chunk_gated_delta_rule
    kda          lean.kda_lean                  fla: flash-linear-attention's chunk_kda
    ssd          lean.ssd_lean                  mamba_ssm: mamba_chunk_scan_combined
    conv         conv.conv_rows (+ halo index)  causal_conv1d: causal_conv1d_fn

The interface every implementation of an op answers (shapes as the strategies call it):

    o, final = gated_delta(q, k, v, g, beta, scale=, initial_state=, docs=, chunk_size=,
                           use_qk_l2norm_in_kernel=, segment_chunks=)
    o, final = kda(...)             # gated_delta's call, g (B, T, Hv, Dk) per key channel
    y, final = ssd(x, dt, A, B, C, D, initial_states, docs, chunk_size,
                   segment_chunks=)                                     # dt discretized

(segment_chunks: the recompute segments, lean.py, in chunks of chunk_size: the torch
kernels always run in them; the libraries are called once per segment through the same
lean.ChunkedScan when the tokens are more than one segment, or None: one call)
    out = conv(x, halo, layout, rank, world, doc, weight, bias, activation)

o and y in the inputs' dtype or fp32 (the callers cast), final states fp32; everything
differentiable, initial states included (the libraries' backwards give dh0 /
dinitial_states). ``docs`` is a LocalDocs (each row's documents on the host and on the
device: fla needs them on the host for cu_seqlens, the others on the device) or None;
``doc`` of the conv is the whole sequence's documents on the device or None.

``get_kernel(op, "auto", x, **dims)`` picks the GPU kernel when it can run x (and dims:
head dims, channels, kernel width), else torch, and logs once per op, device, dtype and
reason which it chose and why the GPU one was passed over (a package that is installed
but fails to import is a warning, never a silent fallback); a named kernel that cannot
run x is a ValueError.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Set, Tuple

import torch

from .conv import conv_rows, halo_plan, tap_mask
from .gpu_kernels import CausalConv1dKernel, FlaGatedDelta, FlaKDA, MambaSSD
from .lean import SEGMENT_CHUNKS, gated_delta_lean, kda_lean, ssd_lean

log = logging.getLogger(__name__)


class LocalDocs(NamedTuple):
    """The documents of the rows a local pass runs over: (R, L) long, every token's."""

    host: torch.Tensor    # on the CPU (fla's cu_seqlens are made from it)
    device: torch.Tensor  # on the inputs' device (the torch kernels' and mamba's seq_idx)

    def rows(self, positions_host: torch.Tensor, positions: torch.Tensor,
             split) -> "LocalDocs":
        """The documents at these columns (host and device positions), through `split`
        (state passing's to_segments)."""
        return LocalDocs(split(self.host[:, positions_host]), split(self.device[:, positions]))

    def columns(self, a: int, b: int) -> "LocalDocs":
        """The documents of tokens a..b-1 of every row (a recompute segment, lean.py)."""
        return LocalDocs(self.host[:, a:b], self.device[:, a:b])


class TorchGatedDelta:
    name = "torch"

    def why_not(self, x, **dims) -> str:
        return ""

    def __call__(self, q, k, v, g, beta, *, scale, initial_state, docs, chunk_size,
                 use_qk_l2norm_in_kernel, segment_chunks=SEGMENT_CHUNKS):
        return gated_delta_lean(q, k, v, g, beta, scale, initial_state,
                                None if docs is None else docs.device, chunk_size,
                                use_qk_l2norm_in_kernel, segment_chunks)


class TorchKDA(TorchGatedDelta):
    def __call__(self, q, k, v, g, beta, *, scale, initial_state, docs, chunk_size,
                 use_qk_l2norm_in_kernel, segment_chunks=SEGMENT_CHUNKS):
        return kda_lean(q, k, v, g, beta, scale, initial_state,
                        None if docs is None else docs.device, chunk_size,
                        use_qk_l2norm_in_kernel, segment_chunks)


class TorchSSD:
    name = "torch"

    def why_not(self, x, **dims) -> str:
        return ""

    def __call__(self, x, dt, A, B, C, D, initial_states, docs, chunk_size,
                 segment_chunks=SEGMENT_CHUNKS):
        return ssd_lean(x, dt, A, B, C, D, initial_states,
                        None if docs is None else docs.device, chunk_size, segment_chunks)


class TorchConv:
    """The taps as gathers from [local rows, halo rows, one zero row] (conv.py), fp32."""

    name = "torch"

    def why_not(self, x, **dims) -> str:
        return ""

    def __call__(self, x, halo, layout, rank, world, doc, weight, bias, activation):
        (B, S, C), K = x.shape, weight.shape[1]
        plan = halo_plan(layout, S * world, rank, world, K)
        rows = torch.cat([x, halo, x.new_zeros(B, 1, C)], dim=1).float()
        mask = tap_mask(doc, plan.positions.to(x.device), K)
        return conv_rows(rows, plan.index.to(x.device), mask, weight, bias,
                         activation).to(x.dtype)


KERNELS = {  # op -> {name: implementation}; the GPU one first
    "gated_delta": {"fla": FlaGatedDelta(), "torch": TorchGatedDelta()},
    "kda": {"fla": FlaKDA(), "torch": TorchKDA()},
    "ssd": {"mamba_ssm": MambaSSD(), "torch": TorchSSD()},
    "conv": {"causal_conv1d": CausalConv1dKernel(), "torch": TorchConv()},
}
KERNEL_CHOICES = {op: ("auto", *impls) for op, impls in KERNELS.items()}
_LOGGED: Set[Tuple[str, str, torch.dtype, str]] = set()


def gpu_kernel_name(op: str) -> str:
    return next(name for name in KERNELS[op] if name != "torch")


def get_kernel(op: str, name: str, x: torch.Tensor, **dims):
    """The implementation of `op` for x: 'auto' (the GPU library's when it can run x and
    dims, else torch; logged once per reason) or a named one (ValueError if it cannot)."""
    impls = KERNELS[op]
    if name not in KERNEL_CHOICES[op]:
        raise ValueError(f"unknown {op} kernel {name!r}; choose one of "
                         f"{list(KERNEL_CHOICES[op])}")
    if name != "auto":
        why = impls[name].why_not(x, **dims)
        if why:
            raise ValueError(f"{op} kernel {name!r} cannot run {x.dtype} tensors on "
                             f"{x.device.type} ({why})")
        return impls[name]
    gpu = impls[gpu_kernel_name(op)]
    why = gpu.why_not(x, **dims)
    chosen = impls["torch"] if why else gpu
    reason = f"{gpu.name}: {why}" if why else "the fastest kernel for it"
    key = (op, x.device.type, x.dtype, reason)
    if key not in _LOGGED:  # once per process, op, device, dtype and reason
        _LOGGED.add(key)
        log.info("linear kernel %s auto -> %s for %s %s (%s)", op, chosen.name,
                 x.device.type, str(x.dtype).replace("torch.", ""), reason)
    return chosen

