"""DeepSpeed's pipeline engine on ctxpar's grid: the topology from the order string.

DeepSpeed's pipeline engine takes its groups from a ``ProcessTopology`` with the named
axes 'pipe', 'data' and 'model' (deepspeed/runtime/pipe/topology.py): row-major, the
**last axis innermost**, the reverse of ctxpar's order string (first name innermost).
ctxpar's grid stays the one source of truth; the topology is derived from the order:

    order tp-cp-dp-pp  ->  axes ['pipe', 'data', 'model'], dims [pp, dp*cp, tp]
                           data coordinate = dp_rank * cp + cp_rank (dp outer, cp inner)

so every global rank has the same place in both, DeepSpeed's 'model' groups are ctxpar's
TP groups, its 'pipe' groups ctxpar's PP groups and its 'data' groups ctxpar's dp x cp
groups (what gradients must be reduced over). DeepSpeed has a single 'data' axis, so dp
and cp must be adjacent in the order (axes of size 1 in between do not count); any other
order raises ``ValueError`` (config validation reports it before any process starts).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from .parallel_state import parse_order

DS_AXIS = {"pp": "pipe", "tp": "model"}  # dp and cp become DeepSpeed's one 'data' axis


def pipeline_axes(order: str, sizes: Dict[str, int]) -> Tuple[List[str], List[int]]:
    """DeepSpeed topology axes and dims (outermost first) that reproduce ctxpar's grid.

    sizes: the degrees {'tp', 'cp', 'pp', 'dp'}. Pure; raises ValueError when dp and cp
    are separated by an axis of size > 1.
    """
    outer_first = list(reversed(parse_order(order)))
    kept = [n for n in outer_first if sizes[n] > 1]  # size-1 axes can sit anywhere
    if "dp" in kept and "cp" in kept and abs(kept.index("dp") - kept.index("cp")) != 1:
        raise ValueError(
            f"parallel.order={order!r} puts {kept[min(kept.index('dp'), kept.index('cp')) + 1]} "
            f"between dp and cp: DeepSpeed's pipeline reduces gradients over one 'data' axis "
            f"(dp x cp), so dp and cp must be adjacent, e.g. 'tp-cp-dp-pp'")
    # 'data' goes where the outer of dp and cp of size > 1 is; the other is folded into it
    anchor = next((n for n in kept if n in ("dp", "cp")), "dp")
    axes, dims = [], []
    for name in outer_first:
        if name in ("dp", "cp"):
            if name == anchor:
                axes.append("data")
                dims.append(sizes["dp"] * sizes["cp"])
            continue
        axes.append(DS_AXIS[name])
        dims.append(sizes[name])
    return axes, dims


def pipeline_topology(order: str, sizes: Dict[str, int]):
    """The deepspeed ProcessTopology equal to ctxpar's grid for this order (pure)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology

    axes, dims = pipeline_axes(order, sizes)
    return ProcessTopology(axes=axes, dims=dims)
