"""model.hyper_connections: manifold-constrained hyper-connections (mHC; Xie et al., 2026;
DeepSeek-V4's hc_mult, hc_sinkhorn_iters, hc_eps), models/hyper_connections.py.

    model:
      hyper_connections:
        streams: 4            # N: the residual stream as N streams (B, T, N, d)
        sinkhorn_iters: 20    # Sinkhorn-Knopp steps making each token's comb doubly stochastic
        eps: 1.0e-6           # added to pre and comb, and to each normalisation's sum
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HyperConnectionsConfig:
    streams: int = 4
    """N: parallel residual streams; each sublayer reads their pre-weighted sum and writes
    its output to each stream times post (transformers' hc_mult)."""
    sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the residual mixing matrix comb (hc_sinkhorn_iters)."""
    eps: float = 1.0e-6
    """Added to pre and to comb and to every Sinkhorn sum (hc_eps); the streams' own RMS
    norm uses model.norm_eps (transformers' rms_norm_eps)."""


def check_hyper_connections(cfg, err) -> None:
    """model.hyper_connections against the model and the run, one ConfigError line per rule
    (before any collective)."""
    hc, m = cfg.model.hyper_connections, cfg.model
    if hc is None:
        return
    if not isinstance(hc.streams, int) or hc.streams < 1:
        err(f"model.hyper_connections.streams={hc.streams!r} must be an integer >= 1 "
            f"(or model.hyper_connections: null)")
    if not isinstance(hc.sinkhorn_iters, int) or hc.sinkhorn_iters < 1:
        err(f"model.hyper_connections.sinkhorn_iters={hc.sinkhorn_iters!r} must be an "
            f"integer >= 1")
    if not hc.eps >= 0:
        err(f"model.hyper_connections.eps={hc.eps!r} must be >= 0")
    for key, value in (("mtp", m.mtp), ("per_layer_input_dim", m.per_layer_input_dim),
                       ("layer_scalar", m.layer_scalar),
                       ("moe.beside_mlp", m.moe is not None and m.moe.beside_mlp)):
        if value:
            err(f"model.hyper_connections with model.{key}={value!r}: not built over the "
                f"N streams; unset one of them")
