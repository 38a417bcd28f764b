"""Hugging Face families as mappings of config.json onto model.* fields.

Every family is ctxpar's one GPT with some fields fixed (the ``fixed`` column) and the
rest read from config.json:

    model_type    architecture         fixed model.*
    llama         LlamaForCausalLM     swiglu, rmsnorm (bias from attention_bias = mlp_bias)
    qwen2         Qwen2ForCausalLM     swiglu, rmsnorm, attention_bias (q/k/v, no o_proj)
    qwen3         Qwen3ForCausalLM     swiglu, rmsnorm, qk_norm
    mistral       MistralForCausalLM   swiglu, rmsnorm; sliding_window on every layer or none
    gemma3_text   Gemma3ForCausalLM    geglu, rmsnorm with norm_offset 1, post_norms,
                                       scale_embeddings, qk_norm, query_pre_attn_scalar;
                                       layer_types, sliding_window, the sliding layers'
                                       own RoPE (layer_rope)
    qwen3_5_text  Qwen3_5ForCausalLM   swiglu, rmsnorm with norm_offset 1, qk_norm,
                                       attention_output_gate; layer_types of
                                       linear_attention (Gated DeltaNet: linear_*) and
                                       full_attention, partial RoPE (linear_families.py)
    nemotron_h    NemotronHForCausalLM relu2 MLP, rope false (NoPE attention); Mamba2,
                                       attention, MLP and MoE blocks, one op each
                                       (model.moe: sigmoid router with its correction
                                       bias, relu2 experts, a shared expert;
                                       nemotron_moe.py)
    olmo_hybrid   OlmoHybridForCausalLM swiglu, rmsnorm, qk_norm over all heads,
                                       reordered_norms on full_attention (post-norm
                                       attention blocks), the Gated DeltaNet's norm eps
                                       1e-5; layer_types, linear_*, beta in [0, 2] or
                                       not, RoPE or NoPE (olmo_hybrid.py)
    qwen3_moe     Qwen3MoeForCausalLM  qwen3's, with model.moe (moe_families.py): softmax
                                       router, SwiGLU experts, MoE layers from
                                       decoder_sparse_step / mlp_only_layers; a window on
                                       every layer or none
    qwen2_moe     Qwen2MoeForCausalLM  qwen2's (q/k/v biases from qkv_bias), with model.moe
                                       and its shared expert behind a sigmoid gate; no
                                       sliding layers
    mixtral       MixtralForCausalLM   mistral's, with model.moe on every layer (experts
                                       intermediate_size wide, top-k weights normalised)
    gpt_oss       GptOssForCausalLM    bias (q/k/v/o), attention_sinks; model.moe on every
                                       layer with a router bias, expert biases and the
                                       clamped SwiGLU; layer_types of sliding and full;
                                       MXFP4 experts dequantized (moe_families.py)
    qwen3_next    Qwen3NextForCausalLM qwen3_5_text's layers, with model.moe and its shared
                                       expert behind a sigmoid gate (qwen2_moe's); its
                                       Gated DeltaNet's projections fused by key head
                                       (qwen3_next.py)
    qwen3_5_moe_text Qwen3_5MoeForCausalLM  qwen3_5_text's layers, with model.moe on every
                                       layer, the top-k normalised, a gated shared expert
    (qwen2 and qwen3 read their sliding layers too: use_sliding_window,
    max_window_layers, layer_types)

Read by both directions (hf.py): import checks each config.json field against what ctxpar
computes and refuses, naming it, any field that would change the computation and that
ctxpar does not implement, and any field it does not know; export writes the family's
config.json from model.* and refuses a model the family cannot hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ..config.sections import HF_FAMILIES
from .linear_families import LINEAR_ATTENTION_KEYS, NEMOTRON_ALIASES, NEMOTRON_MAMBA_KEYS
from .moe_families import MOE_KEYS
from .nemotron_moe import NEMOTRON_MOE_FIXED, NEMOTRON_MOE_INERT, NEMOTRON_MOE_KEYS
from .olmo_hybrid import INIT_KEYS, NEG_EIGVAL
from .qwen3_next import MTP_KEYS, QWEN3_5_MOE_INERT

# model.* fields a family fixes (Llama leaves bias free), so the family of a ModelConfig
# is the first whose fixed values it has.
ARCH_DEFAULTS = {"mlp": "swiglu", "norm": "rmsnorm", "bias": False, "attention_bias": False,
                 "qk_norm": False, "norm_offset": 0.0, "post_norms": False,
                 "scale_embeddings": False, "attention_output_gate": False, "rope": True,
                 "qk_norm_scope": "head", "reordered_norms": None,
                 "linear_allow_neg_eigval": False, "linear_norm_eps": None}

# config.json keys that do not change the computation: bookkeeping, token ids, generation
# defaults, the runtime's switches.
IGNORED_KEYS = frozenset((
    "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "id2label", "label2id",
    "problem_type", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "model_type",
    "pretraining_tp",  # a slicing of Llama's matmuls, the same product
    "initializer_range", "max_position_embeddings",  # mapped to init_std and seq_len
    "_attn_implementation_autoset", "use_return_dict", "tie_word_embeddings",
    "cache_implementation",  # the KV cache transformers generates with
))
# config.json keys every family maps onto model.* (hf.model_fields)
MAPPED_KEYS = frozenset((
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "rms_norm_eps", "head_dim", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_dropout",
))
# Keys that name something ctxpar does not implement, with what it is (refused unless
# the value is the one that turns the feature off: None, 0, False).
NOT_IMPLEMENTED = {
    "num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts", "num_experts_per_tok": "mixture of experts",
    "moe_intermediate_size": "mixture of experts", "decoder_sparse_step": "mixture of experts",
    "final_logit_softcapping": "logit softcapping", "attn_logit_softcapping":
    "attention logit softcapping", "use_bidirectional_attention": "bidirectional attention",
    "use_mrope": "multimodal RoPE", "quantization_config": "quantized weights",
    "use_qk_norm": "a q/k norm over all heads", "attention_chunk_size": "chunked attention",
}


@dataclass(frozen=True)
class Family:
    architecture: str
    fixed: Dict[str, Any]              # model.* values the family always has
    activation: Tuple[str, str]        # (config.json key, value): the MLP's activation
    default_theta: float = 10000.0     # rope_theta when config.json has none
    # config.json keys the family has, with the value ctxpar implements and why
    neutral: Dict[str, Tuple[Any, str]] = field(default_factory=dict)
    # config.json keys the family has whose value ctxpar reads (family-specific code)
    own: Tuple[str, ...] = ()
    # config.json keys the family always writes that compute nothing in the models ctxpar
    # takes (Nemotron-H's multi-token-prediction settings, the MoE keys no code reads)
    inert: Tuple[str, ...] = ()
    # model.moe.* values a mixture-of-experts family always has (None: a dense family,
    # which holds no model.moe)
    moe_fixed: Optional[Dict[str, Any]] = None
    # a family with moe_fixed that also holds dense models (Nemotron-H: MoE blocks or none)
    moe_optional: bool = False


# Qwen3.5's layers: (1 + w) norms, q/k norms, the attention's sigmoid output gate
_QWEN3_5_FIXED = {**ARCH_DEFAULTS, "norm_offset": 1.0, "qk_norm": True,
                  "attention_output_gate": True}

FAMILIES: Dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", {k: v for k, v in ARCH_DEFAULTS.items() if k != "bias"},
        ("hidden_act", "silu"),
        own=("attention_bias", "mlp_bias")),
    "qwen2": Family(
        "Qwen2ForCausalLM", {**ARCH_DEFAULTS, "attention_bias": True},
        ("hidden_act", "silu"), own=("use_sliding_window", "sliding_window",
                                     "max_window_layers", "layer_types")),
    "qwen3": Family(
        "Qwen3ForCausalLM", {**ARCH_DEFAULTS, "qk_norm": True}, ("hidden_act", "silu"),
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")),
    "mistral": Family(
        "MistralForCausalLM", dict(ARCH_DEFAULTS), ("hidden_act", "silu"),
        own=("sliding_window",)),
    "gemma3_text": Family(
        "Gemma3ForCausalLM", {**ARCH_DEFAULTS, "mlp": "geglu", "norm_offset": 1.0,
                              "post_norms": True, "scale_embeddings": True, "qk_norm": True},
        ("hidden_activation", "gelu_pytorch_tanh"), default_theta=1_000_000.0,
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("query_pre_attn_scalar", "sliding_window", "layer_types", "rope_local_base_freq",
             "hidden_act", "sliding_window_pattern", "_sliding_window_pattern")),
    "qwen3_5_text": Family(
        "Qwen3_5ForCausalLM", dict(_QWEN3_5_FIXED),
        ("hidden_act", "silu"),
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("layer_types", "full_attention_interval", *LINEAR_ATTENTION_KEYS),
        inert=MTP_KEYS),  # its multi-token prediction layers, left out (qwen3_next.py)
    "nemotron_h": Family(
        "NemotronHForCausalLM", {**ARCH_DEFAULTS, "mlp": "relu2", "rope": False},
        ("mlp_hidden_act", "relu2"),
        neutral={"attention_bias": (False, "Nemotron-H's attention has no biases"),
                 "use_bias": (False, "ctxpar's Mamba2 has in/out projection biases only "
                                     "with model.bias, which attention would take too"),
                 "mlp_bias": (False, "ctxpar's MLP biases come with model.bias, which "
                                     "Nemotron-H's attention never has"),
                 "mamba_proj_bias": (False, "a Mamba2 projection bias"),
                 "mamba_hidden_act": ("silu", "ctxpar's Mamba2 conv activation is silu"),
                 "residual_in_fp32": (False, "ctxpar adds the residual in the activations' "
                                             "dtype"),
                 "hidden_dropout": (0.0, "ctxpar trains without dropout"),
                 "num_nextn_predict_layers": (0, "multi-token prediction layers"),
                 "sliding_window": (None, "Nemotron-H's attention has no window")},
        own=("layers_block_type", "hybrid_override_pattern", "num_hidden_layers",
             "layer_norm_epsilon", *NEMOTRON_MAMBA_KEYS, *NEMOTRON_ALIASES,
             *NEMOTRON_MOE_KEYS),  # its MoE blocks (nemotron_moe.py)
        inert=(*NEMOTRON_MOE_INERT,  # read by no transformers code (nemotron_moe.py)
               "mtp_layers_block_type", "mtp_hybrid_override_pattern",
               "expand",  # transformers sizes Mamba2 by mamba_num_heads x mamba_head_dim
               "time_step_limit", "mamba_dt_limit",  # its mixer clamps at time_step_min
               "mamba_ssm_cache_dtype", "use_mamba_kernels", "num_logits_to_keep",
               "rescale_prenorm_residual"),  # the init's, not the model's
        moe_fixed=NEMOTRON_MOE_FIXED, moe_optional=True),
    "olmo_hybrid": Family(
        "OlmoHybridForCausalLM",
        {**{k: v for k, v in ARCH_DEFAULTS.items()
            if k not in ("rope", "linear_allow_neg_eigval")},  # read from config.json
         "qk_norm": True, "qk_norm_scope": "all_heads", "reordered_norms": ["full_attention"],
         "linear_norm_eps": 1e-5},
        ("hidden_act", "silu"),  # its MLP's and its Gated DeltaNet conv's
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("layer_types", NEG_EIGVAL, *LINEAR_ATTENTION_KEYS),
        inert=INIT_KEYS),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", {**ARCH_DEFAULTS, "qk_norm": True}, ("hidden_act", "silu"),
        neutral={"attention_bias": (False, "Qwen3-MoE's biases are on o_proj too: ctxpar "
                                           "has q/k/v biases without o_proj's")},
        own=("use_sliding_window", "sliding_window", *MOE_KEYS["qwen3_moe"]),
        inert=("max_window_layers",),  # written by its folders, read by no Qwen3-MoE code
        moe_fixed={"shared_expert_hidden": 0}),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM", {k: v for k, v in ARCH_DEFAULTS.items()
                                if k != "attention_bias"}, ("hidden_act", "silu"),
        neutral={"use_sliding_window": (False, "Qwen2-MoE's sliding layers (every other "
                                               "layer below max_window_layers) are not "
                                               "read by ctxpar")},
        own=("qkv_bias", "layer_types", *MOE_KEYS["qwen2_moe"]),
        inert=("sliding_window", "max_window_layers"),  # read only with use_sliding_window
        moe_fixed={"shared_expert_gate": True}),
    "mixtral": Family(
        "MixtralForCausalLM", dict(ARCH_DEFAULTS), ("hidden_act", "silu"),
        default_theta=1_000_000.0,
        neutral={"router_jitter_noise": (0.0, "ctxpar's router multiplies no noise into "
                                              "its input")},
        own=("sliding_window", *MOE_KEYS["mixtral"]),
        moe_fixed={"shared_expert_hidden": 0, "norm_topk": True, "layers": None}),
    "gpt_oss": Family(
        "GptOssForCausalLM", {**ARCH_DEFAULTS, "bias": True, "attention_sinks": True},
        ("hidden_act", "silu"), default_theta=150_000.0,
        neutral={"attention_bias": (True, "ctxpar's gpt-oss has biases on q/k/v/o "
                                          "(model.bias)")},
        own=("layer_types", "sliding_window", "quantization_config", *MOE_KEYS["gpt_oss"]),
        # its released config.json's own names, read by no transformers gpt-oss code (it
        # reads num_experts_per_tok and rope_scaling's original_max_position_embeddings)
        inert=("experts_per_token", "initial_context_length"),
        moe_fixed={"shared_expert_hidden": 0, "norm_topk": True, "layers": None,
                   "router_bias": True, "expert_bias": True}),
    # Qwen3.5's layers with Qwen2-MoE's experts (qwen3_next.py)
    "qwen3_next": Family(
        "Qwen3NextForCausalLM", dict(_QWEN3_5_FIXED), ("hidden_act", "silu"),
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("layer_types", "full_attention_interval", *LINEAR_ATTENTION_KEYS,
             *MOE_KEYS["qwen3_next"]),
        inert=MTP_KEYS,  # its multi-token prediction layers, left out (qwen3_next.py)
        moe_fixed={"shared_expert_gate": True}),
    "qwen3_5_moe_text": Family(
        "Qwen3_5MoeForCausalLM", dict(_QWEN3_5_FIXED), ("hidden_act", "silu"),
        neutral={"attention_bias": (False, "ctxpar has q/k/v biases without o_proj's, or "
                                           "biases on every layer (MLP too)")},
        own=("layer_types", "full_attention_interval", *LINEAR_ATTENTION_KEYS,
             *MOE_KEYS["qwen3_5_moe_text"]),
        inert=QWEN3_5_MOE_INERT,
        moe_fixed={"shared_expert_gate": True, "norm_topk": True, "layers": None}),
}
assert tuple(FAMILIES) == HF_FAMILIES, "config.sections.HF_FAMILIES names the same families"


@dataclass(frozen=True)
class Wrapper:
    """A multimodal folder around a family's language model: its text_config is the
    family's config.json, its tensors under ``prefix`` are the family's ``model.*``, those
    under ``left_out`` are not imported (said in the start-up line)."""
    text_family: str
    prefix: str
    left_out: Tuple[str, ...]
    what: str                          # what is left out, in words
    top_keys: Tuple[str, ...]          # the top-level keys it may have besides text_config


# model_type of a released multimodal folder -> how its language model is read
WRAPPERS: Dict[str, Wrapper] = {
    "qwen3_5": Wrapper("qwen3_5_text", "model.language_model.", ("model.visual.",),
                       "the vision tower (vision_config, model.visual.*)",
                       ("vision_config", "image_token_id", "video_token_id",
                        "vision_start_token_id", "vision_end_token_id")),
    "qwen3_5_moe": Wrapper("qwen3_5_moe_text", "model.language_model.", ("model.visual.",),
                           "the vision tower (vision_config, model.visual.*)",
                           ("vision_config", "image_token_id", "video_token_id",
                            "vision_start_token_id", "vision_end_token_id")),
}


def family_of(m) -> str:
    """model.family, or the first family whose fixed fields m has (llama for a plain GPT);
    KeyError when none holds m."""
    if m.family is not None:
        return m.family
    for name, fam in FAMILIES.items():
        if all(getattr(m, k) == v for k, v in fam.fixed.items()) and moe_held(m, fam):
            return name
    raise KeyError("no Hugging Face family")


def moe_held(m, fam: Family) -> bool:
    """A dense family for a dense model; a MoE family for model.moe with its fixed values."""
    if fam.moe_fixed is None or m.moe is None:
        return m.moe is None and (fam.moe_fixed is None or fam.moe_optional)
    return all(getattr(m.moe, k) == v for k, v in fam.moe_fixed.items())
