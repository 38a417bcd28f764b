"""Run a function on N local ranks over gloo; a hang or a failing rank fails the test.

    results = run_distributed(fn, world_size, *args, timeout=120)

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled into the
children). Each child joins a gloo process group through a FileStore in a fresh temp dir
(no port to collide on), runs ``fn`` and sends back its return value (must pickle) or its
traceback. The parent waits at most ``timeout`` seconds in all: if a rank raises, every
rank is killed and the first failing rank's traceback is the AssertionError's message; if
the ranks hang, they are killed and the test fails with the ranks that never finished.

Children come from a forkserver that has imported torch once, so a rank starts in a
fraction of a second instead of re-importing torch (2 cores, up to 8 ranks).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, List

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch.distributed.tensor: assert_close imports it (~2 s of CPU per rank otherwise).
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor"])
    return _CTX


def _child(fn, rank, world_size, store_path, args, kwargs, results):
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WANDB_MODE="disabled",
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args, **kwargs)
            # Leave together: a rank whose fn needs no collective would otherwise tear its
            # connections down while a slower peer is still in gloo's connectFullMesh, which
            # then fails with "Connection closed by peer". If another rank failed, this barrier
            # waits until the parent, which saw that failure, kills every rank.
            dist.barrier()
        finally:
            try:
                from ctxpar.distributed.parallel_state import destroy_parallel_state
                destroy_parallel_state()
            except ImportError:
                pass
            dist.destroy_process_group()
        # Plain pickle bytes: torch's multiprocessing reducers would pass tensors by
        # shared memory that dies with this process before the parent reads it.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - the traceback is the test's failure message
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 180.0,
                    **kwargs) -> List[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on world_size gloo ranks; per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ctxpar-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(fn, r, world_size, store_path, args, kwargs, results))
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
