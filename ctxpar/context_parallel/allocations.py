"""Count the tensors an attention call allocates, op by op: the "no copies" counter.

    with count_allocations() as allocs:
        out = context_parallel_attention(...)
    allocs.ops      # Counter: aten op name -> new tensors it returned, e.g. {"aten::clone": 2}
    allocs.bytes    # their total size

A TorchDispatchMode sees every aten call below autograd on this thread. A call counts when
it returns tensors of its own: not a view (slices, transposes, ``reshape`` of contiguous
memory) and not a mutation (in-place ``add_``/``lerp_``, ``out=`` forms, P2P receives into a
buffer). What it cannot see: memory a fused kernel allocates inside itself (workspaces);
on CUDA the caching allocator's own stats (``torch.cuda.memory_stats``) complement it.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.ops[func._schema.name] += 1
                    self.bytes += t.numel() * t.element_size()
        return out

    @property
    def count(self) -> int:
        return sum(self.ops.values())


@contextmanager
def count_allocations():
    """``with count_allocations() as a:`` a.ops / a.count / a.bytes of the block (this thread)."""
    counter = AllocationCounter()
    with counter:
        yield counter
