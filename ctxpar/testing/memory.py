"""Bytes of activations autograd saves for backward, counted once per storage.

    with saved_tensor_bytes(model.parameters()) as seen:
        loss = model(tokens, positions, labels)
    total = sum(seen.values())

Inside a checkpointed region torch's own hooks replace saved tensors by recompute handles,
so only what a mode really keeps is counted, including the inputs checkpoint stores for
the replay. The numbers depend only on shapes: exact, the same on every run and machine.

LiveBytes counts the other kind of memory: the storages ops make while Python holds them, and
their peak (what a CUDA allocator would report as allocated, without its caching).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@contextmanager
def saved_tensor_bytes(params: Iterable[torch.Tensor]):
    """Yields a dict {storage pointer: bytes} filled with what autograd saves meanwhile."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: Dict[int, int] = {}
    held = []  # every packed tensor until the end: no pointer is reused while counting

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        # A node autograd frees before the forward ends (a branch the loss does not read)
        # frees what it saved; without `held` a later storage could take its address and
        # be taken for it.
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
    held.clear()


def forward_saved_bytes(model: torch.nn.Module, vocab_size: int, batch: int, seq_len: int,
                        seed: int = 0) -> int:
    """Saved bytes of one forward + loss of a one-process language model called as
    ``model(tokens, positions, labels) -> loss`` on random tokens; then runs backward
    (the graph is complete and usable, and that frees the saved tensors)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(seq_len)
    with saved_tensor_bytes(model.parameters()) as seen:
        loss = model(tokens, positions, labels)
    total = sum(seen.values())
    loss.backward()
    return total


class LiveBytes(TorchDispatchMode):
    """Bytes of storages made by ops under this mode that Python still holds; and their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, out=, in-place) allocated nothing.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in inputs:
                    self.live.add(key)
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key, nbytes):
        self.live.discard(key)
        self.now -= nbytes


def allocator_peaks(step) -> Dict[Optional[str], int]:
    """(peak bytes above the start, per marked region) of the CPU allocator while `step`
    runs: the profiler's allocation events carry the allocator's running total. step
    takes `region` (torch.profiler.record_function) to mark its parts, ``with
    region("FWD"): ...``; regions FWD, BWD and STEP are reported, the rest under None."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(record_function)
    events = []

    def walk(node, region):
        if node.tag == _EventType.Allocation:
            a = node.typed[1]
            if a.device.type == "cpu":
                events.append((node.start_time_ns, a.total_allocated, a.alloc_size, region))
        for c in node.children:
            walk(c, node.name if node.name in ("FWD", "BWD", "STEP") else region)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    events.sort()
    base = events[0][1] - events[0][2]
    peaks = {}
    for _, total, _, region in events:
        peaks[region] = max(peaks.get(region, 0), total - base)
    return peaks
