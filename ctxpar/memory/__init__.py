"""Device memory at long context: tiled loss, tiled MLP, activation offload (docs/memory.md).

Each trades a little time (a recomputation, a copy) for the largest per-token buffers of a
rank: the (tokens, V/tp) logits, the (tokens, ffn/tp) MLP intermediates and the (tokens, d)
block inputs activation checkpointing keeps. The optimizer's offload is DeepSpeed's own
(deepspeed.zero_optimization.offload_optimizer).
"""
