"""AttentionMask (windows, chunks, sinks, documents) under every CP pattern against one process.

The conventions are checked against transformers' own: sliding_window_causal_mask_function,
Llama 4's chunked mask, gpt-oss' eager attention with sinks (every backend, one process).
The block plan computes every visible (query, key) pair exactly once and nothing else, for
every layout, with and without documents and chunks; bad arguments are refused in one line.
Then one spawn of 4 gloo ranks runs ring, all-gather, Ulysses (u=4) and hybrid (u=2) x every
layout x each mask, MHA/GQA/MQA in turn, fp32 and bf16: a window that divides nothing (37,
a rank holding 48 tokens), one longer than a rank's share (100), windows inside documents,
chunks of 40 (crossing rank boundaries) causal or not and inside documents, sinks alone
and with a window: outputs, LSE, dq, dk, dv, the sinks' gradient (the ranks' shares
summed), the FLOP counters equal to the mask's exact pair count, and the halo's bytes in
each ring_grad_dtype; the planner's counts of the same (ctxpar/plan/counts.py: bytes per
rank, the busiest rank's pairs) equal what the spawn measured.
"""
import pickle

import pytest
import torch

from ctxpar.context_parallel import AttentionMask, rank_positions, shard_sequence
from ctxpar.context_parallel.blocks import ring_steps
from ctxpar.context_parallel.documents import doc_plan
from ctxpar.context_parallel.mask import dense_mask, with_chunks
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import tolerance

LAYOUTS = ("contiguous", "zigzag", "striped")
WORLD, S_LOCAL = 4, 48
N = WORLD * S_LOCAL
CU = torch.tensor([0, 5, 70, 71, 150, N], dtype=torch.int32)  # documents with the window
SINKS = torch.tensor([-1.0, 1.0, 2.5, 4.0])  # one per query head, near the rows' LSE
MASKS = {  # name -> AttentionMask's (causal, sliding_window, cu_seqlens, chunk_size, sinks)
    "w37": (True, 37, None, None, False),
    "w100": (True, 100, None, None, False),
    "w37+docs": (True, 37, CU, None, False),
    "w20": (True, 20, None, None, False),  # 19 <= 24: zigzag's halo too
    "w1": (True, 1, None, None, False),
    "chunk40": (True, None, None, 40, False),
    "chunk40 bidirectional": (False, None, None, 40, False),
    "chunk40+docs+w37": (True, 37, CU, 40, False),
    "sinks": (True, None, None, None, True),
    "sinks+w37": (True, 37, None, None, True),
    "sinks bidirectional+chunk40": (False, None, None, 40, True),
}
HEADS = ((4, 4, 16), (4, 2, 16), (4, 1, 16))  # MHA, GQA, MQA


@pytest.mark.quick
def test_window_matches_transformers_sliding_window_causal_mask():
    """transformers' sliding_window_causal_mask_function (what Mistral, Gemma, Qwen use):
    kv_idx > q_idx - sliding_window and kv_idx <= q_idx, so a query sees itself and
    sliding_window - 1 keys before it."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    n = 50
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for w in (1, 2, 7, 49, 50, 80):
        theirs = sliding_window_causal_mask_function(w)(0, 0, q_idx, kv_idx)
        assert torch.equal(dense_mask(n, True, w), theirs), w
    assert int(dense_mask(n, True, 3)[10].sum()) == 3


def flash_attn_2_visible(L, S, left, right):
    """(L, S) bool: what flash-attn 2 computes for window_size=(left, right), causal=False,
    from its source (v2.5 .. v2.8): flash_api.cpp mha_fwd/mha_bwd turn a side >= seqlen_k
    into -1; set_params_fprop turns a -1 side opposite a set one into seqlen_k (both -1:
    not local, every pair); mask.h apply_mask_local keeps col_idx_limit_left <= col <
    col_idx_limit_right, with left limit row + S - L - left and right limit
    row + 1 + S - L + right."""
    left, right = (-1 if left >= S else left), (-1 if right >= S else right)
    if left < 0 and right < 0:
        return torch.ones(L, S, dtype=torch.bool)
    left, right = (S if left < 0 else left), (S if right < 0 else right)
    row, col = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return (col >= row + S - L - left) & (col < row + 1 + S - L + right)


def flash_attn_4_visible(L, S, left, right):
    """The same for FlashAttention-4 (flash_attn/cute/mask.py, local_row_offset_left/right),
    window_size_left/right None (ctxpar passes None for -1) = no limit, no rewrites."""
    row, col = torch.arange(L)[:, None], torch.arange(S)[None, :]
    vis = torch.ones(L, S, dtype=torch.bool)
    if left >= 0:
        vis &= col >= row + S - L - left
    if right >= 0:
        vis &= col <= row + S - L + right
    return vis


@pytest.mark.parametrize("banded", [False, True], ids=["tiles", "bands"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_computes_every_visible_pair_once(layout, banded):
    """Every (query, key) pair the window (inside documents) leaves is computed exactly
    once, no block without a visible pair exists, each block's counted pairs are its
    visible ones, and the ring stops after the last step with work. Planned for a kernel
    that takes flash-attn's window_size (bands), every window block is a window call that
    flash-attn 2 and FlashAttention-4 read alike (their own masks, rewritten above from
    their sources) and none is masked; for one that does not (tiles), masked tiles."""
    for P, S in ((3, 48), (4, 10)):
        n = P * S
        for w, chunk in ((1, None), (2, None), (37, None), (49, None), (100, None),
                         (None, 7), (None, 40), (37, 40), (2, 7)):
            for cu in (None, torch.tensor([0, 5, n // 2 + 1, n], dtype=torch.int32)):
                bounds = with_chunks(torch.tensor([0, n]) if cu is None else cu.long(), chunk)
                shards = [rank_positions(n, r, P, layout) for r in range(P)]
                seen = torch.zeros(n, n, dtype=torch.int32)
                last_step = 0
                for r, q_pos in enumerate(shards):
                    for src, k_pos in enumerate(shards):
                        plan = doc_plan(bounds, q_pos, k_pos, True, w, banded)
                        if plan:
                            last_step = max(last_step, (r - src) % P)
                        for blk in plan:
                            L, Sk = blk.q1 - blk.q0, blk.k1 - blk.k0
                            vis = (torch.ones(L, Sk, dtype=torch.bool).tril() if blk.causal
                                   else blk.mask if blk.mask is not None
                                   else flash_attn_2_visible(L, Sk, *blk.window)
                                   if blk.window is not None
                                   else torch.ones(L, Sk, dtype=torch.bool))
                            assert (blk.mask is None) if banded else (blk.window is None)
                            if blk.window is not None:
                                assert torch.equal(vis, flash_attn_4_visible(L, Sk,
                                                                             *blk.window))
                            assert blk.pairs() == int(vis.sum()) > 0, (layout, P, w, blk)
                            qi = q_pos[blk.q0:blk.q1, None].expand(L, Sk)[vis]
                            ki = k_pos[None, blk.k0:blk.k1].expand(L, Sk)[vis]
                            seen.index_put_((qi, ki), torch.ones_like(qi, dtype=torch.int32),
                                            accumulate=True)
                want = dense_mask(n, True, w, cu, chunk)
                assert torch.equal(seen, want.int()), (layout, P, S, w, chunk, cu)
                mask = AttentionMask(True, w, [bounds])
                assert ring_steps(layout, True, S, P, mask) == last_step + 1
                if layout == "contiguous" and cu is None and chunk is None:  # window's reach
                    assert last_step == min(P - 1, -(-(w - 1) // S)), (P, S, w)




@pytest.mark.parametrize("layout", LAYOUTS)
def test_bands_on_a_window_kernel_match_one_process(layout):
    """Each of 4 ranks' queries against every rank's keys, block by block as the ring and
    all-gather compute them (blocks.step_plan), on flash_attn's adapter over the math
    kernel with flash-attn 2's window (FlashOnCpu): every window block reaches it as a
    window call, none masked, and the merged out and LSE, then dq and each rank's dk, dv
    from the blocks' backward, equal one process with the dense mask (fp32 rounding), GQA:
    a window of 37 on 48-token shards, one of 100, and 37 inside documents and chunks."""
    from ctxpar.context_parallel.blocks import QueryRows, backward_block, forward_block_, step_plan
    from ctxpar.context_parallel.merge import empty_accumulators
    from ctxpar.testing.attention import FlashOnCpu
    kernel, g = FlashOnCpu(), torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, N, h, 16, generator=g) for h in (4, 2, 2, 4))
    for w, cu, chunk in ((37, None, None), (100, None, None), (37, CU, 40)):
        bounds = with_chunks(torch.tensor([0, N], dtype=torch.int32) if cu is None else cu, chunk)
        mask = AttentionMask(True, w, [bounds.long()] * 2)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        want_o, want_lse = reference(*ref, dense_mask(N, True, w, cu, chunk).expand(2, N, N),
                                     0.25)
        want = (want_o, want_lse, *torch.autograd.grad(want_o, ref, dout))
        pos = [rank_positions(N, r, WORLD, layout) for r in range(WORLD)]
        dk, dv, blocks = torch.zeros_like(k), torch.zeros_like(v), []
        for r in range(WORLD):
            qr, plans = q[:, pos[r]], [(src, step_plan(layout, True, r, src, S_LOCAL, WORLD,
                                                       mask, banded=True))
                                       for src in range(WORLD)]
            blocks += [blk for _, plan in plans for _, blk in plan]
            out, lse = empty_accumulators(qr)
            for src, plan in plans:
                for b, blk in plan:
                    forward_block_(kernel, qr, k[:, pos[src]], v[:, pos[src]], blk, 0.25, out,
                                   lse, b)
            torch.testing.assert_close(out, want[0][:, pos[r]], atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(lse, want[1][:, :, pos[r]], atol=2e-5, rtol=1e-5)
            rows, dq = QueryRows(dout[:, pos[r]], qr, out, lse), torch.zeros_like(qr)
            for src, plan in plans:
                for b, blk in plan:
                    qs, ks, grads = backward_block(kernel, rows, k[:, pos[src]],
                                                   v[:, pos[src]], blk, 0.25, b)
                    dq[b, qs] += grads[0]
                    dk[b, pos[src][ks]] += grads[1]
                    dv[b, pos[src][ks]] += grads[2]
            torch.testing.assert_close(dq, want[2][:, pos[r]], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close((dk, dv), want[3:], atol=2e-5, rtol=1e-5)
        assert any(blk.window is not None for blk in blocks)
        assert all(getattr(blk, "mask", None) is None for blk in blocks)


def test_a_flash_attn_without_window_size_gets_masked_tiles():
    """flash-attn < 2.3 has no window_size: its adapter says so (the plan then makes masked
    tiles, which block_kernel sends to math), and a window call is refused rather than the
    window dropped by the call-by-signature (flash-attn 2.2's signatures)."""
    from ctxpar.context_parallel.kernels import BACKENDS, FlashAttnBackend, block_kernel
    from ctxpar.testing.attention import FlashOnCpu

    def forward(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
        raise AssertionError("not reached")

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                 causal, rng_state=None):
        raise AssertionError("not reached")
    old, q = FlashAttnBackend(forward, backward, ("cpu",)), torch.zeros(1, 4, 2, 8)
    assert not old.native_window(q) and FlashOnCpu().native_window(q)
    assert block_kernel(old, q, windowed=True) is BACKENDS["math"]
    with pytest.raises(RuntimeError, match=r"takes no window_size \(flash-attn < 2.3\)"):
        old.forward(q, q, q, False, 0.25, window=(3, 0))


def test_chunks_match_transformers_chunked_causal_mask():
    """Llama 4's chunked_causal_mask_function (no left padding): (kv // c == q // c) and
    kv <= q; and the chunks are the documents of with_chunks' cuts."""
    from transformers.masking_utils import chunked_causal_mask_function
    n = 50
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for c in (1, 7, 16, 49, 80):
        theirs = chunked_causal_mask_function(c, torch.zeros(1, dtype=torch.long))(
            0, 0, q_idx, kv_idx)
        assert torch.equal(dense_mask(n, True, chunk_size=c), theirs), c
        cuts = with_chunks(torch.tensor([0, n], dtype=torch.int32), c)
        assert cuts.tolist() == sorted({*range(0, n, c), n}) and cuts.dtype == torch.int32
        assert torch.equal(dense_mask(n, True, cu=cuts), theirs), c


@pytest.mark.parametrize("name,kwargs,message", [
    ("window 0", dict(causal=True, sliding_window=0), r"^sliding_window=0 must be a positive"),
    ("window -3", dict(causal=True, sliding_window=-3), r"^sliding_window=-3 must be a "),
    ("window 2.5", dict(causal=True, sliding_window=2.5), r"^sliding_window=2.5 must be a "),
    ("window True", dict(causal=True, sliding_window=True), r"^sliding_window=True must be a"),
    ("bidirectional window", dict(sliding_window=4), r"^sliding_window=4 needs causal=True"),
    ("chunk 0", dict(chunk_size=0), r"^chunk_size=0 must be a positive integer"),
    ("chunk -8", dict(causal=True, chunk_size=-8), r"^chunk_size=-8 must be a positive"),
    ("chunk 1.5", dict(chunk_size=1.5), r"^chunk_size=1.5 must be a positive integer"),
    ("sinks 2-D", dict(sinks=torch.zeros(2, 4)), r"^sinks=shape \(2, 4\) torch.float32 must "
                                                  r"be a 1-D float tensor"),
    ("sinks int", dict(sinks=torch.zeros(4, dtype=torch.long)), r"^sinks=shape \(4,\) "
                                                                  r"torch.int64 must be"),
    ("sinks list", dict(sinks=[0.0, 1.0]), r"^sinks=list must be a 1-D float tensor"),
])
def test_bad_mask_arguments_are_refused_in_one_line(name, kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        AttentionMask(**kwargs)
    assert "\n" not in str(err.value), name


def test_sinks_of_the_wrong_head_count_are_refused_before_any_collective():
    """Checked against q's (local) heads in the API: 3 sinks for 4 heads, one line."""
    from ctxpar.context_parallel import context_parallel_attention
    q = torch.zeros(1, 8, 4, 16)
    for comm in ("ring", "allgather", "ulysses", "hybrid"):
        with pytest.raises(ValueError, match=r"^context_parallel_attention: sinks of shape "
                                             r"\(3,\) on cpu must be \(4,\) on cpu"):
            context_parallel_attention(q, q, q, comm=comm, mask=AttentionMask(
                causal=True, sinks=torch.zeros(3)))


@pytest.mark.parametrize("backend", ["sdpa", "math", "flash_attn"])
def test_sinks_match_gpt_oss_eager_attention(backend, monkeypatch):
    """transformers' gpt-oss eager_attention_forward (the sink as a last softmax column,
    dropped after) on one process with a 128-token window, GQA: ctxpar's output and every
    gradient, the sinks' included, on each backend (flash_attn: FlashOnCpu, its adapter
    over CPU stand-ins; the sinks never reach a kernel, so every backend takes them)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from ctxpar.context_parallel import context_parallel_attention, kernels
    from ctxpar.testing.attention import FlashOnCpu
    monkeypatch.setitem(kernels.BACKENDS, "flash_attn", FlashOnCpu())
    g = torch.Generator().manual_seed(5)
    n, H, Hkv, D, w = 160, 4, 2, 16, 128
    q, k, v, dout = (torch.randn(2, n, h, D, generator=g) for h in (H, Hkv, Hkv, H))
    sinks = SINKS.clone()
    args = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    module = SimpleNamespace(sinks=args[3], num_key_value_groups=H // Hkv, training=False)
    additive = torch.zeros(n, n).masked_fill(~dense_mask(n, True, w), float("-inf"))
    theirs, _ = eager_attention_forward(module, *(x.transpose(1, 2) for x in args[:3]),
                                        additive, D ** -0.5)
    want = (theirs, *torch.autograd.grad(theirs, args, dout))
    ours = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = context_parallel_attention(*ours[:3], comm="ring", backend=backend, mask=AttentionMask(
        causal=True, sliding_window=w, sinks=ours[3]))
    got = (out, *torch.autograd.grad(out, ours, dout))
    for nm, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda m: f"{nm}: {m}")
    assert want[4].abs().min() > 1e-2  # every sink mattered


def reference(q, k, v, mask, scale, sinks=None):
    """fp32 softmax attention under a (B, n, n) bool mask, each head's sink logit (if any)
    one more column of the softmax without a value (gpt-oss, checked above); (out, lse)."""
    H = q.shape[2]
    kr = k.float().repeat_interleave(H // k.shape[2], dim=2)
    vr = v.float().repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kr) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)), -1)
    p = s.softmax(-1)[..., :vr.shape[1]]
    return torch.einsum("bhls,bshd->blhd", p, vr), torch.logsumexp(s, -1)


PATTERNS = (("ring", 1), ("allgather", 1), ("ulysses", 4), ("hybrid", 2))


def _cases():
    """(comm, u, layout, mask name, heads, dtype, ring_grad_dtype): every mask on every
    comm and layout in fp32, the heads (MHA, GQA, MQA) in turn so that each comm x layout
    and each mask meets all three; bf16 with the window of 37 (GQA) on every comm and
    layout and with sinks on every comm; the halo's dK,dV in bf16 (ring, hybrid)."""
    out = []
    for ci, (comm, u) in enumerate(PATTERNS):
        for li, layout in enumerate(LAYOUTS):
            for mi, name in enumerate(MASKS):
                out.append((comm, u, layout, name, HEADS[(mi + li) % 3], torch.float32,
                            "fp32"))
            out.append((comm, u, layout, "w37", HEADS[1], torch.bfloat16, "fp32"))
        out.append((comm, u, LAYOUTS[ci % 3], "sinks+w37", HEADS[1], torch.bfloat16, "fp32"))
        if comm in ("ring", "hybrid"):
            out.append((comm, u, "contiguous", "w37", HEADS[1], torch.float32, "bf16"))
    return out


def _mask_of(name, sinks):
    causal, w, cu, chunk, with_sinks = MASKS[name]
    return AttentionMask(causal=causal, sliding_window=w, cu_seqlens=cu, chunk_size=chunk,
                         sinks=sinks if with_sinks else None)


def _masked_cp(rank, world, payload):
    from ctxpar import init_parallel_state
    from ctxpar.context_parallel import context_parallel_attention, cp_stats
    states = {u: init_parallel_state(cp=world, ulysses=u) for _, u in PATTERNS}
    inputs, out = pickle.loads(payload), []
    for comm, u, layout, name, heads, dtype, grad_dtype in _cases():
        st = states[u]
        groups = dict(ulysses_group=st.ulysses_group, ring_group=st.ring_group) \
            if comm == "hybrid" else dict(cp_group=st.cp_group)
        shard = lambda x: shard_sequence(x.to(dtype), 1, st.cp_group, layout, u)  # noqa: E731
        q, k, v, dout = inputs[heads]
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        sinks = SINKS.clone().requires_grad_()
        with cp_stats() as stats:
            o, lse = context_parallel_attention(
                ql, kl, vl, comm=comm, layout=layout, return_lse=True, backend="sdpa",
                ring_grad_dtype=grad_dtype, mask=_mask_of(name, sinks), **groups)
            o.backward(shard(dout))
        out.append((o.detach(), lse, ql.grad, kl.grad, vl.grad, sinks.grad, stats.as_dict()))
    return out


@pytest.fixture(scope="module")
def cp_results():
    """Every case of _cases() on 4 gloo ranks (one spawn), and the inputs."""
    g = torch.Generator().manual_seed(3)
    inputs = {h: tuple(torch.randn(2, N, c, h[2], generator=g) for c in (h[0], h[1], h[1], h[0]))
              for h in HEADS}
    return inputs, run_distributed(_masked_cp, WORLD, pickle.dumps(inputs), timeout=600)


_REFERENCES = {}  # (mask name, heads, dtype) -> (mask, expected): shared by the comms


def _expected(inputs, name, heads, dtype):
    """The dense mask and the one-process (out, lse, dq, dk, dv[, dsinks]) for a case."""
    key = (name, heads, dtype)
    if key not in _REFERENCES:
        causal, w, cu, chunk, with_sinks = MASKS[name]
        mask = dense_mask(N, causal, w, cu, chunk)
        q, k, v, dout = (x.to(dtype).float().requires_grad_() for x in inputs[heads])
        sinks = SINKS.clone().requires_grad_() if with_sinks else None
        want_o, want_lse = reference(q, k, v, mask.expand(2, N, N), heads[2] ** -0.5, sinks)
        leaves = (q, k, v) + ((sinks,) if with_sinks else ())
        _REFERENCES[key] = mask, (want_o.detach(), want_lse.detach(),
                                  *torch.autograd.grad(want_o, leaves, dout.detach()))
    return _REFERENCES[key]


def _check_case(i, inputs, results):
    comm, u, layout, name, heads, dtype, grad_dtype = _cases()[i]
    with_sinks = MASKS[name][4]
    mask, want = _expected(inputs, name, heads, dtype)
    tol_dtype = torch.bfloat16 if grad_dtype == "bf16" else dtype  # dK,dV rounded per hop
    fwd = bwd = 0
    dsinks = torch.zeros(4)
    for rank in range(WORLD):
        pos = rank_positions(N, rank, WORLD, layout, ulysses=u)
        got = results[rank][i]
        fwd, bwd = fwd + got[6]["fwd_flops"], bwd + got[6]["bwd_flops"]
        for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[:5], want):
            b = b[:, :, pos] if nm == "lse" else b[:, pos]
            torch.testing.assert_close(
                a.float(), b, **tolerance(tol_dtype, b),
                msg=lambda m: f"{comm} u={u} {layout} {name} {heads} {dtype} rank {rank} "
                              f"{nm}: {m}")
        assert (got[5] is None) == (not with_sinks), (comm, layout, name)
        if with_sinks:
            dsinks += got[5]  # each rank's share: its queries (Ulysses: its heads)
    if with_sinks:
        torch.testing.assert_close(dsinks, want[5], **tolerance(dtype, want[5]),
                                   msg=lambda m: f"{comm} {layout} {name} dsinks: {m}")
    # FLOPs = exactly the mask's visible pairs (2 samples; Ulysses and hybrid count H/u
    # heads per rank, the same total over ranks); sinks add none.
    per_pair = 4 * 2 * heads[0] * heads[2]
    assert fwd == per_pair * int(mask.sum()), (comm, layout, name, fwd)
    assert bwd == fwd * 5 // 2, (comm, layout, name, bwd)


def _indices(pred):
    return [i for i, c in enumerate(_cases()) if pred(*c)]


@pytest.mark.parametrize("comm", [c for c, _ in PATTERNS])
def test_windows_match_one_process(cp_results, comm):
    for i in _indices(lambda c, u, lay, name, *_: c == comm and "sinks" not in name
                      and "chunk" not in name):
        _check_case(i, *cp_results)


@pytest.mark.parametrize("comm", [c for c, _ in PATTERNS])
def test_chunks_crossing_rank_boundaries_match_one_process(cp_results, comm):
    for i in _indices(lambda c, u, lay, name, *_: c == comm and "chunk" in name):
        _check_case(i, *cp_results)


@pytest.mark.parametrize("comm", [c for c, _ in PATTERNS])
def test_sinks_and_their_gradient_match_one_process(cp_results, comm):
    for i in _indices(lambda c, u, lay, name, *_: c == comm and name.startswith("sinks")):
        _check_case(i, *cp_results)


def test_the_zigzag_halo_moves_two_neighbours_tails(cp_results):
    """Ring and all-gather, zigzag, window 20 (h = 19 <= 24 tokens a chunk): rank r sends
    its first chunk's tail to r + 1 and its second's to r - 1 and gets one from each: two
    links inside the line, one at its ends, (k, v) x B x h x Hkv x D bytes a link each way,
    in the forward and again in the backward beside the dK,dV going back (fp32 here)."""
    inputs, results = cp_results
    cases = _indices(lambda c, u, lay, name, *_: lay == "zigzag" and name == "w20"
                     and c in ("ring", "allgather"))
    assert len(cases) == 2
    for i in cases:
        comm, _, _, _, (_, Hkv, D), dtype, _ = _cases()[i]
        link = 2 * 2 * 19 * Hkv * D * 4  # fp32 K,V; the fp32 dK,dV back are as large
        for rank in range(WORLD):
            links = (rank > 0) + (rank < WORLD - 1)
            st = results[rank][i][6]
            assert st["fwd_bytes_sent"] == st["fwd_bytes_recv"] == links * link, (comm, st)
            assert st["bwd_bytes_sent"] == st["bwd_bytes_recv"] == 2 * links * link, st
        _check_case(i, inputs, results)


def test_the_halo_moves_only_the_previous_ranks_tail_in_the_ring_grad_dtype(cp_results):
    """Ring and all-gather, contiguous, window 37 on 48 tokens a rank: rank r's last 36
    K,V tokens to r + 1 (k's dtype), in the backward again, plus their dK,dV back in
    ring_grad_dtype (all-gather: fp32); nothing else moves. (Hybrid's ring holds 96 tokens
    a rank over 2 ring ranks.)"""
    inputs, results = cp_results
    cases = _indices(lambda c, u, lay, name, *_: c in ("ring", "allgather")
                     and lay == "contiguous" and name in ("w37", "sinks+w37"))
    # ring: fp32, bf16, bf16 dK,dV, with sinks in fp32 and bf16; all-gather: fp32, bf16,
    # with sinks in fp32
    assert len(cases) == 8
    for i in cases:
        _, _, _, name, (_, Hkv, D), dtype, grad_dtype = _cases()[i]
        halo = 2 * 2 * 36 * Hkv * D  # (k, v) x B x (w - 1) x Hkv x D
        esz, gsz = torch.finfo(dtype).bits // 8, 2 if grad_dtype == "bf16" else 4
        for rank in range(WORLD):
            st, first, last = results[rank][i][6], rank == 0, rank == WORLD - 1
            assert st["fwd_bytes_sent"] == (not last) * halo * esz, (i, rank, st)
            assert st["fwd_bytes_recv"] == (not first) * halo * esz, (i, rank, st)
            assert st["bwd_bytes_sent"] == (not last) * halo * esz + (not first) * halo * gsz
            assert st["bwd_bytes_recv"] == (not first) * halo * esz + (not last) * halo * gsz
        _check_case(i, inputs, results)


def test_chunks_move_only_the_tail_of_the_chunk_a_rank_starts_in(cp_results):
    """Ring and all-gather, contiguous, chunks of 40 on 48 tokens a rank (causal): rank r
    starts at 48r, inside the chunk from 40 * (48r // 40), so it needs only that chunk's
    tokens before 48r (8, 16, 24 for ranks 1-3) from rank r - 1; those K,V, and their
    fp32 dK,dV back, are all that moves."""
    inputs, results = cp_results
    cases = _indices(lambda c, u, lay, name, *_: c in ("ring", "allgather")
                     and lay == "contiguous" and name == "chunk40")
    assert len(cases) == 2
    reach = {r: 48 * r % 40 for r in range(1, WORLD)}
    assert list(reach.values()) == [8, 16, 24]
    for i in cases:
        _, _, _, _, (_, Hkv, D), dtype, _ = _cases()[i]
        per_token = 2 * 2 * Hkv * D * 4  # (k, v) x B x Hkv x D, fp32
        for rank in range(WORLD):
            st = results[rank][i][6]
            sent = reach.get(rank + 1, 0) * per_token
            got = reach.get(rank, 0) * per_token
            assert (st["fwd_bytes_sent"], st["fwd_bytes_recv"]) == (sent, got), (i, rank, st)
            assert st["bwd_bytes_sent"] == st["bwd_bytes_recv"] == sent + got, (i, rank, st)
        _check_case(i, inputs, results)


def test_the_planners_bytes_and_flops_equal_the_measured_ones(cp_results):
    """ctxpar/plan's counts of a windowed or chunked layer (no documents) against this
    spawn's cp_stats, rank by rank: bytes sent forward and backward for every comm and
    layout (the halo's tails, a ring that a window ends early, the usual blocks
    otherwise); FLOPs of the busiest rank (ring, all-gather: rank_pairs' contiguous and
    zigzag slabs) and over all ranks (the mask's visible pairs in closed form)."""
    from ctxpar.context_parallel.mask import visible_pairs
    from ctxpar.plan.comm_bytes import masked_cp_bytes
    from ctxpar.plan.timing import rank_pairs
    _, results = cp_results
    cases = _indices(lambda c, u, lay, name, *_: MASKS[name][0] and MASKS[name][2] is None
                     and (MASKS[name][1] or MASKS[name][3]))
    # 6 masks in fp32 and w37 in bf16 per comm x layout, sinks+w37 in bf16 per comm, the
    # bf16 dK,dV of ring and hybrid
    assert len(cases) == 4 * 3 * (6 + 1) + 4 + 2
    for i in cases:
        comm, u, layout, name, (H, Hkv, D), dtype, grad_dtype = _cases()[i]
        _, w, _, chunk, _ = MASKS[name]
        esz, gsz = torch.finfo(dtype).bits // 8, 2 if grad_dtype == "bf16" else 4
        stats = [results[rank][i][6] for rank in range(WORLD)]
        for rank, st in enumerate(stats):
            want = masked_cp_bytes(comm, WORLD, u, 2, S_LOCAL, H, Hkv, D, esz, gsz, layout, w,
                                   chunk, rank=rank // u, return_lse=True)
            got = (st["fwd_bytes_sent"], st["bwd_bytes_sent"])
            assert got == want, (comm, u, layout, name, dtype, grad_dtype, rank, got, want)
        per_pair = 4 * 2 * H * D
        total = sum(st["fwd_flops"] for st in stats)
        assert total == per_pair * visible_pairs(0, N, w, chunk), (comm, layout, name)
        if comm in ("ring", "allgather") and layout != "striped":
            assert max(st["fwd_flops"] for st in stats) \
                == per_pair * rank_pairs(N, WORLD, layout, w, chunk), (comm, layout, name)
