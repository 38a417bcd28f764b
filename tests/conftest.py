import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_configure(config):
    """Spawned ranks fork from a server that has already imported and probed what nearly
    every rank would (DeepSpeed, torch's compiler modules, the model: helpers/rank_preload.py),
    once for the session instead of once per rank."""
    from ctxpar.testing.distributed import preload
    preload("helpers.rank_preload")


def pytest_itemcollected(item):
    """The first test module that spawns ranks starts the forkserver: its preload runs on
    the other core while pytest collects the rest (a run of modules that spawn none never
    starts it)."""
    if getattr(getattr(item, "module", None), "run_distributed", None) is not None:
        from ctxpar.testing.distributed import start_forkserver
        start_forkserver()


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
