"""Gated DeltaNet, KDA and Mamba2 over a CP group: every strategy against one process.

Each case runs the mixer's core as a model does (ctxpar/testing/linear.py: the short conv
with its halo, the split, the gates, the CP op) on 4 gloo ranks, 48 tokens (12 per rank,
zigzag chunks of 6, kernel chunks of 8: chunk, segment and rank boundaries all fall
differently), and compares the output, the final state and every gradient (the conv's
input and weights, q, k, v, g, beta and A_log, dt_bias for GDN; f, the per-channel
gate's input, for KDA; x, B, C, dt, A_log, dt_bias, D for Mamba2; the initial state) with
the whole sequence on one process. One spawn per world size runs its cases (2 cores); the tolerances are
linear_tolerance's. KDA shares GDN's strategies (kda_cp), so it runs a chosen set:
both strategies, grouped and ungrouped heads, documents, at cp 2, 3 and 4.
"""
import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel import LOCAL, NoComm, cp_stats
from ctxpar.context_parallel.linear import (check_linear_cp, causal_conv1d_cp,
                                            gated_delta_rule_cp, kda_cp, ssd_cp,
                                            summary_bytes)
from ctxpar.context_parallel.layouts import shard_sequence
from ctxpar.context_parallel.linear.lean import SEGMENT_CHUNKS
from ctxpar.testing import run_distributed
from ctxpar.testing.linear import (BATCH, CONV_KERNEL, SEQUENCE, documents, gdn_leaves,
                                   kda_leaves, mismatches, run_case, ssd_leaves)

N = 48
HEADS = {"gdn": {"mha": (4, 4, 8, 8), "gva": (2, 4, 8, 6)},   # (Hk, Hv, Dk, Dv)
         "ssd": {"mha": (4, 6, 4, 5), "gva": (4, 6, 1, 5)}}   # (H, P, G, N)
LAYOUTS = {"state": ("contiguous", "zigzag"), "heads": ("contiguous", "zigzag", "striped")}
CASES = [(mixer, strategy, layout, heads, dtype, docs)
         for mixer in HEADS for strategy, layouts in LAYOUTS.items() for layout in layouts
         for heads in HEADS[mixer]
         for dtype, docs in (("fp32", False), ("fp32", True), ("bf16", True))]
# beta in [0, 2] (OLMo Hybrid's linear_allow_neg_eigval): a state-passing and a heads case
HEADS["gdn"]["gva-neg"] = (2, 4, 8, 6, True)
CASES += [("gdn", "state", "zigzag", "gva-neg", "fp32", True),
          ("gdn", "heads", "striped", "gva-neg", "fp32", True)]
# KDA (Kimi Linear: ungrouped heads; fla's GVA grouped): documents starting mid-rank,
# spanning three ranks, one token long (documents()), each strategy and layout once
HEADS["kda"] = HEADS["gdn"]
CASES += [("kda", "state", "contiguous", "gva", "fp32", True),
          ("kda", "state", "contiguous", "mha", "fp32", False),
          ("kda", "state", "zigzag", "mha", "fp32", True),
          ("kda", "state", "zigzag", "gva", "bf16", True),
          ("kda", "heads", "striped", "gva", "fp32", True),
          ("kda", "heads", "zigzag", "mha", "fp32", True)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case_id(case):
    mixer, strategy, layout, heads, dtype, docs = case
    return f"{mixer}-{strategy}-{layout}-{heads}-{dtype}" + ("-docs" if docs else "")


def _leaves(mixer, heads, dtype, n=N):
    make = {"gdn": gdn_leaves, "kda": kda_leaves, "ssd": ssd_leaves}[mixer]
    return make(n, HEADS[mixer][heads], DTYPES[dtype])


def _run(case, group, recompute_chunks=SEGMENT_CHUNKS):
    mixer, strategy, layout, heads, dtype, docs = case
    return run_case(mixer, _leaves(mixer, heads, dtype), HEADS[mixer][heads], group, layout,
                    strategy, documents(N) if docs else None, recompute_chunks)


def _every_case(rank, world, cases):
    return {_case_id(c): _run(c, dist.group.WORLD) for c in cases}


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_every_case, 4, CASES, timeout=600)


def _check(per_rank_results, case):
    per_rank = [res[_case_id(case)] for res in per_rank_results]
    # the whole sequence on one process, the torch kernels' backward one chunk at a time
    # (lean.py: its segments' boundaries fall at every chunk's, unlike the ranks')
    want = _run(case, LOCAL, recompute_chunks=1)
    found = mismatches(per_rank, want, case[2], DTYPES[case[4]])
    assert not found, "\n".join(found)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "gdn"], ids=_case_id)
def test_gated_delta_over_cp_matches_one_process(world4, case):
    _check(world4, case)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "ssd"], ids=_case_id)
def test_mamba2_ssd_over_cp_matches_one_process(world4, case):
    _check(world4, case)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "kda"], ids=_case_id)
def test_kda_over_cp_matches_one_process(world4, case):
    _check(world4, case)


QUICK = [("gdn", "state", "zigzag", "gva", "fp32", True),
         ("ssd", "heads", "striped", "gva", "fp32", True),
         ("kda", "state", "zigzag", "gva", "fp32", True),
         ("kda", "state", "contiguous", "mha", "fp32", True)]


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_every_case, 2, QUICK, timeout=300)


@pytest.mark.quick
def test_state_passing_on_two_ranks_matches_one_process(world2):
    _check(world2, QUICK[0])


@pytest.mark.quick
def test_heads_on_two_ranks_matches_one_process(world2):
    _check(world2, QUICK[1])


@pytest.mark.quick
@pytest.mark.parametrize("case", QUICK[2:], ids=_case_id)
def test_kda_state_passing_on_two_ranks_matches_one_process(world2, case):
    _check(world2, case)


THREE = [("kda", "state", "contiguous", "gva", "fp32", True),
         ("kda", "state", "zigzag", "mha", "fp32", True)]


@pytest.fixture(scope="module")
def world3():
    return run_distributed(_every_case, 3, THREE, timeout=300)


@pytest.mark.parametrize("case", THREE, ids=_case_id)
def test_kda_state_passing_on_three_ranks_matches_one_process(world3, case):
    """cp3: 16 tokens a rank (zigzag segments of 8), the segments composed over an odd
    number of ranks."""
    _check(world3, case)


# --- bytes ------------------------------------------------------------------------------

def _core_and_conv_bytes(rank, world):
    """{(mixer, layout, n): (core fwd sent, core bwd sent, conv fwd sent, conv bwd sent)}:
    the state-passing op alone, then the conv alone, under cp_stats()."""
    group, out = dist.group.WORLD, {}
    for mixer in ("gdn", "kda", "ssd"):
        dims = HEADS[mixer]["gva"]
        for layout in LAYOUTS["state"]:
            for n in (N, 2 * N):
                t = {k: shard_sequence(x, 1, group, layout) if k in SEQUENCE else x
                     for k, x in _leaves(mixer, "gva", "fp32", n).items()}
                with cp_stats() as core:
                    y = _core_op(mixer, dims, t, group, layout)
                    y.sum().backward()
                xin = (t["xBC"] if mixer == "ssd" else t["mixed"]).requires_grad_()
                with cp_stats() as conv:
                    causal_conv1d_cp(xin, t["conv_weight"], cp_group=group,
                                     layout=layout).sum().backward()
                out[mixer, layout, n] = (core.fwd_bytes_sent, core.bwd_bytes_sent,
                                         conv.fwd_bytes_sent, conv.bwd_bytes_sent)
    return out


def _core_op(mixer, dims, t, group, layout):
    gen = torch.Generator().manual_seed(0)
    B, S = BATCH, t["dout"].shape[1]
    if mixer in ("gdn", "kda"):
        Hk, Hv, Dk, Dv = dims
        q, k = (torch.randn(B, S, Hk, Dk, generator=gen, requires_grad=True) for _ in "qk")
        v = torch.randn(B, S, Hv, Dv, generator=gen, requires_grad=True)
        op, gate = (kda_cp, (Hv, Dk)) if mixer == "kda" else (gated_delta_rule_cp, (Hv,))
        g = -torch.rand(B, S, *gate, generator=gen)
        o, _ = op(q, k, v, g, torch.rand(B, S, Hv, generator=gen), cp_group=group,
                  layout=layout, chunk_size=8, use_qk_l2norm_in_kernel=True)
        return o
    H, P, G, Ns = dims
    x = torch.randn(B, S, H, P, generator=gen, requires_grad=True)
    Bm, C = (torch.randn(B, S, G, Ns, generator=gen, requires_grad=True) for _ in "BC")
    return ssd_cp(x, t["dt"], -t["A_log"].exp(), Bm, C, chunk_size=8, dt_softplus=True,
                  cp_group=group, layout=layout)


def test_state_passing_moves_the_summaries_and_the_conv_its_halo_whatever_n():
    """Forward and backward each send the fp32 summaries of this rank's segments to the 3
    others (summary_bytes: B*H*Dk*(Dk+Dv) per segment for GDN and KDA, B*H*(P*N+1) for
    Mamba2), the same at 48 and 96 tokens; the conv's halo is K-1 tokens of every channel
    per link (contiguous: to rank r+1; zigzag: to r+1 and r-1), likewise independent of n."""
    P = 4
    for rank, got in enumerate(run_distributed(_core_and_conv_bytes, P, timeout=300)):
        for mixer in ("gdn", "kda", "ssd"):
            dims = HEADS[mixer]["gva"]
            ssd = mixer == "ssd"
            heads, state = (dims[0], (dims[1], dims[3])) if ssd else (dims[1], dims[2:])
            channels = (dims[0] * dims[1] + 2 * dims[2] * dims[3] if ssd
                        else 2 * dims[0] * dims[2] + dims[1] * dims[3])
            for layout in LAYOUTS["state"]:
                links = int(rank + 1 < P) + (int(rank > 0) if layout == "zigzag" else 0)
                halo = links * (CONV_KERNEL - 1) * BATCH * channels * 4
                summaries = summary_bytes(BATCH, heads, tuple(state), layout, P,
                                          {"gdn": "gated_delta"}.get(mixer, mixer))
                if mixer == "kda":  # H x Dk x (Dk + Dv) x 4 per segment, to P - 1 ranks
                    Hv, Dk, Dv = dims[1:]
                    segments = 2 if layout == "zigzag" else 1
                    assert summaries == (P - 1) * segments * BATCH * Hv * Dk * (Dk + Dv) * 4
                for n in (N, 2 * N):
                    core_fwd, core_bwd, conv_fwd, conv_bwd = got[mixer, layout, n]
                    assert (core_fwd, core_bwd) == (summaries, summaries), \
                        (rank, mixer, layout, n, core_fwd, core_bwd, summaries)
                    assert conv_fwd == halo, (rank, mixer, layout, n, conv_fwd, halo)
                    back = (CONV_KERNEL - 1) * BATCH * channels * 4 * (
                        int(rank > 0) + (int(rank + 1 < P) if layout == "zigzag" else 0))
                    assert conv_bwd == back, (rank, mixer, layout, n, conv_bwd, back)


# --- one process: documents, validation ----------------------------------------------------

def test_one_process_documents_are_run_as_if_alone():
    """On one process the ops with cu_seqlens give each document what it gets alone (the
    first from the initial state, the others from zero): the reference the CP cases use
    honours the documents."""
    cus = documents(N)
    gdn = _leaves("gdn", "gva", "fp32")
    Hk, Hv, Dk, Dv = HEADS["gdn"]["gva"]
    mixed = gdn["mixed"]
    q, k, v = (x.unflatten(-1, (h, d)) for x, h, d in zip(
        mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], -1), (Hk, Hk, Hv), (Dk, Dk, Dv)))
    g, beta = -torch.rand(BATCH, N, Hv), gdn["b"].sigmoid()
    kw = dict(chunk_size=8, output_final_state=True)
    o, f = gated_delta_rule_cp(q, k, v, g, beta, cu_seqlens=cus,
                               initial_state=gdn["initial_state"], **kw)
    conv = causal_conv1d_cp(mixed, gdn["conv_weight"], activation="silu", cu_seqlens=cus)
    for b, cu in enumerate(cus):
        for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            part = slice(s, e)
            init = gdn["initial_state"][b:b + 1] if d == 0 else None
            o1, f1 = gated_delta_rule_cp(q[b:b + 1, part], k[b:b + 1, part],
                                         v[b:b + 1, part], g[b:b + 1, part],
                                         beta[b:b + 1, part], initial_state=init, **kw)
            torch.testing.assert_close(o[b:b + 1, part], o1, atol=1e-5, rtol=1e-5)
            c1 = causal_conv1d_cp(mixed[b:b + 1, part], gdn["conv_weight"],
                                  activation="silu")
            torch.testing.assert_close(conv[b:b + 1, part], c1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(f[b:b + 1], f1, atol=1e-5, rtol=1e-5)
    s = _leaves("ssd", "gva", "fp32")
    H, P, G, Ns = HEADS["ssd"]["gva"]
    x = torch.randn(BATCH, N, H, P)
    Bm, C = torch.randn(BATCH, N, G, Ns), torch.randn(BATCH, N, G, Ns)
    A = -s["A_log"].exp()
    y = ssd_cp(x, s["dt"], A, Bm, C, chunk_size=8, dt_softplus=True, cu_seqlens=cus)
    for b, cu in enumerate(cus):
        for st, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            one = ssd_cp(x[b:b + 1, st:e], s["dt"][b:b + 1, st:e], A, Bm[b:b + 1, st:e],
                         C[b:b + 1, st:e], chunk_size=8, dt_softplus=True)
            torch.testing.assert_close(y[b:b + 1, st:e], one, atol=1e-5, rtol=1e-5)


def _gdn_call(group, **kw):
    B, S = 1, 8
    q = torch.randn(B, S, 2, 4)
    v, g = torch.randn(B, S, 6, 4), -torch.rand(B, S, 6)
    return gated_delta_rule_cp(q, q, v, g, g.neg(), cp_group=group, **kw)


def _kda_call(group, per_channel=True, **kw):
    B, S = 1, 8
    q = torch.randn(B, S, 2, 4)
    v, g = torch.randn(B, S, 6, 4), -torch.rand(B, S, 6, 4 if per_channel else 1)
    return kda_cp(q, q, v, g if per_channel else g[..., 0], g[..., 0].neg(), cp_group=group,
                  **kw)


def _ssd_call(group, **kw):
    x, dt, A, Bm = torch.randn(1, 8, 6, 4), torch.randn(1, 8, 6), -torch.ones(6), \
        torch.randn(1, 8, 2, 3)
    return ssd_cp(x, dt, A, Bm, Bm, cp_group=group, **kw)


@pytest.mark.parametrize("call, kw, message", [
    (_gdn_call, dict(layout="striped", strategy="state"),
     "strategy='state' takes layouts ['contiguous', 'zigzag'], not layout='striped'"),
    (_ssd_call, dict(layout="striped", strategy="state"),
     "strategy='state' takes layouts ['contiguous', 'zigzag'], not layout='striped'"),
    (_gdn_call, dict(strategy="heads"),
     "strategy='heads' needs linear_num_value_heads=6 divisible by cp_size=4"),
    (_ssd_call, dict(strategy="heads"), "strategy='heads' needs num_heads=6 divisible by "
     "cp_size=4"),
    (_gdn_call, dict(chunk_size=0), "chunk_size=0 must be a positive integer"),
    (_ssd_call, dict(chunk_size=-8), "chunk_size=-8 must be a positive integer"),
    (_gdn_call, dict(strategy="ring"), "strategy='ring' must be one of ['state', 'heads']"),
    (_kda_call, dict(strategy="heads"),
     "strategy='heads' needs linear_num_value_heads=6 divisible by cp_size=4"),
    (_kda_call, dict(per_channel=False), "kda_cp: g has shape (1, 8, 6), expected "
     "(1, 8, 6, 4)"),
])
def test_bad_settings_raise_one_line_naming_key_and_values(call, kw, message):
    """Refused on every rank before any communication (a NoComm stand-in for rank 1 of
    4: nothing could be sent)."""
    with pytest.raises(ValueError) as err:
        call(NoComm(1, 4), **kw)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_check_linear_cp_accepts_what_the_ops_run():
    for strategy, layouts in LAYOUTS.items():
        for layout in layouts:
            check_linear_cp(strategy, layout, num_heads=8, cp_size=4, chunk_size=64)
    with pytest.raises(ValueError, match="summary_bytes: strategy='state' takes layouts"):
        summary_bytes(1, 4, (8, 8), "striped", 4, "gated_delta")


def test_the_linear_cp_benchmark_checks_its_layers_and_counts_state_bytes_independent_of_n(
        tmp_path):
    """tools/benchmarks/bench_linear_cp.py at a tiny n (the timing is docs/benchmarks.md's
    business): both strategies give every rank the one-process output and input gradient
    of a whole GDN, KDA and Mamba2 layer, state passing sends the same bytes at 256 and 512
    tokens (the summaries, which it asserts itself, and the conv halo), heads twice as many."""
    import json
    from tools.benchmarks import bench_linear_cp

    out = tmp_path / "bench.json"
    bench_linear_cp.main(["--seq-len", "256", "512", "--world-size", "2", "--d-model", "32",
                          "--heads", "2", "--head-dim", "8", "--iters", "1", "--warmup", "0",
                          "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mixer"], r["n"]) for r in rows] == [
        ("gated_delta", 256), ("gated_delta", 512), ("kda", 256), ("kda", 512),
        ("mamba2", 256), ("mamba2", 512)]
    for small, large in (rows[:2], rows[2:4], rows[4:]):
        for r in (small, large):
            assert r["max_diff"] < 1e-5, r
        assert small["state_bytes"] == large["state_bytes"] >= small["summary_bytes"] > 0
        assert 1.9 < large["heads_bytes"] / small["heads_bytes"] <= 2.0, (small, large)
