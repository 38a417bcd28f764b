"""ctxpar.testing.run_distributed, the one harness every multi-rank test and benchmark uses:
results in rank order, a failing rank's traceback as the failure, a hang as a timeout that
names the ranks, and functions from ``__main__`` (benchmarks run with -m) spawned."""
import sys
import time

import pytest
import torch.distributed as dist

from ctxpar.testing import run_distributed
from ctxpar.testing.distributed import _context


def _rank_and_sum(rank, world, offset):
    t = __import__("torch").tensor([rank + offset])
    dist.all_reduce(t)
    return rank, world, int(t)


def _rank_one_raises(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _rank_one_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def _modules_at_start(rank, world, names):
    return [n for n in names if n in sys.modules]


def test_ranks_start_with_the_suites_preloaded_modules():
    # conftest.py's preload: imported once in the forkserver, not again in every rank. This
    # module imports none of these, so a rank has them only from the server; a preload
    # that fails to import is skipped silently by multiprocessing.
    names = ["deepspeed", "models.gpt", "torch._dynamo"]
    assert run_distributed(_modules_at_start, 1, names) == [names]


@pytest.mark.quick
def test_results_come_back_in_rank_order_after_a_collective():
    assert run_distributed(_rank_and_sum, 3, 10) == [(0, 3, 33), (1, 3, 33), (2, 3, 33)]


def test_a_failing_rank_fails_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)_rank_one_raises failed on rank 1 of 2:.*"
                                             r"ValueError: rank one says no"):
        run_distributed(_rank_one_raises, 2)


def test_a_hang_fails_with_the_ranks_that_never_finished():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 3s; ranks \[0, 1\] never"):
        run_distributed(_rank_one_hangs, 2, timeout=3)
    assert time.monotonic() - t0 < 30  # killed, not waited for


def test_functions_from_main_are_spawned_others_forked_from_the_server():
    def from_main():
        pass
    from_main.__module__ = "__main__"
    assert _context(from_main).get_start_method() == "spawn"
    assert _context(_rank_and_sum).get_start_method() == "forkserver"
