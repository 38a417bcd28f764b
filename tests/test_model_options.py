"""ModelOptions.from_config: the one reading of a run config into a model's settings
(GPT.from_config and GPTPipe.from_config both use it)."""
import inspect

import torch

from ctxpar.config import config_from_dict
from models.gpt import GPT
from models.options import ModelOptions


def _cfg(**sets):
    data = {"model": {"vocab_size": 256, "seq_len": 128, "n_layers": 2, "d_model": 64,
                      "n_heads": 4},
            "parallel": {"tp": 1, "cp": 1, "dp": 1},
            "train": {"global_batch_size": 8, "micro_batch_size": 8}}
    return config_from_dict(data, overrides=[f"{k}={v}" for k, v in sets.items()])


def test_options_read_every_section_they_name():
    cfg = _cfg(**{"parallel.layout": "zigzag", "parallel.ring_grad_dtype": "bf16",
                  "activation_checkpointing.mode": "full",
                  "activation_checkpointing.every_n_layers": 2, "train.seed": 7})
    opts = ModelOptions.from_config(cfg)
    assert (opts.layout, opts.ring_grad_dtype, opts.activation_checkpointing,
            opts.every_n_layers, opts.seed) == ("zigzag", "bf16", "full", 2, 7)
    assert opts.memory is cfg.memory
    assert opts.kwargs()["cp_comm"] == cfg.parallel.cp_comm


def test_defaults_are_the_constructors():
    params = inspect.signature(GPT.__init__).parameters
    for name, value in ModelOptions().kwargs().items():
        if name != "memory":
            assert params[name].default == value, name


def test_from_config_builds_the_model_the_options_describe():
    class NoGroups:  # one process: every group None
        tp_group = cp_group = ulysses_group = ring_group = None
    cfg = _cfg(**{"activation_checkpointing.mode": "full",
                  "activation_checkpointing.every_n_layers": 2})
    gpt = GPT.from_config(cfg, NoGroups(), device=torch.device("meta"))
    assert (gpt.activation_checkpointing, gpt.every_n_layers, gpt.memory) == \
        ("full", 2, cfg.memory)
