"""--max-seq-len's last word: what bounds the longest context, and by how much.

At the ceiling n the next length (one more chunk unit) does not fit: the GPU's peak
passes MEMORY_MARGIN of its memory, or the node's offloaded bytes pass HOST_MARGIN of its
host memory (search.fits). The line says which, how full each is at n, how fast the
binding one grows per token (from n/2 to n: the peak is affine in seq_len but for a few
saturating terms, longest.py; per term for the GPU, taken in the phase that peaks at n),
and, for a target length, what that growth would need there:

    bound by: GPU memory, 72.0 of 72.0 GB at the backward (first block, attention),
    +15.2 KB a token (layer working set 7.1, recompute 5.0, activations 2.0); 8,000,000
    tokens: ~125.0 GB a GPU; host 1314 of 1600 GB a node

A term that grows faster than the others is what to attack (docs/memory.md's options, more
GPUs); the target's figure is the affine extrapolation, a what-if, not a plan.
"""
from __future__ import annotations

from typing import Optional

from .cluster import Cluster
from .longest import Bisection
from .search import HOST_MARGIN, MEMORY_MARGIN, fits

GB, KB = 1e9, 1e3


def _growth(at, half, tokens: int):
    """Bytes a token of each of the peak phase's terms (at's), largest first."""
    before = dict(next(p for p in half.phases if p.name == at.peak_phase).terms) \
        if any(p.name == at.peak_phase for p in half.phases) else {}
    rates = {k: (v - before.get(k, 0.0)) / tokens for k, v in at.as_dict().items()}
    return sorted(((k, r) for k, r in rates.items() if r > 0), key=lambda kv: -kv[1])


def bound_by(cfg, cand, cluster: Cluster, n: int, target: Optional[int] = None) -> str:
    """One line: what stops layout `cand` at n tokens, its longest (module docstring)."""
    b = Bisection(cfg, cand, cluster)
    k = n // b.u
    at, half, nxt = b.mem(k), b.mem(max(1, k // 2)), b.mem(k + 1)
    assert fits(at, cluster) and not fits(nxt, cluster), "n is not the layout's longest"
    dev_cap, host_cap = MEMORY_MARGIN * cluster.gpu.memory, HOST_MARGIN * cluster.gpu.host_memory
    per_node = cluster.gpus_per_node
    host_at, host_next = at.host_total * per_node, nxt.host_total * per_node
    tokens = (k - max(1, k // 2)) * b.u
    gpu = f"{at.peak / GB:.1f} of {dev_cap / GB:.1f} GB"
    host = f"{host_at / GB:.0f} of {host_cap / GB:.0f} GB a node"
    if nxt.peak > dev_cap:  # the GPU binds (the host may too: said after)
        rate = (at.peak - half.peak) / tokens
        terms = ", ".join(f"{name} {r / KB:.1f}" for name, r in _growth(at, half, tokens)[:3])
        line = (f"bound by: GPU memory, {gpu} at the {at.peak_phase}, +{rate / KB:.1f} KB a "
                f"token ({terms})")
        need = at.peak + rate * (target - n) if target else None
        unit, other = "a GPU", f"host {host}" + (" (full too)" if host_next > host_cap else "")
    else:
        rate = (host_at - half.host_total * per_node) / tokens
        terms = ", ".join(f"{name} {v / GB:.1f} GB" for name, v in
                          sorted(at.host.items(), key=lambda kv: -kv[1])[:2])
        line = (f"bound by: host memory, {host} (a GPU's: {terms}), +{rate / KB:.1f} KB a "
                f"token a node")
        need = host_at + rate * (target - n) if target else None
        unit, other = "a node", f"GPU {gpu}"
    if target and target > n:
        line += f"; {target:,} tokens: ~{need / GB:.1f} GB {unit}"
    return f"{line}; {other}"
