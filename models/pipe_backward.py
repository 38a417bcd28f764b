"""One backward per pipeline stage, however many floating tensors the stage hands on.

DeepSpeed's pipeline engine (0.19.8, PipelineEngine._exec_backward_pass) runs a stage's
backward as ``out.backward(grad, retain_graph=True)`` on each floating output in turn,
the last without retain_graph. When a stage hands on more than x (Gemma 4's shared K/V
and per-layer inputs, the MoE routers' statistics, DSA's indexer sums:
models/pipe_carry.py), each pass walks the stage's graph below its output: with the
routers' statistics, which depend on every block, the stage's whole backward twice (a
pass that brings no gradient to a node still runs it, on zeros), its CP traffic too.

``one_backward`` cuts every floating output but the last from the graph (a leaf that
keeps the gradient its pass brings) and hangs them all on the last one: the engine's
passes before the last stop at those leaves, the last runs the stage's graph once with
every gradient. A pass that finds a gradient missing (an engine that ran the outputs in
another order, or together) raises rather than drop it.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class _Release(torch.autograd.Function):
    """Identity on the last output; its backward hands on the earlier outputs' kept
    gradients with its own."""

    @staticmethod
    def forward(ctx, kept: List[Optional[torch.Tensor]], last, *earlier):
        ctx.kept = kept
        return last.view_as(last)

    @staticmethod
    def backward(ctx, grad):
        kept, ctx.kept = ctx.kept, None
        if kept is None or any(g is None for g in kept):
            raise RuntimeError(
                "models/pipe_backward.py: a pipeline stage's last output came back before "
                "the earlier ones' gradients (DeepSpeed's engine is expected to run "
                "out.backward on each floating output in turn, the last one last)")
        return (None, grad, *kept)


def one_backward(outputs):
    """The stage's outputs with its floating tensors that take a gradient joined into one
    backward when there are two or more (else as they are)."""
    if not isinstance(outputs, tuple) or not torch.is_grad_enabled():
        return outputs
    at = [i for i, t in enumerate(outputs)
          if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]
    if len(at) < 2:
        return outputs
    kept: List[Optional[torch.Tensor]] = [None] * (len(at) - 1)
    out = list(outputs)
    for k, i in enumerate(at[:-1]):
        out[i] = outputs[i].detach().requires_grad_()

        def keep(g, k=k):
            kept[k] = g
        out[i].register_hook(keep)
    out[at[-1]] = _Release.apply(kept, outputs[at[-1]], *(outputs[i] for i in at[:-1]))
    return tuple(out)
