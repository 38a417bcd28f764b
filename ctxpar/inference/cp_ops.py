"""The context-parallel pieces inference uses, imported in this one place.

Public names come from ``ctxpar``; the internals (the layout's chunk count, the softmax
scale and the log-sum-exp merge of the ring) from their modules. When those move, this is
the file that changes.
"""
from ..attention_backends import default_scale
from ..comm import group_rank_and_size
from ..ring_attention import merge_block_
from ..sharding import check_layout, num_chunks, sequence_positions, shard_sequence

__all__ = ["check_layout", "default_scale", "group_rank_and_size", "merge_block_",
           "num_chunks", "sequence_positions", "shard_sequence"]
