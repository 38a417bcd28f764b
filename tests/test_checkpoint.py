"""Checkpoint bookkeeping without training: manifests, damaged tags, resume points, names, signals.

(1) Pure: a tag counts only when its manifest verifies (a missing shard, a truncated file,
a marker without files or a foreign marker are refused in one line naming the file);
--resume auto passes over damaged tags; a resume point refuses another model and 16-bit
stage-0 reshards and asks DeepSpeed for its universal loader only where it has one;
parameter names map GPT <-> pipeline <-> Hugging Face both ways for every parameter;
the new config keys are validated. (2) Two gloo ranks: a signal seen by one rank at any
moment stops both after the same step.
"""
import os
import re
import signal

import pytest
import torch

from ctxpar.checkpoint.names import from_hf, from_pipe, to_hf, to_pipe
from ctxpar.checkpoint import reshard
from ctxpar.checkpoint.resume import (MARKER, CheckpointError, latest_complete, read_manifest,
                                      verify, write_manifest)
from ctxpar.checkpoint.universal import universal_checkpoint_info
from ctxpar.config import ConfigError, ModelConfig, config_from_dict, to_dict
from ctxpar.config.hf_families import HF_FAMILIES
from ctxpar.testing import run_distributed
from models.gpt import GPT


def make_tag(save_dir, step, meta=None, files=("mp_rank_00_model_states.pt",
                                               "zero_pp_rank_0_mp_rank_00_optim_states.pt")):
    d = os.path.join(save_dir, f"step_{step:08d}")
    os.makedirs(d)
    for i, name in enumerate(files):
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"x" * (100 + i))
    write_manifest(d, step, meta or {})
    return d


@pytest.mark.quick
def test_manifest_lists_every_file_and_verifies(tmp_path):
    d = make_tag(str(tmp_path), 10, {"layout": {"tp": 1}})
    m = verify(d)
    assert m["step"] == 10 and m["layout"] == {"tp": 1}
    assert m["files"] == {"mp_rank_00_model_states.pt": 100,
                          "zero_pp_rank_0_mp_rank_00_optim_states.pt": 101}


@pytest.mark.parametrize("damage,msg", [
    ("missing", "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (listed in"),
    ("truncated", "zero_pp_rank_0_mp_rank_00_optim_states.pt has 7 bytes, the manifest says 101"),
    ("no_files", "mp_rank_00_model_states.pt is missing (listed in"),
    ("foreign", "COMPLETE is not a ctxpar manifest"),
    ("no_marker", "COMPLETE is missing: the checkpoint was not finished"),
])
def test_damaged_checkpoints_are_refused_in_one_line(tmp_path, damage, msg):
    d = make_tag(str(tmp_path), 10)
    shard = os.path.join(d, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    if damage == "missing":
        os.remove(shard)
    elif damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(7)
    elif damage == "no_files":  # a COMPLETE marker vouching for files that are gone
        for name in os.listdir(d):
            if name != MARKER:
                os.remove(os.path.join(d, name))
    elif damage == "foreign":
        with open(os.path.join(d, MARKER), "w") as f:
            f.write("{\"step\": 10}")
    else:
        os.remove(os.path.join(d, MARKER))
    with pytest.raises(CheckpointError) as e:
        verify(d)
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path) in str(e.value)  # names the file by its path


def test_resume_auto_skips_damaged_tags_and_says_so(tmp_path):
    save = str(tmp_path)
    make_tag(save, 10)
    d20 = make_tag(save, 20)
    d30 = make_tag(save, 30)
    os.remove(os.path.join(d30, MARKER))  # a save in progress: passed over silently
    os.remove(os.path.join(d20, "mp_rank_00_model_states.pt"))
    said = []
    assert latest_complete(save, said.append) == "step_00000010"
    assert len(said) == 1 and said[0].startswith("skipping step_00000020: ") \
        and "mp_rank_00_model_states.pt is missing" in said[0]
    assert latest_complete(str(tmp_path / "nowhere")) is None


def test_markers_from_before_manifests_still_load(tmp_path):
    d = tmp_path / "step_00000005"
    d.mkdir()
    (d / MARKER).write_text("5\n")
    assert read_manifest(str(d)) == {"step": 5, "legacy": True}
    assert latest_complete(str(tmp_path)) == "step_00000005"


def _cfg(**sets):
    data = {"model": {"vocab_size": 256, "seq_len": 128, "n_layers": 2, "d_model": 64,
                      "n_heads": 4, "n_kv_heads": 2},
            "parallel": {"tp": 1, "cp": 2, "dp": 2},
            "train": {"global_batch_size": 16, "micro_batch_size": 8},
            "deepspeed": {"zero_optimization": {"stage": 1}}}
    return config_from_dict(data, overrides=[f"{k}={v}" for k, v in sets.items()])


def test_resume_plan_reshards_only_on_a_layout_change(tmp_path):
    saved = _cfg()
    make_tag(str(tmp_path), 4, reshard.checkpoint_meta(saved, 2))
    same = reshard.resume_point(str(tmp_path), "auto", _cfg(), 4)
    assert same.tag == "step_00000004" and not same.universal
    ds = {}
    same.configure(ds)
    assert ds == {}
    other = reshard.resume_point(str(tmp_path), "step_00000004",
                                _cfg(**{"parallel.tp": 2, "parallel.dp": 1}), 4)
    assert other.changed == {"tp": (1, 2), "dp": (2, 1)}
    other.configure(ds)
    assert ds == {"checkpoint": {"load_universal": True}}  # DeepSpeed's ZeRO loader
    zero0 = reshard.resume_point(str(tmp_path), "auto",
                                _cfg(**{"deepspeed.zero_optimization.stage": 0}), 4)
    ds = {}
    zero0.configure(ds)
    assert zero0.universal and ds == {}  # the torch optimizer: ctxpar loads it
    # RoPE's base may change on resume (context extension); shapes may not.
    assert reshard.resume_point(str(tmp_path), "auto", _cfg(**{"model.rope_theta": 5e5}), 4)
    assert reshard.resume_point(str(tmp_path), "none", _cfg(), 4) is None


@pytest.mark.parametrize("sets,msg", [
    ({"model.n_layers": 4}, "was saved with model.n_layers=2, the config has model.n_layers=4"),
    ({"deepspeed.fp16.enabled": True, "parallel.tp": 2, "parallel.dp": 1,
      "deepspeed.zero_optimization.stage": 0},
     "resumed on tp2·cp2·pp1·dp1 ZeRO-0 fp16: resharding takes fp32 at ZeRO stage 0-2"),
])
def test_resume_plan_refusals(tmp_path, sets, msg):
    make_tag(str(tmp_path), 4, reshard.checkpoint_meta(_cfg(), 2))
    with pytest.raises(CheckpointError) as e:
        reshard.resume_point(str(tmp_path), "auto", _cfg(**sets), 4)
    assert msg in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match="step_00000009 does not exist"):
        reshard.resume_point(str(tmp_path), "step_00000009", _cfg(), 4)


def test_a_moe_reshards_across_ep_but_not_into_or_out_of_a_pipeline(tmp_path):
    moe = {"model.moe": "{num_experts: 4, top_k: 2}"}
    make_tag(str(tmp_path), 4, reshard.checkpoint_meta(_cfg(**moe, **{"parallel.ep": 2}), 2))
    other = reshard.resume_point(str(tmp_path), "auto", _cfg(**moe, **{"parallel.ep": 4}), 4)
    assert other.changed == {"ep": (2, 4)}
    with pytest.raises(CheckpointError, match="a pipeline at ep 1 keeps the experts in the "
                                              "optimizer's dense groups"):
        reshard.resume_point(str(tmp_path), "auto",
                             _cfg(**moe, **{"parallel.pp": 2, "parallel.dp": 1}), 4)


@pytest.mark.parametrize("tied", [True, False])
def test_names_map_every_parameter_both_ways(tied):
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layers=3, d_model=32, n_heads=4,
                      tie_embeddings=tied)
    gpt_names = [n for n, _ in GPT(cfg, device=torch.device("meta")).named_parameters()]
    pipe = [to_pipe(n, 3, tied) for n in gpt_names]
    assert len(set(pipe)) == len(pipe)
    assert [from_pipe(n, 3) for n in pipe] == gpt_names
    assert [from_hf(to_hf(n)) for n in gpt_names] == gpt_names
    # DeepSpeed's PipelineModule: index in (embedding | 3 blocks | final norm | head)
    assert to_pipe("layers.0.attn.q_proj.weight", 3, tied) == "1.attn.q_proj.weight"
    assert to_pipe("final_norm.weight", 3, tied) == "4.final_norm.weight"
    assert to_pipe("embed.weight", 3, tied) == \
        ("tied_modules.embed.embed.weight" if tied else "0.embed.weight")
    assert to_hf("layers.2.mlp_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert to_hf("layers.2.attn.o_proj.weight") == "model.layers.2.self_attn.o_proj.weight"
    if not tied:
        assert to_pipe("lm_head.weight", 3, tied) == "5.lm_head.weight"


def test_universal_info_follows_the_tp_attributes():
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4)
    meta = GPT(cfg, device=torch.device("meta"))
    info = universal_checkpoint_info(meta, cfg.n_layers, cfg.tie_embeddings)
    assert info["tp_replicated_parameter_patterns"] == [
        r"final_norm\.weight$", r"layers\.\d+\.attn_norm\.weight$",
        r"layers\.\d+\.mlp_norm\.weight$"]
    assert info["parameter_with_row_parallelism_patterns"] == [
        r"layers\.\d+\.attn\.o_proj\.weight$", r"layers\.\d+\.mlp\.down_proj\.weight$"]
    pipe = universal_checkpoint_info(meta, cfg.n_layers, cfg.tie_embeddings, pipelined=True)
    assert r"\d+\.final_norm\.weight$" in pipe["tp_replicated_parameter_patterns"]
    assert pipe["pipeline_replicated_parameter_patterns"] == [r"tied_modules\.embed\."]


@pytest.mark.parametrize("sets,msg", [
    (["model.rope_scaling={rope_type: longrope, factor: 4}"],
     "model.rope_scaling.rope_type='longrope' must be one of 'linear', 'llama3', 'yarn'"),
    (["model.rope_scaling={rope_type: yarn, factor: 4}"],
     "model.rope_scaling for rope_type='yarn' needs the keys factor, "
     "original_max_position_embeddings, rope_type and may have attention_factor"),
    (["model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 8, "
      "truncate: 1}"], "model.rope_scaling.truncate=1 must be true or false"),
    (["model.head_dim=7"], "model.head_dim=7 (model.head_dim or d_model/n_heads) must be even"),
    (["model.family=phi3"], "model.family='phi3' must be one of 'llama', 'qwen2', 'qwen3', "
                            "'mistral', 'gemma3_text', "  # the registry's order, each named:
                            + ", ".join(repr(f) for f in HF_FAMILIES[5:]) + " or null"),
    (["model.norm=layernorm", "model.norm_offset=1"],
     "model.norm_offset=1.0 applies to RMSNorm, not model.norm='layernorm'"),
    (["model.rope_scaling={rope_type: linear}"],
     "model.rope_scaling for rope_type='linear' needs exactly the keys factor, rope_type"),
    (["model.rope_scaling={rope_type: linear, factor: 0}"],
     "model.rope_scaling.factor=0 must be a number > 0"),
    (["model.init_from=/nonexistent/llama"],
     "model.init_from='/nonexistent/llama' does not exist (want a folder)"),
    (["data.tokenizer=/nonexistent/tokenizer.json"],
     "data.tokenizer='/nonexistent/tokenizer.json' does not exist (want a file)"),
])
def test_new_config_keys_are_validated(sets, msg):
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, overrides=sets)
    assert msg in str(e.value), str(e.value)
    ok = config_from_dict({}, overrides=[
        "model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 1, "
        "high_freq_factor: 4, original_max_position_embeddings: 8192}"])
    assert to_dict(ok)["model"]["rope_scaling"]["factor"] == 8
    yarn = config_from_dict({}, overrides=[
        "model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 8, "
        "beta_fast: 16, truncate: false}", "model.head_dim=24"])
    assert yarn.model.rope_scaling["truncate"] is False and yarn.model.head_dim == 24


def _signalled_steps(rank, world, plan):
    """Step after which each rank stops, with `plan` = {rank: (step, signal)} sent to itself."""
    from ctxpar.checkpoint import PreemptionGuard
    guard = PreemptionGuard()
    try:
        for step in range(1, 10):
            if rank in plan and plan[rank][0] == step:
                os.kill(os.getpid(), plan[rank][1])  # arrives "during" this step
            if guard.should_stop():
                return step, guard.reason
        return None, None
    finally:
        guard.close()


def test_preemption_every_rank_stops_after_the_same_step():
    # Rank 1 gets SIGUSR1 in step 3, rank 0 a SIGTERM only in step 5: both stop after 3.
    out = run_distributed(_signalled_steps, 2,
                          {1: (3, signal.SIGUSR1), 0: (5, signal.SIGTERM)}, timeout=60)
    assert out == [(3, "another rank's signal"), (3, "SIGUSR1")]


def test_universal_info_gives_each_layer_its_own_rule_where_layer_types_split_apart(
        monkeypatch):
    """MiMo-V2-Flash's K/V heads per layer type at tp 2: the full layer's single kv head
    replicated (ReplicatedHeadLinear), the sliding layer's two split; one pattern for every
    layer's k_proj would merge the sliding layer's halves as copies (ds_to_universal's
    merge_tp_slices asserts they are equal), so each layer gets its own."""
    from models.options import ModelGroups
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4,
                      n_kv_heads=1, layer_types=["full_attention", "sliding_attention"],
                      sliding_window=4, layer_kv_heads={"sliding_attention": 2})
    meta = GPT(cfg, ModelGroups(tp_group=object()), device=torch.device("meta"))
    info = universal_checkpoint_info(meta, cfg.n_layers, cfg.tie_embeddings)
    replicated = info["tp_replicated_parameter_patterns"]
    assert r"layers\.0\.attn\.k_proj\.weight$" in replicated
    assert r"layers\.0\.attn\.v_proj\.weight$" in replicated
    assert not any(re.match(p, "layers.1.attn.k_proj.weight") for p in replicated)
    assert r"layers\.\d+\.attn_norm\.weight$" in replicated  # one rule: one pattern
