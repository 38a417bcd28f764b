"""tools/gpu_check.py's plumbing on CPU: it runs for real only on a GPU node.

A dry run of three parts (and of the linear mixers' part on its own) (one of them out of time on purpose) writes both reports and
keeps going; the fp32 reference it holds the kernels to is checked against the math
kernel itself. The remaining parts (pytest, cp_efficiency, train) are the same plumbing
around subprocesses: `python tools/gpu_check.py --dry-run` runs all six in ~25 s.
"""
import json
import os
import subprocess
import sys

import pytest

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")


def _tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.quick
def test_help_documents_every_part():
    out = _tool("--help").stdout
    for word in ("--dry-run", "--budget", "env", "pytest", "kernels", "linear", "cp_efficiency",
                 "memory", "train", "report.md", "20 min"):
        assert word in out, word


def test_dry_run_reports_every_part_and_outlives_one_that_runs_out_of_time(tmp_path):
    proc = _tool("--dry-run", "--parts", "env", "kernels", "memory", "--budget", "memory=0.2",
                 "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one part did not finish
    parts = json.load(open(tmp_path / "report.json"))["parts"]
    assert [parts[p]["status"] for p in ("env", "kernels", "memory")] == \
        ["ok", "ok", "timeout"], parts
    assert parts["env"]["data"]["alloc_conf"] == os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rows = parts["kernels"]["data"]["rows"]
    assert rows and all(r["ok"] and r["kernel"] == "sdpa" for r in rows)
    assert {(r["head_dim"], r["causal"]) for r in rows} == {(16, True), (16, False),
                                                            (24, True), (24, False)}
    md = open(tmp_path / "report.md").read()
    assert "| memory | timeout |" in md and "## Kernels against the fp32 reference" in md


def test_linear_part_compares_every_op_with_and_without_documents(tmp_path):
    """On CPU the linear part runs its plumbing (the torch path against itself: error 0) for
    every op (Gated DeltaNet, KDA, SSD, conv), one process and a simulated rank, with and
    without documents; on a GPU the same rows hold the libraries' kernels."""
    proc = _tool("--dry-run", "--parts", "linear", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    part = json.load(open(tmp_path / "report.json"))["parts"]["linear"]
    rows = part["data"]["rows"]
    assert {(r["op"], r["where"], r["documents"]) for r in rows} == {
        (op, where, docs) for op in ("gated_delta", "kda", "ssd", "conv")
        for where in ("cp1", "cp4 rank 1 (simulated)") for docs in (False, True)}
    assert all(r["ok"] and r["max_err"] == 0 and "dout" not in r["errors"] for r in rows)
    assert "## Linear mixers' GPU kernels" in open(tmp_path / "report.md").read()


def test_the_reference_in_row_blocks_is_the_math_kernel():
    """The kernels part's fp32 reference, computed a few query rows at a time with its own
    causal mask, equals the math kernel on the whole block (same fp32 ops per row)."""
    from ctxpar.context_parallel.kernels import MathBackend
    from ctxpar.testing.attention import reference_attention_in_rows
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 10, 4, 8, generator=g) for _ in "qo")
    k, v = (torch.randn(2, 10, 2, 8, generator=g) for _ in "kv")
    for causal in (True, False):
        got = reference_attention_in_rows(q, k, v, dout, causal, 0.3, rows=3)
        out, lse = MathBackend().forward(q, k, v, causal, 0.3)
        want = (out, lse, *MathBackend().backward(dout, q, k, v, out, lse, causal, 0.3))
        for a, b in zip(got, want):  # fp32, sums in another order: ~1e-7
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_planner_bytes_for_every_pattern():
    from tools.gpu_check_parts import planner_attention_bytes
    for comm, u in (("ring", 1), ("allgather", 1), ("ulysses", 8), ("hybrid", 2)):
        got = planner_attention_bytes(comm, 32768, 8, u, 32, 8, 128, 2)
        assert got["saved"] > 0 and got["buffers"] > 0, (comm, got)
