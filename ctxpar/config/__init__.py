"""YAML -> nested dataclasses, validated in one place at load time.

    cfg = load_config("configs/tiny_cpu.yaml", overrides=["parallel.cp=4", "train.steps=10"],
                      world_size=8)

Every problem raises one ``ConfigError`` naming the file, the key and the values, e.g.
``configs/x.yaml: model.n_heads=6 is not divisible by parallel.tp=4``. Loading is pure
(no collectives), so every rank raises the same error before any process group exists.

The package, one idea per file (every name is importable from ``ctxpar.config``):

    sections.py    the dataclasses, one per YAML section; the values a field may take;
                   resolved_ffn_hidden, resolved_head_dim, softmax_scale and
                   ulysses_degree (fields left unset);
                   RENAMED_KEYS (old spellings that still load, with a notice)
    load.py        YAML or a dict -> Config (types, --set overrides, old spellings), and
                   back (to_dict, dump_config)
    validation.py  validate: every cross-field rule, section by section
    layer_mixers.py  LAYER_MIXERS: each layer type's token and channel mixer; layer_types
                   (the floor under sections.py's model.moe checks and layers.py)
    layers.py      layer_attention: each layer's kind (full, sliding, chunked attention;
                   Gated DeltaNet, Mamba2, Nemotron-H's single-op blocks), its mixers,
                   window, chunk and RoPE, from model.layer_types and friends; the
                   linear mixers' sizes (gated_delta_dims, mamba_dims)
    parameters.py  parameter_specs: every tensor's name, full shape and TP split
    deepspeed.py   deepspeed_config: the deepspeed section with batch sizes, clipping and
                   ZeRO's buckets filled in
"""
from .deepspeed import (BUCKET_MAX, BUCKET_MIN, BUCKET_PER_RANK, PREFETCH_MAX, deepspeed_config,
                        grad_accum_steps, zero_bucket_defaults, zero_bucket_size)
from .load import config_from_dict, dump_config, load_config, to_dict
from .sections import (CHECKPOINT_MODES, CHOICES, GATED_MLPS, HF_FAMILIES, RENAMED_KEYS,
                       ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL, ActivationCheckpointingConfig,
                       CheckpointConfig, Config, ConfigError, DataConfig, LoggingConfig,
                       LongContextEvalConfig, MemoryConfig, ModelConfig, ParallelConfig,
                       TrainConfig, WandbConfig, resolved_ffn_hidden, resolved_head_dim,
                       rotary_dim, softmax_scale, ulysses_degree)
from .layers import LAYER_TYPES, LayerAttention, layer_attention, layer_types
from .validation import validate

__all__ = [
    "ActivationCheckpointingConfig", "BUCKET_MAX", "BUCKET_MIN", "BUCKET_PER_RANK",
    "CHECKPOINT_MODES", "CHOICES", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "GATED_MLPS", "HF_FAMILIES", "LAYER_TYPES", "LayerAttention", "LoggingConfig",
    "LongContextEvalConfig", "MemoryConfig", "ModelConfig", "PREFETCH_MAX", "ParallelConfig",
    "RENAMED_KEYS", "ROPE_SCALING_KEYS", "ROPE_SCALING_OPTIONAL", "TrainConfig", "WandbConfig",
    "config_from_dict", "deepspeed_config", "dump_config", "grad_accum_steps",
    "layer_attention", "layer_types", "load_config", "resolved_head_dim", "rotary_dim",
    "softmax_scale",
    "resolved_ffn_hidden", "to_dict", "ulysses_degree", "validate", "zero_bucket_defaults",
    "zero_bucket_size",
]
