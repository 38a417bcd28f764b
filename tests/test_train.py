"""train.py end to end: torchrun with 4 CPU processes, real DeepSpeed, wandb offline.

The runs are shared through module-scoped fixtures (each costs ~30-60 s on 2 cores):
  cp2dp2     cp=2 x dp=2, 20 steps, checkpoints at 10 and 20, wandb offline
  resumed    a copy of cp2dp2's step-10 checkpoint, resumed with --resume auto
  tp2cp2     tp=2 x cp=2, 20 steps; cp2dp2_zero3 the same grid as cp2dp2 on ZeRO-3
  single     one process (cp=1, tp=1, dp=1, ZeRO-0), 20 steps (conftest.py: session-wide,
             test_train_memory.py compares to it too)
  cp4 runs   one per parallel.cp_comm at cp=4, 6 steps: ring, ulysses (4 processes),
             allgather x pp2 and hybrid (ulysses 2 x ring 2) x tp2 (8 processes)
All share seed and global batch (16 samples), so their per-step losses must agree (the
first 6 steps of a 20-step run are those of a 6-step run: the learning rate only starts
to depend on train.steps after the 5 warmup steps).
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest

from ctxpar.distributed.parallel_state import free_port
from helpers.train_run import BASE, CONFIG, ROOT, assert_same_run, losses, run_train

FIELDS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops_per_device",
          "peak_mem_bytes", "step_time_s"}


# Long-context tasks at each evaluation (the start and step 20), split over the 2 DP ranks.
LONG_CONTEXT = ["long_context_eval.tasks=[needle,variable_tracking]",
                "long_context_eval.lengths=[100,128]", "long_context_eval.depths=[0,1]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def cp2dp2(runs):
    d = str(runs / "cp2dp2")
    proc = run_train(d, 4, ["parallel.cp=2", "parallel.dp=2", "parallel.tp=1",
                            "checkpoint.save_interval=10", "train.eval_at_start=true",
                            *LONG_CONTEXT], launcher="fresh")  # torchrun itself
    (runs / "cp2dp2.console").write_text(proc.stdout + proc.stderr)
    return d


def test_cp2dp2_learns_logs_and_tracks(cp2dp2):
    rows = [json.loads(line) for line in open(os.path.join(cp2dp2, "metrics.jsonl"))]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    for r in steps:
        assert FIELDS <= set(r), FIELDS - set(r)
    first, last = steps[0]["loss"], sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(256) toward ~ln(10) and below
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and evals[-1]["step"] == 20 and 0.0 <= evals[-1]["eval_accuracy"] <= 1.0
    assert os.path.isfile(os.path.join(cp2dp2, "config.yaml"))
    wandb_runs = os.listdir(os.path.join(cp2dp2, "wandb"))
    assert any(n.startswith("offline-run-") for n in wandb_runs), wandb_runs
    ckpts = sorted(os.listdir(os.path.join(cp2dp2, "checkpoints")))
    assert "step_00000010" in ckpts and "step_00000020" in ckpts
    assert os.path.isfile(os.path.join(cp2dp2, "checkpoints", "step_00000010", "COMPLETE"))


def test_long_context_tasks_are_logged_and_match_the_tool_on_the_checkpoint(
        cp2dp2, tmp_path, monkeypatch):
    # train.py's in-training scores at step 20 (cp2 x dp2, cells split over DP) equal
    # tools/long_context_eval.py's on the step-20 checkpoint at cp1: the same prompts, the
    # same greedy answers.
    import torch.distributed as dist

    from tools import long_context_eval

    rows = [json.loads(line) for line in open(os.path.join(cp2dp2, "metrics.jsonl"))]
    lc = {r["step"]: r for r in rows if "lc_needle" in r}
    assert sorted(lc) == [0, 20]
    assert set(lc[20]) == {"step", "lc_needle", "lc_needle_100", "lc_needle_128",
                           "lc_variable_tracking", "lc_variable_tracking_100",
                           "lc_variable_tracking_128"}
    for step in (0, 20):
        assert os.path.isfile(os.path.join(cp2dp2, "long_context", f"step_{step:08d}.png"))
    media = [f for _, _, fs in os.walk(os.path.join(cp2dp2, "wandb")) for f in fs]
    assert any(f.endswith(".png") for f in media) and any("table" in f for f in media), media
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    out = str(tmp_path / "lc")
    try:
        assert long_context_eval.main(
            ["--run-dir", cp2dp2, "--checkpoint", "step_00000020", "--tasks", "needle",
             "variable_tracking", "--lengths", "100", "128", "--depths", "0", "1",
             "--samples", "2", "--needles", "2", "--loss-samples", "0",
             "--out", out]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tool = json.load(open(os.path.join(out, "results.json")))["tasks"]
    train = json.load(open(os.path.join(cp2dp2, "long_context", "step_00000020.json")))
    assert [c["completions"] for c in tool] == [c["completions"] for c in train["tasks"]]


def test_eval_at_start_measures_the_model_before_training(cp2dp2, runs):
    # train.eval_at_start: one more eval, at step 0; the resumed run below (without it)
    # still reproduces these losses bit for bit, so it did not disturb training.
    rows = [json.loads(line) for line in open(os.path.join(cp2dp2, "metrics.jsonl"))]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 20], evals
    assert evals[0]["eval_loss"] > evals[1]["eval_loss"] + 1.0, evals  # the gain shows
    console = (runs / "cp2dp2.console").read_text()
    assert "step 0: passkey accuracy " in console and "step 20: passkey accuracy " in console


def test_memory_is_logged_raw_and_above_the_baseline(cp2dp2):
    # peak_mem_bytes: the process's resident set on CPU; peak_mem_model_bytes: the peak
    # above the resident set before the model was built (interpreter and libraries left
    # out), the figure comparable to the start line's prediction.
    rows = [json.loads(line) for line in open(os.path.join(cp2dp2, "metrics.jsonl"))]
    for r in (r for r in rows if "loss" in r):
        assert 0 < r["peak_mem_model_bytes"] < r["peak_mem_bytes"], r


def test_evaluator_and_checkpointer_own_their_when():
    from types import SimpleNamespace
    from ctxpar.components.checkpointer import Checkpointer
    from ctxpar.components.evaluation import Evaluator, describe
    from ctxpar.config import config_from_dict

    def evaluator(**train):
        cfg = config_from_dict({"train": {"steps": 30, **train}}, world_size=1)
        return Evaluator(cfg, SimpleNamespace(has_eval=True), state=None)
    every10 = evaluator(eval_interval=10)
    assert [s for s in range(1, 31) if every10.should_evaluate(s)] == [10, 20, 30]
    assert not every10.should_evaluate(0, start=True)
    assert evaluator(eval_at_start=True).should_evaluate(7, start=True)  # a resumed start
    assert [s for s in range(1, 31) if evaluator().should_evaluate(s)] == [30]  # only the end
    none = Evaluator(evaluator().cfg, SimpleNamespace(has_eval=False), state=None)
    assert not none.should_evaluate(30) and none.summary() == ""
    assert describe({"eval_accuracy": 0.5}) == "passkey accuracy 0.500"
    assert describe({"eval_loss": 2.0, "eval_ppl": 7.389}) == "eval loss 2.0000 (ppl 7.39)"
    ck = Checkpointer(engine=None, save_dir="unused", interval=10, meta={}, stream=None)
    assert [s for s in range(1, 26) if ck.should_save(s)] == [10, 20]
    assert ck.should_save(25, last_step=True) and ck.save(7) is None  # not due: no collective
    assert not Checkpointer(None, "unused", 0, {}, None).should_save(10)


def test_start_prints_the_planners_prediction_once(cp2dp2, runs):
    # Rank 0 only: this layout's predicted memory and tokens/s on the detected device
    # (the calibrated cpu preset here; ctxpar/plan/startup.py).
    console = (runs / "cp2dp2.console").read_text()
    lines = [ln for ln in console.splitlines() if ln.startswith("plan: ")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("plan: tp1 cp2 ring/zigzag pp1 dp2") and "tokens/s" in lines[0]


def test_console_has_no_third_party_warnings(cp2dp2, runs):
    # No rank of a ZeRO-1 run prints torch's FutureWarning for DeepSpeed's
    # all_gather_into_tensor inside the bar, nor wandb's about a deprecated argument.
    console = (runs / "cp2dp2.console").read_text()
    assert "all_gather_into_tensor" not in console, console[-3000:]
    # ctxpar/distributed/deepspeed_comm.py
    assert "deepspeed_shm_comm" not in console, console[-3000:]
    assert not re.search(r"\w+Warning\b|wandb: WARNING", console), console[-3000:]


def test_known_warning_filters_are_narrow():
    from ctxpar.components.known_warnings import filter_known_warnings
    msg = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings()
        for text, category, module in [
                (msg, FutureWarning, "torch.distributed.c10d_logger"),   # the one: hidden
                (msg, FutureWarning, "ctxpar.context_parallel.comm"),   # same words elsewhere
                (msg, UserWarning, "torch.distributed.c10d_logger"),     # another category
                ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning,
                 "torch.distributed.c10d_logger")]:                     # another message
            warnings.warn_explicit(text, category, module.replace(".", "/") + ".py", 1,
                                   module=module)
    assert [(str(w.message)[:40], w.category) for w in seen] == [
        (msg[:40], FutureWarning), (msg[:40], UserWarning),
        ("`torch.distributed.reduce_scatter_tensor", FutureWarning)]


def test_resume_reproduces_uninterrupted_losses(cp2dp2, runs):
    d = str(runs / "resumed")
    os.makedirs(os.path.join(d, "checkpoints"))
    shutil.copytree(os.path.join(cp2dp2, "checkpoints", "step_00000010"),
                    os.path.join(d, "checkpoints", "step_00000010"))
    # A half-written later checkpoint (no COMPLETE marker) must be ignored.
    shutil.copytree(os.path.join(cp2dp2, "checkpoints", "step_00000020"),
                    os.path.join(d, "checkpoints", "step_00000020"))
    os.remove(os.path.join(d, "checkpoints", "step_00000020", "COMPLETE"))
    proc = run_train(d, 4, ["parallel.cp=2", "parallel.dp=2", "parallel.tp=1",
                            "logging.wandb.mode=disabled"], extra=["--resume", "auto"])
    assert "resumed from" in proc.stdout and "step_00000010" in proc.stdout
    want, got = losses(cp2dp2), losses(d)
    assert sorted(got) == list(range(11, 21))
    for s in got:
        # fp32, same ranks, same reduction order, same data: bit-identical.
        assert got[s] == want[s], (s, got[s], want[s])


def test_single_process_logs_the_same_loss(cp2dp2, single):
    assert_same_run(single, cp2dp2, 20)


@pytest.mark.parametrize("name,nproc,layout", [
    ("tp2cp2", 4, ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2",
                   "parallel.layout=striped"]),
    # ZeRO-3 with CP, every parameter really partitioned (persistence threshold 0).
    ("cp2dp2_zero3", 4, ["parallel.cp=2", "parallel.dp=2", "parallel.tp=1",
                         "deepspeed.zero_optimization.stage=3",
                         "deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]),
])
def test_layouts_log_the_same_loss(cp2dp2, runs, name, nproc, layout):
    d = str(runs / name)
    run_train(d, nproc, layout + ["logging.wandb.mode=disabled"])
    assert_same_run(d, cp2dp2, 20)


@pytest.mark.parametrize("nproc,sets", [
    (4, ["parallel.cp_comm=ring"]),
    (4, ["parallel.cp_comm=ulysses", "parallel.layout=striped"]),
    (8, ["parallel.cp_comm=allgather", "parallel.pp=2"]),
    (8, ["parallel.cp_comm=hybrid", "parallel.ulysses=2", "parallel.tp=2"]),
], ids=["ring", "ulysses", "allgather-pp2", "hybrid-tp2"])
def test_every_cp_comm_at_cp4_logs_the_same_loss(single, runs, nproc, sets):
    d = str(runs / "cp4-{}".format(sets[0].split("=")[1]))
    run_train(d, nproc, ["parallel.cp=4", "parallel.dp=1", "train.steps=6",
                         "train.eval_samples=8", "logging.wandb.mode=disabled", *sets])
    assert_same_run(d, single, 6)


def test_text_corpus_trains_and_evaluates_on_held_out_text(tmp_path):
    # Real text through tools/preprocess_data.py; train.py evaluates the loss on the last
    # 10% of the file (data.eval_fraction), which it never trains on.
    import random
    from ctxpar.data.passkey import SENTENCES
    rnd = random.Random(0)
    docs = ["".join(rnd.choice(SENTENCES) for _ in range(40)) for _ in range(60)]  # ~55 KB
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    str(tmp_path / "docs.jsonl"), "--output-prefix", prefix], check=True,
                   capture_output=True, timeout=120)
    d = tmp_path / "text"
    sets = ["parallel.cp=1", "parallel.dp=1", "data.kind=tokens", f"data.path={prefix}",
            "data.eval_fraction=0.1", "train.steps=10", "train.eval_interval=5",
            "logging.wandb.mode=disabled"]
    proc = run_train(str(d), 1, sets, launcher="fresh")  # `python train.py` itself
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5, 10] and "eval_accuracy" not in evals[0]
    # Filler sentences of 12 nouns x 12 adjectives: held-out loss falls well below ln(256).
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] < 5.0, evals
    ppl, loss = evals[1]["eval_ppl"], evals[1]["eval_loss"]
    assert abs(ppl - math.exp(loss)) < 1e-6 * ppl
    assert "held-out samples" in proc.stdout and "eval loss" in proc.stdout.splitlines()[-1]
    # The same command again finds the finished run: it says so and trains nothing.
    again = run_train(str(d), 1, sets)
    assert "nothing to train" in again.stdout and "step_00000010" in again.stdout, again.stdout
    assert [json.loads(line) for line in open(d / "metrics.jsonl")] == rows


@pytest.mark.quick
@pytest.mark.parametrize("sets,msg", [
    (["parallel.cp=3"], "model.seq_len=128 is not divisible by 6"),
    (["parallel.tp=3"], "is not divisible by parallel.tp=3"),
    (["data.kind=tokens", "data.path=/nonexistent/corpus"], "/nonexistent/corpus.bin does not exist"),
    (["train.stepz=3"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    # memory options and the ZeRO-Offload refusals (ctxpar/config/validation.py)
    (["memory.loss_tile_tokens=0"], "memory.loss_tile_tokens=0 must be 'auto' or an integer >= 1"),
    (["memory.offload_activations=true"], "memory.offload_activations=true needs "
                                          "activation_checkpointing.mode 'full', 'selective' or"),
    (["deepspeed.zero_optimization.offload_optimizer.device=nvme"],
     "deepspeed.zero_optimization.offload_optimizer.device='nvme' must be 'cpu' or 'none'"),
    (["deepspeed.zero_optimization.stage=0",
      "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
     "deepspeed.zero_optimization.offload_optimizer with stage=0: the offload lives in"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, sets, msg):
    single = ["parallel.cp=1", "parallel.dp=1"]  # fits a world of 1; `sets` come after
    proc = run_train(str(tmp_path / "bad"), 1, single + sets, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and msg in lines[0], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")


def run_ranks(world, sets, extra=()):
    """train.py as `world` separate processes with torch's env variables (as srun starts
    them), not torchrun: torchrun SIGTERMs the slower rank as soon as the first one exits,
    so it could never show that *every* rank reaches a check on its own.
    Returns each rank's (exit code, stderr)."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
               "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), "--config", CONFIG,
             "--set", *BASE, *sets, *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # a rank stuck in a collective fails here
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


def assert_every_rank_says(results, msg):
    for r, (code, err) in enumerate(results):
        assert code == 2, err[-2000:]
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert len(lines) == 1 and lines[0].startswith(f"[rank {r}] error:") \
            and msg in lines[0], err[-2000:]


def test_bad_layout_fails_on_every_rank_without_hanging(tmp_path):
    # world 2 with cp=2 x dp=2 requested: both ranks refuse before any collective.
    results = run_ranks(2, [f"logging.run_dir={tmp_path / 'bad'}", "parallel.cp=2",
                            "parallel.dp=2"])
    assert_every_rank_says(results, "does not equal the world size 2")
    assert not os.path.exists(tmp_path / "bad" / "metrics.jsonl")


def test_run_dir_through_a_file_fails_on_every_rank_and_creates_nothing(tmp_path):
    (tmp_path / "afile").write_text("x")
    run_dir = tmp_path / "afile" / "run"
    results = run_ranks(2, [f"logging.run_dir={run_dir}", "parallel.cp=2", "parallel.dp=1"])
    assert_every_rank_says(results, f"logging.run_dir={str(run_dir)!r}: "
                                    f"{tmp_path / 'afile'} is a file, not a directory")
    assert all("Traceback" not in err for _, err in results)
    assert sorted(os.listdir(tmp_path)) == ["afile"] and (tmp_path / "afile").read_text() == "x"


def test_resume_from_a_missing_tag_names_the_tags_that_exist(cp2dp2, tmp_path):
    # cp2dp2 saved step_00000010 and step_00000020; a typo'd tag is refused on every rank
    # before DeepSpeed looks for it (its own error is a bare AssertionError), and the
    # finished run is left as it was.
    before = sorted(os.listdir(cp2dp2))
    results = run_ranks(2, [f"logging.run_dir={cp2dp2}", "parallel.cp=2", "parallel.dp=1"],
                        ["--resume", "step_00000999"])
    ckpts = os.path.join(cp2dp2, "checkpoints")
    assert_every_rank_says(results, f"--resume step_00000999: checkpoint "
                                    f"{os.path.join(ckpts, 'step_00000999')} does not exist; "
                                    f"complete checkpoints in {ckpts}: step_00000010, "
                                    f"step_00000020")
    assert all("Traceback" not in err for _, err in results)
    assert sorted(os.listdir(cp2dp2)) == before


def test_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                           str(tmp_path / "nope.yaml")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "config file does not exist" in proc.stderr


@pytest.mark.quick
def test_non_finite_loss_stops_without_saving(tmp_path):
    # lr 1e30: step 1 is finite but leaves weights ~1e30, so step 2's logits overflow.
    d = tmp_path / "nan"
    proc = run_train(str(d), 1, ["parallel.cp=1", "parallel.dp=1", "train.lr=1e30",
                                 "train.min_lr=1e30", "train.warmup_steps=0",
                                 "train.grad_clip=0", "checkpoint.save_interval=1",
                                 "logging.wandb.mode=disabled"], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "non-finite loss" in proc.stdout, proc.stdout[-2000:]
    # Checkpoints stop before the bad step: nothing written from a non-finite state.
    ckpts = sorted(c for c in os.listdir(d / "checkpoints") if c.startswith("step_"))
    bad_step = max(losses(str(d))) + 1
    assert ckpts and all(int(c.split("_")[1]) < bad_step for c in ckpts), (ckpts, bad_step)
