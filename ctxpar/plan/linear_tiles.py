"""A linear block over tiles (memory.tiled_linear; context_parallel/linear/tiles.py) in
bytes per rank: what it saves and what it holds while one tile runs.

    saved     the block's input (the norm's output: counted by the norm) and, per row
              (B samples x the layout's segments at cp > 1), the (state, conv tail) fp32
              entering every tile but the first: (tiles - 1) x (|state| + (K-1) Cc) x 4;
              at cp > 1 also the summary pass's (its state [M | E] for GDN and KDA, [E | M]
              for Mamba2), both passes' first rows, the first tail's hidden rows and
              PassStates' gathered summaries (cp x rows x |summary| fp32)
    working   while a tile's backward runs: the untiled block's saved set and kernel
              working set at one tile's shapes (linear_layers.mixer_saved,
              mixer_working_set on rows x tile tokens, one process: the tile runs its
              local kernel; at cp > 1 GDN's and KDA's summary pass at value width
              Dk + Dv, the larger), plus what ChunkedScan writes over the rank's sequence:
              the input's gradient (B, T, d) in e and the parameters' gradient sums (e)

The forward holds one tile's block (mixer_saved + half its working set: the phases'
rule for a replayed block) beside the output it writes.
"""
from __future__ import annotations

from dataclasses import replace

from ..config.layers import DELTA_TYPES
from ..context_parallel.linear.state_passing import SEGMENTS
from .linear_layers import mixer_saved, mixer_working_set


def _state(kind: str, sh) -> int:
    """Elements of one row's recurrent state."""
    return sh.Hv * sh.Dk * sh.Dv if kind in DELTA_TYPES else sh.H * sh.P * sh.N


def _summary(kind: str, sh) -> int:
    """Elements of one row's state passing summary ([M | E] or [E | M])."""
    return sh.Hv * sh.Dk * (sh.Dk + sh.Dv) if kind in DELTA_TYPES else sh.H * (sh.P * sh.N + 1)


def mixer_params(kind: str, sh, d: int) -> int:
    """Parameters of one linear mixer on a rank (their gradients' sums over tiles): GDN's
    and KDA's projections to [q | k | v], z (or the output gate), a, b and out_proj, the
    conv (KDA's low-rank gates counted as GDN's z and a: within a few per cent); Mamba2's
    in_proj, out_proj, the conv with its bias."""
    if kind in DELTA_TYPES:
        return d * (sh.conv_channels + 2 * sh.Hv * sh.Dv + 2 * sh.Hv) \
            + sh.conv_channels * sh.K + 2 * sh.Hv + sh.Dv
    return d * (sh.in_proj_rows + sh.H * sh.P) + sh.conv_channels * (sh.K + 1) + 3 * sh.H \
        + sh.H * sh.P


def tiled_saved(kind: str, sh, B: int, T: int, cp: int, layout: str, tile: int,
                d: int, e: int) -> int:
    """What a tiled linear block saves on a rank beyond its input (module docstring)."""
    slots = SEGMENTS[layout] if cp > 1 else 1
    rows, tiles = B * slots, -(-(T // slots) // tile)
    tail = (sh.K - 1) * sh.conv_channels
    out = 4 * rows * (tiles - 1) * (_state(kind, sh) + tail)
    if cp > 1:
        summary = _summary(kind, sh)
        out += 4 * rows * ((tiles - 1) * (summary + tail) + summary + _state(kind, sh)
                           + 2 * tail + cp * summary) + 4 * B * _state(kind, sh) \
            + rows * (sh.K - 1) * d * e
    return out


def tiled_working_set(kind: str, sh, B: int, T: int, e: int, cp: int, layout: str,
                      device: str, tile: int, d: int) -> int:
    """What a tiled linear block holds while one tile's backward runs (module docstring)."""
    slots = SEGMENTS[layout] if cp > 1 else 1
    rows, tokens = B * slots, min(tile, T // slots)
    shapes = [sh]
    if cp > 1 and kind in DELTA_TYPES:  # the summary pass: values [0 | v], Dk + Dv wide
        shapes.append(replace(sh, Dv=sh.Dk + sh.Dv))
    one = max(mixer_saved(kind, s, rows, tokens, e, 1, "state", "contiguous", device)
              + mixer_working_set(kind, s, rows, tokens, e, 1, "state", "contiguous", device)
              for s in shapes)
    return one + B * T * d * e + mixer_params(kind, sh, d) * e
