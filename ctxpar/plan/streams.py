"""What model.hyper_connections (mHC, models/hyper_connections.py) adds to a rank's saved
activations: the residual as N streams (B, T/cp, N, d), and each sublayer's and the head's
fp32 maps. Exact against autograd's saved tensors on CPU (tests/test_hyper_connections.py);
per token, N streams, d model width, e the activations' bytes, I Sinkhorn iterations:

    block input      'full', 'selective' (an attention block's): N d e in place of d e
    each sublayer    'none': the streams N d e, their fp32 normed copy 4 N d (and the fp32
                     cast 4 N d below e = 4), the rsqrt 4, the map's output 4 (2+N) N, pre's
                     sigmoid and pre 8 N, post's sigmoid 4 N and post in e, the softmax
                     4 N^2, the 2I-1 Sinkhorn divisions' numerators and sums (2I-1)(4 N^2 +
                     4 N), comb in e, and the sublayer's output d e (post times it keeps it)
    head             the streams N d e, their normed copy 4 N d (and cast), rsqrt 4,
                     mixes, sigmoid and pre 12 N
    below fp32       each map's fp32 copy of its fn (and of its scale) the linear keeps
"""
from __future__ import annotations

from ..config import ModelConfig
from ..config.layer_mixers import LAYER_MIXERS


def _read(n: int, d: int, e: int) -> int:
    """The streams, their normed fp32 copy (and cast below fp32), the rsqrt: per token."""
    return n * d * e + 4 * n * d * (1 if e == 4 else 2) + 4


def sublayer_saved(n: int, d: int, e: int, iters: int) -> int:
    """Saved bytes per token of one sublayer's HyperConnection and stream mix ('none')."""
    maps = 4 * (2 + n) * n + 12 * n + e * n + 4 * n * n + (2 * iters - 1) * (4 * n * n + 4 * n)
    return _read(n, d, e) + maps + e * n * n + d * e


def streams_saved(tokens: int, d: int, e: int, m: ModelConfig, mode: str, kind: str) -> int:
    """What a block of layer type kind saves in mode beyond its single-stream count."""
    hc = m.hyper_connections
    if hc is None:
        return 0
    n, (token, channel) = hc.streams, LAYER_MIXERS[kind]
    # 'selective' splits attention blocks only; others keep everything (counts.block_activations)
    if mode == "full" or (mode == "selective" and token == "attention"):
        return tokens * (n - 1) * d * e  # the block input kept whole: N streams
    sublayers = (token is not None) + (channel is not None)
    weights = 0 if e == 4 else 4 * ((2 + n) * n * n * d + 3)  # fp32 copies of fn, scale
    return sublayers * (tokens * sublayer_saved(n, d, e, hc.sinkhorn_iters) + weights)


def head_streams_saved(tokens: int, d: int, e: int, m: ModelConfig) -> int:
    """What the HyperHead saves before the final norm (its fn's fp32 copy below fp32)."""
    hc = m.hyper_connections
    if hc is None:
        return 0
    n = hc.streams
    return tokens * (_read(n, d, e) + 12 * n) + (0 if e == 4 else 4 * (n * n * d + 1))
