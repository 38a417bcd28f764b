"""Every CP attention pattern vs one-process fp32 attention on the gathered sequence, on gloo.

For each world size one spawned function loops over every (pattern, layout, causal,
heads, dtype, backend) combination on small tensors and returns out, lse, dq, dk, dv and
the per-rank counters; the parent compares them with the reference (outputs, LSE and
gradients at the rank's global positions) and the counters with their formulas (bytes
exact, FLOPs exactly the causally visible pairs, communication calls per layer). Patterns:
ring, allgather and ulysses over the world; hybrid over the ulysses x ring sub-groups of a
ParallelState (2x1 and 1x2 at P=2, which must equal ulysses and ring bit for bit, and
2x2 at P=4). MHA, GQA and MQA; at P=4 GQA 8/2 and MQA replicate kv heads for Ulysses.
"""
import itertools
import math

import pytest
import torch

from ctxpar.context_parallel.layouts import LAYOUTS, rank_positions
from ctxpar.plan.comm_bytes import cp_bytes
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import (B, PATTERNS, S_LOCAL, comm_ops_per_layer, global_inputs,
                                      reference_attention, tolerance)

HEADS = [(4, 4, 40), (8, 2, 64), (8, 1, 40)]  # (heads, kv_heads, head_dim): MHA, GQA, MQA;
                                              # 40 is not a power of two
DTYPES = (torch.float32, torch.bfloat16)
EXACT = dict(atol=0, rtol=0)  # byte and FLOP counts are integers: must match exactly


def visible_pairs(positions, n, causal):
    """(query, key) pairs queries at these positions may see: key position <= query's."""
    return int((positions + 1).sum()) if causal else positions.numel() * n


# ------------------------------------------------------------------ formulas


def expected_flops(comm, P, u, rank, n, layout, causal, H, D):
    """Forward FLOPs of this rank: 4*B*heads*D per visible (query, key) pair it computes."""
    if comm in ("ring", "allgather") or P == 1:
        return 4 * B * H * D * visible_pairs(rank_positions(n, rank, P, layout), n, causal)
    if comm == "ulysses":
        u = P
    r = P // u  # hybrid: H/u heads of ring rank (rank // u)'s shard over r ring ranks
    return 4 * B * (H // u) * D * visible_pairs(rank_positions(n, rank // u, r, layout), n,
                                                causal)


# ------------------------------------------------------------------ the spawned side


def combos(world):
    """(comm, u, causal, (H, Hkv, D), dtype, layout, backend): both kernels for the ring
    (the reference for the others), the default one for the rest."""
    out = []
    for comm, u in PATTERNS[world]:
        backends = ("sdpa", "math") if comm == "ring" else ("sdpa",)
        out += [(comm, u, *c) for c in itertools.product((False, True), HEADS, DTYPES,
                                                           LAYOUTS, backends)]
    return out


def _cp_outputs(rank, world):
    """Each rank's results for every combo; the parent compares them (a child's first
    assert_close would import torch.distributed.tensor, ~2 s of CPU per rank)."""
    from ctxpar import init_parallel_state
    from ctxpar.context_parallel import (NoComm, context_parallel_attention, cp_stats,
                                         shard_sequence)

    states = {u: init_parallel_state(cp=world, ulysses=u) for u in {u for _, u in PATTERNS[world]}}
    results = []
    for comm, u, causal, (H, Hkv, D), dtype, layout, backend in combos(world):
        st = states[u]
        groups = dict(ulysses_group=st.ulysses_group, ring_group=st.ring_group) \
            if comm == "hybrid" else dict(cp_group=st.cp_group)
        q, k, v, dout = global_inputs(world * S_LOCAL, H, Hkv, D, dtype)
        shard = lambda x: shard_sequence(x, 1, st.cp_group, layout, u)  # noqa: E731
        ql, kl, vl = (shard(x).detach().requires_grad_() for x in (q, k, v))
        kw = dict(comm=comm, causal=causal, layout=layout, backend=backend, return_lse=True)
        with cp_stats() as stats:
            out, lse = context_parallel_attention(ql, kl, vl, **groups, **kw)
            out.backward(shard(dout))
        # NoComm stand-ins (the benchmark's compute-only mode): same FLOPs, no byte.
        alone = dict(ulysses_group=NoComm(st.ulysses_rank, u),
                     ring_group=NoComm(st.ring_rank, world // u)) if comm == "hybrid" else \
            dict(cp_group=NoComm(rank, world))
        with cp_stats() as nocomm:
            context_parallel_attention(ql.detach(), kl.detach(), vl.detach(), **alone, **kw)
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            stats=stats.as_dict(), nocomm=nocomm.as_dict()))
    return results


def _reference(n, causal, H, Hkv, D, dtype):
    q, k, v, dout = global_inputs(n, H, Hkv, D, dtype)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, causal, 1 / math.sqrt(D))
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout.float())
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


# the quick tier runs the 2-rank worlds: every pattern once (make test-quick < 90 s)
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.quick) if w == 2 else w
                                   for w in sorted(PATTERNS)])
def test_every_pattern_matches_full_attention(world):
    per_rank = run_distributed(_cp_outputs, world, timeout=420)
    n, refs, cases = world * S_LOCAL, {}, combos(world)
    for i, (comm, u, causal, (H, Hkv, D), dtype, layout, backend) in enumerate(cases):
        combo = f"P={world} {comm} u={u} {layout} causal={causal} H={H}/{Hkv} D={D} {dtype} " \
                f"{backend}"
        key = (causal, H, Hkv, D, dtype)
        if key not in refs:
            refs[key] = _reference(n, *key)
        ref, flops = refs[key], []
        for rank, results in enumerate(per_rank):
            got, pos = results[i], rank_positions(n, rank, world, layout, ulysses=u)
            where = f"{combo} rank {rank}"
            assert got["out"].dtype == dtype and got["out"].shape == (B, S_LOCAL, H, D), where
            assert got["lse"].dtype == torch.float32 and got["lse"].shape == (B, H, S_LOCAL)
            for name in ("out", "lse", "dq", "dk", "dv"):
                expected = ref[name][:, :, pos] if name == "lse" else ref[name][:, pos]
                torch.testing.assert_close(got[name].float(), expected,
                                           **tolerance(dtype, expected),
                                           msg=lambda m: f"{where} {name}: {m}")
            st, ex = got["stats"], dict(EXACT, msg=lambda m: f"{where}: {m}")
            # The planner's formula (ctxpar/plan/counts.py), with the LSE returned (one more
            # all-to-all for Ulysses): the minimum of each algorithm, exactly.
            fwd_b, bwd_b = cp_bytes(comm, world, u, B, S_LOCAL, H, Hkv, D, dtype.itemsize,
                                    return_lse=True)
            torch.testing.assert_close((st["fwd_bytes_sent"], st["fwd_bytes_recv"],
                                        st["bwd_bytes_sent"], st["bwd_bytes_recv"]),
                                       (fwd_b, fwd_b, bwd_b, bwd_b), **ex)
            f_ops, b_ops = comm_ops_per_layer(comm, world, u)
            f_ops += 1 if comm in ("ulysses", "hybrid") and u > 1 else 0  # the LSE's a2a
            torch.testing.assert_close((st["fwd_comm_ops"], st["bwd_comm_ops"]),
                                       (f_ops, b_ops), **ex)
            # FLOPs: exactly the visible pairs: no invisible block computed, none missed.
            fwd_f = expected_flops(comm, world, u, rank, n, layout, causal, H, D)
            torch.testing.assert_close((st["fwd_flops"], st["bwd_flops"]),
                                       (fwd_f, fwd_f * 5 // 2), **ex)
            nc = got["nocomm"]
            torch.testing.assert_close((nc["fwd_bytes_sent"], nc["fwd_comm_ops"], nc["fwd_flops"]),
                                       (0, 0, fwd_f), **ex)
            flops.append(st["fwd_flops"])
        if not causal or layout == "zigzag" or comm == "ulysses":  # balanced: equal work
            torch.testing.assert_close(flops, [flops[0]] * world, **EXACT)
    if world == 2:  # hybrid with u = 1 is the ring, with r = 1 Ulysses: the same bits
        for i, c in enumerate(cases):
            if c[0] == "hybrid":
                twin = cases.index(("ring" if c[1] == 1 else "ulysses", 1 if c[1] == 1 else 2,
                                    *c[2:]))
                for results in per_rank:
                    for name in ("out", "lse", "dq", "dk", "dv"):
                        assert torch.equal(results[i][name], results[twin][name]), (c, name)
