"""train.py as the tests run it: one process or torchrun on CPU, and its metrics.

    proc = run_train(run_dir, 4, ["parallel.cp=2", "parallel.dp=2"])
    assert_same_run(run_dir, single_dir, steps=20)

Every run starts from configs/tiny_cpu.yaml with BASE's settings (smaller than the README
job so the suite stays fast; still a real passkey sample), so runs of any layout share
seed and global batch and their per-step losses must agree.
"""
import json
import os
import subprocess
import sys

from ctxpar.distributed.parallel_state import free_port
from helpers.warm_launch import run_warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
BASE = ["model.seq_len=128", "train.steps=20", "train.warmup_steps=5", "train.eval_interval=0",
        "train.weight_decay=0.1",  # decoupled decay on matrices only: ZeRO-3 must see 2-D
        "train.eval_samples=16", "logging.log_interval=1"]
# A four-layer hybrid on BASE's model: Gated DeltaNet, Mamba2, full attention, Gated
# DeltaNet, sized for CPU (kernel chunks of 16 split a cp2 zigzag segment).
HYBRID_MODEL = ["model.n_layers=4",
                "model.layer_types=[linear_attention,mamba,full_attention,linear_attention]",
                "model.linear_num_key_heads=2", "model.linear_key_head_dim=16",
                "model.mamba_head_dim=16", "model.ssm_state_size=16", "model.n_groups=2",
                "model.linear_chunk_size=16"]


def run_train(run_dir, nproc, overrides, extra=(), timeout=420, check=True, config=CONFIG,
              launcher="warm"):
    """train.py with BASE + overrides writing to run_dir, on nproc processes; the
    CompletedProcess (AssertionError with stderr's tail if it fails and check is set).

    launcher "warm": ranks forked from the suite's preloaded forkserver with torchrun's
    variables (helpers/warm_launch.py); "fresh": new interpreters as a user starts them,
    torchrun (`python train.py` for one process)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT}
    env.pop("WANDB_MODE", None)  # the config decides (offline by default)
    sets = BASE + [f"logging.run_dir={run_dir}"] + list(overrides)
    if launcher == "warm":
        proc = run_warm("train.py", ["--config", config, "--set", *sets, *extra], nproc, env,
                        timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stderr[-4000:]}")
        return proc
    assert launcher == "fresh", launcher
    for _ in range(3):  # a port free when chosen can be taken before torchrun binds it
        if nproc == 1:
            cmd = [sys.executable, os.path.join(ROOT, "train.py")]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                   str(nproc), "--master_port", str(free_port()), os.path.join(ROOT, "train.py")]
        cmd += ["--config", config, "--set", *sets, *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if not port_taken(proc):
            break
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def port_taken(proc) -> bool:
    """torchrun could not listen on its --master_port (EADDRINUSE at the rendezvous, before
    any rank of train.py started): another process took the port free_port() chose."""
    return proc.returncode != 0 and "EADDRINUSE" in proc.stderr and \
        "static_tcp_rendezvous" in proc.stderr


def losses(run_dir):
    """{step: loss} from run_dir/metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def metric(run_dir, key):
    """{step: value of key} of the training rows of run_dir/metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r[key] for r in rows if "loss" in r}


def assert_same_run(run_dir, want_dir, steps):
    """The first `steps` losses and gradient norms of run_dir equal want_dir's."""
    want, got = losses(want_dir), losses(run_dir)
    assert sorted(got) == list(range(1, steps + 1)) and set(got) <= set(want), sorted(got)
    for s in got:
        # fp32: only the order of reductions differs (TP all-reduce, CP merges and
        # all-to-alls, DP sums); after 20 Adam steps that drifts ~1e-6 relative, well
        # inside 1e-4.
        assert abs(got[s] - want[s]) <= 1e-4 * abs(want[s]), (s, got[s], want[s])
    # The gradient norm (before clipping) is logged on every engine and agrees too: it is
    # what diverged under ZeRO-3 with CP (3.08 for 3.31 at step 1) while the loss did not.
    want_norm, got_norm = metric(want_dir, "grad_norm"), metric(run_dir, "grad_norm")
    for s in got:
        assert got_norm[s] is not None and abs(got_norm[s] - want_norm[s]) <= \
            1e-4 * want_norm[s], (s, got_norm[s], want_norm[s])


def single_run(run_dir):
    """One process on ZeRO-0, 20 steps: every layout's reference (the `single` fixture in
    conftest.py, shared by test_train.py and test_train_memory.py). fp32: DeepSpeed records no
    gradient norm on that engine; ctxpar does (ctxpar/distributed/grad_norm.py)."""
    run_train(run_dir, 1, ["parallel.cp=1", "parallel.dp=1", "parallel.tp=1",
                           "deepspeed.zero_optimization.stage=0", "logging.wandb.mode=disabled"])
    return run_dir
