"""ctxpar's Ulysses equals DeepSpeed-Ulysses, through the benchmark that compares their speed.

tools/benchmarks/bench_ulysses.py runs ``context_parallel_attention(comm="ulysses")`` and DeepSpeed's
own ``DistributedAttention`` side by side on real gloo ranks around the same fused kernel
and reports the largest difference of their outputs and input gradients. Both hand that
kernel the same tokens of the same heads in the same (contiguous) layout, so the results
must be bitwise equal; any regrouping mistake (a wrong head group, token order or
gradient routing) shows as a difference of order 1. MHA and GQA (8/2 heads); a tiny n keeps
it to seconds (the timing itself is the benchmark's business, docs/benchmarks.md).
"""
import json
import math

import pytest


pytest.importorskip("deepspeed")


@pytest.mark.quick
def test_ctxpar_ulysses_equals_deepspeed_ulysses(tmp_path, monkeypatch):
    from tools.benchmarks import bench_ulysses

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    out = tmp_path / "bench.json"
    bench_ulysses.main(["--seq-len", "256", "--world-sizes", "2", "--kv-heads", "8", "2",
                        "--iters", "1", "--warmup", "0", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["P"], r["heads"], r["kv_heads"]) for r in rows] == [(2, 8, 8), (2, 8, 2)]
    for r in rows:
        assert r["max_diff"] == 0.0, r
        assert all(math.isfinite(x) and x > 0 for x in r["ratio"].values()), r
