"""The rank grid: pure checks on rank_grid(), then real gloo groups on spawned ranks."""
import time

import pytest
import torch
import torch.distributed as dist

from ctxpar.distributed.parallel_state import rank_grid
from ctxpar.testing import run_distributed

FAMILIES = ("tp", "cp", "pp", "dp", "dp_cp", "ulysses", "ring")
LAYOUTS = [  # (world, tp, cp, pp)
    (1, 1, 1, 1), (2, 1, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (6, 2, 3, 1), (6, 1, 3, 1),
    (8, 2, 2, 1), (8, 1, 4, 2), (8, 2, 2, 2), (8, 1, 8, 1),
]


@pytest.mark.quick
@pytest.mark.parametrize("world,tp,cp,pp", LAYOUTS)
@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "cp-tp-pp-dp", "dp-pp-cp-tp"])
def test_families_partition_the_world(world, tp, cp, pp, order):
    u = 2 if cp % 2 == 0 else 1  # split every even CP group into Ulysses pairs
    groups = rank_grid(world, tp=tp, cp=cp, pp=pp, order=order, ulysses=u)
    dp = world // (tp * cp * pp)
    want = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "dp_cp": dp * cp, "ulysses": u,
            "ring": cp // u}
    for fam in FAMILIES:
        flat = sorted(r for g in groups[fam] for r in g)
        assert flat == list(range(world)), fam  # every rank in exactly one group
        assert all(len(g) == want[fam] for g in groups[fam]), fam
    # Each CP group is its Ulysses groups side by side: cp rank = ring rank * u + ulysses
    # rank, with ring and Ulysses groups crossing at exactly one rank.
    for cpg in groups["cp"]:
        for c, r in enumerate(cpg):
            ug = next(g for g in groups["ulysses"] if r in g)
            rg = next(g for g in groups["ring"] if r in g)
            assert c == rg.index(r) * u + ug.index(r) and set(ug) | set(rg) <= set(cpg)
            assert set(ug) & set(rg) == {r}
    # dp x cp is exactly the union of this rank's dp group and every cp group along it.
    for r in range(world):
        dpcp = next(g for g in groups["dp_cp"] if r in g)
        dpg = next(g for g in groups["dp"] if r in g)
        union = {x for d in dpg for c in groups["cp"] if d in c for x in c}
        assert set(dpcp) == union


@pytest.mark.quick
def test_order_is_honoured_exact_ranks():
    # tp innermost: TP pairs are adjacent ranks; CP strides by tp; DP strides by tp*cp.
    g = rank_grid(8, tp=2, cp=2, pp=1, order="tp-cp-dp-pp")
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["pp"] == [[r] for r in range(8)]
    # cp innermost: the ring is on adjacent ranks, TP strides by cp.
    g = rank_grid(8, tp=2, cp=2, pp=2, order="cp-tp-pp-dp")
    assert g["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == [[r] for r in range(8)]
    # A 4D example used in docs/parallelism.md: tp2 cp2 pp2 dp2 = 16 ranks.
    g = rank_grid(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp")
    assert g["pp"][0] == [0, 8] and g["dp"][0] == [0, 4] and g["cp"][0] == [0, 2]
    assert g["dp_cp"][0] == [0, 2, 4, 6]


def test_ulysses_and_ring_sub_groups_exact_ranks():
    # tp2 x cp4 (u2 x r2), tp-cp-dp-pp: CP groups stride by tp; Ulysses pairs are adjacent
    # CP ranks (global stride tp), ring pairs stride by tp*u.
    g = rank_grid(8, tp=2, cp=4, order="tp-cp-dp-pp", ulysses=2)
    assert g["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["ulysses"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["ring"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # cp first (innermost), cp8 = u4 x r2 with dp2: Ulysses groups are 4 adjacent ranks.
    g = rank_grid(16, cp=8, order="cp-tp-dp-pp", ulysses=4)
    assert g["ulysses"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g["ring"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["dp_cp"] == [list(range(16))]
    # u = 1: the ring is the CP group; u = cp: Ulysses is.
    g = rank_grid(4, cp=4)
    assert g["ring"] == g["cp"] == [[0, 1, 2, 3]] and g["ulysses"] == [[0], [1], [2], [3]]
    g = rank_grid(4, cp=4, ulysses=4)
    assert g["ulysses"] == g["cp"] and g["ring"] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(world_size=8, tp=3), "tp*cp*pp = 3*1*1 = 3"),
    (dict(world_size=8, tp=2, cp=2, dp=3), "2*2*1*3 = 12 does not equal the world size 8"),
    (dict(world_size=4, tp=0), "tp=0 must be an integer >= 1"),
    (dict(world_size=4, cp=-2), "cp=-2"),
    (dict(world_size=4, dp=0), "dp=0"),
    (dict(world_size=4, cp=4, ulysses=3), "parallel.ulysses=3 must be an integer >= 1 "
                                          "dividing parallel.cp=4"),
    (dict(world_size=4, cp=4, ulysses=0), "parallel.ulysses=0"),
])
def test_bad_sizes_fail_fast(kwargs, msg):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=msg.replace("*", r"\*")):
        rank_grid(**kwargs)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("order", ["tp-cp-dp", "tp-cp-dp-pp-tp", "tp-cp-dp-xx", "tp,cp,dp,pp"])
def test_bad_order_fails(order):
    with pytest.raises(ValueError, match="must name each of tp, cp, pp, dp exactly once"):
        rank_grid(4, order=order)


def _check_groups(rank, world, tp, cp, pp, order, u):
    from ctxpar import DeepSpeedMPU, init_parallel_state
    state = init_parallel_state(tp=tp, cp=cp, pp=pp, order=order, ulysses=u)
    g = rank_grid(world, tp=tp, cp=cp, pp=pp, order=order, ulysses=u)
    out = {}
    for fam in FAMILIES:
        pg = getattr(state, f"{fam}_group")
        ranks = state.ranks(fam)
        assert ranks in g[fam]
        assert dist.get_world_size(pg) == len(ranks)
        assert dist.get_rank(pg) == ranks.index(rank) == getattr(state, f"{fam}_rank")
        # A real collective over the group: the sum of global ranks matches the list.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        assert t.item() == sum(ranks), (fam, t.item(), ranks)
        out[fam] = ranks
    cp_ranks = state.ranks("cp")
    i = cp_ranks.index(rank)
    assert i == state.ring_rank * u + state.ulysses_rank
    assert state.cp_next_rank == cp_ranks[(i + 1) % cp]
    assert state.cp_prev_rank == cp_ranks[(i - 1) % cp]
    assert state.is_pp_first_stage == (state.pp_rank == 0)
    assert state.is_pp_last_stage == (state.pp_rank == pp - 1)
    mpu = DeepSpeedMPU(state)
    assert mpu.get_sequence_data_parallel_world_size() == state.dp_size * cp
    assert mpu.get_model_parallel_world_size() == tp
    assert mpu.get_pipe_parallel_world_size() == pp
    return out


@pytest.mark.parametrize("world,tp,cp,pp,order,u", [
    (1, 1, 1, 1, "tp-cp-dp-pp", 1),
    (2, 1, 2, 1, "tp-cp-dp-pp", 2),
    (4, 2, 2, 1, "cp-tp-dp-pp", 1),
    (6, 2, 3, 1, "tp-cp-dp-pp", 1),
    (8, 2, 2, 2, "tp-cp-dp-pp", 1),
    (8, 1, 4, 2, "cp-dp-tp-pp", 2),
    (8, 2, 4, 1, "tp-cp-dp-pp", 2),
])
def test_real_groups(world, tp, cp, pp, order, u):
    res = run_distributed(_check_groups, world, tp, cp, pp, order, u)
    # Every rank agrees on the partition (no rank built a different grid).
    for fam in FAMILIES:
        groups = {tuple(r[fam]) for r in res}
        assert sorted(x for g in groups for x in g) == list(range(world))


def _bad_layout(rank, world):
    from ctxpar import init_parallel_state
    try:
        init_parallel_state(tp=3, cp=1)
    except ValueError as e:
        return str(e)
    return None


def test_bad_layout_raises_on_every_rank_without_hanging():
    msgs = run_distributed(_bad_layout, 4, timeout=60)
    assert all(m and "world size 4" in m for m in msgs), msgs
