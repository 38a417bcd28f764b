"""A whole linear block (Gated DeltaNet, KDA, Mamba2) over tiles of the rank's tokens.

The lean kernels (lean.py) save the kernel's inputs, but the block around the kernel
still keeps, over the rank's whole sequence, its projections, the conv's input and
output, the gates, the kernel's output and the gated norm's inputs: tens of KB a token.
Under memory.tiled_linear the block runs as lean.ChunkedScan runs a kernel, with the
block as the recurrence and `tile` tokens as the segment:

    forward   under no_grad, tile by tile: projections, the short conv, the kernel, the
              gated norm, the output projection of one tile, from the state the tile
              before handed on: the recurrent state and the conv's last K - 1 inputs
              (its "tail", packed with the state as one fp32 row per sample); saved are
              the block's input and every tile's entering (state, tail)
    backward  tile by tile from the last: the tile again with autograd from its saved
              entering (state, tail), backpropagated into the tile's input, the block's
              parameters (summed over tiles) and the entering (state, tail), whose
              gradient goes to the tile before (ChunkedScan's backward, unchanged)

so the block's working set is one tile's, forward and backward, and its saved set the
input (B, T/cp, d) plus (tiles - 1) x (|state| + (K-1) C) fp32 per sample.

Documents: a tile whose first token starts a document takes a zero (state, tail)
(ChunkedScan's reset); inside a tile the conv's taps and the kernel's masks restart at
each start, and a tail row of another document than the tile's last token is zeroed
before it is handed on, so the conv never reads across a document.

CP (strategy 'state' only: the 'heads' all-to-all would need every rank's tile at once):
the rank's incoming state is its first tile's. It comes from state passing's composition
(state_passing.pass_states, its all-gather and its reduce-scatter backward reused), which
needs each rank's summary (M, E) first: a first tiled pass computes it with the same
machinery (GDN and KDA: the kernel on [0 | v] from [I | 0], state_passing's widened
pass; Mamba2: the scan from zero and the product of the decays), then the block runs
tiled from the composed state. The conv's first tail is the K - 1 hidden rows before
each of the rank's runs of positions (conv.py's halo plan and exchange, on the block's
input), projected. Zigzag's two chunks are two rows (to_segments), as in state passing.
Twice the kernel's forward and backward at cp > 1 (docs/memory.md, "Tiled linear blocks").

The mixer supplies (models/linear_tiles.py): tile_shapes() -> (state shape per sample,
conv channels, conv kernel), conv_input(x) -> (B, L, C), tile(x, state, tail, docs) ->
(y, state, tail), and for cp > 1 summary_start(carry), summary_tile(x, state, tail, docs)
and summary_combine (state_passing's combine for its summary).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.func import functional_call

from ..comm import group_rank_and_size
from ..layouts import rank_positions
from .api import _cp_group, _documents
from .conv import HaloExchange, halo_plan
from .kernels import LocalDocs
from .lean import ChunkedScan
from .state_passing import (SEGMENTS, carries_state, from_segments, pass_states,
                            to_segments)

TILED_LINEAR_STRATEGIES = ("state",)  # parallel.linear_cp values tiles run under at cp > 1


def check_tile_tokens(tile: int, chunk_size: int, key: str = "memory.linear_tile_tokens"
                      ) -> None:
    """A tile is a positive multiple of the kernel's chunk: the kernel's chunks stay the
    ones it runs untiled (the same operations, the same rounding)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0 or tile % chunk_size:
        raise ValueError(f"{key}={tile!r} must be a positive multiple of the linear chunk "
                         f"size {chunk_size}")


def pack(state: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """(B, |state| + (K-1) C) fp32: the recurrent state and the conv tail of each row."""
    return torch.cat([state.flatten(1).float(), tail.flatten(1).float()], dim=1)


def unpack(packed: torch.Tensor, shapes, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """pack's inverse: (state (B, *state) fp32, tail (B, K-1, C) in the block's dtype)."""
    state_shape, channels, kernel = shapes
    n = packed.shape[1] - (kernel - 1) * channels
    state, tail = packed.split([n, packed.shape[1] - n], dim=1)
    return state.view(-1, *state_shape), tail.view(-1, kernel - 1, channels).to(dtype)


def conv_tile(rows: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor], docs: Optional[LocalDocs]
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The short conv (silu) of one tile: (out (B, L, C), the tail for the next tile).

    rows (B, L, C) the tile's conv inputs; tail (B, K-1, C) the inputs of the K-1 tokens
    before it, zero where another document than the tile's first token's; weight (C, K).
    The next tail is zero where another document than the tile's last token's."""
    from .api import causal_conv1d  # the one-process conv (api imports this package's kernels)
    K = weight.shape[1]
    full = torch.cat([tail.to(rows.dtype), rows], dim=1)                # (B, K-1+L, C)
    seq = None if docs is None else docs.device
    if seq is not None:  # the tail counts as the first token's document (zero otherwise)
        seq = torch.cat([seq[:, :1].expand(-1, K - 1), seq], dim=1)
    out = causal_conv1d(full, weight, bias, activation="silu", seq_idx=seq)[:, K - 1:]
    nxt = full[:, full.shape[1] - (K - 1):]
    if seq is not None:
        nxt = nxt * (seq[:, -(K - 1):] == seq[:, -1:])[..., None].to(nxt.dtype)
    return out, nxt


class _Method(nn.Module):
    """mixer.<method> as a module's forward, so torch.func.functional_call can run it on
    the parameters ChunkedScan's backward hands it (detached leaves of the same values)."""

    def __init__(self, mixer: nn.Module, method: str):
        super().__init__()
        self.mixer, self.method = mixer, method

    def forward(self, *args):
        return getattr(self.mixer, self.method)(*args)


def _run(mixer, method, names, shapes, x, *rest):
    """ChunkedScan's `run` for a block: (y, packed (state, tail) after the tile)."""
    *params, packed, docs = rest
    if packed is None:  # the first tile on one process: zero state, zero tail
        state_shape, channels, kernel = shapes
        packed = x.new_zeros(x.shape[0], math.prod(state_shape) + (kernel - 1) * channels,
                             dtype=torch.float32)
    state, tail = unpack(packed, shapes, x.dtype)
    y, state, tail = functional_call(_Method(mixer, method),
                                     {f"mixer.{n}": p for n, p in zip(names, params)},
                                     (x, state, tail, docs))
    return y, pack(state, tail)


def _first_tail(mixer, x, group, layout, docs_n, K, slots):
    """(B*slots, K-1, C): the conv inputs of the K-1 tokens before each of the rank's
    runs (zero before position 0 and in another document than the run's first token)."""
    rank, world = group_rank_and_size(group)
    B, S, d = x.shape
    plan = halo_plan(layout, S * world, rank, world, K)
    halo = HaloExchange.apply(x, plan, group) if plan.recvs or plan.sends \
        else x.new_zeros(B, 0, d)
    first = plan.positions.view(slots, -1)[:, 0]                        # (slots,)
    runs = torch.arange(slots) * (S // slots)
    idx = plan.index[runs][:, torch.arange(K - 1, 0, -1)]              # (slots, K-1)
    local, taps = idx < S, first[:, None] - torch.arange(K - 1, 0, -1)  # positions read
    from_x = x[:, idx.clamp(max=S - 1).flatten().to(x.device)]
    from_halo = torch.cat([halo, x.new_zeros(B, 1, d)], dim=1)[
        :, (idx - S).clamp(min=0).flatten().to(x.device)]
    rows = torch.where(local.flatten().to(x.device)[None, :, None], from_x, from_halo)
    keep = (taps >= 0).to(x.device).expand(B, -1, -1)                 # (B, slots, K-1)
    if docs_n is not None:
        keep = keep & (docs_n[:, taps.clamp(min=0).to(x.device)]
                       == docs_n[:, first.to(x.device)][:, :, None])
    tail = mixer.conv_input(rows).unflatten(1, (slots, K - 1))         # (B, slots, K-1, C)
    return (tail * keep[..., None].to(tail.dtype)).flatten(0, 1)


def tiled_linear_block(mixer: nn.Module, x: torch.Tensor, cu_seqlens, tile: int,
                       strategy: str = "state") -> torch.Tensor:
    """The mixer's block over tiles of `tile` tokens (module docstring): x (B, T/cp, d)
    this rank's tokens in the mixer's CP layout -> (B, T/cp, d), as the untiled block."""
    group, layout = _cp_group(mixer.cp.cp_group), mixer.cp.layout
    rank, P = group_rank_and_size(group)
    if P > 1 and strategy not in TILED_LINEAR_STRATEGIES:
        raise ValueError(f"memory.tiled_linear runs under parallel.linear_cp in "
                         f"{list(TILED_LINEAR_STRATEGIES)} at cp > 1, not {strategy!r}")
    B, S = x.shape[:2]
    shapes = mixer.tile_shapes()
    state_shape, channels, K = shapes
    slots = SEGMENTS[layout] if P > 1 else 1
    doc = _documents(cu_seqlens, S * P, B, "memory.tiled_linear", x.device)
    pos_host = rank_positions(S * P, rank, P, layout)
    pos = pos_host.to(x.device)
    docs = None if doc is None else doc.rows(pos_host, pos, partial(to_segments, slots=slots))
    named = [(n, p) for n, p in mixer.named_parameters()]
    names, params = [n for n, _ in named], [p for _, p in named]
    xs = to_segments(x, slots)                                          # (B*slots, L, d)
    start = None  # one process: the first tile starts from zeros (_run), nothing saved
    if P > 1:
        tail = _first_tail(mixer, x, group, layout, None if doc is None else doc.device,
                           K, slots)
        carry = carries_state(pos, None if doc is None else doc.device, B, slots).float()
        summary_run = partial(_run, mixer, "summary_tile", names, mixer.summary_shapes())
        _, summary = ChunkedScan.apply(summary_run, tile, 1, docs,
                                       pack(mixer.summary_start(carry), tail), xs, *params)
        summary, _ = unpack(summary, mixer.summary_shapes(), x.dtype)  # (B*slots, ...)
        summary = summary.unflatten(0, (B, slots)).transpose(0, 1)     # (slots, B, ...)
        s0 = x.new_zeros(B, *state_shape, dtype=torch.float32)
        s_in, _ = pass_states(summary, mixer.summary_combine, s0, group, layout)
        s_in = s_in.transpose(0, 1).flatten(0, 1)                       # (B*slots, *state)
        start = pack(s_in * carry.view(-1, *[1] * len(state_shape)), tail)
    run = partial(_run, mixer, "tile", names, shapes)
    y, _ = ChunkedScan.apply(run, tile, 1, docs, start, xs, *params)
    return from_segments(y, slots)
