"""Sequence layouts: exact positions (pure; also the two-level layouts of hybrid CP and the
order Ulysses' all-to-all delivers), then shard -> gather on gloo ranks."""
import itertools

import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel.layouts import (LAYOUTS, gather_sequence, rank_positions,
                                             sequence_positions, shard_sequence,
                                             ulysses_arrival_positions)
from ctxpar.testing import run_distributed

EXACT = dict(atol=0, rtol=0)  # positions and copied values: no arithmetic, must be exact


@pytest.mark.quick
@pytest.mark.parametrize("layout,want", [
    # n = 12, P = 3
    ("contiguous", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
    ("zigzag", [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]),  # chunks r and 2P-1-r
    ("striped", [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]),  # t on rank t mod P
])
def test_positions_exact(layout, want):
    got = [rank_positions(12, r, 3, layout).tolist() for r in range(3)]
    torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.quick
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
    (12, 4, "striped", "Ulysses degree u=3 must be >= 1 and divide the 4 context-parallel"),
])
def test_bad_lengths_and_layouts(n, world, layout, msg):
    with pytest.raises(ValueError, match=msg):
        rank_positions(n, 0, world, layout, ulysses=3 if "Ulysses" in msg else 1)


def two_level_positions(n, rank, world, layout, u):
    """The definition in layouts.py, built literally: the layout over the r = P/u ring
    ranks, then the layout over the u Ulysses ranks by index within that shard."""
    r = world // u
    ring_rank, ulysses_rank = divmod(rank, u)
    shard = rank_positions(n, ring_rank, r, layout)                # n/r global positions
    return shard[rank_positions(n // r, ulysses_rank, u, layout)]  # indices into the shard


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world,u", [(4, 2), (8, 2), (8, 4), (6, 3), (6, 2), (4, 1), (4, 4)])
def test_two_level_layout_is_the_definition(layout, world, u):
    n = 8 * world
    for rank in range(world):
        got = rank_positions(n, rank, world, layout, ulysses=u)
        torch.testing.assert_close(got, two_level_positions(n, rank, world, layout, u), **EXACT)
        if layout != "striped" or u in (1, world):  # the plain layout over P, as documented
            torch.testing.assert_close(got, rank_positions(n, rank, world, layout), **EXACT)


def test_two_level_striped_exact():
    # n = 16, P = 4 = u2 x r2: cp rank (ring j, ulysses i) holds t = j + 2*i (mod 4).
    got = [rank_positions(16, c, 4, "striped", ulysses=2).tolist() for c in range(4)]
    assert got == [[0, 4, 8, 12], [2, 6, 10, 14], [1, 5, 9, 13], [3, 7, 11, 15]]


@pytest.mark.parametrize("layout,want", [
    # A ring rank's shard of 8 tokens over u = 2 Ulysses ranks: where the i-th gathered
    # token (rank 0's shard, then rank 1's) sits in the shard.
    ("contiguous", None),
    ("zigzag", [0, 1, 6, 7, 2, 3, 4, 5]),
    ("striped", [0, 2, 4, 6, 1, 3, 5, 7]),
])
def test_ulysses_arrival_positions(layout, want):
    got = ulysses_arrival_positions(8, 2, layout)
    assert (got if got is None else got.tolist()) == want


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


def _degrees(world):
    """Ulysses degrees to try: 1 (the plain layouts) and a two-level split when P allows."""
    return (1, 2) if world % 2 == 0 else (1,)


def _roundtrip(rank, world):
    """Per (layout, u): what this rank got. The parent asserts (a child's first
    assert_close would import torch.distributed.tensor, ~2 s of CPU per rank)."""
    group = dist.new_group(list(range(world)))  # an explicit group, not only the world
    x, w = _example(world)
    res = {}
    for layout, u in itertools.product(LAYOUTS, _degrees(world)):
        leaf = shard_sequence(x, 1, group, layout, u).clone().requires_grad_()
        full = gather_sequence(leaf, 1, group, layout, u)
        (full * w).sum().backward()
        res[layout, u] = dict(pos=sequence_positions(x.shape[1], group, layout, ulysses=u),
                              local=leaf.detach(),
                              local_neg_dim=shard_sequence(x, -2, group, layout, u),
                              full=full.detach(), grad=leaf.grad)
    return res


@pytest.mark.parametrize("world", [3, 4])
def test_shard_gather_roundtrip(world):
    x, w = _example(world)
    for rank, res in enumerate(run_distributed(_roundtrip, world, timeout=60)):
        assert len(res) == len(LAYOUTS) * len(_degrees(world))
        for (layout, u), got in res.items():
            pos = rank_positions(x.shape[1], rank, world, layout, ulysses=u)
            msg = lambda m: f"rank {rank} {layout} u={u}: {m}"  # noqa: E731
            torch.testing.assert_close(got["pos"], pos, **EXACT, msg=msg)
            torch.testing.assert_close(got["local"], x[:, pos], **EXACT, msg=msg)
            torch.testing.assert_close(got["local_neg_dim"], x[:, pos], **EXACT, msg=msg)
            torch.testing.assert_close(got["full"], x, **EXACT, msg=msg)  # the identity
            # Backward is the shard of the (replicated) gradient.
            torch.testing.assert_close(got["grad"], w[:, pos], **EXACT, msg=msg)
