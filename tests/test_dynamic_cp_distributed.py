"""Dynamic CP over processes: the tiles' groups (exact rank lists), then a step's documents
run by the schedule on 4 ranks (cp2 x dp2's DP x CP group) against one process running
each document alone: per-token logits, the token-mean loss and every gradient, for the
ring, all-gather, Ulysses and hybrid (Ulysses degree 2 around the ring) patterns, the
model with mHC's residual streams (model.hyper_connections) (fp32;
the tolerance is test_documents.py's: the ring's merge and the gradient sum over ranks add
in another order)."""
import pytest
import torch

from ctxpar.dynamic_cp.schedule import schedule
from ctxpar.dynamic_cp.stream import dynamic_cp_sizes
from ctxpar.dynamic_cp.groups import dynamic_group_ranks, hybrid_ranks, tile_ranks
from ctxpar.distributed.parallel_state import rank_grid
from ctxpar.testing import run_distributed
from models.options import ModelOptions

# Inputs per document (stored: one more, EOS) and 16 tokens per rank: under zigzag the
# sizes are 4, 3, 2, 2, 2 and 1 for the rest (ulysses, 4 heads, and hybrid, Ulysses
# degree 2: 1, 2 and 4 only).
INPUTS = [55, 40, 25, 30, 9, 6, 12, 15, 3, 20]
BUDGET, LAYOUT, COMMS, U = 16, "zigzag", ("ring", "allgather", "ulysses", "hybrid"), 2


def _cost(n, d):  # placement only: any deterministic model gives a valid schedule
    return n / d + n * n / (512 * d)


def _sizes(comm):
    return dynamic_cp_sizes(4, comm, heads_per_rank=4, ulysses=U)


def _cfg():
    from ctxpar.config import ModelConfig
    from ctxpar.config.hyper_connections import HyperConnectionsConfig
    # with mHC's N residual streams (token-local: each pack's ranks map their own tokens)
    return ModelConfig(vocab_size=64, seq_len=64, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=2, hyper_connections=HyperConnectionsConfig(3, 5))


def _documents():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 64, (n + 1,), generator=g).numpy() for n in INPUTS]


@pytest.mark.quick
def test_tiles_are_the_same_positions_of_every_dp_cp_group():
    groups = rank_grid(8, tp=2, cp=2)["dp_cp"]          # tp2 x cp2 x dp2: [0,2,4,6], [1,3,5,7]
    assert groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert tile_ranks(groups, [1, 3, 4]) == [((0, 3), [0, 2, 4]), ((0, 4), [0, 2, 4, 6]),
                                             ((0, 3), [1, 3, 5]), ((0, 4), [1, 3, 5, 7])]
    assert tile_ranks(rank_grid(4, cp=2)["dp_cp"], [1, 2, 3, 4]) == [
        ((0, 2), [0, 1]), ((2, 2), [2, 3]), ((0, 3), [0, 1, 2]), ((0, 4), [0, 1, 2, 3])]


def test_hybrid_tiles_split_into_contiguous_ulysses_and_strided_ring_groups():
    assert _sizes("hybrid") == [1, 2, 4] and _sizes("ring") == [1, 2, 3, 4]
    # position p of a tile: Ulysses group p // u (the u contiguous ranks), ring group p % u
    assert hybrid_ranks([0, 2, 4, 6], 2) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    assert hybrid_ranks([1, 3, 5, 7, 9, 11], 3) == ([[1, 3, 5], [7, 9, 11]],
                                                    [[1, 7], [3, 9], [5, 11]])
    # every set once, in creation order; the two-rank tiles are the four's Ulysses groups
    assert dynamic_group_ranks(rank_grid(4, cp=2)["dp_cp"], [1, 2, 4], U) == [
        [0, 1], [2, 3], [0, 1, 2, 3], [0, 2], [1, 3]]
    assert dynamic_group_ranks(rank_grid(8, tp=2, cp=2)["dp_cp"], [1, 2, 4], U) == [
        [0, 2], [4, 6], [0, 2, 4, 6], [0, 4], [2, 6],
        [1, 3], [5, 7], [1, 3, 5, 7], [1, 5], [3, 7]]
    assert dynamic_group_ranks(rank_grid(4, cp=2)["dp_cp"], [1, 2, 3, 4]) == [
        ranks for _, ranks in tile_ranks(rank_grid(4, cp=2)["dp_cp"], [1, 2, 3, 4])]


def test_a_one_rank_hybrid_pack_runs_as_the_other_patterns_one_rank_packs():
    """Ulysses and ring groups LOCAL (the one-rank tile's): the same kernel calls, bit for
    bit, as every other pattern with its group LOCAL."""
    from ctxpar.context_parallel import LOCAL
    from ctxpar.dynamic_cp.batch import pack_sequence, shard_pack
    from models.gpt import GPT

    full = pack_sequence(_documents()[4:7], 32)
    local = shard_pack(full, LOCAL, LAYOUT)
    args = (local["tokens"], local["positions"], local["labels"])
    out = {}
    for comm in COMMS:
        model = GPT(_cfg(), options=ModelOptions(layout=LAYOUT, cp_comm=comm, seed=11))
        model.use_cp_group(LOCAL, LOCAL, LOCAL)
        loss = model(*args, cu_seqlens=local["cu_seqlens"])
        loss.backward()
        out[comm] = [loss.detach()] + [p.grad for p in model.parameters()]
    for comm in COMMS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[comm], out["ring"])), comm


def _dynamic_step(rank, world):
    from ctxpar import init_parallel_state
    from ctxpar.context_parallel import gather_sequence
    from ctxpar.dynamic_cp.groups import build_dynamic_cp_groups
    from ctxpar.context_parallel.comm import group_rank_and_size
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.dynamic_cp import pack_inputs
    from models.gpt import GPT
    from models.options import ModelGroups
    import torch.distributed as dist

    state = init_parallel_state(cp=2, ulysses=U)
    groups = build_dynamic_cp_groups(state, _sizes("ring"))
    hybrid = build_dynamic_cp_groups(state, _sizes("hybrid"), ulysses=U)
    docs, n_tokens = _documents(), sum(INPUTS)
    out = {"tiles": sorted(groups.groups),
           "hybrid_groups": {t: tuple(group_rank_and_size(g) for g in hybrid.tile_groups(*t)[1:])
                      for t in sorted(hybrid.groups)}}
    for comm in COMMS:
        tiles = hybrid if comm == "hybrid" else groups
        model = GPT(_cfg(), ModelGroups(cp_group=state.cp_group, ulysses_group=
                                        state.ulysses_group, ring_group=state.ring_group),
                    ModelOptions(layout=LAYOUT, cp_comm=comm, seed=11))
        plan = schedule(INPUTS, world, BUDGET, _cost, 1.0, LAYOUT, _sizes(comm))
        loss, logits, sizes = torch.zeros(()), {}, {}
        for pack in plan.packs_of(tiles.position):
            tile = tiles.tile_groups(pack.first, pack.size)
            group = tile.cp_group
            local = pack_inputs(model, tile, [docs[i] for i in pack.docs], pack.length,
                                LAYOUT)
            loss_sum = model(local["tokens"], local["positions"], local["labels"],
                             cu_seqlens=local["cu_seqlens"])
            (loss_sum / n_tokens).backward()        # the token mean over the whole step
            loss += loss_sum.detach()
            with torch.no_grad():
                y = model(local["tokens"], local["positions"], cu_seqlens=local["cu_seqlens"])
                y = gather_sequence(y, 1, group, LAYOUT, tile.ulysses)[0]  # (length, V)
            cu = local["cu_seqlens"][0].tolist()
            for j, i in enumerate(pack.docs):
                logits[i], sizes[i] = y[cu[j]:cu[j + 1]], pack.size
        dist.all_reduce(loss)                       # every rank's share of every pack
        for p in model.parameters():
            dist.all_reduce(p.grad)                 # the unchanged DP x CP reduction
        out[comm] = dict(loss=(loss / n_tokens).item(), logits=logits, sizes=sizes,
                         grads=gather_full_state_dict(model, None, grads=True))
    return out


def _one_process():
    from models.gpt import GPT
    model = GPT(_cfg(), options=ModelOptions(seed=11))
    loss, logits = torch.zeros(()), {}
    for i, d in enumerate(_documents()):
        tokens, labels = torch.as_tensor(d[None, :-1]), torch.as_tensor(d[None, 1:])
        pos = torch.arange(tokens.shape[1])
        loss_sum = model(tokens, pos, labels)
        (loss_sum / sum(INPUTS)).backward()
        loss += loss_sum.detach()
        with torch.no_grad():
            logits[i] = model(tokens, pos)[0]
    return (loss / sum(INPUTS)).item(), logits, {n: p.grad for n, p in model.named_parameters()}


def test_a_dynamic_step_equals_one_process_running_each_document():
    want_loss, want_logits, want_grads = _one_process()
    results = run_distributed(_dynamic_step, 4, timeout=400)
    # each rank has its one-rank tile and the groups holding it, e.g. rank 2: (0,3), (2,2)
    assert results[2]["tiles"] == [(0, 3), (0, 4), (2, 1), (2, 2)]
    assert results[3]["tiles"] == [(0, 4), (2, 2), (3, 1)]
    # hybrid, rank 2: (rank, size) in its Ulysses group [2, 3] and ring group [0, 2] of
    # the four; at size 2 = u the ring is LOCAL, at size 1 both are
    assert results[2]["hybrid_groups"] == {(0, 4): ((0, 2), (1, 2)), (2, 1): ((0, 1), (0, 1)),
                                    (2, 2): ((0, 2), (0, 1))}
    for comm in COMMS:
        sizes = {}
        for rank, res in enumerate(results):
            got = res[comm]
            sizes.update(got["sizes"])
            where = f"{comm} rank {rank}"
            assert abs(got["loss"] - want_loss) <= 1e-6 * abs(want_loss), where
            for i, y in got["logits"].items():
                torch.testing.assert_close(y, want_logits[i], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} document {i}: {m}")
            for name, g in want_grads.items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where} {name}: {m}")
        assert sorted(sizes) == list(range(len(INPUTS)))           # every document ran
        want_sizes = set(_sizes(comm))
        assert set(sizes.values()) == want_sizes
