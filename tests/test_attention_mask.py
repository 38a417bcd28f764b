"""Sliding windows (AttentionMask) under every CP pattern against one process with a dense mask.

The convention is checked against transformers' own mask functions; the block plan computes
every visible (query, key) pair exactly once and nothing else, for every layout, with and
without documents; bad windows are refused in one line. Then one spawn of 4 gloo ranks runs
ring, all-gather, Ulysses (u=4) and hybrid (u=2) x every layout x MHA/GQA/MQA x fp32/bf16 with
a window that divides nothing (37, a rank holding 48 tokens), one longer than a rank's
share (100) and a window inside documents: outputs, LSE, dq, dk, dv, and the FLOP counters
equal to the mask's exact pair count.
"""
import pickle

import pytest
import torch

from ctxpar.context_parallel import AttentionMask, rank_positions, shard_sequence
from ctxpar.context_parallel.blocks import ring_steps
from ctxpar.context_parallel.documents import doc_plan
from ctxpar.context_parallel.mask import dense_mask
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import tolerance

LAYOUTS = ("contiguous", "zigzag", "striped")
WORLD, S_LOCAL = 4, 48
N = WORLD * S_LOCAL
CU = torch.tensor([0, 5, 70, 71, 150, N], dtype=torch.int32)  # documents with the window
MASKS = {"w37": (37, None), "w100": (100, None), "w37+docs": (37, CU), "w1": (1, None)}
HEADS = ((4, 4, 16), (4, 2, 16), (4, 1, 16))  # MHA, GQA, MQA


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


def test_bad_window_is_refused_in_one_line():
    for w in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"^sliding_window=.* must be a positive integer"):
            AttentionMask(causal=True, sliding_window=w)
    with pytest.raises(ValueError, match=r"^sliding_window=4 needs causal=True"):
        AttentionMask(causal=False, sliding_window=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_computes_every_visible_pair_once(layout):
    """Every (query, key) pair the window (inside documents) leaves is computed exactly
    once, no block without a visible pair exists, each block's counted pairs are its
    visible ones, and the ring stops after the last step with work."""
    for P, S in ((3, 48), (4, 10)):
        n = P * S
        for w in (1, 2, 37, 49, 100):
            for cu in (None, torch.tensor([0, 5, n // 2 + 1, n], dtype=torch.int32)):
                shards = [rank_positions(n, r, P, layout) for r in range(P)]
                seen = torch.zeros(n, n, dtype=torch.int32)
                last_step = 0
                for r, q_pos in enumerate(shards):
                    for src, k_pos in enumerate(shards):
                        plan = doc_plan(torch.tensor([0, n]) if cu is None else cu.long(),
                                        q_pos, k_pos, True, w)
                        if plan:
                            last_step = max(last_step, (r - src) % P)
                        for blk in plan:
                            L, Sk = blk.q1 - blk.q0, blk.k1 - blk.k0
                            vis = (torch.ones(L, Sk, dtype=torch.bool).tril() if blk.causal
                                   else blk.mask if blk.mask is not None
                                   else torch.ones(L, Sk, dtype=torch.bool))
                            assert blk.pairs() == int(vis.sum()) > 0, (layout, P, w, blk)
                            qi = q_pos[blk.q0:blk.q1, None].expand(L, Sk)[vis]
                            ki = k_pos[None, blk.k0:blk.k1].expand(L, Sk)[vis]
                            seen.index_put_((qi, ki), torch.ones_like(qi, dtype=torch.int32),
                                            accumulate=True)
                want = dense_mask(n, True, w, cu)
                assert torch.equal(seen, want.int()), (layout, P, S, w, cu)
                mask = AttentionMask(True, w, None if cu is None else [cu.long()])
                assert ring_steps(layout, True, S, P, mask) == last_step + 1
                if layout == "contiguous" and cu is None:  # the window's reach in shards
                    assert last_step == min(P - 1, -(-(w - 1) // S)), (P, S, w)


def reference(q, k, v, mask, scale):
    """fp32 softmax attention under a (B, n, n) bool mask; (out, lse)."""
    H = q.shape[2]
    kr = k.float().repeat_interleave(H // k.shape[2], dim=2)
    vr = v.float().repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kr) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhls,bshd->blhd", s.softmax(-1), vr), torch.logsumexp(s, -1)


PATTERNS = (("ring", 1), ("allgather", 1), ("ulysses", 4), ("hybrid", 2))


def _cases():
    """Every mask with MHA and GQA in fp32; MQA and bf16 (GQA) with the window of 37."""
    return [(comm, u, layout, name, heads, dtype)
            for comm, u in PATTERNS for layout in LAYOUTS for name in MASKS
            for heads in HEADS for dtype in (torch.float32, torch.bfloat16)
            if (dtype == torch.float32 and (heads != HEADS[2] or name == "w37"))
            or (name == "w37" and heads == HEADS[1])]


def _windowed_cp(rank, world, payload):
    from ctxpar import init_parallel_state
    from ctxpar.context_parallel import context_parallel_attention, cp_stats
    states = {u: init_parallel_state(cp=world, ulysses=u) for _, u in PATTERNS}
    inputs, out = pickle.loads(payload), []
    for comm, u, layout, name, heads, dtype in _cases():
        st = states[u]
        groups = dict(ulysses_group=st.ulysses_group, ring_group=st.ring_group) \
            if comm == "hybrid" else dict(cp_group=st.cp_group)
        w, cu = MASKS[name]
        shard = lambda x: shard_sequence(x.to(dtype), 1, st.cp_group, layout, u)  # noqa: E731
        q, k, v, dout = inputs[heads]
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        with cp_stats() as stats:
            o, lse = context_parallel_attention(
                ql, kl, vl, comm=comm, layout=layout, return_lse=True, backend="sdpa",
                mask=AttentionMask(causal=True, sliding_window=w, cu_seqlens=cu), **groups)
            o.backward(shard(dout))
        out.append((o.detach(), lse, ql.grad, kl.grad, vl.grad, stats.fwd_flops,
                    stats.bwd_flops, stats.as_dict()))
    return out


def test_windowed_attention_matches_one_process_for_every_pattern():
    g = torch.Generator().manual_seed(3)
    inputs = {h: tuple(torch.randn(2, N, c, h[2], generator=g) for c in (h[0], h[1], h[1], h[0]))
              for h in HEADS}
    results = run_distributed(_windowed_cp, WORLD, pickle.dumps(inputs), timeout=600)
    for i, (comm, u, layout, name, heads, dtype) in enumerate(_cases()):
        w, cu = MASKS[name]
        mask = dense_mask(N, True, w, cu)
        q, k, v, dout = (x.to(dtype).float().requires_grad_() for x in inputs[heads])
        want_o, want_lse = reference(q, k, v, mask.expand(2, N, N), heads[2] ** -0.5)
        want = (want_o.detach(), want_lse.detach(),
                *torch.autograd.grad(want_o, (q, k, v), dout.detach()))
        fwd = bwd = 0
        for rank in range(WORLD):
            pos = rank_positions(N, rank, WORLD, layout, ulysses=u)
            got = results[rank][i]
            fwd, bwd = fwd + got[5], bwd + got[6]
            if comm == "ring" and layout == "contiguous" and name == "w37":
                # The halo: rank r's last 36 K,V tokens to r + 1 (k's dtype), and in the
                # backward again, plus their fp32 dK,dV back: nothing else moves.
                halo = 2 * 2 * 36 * heads[1] * heads[2]  # (k, v) x B x (w - 1) x Hkv x D
                esz = torch.finfo(dtype).bits // 8
                st = got[7]
                assert st["fwd_bytes_sent"] == (rank < WORLD - 1) * halo * esz, st
                assert st["fwd_bytes_recv"] == (rank > 0) * halo * esz, st
                assert st["bwd_bytes_sent"] == ((rank < WORLD - 1) * halo * esz
                                                + (rank > 0) * halo * 4), st
                assert st["bwd_bytes_recv"] == ((rank > 0) * halo * esz
                                                + (rank < WORLD - 1) * halo * 4), st
            for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[:5], want):
                b = b[:, :, pos] if nm == "lse" else b[:, pos]
                torch.testing.assert_close(
                    a.float(), b, **tolerance(dtype, b),
                    msg=lambda m: f"{comm} u={u} {layout} {name} {heads} {dtype} rank {rank} "
                                  f"{nm}: {m}")
        # FLOPs = exactly the mask's visible pairs (2 samples; Ulysses and hybrid count
        # H/u heads per rank, the same total over ranks).
        per_pair = 4 * 2 * heads[0] * heads[2]
        assert fwd == per_pair * int(mask.sum()), (comm, layout, name, fwd)
        assert bwd == fwd * 5 // 2, (comm, layout, name, bwd)
