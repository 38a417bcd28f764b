"""Hybrid attention (``comm="hybrid"``, USP / Megatron's a2a+p2p): Ulysses inside, ring across.

The CP group of P ranks factors into r = P/u ring ranks of u Ulysses ranks each, Ulysses
innermost (adjacent ranks: one NVLink domain), cp rank = ring_rank * u + ulysses_rank
(parallel_state builds both sub-groups from the grid). With the two-level token layout of
layouts.py, the Ulysses all-to-all over u gives each rank its ring rank's whole layout
shard (n/r tokens, ascending) at H/u heads, and the ring over r then runs exactly as it
would with r ranks and H/u heads: same block plan, same LSE merge, same backward ring.

    q (B, n/P, H, D) --a2a over u--> (B, n/r, H/u, D) --ring over r--> --a2a back--> (B, n/P, H, D)

Per layer: Ulysses' all-to-alls (one per tensor) of the local q, k, v, out (fwd) and dout,
dq, dk, dv (bwd) inside the node, plus the ring's r-1 (fwd) and 2r-1 (bwd) P2P steps of
K,V at Hkv'/u heads across nodes (Hkv' = Hkv, or lcm(Hkv, u) when replicated, see
ulysses.py). u = 1 is the ring and r = 1 is Ulysses, exactly (same code path, same bits).
"""
from __future__ import annotations

from . import ring
from .blocks import BlockwiseAttention
from .ulysses import ulysses_attention


def hybrid_attention(q, k, v, ulysses_group, ring_group, causal: bool, layout: str,
                     scale: float, kernel, return_lse: bool = False,
                     ring_grad_dtype: str = "fp32", mask=None, sinks=None):
    """(out (B, s, H, D), lse (B, H, s) or None): Ulysses over ulysses_group around the ring
    over ring_group (whose dK,dV travel in ring_grad_dtype). mask: None or the
    AttentionMask of the full sequence (mask.py); the ring's r shards of the two-level
    layout are exactly a ring of r ranks' layout shards, so the ring's plan applies as is.
    sinks: None or the (H/u,) sink logits of this rank's head group (ulysses.head_shard)."""
    pattern = ring.ring_pattern(ring_grad_dtype, mask)

    def ring_over_shards(qh, kh, vh):  # (B, n/r, H/u, D), (B, n/r, Hkv'/u, D)
        return BlockwiseAttention.apply(qh, kh, vh, pattern, ring_group, causal, layout,
                                        scale, kernel, sinks)

    return ulysses_attention(q, k, v, ulysses_group, layout, ring_over_shards, return_lse)
