"""The context-parallel pieces inference uses, imported in this one place.

Public names come from ``ctxpar``; the internals (the layout's chunk count, the softmax
scale and the log-sum-exp merge) from their modules in ctxpar/context_parallel/. When
those move, this is the file that changes.
"""
from ..context_parallel.comm import group_rank_and_size
from ..context_parallel.kernels import default_scale
from ..context_parallel.layouts import (check_layout, num_chunks, sequence_positions,
                                        shard_sequence)
from ..context_parallel.mask import AttentionMask
from ..context_parallel.merge import merge_block_
from ..context_parallel.sinks import finish as finish_sinks

__all__ = ["AttentionMask", "check_layout", "default_scale", "finish_sinks",
           "group_rank_and_size", "merge_block_", "num_chunks", "sequence_positions",
           "shard_sequence"]
