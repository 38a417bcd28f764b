"""A checkpoint written by an earlier ctxpar (tests/data/checkpoint_v1) still resumes: at
its own layout the next steps' losses and gradient norms are the run's own, and resharded
to cp 2 (DeepSpeed's universal checkpoint) they agree to fp32 reordering."""
import json
import os
import shutil

import pytest

from helpers.train_run import losses, metric, run_train

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_v1")
SETS = ["train.steps=4", "train.warmup_steps=1", "model.d_model=32", "model.n_heads=2",
        "model.n_kv_heads=1", "checkpoint.save_interval=2", "logging.wandb.mode=disabled",
        "parallel.dp=1", "train.global_batch_size=8", "train.weight_decay=0.0"]


@pytest.mark.quick
# Same layout: the same sums in the same order, so equal up to the CPU's kernels (another
# machine's vector width reorders fp32 sums: ~1e-7 relative); cp 2 merges each row's
# attention from two blocks by LSE, another fp32 order of the same sums (~1e-7).
@pytest.mark.parametrize("nproc", [1, 2])
def test_earlier_checkpoint_resumes(tmp_path, nproc):
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(FIXTURE, "checkpoints"), run_dir / "checkpoints")
    proc = run_train(run_dir, nproc, SETS + [f"parallel.cp={nproc}"])
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in proc.stderr + proc.stdout
    want = json.load(open(os.path.join(FIXTURE, "expected.json")))
    got_loss, got_norm = losses(run_dir), metric(run_dir, "grad_norm")
    assert sorted(got_loss) == [3, 4], got_loss
    for step in (3, 4):
        assert got_loss[step] == pytest.approx(want[str(step)]["loss"], rel=1e-5)
        assert got_norm[step] == pytest.approx(want[str(step)]["grad_norm"], rel=1e-5)
