"""The planner's saved activation bytes against what autograd saves, one process, fp32."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ctxpar.config import CHECKPOINT_MODES, ModelConfig
from ctxpar.plan import counts
from ctxpar.plan.candidate import Candidate
from ctxpar.testing.memory import saved_tensor_bytes
from models.gpt import GPT
from models.options import ModelOptions


def assert_planner_saves_what_autograd_saves(m: ModelConfig, modes=CHECKPOINT_MODES,
                                             msg=None, beside=None) -> None:
    """A forward of two 32-token rows of m (vocab >= 64) under each checkpointing mode
    (every_n_layers: 2) saves exactly counts.activation_bytes' bytes; beside: a context
    manager yielding a list that collects the bytes kept for backward outside autograd's
    saved tensors (a core's held selection) during the forward."""
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    for mode in modes:
        model = GPT(m, options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                            seed=1))
        with saved_tensor_bytes(model.parameters()) as seen, \
                (beside or _nothing)() as held:
            loss = model(tokens, torch.arange(32), tokens)  # its graph holds what is kept
        cand = Candidate(1, 1, 1, 1, "ring", 1, "zigzag", activation=mode, every_n_layers=2,
                         micro_batch=2)
        assert sum(seen.values()) + sum(held) == counts.activation_bytes(m, cand, 4), \
            (mode, msg)
        del loss


@contextmanager
def _nothing():
    yield []
