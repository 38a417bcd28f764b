"""Activation offload: what checkpointing keeps per layer waits in host memory for its backward.

Under activation checkpointing a layer keeps little, but it keeps it from its forward to its
backward: the block input x (B, T/cp, d) for ``full`` / ``every_n_layers`` (what
torch.utils.checkpoint stores to replay the block), and for ``selective`` x plus what the
CP attention saves, q (B, T/cp, nh/tp, hd), k, v (B, T/cp, nkv/tp, hd), out, lse
(B, nh/tp, T/cp) fp32, and the checkpointed pieces' inputs. Over L layers that is
L * B * T/cp * d * bytes or more; with offload it lives in host memory instead, and only
the layer being back-propagated (and the one prefetched behind it) is on the device.

The mechanism is torch's own (torch.autograd.graph.saved_tensors_hooks, as save_on_cpu):
``run_layer`` runs one layer under pack/unpack hooks. Pack sees every tensor autograd saves
outside the layer's inner checkpoints (whose own hooks replace what they save by
recomputation), including the inputs checkpoint stores for its replay; it copies each to
host memory and keeps only the host copy, so the device memory is freed as soon as the
forward drops the tensor (x: once the next layer has run). Unpack brings it back.

CUDA: host buffers are pinned; device-to-host copies run on a side stream after an event
of the compute stream (``record_stream`` keeps the allocator from reusing the device block
before the copy has read it), so they overlap the next layers' compute. When a layer's
backward first unpacks a tensor, the whole layer and the layer before it are brought back
on another side stream (host-to-device after that tensor's device-to-host event); the
compute stream waits for a tensor's event only when it unpacks it. No host synchronisation.
CPU (tests, gloo): the same code with a separate CPU tensor as the "host" copy and plain
copies, so it is tested bit for bit.

Left on the device (``held_elsewhere``, ``not_worth_moving``): parameters and other leaves that require grad (their owner
holds them anyway: a Parameter, or the input a pipeline stage received and keeps for its
backward), tensors registered with ``keep`` (RoPE's cos/sin, shared by every layer),
integer tensors (positions, document boundaries), tensors under ``min_bytes`` (a copy
costs more than it frees) and overlapping views (an expanded tensor would grow). A tensor
saved twice in one layer (x by both of selective's checkpoints) is copied once.

Counters (bytes, live): ``host_bytes`` in host copies; ``device_bytes`` of restored copies
the offloader holds (prefetched and not yet handed to autograd, which then frees each with
the backward node that uses it); ``peak_device_bytes``, ``peak_host_bytes`` since
``reset_peaks``; ``kept_bytes`` of the storages of saved tensors left on the device by the
keep/dtype/size rules since ``reset_peaks`` (each storage once). ``stats()`` returns them.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

MIN_BYTES = 64 * 1024  # below this a copy's fixed cost outweighs the memory it frees


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some order of its dims is contiguous (so an empty_strided
    copy with the same strides has exactly its numel elements)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class _Layer:
    """One layer's forward: its offloaded tensors and the layer whose output was its input."""

    __slots__ = ("saved", "prev", "seen", "fetched", "__weakref__")

    def __init__(self, prev: Optional["_Layer"]):
        self.saved: List[weakref.ref] = []  # _Saved, weakly: autograd's graph owns them
        self.prev = prev
        self.seen: Dict[tuple, tuple] = {}  # during the forward: key -> (storage ref, packed)
        self.fetched = False


class _Saved:
    """One saved tensor in host memory; on the device again from fetch() to its last unpack."""

    def __init__(self, off: "ActivationOffload", t: torch.Tensor, layer: _Layer):
        self.off, self.layer = off, layer
        self.device, self.dtype = t.device, t.dtype
        self.shape, self.stride = t.shape, t.stride()
        self.nbytes = t.numel() * t.element_size()
        self.packs, self.unpacks = 1, 0  # saved variables holding it; unpacks so far
        self.dev: Optional[torch.Tensor] = None  # the restored device copy
        self.d2h_done = self.h2d_done = None  # CUDA events
        pinned = t.is_cuda  # pin only where there is a device to copy to asynchronously
        self.host = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                        device="cpu", pin_memory=pinned)
        with torch.no_grad():
            if t.is_cuda:
                stream = off._stream("d2h", t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
                with torch.cuda.stream(stream):
                    self.host.copy_(t.detach(), non_blocking=True)
                    self.d2h_done = torch.cuda.Event()
                    self.d2h_done.record(stream)
                t.record_stream(stream)  # freed by the forward, reused only after the copy
            else:
                self.host.copy_(t.detach())
        off._count(host=self.nbytes)

    def fetch(self) -> None:
        """Start bringing the tensor back (CUDA: asynchronously on the h2d stream)."""
        if self.dev is not None:
            return
        if self.device.type == "cuda":
            stream = self.off._stream("h2d", self.device)
            with torch.cuda.stream(stream):
                stream.wait_event(self.d2h_done)  # the host copy is complete
                self.dev = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                               device=self.device)
                self.dev.copy_(self.host, non_blocking=True)
                self.h2d_done = torch.cuda.Event()
                self.h2d_done.record(stream)
        else:
            self.dev = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                           device=self.device)
            self.dev.copy_(self.host)
        self.off._count(device=self.nbytes)

    def unpack(self) -> torch.Tensor:
        layer = self.layer
        if not layer.fetched:  # this layer's backward starts: bring it and the previous back
            layer.fetched = True
            for other in (layer, layer.prev):
                for ref in (other.saved if other is not None else ()):
                    saved = ref()
                    if saved is not None:
                        saved.fetch()
        self.fetch()  # fetched earlier and released, unpacked again (e.g. retain_graph)
        t = self.dev
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.h2d_done)
            t.record_stream(current)  # allocated on the h2d stream, used on this one
        self.unpacks += 1
        if self.unpacks >= self.packs:  # autograd holds it now and frees it after use
            self.dev = None
            self.off._count(device=-self.nbytes)
        return t

    def __del__(self):
        self.off._count(host=-self.nbytes, device=-self.nbytes if self.dev is not None else 0)


class ActivationOffload:
    """Saved-tensor hooks that keep layers' saved tensors in host memory (module docstring).

        off = ActivationOffload()
        off.keep(cos, sin)                                       # shared by every layer
        x = run_layer(off, checkpoint, block, x, cos, sin, use_reentrant=False)
        print(off.stats())   # device_bytes, host_bytes, peaks, kept_bytes
    """

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.device_bytes = self.host_bytes = 0
        self.peak_device_bytes = self.peak_host_bytes = self.kept_bytes = 0
        self._layer: Optional[_Layer] = None  # the layer whose forward is running
        self._made_by = WeakIdKeyDictionary()  # layer output -> its _Layer
        self._kept = WeakIdKeyDictionary()  # tensors registered with keep()
        self._kept_storages: Dict[int, weakref.ref] = {}  # counted in kept_bytes
        self._streams: Dict[Any, Any] = {}  # (kind, device) -> CUDA side stream

    def keep(self, *tensors: torch.Tensor) -> None:
        """Leave these on the device when saved (e.g. cos/sin every layer shares)."""
        for t in tensors:
            self._kept[t] = True

    def run(self, fn: Callable, *args, to_host: bool = True, **kwargs):
        """fn(*args, **kwargs) as one layer: what it saves for backward goes to host memory
        (to_host=False: stays on the device, the layer only links its neighbours, so the
        layer before it is prefetched by the layer after it). The layer's input is the
        first tensor in args; its output (a tensor, or a tuple starting with one) is the
        next layer's input."""
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        prev = self._made_by.get(x) if x is not None else None
        if prev is not None and not prev.saved:  # an on-device layer: link past it
            prev = prev.prev
        if prev is None:  # a chain of layers starts (a forward): forget freed storages
            self._kept_storages = {k: r for k, r in self._kept_storages.items()
                                   if r() is not None}
        layer = _Layer(prev)
        if to_host:
            outer, self._layer = self._layer, layer
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    y = fn(*args, **kwargs)
            finally:
                self._layer = outer
                layer.seen.clear()
        else:
            y = fn(*args, **kwargs)
        out = y[0] if isinstance(y, tuple) else y
        if isinstance(out, torch.Tensor):
            self._made_by[out] = layer
        return y

    @staticmethod
    def held_elsewhere(t: torch.Tensor) -> bool:
        """A parameter (or a view of one) or another leaf that requires grad: its owner keeps
        it on the device anyway, so a copy would free nothing."""
        return (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                or (t.is_leaf and t.requires_grad))

    def not_worth_moving(self, t: torch.Tensor) -> bool:
        """Registered with keep(), integer, under min_bytes, or an overlapping view."""
        return (t in self._kept or not t.is_floating_point()
                or t.numel() * t.element_size() < self.min_bytes or not _dense(t))

    def _pack(self, t: torch.Tensor):
        layer = self._layer
        # Keyed by the storage object (alive while any tensor on it is), not its data
        # pointer: no pointer reuse to guard against, and fake tensors have none.
        storage = t.untyped_storage()
        key = (id(storage), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
               t._version)
        hit = layer.seen.get(key)
        if hit is not None and hit[0]() is storage:  # the same view of the same memory
            if isinstance(hit[1], _Saved):
                hit[1].packs += 1
            return hit[1]
        if self.held_elsewhere(t):
            packed = t
        elif self.not_worth_moving(t):
            counted = self._kept_storages.get(id(storage))
            if counted is None or counted() is not storage:  # a storage not counted yet
                self._kept_storages[id(storage)] = weakref.ref(storage)
                self.kept_bytes += storage.nbytes()
            packed = t
        else:
            packed = _Saved(self, t, layer)
            layer.saved.append(weakref.ref(packed))
        layer.seen[key] = (weakref.ref(storage), packed)
        return packed

    @staticmethod
    def _unpack(packed):
        return packed.unpack() if isinstance(packed, _Saved) else packed

    def _count(self, host: int = 0, device: int = 0) -> None:
        self.host_bytes += host
        self.device_bytes += device
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _stream(self, kind: str, device: torch.device):
        key = (kind, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def reset_peaks(self) -> None:
        self.peak_device_bytes, self.peak_host_bytes = self.device_bytes, self.host_bytes
        self.kept_bytes = 0
        self._kept_storages.clear()

    def stats(self) -> Dict[str, int]:
        return dict(device_bytes=self.device_bytes, host_bytes=self.host_bytes,
                    peak_device_bytes=self.peak_device_bytes,
                    peak_host_bytes=self.peak_host_bytes, kept_bytes=self.kept_bytes)


def run_layer(offload: Optional[ActivationOffload], fn: Callable, *args,
              to_host: bool = True, **kwargs):
    """fn(*args, **kwargs), as one offloaded layer when offload is given (ActivationOffload.run)."""
    if offload is None:
        return fn(*args, **kwargs)
    return offload.run(fn, *args, to_host=to_host, **kwargs)
