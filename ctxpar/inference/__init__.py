"""Inference under context parallelism: a CP-sharded KV cache, ring prefill, and decoding
whose attention is merged across CP ranks with the log-sum-exp rule (flash-decoding).

    kv_cache.py    KVCache: this rank's share of every layer's keys and values
    decode.py      one query against the local shard, (out, lse), merged over CP
    sampling.py    greedy / temperature / top-k / top-p, the same draw on every rank
    generation.py  generate(): pad, prefill with the training ring, decode, stop
    recompute.py   generation by full forwards, for layers without a decode cache (V4)
    output.py      GenerationOutput, the last prompt position's state, full logits
    checkpoint.py  a train.py run's config and weights, at any tp and cp (generate.py)
"""
from .decode import DecodeStats, decode_bytes_per_step, merge_partials, partial_attention
from .generation import GenerationOutput, check_prompts, generate
from .kv_cache import KVCache, decode_capacity
from .sampling import SamplingParams, filter_logits, sample

__all__ = [
    "DecodeStats", "GenerationOutput", "KVCache", "SamplingParams", "check_prompts",
    "decode_bytes_per_step", "decode_capacity", "filter_logits", "generate",
    "merge_partials", "partial_attention", "sample",
]
