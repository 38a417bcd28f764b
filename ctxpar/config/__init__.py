"""YAML -> nested dataclasses, validated in one place at load time.

    cfg = load_config("configs/tiny_cpu.yaml", overrides=["parallel.cp=4", "train.steps=10"],
                      world_size=8)

Every problem raises one ``ConfigError`` naming the file, the key and the values, e.g.
``configs/x.yaml: model.n_heads=6 is not divisible by parallel.tp=4``. Loading is pure
(no collectives), so every rank raises the same error before any process group exists.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from ..distributed.parallel_state import parse_order, resolve_sizes
from ..context_parallel.api import CP_COMMS
from ..context_parallel.layouts import LAYOUTS, num_chunks


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
    """'swiglu' or 'gelu'."""
    norm: str = "rmsnorm"
    """'rmsnorm' or 'layernorm' (pre-norm)."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    rope_theta: float = 10000.0
    """RoPE base; raise it for long contexts."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """RoPE frequency scaling, Hugging Face's form: None, {rope_type: linear, factor} or
    {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (Llama 3.1's long-context rule)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    bias: bool = False
    """Biases in linear layers."""
    init_std: float = 0.02
    """Std of the normal init (output projections are scaled by 1/sqrt(2*n_layers))."""
    init_from: Optional[str] = None
    """Start a new run from these weights (step 0, fresh optimizer): a local Hugging Face
    Llama folder (config.json + *.safetensors) or a ctxpar checkpoint (a step_* folder).
    The architecture must match model.*; seq_len, rope_theta and rope_scaling may differ."""


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
    """Per-block attention kernel: 'auto', 'flash_attn', 'flash_attn4', 'sdpa' or 'math'."""
    pp_partition: str = "parameters"
    """Pipeline partitioning: 'parameters' or 'uniform'."""


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
    tokenizer: Optional[str] = None
    """The Hugging Face tokenizer.json the token files were made with (None = byte-level);
    exported with the model by tools/convert_checkpoint.py --to hf."""


@dataclass
class CheckpointingConfig:
    activation: str = "none"
    """Activation checkpointing: 'none', 'full', 'selective' or 'every_n_layers'."""
    every_n_layers: int = 1
    """For activation=every_n_layers: checkpoint every n-th block."""
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
    intermediates exist for one tile at a time."""
    mlp_tile_tokens: Union[int, str] = "auto"
    """Tokens per MLP tile, or 'auto' (ctxpar/memory/tiled_mlp.py says how it is chosen)."""
    offload_activations: bool = False
    """What activation checkpointing keeps per layer goes to (pinned) host memory until its
    backward; needs checkpointing.activation other than 'none'."""


@dataclass
class WandbConfig:
    project: str = "ctxpar"
    """wandb project."""
    name: Optional[str] = None
    """Run name (None = the run dir's name)."""
    mode: str = "offline"
    """'offline' (default, synced later with `wandb sync`), 'online' or 'disabled'."""


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
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Activation checkpointing and model checkpoints."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Tiled loss, tiled MLP and activation offload (the optimizer's offload is DeepSpeed's
    deepspeed.zero_optimization.offload_optimizer)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and wandb."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Passed to deepspeed.initialize as is, with batch sizes and clipping filled in from train."""
    source: str = field(default="<dict>", metadata={"internal": True})
    """Where this config came from (for error messages)."""


CHECKPOINT_MODES = ("none", "full", "selective", "every_n_layers")  # models/gpt.py

CHOICES = {
    "model.mlp": ("swiglu", "gelu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "parallel.layout": LAYOUTS,
    "parallel.cp_comm": CP_COMMS,
    "parallel.ring_grad_dtype": ("fp32", "bf16"),
    "parallel.attention_backend": ("auto", "flash_attn", "flash_attn4", "sdpa", "math"),
    "parallel.pp_partition": ("parameters", "uniform"),
    "data.kind": ("passkey", "tokens"),
    "checkpointing.activation": CHECKPOINT_MODES,
    "logging.wandb.mode": ("offline", "online", "disabled"),
}


# ---------------------------------------------------------------- building from dicts

def _coerce(value: Any, tp: Any, key: str, src: str) -> Any:
    """Check a YAML value against a field's annotation; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin is Union:
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key, src)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(f"{src}: {key}={value!r} must be set")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {key} must be a mapping, got {value!r}")
        return _build(tp, value, key, src)
    if tp is Any:
        return value
    if origin in (dict, Dict) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{src}: {key} must be a mapping, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            return float(value)
        elif isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{src}: {key}={value!r} must be a number")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be an integer")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be true or false")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{src}: {key}={value!r} must be a string")
    raise AssertionError(f"unhandled annotation {tp} for {key}")  # a new field type


def _build(cls, data: Dict[str, Any], prefix: str, src: str):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            raise ConfigError(f"{src}: unknown config key {full!r}{hint}; "
                              f"known keys: {', '.join(fields)}")
        kwargs[key] = _coerce(value, hints[key], full, src)
    return cls(**kwargs)


def _parse_override(item: str, src: str):
    if "=" not in item:
        raise ConfigError(f"{src}: override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _apply_override(data: Dict[str, Any], path: List[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
    node[path[-1]] = value


def config_from_dict(data: Dict[str, Any], source: str = "<dict>",
                     overrides: Sequence[str] = (), world_size: Optional[int] = None,
                     check_paths: bool = True, training: bool = True) -> Config:
    """Build, override and validate a Config from a plain dict (what YAML gives)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    data = copy.deepcopy(data)
    for item in overrides:
        path, value = _parse_override(item, source)
        _apply_override(data, path, value)
    cfg = _build(Config, data, "", source)
    cfg.source = source
    validate(cfg, world_size, check_paths, training)
    return cfg


def load_config(path: str, overrides: Sequence[str] = (), world_size: Optional[int] = None,
                check_paths: bool = True, training: bool = True) -> Config:
    """Read a YAML file, apply ``section.key=value`` overrides and validate."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file does not exist")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    return config_from_dict(data, source=path, overrides=overrides, world_size=world_size,
                            check_paths=check_paths, training=training)


# ---------------------------------------------------------------- validation

def resolved_ffn_hidden(m: ModelConfig) -> int:
    """model.ffn_hidden, or its default: 4*d_model (gelu), 8/3*d_model rounded up to 64 (swiglu)."""
    if m.ffn_hidden is not None:
        return m.ffn_hidden
    if m.mlp == "gelu":
        return 4 * m.d_model
    return (8 * m.d_model + 191) // 192 * 64  # ceil(8*d/3 / 64) * 64


def ulysses_degree(p: ParallelConfig) -> int:
    """The Ulysses part u of the CP group (cp = u x ring): cp for 'ulysses', parallel.ulysses
    for 'hybrid', 1 for the ring and all-gather."""
    if p.cp_comm == "ulysses":
        return p.cp
    return (p.ulysses or 1) if p.cp_comm == "hybrid" else 1


def _check_cp_comm(p: ParallelConfig, m: ModelConfig, err) -> None:
    """parallel.cp_comm and parallel.ulysses against cp and the heads per TP rank."""
    if p.ulysses is not None and p.ulysses < 1:
        err(f"parallel.ulysses={p.ulysses} must be >= 1")
    if p.cp_comm in ("ring", "allgather") and p.ulysses not in (None, 1):
        err(f"parallel.ulysses={p.ulysses} is only used with parallel.cp_comm='ulysses' or "
            f"'hybrid' (parallel.cp_comm={p.cp_comm!r})")
    if p.cp_comm == "ulysses" and p.ulysses not in (None, p.cp):
        err(f"parallel.ulysses={p.ulysses} must equal parallel.cp={p.cp} with "
            f"parallel.cp_comm='ulysses' (a Ulysses degree below cp is cp_comm='hybrid')")
    if p.cp_comm == "hybrid" and (p.ulysses is None or p.cp % p.ulysses):
        err(f"parallel.cp_comm='hybrid' needs parallel.ulysses dividing parallel.cp={p.cp} "
            f"(ring = cp / ulysses), got parallel.ulysses={p.ulysses}")
    if p.ring_grad_dtype != "fp32" and p.cp_comm not in ("ring", "hybrid"):
        err(f"parallel.ring_grad_dtype={p.ring_grad_dtype!r} applies to the ring's dK,dV "
            f"(parallel.cp_comm 'ring' or 'hybrid'), not parallel.cp_comm={p.cp_comm!r}")
    u, heads = ulysses_degree(p), m.n_heads // p.tp
    if heads % u:
        err(f"model.n_heads={m.n_heads} / parallel.tp={p.tp} = {heads} heads per TP rank is "
            f"not divisible by the Ulysses degree {u} (parallel.cp_comm={p.cp_comm!r}, "
            f"parallel.cp={p.cp}, parallel.ulysses={p.ulysses})")


def validate(cfg: Config, world_size: Optional[int] = None, check_paths: bool = True,
             training: bool = True) -> None:
    """Every cross-field rule, in one place. Raises the first ConfigError found.

    check_paths=False skips the files the config points at (to validate a GPU config
    on a machine without its data set). training=False (generate.py) skips the rules only
    training needs: model.seq_len split into the layout's chunks (generation shards each
    prompt at its own padded length, and RoPE takes positions, not the trained length).
    """
    src, m, p, t = cfg.source, cfg.model, cfg.parallel, cfg.train

    def err(msg):
        raise ConfigError(f"{src}: {msg}")

    for key, allowed in CHOICES.items():
        section, *rest = key.split(".")
        value = getattr(cfg, section)
        for r in rest:
            value = getattr(value, r)
        if value not in allowed:
            err(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}")

    positive = {
        "model.vocab_size": m.vocab_size, "model.seq_len": m.seq_len,
        "model.n_layers": m.n_layers, "model.d_model": m.d_model, "model.n_heads": m.n_heads,
        "parallel.tp": p.tp, "parallel.cp": p.cp, "parallel.pp": p.pp,
        "train.steps": t.steps, "train.micro_batch_size": t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "checkpointing.every_n_layers": cfg.checkpointing.every_n_layers,
        "logging.log_interval": cfg.logging.log_interval,
    }
    for key, value in positive.items():
        if value < 1:
            err(f"{key}={value} must be >= 1")
    if p.dp != "auto" and (not isinstance(p.dp, int) or p.dp < 1):
        err(f"parallel.dp={p.dp!r} must be an integer >= 1 or 'auto'")
    for key, value in {"train.lr": t.lr, "train.min_lr": t.min_lr,
                       "train.warmup_steps": t.warmup_steps, "train.grad_clip": t.grad_clip,
                       "train.eval_interval": t.eval_interval,
                       "checkpointing.save_interval": cfg.checkpointing.save_interval}.items():
        if value < 0:
            err(f"{key}={value} must be >= 0")

    # Model shapes against the TP split.
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if m.d_model % m.n_heads:
        err(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
    if kv < 1 or m.n_heads % kv:
        err(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv}")
    if m.n_heads % p.tp:
        err(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}")
    if kv % p.tp and p.tp % kv:
        err(f"model.n_kv_heads={kv} and parallel.tp={p.tp}: kv heads must divide over tp "
            f"(kv % tp == 0) or be replicated (tp % kv == 0)")
    if m.vocab_size % p.tp:
        err(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp} "
            f"(pad the vocabulary)")
    if m.ffn_hidden is not None and (m.ffn_hidden < 1 or m.ffn_hidden % p.tp):
        err(f"model.ffn_hidden={m.ffn_hidden} must be >= 1 and divisible by parallel.tp={p.tp}")
    if m.ffn_hidden is None and resolved_ffn_hidden(m) % p.tp:
        err(f"model.ffn_hidden (default {resolved_ffn_hidden(m)} for mlp={m.mlp!r}) is not "
            f"divisible by parallel.tp={p.tp}; set model.ffn_hidden")
    if (m.d_model // m.n_heads) % 2:
        err(f"model.d_model/model.n_heads = {m.d_model // m.n_heads} must be even for RoPE")
    _check_cp_comm(p, m, err)
    if m.rope_theta <= 0:
        err(f"model.rope_theta={m.rope_theta} must be > 0")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling, err)

    # Sequence against the CP layout.
    chunks = num_chunks(p.cp, p.layout)
    if training and m.seq_len % chunks:
        err(f"model.seq_len={m.seq_len} is not divisible by {chunks} "
            f"(parallel.layout={p.layout!r} needs {'2*' if p.layout == 'zigzag' else ''}cp "
            f"chunks, parallel.cp={p.cp})")
    if m.n_layers < p.pp:
        err(f"model.n_layers={m.n_layers} < parallel.pp={p.pp}: each stage needs a block")

    # The grid order, the world and the batch: the checks init_parallel_state makes, here
    # before any process group exists. dp stays None when 'auto' and the world is unknown.
    try:
        parse_order(p.order)
        dp = (resolve_sizes(world_size, p.tp, p.cp, p.pp, p.dp)["dp"]
              if world_size is not None else None if p.dp == "auto" else p.dp)
    except ValueError as e:
        err(str(e))
    if p.pp > 1:  # DeepSpeed's pipeline has one 'data' axis: dp x cp must be one block of ranks
        from ..distributed.pipeline_parallel import pipeline_axes
        try:  # dp unknown ('auto' without a world size): assume it may exceed 1
            pipeline_axes(p.order, {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp or 2})
        except ValueError as e:
            err(f"{e} (parallel.pp={p.pp})")
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        err(f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size*dp = {t.micro_batch_size}*{dp}")

    # DeepSpeed section: what we know DeepSpeed will refuse, said up front.
    ds = cfg.deepspeed
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if p.pp > 1 and stage >= 2:
        err(f"deepspeed.zero_optimization.stage={stage} with parallel.pp={p.pp}: DeepSpeed's "
            f"pipeline engine supports ZeRO stage 0 or 1 only (use stage 1)")
    if stage == 3 and p.cp > 1 and not (ds.get("zero_optimization") or {}).get(
            "reduce_scatter", True):
        err(f"deepspeed.zero_optimization.reduce_scatter=false with stage 3 and "
            f"parallel.cp={p.cp}: DeepSpeed 0.19.8 then divides some gradient buckets by dp "
            f"and others by dp*cp, so no loss scaling is exact (leave reduce_scatter on)")
    _check_offload(ds.get("zero_optimization") or {}, stage, err)
    if (ds.get("bf16") or {}).get("enabled") and (ds.get("fp16") or {}).get("enabled"):
        err("deepspeed.bf16.enabled and deepspeed.fp16.enabled are both true")
    for key, want in (("train_micro_batch_size_per_gpu", t.micro_batch_size),
                      ("train_batch_size", t.global_batch_size)):
        if key in ds and ds[key] != want:
            err(f"deepspeed.{key}={ds[key]} disagrees with train ({want}); set it in train only")

    for key, value, want in (("model.init_from", m.init_from, os.path.isdir),
                             ("data.tokenizer", cfg.data.tokenizer, os.path.isfile)):
        if value is not None and check_paths and not want(value):
            err(f"{key}={value!r} does not exist (want a "
                f"{'folder' if want is os.path.isdir else 'file'})")
    if cfg.data.kind == "tokens":
        if not cfg.data.path:
            err("data.path must be set when data.kind='tokens'")
        for key in ("path", "eval_path") if check_paths else ():
            prefix = getattr(cfg.data, key)
            for ext in (".bin", ".idx") if prefix else ():
                if not os.path.isfile(prefix + ext):
                    err(f"data.{key}={prefix!r}: {prefix + ext} does not exist")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        err(f"data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1)")
    if cfg.data.eval_path and cfg.data.kind != "tokens":
        err(f"data.eval_path is set but data.kind={cfg.data.kind!r} (it is for 'tokens')")
    if cfg.data.kind == "passkey":
        if not 1 <= cfg.data.passkey_digits <= 6:
            err(f"data.passkey_digits={cfg.data.passkey_digits} must be in 1..6")
        from ..data.passkey import min_seq_len  # the needle + question + key must fit
        if m.seq_len < min_seq_len(cfg.data.passkey_digits):
            err(f"model.seq_len={m.seq_len} is too short for data.kind='passkey' with "
                f"{cfg.data.passkey_digits} digits (needs >= "
                f"{min_seq_len(cfg.data.passkey_digits)})")
        if m.vocab_size < 256:
            err(f"model.vocab_size={m.vocab_size} < 256: data.kind='passkey' is byte-level")
        from ..data.passkey import min_packed_seq_len
        need = min_packed_seq_len(cfg.data.passkey_digits, cfg.data.passkey_docs)
        if cfg.data.passkey_docs < 1 or m.seq_len < need:
            err(f"data.passkey_docs={cfg.data.passkey_docs} must be >= 1 and fit in "
                f"model.seq_len={m.seq_len} (needs >= {need})")
    _check_memory(cfg.memory, cfg.checkpointing, err)
    if cfg.data.eod_mask_loss and cfg.data.kind != "tokens":
        err(f"data.eod_mask_loss=true is for data.kind='tokens' (passkey labels only the "
            f"answer), not {cfg.data.kind!r}")


def _check_memory(mem: MemoryConfig, ckpt: CheckpointingConfig, err) -> None:
    """memory.*: tile sizes 'auto' or >= 1; offload needs something checkpointed to offload."""
    for key in ("loss_tile_tokens", "mlp_tile_tokens"):
        v = getattr(mem, key)
        if v != "auto" and (isinstance(v, str) or v < 1):
            err(f"memory.{key}={v!r} must be 'auto' or an integer >= 1")
    if mem.offload_activations and ckpt.activation == "none":
        err("memory.offload_activations=true needs checkpointing.activation 'full', "
            "'selective' or 'every_n_layers' (it offloads what checkpointing keeps; "
            "checkpointing.activation='none')")


def _check_offload(zero: Dict[str, Any], stage: int, err) -> None:
    """deepspeed.zero_optimization's offload keys: host (cpu) offload of the optimizer at
    ZeRO 1-3 and of the parameters at ZeRO 3, nothing ctxpar cannot hold exact
    (ctxpar/memory/optimizer.py; tests/test_train_memory.py)."""
    for old, new in (("cpu_offload", "offload_optimizer: {device: cpu}"),
                     ("cpu_offload_param", "offload_param: {device: cpu}"),
                     ("cpu_offload_use_pin_memory", "offload_optimizer: {pin_memory: true}")):
        if old in zero:
            err(f"deepspeed.zero_optimization.{old} is DeepSpeed's deprecated spelling; "
                f"write {new}")
    for key in ("offload_optimizer", "offload_param"):
        spec = zero.get(key)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            err(f"deepspeed.zero_optimization.{key}={spec!r} must be a mapping such as "
                f"{{device: cpu, pin_memory: true}}")
        device = spec.get("device", "none")
        if device not in ("none", "cpu"):
            err(f"deepspeed.zero_optimization.{key}.device={device!r} must be 'cpu' or 'none' "
                f"(NVMe swapping needs DeepSpeed's async_io op and is not tested with ctxpar)")
        if device == "none":
            continue
        if key == "offload_optimizer" and stage == 0:
            err("deepspeed.zero_optimization.offload_optimizer with stage=0: the offload "
                "lives in ZeRO's optimizer (stage 1, 2 or 3); at stage 0 DeepSpeed would "
                "silently keep the optimizer on the device")
        if key == "offload_param" and stage != 3:
            err(f"deepspeed.zero_optimization.offload_param with stage={stage}: only ZeRO-3 "
                f"partitions the parameters, so only it can offload them (use stage 3)")
    opt = zero.get("offload_optimizer") or {}
    if opt.get("device", "none") == "cpu" and (opt.get("ratio", 1.0) != 1.0
                                               or opt.get("super_offload", False)):
        err(f"deepspeed.zero_optimization.offload_optimizer.ratio={opt.get('ratio', 1.0)} / "
            f"super_offload={opt.get('super_offload', False)}: a partial or Superchip offload "
            f"runs DeepSpeedCPUAdam beside a device Adam, which ctxpar neither chooses nor "
            f"tests (leave ratio 1.0 and super_offload false)")


ROPE_SCALING_KEYS = {  # rope_type -> its numeric keys (Hugging Face's names)
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def _check_rope_scaling(rs: Dict[str, Any], err) -> None:
    kind = rs.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        err(f"model.rope_scaling.rope_type={kind!r} must be one of "
            f"{', '.join(map(repr, ROPE_SCALING_KEYS))}")
    want = {"rope_type", *ROPE_SCALING_KEYS[kind]}
    if set(rs) != want:
        err(f"model.rope_scaling for rope_type={kind!r} needs exactly the keys "
            f"{', '.join(sorted(want))} (got {', '.join(sorted(rs))})")
    for key in ROPE_SCALING_KEYS[kind]:
        v = rs[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            err(f"model.rope_scaling.{key}={v!r} must be a number > 0")
    if kind == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
        err(f"model.rope_scaling.high_freq_factor={rs['high_freq_factor']} must be > "
            f"low_freq_factor={rs['low_freq_factor']}")


# ---------------------------------------------------------------- derived views

def grad_accum_steps(cfg: Config, dp: int) -> int:
    """Micro-batches per optimizer step on each DP rank."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)


# ZeRO's buckets when the user sets none (deepspeed_config). DeepSpeed 0.19.8's defaults are
# sized for nothing in particular: reduce_bucket_size = allgather_bucket_size = 5e8 elements,
# and ZeRO 1/2 allocate a reduce buffer of that many elements (2 GB in fp32, twice with
# overlap_comm) whatever the model; ZeRO-3 keeps every gathered parameter that is used again
# within stage3_max_reuse_distance = 1e9 elements, i.e. a model of under ~5e8 parameters
# stays whole from forward to backward.
BUCKET_MIN = 40_000_000        # Megatron-Core's DDP bucket: max(4e7, 1e6 x dp) parameters
BUCKET_PER_RANK = 1_000_000    # (distributed_data_parallel_config.bucket_size)
BUCKET_MAX = 500_000_000       # DeepSpeed's reduce/allgather_bucket_size default: never more
PREFETCH_MAX = 50_000_000      # DeepSpeed's stage3_prefetch_bucket_size default: never more


def zero_bucket_size(zero_group: int) -> int:
    """Elements per ZeRO bucket: Megatron-Core's max(4e7, 1e6 x D) over the ZeRO group
    D = dp x cp (ctxpar/distributed/zero.py), at most DeepSpeed's 5e8. Larger groups get
    larger buckets so the collectives stay bandwidth-bound, not latency-bound (Megatron's
    reason)."""
    return min(max(BUCKET_MIN, BUCKET_PER_RANK * zero_group), BUCKET_MAX)


def zero_bucket_defaults(stage: int, zero_group: int) -> Dict[str, int]:
    """What deepspeed_config fills into zero_optimization when the user set none of it,
    with B = zero_bucket_size(D):

        stage 1, 2   reduce_bucket_size = allgather_bucket_size = B
        stage 3      reduce_bucket_size = B, stage3_prefetch_bucket_size = min(B, 5e7),
                     stage3_max_live_parameters = stage3_max_reuse_distance = 2 B
                     (the module running plus one prefetched bucket)

    Device bytes they bound: ZeRO 1/2 allocate a B-element reduce buffer of the gradients'
    dtype (the model's; at ZeRO-1 deepspeed.data_types.grad_accum_dtype when set), twice
    with overlap_comm; ZeRO-3 one B-element bucket, plus at most 2 B gathered parameters
    kept for reuse. Stage 0 has no buckets (DeepSpeed's all-reduce flattens the gradients
    it has)."""
    b = zero_bucket_size(zero_group)
    if stage in (1, 2):
        return {"reduce_bucket_size": b, "allgather_bucket_size": b}
    if stage == 3:
        return {"reduce_bucket_size": b,
                "stage3_prefetch_bucket_size": min(b, PREFETCH_MAX),
                "stage3_max_live_parameters": 2 * b, "stage3_max_reuse_distance": 2 * b}
    return {}


def deepspeed_config(cfg: Config, dp: int) -> Dict[str, Any]:
    """The ``deepspeed`` section with batch sizes and clipping filled in from ``train``, and
    ZeRO's bucket sizes from ``zero_bucket_defaults`` where the user set none (a key the
    user set, under either of DeepSpeed's names for it, always wins).

    DeepSpeed checks train_batch_size == micro * grad_accum * dp_world_size, where its
    dp world size comes from the mpu's data-parallel group (DP only; CP ranks share samples).
    With pp > 1 DeepSpeed's pipeline grid is the mpu and its data-parallel group is dp x cp
    (ctxpar/distributed/pipeline_parallel.py), so it counts cp times the samples:
    train_batch_size is scaled by cp for it; the samples per step are still
    train.global_batch_size.
    """
    ds = copy.deepcopy(cfg.deepspeed)
    ds["train_batch_size"] = cfg.train.global_batch_size * (
        cfg.parallel.cp if cfg.parallel.pp > 1 else 1)
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = grad_accum_steps(cfg, dp)
    ds.setdefault("gradient_clipping", cfg.train.grad_clip)
    ds.setdefault("steps_per_print", 10 ** 9)  # train.py logs; keep DeepSpeed quiet
    zero = ds.get("zero_optimization")
    if zero:
        for key, value in zero_bucket_defaults(int(zero.get("stage", 0)),
                                               dp * cfg.parallel.cp).items():
            if key not in zero and key.replace("stage3_", "") not in zero:
                zero[key] = value
    return ds


def to_dict(cfg: Config) -> Dict[str, Any]:
    """Plain nested dict (for dumping and wandb), without the internal fields."""
    out = dataclasses.asdict(cfg)
    out.pop("source", None)
    return out


def dump_config(cfg: Config, run_dir: str) -> str:
    """Write the config used for a run to <run_dir>/config.yaml; returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(tmp, path)
    return path
