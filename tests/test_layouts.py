"""Sequence layouts: exact positions (pure), then shard -> gather on gloo ranks."""
import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel.layouts import (LAYOUTS, gather_sequence, rank_positions, sequence_positions,
                             shard_sequence)
from dist_harness import run_distributed

EXACT = dict(atol=0, rtol=0)  # positions and copied values: no arithmetic, must be exact


@pytest.mark.parametrize("layout,want", [
    # n = 12, P = 3
    ("contiguous", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
    ("zigzag", [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),  # chunks r and 2P-1-r
    ("striped", [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]),  # t on rank t mod P
])
def test_positions_exact(layout, want):
    got = [rank_positions(12, r, 3, layout).tolist() for r in range(3)]
    torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_positions_partition_the_sequence(layout, world):
    n = 16 * world
    pos = torch.cat([rank_positions(n, r, world, layout) for r in range(world)])
    torch.testing.assert_close(pos.sort().values, torch.arange(n), **EXACT)


@pytest.mark.parametrize("n,world,layout,msg", [
    (10, 3, "contiguous", "n=10 is not divisible by P = 3 for layout 'contiguous' with P=3"),
    (12, 4, "zigzag", "n=12 is not divisible by 2P = 8 for layout 'zigzag' with P=4"),
    (7, 2, "striped", "n=7 is not divisible by P = 2 for layout 'striped'"),
    (8, 2, "snake", "unknown sequence layout 'snake'"),
])
def test_bad_lengths_and_layouts(n, world, layout, msg):
    with pytest.raises(ValueError, match=msg):
        rank_positions(n, 0, world, layout)


def test_single_process_without_group():
    assert not dist.is_initialized()
    x = torch.arange(12.0).view(1, 12, 1)
    for layout in LAYOUTS:  # P = 1: everything is local, gather is the identity
        torch.testing.assert_close(shard_sequence(x, 1, None, layout), x, **EXACT)
        torch.testing.assert_close(gather_sequence(x, 1, None, layout), x, **EXACT)
        torch.testing.assert_close(sequence_positions(12, None, layout), torch.arange(12),
                                   **EXACT)


def _example(world):
    """The full tensor and an upstream gradient; the same on every rank and the parent."""
    x = torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(0))
    return x, torch.randn(x.shape, generator=torch.Generator().manual_seed(1))


def _roundtrip(rank, world):
    """Per layout: what this rank got. The parent asserts (a child's first assert_close
    would import torch.distributed.tensor, ~2 s of CPU per rank)."""
    group = dist.new_group(list(range(world)))  # an explicit group, not only the world
    x, w = _example(world)
    res = {}
    for layout in LAYOUTS:
        leaf = shard_sequence(x, 1, group, layout).clone().requires_grad_()
        full = gather_sequence(leaf, 1, group, layout)
        (full * w).sum().backward()
        res[layout] = dict(pos=sequence_positions(x.shape[1], group, layout),
                           local=leaf.detach(), local_neg_dim=shard_sequence(x, -2, group, layout),
                           full=full.detach(), grad=leaf.grad)
    return res


@pytest.mark.parametrize("world", [3, 4])
def test_shard_gather_roundtrip(world):
    x, w = _example(world)
    for rank, res in enumerate(run_distributed(_roundtrip, world, timeout=60)):
        for layout, got in res.items():
            pos = rank_positions(x.shape[1], rank, world, layout)
            msg = lambda m: f"rank {rank} {layout}: {m}"  # noqa: E731
            torch.testing.assert_close(got["pos"], pos, **EXACT, msg=msg)
            torch.testing.assert_close(got["local"], x[:, pos], **EXACT, msg=msg)
            torch.testing.assert_close(got["local_neg_dim"], x[:, pos], **EXACT, msg=msg)
            torch.testing.assert_close(got["full"], x, **EXACT, msg=msg)  # the identity
            # Backward is the shard of the (replicated) gradient.
            torch.testing.assert_close(got["grad"], w[:, pos], **EXACT, msg=msg)
