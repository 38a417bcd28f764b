"""memory.tiled_linear against the run: what the tiled linear blocks are built and tested
with (ctxpar/context_parallel/linear/tiles.py; tests/test_linear_tiles.py), the rest
refused by key, one line each."""
from __future__ import annotations

from typing import Callable

from ..context_parallel.linear.tiles import TILED_LINEAR_STRATEGIES, check_tile_tokens
from .layer_mixers import token_mixers
from .layers import gated_delta_dims, mamba_dims


def check_tiled_linear(cfg, err: Callable[[str], None]) -> None:
    mem, m, p = cfg.memory, cfg.model, cfg.parallel
    if not mem.tiled_linear:
        return
    mixers = token_mixers(m)
    chunks = ([gated_delta_dims(m).chunk_size] if mixers & {"gated_delta", "kda"} else []) + \
        ([mamba_dims(m).chunk_size] if "mamba2" in mixers else [])
    for chunk in chunks:
        try:
            check_tile_tokens(mem.linear_tile_tokens, chunk)
        except ValueError as e:
            err(str(e))
    unbuilt = [
        (not chunks, "a model without linear layers (model.layer_types has no "
                     "'linear_attention', 'kimi_delta_attention' or 'mamba')"),
        (p.cp > 1 and p.linear_cp not in TILED_LINEAR_STRATEGIES,
         f"parallel.linear_cp={p.linear_cp!r} at parallel.cp={p.cp} (tiles run under "
         f"{list(TILED_LINEAR_STRATEGIES)}: the heads all-to-all needs every rank's tile)"),
        (cfg.data.dynamic_cp, "data.dynamic_cp=true (tested with the static CP group)"),
    ]
    for refused, why in unbuilt:
        if refused:
            err(f"memory.tiled_linear=true is not built with {why}")
