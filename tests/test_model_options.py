"""ModelOptions.from_config: the one reading of a run config into a model's settings
(GPT.from_config and GPTPipe.from_config both use it)."""
import pytest
import torch

from ctxpar.config import config_from_dict
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions


def _cfg(**sets):
    data = {"model": {"vocab_size": 256, "seq_len": 128, "n_layers": 2, "d_model": 64,
                      "n_heads": 4},
            "parallel": {"tp": 1, "cp": 1, "dp": 1},
            "train": {"global_batch_size": 8, "micro_batch_size": 8}}
    return config_from_dict(data, overrides=[f"{k}={v}" for k, v in sets.items()])


@pytest.mark.quick
def test_options_read_every_section_they_name():
    cfg = _cfg(**{"parallel.layout": "zigzag", "parallel.ring_grad_dtype": "bf16",
                  "activation_checkpointing.mode": "full",
                  "activation_checkpointing.every_n_layers": 2, "train.seed": 7})
    opts = ModelOptions.from_config(cfg)
    assert (opts.layout, opts.ring_grad_dtype, opts.activation_checkpointing,
            opts.every_n_layers, opts.seed) == ("zigzag", "bf16", "full", 2, 7)
    assert opts.memory is cfg.memory
    assert opts.cp_comm == cfg.parallel.cp_comm


def test_no_options_are_the_defaults():
    gpt = GPT(_cfg().model, device=torch.device("meta"))
    want = ModelOptions()
    assert (gpt.activation_checkpointing, gpt.every_n_layers, gpt.cp.comm, gpt.cp.layout) == \
        (want.activation_checkpointing, want.every_n_layers, want.cp_comm, want.layout)


@pytest.mark.quick
def test_from_config_builds_the_model_the_options_describe():
    cfg = _cfg(**{"activation_checkpointing.mode": "full",
                  "activation_checkpointing.every_n_layers": 2})
    gpt = GPT.from_config(cfg, ModelGroups(), device=torch.device("meta"))
    assert (gpt.activation_checkpointing, gpt.every_n_layers, gpt.memory) == \
        ("full", 2, cfg.memory)
