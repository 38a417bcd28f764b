"""Context parallelism: exact attention over a sequence sharded across a CP group.

One file per communication pattern, beside the pieces they share:

    api.py        context_parallel_attention(comm=...), ring_attention, ContextParallel
    ring.py       comm="ring": K,V blocks over a P2P ring, overlapped step by step
    halo.py       the ring under a short sliding window (contiguous, zigzag): neighbours' tails
    allgather.py  comm="allgather": K,V all-gathered once (Llama 3), dK,dV reduce-scattered
    ulysses.py    comm="ulysses": all-to-all sequence <-> heads around one local kernel
    hybrid.py     comm="hybrid": Ulysses inside each ring rank, the ring across (USP)
    latent.py     MLA (DeepSeek-V2/V3): the ring / all-gather of the latent, expanded per
                  block; latent_api.py its entry point latent_attention(comm=...), and
                  expanded_attention for any expansion (expansion.py: Gemma 4's keys
                  equal to values, k_proj x on the wire)
    sparse_latent.py  DeepSeek sparse attention (V3.2, GLM-5): the indexer's top-k streamed
                  (dsa_indexer.py), MLA over the selected latent rows (dsa_attention.py),
                  the indexer's KL losses (dsa_loss.py); the pairs (dsa_pairs.py) and the
                  blocks' stream (dsa_stream.py) they share
    compressed.py DeepSeek-V4's heavily compressed attention core (hca_attention): the
                  window's halo plus compressed entries; compressor.py makes and
                  all-gathers the entries

    layouts.py    contiguous / zigzag / striped token layouts (two-level under hybrid)
    blocks.py     the causal block plan, per-block compute, the blockwise autograd wrapper
    mask.py       AttentionMask: causal, sliding window, documents, chunks, sinks
    sinks.py      attention sinks: one more softmax term per head, after the merge
    kernels.py    per-block kernels with log-sum-exp: flash_attn, sdpa, math
    bands.py      flash-attn's window_size on a block; a window's band as window calls
    merge.py      the log-sum-exp merge of two partial results
    comm.py       RingComm (P2P) and the all-gather / reduce-scatter / all-to-all calls
    stats.py      cp_stats(): bytes, FLOPs, kernel and communication calls per rank

    linear/       Gated DeltaNet and Mamba2 over the same groups and layouts: the state
                  passed between ranks, or the heads all-to-all (linear/__init__.py)
"""
from .api import CP_COMMS, ContextParallel, context_parallel_attention, ring_attention
from .latent import LatentDims
from .latent_api import latent_attention
from .comm import LOCAL, NoComm
from .mask import AttentionMask
from .layouts import (LAYOUTS, gather_sequence, num_chunks, rank_positions,
                      sequence_positions, shard_sequence)
from .stats import CPStats, RingStats, cp_stats, ring_stats

__all__ = [
    "AttentionMask", "CP_COMMS", "CPStats", "ContextParallel", "LAYOUTS", "LOCAL",
    "LatentDims", "NoComm", "RingStats", "latent_attention",
    "context_parallel_attention", "cp_stats", "gather_sequence", "num_chunks",
    "rank_positions", "ring_attention", "ring_stats", "sequence_positions", "shard_sequence",
]
