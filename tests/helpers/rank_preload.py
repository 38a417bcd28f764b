"""What the suite's spawned ranks would each import or probe, done once in run_distributed's
forkserver (conftest.py preloads this module), then frozen out of the ranks' collections.

- DeepSpeed, pytest, ctxpar and the GPT: imported by nearly every rank; train.py (as the
  module ``train``): the ranks helpers/warm_launch.py forks run its main().
- torch._dynamo and torch._inductor.compile_fx: a rank's first torch optimizer imports the
  first (torch.optim's ``_disable_dynamo`` wrapper), and deepspeed.initialize's optimizer
  check imports DeepSpeed's Muon module, whose ``torch.compile`` at import loads the second.
  Both are the bulk of a DeepSpeed engine's start on CPU.
- ``deepspeed.ops.__compatible_ops__``: DeepSpeed's probe of which ops this machine could
  build (async_io runs the compiler), read by ctxpar's init_deepspeed_comm in every rank.
- ``gc.freeze()``: all of the above moves to the permanent generation, so a rank's
  collections (DeepSpeed's own, the memory tests' ``gc.collect``) walk only what the rank
  made; Python's gc documentation advises it for servers that fork.

DeepSpeed picks its accelerator here, from DS_ACCELERATOR (conftest.py sets cpu): the suite
spawns CPU ranks only. A piece a newer release moved is skipped, not fatal: multiprocessing
drops a preload that raises ImportError as a whole, silently, and the rest still pays off
(tests/test_harness.py checks that ranks start with the essentials).
"""
import gc
import importlib

import deepspeed  # noqa: F401
import deepspeed.ops
import pytest  # noqa: F401

import ctxpar  # noqa: F401
import models.gpt  # noqa: F401

for name in ("torch._dynamo", "torch._inductor.compile_fx",
             "deepspeed.runtime.zero.muon.muon_optimizer", "models.gpt_pipe",
             "train"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
deepspeed.ops.__compatible_ops__  # noqa: B018 - the probe runs on first access: here, once
gc.freeze()
