"""`make test-quick` runs the tests marked `quick` (pytest.ini): one fast case of each
module's core parity, the loop while editing; `make test` runs everything, as CI does.
Every test module has at least one quick case, so an edit anywhere gets an answer from the
quick tier, or the module says here why it has none."""
import glob
import os
import re

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
QUICK = re.compile(r"\bmark\.quick\b")  # @pytest.mark.quick, pytest.param(..., marks=...)
EXEMPT = {  # module: why it has no quick case
    "test_gpu.py": "CUDA only: skipped wherever make test-quick runs (CI, the 2-core machines)",
    "test_slurm.py": "starts a Slurm controller and node daemons first (needs slurm-wlm)",
    "test_reshard.py": "every test is a chain of 4-process train.py runs; train.py's resume "
                       "is quick in test_checkpoint_compat.py, a checkpoint loaded at "
                       "another tp in test_generate.py",
    "test_train_attention_kinds.py": "two 4-process train.py runs and their reference; the "
                                     "masks' parity is quick in test_attention_mask.py",
}


@pytest.mark.quick
def test_every_module_has_a_quick_case_or_says_why_not():
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(TESTS, "test_*.py")))
    quick = {m for m in modules if QUICK.search(open(os.path.join(TESTS, m)).read())}
    missing = [m for m in modules if m not in quick and m not in EXEMPT]
    assert not missing, f"no quick case and no exemption here: {missing}"
    stale = [m for m in EXEMPT if m not in modules or m in quick]
    assert not stale, f"exempt but gone or with a quick case: {stale}"
