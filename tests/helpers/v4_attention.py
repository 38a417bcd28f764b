"""transformers' DeepSeek-V4 attention of one layer, tiny and random, for the V4 tests."""
from __future__ import annotations

import torch


def tiny_v4_attention(kind: str, *, hidden: int, head_dim: int, heads: int, window: int,
                      rates: dict, index_heads: int, index_dim: int, topk: int):
    """transformers' DeepseekV4Attention of a layer of `kind`: weights N(0, 0.5), the
    indexer's heads in +/- pairs (no score ties), RoPE on half of each head with the main
    and compress bases apart; eager attention, fp32. Seed torch before calling."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
    cfg = DeepseekV4Config(
        hidden_size=hidden, head_dim=head_dim, num_attention_heads=heads,
        sliding_window=window, q_lora_rank=8, index_head_dim=index_dim,
        index_n_heads=index_heads, index_topk=topk, o_groups=2, o_lora_rank=4,
        num_hidden_layers=1, layer_types=[kind], compress_rates=rates,
        rope_parameters={"main": {**rope, "rope_theta": 10000.0},
                         "compress": {**rope, "rope_theta": 160000.0}})
    cfg._attn_implementation = "eager"
    attn = hf.DeepseekV4Attention(cfg, 0).float()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)
        if attn.compressor is not None and hasattr(attn.compressor, "indexer"):
            pairs = attn.compressor.indexer.q_b_proj.weight.view(index_heads, index_dim, -1)
            pairs[1::2] = -pairs[0::2]
    return attn
