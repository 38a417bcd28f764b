"""--max-seq-len's "bound by" line (ctxpar/plan/bound.py): which memory stops the longest
context, the GPU's or the host's, how fast it grows a token, and what a target length
would need. One layout of gpt1b_32k_3d on one H100: GPU-bound as it is, host-bound with
its activations offloaded to a small host; in both the line's need at twice the longest
length is the planner's own memory there (the peak and the host bytes are affine in
seq_len here: within 2%), and the rate is what separates the two lengths. Checked by hand
to fail: the rate taken over the whole length (from zero) instead of n/2..n (the GPU's
constant model state then counts as growth: 144 GB for 122; the host's bytes have no
constant part, so its case cannot tell)."""
import os
import re

import pytest

from ctxpar.config import load_config
from ctxpar.plan.bound import bound_by
from ctxpar.plan.cluster import Cluster, gpu_preset
from ctxpar.plan.longest import Allowed, Bisection, candidates, longest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETS = ["train.global_batch_size=1", "parallel.dp=1"]


def _need(line: str) -> float:
    return float(re.search(r"tokens: ~([\d.]+) GB", line).group(1)) * 1e9


@pytest.mark.quick
@pytest.mark.parametrize("offload, host, binds", [(False, 2000e9, "GPU memory"),
                                                  (True, 10e9, "host memory")])
def test_bound_by_names_the_binding_memory_and_what_twice_the_length_needs(offload, host,
                                                                         binds):
    cfg = load_config(os.path.join(ROOT, "configs", "gpt1b_32k_3d.yaml"), SETS,
                      check_paths=False)
    cluster = Cluster(1, 1, gpu_preset("h100", host_memory=host))
    allowed = Allowed(options=("offload_activations",) if offload else (), patterns=(),
                      tp=1, pp=1)
    cand = next(c for c in candidates(cfg, cluster, allowed)
                if c.zero == 3 and c.activation == "full" and c.offload_activations == offload)
    n, _ = longest(cfg, cand, cluster)
    line = bound_by(cfg, cand, cluster, n, target=2 * n)
    assert line.startswith(f"bound by: {binds}, "), line
    b = Bisection(cfg, cand, cluster)
    there = b.mem(2 * n // b.u)
    want = there.peak if binds == "GPU memory" else there.host_total
    assert abs(_need(line) - want) <= 0.02 * want, (line, want / 1e9)
