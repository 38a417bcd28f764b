"""model.compressed_attention: DeepSeek-V4's attention in every attention layer
(models/compressed_attention.py; transformers' DeepseekV4Attention).

    model:
      n_heads: 64                 # query heads (num_attention_heads)
      n_kv_heads: 1               # one shared K = V head (MQA): required
      head_dim: 512
      partial_rotary_factor: 0.125   # RoPE on the last head_dim x this channels, pairs
      sliding_window: 128         # every V4 layer's window
      rope_theta: 10000           # 'sliding_attention' layers (V4's "main" RoPE)
      layer_rope:                 # the compressed layers' (V4's "compress" RoPE)
        compressed_sparse_attention: {rope_theta: 160000}
        heavily_compressed_attention: {rope_theta: 160000}
      layer_types: [sliding_attention, compressed_sparse_attention,
                    heavily_compressed_attention, ...]
      compressed_attention:
        q_lora_rank: 1024         # the queries' bottleneck (q_a_proj, q_a_norm, q_b_proj)
        o_groups: 8               # the grouped output projection's groups (o_a_proj)
        o_lora_rank: 1024         # each group's width after o_a_proj
        index_n_heads: 64         # the CSA layers' lightning indexer
        index_head_dim: 128
        index_topk: 512
        compress_rates: {compressed_sparse_attention: 4, heavily_compressed_attention: 128}

The three layer types: 'sliding_attention' attends within the window only;
'compressed_sparse_attention' (CSA) adds entries compressing every m = 4 tokens (two
overlapping series) of which the indexer picks index_topk per query;
'heavily_compressed_attention' (HCA) adds every complete entry of m = 128 tokens. Every
layer has per-head sinks and undoes V's RoPE on its output (K = V). The cores:
ctxpar/context_parallel/compressed.py and compressed_sparse.py; the rules and the
parameters: ctxpar/config/compressed_layers.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict



def _default_rates() -> Dict[str, int]:
    return {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass
class CompressedAttentionConfig:
    q_lora_rank: int = 1024
    """The queries' low-rank bottleneck: q_a_proj (d_model -> q_lora_rank), q_a_norm,
    q_b_proj (-> n_heads x head_dim); replicated over TP, q_b_proj split by heads."""
    o_groups: int = 8
    """The grouped output projection's groups: o_a_proj maps each group of n_heads /
    o_groups heads to o_lora_rank numbers (split over TP by groups: divides by tp)."""
    o_lora_rank: int = 1024
    """Each group's width after o_a_proj; o_b_proj maps o_groups x o_lora_rank back to
    d_model (row-parallel over TP)."""
    index_n_heads: int = 64
    """The CSA layers' lightning indexer's heads (replicated over TP)."""
    index_head_dim: int = 128
    """Each indexer head's width, and its compressed keys' (at least the RoPE channels)."""
    index_topk: int = 512
    """The compressed entries each query of a CSA layer attends to (its indexer's top-k)."""
    compress_rates: Dict[str, int] = field(default_factory=_default_rates)
    """Tokens per compressed entry by layer type (transformers' compress_rates): CSA's m
    and HCA's m'."""

    def rate(self, kind: str) -> int:
        return self.compress_rates[kind]
