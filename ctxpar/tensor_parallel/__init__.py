"""Megatron-style tensor parallelism: f/g ops, parallel layers, vocab-parallel loss
and argmax."""
from .argmax import vocab_parallel_argmax
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear,
    ReplicatedHeadLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
    set_tensor_model_parallel_attributes,
)
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    select_replicated_rows,
)
from .utils import (
    full_shape,
    gather_full_state_dict,
    is_tensor_parallel,
    load_full_state_dict_,
    shard_full_tensor,
)
