"""The benchmarks' launcher: run a function on P local processes joined in one process group.

    per_rank = spawn_ranks(fn, world, "cpu", threads, *args, timeout=3600)
    save_results(a.json, a, rows)    # rows plus date, torch, machine and the arguments

``fn(rank, world, device, *args)`` runs on every rank after ``init_process_group`` (gloo
with `threads` intra-op threads per process on CPU; NCCL on cuda:rank) and returns a
picklable result; the list is in rank order. A failing rank raises RuntimeError here with
its error. fn must be importable by a spawned process (module level).
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import traceback
from datetime import date

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(fn, rank, world, device_type, threads, store_path, args, results):
    try:
        if device_type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(threads)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        try:
            results.put((rank, True, fn(rank, world, device, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, False, traceback.format_exc()))


def spawn_ranks(fn, world: int, device_type: str, threads: int, *args, timeout: float = 3600):
    """[fn's result on rank r for r in range(world)] (see the module docstring)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_child, args=(fn, r, world, device_type, threads,
                                                   os.path.join(tmp, "store"), args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        per_rank = {}
        for _ in range(world):
            rank, ok, out = results.get(timeout=timeout)
            if not ok:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {rank} of {world} failed:\n{out}")
            per_rank[rank] = out
        for p in procs:
            p.join()
    return [per_rank[r] for r in range(world)]


def save_results(path: str, args, rows, **meta) -> None:
    """Write {"meta": when, where, with what arguments; "rows": rows} as JSON to path."""
    meta = dict(date=str(date.today()), torch=torch.__version__, machine=platform.machine(),
                cpus=os.cpu_count(), args=vars(args), **meta)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {path}")
