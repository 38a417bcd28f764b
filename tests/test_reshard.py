"""Resume on another layout: train.py saves on layout A, continues on layout B, logs A's losses.

Two chains of train.py runs (torchrun, CPU, fp32, 8 steps, a checkpoint every 2 steps);
each later run copies one checkpoint of the run before it and resumes with --resume auto:

    GQA, 2 kv heads:
    pp2·cp2 ZeRO-1 (A1) --@2--> cp2·dp2 ZeRO-1 --@4--> tp2·cp2 ZeRO-0 --@6--> cp1 ZeRO-1
    MQA, 1 kv head:
    cp2 ZeRO-1 (A2) --@2--> cp4 ZeRO-0 --@4--> tp2·pp2 ZeRO-1
                    `--@2 and @4, @4 damaged--> cp2 ZeRO-2 (from @2)

covering pp -> no pp and back, tp up and down (split kv heads, and one kv head replicated
over tp2: ReplicatedHeadLinear), cp 1, 2, 4, dp 1 and 2, ZeRO 0 -> 1, 1 -> 0, 1 -> 2,
both sources of the universal conversion (DeepSpeed's ds_to_universal for ZeRO, ctxpar's
for stage 0) and both loaders (DeepSpeed's load_universal, ctxpar's torch optimizer).
A resume on the saving layout is bit-identical (test_train.py, test_pipeline.py), so the
uninterrupted A run is the reference for every later run of its chain.
"""
import json
import os
import shutil

import pytest

from helpers.train_run import losses, run_train

STEPS = 8
COMMON = [f"train.steps={STEPS}", "checkpoint.save_interval=2", "train.warmup_steps=2",
          "logging.wandb.mode=disabled"]
LAYOUTS = {
    "pp2cp2": (4, ["parallel.tp=1", "parallel.cp=2", "parallel.pp=2", "parallel.dp=1"]),
    "cp2dp2": (4, ["parallel.tp=1", "parallel.cp=2", "parallel.dp=2"]),
    "tp2cp2": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.dp=1"]),
    "cp1": (1, ["parallel.tp=1", "parallel.cp=1", "parallel.dp=1"]),
    "cp2": (2, ["parallel.tp=1", "parallel.cp=2", "parallel.dp=1"]),
    "cp4": (4, ["parallel.tp=1", "parallel.cp=4", "parallel.dp=1"]),
    "tp2pp2": (4, ["parallel.tp=2", "parallel.cp=1", "parallel.pp=2", "parallel.dp=1"]),
}
MQA = ["model.n_kv_heads=1"]  # chain 2: the kv head is replicated on tp2


def zero(stage):
    return [f"deepspeed.zero_optimization.stage={stage}"]


def train(run_dir, layout, stage, extra=(), model=()):
    nproc, sets = LAYOUTS[layout]
    return run_train(str(run_dir), nproc, [*sets, *zero(stage), *COMMON, *model],
                     extra=list(extra))


def copy_checkpoints(source, run_dir, steps):
    for s in steps:
        tag = f"step_{s:08d}"
        shutil.copytree(os.path.join(source, "checkpoints", tag), run_dir / "checkpoints" / tag)


def resume_from(runs, name, source, step, layout, stage, model=()):
    """A run in runs/name starting from source's step checkpoint, on layout/stage."""
    d = runs / name
    copy_checkpoints(source, d, [step])
    return str(d), train(d, layout, stage, ["--resume", "auto"], model)


def assert_same_losses(reference, run_dir, first):
    want, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(first, STEPS + 1)), sorted(got)
    for s in got:
        # fp32: the weights and Adam states are restored exactly; what differs from the
        # reference is the order of the reductions on the new layout (TP partial sums,
        # the ring's LSE merge, DP/CP gradient sums), measured <= 2e-7 relative here.
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])


def assert_resharded(proc, *changes):
    line = next((ln for ln in proc.stdout.splitlines() if "resharded step_" in ln), "")
    assert all(c in line for c in changes), proc.stdout[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def a1(runs):
    train(runs / "a1", "pp2cp2", 1)
    return str(runs / "a1")


@pytest.fixture(scope="module")
def cp2dp2(runs, a1):
    return resume_from(runs, "cp2dp2", a1, 2, "cp2dp2", 1)


@pytest.fixture(scope="module")
def tp2cp2(runs, cp2dp2):
    return resume_from(runs, "tp2cp2", cp2dp2[0], 4, "tp2cp2", 0)


@pytest.fixture(scope="module")
def a2(runs):
    train(runs / "a2", "cp2", 1, model=MQA)
    return str(runs / "a2")


@pytest.fixture(scope="module")
def cp4(runs, a2):
    return resume_from(runs, "cp4", a2, 2, "cp4", 0, MQA)


def test_pp2cp2_to_cp2dp2(a1, cp2dp2):
    d, proc = cp2dp2
    assert_resharded(proc, "pp 2->1", "dp 1->2", "saved on tp1·cp2·pp2·dp1 ZeRO-1 fp32")
    assert_same_losses(a1, d, 3)


def test_cp2dp2_to_tp2cp2_and_zero1_to_zero0(a1, tp2cp2):
    d, proc = tp2cp2
    assert_resharded(proc, "tp 1->2", "dp 2->1", "zero_stage 1->0")
    assert_same_losses(a1, d, 5)


def test_tp2cp2_to_cp1_from_zero0(runs, a1, tp2cp2):
    d, proc = resume_from(runs, "cp1", tp2cp2[0], 6, "cp1", 1)
    assert_resharded(proc, "tp 2->1", "cp 2->1", "zero_stage 0->1")
    assert_same_losses(a1, d, 7)
    # The manifest of the new run's final checkpoint records the layout that wrote it.
    with open(os.path.join(d, "checkpoints", f"step_{STEPS:08d}", "COMPLETE")) as f:
        manifest = json.load(f)
    assert manifest["layout"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "ep": 1, "zero_stage": 1,
                                  "dtype": "fp32", "order": "tp-cp-dp-pp"}
    assert manifest["step"] == STEPS and manifest["config"]["parallel"]["cp"] == 1
    assert all(size > 0 for size in manifest["files"].values()), manifest["files"]


def test_cp2_to_cp4_to_zero0(a2, cp4):
    d, proc = cp4
    assert_resharded(proc, "cp 2->4", "zero_stage 1->0")
    assert_same_losses(a2, d, 3)


def test_cp4_to_tp2pp2_with_a_replicated_kv_head(runs, a2, cp4):
    d, proc = resume_from(runs, "tp2pp2", cp4[0], 4, "tp2pp2", 1, MQA)
    assert_resharded(proc, "tp 1->2", "cp 4->1", "pp 1->2", "zero_stage 0->1")
    assert_same_losses(a2, d, 5)


def test_zero1_to_zero2_skipping_a_damaged_checkpoint(runs, a2):
    # The newer checkpoint (step 4) lost bytes of a ZeRO shard: --resume auto says so in
    # one line and resumes from step 2 instead, never loading step 4.
    d = runs / "zero2"
    copy_checkpoints(a2, d, [2, 4])
    shard = d / "checkpoints" / "step_00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = train(d, "cp2", 2, ["--resume", "auto"], MQA)
    skipped = [ln for ln in proc.stderr.splitlines() if "skipping step_00000004" in ln]
    assert len(skipped) == 1 and str(shard) in skipped[0] and "1000 bytes" in skipped[0], \
        proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    assert_resharded(proc, "zero_stage 1->2")
    assert_same_losses(a2, str(d), 3)


def test_init_from_a_checkpoint_at_a_longer_context(runs, a1):
    # Context extension from a ctxpar checkpoint: A1's last tag (pp2·cp2) starts a cp4 run
    # at twice the sequence and 4x the RoPE base. Its step-1 loss (before any update) is the
    # checkpoint's weights, loaded in one process, scored on the same first global batch.
    import numpy as np
    import torch
    from ctxpar.checkpoint import read_manifest
    from ctxpar.checkpoint.universal import full_weights, to_universal
    from ctxpar.config import ModelConfig
    from ctxpar.data import PasskeyTask
    from models.gpt import GPT

    d = runs / "extend"
    proc = run_train(str(d), 4, [*LAYOUTS["cp4"][1], "model.seq_len=256",
                                 "model.rope_theta=40000", f"model.init_from={a1}",
                                 "train.steps=1", "logging.wandb.mode=disabled"])
    assert "initialized from" in proc.stdout and "ctxpar checkpoint" in proc.stdout and \
        "seq_len 128 -> 256" in proc.stdout and "rope_theta 10000.0 -> 40000.0" in proc.stdout
    tag = os.path.join(a1, "checkpoints", f"step_{STEPS:08d}")
    to_universal(tag, str(runs / "a1_universal"), read_manifest(tag)["layout"], 2,
                 lambda n: n)
    weights = full_weights(str(runs / "a1_universal"))
    model = GPT(ModelConfig(vocab_size=256, seq_len=256, n_layers=2, d_model=64, n_heads=4,
                            n_kv_heads=2, rope_theta=40000.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        task = PasskeyTask(256, 2, 1234, "train")
        x, y = (torch.from_numpy(np.stack([task[i][j] for i in range(16)])) for j in (0, 1))
        want = (model(x, torch.arange(256), y) / (y != -100).sum()).item()
    got = losses(str(d))[1]
    assert abs(got - want) <= 1e-5 * want, (got, want)  # fp32, CP reduction order only
