"""What a config holds: one dataclass per YAML section, the values a field may take, and
what a field left unset resolves to (model.ffn_hidden, parallel.ulysses)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ..context_parallel.api import CP_COMMS
from ..context_parallel.kernels import BACKENDS
from ..context_parallel.layouts import LAYOUTS
from ..context_parallel.linear.api import LINEAR_CP_STRATEGIES
from ..context_parallel.ring import GRAD_DTYPES
from .hf_families import HF_FAMILIES  # config.json model_types
from .compressed_attention import CompressedAttentionConfig
from .dsa import DSAConfig
from .mla import MLAConfig
from .moe import MoEConfig
from .hyper_connections import HyperConnectionsConfig
from .mtp import MTPConfig


class ConfigError(ValueError):
    """A bad config: the message names the file, the key and the values."""


@dataclass
class ModelConfig:
    vocab_size: int = 256
    """Vocabulary size (must divide by parallel.tp: the embedding is split by rows)."""
    seq_len: int = 1024
    """Tokens per sample, the full (unsharded) sequence; CP ranks hold seq_len/cp each."""
    n_layers: int = 2
    """Transformer blocks."""
    d_model: int = 64
    """Hidden size."""
    n_heads: int = 4
    """Query heads (split over tp)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for GQA/MQA (None = n_heads); split over tp, or replicated when < tp."""
    ffn_hidden: Optional[int] = None
    """MLP hidden size (None: 4*d_model for gelu, 8/3*d_model rounded up to 64 for swiglu)."""
    mlp: str = "swiglu"
    """'swiglu' (down(silu(gate x) * up x): Llama, Qwen, Mistral), 'geglu' (the same gated
    MLP with tanh-GELU, Hugging Face's gelu_pytorch_tanh: Gemma), 'gelu' (down(gelu(up x)),
    tanh-GELU, not gated) or 'relu2' (down(relu(up x)^2), not gated: Nemotron-H)."""
    swiglu_limit: Optional[float] = None
    """DeepSeek-V4's clamped SwiGLU in every gated MLP of the model (the dense MLPs, the
    shared expert, the routed experts): down(silu(min(gate x, L)) * clamp(up x, -L, L)),
    L this limit (transformers' DeepseekV4Config.swiglu_limit). None: unclamped. Not
    gpt-oss's form (model.moe.swiglu_limit: (up + 1) * gate * sigmoid(alpha * gate))."""
    norm: str = "rmsnorm"
    """'rmsnorm' or 'layernorm' (pre-norm)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    norm_offset: float = 0.0
    """RMSNorm scales by (norm_offset + weight): 0 (Llama, Qwen, Mistral) or 1 (Gemma, whose
    norm weights are stored as w - 1 and start at 0). Applies to every RMSNorm, q/k norms too."""
    post_norms: bool = False
    """Also a norm on the attention's output and on the MLP's output before each joins the
    residual stream (Gemma 2/3's post_attention_layernorm and post_feedforward_layernorm)."""
    reordered_norms: Optional[List[str]] = None
    """Layer types whose blocks norm each mixer's output instead of its input (OLMo 2's
    reordered norms): x + norm(mixer(x)), then x + norm(mlp(x)), the norms named
    post_attn_norm and post_mlp_norm; the other layers stay pre-norm (OLMo Hybrid:
    ['full_attention'], its Gated DeltaNet layers pre-norm). None: every block pre-norm."""
    scale_embeddings: bool = False
    """Multiply the input embedding by sqrt(d_model) (Gemma); the tied head is not scaled."""
    rope_theta: float = 10000.0
    """RoPE base; raise it for long contexts."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """RoPE frequency scaling, Hugging Face's form: None, {rope_type: linear, factor} or
    {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (Llama 3.1's long-context rule) or {rope_type: yarn,
    factor, original_max_position_embeddings[, beta_fast, beta_slow, attention_factor, mscale,
    mscale_all_dim, truncate]} (YaRN, Peng et al.: Qwen's and DeepSeek's extensions)."""
    sliding_window: Optional[int] = None
    """Sliding-window attention (Mistral, Gemma, gpt-oss): a query sees itself and the
    sliding_window - 1 keys before it (transformers' convention), on every layer when
    layer_types is unset, else on the 'sliding_attention' layers."""
    attention_chunk_size: Optional[int] = None
    """Chunked attention (Llama 4): a query sees only the keys of its own chunk of this many
    tokens (causal inside it), on every layer when layer_types is unset, else on the
    'chunked_attention' layers."""
    layer_types: Optional[List[str]] = None
    """Each layer's kind (ctxpar/config/layers.py, transformers' names). Attention + MLP
    blocks: 'full_attention', 'sliding_attention' (model.sliding_window),
    'chunked_attention' (model.attention_chunk_size), 'linear_attention' (Gated DeltaNet in
    place of attention, Qwen3-Next / Qwen3.5), 'kimi_delta_attention' (Kimi Delta
    Attention, Kimi Linear: the linear_* fields, its gates' low rank the head dims); e.g.
    Gemma 3's five sliding layers per full one, Qwen3.5's three linear per full one. Nemotron-H's single-op blocks (norm, op,
    residual): 'mamba' (Mamba2), 'attention' (full causal attention), 'mlp'. Unset: every
    layer the same attention + MLP block."""
    layer_rope: Optional[Dict[str, Any]] = None
    """RoPE per layer type, overriding rope_theta/rope_scaling on that type's layers:
    {layer type: {rope_theta: ..., rope_scaling: ... or null}} (Gemma 3:
    {sliding_attention: {rope_theta: 10000.0}} beside a global 1,000,000 with scaling)."""
    attention_sinks: Union[bool, List[str]] = False
    """A learned sink logit per query head joins every softmax's denominator: true on
    every attention layer (gpt-oss), or a list of the layer types whose layers have them
    (MiMo-V2-Flash: [sliding_attention]); parameter layers.N.attn.sinks (n_heads,), split
    over tp by heads."""
    layer_kv_heads: Optional[Dict[str, int]] = None
    """K/V heads per layer type, overriding n_kv_heads on that type's layers: {layer type:
    heads} (MiMo-V2-Flash: {sliding_attention: 8} beside n_kv_heads 4 on its full layers).
    Each count groups n_heads and divides over tp (or is replicated across it), as
    n_kv_heads; the KV cache and the planner count each layer's own."""
    v_head_dim: Optional[int] = None
    """Channels per value head when they differ from head_dim (MiMo-V2-Flash: 128 beside
    q/k's 192): v_proj is n_kv_heads x v_head_dim wide, o_proj reads n_heads x v_head_dim.
    CP attention carries V zero-padded to head_dim (its patterns move K and V as one
    block; the padding's output columns are dropped, exactly); the KV cache keeps V at
    v_head_dim. None = head_dim."""
    attention_value_scale: float = 1.0
    """Every value multiplied by this before attention (MiMo-V2-Flash's 0.707,
    transformers' attention_value_scale); 1: none."""
    linear_num_key_heads: Optional[int] = None
    """Gated DeltaNet ('linear_attention' layers) and KDA ('kimi_delta_attention'):
    query/key heads (None = n_heads)."""
    linear_num_value_heads: Optional[int] = None
    """Gated DeltaNet: value heads, a multiple of the key heads (None = the key heads);
    value head h reads key head h // (value heads / key heads)."""
    linear_key_head_dim: Optional[int] = None
    """Gated DeltaNet: channels per query/key head (None = head_dim or d_model // n_heads)."""
    linear_value_head_dim: Optional[int] = None
    """Gated DeltaNet: channels per value head (None = linear_key_head_dim)."""
    linear_conv_kernel_dim: Optional[int] = None
    """Gated DeltaNet: taps of the depthwise causal conv over q|k|v (None = 4)."""
    linear_allow_neg_eigval: bool = False
    """Gated DeltaNet: beta = 2 sigmoid(b), in [0, 2], so the transition I - beta k k^T
    may have a negative eigenvalue (OLMo Hybrid; Grazzi et al., 'Unlocking State-Tracking
    in Linear RNNs Through Negative Eigenvalues'); false: sigmoid(b) in [0, 1] (Qwen3.5)."""
    linear_norm_eps: Optional[float] = None
    """Gated DeltaNet: epsilon of the gated output norm (None = norm_eps; OLMo Hybrid fixes
    1e-5, fla's FusedRMSNormGated default, whatever its rms_norm_eps)."""
    mamba_num_heads: Optional[int] = None
    """Mamba2 ('mamba' layers): SSM heads (None = n_heads)."""
    mamba_head_dim: Optional[int] = None
    """Mamba2: channels per head; the mixer's width is mamba_num_heads * mamba_head_dim
    (None = head_dim or d_model // n_heads)."""
    ssm_state_size: Optional[int] = None
    """Mamba2: state size N of each head (None = 128, Nemotron-H's)."""
    n_groups: Optional[int] = None
    """Mamba2: B/C groups (mamba_num_heads a multiple), also the gated norm's groups
    (None = 1)."""
    conv_kernel: Optional[int] = None
    """Mamba2: taps of the depthwise causal conv over x|B|C (None = 4)."""
    use_conv_bias: Optional[bool] = None
    """Mamba2: a bias on that conv (None = true, Nemotron-H's); in_proj and out_proj take
    model.bias."""
    time_step_min: Optional[float] = None
    """Mamba2: dt's lower clamp (Nemotron-H's mixer: dt_limit = (time_step_min, inf)) and
    the low end of dt_bias' init (None = 0.001)."""
    time_step_max: Optional[float] = None
    """Mamba2: the high end of dt_bias' init (softplus^-1 of a log-uniform dt; None = 0.1)."""
    time_step_floor: Optional[float] = None
    """Mamba2: the init's dt floor (None = 1e-4)."""
    linear_chunk_size: Optional[int] = None
    """Tokens per chunk of the chunked Gated DeltaNet, KDA and SSD kernels (all; the result
    does not depend on it, only the work's shape; None = 64)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    bias: bool = False
    """Biases in every linear layer (the head aside)."""
    attention_bias: bool = False
    """Biases on q/k/v only, none on o_proj (Qwen2); model.bias already gives them."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k (weights of head_dim) before RoPE (Qwen3, Gemma 3)."""
    qk_norm_scope: str = "head"
    """With qk_norm: 'head' (each head's channels, one (head_dim,) weight per projection)
    or 'all_heads' (the whole q and k projections, weights of n_heads x head_dim and
    n_kv_heads x head_dim split over TP with the heads; OLMo 2, OLMo Hybrid)."""
    attention_output_gate: bool = False
    """Gated attention (Qwen3.5, Qwen3-Next): q_proj gives each head its query and a gate
    (rows [q | gate] per head, 2 x n_heads x head_dim), and the attention output is
    multiplied by sigmoid(gate) before o_proj."""
    rope: bool = True
    """RoPE on the attention layers' q and k; false: no positions at all (NoPE: Nemotron-H's
    attention layers, whose order comes from the Mamba2 layers around them)."""
    nope_layers: Optional[List[int]] = None
    """Attention layers (indices) that take no RoPE while the others do (Llama 4's
    no_rope_layers: every fourth layer NoPE, the rest chunked with RoPE). None: RoPE on
    every attention layer as model.rope says."""
    attn_temperature_tuning: bool = False
    """On the NoPE layers (model.nope_layers, or every layer under model.rope=false) each
    query is multiplied by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)), p the
    token's global position (Llama 4's temperature tuning; Nakanishi, 'Scalable-Softmax
    Is Superior for Attention'): under CP each rank scales by its tokens' layout positions,
    never a local arange."""
    floor_scale: int = 8192
    """Temperature tuning: positions per step of the log (transformers' floor_scale)."""
    attn_scale: float = 0.1
    """Temperature tuning: the log's weight (transformers' attn_scale)."""
    qk_l2_norm: bool = False
    """Llama 4's q/k norm: each head's q and k divided by their RMS (no weight, eps
    model.norm_eps) after RoPE, on the RoPE layers only (the NoPE layers keep theirs)."""
    partial_rotary_factor: float = 1.0
    """RoPE turns the first head_dim x factor channels of each q and k head (an even
    number), its frequencies over those channels; the rest pass unrotated (Qwen3.5 and
    Qwen3-Next: 0.25)."""
    head_dim: Optional[int] = None
    """Channels per attention head (None = d_model // n_heads); Qwen3 and Gemma set it
    independently (q/k/v project d_model to heads * head_dim, o_proj back)."""
    query_pre_attn_scalar: Optional[float] = None
    """The softmax scale is query_pre_attn_scalar ** -0.5 (Gemma's field; None = head_dim)."""
    global_head_dim: Optional[int] = None
    """Channels per head of the 'full_attention' layers where they differ from the sliding
    layers' head_dim (Gemma 4: 512 beside 256); None: head_dim on every layer."""
    global_n_kv_heads: Optional[int] = None
    """K/V heads of the 'full_attention' layers (Gemma 4's num_global_key_value_heads);
    None: n_kv_heads on every layer."""
    attention_k_eq_v: bool = False
    """The 'full_attention' layers have no v_proj: their values are k_proj's output (Gemma
    4), V = value_norm(k_proj x) beside K = RoPE(k_norm(k_proj x))."""
    value_norm: bool = False
    """A weightless RMSNorm (eps norm_eps) over each head's values (Gemma 4's v_norm)."""
    num_kv_shared_layers: int = 0
    """The last this many layers compute no K/V (no k_proj, v_proj, k_norm): each attends
    with the K/V of the last earlier layer of its type (Gemma 4); 0: none."""
    per_layer_input_dim: int = 0
    """Per-layer input embeddings (Gemma 4's hidden_size_per_layer_input; 0: none): a
    second embedding of n_layers x per_layer_input_dim per token, mixed with a projection of
    the input embedding, gives each block a vector it gates into its output
    (models/per_layer_input.py)."""
    final_logit_softcapping: Optional[float] = None
    """The logits as cap * tanh(logits / cap) (Gemma 2 and 4; None: none); not with
    memory.tiled_loss, whose tiles make the logits inside the loss."""
    layer_scalar: bool = False
    """Each block's output multiplied by a scalar of its own, a buffer read from the
    checkpoint and not trained (Gemma 4's layer_scalar)."""
    hyper_connections: Optional[HyperConnectionsConfig] = None
    """Manifold-constrained hyper-connections: the residual stream as N streams mixed
    around every sublayer (ctxpar/config/hyper_connections.py; DeepSeek-V4; None: one
    residual stream)."""
    double_wide_mlp: bool = False
    """The MLP of the layers that share K/V (the last model.num_kv_shared_layers) is
    2 x ffn_hidden wide (Gemma 4's use_double_wide_mlp); the dense MLP beside the experts
    under model.moe.beside_mlp too."""
    init_std: float = 0.02
    """Std of the normal init (output projections are scaled by 1/sqrt(2*n_layers))."""
    moe: Optional[MoEConfig] = None
    """A mixture of experts in place of the MLP (ctxpar/config/moe.py; None: dense)."""
    mla: Optional[MLAConfig] = None
    """Multi-head latent attention in every attention layer (ctxpar/config/mla.py;
    DeepSeek-V2/V3, Kimi K2; None: MHA/GQA)."""
    dsa: Optional[DSAConfig] = None
    """DeepSeek sparse attention on top of model.mla: the lightning indexer's top-k per
    query (ctxpar/config/dsa.py; DeepSeek-V3.2, GLM-5; None: dense MLA)."""
    compressed_attention: Optional[CompressedAttentionConfig] = None
    """DeepSeek-V4's attention in every attention layer: MQA with K = V, sinks, the window,
    and the compressed layers' entries (ctxpar/config/compressed_attention.py; None:
    none)."""
    mtp: Optional[MTPConfig] = None
    """Multi-token prediction layers after the head (ctxpar/config/mtp.py; None: none, and
    an imported folder's MTP tensors are left out)."""
    family: Optional[str] = None
    """The Hugging Face family the model is exported as (config.json's model_type: one of
    HF_FAMILIES); None: the one model.init_from's folder has, else the first whose
    architecture holds the fields (docs/checkpoints.md)."""
    init_from: Optional[str] = None
    """Start a new run from these weights (step 0, fresh optimizer): a local Hugging Face
    folder of a family in HF_FAMILIES (config.json + *.safetensors) or a ctxpar checkpoint
    (a step_* folder).
    The architecture must match model.*; seq_len, rope_theta, rope_scaling and layer_rope
    may differ."""


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sample's tokens are split over cp ranks."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp: Union[int, str] = "auto"
    """Data-parallel degree, or 'auto' = world // (tp*cp*pp)."""
    order: str = "tp-cp-dp-pp"
    """Grid order, innermost first (adjacent ranks)."""
    layout: str = "zigzag"
    """Token layout over CP: 'zigzag', 'striped' or 'contiguous'."""
    cp_comm: str = "ring"
    """How attention communicates over CP: 'ring' (K,V blocks over a P2P ring), 'allgather'
    (K,V all-gathered once), 'ulysses' (all-to-all sequence <-> heads) or 'hybrid'
    (Ulysses over parallel.ulysses adjacent ranks inside, the ring across them)."""
    ulysses: Optional[int] = None
    """Ulysses degree: for cp_comm='hybrid' the inner degree N (ring = cp / N); for
    'ulysses' it is cp (None = cp); unused (None or 1) for 'ring' and 'allgather'."""
    ring_grad_dtype: str = "fp32"
    """The dtype the ring's travelling dK,dV accumulator crosses the links in: 'fp32'
    (exact) or 'bf16' (half the backward's gradient bytes, one bf16 rounding of the running
    sum per hop; docs/benchmarks.md states the error). cp_comm 'ring' or 'hybrid' only."""
    attention_backend: str = "auto"
    """Per-block attention kernel: 'auto' or one of ctxpar.context_parallel.kernels.BACKENDS
    ('flash_attn', 'flash_attn4', 'sdpa', 'math')."""
    pp_partition: str = "parameters"
    """Pipeline partitioning: 'parameters' or 'uniform'."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts split over ep ranks of the DP x CP
    group (folded: CP and DP ranks are more tokens for the experts), tokens sent to their
    experts' ranks by all-to-all. Must divide dp x cp and model.moe.num_experts."""
    linear_cp: str = "state"
    """How the linear layers ('linear_attention', 'kimi_delta_attention', 'mamba') talk
    over CP (ctxpar/context_parallel/linear/): 'state' (each rank's (M, E) summary of its state,
    one fp32 all-gather: bytes independent of the sequence length; layouts contiguous and
    zigzag) or 'heads' (all-to-all sequence <-> heads around the kernel, as Ulysses: bytes
    proportional to the local sequence; any layout, heads divisible by cp). 'state' is the
    default: its traffic does not grow with the context."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    micro_batch_size: int = 1
    """Samples per forward per DP rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all DP ranks (= micro * grad_accum * dp)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    seed: int = 1234
    """Seed for init and data."""
    eval_interval: int = 0
    """Steps between evaluations (0 = only at the end)."""
    eval_samples: int = 32
    """Samples per evaluation."""
    eval_at_start: bool = False
    """Also evaluate before the first step (at step 0, or at the step a resume starts from),
    so a run from model.init_from or a checkpoint shows what the model could do before it."""


@dataclass
class DataConfig:
    kind: str = "passkey"
    """'passkey' (built-in synthetic retrieval task) or 'tokens' (a preprocessed .bin/.idx)."""
    path: Optional[str] = None
    """For kind=tokens: the prefix of <path>.bin and <path>.idx from tools/preprocess_data.py."""
    eval_path: Optional[str] = None
    """For kind=tokens: prefix of a held-out .bin/.idx to evaluate on (None = eval_fraction)."""
    eval_fraction: float = 0.01
    """For kind=tokens without eval_path: share of path's samples (its end) held out for eval."""
    passkey_digits: int = 2
    """For kind=passkey: digits of the planted key."""
    passkey_docs: int = 1
    """For kind=passkey: documents packed per sample, each with its own key; the question
    is at the end of the last one (> 1: the packed task, for data.document_mask)."""
    document_mask: bool = False
    """Attention stays inside each packed document (Megatron's reset_attention_mask): the
    samples' document boundaries go to CP attention as cu_seqlens."""
    reset_positions: bool = False
    """RoPE positions restart at 0 at each document (Megatron's reset_position_ids)."""
    eod_mask_loss: bool = False
    """No loss on predicting the token after a document's end (EOS) (Megatron's
    eod_mask_loss); for kind=tokens (passkey labels only the answer)."""
    dynamic_cp: bool = False
    """Variable-length data with dynamic context parallelism (ctxpar/dynamic_cp/schedule.py):
    each step trains on train.global_batch_size whole documents of the token file, each
    given the smallest CP size whose ranks hold it (1 to dp x cp, any) and a group of
    the DP x CP ranks, balanced by the planner's step time; document masking and RoPE
    restarting per document always; the loss is the token mean over the step. For
    data.kind=tokens, parallel.pp=1, every cp_comm (hybrid: sizes 1 and the multiples of
    parallel.ulysses); every ZeRO stage (2 and 3 run the packs in rounds,
    models/dynamic_cp.py)."""
    dynamic_cp_schedule: str = "balanced"
    """With data.dynamic_cp: 'balanced' (each document its CP size and rank group, balanced
    toward the step's work bound, ctxpar/dynamic_cp/balance.py) or 'static' (static CP's
    packing of the same documents: in order, samples of parallel.cp x tokens_per_rank
    tokens each over a CP group; the comparison the balanced one is measured and tested
    against)."""
    dynamic_cp_window: int = 1
    """With data.dynamic_cp: the steps whose documents may trade places (each window of
    this many steps dealt again, longest first in snake order, as a function of the
    lengths: the same on every layout and run, resumable inside a window; 1 = every step
    its own documents, in the stream's order; ctxpar/dynamic_cp/balance.py)."""
    tokens_per_rank: Optional[int] = None
    """With data.dynamic_cp: the most tokens a rank holds at once, its share of one packed
    sequence (None = model.seq_len / parallel.cp, what static CP gives it)."""
    tokenizer: Optional[str] = None
    """The Hugging Face tokenizer.json the token files were made with (None = byte-level);
    exported with the model by tools/convert_checkpoint.py --to hf."""


@dataclass
class ActivationCheckpointingConfig:
    """Activation recompute: blocks that keep little for backward and replay their forward
    (models/gpt.py; docs/memory.md)."""
    mode: str = "none"
    """'none', 'full' (a block keeps its input and replays whole), 'selective' (the
    attention core's outputs kept, the projections and MLP replayed) or 'every_n_layers'
    (every n-th block 'full', the others 'none')."""
    every_n_layers: int = 1
    """For mode=every_n_layers: checkpoint every n-th block."""


@dataclass
class CheckpointConfig:
    """Checkpoint files: where and how often train.py saves (docs/checkpoints.md)."""
    save_dir: Optional[str] = None
    """DeepSpeed checkpoint directory (None = <run_dir>/checkpoints)."""
    save_interval: int = 0
    """Steps between checkpoints (0 = only at the end)."""


@dataclass
class MemoryConfig:
    """What trades time or host memory for device memory at long context (docs/memory.md)."""
    tiled_loss: bool = False
    """LM head + vocab-parallel cross entropy one tile of tokens at a time: the full
    (tokens, V/tp) logits never exist, in forward or backward."""
    loss_tile_tokens: Union[int, str] = "auto"
    """Tokens per loss tile, or 'auto' (ctxpar/memory/tiled_loss.py says how it is chosen)."""
    tiled_mlp: bool = False
    """The MLP over tiles of tokens, each recomputed in backward: its (tokens, ffn/tp)
    intermediates exist for one tile at a time. With model.moe, the routed experts (the
    router over all tokens, each tile dispatched and combined alone); under activation
    checkpointing the block's recompute skips them (models/moe.py), so they cost no more
    than untiled there."""
    mlp_tile_tokens: Union[int, str] = "auto"
    """Tokens per MLP tile, or 'auto' (ctxpar/memory/tiled_mlp.py says how it is chosen)."""
    tiled_linear: bool = False
    """Each linear block (Gated DeltaNet, KDA, Mamba2) over tiles of linear_tile_tokens, each
    recomputed in backward from its saved entering state: the block keeps its input and
    one state per tile, not its projections over the rank's sequence
    (ctxpar/context_parallel/linear/tiles.py)."""
    linear_tile_tokens: int = 2048
    """Tokens per linear block tile: a multiple of the linear chunk size."""
    offload_activations: bool = False
    """What activation checkpointing keeps per layer goes to (pinned) host memory until its
    backward; needs activation_checkpointing.mode other than 'none'."""


@dataclass
class WandbConfig:
    project: str = "ctxpar"
    """wandb project."""
    name: Optional[str] = None
    """Run name (None = the run dir's name)."""
    mode: str = "offline"
    """'offline' (default, synced later with `wandb sync`), 'online' or 'disabled'."""


@dataclass
class LongContextEvalConfig:
    """Long-context tasks (ctxpar/data/long_context.py) answered by CP generation at every
    evaluation of train.py, logged to metrics.jsonl and wandb (tools/long_context_eval.py
    does the same on a checkpoint)."""
    tasks: List[str] = field(default_factory=list)
    """Which: 'needle', 'multikey', 'multivalue', 'multiquery', 'variable_tracking'
    (empty: none)."""
    lengths: List[int] = field(default_factory=list)
    """Prompt lengths in tokens (empty: model.seq_len's quarters, the answer's room left)."""
    depths: List[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    """Needle depths in [0, 1] (0: the start, 1: just before the question)."""
    samples: int = 2
    """Prompts per length x depth cell."""
    needles: int = 2
    """Keys of the multi-key/value/query tasks, variables of variable tracking."""
    digits: Optional[int] = None
    """Digits of a key (None: data.passkey_digits for a passkey run, else 4)."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Where metrics.jsonl, config.yaml, wandb files and checkpoints go."""
    log_interval: int = 1
    """Steps between metric lines."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases tracking."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The rank grid."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and batch sizes."""
    data: DataConfig = field(default_factory=DataConfig)
    """What to train on."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    """Activation recompute (which blocks replay their forward in backward)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint files (where and how often train.py saves)."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Tiled loss, tiled MLP and activation offload (the optimizer's offload is DeepSpeed's
    deepspeed.zero_optimization.offload_optimizer)."""
    long_context_eval: LongContextEvalConfig = field(default_factory=LongContextEvalConfig)
    """Long-context tasks at every evaluation (off unless tasks are named)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and wandb."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Passed to deepspeed.initialize as is, with batch sizes and clipping filled in from train."""
    source: str = field(default="<dict>", metadata={"internal": True})
    """Where this config came from (for error messages)."""


RENAMED_KEYS = {  # old spelling -> new; a config using the old one loads with a notice
    "checkpointing.activation": "activation_checkpointing.mode",
    "checkpointing.every_n_layers": "activation_checkpointing.every_n_layers",
    "checkpointing.save_dir": "checkpoint.save_dir",
    "checkpointing.save_interval": "checkpoint.save_interval",
}


CHECKPOINT_MODES = ("none", "full", "selective", "every_n_layers")  # models/gpt.py

CHOICES = {  # each from the module that implements it, where ctxpar has one
    "model.mlp": ("swiglu", "geglu", "gelu", "relu2"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.qk_norm_scope": ("head", "all_heads"),  # models/qk_norm.py
    "parallel.layout": LAYOUTS,
    "parallel.cp_comm": CP_COMMS,
    "parallel.ring_grad_dtype": tuple(GRAD_DTYPES),
    "parallel.attention_backend": ("auto", *BACKENDS),
    "parallel.pp_partition": ("parameters", "uniform"),
    "parallel.linear_cp": LINEAR_CP_STRATEGIES,
    "data.kind": ("passkey", "tokens"),
    "activation_checkpointing.mode": CHECKPOINT_MODES,
    "logging.wandb.mode": ("offline", "online", "disabled"),
}

ROPE_SCALING_KEYS = {  # rope_type -> its required numeric keys (Hugging Face's names)
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),  # Gemma 4's full layers (models/rope.py)
}
ROPE_SCALING_OPTIONAL = {  # rope_type -> keys it may have (modeling_rope_utils' defaults)
    "proportional": ("partial_rotary_factor", "factor"),
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
             "truncate"),
}
GATED_MLPS = ("swiglu", "geglu")


# ---------------------------------------------------------------- fields left unset

def resolved_ffn_hidden(m: ModelConfig) -> int:
    """model.ffn_hidden, or its default: 4*d_model (gelu), 8/3*d_model rounded up to 64
    (swiglu, geglu)."""
    if m.ffn_hidden is not None:
        return m.ffn_hidden
    if m.mlp not in GATED_MLPS:
        return 4 * m.d_model
    return (8 * m.d_model + 191) // 192 * 64  # ceil(8*d/3 / 64) * 64


def resolved_head_dim(m: ModelConfig) -> int:
    """model.head_dim, or its default d_model // n_heads."""
    return m.head_dim if m.head_dim is not None else m.d_model // m.n_heads


def rotary_dim(m: ModelConfig) -> int:
    """Channels of each attention head that RoPE turns: head_dim x partial_rotary_factor;
    MLA's rope part (model.mla.qk_rope_head_dim)."""
    if m.mla is not None:
        return m.mla.qk_rope_head_dim
    return int(round(resolved_head_dim(m) * m.partial_rotary_factor))


def softmax_scale(m: ModelConfig) -> float:
    """Attention's softmax scale: query_pre_attn_scalar ** -0.5, or head_dim ** -0.5; MLA's
    (qk_nope + qk_rope) ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared, as
    transformers' DeepseekV3Attention (its yarn_apply_mscale)."""
    if m.mla is not None:
        scale = float(m.mla.qk_head_dim) ** -0.5
        rs = m.rope_scaling or {}
        if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):
            factor = rs["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1
            scale *= mscale * mscale
        return scale
    s = m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None else resolved_head_dim(m)
    return float(s) ** -0.5


def ulysses_degree(p: ParallelConfig) -> int:
    """The Ulysses part u of the CP group (cp = u x ring): cp for 'ulysses', parallel.ulysses
    for 'hybrid', 1 for the ring and all-gather."""
    if p.cp_comm == "ulysses":
        return p.cp
    return (p.ulysses or 1) if p.cp_comm == "hybrid" else 1
