"""model.mla: multi-head latent attention (DeepSeek-V2/V3, Kimi K2) in every attention layer.

    model:
      mla:
        q_lora_rank: 1536         # q through a rank-1536 bottleneck with its norm (null: q_proj)
        kv_lora_rank: 512         # the latent c_kv each token's keys and values come from
        qk_nope_head_dim: 128     # per head: the keys' and queries' channels without RoPE
        qk_rope_head_dim: 64      # the RoPE channels: one key shared by every head
        v_head_dim: 128           # per head: the values' channels
        rope_interleave: true     # RoPE on interleaved pairs (DeepSeek's checkpoints)

With model.rope=false (Kimi Linear's MLA) nothing turns: the qk_rope_head_dim channels of
the queries and the shared key take part unrotated (transformers' KimiLinearAttention),
rope_interleave then computes nothing.

Per token the layer keeps kv_lora_rank + qk_rope_head_dim numbers (576 for DeepSeek-V3):
kv_a_layernorm(c_kv) and the rotated shared key, which is what travels over the CP group
(ctxpar/context_parallel/latent.py) instead of the expanded K and V (heads x (192 + 128)
for V3). The softmax scale is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's
mscale(factor, mscale_all_dim) squared when model.rope_scaling is YaRN with mscale_all_dim
(transformers' DeepseekV3Attention). model.n_kv_heads and model.head_dim do not apply:
every head has its own keys and values, expanded from the one latent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MLAConfig:
    q_lora_rank: Optional[int] = None
    """Rank of the queries' bottleneck (q_a_proj -> q_a_layernorm -> q_b_proj); None: one
    q_proj (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the latent c_kv (kv_a_proj_with_mqa's first part, normed by
    kv_a_layernorm, expanded per head by kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """Per head: the query and key channels RoPE leaves alone (keys from kv_b_proj)."""
    qk_rope_head_dim: int = 64
    """Per head: the query channels RoPE turns, and the one key of that width shared by
    every head (kv_a_proj_with_mqa's second part)."""
    v_head_dim: int = 128
    """Per head: the value channels (o_proj reads heads x v_head_dim)."""
    rope_interleave: bool = True
    """RoPE on interleaved channel pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints
    lay them out (transformers' apply_rotary_pos_emb_interleave); false: rotate-half."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers per token that MLA keeps and sends: the latent and the shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def check_mla(m, tp: int, err) -> None:
    """model.mla against the model and parallel.tp, each rule one ConfigError line."""
    mla = m.mla
    if mla is None:
        return
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(mla, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            err(f"model.mla.{key}={value!r} must be an integer >= 1")
    if mla.q_lora_rank is not None and (not isinstance(mla.q_lora_rank, int)
                                        or mla.q_lora_rank < 1):
        err(f"model.mla.q_lora_rank={mla.q_lora_rank!r} must be an integer >= 1 or null")
    if m.rope and isinstance(mla.qk_rope_head_dim, int) and mla.qk_rope_head_dim % 2:
        err(f"model.mla.qk_rope_head_dim={mla.qk_rope_head_dim} must be even (RoPE turns "
            f"channel pairs)")
    for key in ("nope_layers", "attn_temperature_tuning"):
        if getattr(m, key):
            err(f"model.{key}={getattr(m, key)!r} with model.mla: MLA turns every layer's "
                f"rope part, or none (model.rope=false, Kimi Linear's), without Llama 4's "
                f"temperature")
    if m.n_kv_heads not in (None, m.n_heads):
        err(f"model.n_kv_heads={m.n_kv_heads} with model.mla: every MLA head has its own keys "
            f"and values (leave it null)")
    if m.partial_rotary_factor != 1.0:
        err(f"model.partial_rotary_factor={m.partial_rotary_factor} with model.mla: MLA's "
            f"RoPE channels are model.mla.qk_rope_head_dim")
    for key in ("attention_sinks", "attention_output_gate", "qk_norm", "bias",
                "attention_bias"):
        if getattr(m, key):
            err(f"model.{key}=true with model.mla: not built for latent attention")
    if m.norm_offset:
        err(f"model.norm_offset={m.norm_offset} with model.mla: its bottleneck norms are "
            f"plain RMSNorms (DeepSeek's)")
