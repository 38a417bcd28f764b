"""tools/install_torch.sh: which index the pinned torch comes from, and that an index that
cannot be reached costs seconds, not a hang. Dry runs: nothing is installed."""
import os
import socket
import subprocess
import sys
import time

import pytest

from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "install_torch.sh"


def run_script(tmp_path, cpu_index, gpu=False, timeout_s="2"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
    # PATH holds only the fake tools: a GPU machine's own nvidia-smi must not leak in.
    env = {"PATH": str(bin_dir), "TORCH_CPU_INDEX": cpu_index,
           "TORCH_INDEX_TIMEOUT": timeout_s}
    start = time.monotonic()
    out = subprocess.run(["/bin/bash", str(SCRIPT), sys.executable, "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=30)
    return out, time.monotonic() - start


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.quick
def test_refused_cpu_index_falls_back_to_the_default_index_at_once(tmp_path):
    out, took = run_script(tmp_path, f"http://127.0.0.1:{closed_port()}/whl/cpu")
    assert out.returncode == 0, out.stderr
    assert "did not answer" in out.stdout
    assert "would run:" in out.stdout and "--index-url" not in out.stdout
    assert out.stdout.rstrip().endswith("-m pip install torch==2.13.0")
    assert took < 5


def test_silent_cpu_index_is_given_up_after_the_timeout(tmp_path):
    # A listening socket that never answers: the probe must stop at TORCH_INDEX_TIMEOUT.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        out, took = run_script(tmp_path, f"http://127.0.0.1:{port}/whl/cpu", timeout_s="1")
    assert out.returncode == 0, out.stderr
    assert "did not answer within 1s" in out.stdout
    assert "--index-url" not in out.stdout
    assert 0.9 < took < 5


def test_answering_cpu_index_gives_the_cpu_build(tmp_path):
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    port = closed_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1", "--directory", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        index = f"http://127.0.0.1:{port}/whl/cpu"
        for _ in range(100):  # until the server listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        out, _ = run_script(tmp_path, index)
    finally:
        server.terminate()
        server.wait()
    assert out.returncode == 0, out.stderr
    assert "the CPU build" in out.stdout
    assert f"--index-url {index} --timeout 2 --retries 1 torch==2.13.0" in out.stdout


def test_gpu_machine_gets_the_default_index_cuda_build(tmp_path):
    # The CPU index would answer nothing here; with nvidia-smi present it is never asked.
    out, _ = run_script(tmp_path, f"http://127.0.0.1:{closed_port()}/whl/cpu", gpu=True)
    assert out.returncode == 0, out.stderr
    assert "nvidia-smi found" in out.stdout and "CUDA build" in out.stdout
    assert "--index-url" not in out.stdout
    assert out.stdout.rstrip().endswith("-m pip install torch==2.13.0")
