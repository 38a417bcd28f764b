"""ctxpar: ring-attention context parallelism composed with TP, PP and DP on DeepSpeed.

The public API only; see README.md and docs/parallelism.md.
"""
from .parallel_state import (
    ParallelState,
    destroy_parallel_state,
    get_parallel_state,
    init_distributed,
    init_parallel_state,
    rank_grid,
)
from .mpu import DeepSpeedMPU
from .data import (DataError, PasskeyTask, SampleStream, build_data, build_sample_stream,
                   passkey_accuracy, evaluate, shard_batch)
from .ring_attention import RingStats, ring_attention, ring_stats
from .sharding import gather_sequence, sequence_positions, shard_sequence
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_state_dict,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"
