import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_configure(config):
    """Spawned ranks fork from a server that has imported what nearly every rank imports
    (ctxpar/testing/distributed.py): DeepSpeed, which every rank of an engine test would
    import anew, pytest and the model, once for the session. DeepSpeed picks its
    accelerator there, from DS_ACCELERATOR above: the suite spawns CPU ranks only."""
    from ctxpar.testing.distributed import preload
    preload("deepspeed", "pytest", "ctxpar", "models.gpt")


@pytest.fixture(scope="session")
def single(tmp_path_factory):
    """train.py on one process, 20 steps: the reference test_train.py and
    test_train_memory.py compare every layout's losses with (run once per session)."""
    from helpers.train_run import single_run
    return single_run(str(tmp_path_factory.mktemp("single") / "single"))


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
