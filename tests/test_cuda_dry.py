"""The CUDA path without a GPU (CI never has one).

The dry run: tests/cuda_dry_cases.py on fake CUDA tensors, in a process whose CPU-only
torch has a fake CUDA device (tests/fake_cuda.py; the rules and stand-ins it checks
against are in tests/cuda_dry.py). To run a few of its cases with their own report:
    python tests/fake_cuda.py -k "ring and zigzag"

And, on real CPU tensors, what cannot run on fake ones: the fused LSE merge CUDA compiles
(torch.compile), and the host-side pieces of the CUDA route.
"""
import os
import re
import subprocess

import pytest
import torch

import fake_cuda


def pinned_torch() -> str:
    """The torch version `make install` pins (tools/install_torch.sh's TORCH_VERSION default)."""
    root = os.path.dirname(os.path.dirname(__file__))
    with open(os.path.join(root, "tools", "install_torch.sh")) as f:
        return re.search(r"TORCH_VERSION:-([0-9.]+)", f.read()).group(1)


def _cannot_run(why: str) -> None:
    """On the torch the project pins (CI's), the dry run must run: a moved private API or a
    fake_cuda.cpp that no longer builds fails the test. On another torch a user installed,
    it skips with the reason (the private APIs it needs may move between releases)."""
    if torch.__version__.split("+")[0] == pinned_torch():
        pytest.fail(f"{why} on the pinned torch {torch.__version__}", pytrace=False)
    pytest.skip(f"{why} (torch {torch.__version__}; the project pins {pinned_torch()})")


def test_cuda_path_on_fake_cuda_tensors():
    """Every case of tests/cuda_dry_cases.py passes in the fake-CUDA process (its output,
    with each failing case's traceback, is the message when one does not)."""
    why = fake_cuda.private_api_problem()
    if why:
        _cannot_run(why)
    try:
        lib = fake_cuda.guard_library()  # g++, cached: seconds the first time
    except subprocess.CalledProcessError as e:  # the compiler ran and refused the source
        first = next((ln for ln in e.stderr.splitlines() if "error" in ln), e.stderr[:300])
        _cannot_run(f"tests/fake_cuda.cpp no longer builds (c10's FakeGuardImpl or the CUDA "
                    f"hooks moved?): {first}")
    proc = subprocess.run(fake_cuda.child_command(lib, ["-rfE"]), env=fake_cuda.child_env(),
                          capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-12000:]
    assert proc.returncode == 0, f"fake-CUDA dry run failed (rc={proc.returncode}):\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail


def _merge_inputs(B, L, H, D, dtype, gen):
    """Accumulators (a view of a longer sequence, as the ring merges into) and a block."""
    out = torch.randn(B, 2 * L, H, D, generator=gen)
    lse = torch.randn(B, H, 2 * L, generator=gen)
    lse[..., :1] = float("-inf")  # a row that has seen no key yet
    blk = torch.randn(B, L, H, D, generator=gen).to(dtype)
    blk_lse = torch.randn(B, H, L, generator=gen)
    return out, lse, blk, blk_lse


def test_fused_merge_outlives_the_recompile_limit():
    """The merge CUDA fuses, over more block shapes and dtypes than dynamo's recompile limit
    (forced down to 2 here): every call merges exactly as the eager merge, and the fused
    merge stays on (was: fullgraph=True made the limit an error after ~8 configurations,
    which turned the merge eager for the rest of the process). dynamo on the 'eager'
    backend: the same guards and recompiles, without generating kernels."""
    from ctxpar.context_parallel.merge import FusedMerge, merge_block_eager_
    torch._dynamo.reset()
    fused = FusedMerge(backend="eager", recompile_limit=2)
    gen = torch.Generator().manual_seed(0)
    try:
        for B, L, dtype in [(2, 8, torch.float32), (2, 12, torch.float32), (1, 8, torch.float32),
                            (2, 8, torch.bfloat16), (1, 1, torch.float16), (2, 5, torch.float16)]:
            out, lse, blk, blk_lse = _merge_inputs(B, L, 2, 8, dtype, gen)
            want_out, want_lse = out.clone(), lse.clone()
            merge_block_eager_(want_out[:, L:], want_lse[:, :, L:], blk, blk_lse)
            fused(out[:, L:], lse[:, :, L:], blk, blk_lse)
            # fp32 reordered inside a fused kernel (sigmoid/lerp in registers): ~1 ulp
            torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-6)
        assert fused.worked and not fused.disabled
    finally:
        torch._dynamo.reset()


def test_fused_merge_without_a_compiler_merges_eagerly(caplog):
    """A compiler that fails before its first success (no triton on a GPU box, say) turns
    the fused merge off for good, once, with one warning; results stay exact."""
    from ctxpar.context_parallel.merge import FusedMerge, merge_block_eager_

    def broken(*args):
        raise RuntimeError("Cannot find a working triton installation")
    fused = FusedMerge(backend="eager")
    fused.fn = broken
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        out, lse, blk, blk_lse = _merge_inputs(1, 4, 2, 8, torch.float32, gen)
        want_out, want_lse = out.clone(), lse.clone()
        merge_block_eager_(want_out[:, 4:], want_lse[:, :, 4:], blk, blk_lse)
        fused(out[:, 4:], lse[:, :, 4:], blk, blk_lse)
        torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=0)
    assert fused.disabled
    assert [r.message for r in caplog.records].count(
        "fused LSE merge unavailable, merging eagerly (RuntimeError: Cannot find a working "
        "triton installation)") == 1


@pytest.mark.quick
def test_unpacking_documents_once_per_packed_tensor():
    """What the pipeline's blocks call on each layer: the first call per packed tensor
    reads it, the next ones reuse the result; a new tensor or an in-place change reads
    again (on a GPU each read is a blocking copy, tests/cuda_dry_cases.py counts them)."""
    from ctxpar.context_parallel.documents import pack_cu_seqlens, unpack_cu_seqlens
    cus = [torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)]
    packed = pack_cu_seqlens(cus, 8)
    first = unpack_cu_seqlens(packed)
    assert unpack_cu_seqlens(packed) is first
    assert [c.tolist() for c in first] == [[0, 3, 8], [0, 8]]
    packed[0, :3] = torch.tensor([0, 5, 8], dtype=torch.int32)  # reused in place
    assert [c.tolist() for c in unpack_cu_seqlens(packed)] == [[0, 5, 8], [0, 8]]
    again = pack_cu_seqlens(cus, 8)
    assert unpack_cu_seqlens(again) is not first


def test_cuda_allocator_defaults_keep_the_users_choice():
    from ctxpar.distributed.parallel_state import cuda_allocator_defaults
    env = {}
    assert cuda_allocator_defaults(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert cuda_allocator_defaults(env) == "max_split_size_mb:512"


def test_fake_cuda_device_exists_only_in_the_dry_runs_process():
    """This test process keeps its real CUDA (none here): the fake device is loaded only in
    the process tests/fake_cuda.py starts."""
    assert not torch.cuda.is_available()
    assert fake_cuda.CHILD_ENV not in os.environ
