"""An entrypoint on N local ranks forked from the suite's warm forkserver, started as torchrun
starts its workers: the same environment variables, the same rendezvous (a TCPStore the
launcher hosts, TORCHELASTIC_USE_AGENT_STORE), one stdout and one stderr that every rank
appends to, and the run stopped as soon as one rank fails.

    proc = run_warm("train.py", ["--config", CONFIG, "--set", ...], nproc=4, env=env)

Why: a train.py run of the suite trains for one or two seconds but starts for twenty (a
launcher and four ranks each importing torch, DeepSpeed and torch's compiler on 2 cores).
The forkserver imported all of that once (helpers/rank_preload.py), so a rank forked
from it starts at once. What it does not cover, tests of the real launchers do:
`torchrun` and `python train.py` (run_train(..., launcher="fresh")), `srun`
(tests/test_slurm.py), and generate.py's teardown in a finalizing interpreter
(tests/test_generate.py).

Returns a subprocess.CompletedProcess as subprocess.run(capture_output=True, text=True)
would: nproc=1 is `python ENTRYPOINT` (no launcher variables; the entrypoint's own
world of one) and its exit code; nproc > 1 exits 1 when a rank fails, as torchrun does,
with a last stderr line naming the rank and its code. A run past ``timeout`` seconds is
killed and raises subprocess.TimeoutExpired.
"""
from __future__ import annotations

import atexit
import importlib
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_warm(script: str, argv, nproc: int, env: dict, timeout: float,
             cwd: str = ROOT) -> subprocess.CompletedProcess:
    import torch.distributed as dist
    from ctxpar.testing.distributed import start_forkserver

    ctx = start_forkserver()
    module = os.path.splitext(script)[0].replace(os.sep, ".")  # train.py -> train
    args = [os.path.join(ROOT, script), *argv]
    store = None
    rank_envs = [dict(env)]
    if nproc > 1:
        # Port 0: the OS picks a free one as the store binds, so no two launches collide.
        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        rank_envs = [{**env, **torchrun_env(r, nproc, store.port)} for r in range(nproc)]
    with tempfile.TemporaryDirectory(prefix="warm-launch-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        procs = [ctx.Process(target=_rank_main, args=(module, args, e, cwd, out, err),
                             name=f"rank{r}") for r, e in enumerate(rank_envs)]
        for p in procs:
            p.start()
        try:
            failed = _wait(procs, timeout)
        except subprocess.TimeoutExpired:
            _stop(procs)
            raise subprocess.TimeoutExpired(["warm", script, *argv], timeout,
                                            _read(out), _read(err)) from None
        finally:
            del store
        stdout, stderr = _read(out), _read(err)
    if failed is None:
        code = 0
    elif nproc == 1:
        code = failed[1]
    else:
        code = 1
        stderr += f"warm launch: rank {failed[0]} exited with code {failed[1]}; stopped the others\n"
    return subprocess.CompletedProcess([script, *argv], code, stdout, stderr)


def torchrun_env(rank: int, world: int, port: int) -> dict:
    """The variables torchrun gives worker `rank` of `world` on one node (torch's
    distributed/elastic/agent/server/local_elastic_agent.py)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}


def _wait(procs, timeout):
    """Until every rank has exited (None) or one failed ((index, exit code)), when the
    others are stopped as torchrun stops them."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            _stop(procs)
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("warm launch", timeout)
        time.sleep(0.05)


def _stop(procs, grace: float = 5.0):
    """SIGTERM the ranks still running, SIGKILL those left after `grace` seconds."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _read(path):
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def _rank_main(module, argv, env, cwd, out, err):
    """One rank: its environment, cwd, argv and output files, then the entrypoint's main()
    and its exit hooks (a forked child would skip them: multiprocessing leaves by os._exit)."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = list(argv)
    try:
        code = importlib.import_module(module).main()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
