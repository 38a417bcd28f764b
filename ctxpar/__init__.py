"""ctxpar: context parallelism (ring, all-gather, Ulysses, hybrid) composed with TP, PP and DP.

The public API only; see README.md and docs/parallelism.md.
"""
from .distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    get_parallel_state,
    init_distributed,
    init_parallel_state,
    rank_grid,
)
from .distributed.mpu import DeepSpeedMPU
from .data import (DataError, PasskeyTask, SampleStream, build_data, build_sample_stream,
                   passkey_accuracy, shard_batch)
from .components.evaluation import evaluate
from .context_parallel import (CP_COMMS, ContextParallel, CPStats, RingStats,
                               context_parallel_attention, cp_stats, gather_sequence,
                               ring_attention, ring_stats, sequence_positions, shard_sequence)
from .tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_full_state_dict,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)

__version__ = "0.1.0"
