"""A real single-node Slurm (munged + slurmctld + slurmd) under a temp dir, for tests.

    with slurm_cluster() as cluster:              # or the pytest fixture in test_slurm.py
        cluster.run(["srun", "-N1", "-n2", "hostname"])
        env = cluster.env                         # os.environ + SLURM_CONF for sbatch/srun

Everything (munge key and socket, slurm.conf, state, spool, logs, pid files) lives in one
temp dir, on free ports, so it can run beside another test's cluster on the same machine.
The settings are the ones checked in /work/shared/ENVIRONMENT.md ("A real Slurm on one
machine"). Every wait has a timeout; on exit jobs are cancelled and the daemons stopped by
the pids in their pid files (SIGTERM, then SIGKILL), so a failing test never leaves a
cluster behind or hangs the suite.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List

DAEMONS = ("slurmd", "slurmctld", "munged")  # stop order: the node, the controller, auth


def slurm_missing() -> str:
    """Why a cluster cannot start here ('' when it can): the daemons are not installed."""
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo")
               if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found); on Debian: "
                f"apt-get install slurm-wlm munge (.ci/run does this when apt is there)")
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (SlurmUser=root) and this is not root"
    return ""


def _free_ports(n: int) -> List[int]:
    """n distinct free TCP ports (all held open while choosing, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the test process dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: str, cpus: int):
        self.root, self.cpus = root, cpus
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(root, "slurm.conf")
        self.env: Dict[str, str] = {**os.environ, "SLURM_CONF": self.conf}
        for k in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if k != "SLURM_CONF":  # a test run inside a Slurm job must not leak its job
                del self.env[k]
        self._procs: Dict[str, subprocess.Popen] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _write_config(self) -> None:
        key = self.path("munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))  # a fresh key: this cluster trusts only itself
        for d in ("state", "spool"):
            os.makedirs(self.path(d))
        ctld_port, d_port = _free_ports(2)
        lines = [
            "ClusterName=ctxpar-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.path('munge.socket.2')}",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={d_port}",
            f"StateSaveLocation={self.path('state')}", f"SlurmdSpoolDir={self.path('spool')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmdPidFile={self.path('slurmd.pid')}",
            f"SlurmctldLogFile={self.path('slurmctld.log')}",
            f"SlurmdLogFile={self.path('slurmd.log')}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "MpiDefault=none", "ReturnToService=2", "MailProg=/bin/true",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "KillWait=5",
            # Declared CPUs may exceed the real cores (to run 8 ranks on 2): slurmd then
            # trusts this file instead of draining the node for "low core count".
            *(["SlurmdParameters=config_overrides"] if self.cpus > os.cpu_count() else []),
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP "
            f"OverSubscribe=YES",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: List[str]) -> None:
        log = open(self.path(f"{name}.out"), "wb")
        # Foreground (-F / -D) so the pid is known at once; own session so a Ctrl-C to the
        # test's process group does not reach it first; dies with the test process.
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env,
                                             start_new_session=True,
                                             preexec_fn=_die_with_parent)
        log.close()

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self._write_config()
        p = self.path
        self._spawn("munged", [_exe("munged"), "-F", "--force", f"--socket={p('munge.socket.2')}",
                               f"--key-file={p('munge.key')}", f"--log-file={p('munged.log')}",
                               f"--pid-file={p('munged.pid')}", f"--seed-file={p('munge.seed')}"])
        self._wait(lambda: os.path.exists(p("munge.socket.2")), 15, "munged's socket")
        self._spawn("slurmctld", [_exe("slurmctld"), "-D", "-f", self.conf])
        self._spawn("slurmd", [_exe("slurmd"), "-D", "-f", self.conf])
        self._wait(self._node_idle, timeout, f"node {self.host} idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, pr in self._procs.items() if pr.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited with {self._procs[dead[0]].returncode} "
                                   f"while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    def run(self, argv: List[str], check: bool = True, timeout: float = 60.0, **kw
            ) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster; output as text."""
        try:
            r = subprocess.run(argv, env=kw.pop("env", self.env), capture_output=True,
                               text=True, timeout=timeout, **kw)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{' '.join(argv)} timed out after {timeout}s\n{self.logs()}"
                               ) from e
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}"
                               f"\n{self.logs()}")
        return r

    def logs(self, tail: int = 15) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmctld.out",
                     "slurmd.out", "munged.out"):
            with contextlib.suppress(OSError), open(self.path(name), errors="replace") as f:
                lines = f.read().splitlines()[-tail:]
                if lines:
                    out.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):  # jobs first, so no slurmstepd outlives us
                self.run(["scancel", "--full", "--user=root"], check=False, timeout=10)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and self.run(
                        ["squeue", "-h"], check=False, timeout=10).stdout.strip():
                    time.sleep(0.5)
        for name in DAEMONS:
            pid = self._pid(name)
            if pid is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            proc = self._procs[name]
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def _pid(self, name: str):
        """The daemon's pid from its pid file, or the spawned one (if it died before writing)."""
        proc = self._procs.get(name)
        if proc is None or proc.poll() is not None:
            return None
        with contextlib.suppress(OSError, ValueError), open(self.path(f"{name}.pid")) as f:
            pid = int(f.read().strip())
            if pid == proc.pid:
                return pid
        return proc.pid


@contextlib.contextmanager
def slurm_cluster(cpus: int = 8):
    """Start a private cluster whose one node has `cpus` CPUs; always stop it, remove its dir.

    Slurm refuses --ntasks-per-node above the node's CPUs even with --overcommit, so the
    node declares 8 (the sbatch's GPU default of 8 tasks per node) whatever the cores are.
    """
    root = tempfile.mkdtemp(prefix="ctxpar-slurm-")  # short: unix socket paths max ~107
    cluster = SlurmCluster(root, cpus)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
