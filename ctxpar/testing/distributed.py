"""Run a function on N local ranks in one process group; a hang or a failing rank fails.

    results = run_distributed(fn, world_size, *args, timeout=120)
    per_rank = run_distributed(fn, world, torch.device("cuda"), a, device_type="cuda",
                               threads=4, timeout=3600)      # a benchmark on GPUs

``fn(rank, world_size, *args, **kwargs)`` must be a module-level function (it is pickled
into the children). Each child joins a process group (gloo with ``threads`` intra-op
threads on CPU; NCCL on cuda:rank) through a FileStore in a fresh temp dir (no port to
collide on), runs ``fn`` and sends back its return value (must pickle) or its traceback.
The parent waits at most ``timeout`` seconds in all: if a rank raises, every rank is killed
and the first failing rank's traceback is the AssertionError's message; if the ranks hang,
they are killed and the call fails with the ranks that never finished.

Children come from a forkserver that has imported torch once, so a rank starts in a
fraction of a second instead of re-importing torch (2 cores, up to 8 ranks); ``preload``
adds modules every rank would import (the test suite: DeepSpeed, pytest, the model). A
function defined in ``__main__`` (a benchmark run as a script or with ``python -m``) is
spawned instead: the forkserver cannot import a ``__main__`` started with ``-m``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List

_FORKSERVER = None
# torch.distributed.tensor: assert_close imports it (~2 s of CPU per rank otherwise).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor"]


def preload(*modules: str) -> None:
    """Import ``modules`` in the forkserver too, once, so that no rank imports them again
    (the test suite: tests/conftest.py, tests/helpers/rank_preload.py). Call it before
    the first ``run_distributed`` (or ``start_forkserver``): the server starts with the list
    it has then. A module that reads the environment at import keeps what it read there
    (DeepSpeed's accelerator: DS_ACCELERATOR), so preload only what every later device_type
    agrees with."""
    if _FORKSERVER is not None:
        raise RuntimeError(f"preload{modules}: the forkserver is already configured; "
                           "call preload before the first run_distributed")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def start_forkserver():
    """The forkserver ranks fork from, started now if it is not yet: its preload imports
    run in the background while the caller goes on (pytest: while it collects), instead of
    inside the first ``run_distributed``."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = mp.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(list(_PRELOAD))
        _ensure_running_on_our_path()
    return _FORKSERVER


def _context(fn):
    if getattr(fn, "__module__", None) == "__main__":
        return mp.get_context("spawn")
    return start_forkserver()


def _ensure_running_on_our_path():
    """Start the server on this process's sys.path. Python 3.11's forkserver imports its
    preload without the sys.path it is handed (only its ranks get that), so a module found
    through the parent's path alone (pytest's ``pythonpath``, a benchmark's folder) would be
    dropped silently; PYTHONPATH carries the path into the server's interpreter."""
    from multiprocessing import forkserver
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _report(results, rank, ok, payload):
    """Put one result and wait until it is in the pipe: a failing rank's traceback must be
    there before its peers, blocked in a collective with it, fail on the closed connection
    (the parent reports the first failure it reads)."""
    results.put((rank, ok, payload))
    results.close()
    results.join_thread()


def _child(fn, rank, world_size, store_path, device_type, threads, args, kwargs, results):
    os.environ.update(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR=device_type,
                      WANDB_MODE="disabled", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        if device_type == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args, **kwargs)
            # Leave together: a rank whose fn needs no collective would otherwise tear its
            # connections down while a slower peer is still in gloo's connectFullMesh, which
            # then fails with "Connection closed by peer". If another rank failed, this barrier
            # waits until the parent, which saw that failure, kills every rank.
            dist.barrier()
        except BaseException:  # noqa: BLE001 - the traceback is the caller's failure message
            _report(results, rank, False, traceback.format_exc())
            return
        finally:
            from ctxpar.distributed.parallel_state import destroy_parallel_state
            destroy_parallel_state()
            dist.destroy_process_group()
        # Plain pickle bytes: torch's multiprocessing reducers would pass tensors by
        # shared memory that dies with this process before the parent reads it.
        _report(results, rank, True, pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - setting up or leaving the group failed
        _report(results, rank, False, traceback.format_exc())


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 180.0,
                    device_type: str = "cpu", threads: int = 1, **kwargs) -> List[Any]:
    """fn(rank, world_size, *args, **kwargs) on world_size ranks; the results in rank order.

    device_type "cpu" joins gloo with ``threads`` intra-op threads per rank; "cuda" joins
    NCCL with rank r on cuda:r. Raises AssertionError with the failing rank's traceback,
    or naming the ranks that never finished within ``timeout`` seconds."""
    ctx = _context(fn)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ctxpar-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(fn, r, world_size, store_path, device_type, threads, args,
                                   kwargs, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outs, deadline = {}, time.monotonic() + timeout
        try:
            while len(outs) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(outs))
                    raise AssertionError(
                        f"{fn.__name__} on {world_size} ranks timed out after {timeout:.0f}s; "
                        f"ranks {missing} never finished (a hang in a collective?)")
                try:
                    rank, ok, out = results.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in outs and p.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(
                            f"{fn.__name__}: rank {dead[0]} died with exit code "
                            f"{procs[dead[0]].exitcode} and no traceback")
                    continue
                if not ok:
                    raise AssertionError(f"{fn.__name__} failed on rank {rank} of "
                                         f"{world_size}:\n{out}")
                outs[rank] = pickle.loads(out)
        finally:
            for p in procs:
                p.join(timeout=5 if len(outs) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outs[r] for r in range(world_size)]
