"""How many (N, f) tensors a dense MLP keeps at each point of its step, by model.mlp.

N tokens on the rank, f = ffn/tp. Read from models/mlp.py, ctxpar/memory/tiled_mlp.py and
the autograd formulas of the ops they call; held to autograd's saved tensors and the
allocator's live bytes (tests/test_plan.py, one case per kind):

kind      saved  forward  backward
gated       4       4        2      gate, up, act(gate) (SwiGLU: silu, GeGLU: tanh-GELU) and
                                    the product are saved; without autograd gated_product's
                                    arguments gate and up live until it returns, beside
                                    act(gate) and the product; backward: the product's two
                                    inputs' gradients (the product's own replaces the
                                    product, which down's backward frees)
gelu        2       2        1      up (the GELU's input) and gelu(up) (down's input) saved;
                                    backward: the GELU's input gradient
relu2       2       3        3      relu(up) (relu keeps its output, the square its input:
                                    one tensor) and its square saved; without autograd up,
                                    up_activation's argument, lives beside both; backward:
                                    the square's (torch's pow_backward, grad * (2 * x.pow(1)),
                                    holds x.pow(1), twice it and the product at once)

saved is what the MLP keeps in mode 'none'; forward the largest point of a forward without
autograd (a checkpointed block, evaluation, a tiled MLP's tile); backward what its
backward holds beyond the saved ones. model.swiglu_limit's clamps save two more
(moe_layers.clamp_saved) and hold none more.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from ..config import GATED_MLPS, ModelConfig


class Widths(NamedTuple):
    saved: int     # (N, f) tensors autograd keeps (mode 'none')
    forward: int   # alive at once in a forward without autograd
    backward: int  # alive in its backward beyond the saved ones


GATED = Widths(saved=4, forward=4, backward=2)
UNGATED = {"gelu": Widths(saved=2, forward=2, backward=1),
           "relu2": Widths(saved=2, forward=3, backward=3)}


def mlp_widths(kind: str) -> Widths:
    """The (N, f) counts of model.mlp `kind` (the module docstring's table)."""
    return GATED if kind in GATED_MLPS else UNGATED[kind]


def saved_width(m: Optional[ModelConfig]) -> int:
    """(N, f) tensors a dense MLP of m saves (m None: the default, gated)."""
    return mlp_widths(m.mlp if m is not None else GATED_MLPS[0]).saved
