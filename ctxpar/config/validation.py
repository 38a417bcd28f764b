"""Every cross-field rule of a Config, each in one place: ``validate`` runs the checks of
each section in turn and raises the first ConfigError it finds, before any process group
exists (config_from_dict calls it)."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from ..context_parallel.layouts import num_chunks
from ..distributed.parallel_state import parse_order, resolve_sizes
from ..context_parallel.linear.api import check_linear_cp
from .attention_heads import check_attention_heads
from .layer_mixers import has_linear_layers, token_mixers
from .linear_tiles import check_tiled_linear
from .kv_layers import check_kv_layers
from .layers import check_layers, gated_delta_dims, mamba_dims
from .compressed_layers import check_compressed_attention
from .dsa import check_dsa
from .mla import check_mla
from .pipeline_stages import check_mtp_stages, check_stages_hold_experts
from .moe import check_moe
from .hash_routing import check_hash_layers
from .hyper_connections import check_hyper_connections
from .mtp import check_mtp
from .sections import (CHOICES, HF_FAMILIES, ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL, Config,
                       ConfigError, ModelConfig, ParallelConfig, resolved_ffn_hidden,
                       resolved_head_dim, ulysses_degree)

Err = Callable[[str], None]

AT_LEAST_ONE = ("model.vocab_size", "model.seq_len", "model.n_layers", "model.d_model",
                "model.n_heads", "parallel.tp", "parallel.cp", "parallel.pp", "train.steps",
                "train.micro_batch_size", "train.global_batch_size",
                "activation_checkpointing.every_n_layers", "logging.log_interval")
AT_LEAST_ZERO = ("train.lr", "train.min_lr", "train.warmup_steps", "train.grad_clip",
                 "train.eval_interval", "checkpoint.save_interval")


def validate(cfg: Config, world_size: Optional[int] = None, check_paths: bool = True,
             training: bool = True) -> None:
    """Every cross-field rule, section by section. Raises the first ConfigError found.

    check_paths=False skips the files the config points at (to validate a GPU config
    on a machine without its data set). training=False (generate.py) skips the rules only
    training needs: model.seq_len split into the layout's chunks (generation shards each
    prompt at its own padded length, and RoPE takes positions, not the trained length).
    """
    def err(msg):
        raise ConfigError(f"{cfg.source}: {msg}")

    _check_choices_and_ranges(cfg, err)
    _check_model(cfg.model, cfg.parallel, err)
    _check_cp_comm(cfg.parallel, cfg.model, err)
    _check_linear_layers(cfg, err)
    _check_sequence(cfg.model, cfg.parallel, training, err)
    _check_grid_and_batch(cfg, world_size, err)
    check_moe(cfg, _resolved_dp(cfg, world_size), err)
    check_stages_hold_experts(cfg, err)
    check_mla(cfg.model, cfg.parallel.tp, err)
    check_dsa(cfg, err)
    check_compressed_attention(cfg, err)
    check_mtp(cfg, err)
    check_hyper_connections(cfg, err)
    check_hash_layers(cfg, err)
    check_mtp_stages(cfg, err)  # under the pipeline: the last stage's share
    _check_deepspeed(cfg, err)
    _check_paths(cfg, check_paths, err)
    _check_data(cfg, err)
    _check_dynamic_cp(cfg, err)
    _check_memory(cfg, err)
    check_tiled_linear(cfg, err)
    _check_long_context_eval(cfg, err)


def _value(cfg: Config, key: str) -> Any:
    """The value of a dotted key such as 'parallel.cp'."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _check_choices_and_ranges(cfg: Config, err: Err) -> None:
    """Each CHOICES key among its values; counts >= 1, rates and intervals >= 0."""
    for key, allowed in CHOICES.items():
        value = _value(cfg, key)
        if value not in allowed:
            err(f"{key}={value!r} must be one of {', '.join(map(repr, allowed))}")
    for keys, least in ((AT_LEAST_ONE, 1), (AT_LEAST_ZERO, 0)):
        for key in keys:
            value = _value(cfg, key)
            if value < least:
                err(f"{key}={value} must be >= {least}")
    dp = cfg.parallel.dp
    if dp != "auto" and (not isinstance(dp, int) or dp < 1):
        err(f"parallel.dp={dp!r} must be an integer >= 1 or 'auto'")


def _check_model(m: ModelConfig, p: ParallelConfig, err: Err) -> None:
    """The model's shapes against the TP split, and RoPE's."""
    kv = m.n_kv_heads if m.n_kv_heads is not None else m.n_heads
    if m.head_dim is None and m.d_model % m.n_heads:
        err(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads} "
            f"(or set model.head_dim)")
    if m.head_dim is not None and m.head_dim < 1:
        err(f"model.head_dim={m.head_dim} must be >= 1 (or null: d_model // n_heads)")
    if m.query_pre_attn_scalar is not None and m.query_pre_attn_scalar <= 0:
        err(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} must be > 0")
    if m.norm_offset != 0 and m.norm != "rmsnorm":
        err(f"model.norm_offset={m.norm_offset} applies to RMSNorm, not "
            f"model.norm={m.norm!r}")
    if m.family is not None and m.family not in HF_FAMILIES:
        err(f"model.family={m.family!r} must be one of {', '.join(map(repr, HF_FAMILIES))} "
            f"or null")
    if m.qk_norm and m.norm != "rmsnorm":
        err(f"model.qk_norm=true is an RMSNorm over each head; model.norm={m.norm!r}")
    if m.qk_norm_scope == "all_heads" and m.norm_offset:
        err(f"model.qk_norm_scope='all_heads' with model.norm_offset={m.norm_offset}: the "
            f"whole-projection q/k norm scales by its weight alone (OLMo 2's)")
    if m.qk_norm_scope == "all_heads" and (not m.qk_norm or kv % p.tp):
        err(f"model.qk_norm_scope='all_heads' needs model.qk_norm=true and the kv heads "
            f"split over TP (model.n_kv_heads={kv}, parallel.tp={p.tp}): its k weight is "
            f"split with them")
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
    if m.swiglu_limit is not None and (m.mlp != "swiglu" or not m.swiglu_limit > 0):
        err(f"model.swiglu_limit={m.swiglu_limit} needs model.mlp='swiglu' and a limit > 0 "
            f"(model.mlp={m.mlp!r})")
    if m.swiglu_limit is not None and m.moe is not None and m.moe.swiglu_limit is not None:
        err(f"model.swiglu_limit={m.swiglu_limit} (DeepSeek-V4's clamp) and "
            f"model.moe.swiglu_limit={m.moe.swiglu_limit} (gpt-oss's) are two forms: set one")
    if m.ffn_hidden is None and resolved_ffn_hidden(m) % p.tp:
        err(f"model.ffn_hidden (default {resolved_ffn_hidden(m)} for mlp={m.mlp!r}) is not "
            f"divisible by parallel.tp={p.tp}; set model.ffn_hidden")
    if not m.rope:  # NoPE: nothing to turn, scale or set per layer
        for key, off in (("rope_scaling", None), ("layer_rope", None),
                         ("partial_rotary_factor", 1.0)):
            if getattr(m, key) != off:
                err(f"model.{key}={getattr(m, key)!r} with model.rope=false: the attention "
                    f"layers have no RoPE")
    if m.rope and resolved_head_dim(m) % 2:
        err(f"model.head_dim={resolved_head_dim(m)} (model.head_dim or d_model/n_heads) must "
            f"be even for RoPE")
    rot = resolved_head_dim(m) * m.partial_rotary_factor
    if not 0 < m.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
        err(f"model.partial_rotary_factor={m.partial_rotary_factor} must be in (0, 1] and "
            f"turn an even number of head_dim={resolved_head_dim(m)} channels (it turns "
            f"{rot:g})")
    _check_nope_layers(m, err)
    if m.rope_theta <= 0:
        err(f"model.rope_theta={m.rope_theta} must be > 0")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling, err)
    check_layers(m, err)
    check_attention_heads(m, p.tp, err)
    check_kv_layers(m, p, err)
    for rope in (m.layer_rope or {}).values():
        if isinstance(rope, dict) and rope.get("rope_scaling") is not None:
            _check_rope_scaling(rope["rope_scaling"], err)


def _check_cp_comm(p: ParallelConfig, m: ModelConfig, err: Err) -> None:
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


def _check_linear_layers(cfg: Config, err: Err) -> None:
    """The linear mixers ('linear_attention', 'mamba') against the run: the CP strategy's
    rules (context_parallel.linear.check_linear_cp), and what is not built for them yet,
    refused by key rather than run wrong."""
    m, p = cfg.model, cfg.parallel
    if not has_linear_layers(m):
        return
    mixers, heads, split = token_mixers(m), [], []
    if mixers & {"gated_delta", "kda"}:
        g = gated_delta_dims(m)
        heads.append(("model.linear_num_value_heads", g.num_value_heads, g.chunk_size))
        split += [("model.linear_num_key_heads", g.num_key_heads),
                  ("model.linear_num_value_heads", g.num_value_heads)]
    if "mamba2" in mixers:
        d = mamba_dims(m)
        heads.append(("model.mamba_num_heads", d.num_heads, d.chunk_size))
        split += [("model.mamba_num_heads", d.num_heads), ("model.n_groups", d.n_groups)]
    for key, n in split:  # TP splits the mixers by heads (and Mamba2's B/C groups)
        if n % p.tp:
            err(f"{key}={n} is not divisible by parallel.tp={p.tp} (TP splits the linear "
                f"mixers by heads)")
    for key, n, chunk in heads:  # 'heads' moves each TP rank's heads over CP
        try:
            check_linear_cp(p.linear_cp, p.layout, max(n // p.tp, 1), p.cp, chunk,
                            key if p.tp == 1 else f"{key} / parallel.tp")
        except ValueError as e:
            err(f"parallel.linear_cp={p.linear_cp!r}, parallel.layout={p.layout!r}, "
                f"parallel.cp={p.cp}: {str(e).replace('strategy=', 'parallel.linear_cp=')}")
    linear = ("model.layer_types has 'linear_attention', 'kimi_delta_attention' or 'mamba' "
              "layers")
    unbuilt = [
        (cfg.data.dynamic_cp and p.linear_cp == "heads",
         "data.dynamic_cp=true and parallel.linear_cp='heads': dynamic CP's pack sizes "
         "(1 to the DP x CP ranks) need not divide the linear heads; 'state' takes any"),
        (p.cp_comm == "hybrid" and p.layout == "striped",
         "parallel.cp_comm='hybrid' with parallel.layout='striped': its two-level layout "
         "is not the linear mixers' striped layout"),
    ]
    for refused, why in unbuilt:
        if refused:
            err(f"{linear}; not built with {why}")


def _check_sequence(m: ModelConfig, p: ParallelConfig, training: bool, err: Err) -> None:
    """The sequence against the CP layout's chunks, the layers against the pipeline."""
    chunks = num_chunks(p.cp, p.layout)
    if training and m.seq_len % chunks:
        err(f"model.seq_len={m.seq_len} is not divisible by {chunks} "
            f"(parallel.layout={p.layout!r} needs {'2*' if p.layout == 'zigzag' else ''}cp "
            f"chunks, parallel.cp={p.cp})")
    if m.n_layers < p.pp:
        err(f"model.n_layers={m.n_layers} < parallel.pp={p.pp}: each stage needs a block")


def _resolved_dp(cfg: Config, world_size: Optional[int]) -> Optional[int]:
    """parallel.dp as a number (None: 'auto' with the world unknown); ValueError when the
    world does not hold the grid (_check_grid_and_batch reports it first)."""
    p = cfg.parallel
    if world_size is not None:
        return resolve_sizes(world_size, p.tp, p.cp, p.pp, p.dp)["dp"]
    return None if p.dp == "auto" else p.dp


def _check_grid_and_batch(cfg: Config, world_size: Optional[int], err: Err) -> None:
    """The grid order, the world and the batch: the checks init_parallel_state makes, here
    before any process group exists. dp stays None when 'auto' and the world is unknown."""
    p, t = cfg.parallel, cfg.train
    try:
        parse_order(p.order)
        dp = _resolved_dp(cfg, world_size)
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


def _check_deepspeed(cfg: Config, err: Err) -> None:
    """The deepspeed section: what we know DeepSpeed will refuse, said up front."""
    ds, p, t = cfg.deepspeed, cfg.parallel, cfg.train
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if p.pp > 1 and stage >= 2:
        err(f"deepspeed.zero_optimization.stage={stage} with parallel.pp={p.pp}: DeepSpeed's "
            f"pipeline engine supports ZeRO stage 0 or 1 only (use stage 1)")
    if stage == 3 and p.cp > 1 and not zero.get("reduce_scatter", True):
        err(f"deepspeed.zero_optimization.reduce_scatter=false with stage 3 and "
            f"parallel.cp={p.cp}: DeepSpeed 0.19.8 then divides some gradient buckets by dp "
            f"and others by dp*cp, so no loss scaling is exact (leave reduce_scatter on)")
    _check_offload(zero, stage, err)
    if (ds.get("bf16") or {}).get("enabled") and (ds.get("fp16") or {}).get("enabled"):
        err("deepspeed.bf16.enabled and deepspeed.fp16.enabled are both true")
    for key, want in (("train_micro_batch_size_per_gpu", t.micro_batch_size),
                      ("train_batch_size", t.global_batch_size)):
        if key in ds and ds[key] != want:
            err(f"deepspeed.{key}={ds[key]} disagrees with train ({want}); set it in train only")


def _check_paths(cfg: Config, check_paths: bool, err: Err) -> None:
    """The files and folders the config points at exist (unless check_paths is off)."""
    if not check_paths:
        return
    for key, value, want in (("model.init_from", cfg.model.init_from, os.path.isdir),
                             ("data.tokenizer", cfg.data.tokenizer, os.path.isfile)):
        if value is not None and not want(value):
            err(f"{key}={value!r} does not exist (want a "
                f"{'folder' if want is os.path.isdir else 'file'})")
    if cfg.data.kind != "tokens":
        return
    for key in ("path", "eval_path"):
        prefix = getattr(cfg.data, key)
        for ext in (".bin", ".idx") if prefix else ():
            if not os.path.isfile(prefix + ext):
                err(f"data.{key}={prefix!r}: {prefix + ext} does not exist")


def _check_data(cfg: Config, err: Err) -> None:
    """The data section against its kind: token files, or the passkey task fitting the
    sequence and the byte-level vocabulary."""
    data, m = cfg.data, cfg.model
    if data.kind == "tokens" and not data.path:
        err("data.path must be set when data.kind='tokens'")
    if not 0.0 <= data.eval_fraction < 1.0:
        err(f"data.eval_fraction={data.eval_fraction} must be in [0, 1)")
    if data.eval_path and data.kind != "tokens":
        err(f"data.eval_path is set but data.kind={data.kind!r} (it is for 'tokens')")
    if data.kind == "passkey":
        if not 1 <= data.passkey_digits <= 6:
            err(f"data.passkey_digits={data.passkey_digits} must be in 1..6")
        from ..data.passkey import min_packed_seq_len, min_seq_len
        if m.seq_len < min_seq_len(data.passkey_digits):  # needle + question + key must fit
            err(f"model.seq_len={m.seq_len} is too short for data.kind='passkey' with "
                f"{data.passkey_digits} digits (needs >= {min_seq_len(data.passkey_digits)})")
        if m.vocab_size < 256:
            err(f"model.vocab_size={m.vocab_size} < 256: data.kind='passkey' is byte-level")
        need = min_packed_seq_len(data.passkey_digits, data.passkey_docs)
        if data.passkey_docs < 1 or m.seq_len < need:
            err(f"data.passkey_docs={data.passkey_docs} must be >= 1 and fit in "
                f"model.seq_len={m.seq_len} (needs >= {need})")
    if data.eod_mask_loss and data.kind != "tokens":
        err(f"data.eod_mask_loss=true is for data.kind='tokens' (passkey labels only the "
            f"answer), not {data.kind!r}")


def _check_dynamic_cp(cfg: Config, err: Err) -> None:
    """data.dynamic_cp: what the schedule's packs need of the rest of the run."""
    data, p = cfg.data, cfg.parallel
    if not data.dynamic_cp:
        for key, value, default in (("tokens_per_rank", data.tokens_per_rank, None),
                                    ("dynamic_cp_schedule", data.dynamic_cp_schedule,
                                     "balanced"),
                                    ("dynamic_cp_window", data.dynamic_cp_window, 1)):
            if value != default:
                err(f"data.{key}={value} is for data.dynamic_cp=true")
        return
    why = None
    if data.kind != "tokens":
        why = f"data.kind={data.kind!r}: it takes whole documents of a token file ('tokens')"
    elif p.pp > 1:
        why = (f"parallel.pp={p.pp}: the pipeline runs the same micro-batches on every "
               f"stage, but each rank runs its own number of packs")
    elif data.tokens_per_rank is not None and data.tokens_per_rank < 2:
        why = f"data.tokens_per_rank={data.tokens_per_rank} must be >= 2"
    elif data.dynamic_cp_schedule not in ("balanced", "static"):
        why = (f"data.dynamic_cp_schedule={data.dynamic_cp_schedule!r}: choose 'balanced' "
               f"or 'static'")
    elif data.dynamic_cp_window < 1:
        why = f"data.dynamic_cp_window={data.dynamic_cp_window} must be >= 1"

    if why:
        err(f"data.dynamic_cp=true with {why}")


def _check_memory(cfg: Config, err: Err) -> None:
    """memory.*: tile sizes 'auto' or >= 1; offload needs something checkpointed to offload."""
    mem = cfg.memory
    for key in ("loss_tile_tokens", "mlp_tile_tokens"):
        v = getattr(mem, key)
        if v != "auto" and (isinstance(v, str) or v < 1):
            err(f"memory.{key}={v!r} must be 'auto' or an integer >= 1")
    cap = cfg.model.final_logit_softcapping
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or cap <= 0):
        err(f"model.final_logit_softcapping={cap!r} must be a number > 0 (or null: none)")
    elif cap is not None and mem.tiled_loss:
        err(f"model.final_logit_softcapping={cap} with memory.tiled_loss=true: the tiled "
            f"loss makes its logits uncapped; set memory.tiled_loss false")
    if mem.offload_activations and cfg.activation_checkpointing.mode == "none":
        err("memory.offload_activations=true needs activation_checkpointing.mode 'full', "
            "'selective' or 'every_n_layers' (it offloads what checkpointing keeps; "
            "activation_checkpointing.mode='none')")


def _check_offload(zero: Dict[str, Any], stage: int, err: Err) -> None:
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


def _check_rope_scaling(rs: Dict[str, Any], err: Err) -> None:
    """model.rope_scaling: Hugging Face's keys for its rope_type, each a number > 0
    (yarn's truncate true or false)."""
    kind = rs.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        err(f"model.rope_scaling.rope_type={kind!r} must be one of "
            f"{', '.join(map(repr, ROPE_SCALING_KEYS))}")
    want = {"rope_type", *ROPE_SCALING_KEYS[kind]}
    optional = set(ROPE_SCALING_OPTIONAL.get(kind, ()))
    if not want <= set(rs) <= want | optional:
        need = (f"the keys {', '.join(sorted(want))} and may have "
                f"{', '.join(sorted(optional))}" if optional
                else f"exactly the keys {', '.join(sorted(want))}")
        err(f"model.rope_scaling for rope_type={kind!r} needs {need} "
            f"(got {', '.join(sorted(rs))})")
    for key in sorted(set(rs) - {"rope_type"}):
        v = rs[key]
        if key == "truncate":
            if not isinstance(v, bool):
                err(f"model.rope_scaling.truncate={v!r} must be true or false")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            err(f"model.rope_scaling.{key}={v!r} must be a number > 0")
    if kind == "llama3" and rs["high_freq_factor"] < rs["low_freq_factor"]:
        err(f"model.rope_scaling.high_freq_factor={rs['high_freq_factor']} must be >= "
            f"low_freq_factor={rs['low_freq_factor']} (equal: no blended band, Llama 4's)")


def _check_long_context_eval(cfg: Config, err: Err) -> None:
    """long_context_eval: known tasks, counts >= 1, depths in [0, 1]; and the runs whose
    training model generation cannot use as it is (tools/long_context_eval.py evaluates
    their checkpoints instead)."""
    from ..data.long_context import TASKS

    lc, p = cfg.long_context_eval, cfg.parallel
    bad = [t for t in lc.tasks if t not in TASKS]
    if bad:
        err(f"long_context_eval.tasks: unknown {bad}; choose from {list(TASKS)}")
    for key in ("samples", "needles"):
        if getattr(lc, key) < 1:
            err(f"long_context_eval.{key}={getattr(lc, key)} must be >= 1")
    if lc.digits is not None and not 1 <= lc.digits <= 9:
        err(f"long_context_eval.digits={lc.digits} must be in 1..9")
    if any(n < 1 for n in lc.lengths):
        err(f"long_context_eval.lengths={lc.lengths} must all be >= 1")
    if any(not 0.0 <= d <= 1.0 for d in lc.depths) or not lc.depths:
        err(f"long_context_eval.depths={lc.depths} must be values in [0, 1]")
    if not lc.tasks:
        return
    stage = cfg.deepspeed.get("zero_optimization", {}).get("stage", 0)
    why = ("parallel.pp={} (generation runs the whole model on each rank)".format(p.pp)
           if p.pp > 1 else
           "parallel.cp_comm={!r} (generation prefills with the ring)".format(p.cp_comm)
           if p.cp_comm != "ring" else
           "ZeRO stage 3 (partitioned weights)" if stage == 3 else None)
    if why:
        err(f"long_context_eval.tasks={lc.tasks} cannot run inside training with {why}: "
            f"evaluate the checkpoints with tools/long_context_eval.py")


def _check_nope_layers(m, err) -> None:
    """model.nope_layers, attn_temperature_tuning and qk_l2_norm (Llama 4's), one line each."""
    nope = m.nope_layers or []
    if m.nope_layers is not None and (not isinstance(nope, list) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < m.n_layers
            for i in nope) or len(set(nope)) != len(nope)):
        err(f"model.nope_layers={m.nope_layers!r} must list distinct layer indices in "
            f"[0, {m.n_layers})")
    if m.attn_temperature_tuning and m.rope and not nope:
        err("model.attn_temperature_tuning=true scales the NoPE layers' queries: set "
            "model.nope_layers (or model.rope=false)")
    if m.floor_scale < 1 or m.attn_scale < 0:
        err(f"model.floor_scale={m.floor_scale} must be >= 1 and model.attn_scale="
            f"{m.attn_scale} >= 0")
    if m.qk_l2_norm and (m.qk_norm or not m.rope):
        err(f"model.qk_l2_norm=true with model.qk_norm={m.qk_norm}, model.rope={m.rope}: "
            f"Llama 4's weightless q/k norm is on its RoPE layers, instead of qk_norm")
