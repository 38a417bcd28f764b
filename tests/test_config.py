"""Config loading and validation: pure, no processes, no collectives."""
import dataclasses
import glob
import logging
import os
import re

import pytest
import yaml

from ctxpar.config import (CHOICES, RENAMED_KEYS, ConfigError, config_from_dict,
                           deepspeed_config, dump_config, load_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


@pytest.mark.quick
@pytest.mark.parametrize("data,world,msg", [
    ({"modle": {}}, None, "unknown config key 'modle' (did you mean 'model'?)"),
    ({"model": {"n_head": 4}}, None, "unknown config key 'model.n_head' (did you mean 'model.n_heads'?)"),
    ({"model": {"n_heads": "four"}}, None, "model.n_heads='four' must be an integer"),
    ({"train": {"lr": "fast"}}, None, "train.lr='fast' must be a number"),
    ({"model": {"tie_embeddings": 1}}, None, "model.tie_embeddings=1 must be true or false"),
    ({"model": {"n_heads": 6, "d_model": 96}, "parallel": {"tp": 4}}, None,
     "model.n_heads=6 is not divisible by parallel.tp=4"),
    ({"model": {"d_model": 65, "n_heads": 4}}, None,
     "model.d_model=65 is not divisible by model.n_heads=4"),
    ({"model": {"n_heads": 8, "n_kv_heads": 3, "d_model": 64}}, None,
     "model.n_heads=8 is not divisible by model.n_kv_heads=3"),
    ({"model": {"n_heads": 12, "n_kv_heads": 6, "d_model": 96}, "parallel": {"tp": 4}}, None,
     "model.n_kv_heads=6 and parallel.tp=4"),
    ({"model": {"seq_len": 100}, "parallel": {"cp": 4}}, None,
     "model.seq_len=100 is not divisible by 8 (parallel.layout='zigzag'"),
    ({"parallel": {"layout": "zigzig"}}, None, "parallel.layout='zigzig' must be one of"),
    ({"parallel": {"tp": 2, "cp": 2}}, 6, "world size 6 is not divisible by parallel.tp*cp*pp = 2*2*1 = 4"),
    ({"parallel": {"cp": 2, "dp": 3}}, 4, "parallel.tp*cp*pp*dp = 1*2*1*3 = 6 does not equal the world size 4"),
    ({"train": {"global_batch_size": 6, "micro_batch_size": 2}, "parallel": {"cp": 1}}, 2,
     "train.global_batch_size=6 is not divisible by train.micro_batch_size*dp = 2*2"),
    ({"parallel": {"pp": 2}, "deepspeed": {"zero_optimization": {"stage": 2}}}, None,
     "deepspeed.zero_optimization.stage=2 with parallel.pp=2"),
    ({"parallel": {"cp": 2}, "deepspeed": {"zero_optimization": {"stage": 3,
                                                                 "reduce_scatter": False}}},
     None, "deepspeed.zero_optimization.reduce_scatter=false with stage 3 and parallel.cp=2"),
    ({"data": {"kind": "tokens", "path": "/nonexistent/corpus"}}, None,
     "data.path='/nonexistent/corpus': /nonexistent/corpus.bin does not exist"),
    ({"parallel": {"tp": 0}}, None, "parallel.tp=0 must be >= 1"),
    ({"parallel": {"order": "tp-cp-dp"}}, None, "parallel.order='tp-cp-dp' must name each"),
    # Context-parallel communication: every combination that cannot run, in one line.
    ({"parallel": {"cp_comm": "p2p"}}, None, "parallel.cp_comm='p2p' must be one of 'ring', "
     "'allgather', 'ulysses', 'hybrid'"),
    ({"parallel": {"cp": 4, "ulysses": 2}}, None, "parallel.ulysses=2 is only used with "
     "parallel.cp_comm='ulysses' or 'hybrid' (parallel.cp_comm='ring')"),
    ({"parallel": {"cp": 4, "ulysses": 2, "cp_comm": "allgather"}}, None,
     "(parallel.cp_comm='allgather')"),
    ({"parallel": {"cp": 4, "ulysses": 2, "cp_comm": "ulysses"}}, None,
     "parallel.ulysses=2 must equal parallel.cp=4 with parallel.cp_comm='ulysses'"),
    ({"parallel": {"cp": 4, "cp_comm": "hybrid"}}, None, "parallel.cp_comm='hybrid' needs "
     "parallel.ulysses dividing parallel.cp=4 (ring = cp / ulysses), got parallel.ulysses=None"),
    ({"parallel": {"cp": 4, "ulysses": 3, "cp_comm": "hybrid"}}, None,
     "dividing parallel.cp=4 (ring = cp / ulysses), got parallel.ulysses=3"),
    ({"parallel": {"cp": 4, "ulysses": 0, "cp_comm": "hybrid"}}, None,
     "parallel.ulysses=0 must be >= 1"),
    ({"model": {"n_heads": 4}, "parallel": {"tp": 2, "cp": 4, "cp_comm": "ulysses"}}, None,
     "model.n_heads=4 / parallel.tp=2 = 2 heads per TP rank is not divisible by the Ulysses "
     "degree 4 (parallel.cp_comm='ulysses', parallel.cp=4, parallel.ulysses=None)"),
    ({"model": {"n_heads": 6, "d_model": 96}, "parallel": {"cp": 8, "ulysses": 4,
                                                          "cp_comm": "hybrid"}}, None,
     "model.n_heads=6 / parallel.tp=1 = 6 heads per TP rank is not divisible by the Ulysses "
     "degree 4 (parallel.cp_comm='hybrid'"),
    ({"model": {"seq_len": 100}, "parallel": {"cp": 4, "ulysses": 2, "cp_comm": "hybrid"}},
     None, "model.seq_len=100 is not divisible by 8 (parallel.layout='zigzag'"),
    ({"parallel": {"ring_grad_dtype": "fp16"}}, None,
     "parallel.ring_grad_dtype='fp16' must be one of 'fp32', 'bf16'"),
    ({"parallel": {"cp": 4, "cp_comm": "allgather", "ring_grad_dtype": "bf16"}}, None,
     "parallel.ring_grad_dtype='bf16' applies to the ring's dK,dV (parallel.cp_comm 'ring' "
     "or 'hybrid'), not parallel.cp_comm='allgather'"),
    # ZeRO-Offload: what ctxpar cannot hold exact is refused (ctxpar/memory/optimizer.py).
    ({"deepspeed": {"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/nvme"}}}}, None,
     "deepspeed.zero_optimization.offload_optimizer.device='nvme' must be 'cpu' or 'none'"),
    ({"deepspeed": {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}},
     None, "deepspeed.zero_optimization.offload_optimizer with stage=0: the offload lives in "
           "ZeRO's optimizer (stage 1, 2 or 3)"),
    ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}},
     None, "deepspeed.zero_optimization.offload_param with stage=2: only ZeRO-3 partitions"),
    ({"deepspeed": {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5}}}}, None,
     "deepspeed.zero_optimization.offload_optimizer.ratio=0.5 / super_offload=False"),
    ({"deepspeed": {"zero_optimization": {"stage": 2, "cpu_offload": True}}}, None,
     "deepspeed.zero_optimization.cpu_offload is DeepSpeed's deprecated spelling; write "
     "offload_optimizer: {device: cpu}"),
    ({"deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}}, None,
     "deepspeed.zero_optimization.offload_optimizer='cpu' must be a mapping"),
    ({"parallel": {"attention_backend": "flash"}}, None, "parallel.attention_backend='flash' "
     "must be one of 'auto', 'flash_attn', 'flash_attn4', 'sdpa', 'math'"),
    # The old checkpointing section: a key it never had, or a key given in both spellings.
    ({"checkpointing": {"activaton": "full"}}, None, "unknown config key "
     "'checkpointing.activaton' (the deprecated section 'checkpointing' became "
     "activation_checkpointing.mode, activation_checkpointing.every_n_layers, "
     "checkpoint.save_dir, checkpoint.save_interval)"),
    ({"checkpointing": {"save_dir": "a"}, "checkpoint": {"save_dir": "b"}}, None,
     "checkpointing.save_dir and checkpoint.save_dir are both set"),
    # Attention kinds (ctxpar/config/layers.py): windows, chunks, layer types, RoPE per type.
    ({"model": {"sliding_window": 0}}, None, "model.sliding_window=0 must be >= 1"),
    ({"model": {"attention_chunk_size": -8}}, None, "model.attention_chunk_size=-8 must be >= 1"),
    ({"model": {"layer_types": ["full_attention"]}}, None,
     "model.layer_types has 1 entries; model.n_layers=2 needs one per layer"),
    ({"model": {"layer_types": ["full_attention", "local"]}}, None,
     "model.layer_types: unknown type(s) ['local']; choose from ['full_attention', "
     "'sliding_attention', 'chunked_attention', 'linear_attention', 'kimi_delta_attention', "
     "'mamba', 'attention', 'mlp', 'compressed_sparse_attention', "
     "'heavily_compressed_attention']"),
    ({"model": {"layer_types": ["full_attention", "sliding_attention"]}}, None,
     "model.layer_types has 'sliding_attention' layers but model.sliding_window is not set"),
    ({"model": {"layer_types": ["full_attention"] * 2, "sliding_window": 8}}, None,
     "model.sliding_window=8 is set but no layer in model.layer_types is 'sliding_attention'"),
    ({"model": {"sliding_window": 8, "attention_chunk_size": 16}}, None,
     "both set: say which layers take which in model.layer_types"),
    ({"model": {"sliding_window": 8, "layer_rope": {"full_attention": {"rope_theta": 1.0}}}},
     None, "model.layer_rope.full_attention is set but no layer is 'full_attention'"),
    ({"model": {"sliding_window": 8, "layer_rope": {"sliding_attention": {"base": 1.0}}}},
     None, "model.layer_rope.sliding_attention={'base': 1.0} must be a mapping of rope_theta"),
    ({"model": {"layer_types": "sliding_attention"}}, None, "model.layer_types must be a list"),
    ({"model": {"rope": False, "partial_rotary_factor": 0.5}}, None,
     "model.partial_rotary_factor=0.5 with model.rope=false: the attention layers have no "
     "RoPE"),
    ({"model": {"rope": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}}, None,
     "model.rope_scaling={'factor': 2.0, 'rope_type': 'linear'} with model.rope=false"),
    # long_context_eval: known tasks, and only where the training model can generate.
    ({"long_context_eval": {"tasks": ["needles"]}}, None,
     "long_context_eval.tasks: unknown ['needles']; choose from ['needle', 'multikey',"),
    ({"long_context_eval": {"tasks": ["needle"], "depths": [0.5, 2]}}, None,
     "long_context_eval.depths=[0.5, 2.0] must be values in [0, 1]"),
    ({"long_context_eval": {"tasks": ["needle"]}, "parallel": {"pp": 2}}, None,
     "long_context_eval.tasks=['needle'] cannot run inside training with parallel.pp=2 "
     "(generation runs the whole model on each rank): evaluate the checkpoints with "
     "tools/long_context_eval.py"),
    ({"long_context_eval": {"tasks": ["needle"]},
      "deepspeed": {"zero_optimization": {"stage": 3}}}, None, "with ZeRO stage 3"),
])
def test_bad_configs_name_file_key_and_values(tmp_path, data, world, msg):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=world)
    text = str(e.value)
    assert text.startswith(path + ": "), text
    assert msg in text, text
    assert "\n" not in text  # one line


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = _write(tmp_path, "model: {n_heads: 4\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"malformed YAML \(line"):
        load_config(bad)


@pytest.mark.quick
def test_overrides_and_deepspeed_fill(tmp_path):
    path = _write(tmp_path, {"parallel": {"cp": 2}, "train": {"global_batch_size": 8, "lr": "3e-4"},
                             "deepspeed": {"bf16": {"enabled": True}}})
    cfg = load_config(path, overrides=["parallel.cp=4", "train.steps=10", "logging.wandb.mode=disabled"],
                      world_size=8)
    assert cfg.parallel.cp == 4 and cfg.train.steps == 10 and cfg.train.lr == 3e-4
    assert cfg.logging.wandb.mode == "disabled"
    ds = deepspeed_config(cfg, dp=2)
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 1.0
    with pytest.raises(ConfigError, match="unknown config key 'train.stpes'"):
        load_config(path, overrides=["train.stpes=3"])
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(path, overrides=["train.steps"])


@pytest.mark.parametrize("zero,cp,want", [
    # ZeRO group D = dp 2 x cp: B = max(4e7, 1e6 D), at most 5e8 (config.zero_bucket_size)
    ({"stage": 1}, 2, {"reduce_bucket_size": 40_000_000, "allgather_bucket_size": 40_000_000}),
    ({"stage": 2}, 64, {"reduce_bucket_size": 128_000_000,
                        "allgather_bucket_size": 128_000_000}),
    ({"stage": 2}, 512, {"reduce_bucket_size": 500_000_000}),
    ({"stage": 3}, 2, {"reduce_bucket_size": 40_000_000, "stage3_prefetch_bucket_size": 40_000_000,
                       "stage3_max_live_parameters": 80_000_000,
                       "stage3_max_reuse_distance": 80_000_000}),
    ({"stage": 3}, 64, {"stage3_prefetch_bucket_size": 50_000_000}),  # DeepSpeed's: no more
    # the user's values win, under either of DeepSpeed's names
    ({"stage": 1, "reduce_bucket_size": 12345}, 2, {"reduce_bucket_size": 12345,
                                                    "allgather_bucket_size": 40_000_000}),
    ({"stage": 3, "prefetch_bucket_size": 7}, 2, {"prefetch_bucket_size": 7}),
    ({"stage": 0}, 2, {"stage": 0}),  # no ZeRO, no buckets
])
def test_zero_bucket_defaults(zero, cp, want):
    cfg = config_from_dict({"model": {"n_heads": 4, "seq_len": 4096}, "train": {
        "global_batch_size": 8}, "parallel": {"cp": cp, "dp": 2},
        "deepspeed": {"zero_optimization": zero}})
    got = deepspeed_config(cfg, dp=2)["zero_optimization"]
    assert {k: got.get(k) for k in want} == want, got
    if zero["stage"] == 0:
        assert got == zero
    if "prefetch_bucket_size" in zero:  # not also set under the other name
        assert "stage3_prefetch_bucket_size" not in got
    assert deepspeed_config(config_from_dict({}), dp=1).get("zero_optimization") is None


@pytest.mark.parametrize("parallel,u", [
    (dict(cp=4), 1), (dict(cp=4, cp_comm="allgather"), 1), (dict(cp=4, cp_comm="ulysses"), 4),
    (dict(cp=4, cp_comm="ulysses", ulysses=4), 4), (dict(cp=8, cp_comm="hybrid", ulysses=2), 2),
    (dict(cp=4, cp_comm="hybrid", ulysses=1), 1),  # degenerate: the ring
    (dict(cp=4, cp_comm="hybrid", ulysses=4), 4),  # degenerate: Ulysses
    # kv heads per TP rank fewer than the Ulysses degree: replicated, not refused
    (dict(cp=4, cp_comm="ulysses", tp=2, _model=dict(n_heads=8, n_kv_heads=2)), 4),
])
def test_cp_comm_combinations_that_run(parallel, u):
    from ctxpar.config import ulysses_degree
    model = {"n_heads": 4, "d_model": 64, **parallel.pop("_model", {})}
    cfg = config_from_dict({"model": model, "parallel": parallel})
    assert ulysses_degree(cfg.parallel) == u


def test_dump_roundtrip(tmp_path):
    cfg = config_from_dict({"model": {"n_layers": 3}, "parallel": {"cp": 2}})
    out = dump_config(cfg, str(tmp_path / "run"))
    again = load_config(out)
    assert again.model.n_layers == 3 and again.parallel.cp == 2


OLD_SPELLING = {"checkpointing": {"activation": "every_n_layers", "every_n_layers": 2,
                                  "save_dir": "ck", "save_interval": 5}}
NEW_SPELLING = {"activation_checkpointing": {"mode": "every_n_layers", "every_n_layers": 2},
                "checkpoint": {"save_dir": "ck", "save_interval": 5}}


def test_the_old_checkpointing_section_loads_to_the_same_config_with_one_notice(
        tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    new_path, old_path = _write(tmp_path, NEW_SPELLING, "new.yaml"), \
        _write(tmp_path, OLD_SPELLING, "old.yaml")
    with caplog.at_level(logging.WARNING, logger="ctxpar.config"):
        new = load_config(new_path)
        assert caplog.records == []
        old = load_config(old_path)
    assert dataclasses.replace(old, source=new_path) == new
    assert [r.getMessage() for r in caplog.records] == [
        f"{old_path}: deprecated config keys, still read: checkpointing.activation -> "
        f"activation_checkpointing.mode, checkpointing.every_n_layers -> "
        f"activation_checkpointing.every_n_layers, checkpointing.save_dir -> "
        f"checkpoint.save_dir, checkpointing.save_interval -> checkpoint.save_interval"]
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # every rank loads the config; rank 0 says it
    with caplog.at_level(logging.WARNING, logger="ctxpar.config"):
        load_config(old_path)
    assert caplog.records == []


def test_old_spelling_overrides_set_the_new_keys(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    path = _write(tmp_path, NEW_SPELLING)
    with caplog.at_level(logging.WARNING, logger="ctxpar.config"):
        cfg = load_config(path, overrides=["checkpointing.activation=full",
                                           "checkpointing.save_interval=7"])
    assert cfg.activation_checkpointing.mode == "full" and cfg.checkpoint.save_interval == 7
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: --set: deprecated config keys, still read: checkpointing.activation -> "
        f"activation_checkpointing.mode, checkpointing.save_interval -> checkpoint.save_interval"]
    # A new-spelling override wins over the file's old section, as over any file key.
    old = load_config(_write(tmp_path, OLD_SPELLING, "old.yaml"),
                      overrides=["activation_checkpointing.mode=selective"])
    assert old.activation_checkpointing.mode == "selective" and old.checkpoint.save_dir == "ck"


def test_choices_are_the_implementing_modules_own():
    from ctxpar.context_parallel.kernels import BACKENDS
    from ctxpar.context_parallel.ring import GRAD_DTYPES
    assert CHOICES["parallel.attention_backend"] == ("auto", *BACKENDS)
    assert CHOICES["parallel.ring_grad_dtype"] == tuple(GRAD_DTYPES)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_validates(path):
    # GPU configs point at a corpus that only exists on the cluster: skip the file check.
    cfg = load_config(path, check_paths=False)
    with open(path) as f:  # written in the current spelling (no renamed section)
        assert not {k.split(".")[0] for k in RENAMED_KEYS} & set(yaml.safe_load(f))
    p = cfg.parallel
    if p.dp != "auto":
        load_config(path, world_size=p.tp * p.cp * p.pp * p.dp, check_paths=False)


@pytest.mark.parametrize("name,params", [("gpt1b_32k_3d", 1_198_098_432),
                                         ("gpt1b_32k_4d", 1_198_098_432),
                                         ("gpt7b_128k_3d", 6_738_415_616),
                                         ("gpt7b_128k_4d", 6_738_415_616),
                                         ("gpt1b_32k_ulysses", 1_198_098_432),
                                         ("gpt7b_128k_hybrid", 6_738_415_616),
                                         ("gpt8b_128k_allgather", 8_030_261_248),
                                         ("extend_llama3_8b_128k", 8_030_261_248),
                                         ("extend_qwen3_8b_128k", 8_190_735_360),
                                         ("extend_mistral_7b_128k", 7_248_023_552),
                                         ("extend_gemma3_1b_128k", 999_885_952),
                                         ("extend_qwen3_5_9b_1m", 8_953_803_264),
                                         ("extend_nemotron_h_8b_32k", 8_100_852_736),
                                         ("extend_qwen3_30b_a3b_128k", 30_532_122_624),
                                         ("extend_gpt_oss_20b_512k", 20_914_757_184),
                                         ("extend_qwen3_next_80b_a3b_1m", 79_674_391_296),
                                         ("extend_glm4_5_air_512k", 106_852_245_504),
                                         ("extend_deepseek_v2_lite_1m", 15_706_484_224),
                                         ("extend_minimax_m2_768k", 228_689_748_992),
                                         ("extend_llama4_scout_1m", 107_769_861_120),
                                         ("extend_mimo_v2_flash_1m", 308_778_768_832),
                                         ("extend_kimi_linear_48b_1m", 49_122_675_072),
                                         ("extend_gemma4_31b_512k", 30_697_345_280),
                                         ("extend_deepseek_v32_1m", 671_877_929_216),
                                         ("extend_glm5_800k", 743_911_199_232),
                                         ("extend_deepseek_v3_671b_128k", 671_026_404_352)])
def test_gpu_configs_build_the_stated_model_on_meta(name, params):
    # The sizes the config comments and README state; meta device: shapes only.
    import torch
    from ctxpar.config.parameters import active_parameters
    from models.gpt import GPT
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), check_paths=False)
    model = GPT(cfg.model, device=torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == params
    if cfg.model.moe is not None:  # 8 of Qwen3-30B-A3B's 128 experts, 4 of gpt-oss-20b's 32,
        # 10 of Qwen3-Next-80B-A3B's 512, 6 of DeepSeek-V2-Lite's 64 (+ its 2 shared)
        assert active_parameters(cfg.model) == {"extend_qwen3_30b_a3b_128k": 3_353_032_704,
                                                "extend_gpt_oss_20b_512k": 4_187_440_704,
                                                "extend_qwen3_next_80b_a3b_1m":
                                                3_874_929_408,
                                                "extend_glm4_5_air_512k":
                                                13_424_123_904,
                                                "extend_deepseek_v2_lite_1m":
                                                2_661_150_208,
                                                "extend_minimax_m2_768k":
                                                11_030_537_216,
                                                "extend_llama4_scout_1m":
                                                17_172_894_720,
                                                "extend_mimo_v2_flash_1m":
                                                15_445_924_288,
                                                "extend_kimi_linear_48b_1m":
                                                3_484_453_248,
                                                "extend_deepseek_v32_1m":
                                                38_403_807_488,
                                                "extend_glm5_800k":
                                                41_784_709_632,
                                                "extend_deepseek_v3_671b_128k":
                                                37_552_282_624}[name]


def quoted_verdicts():
    """(config, the planner command its comments quote, the figures quoted after
    "the config's own layout:") of every config that quotes one."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        comments = " ".join(line.lstrip("#").strip() for line in open(path)
                            if line.startswith("#"))
        # each command (its --set overrides too) with the own-layout line after it
        for k, command in enumerate(re.finditer(
                r"python -m ctxpar\.plan (--config \S+(?: --set(?: \S+=\S+)+)?"
                r"(?: --nodes \d+)?)(?! --max-seq-len| --set| --documents)", comments)):
            own = re.compile(r"the config's own layout: ([^:]+?): ([\d.]+) GB, "
                             r"([\d,]+) tokens/s per GPU, MFU ([\d.]+)%").search(
                comments, command.end())
            if own:
                found.append(pytest.param(command.group(1).split(), own.groups(),
                                          id=f"{os.path.basename(path)[:-5]}-{k}"))
    return found


@pytest.mark.parametrize("args,quoted", quoted_verdicts())
def test_configs_quote_what_the_planner_predicts_for_their_own_layout(args, quoted):
    """Each config's comment quotes the planner's line on its own layout (memory per GPU,
    tokens/s per GPU, MFU) beside the command that prints it: the planner, rerun on that
    layout alone (the whole search is the command's: minutes), must print the same."""
    from ctxpar.plan.__main__ import cluster_of, own_layout, parse_args
    a = parse_args(args)
    line = own_layout(load_config(os.path.join(ROOT, a.config), a.set or (),
                                  check_paths=False), cluster_of(a))
    name, gb, tokens, mfu = quoted
    assert line == (f"the config's own layout: {name}: {gb} GB, {tokens} tokens/s per GPU, "
                    f"MFU {mfu}%"), f"{a.config} quotes {quoted}; the planner prints {line}"


def test_the_extension_configs_quote_their_planner_verdict():
    """The check above covers every configs/extend_*.yaml (a regex that found none would
    pass vacuously)."""
    names = {p.id.rsplit("-", 1)[0] for p in quoted_verdicts()}  # the config of "<config>-<k>"
    extends = {os.path.basename(f)[:-5] for f in glob.glob(os.path.join(ROOT, "configs",
                                                                        "extend_*.yaml"))}
    assert extends - {"extend_tiny_cpu", "extend_llama3_8b_128k"} <= names, sorted(extends - names)

def quoted_longest():
    """(config, the --max-seq-len command its comments quote, the longest seq_len and
    layout quoted after it) of every config that quotes one."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        comments = " ".join(line.lstrip("#").strip() for line in open(path)
                            if line.startswith("#"))
        for m in re.finditer(r"python -m ctxpar\.plan (--config \S+ --set \S+ \S+ --nodes \d+ "
                             r"--gpus-per-node \d+) --max-seq-len.*?longest seq_len: "
                             r"([\d,]+) tokens \(layout ((?:[^()]|\([^()]*\))+)\)",
                             comments):  # a layout's tile sizes in parentheses
            found.append(pytest.param(m.group(1).split(), int(m.group(2).replace(",", "")),
                                      m.group(3), id=f"{os.path.basename(path)[:-5]}-"
                                      f"{m.group(1).split()[-1]}gpus"))
    return found


@pytest.mark.parametrize("args,tokens,layout", quoted_longest())
def test_configs_quote_the_longest_context_the_planner_predicts(args, tokens, layout):
    """A config's quoted --max-seq-len verdict (tokens and the layout that reaches them):
    the planner's bisection rerun on that layout alone (the whole search is the
    command's: minutes) must give the same length."""
    from ctxpar.plan.__main__ import allowed_from, cluster_of, parse_args
    from ctxpar.plan.longest import candidates, longest
    a = parse_args([*args, "--max-seq-len"])
    cluster = cluster_of(a)
    cfg = load_config(os.path.join(ROOT, a.config), a.set, check_paths=False)
    mine = [c for c in candidates(cfg, cluster, allowed_from(a)) if c.name() == layout]
    assert mine, f"{a.config}: no candidate is named {layout!r}"
    got = max(longest(cfg, c, cluster)[0] for c in mine)
    assert got == tokens, f"{a.config} quotes {tokens:,} tokens on {layout}; the planner: {got:,}"


def test_the_hybrid_configs_quote_their_longest_context_on_1_and_8_gpus():
    """Qwen3.5-9B's and Nemotron-H-8B's configs quote --max-seq-len on 1 and 8 H100s (a
    regex that found none would let the check above pass vacuously)."""
    ids = {p.id for p in quoted_longest()}
    assert {f"{c}-{g}gpus" for c in ("extend_qwen3_5_9b_1m", "extend_nemotron_h_8b_32k")
            for g in (1, 8)} <= ids, sorted(ids)


def test_the_planner_docs_quote_the_hybrid_configs_longest_context():
    """docs/planner.md's table of Qwen3.5-9B's and Nemotron-H-8B's longest context gives
    the configs' quoted lengths and layouts (themselves held to the planner above), so
    the docs, the configs and the planner cannot drift apart."""
    quoted = {p.id: p.values[1:] for p in quoted_longest()}
    configs = {"Qwen3.5-9B": "extend_qwen3_5_9b_1m", "Nemotron-H-8B": "extend_nemotron_h_8b_32k"}
    text = open(os.path.join(ROOT, "docs", "planner.md")).read()
    rows = re.findall(r"^\| (Qwen3\.5-9B|Nemotron-H-8B) \| (\d+) \| ([\d,]+) \| ([^|]+) \|",
                      text, re.M)
    assert len(rows) == 4, rows
    for model, gpus, tokens, layout in rows:
        want_tokens, want_layout = quoted[f"{configs[model]}-{gpus}gpus"]
        assert int(tokens.replace(",", "")) == want_tokens, (model, gpus, tokens, want_tokens)
        # the docs name the layout by its words but pp1 dp1 mb1 (and the options in words)
        assert set(layout.split(",")[0].split()) <= set(want_layout.split()), \
            (model, gpus, layout, want_layout)


def test_run_dir_that_cannot_be_created_is_a_config_error(tmp_path):
    from ctxpar.config.run_dir import check_run_dir
    (tmp_path / "afile").write_text("x")

    def check(**logging_and_ckpt):
        ckpt = logging_and_ckpt.pop("save_dir", None)
        cfg = config_from_dict({"logging": logging_and_ckpt,
                                "checkpoint": {"save_dir": ckpt}}, world_size=4)
        check_run_dir(cfg)

    check(run_dir=str(tmp_path / "new" / "deeper"))  # creatable: fine, and not created
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    with pytest.raises(ConfigError, match=r"^logging.run_dir='.*afile/run': .*afile is a "
                                          r"file, not a directory$"):
        check(run_dir=str(tmp_path / "afile" / "run"))
    with pytest.raises(ConfigError, match=r"^logging.run_dir='.*afile': .*afile is not a "
                                          r"directory$"):
        check(run_dir=str(tmp_path / "afile"))
    with pytest.raises(ConfigError, match=r"^checkpoint.save_dir='.*afile/ck': "):
        check(run_dir=str(tmp_path / "ok"), save_dir=str(tmp_path / "afile" / "ck"))
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match=r"cannot create it: .*ro is not writable$"):
            check(run_dir=str(ro / "run"))
    assert sorted(os.listdir(tmp_path)) in (["afile"], ["afile", "ro"])
