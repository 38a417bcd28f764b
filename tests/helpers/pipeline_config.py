"""The config of a pipeline parity test's run: a model, a 2-stage grid, plain SGD steps."""
from __future__ import annotations


def pipeline_config(model: dict, parallel: dict, ckpt: str, batch: int, seed: int,
                    world: int):
    """config_from_dict of `model` (a ModelConfig as a dict) over pp=2 with `parallel`'s
    other sizes, uniform stages, micro-batches of 1 of a global `batch`, no clipping, the
    activation checkpointing mode `ckpt`; DeepSpeed told the test's optimizer is fine."""
    from ctxpar.config import config_from_dict
    return config_from_dict({
        "model": model, "parallel": dict(pp=2, pp_partition="uniform", **parallel),
        "train": dict(micro_batch_size=1, global_batch_size=batch, grad_clip=0.0, seed=seed),
        "data": dict(kind="tokens", path="unused"),
        "activation_checkpointing": dict(mode=ckpt),
        "deepspeed": {"zero_allow_untested_optimizer": True},
    }, world_size=world, check_paths=False)
