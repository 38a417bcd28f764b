"""One parameter's description (ParamSpec: GPT name, full shape, TP split) and a linear
layer's, below ctxpar/config/parameters.py (which describes the whole model from them) so
that a mixer's own description (compressed_layers.py) can use them without a circle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class ParamSpec:
    name: str                # GPT's parameter name (ctxpar/checkpoint/names.py)
    shape: Tuple[int, ...]   # the full tensor's
    split: Optional[str]     # 'column', 'row', 'heads' or None (parameters.py's docstring)

    def local_shape(self, tp: int, ep: int = 1) -> Tuple[int, ...]:
        """The shape one of tp ranks (and of ep expert-parallel ranks) holds."""
        if self.split == "experts_column":  # (E, rows, d): experts over EP, rows over TP
            return (self.shape[0] // ep, self.shape[1] // tp, self.shape[2])
        if self.split == "experts_row":     # (E, d, f)
            return (self.shape[0] // ep, self.shape[1], self.shape[2] // tp)
        if self.split == "experts_bias":    # (E, rows): rows over TP; (E, d): whole
            return (self.shape[0] // ep, self.shape[1] // (tp if self.name.endswith(
                "gate_up_proj_bias") else 1))
        if self.split == "column":
            return (self.shape[0] // tp, *self.shape[1:])
        if self.split == "row" and len(self.shape) == 2:
            return (self.shape[0], self.shape[1] // tp)
        return self.shape  # replicated: norms, row-parallel biases, kv heads < tp

    def numel(self, tp: int = 1, ep: int = 1) -> int:
        return math.prod(self.local_shape(tp, ep))


def linear_specs(name: str, d_in: int, d_out: int, split: str, bias: bool) -> List[ParamSpec]:
    specs = [ParamSpec(f"{name}.weight", (d_out, d_in), split)]
    if bias:  # a row-parallel layer's bias is added once, after the all-reduce: replicated
        specs.append(ParamSpec(f"{name}.bias", (d_out,), None if split == "row" else split))
    return specs


