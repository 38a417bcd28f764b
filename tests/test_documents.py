"""Document masking (packed documents) under every CP pattern against one process with a dense mask.

Pure checks of the plan (every visible pair computed exactly once, nothing else), bad
boundaries refused in one line, then ring, all-gather, Ulysses and hybrid (those that fit P)
on P = 2, 3, 4 ranks for every layout,
causal or not, MHA/GQA, the sdpa (CPU flash) and math kernels and flash_attn's adapter
(stand-ins without masks, as on a GPU), fp32, two samples with
their own documents, including the edge cases: length-1 documents, a document longer than
a shard, one spanning every rank, many tiny ones, a boundary exactly at a shard edge.
"""
import pickle

import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel import AttentionMask, rank_positions, ring_attention, shard_sequence
from ctxpar.context_parallel.documents import check_cu_seqlens, doc_plan, reference_mask
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import PATTERNS, FlashOnCpu, masked_reference, tolerance
from models.options import ModelGroups, ModelOptions

LAYOUTS = ("contiguous", "zigzag", "striped")
S_LOCAL = 12  # tokens per rank: even (zigzag), and shards cut documents in odd places


def edge_case_docs(n: int, P: int):
    """Two samples' boundaries: sample 0 has length-1 documents, a document cut exactly at
    a shard edge, one longer than a shard and many tiny ones; sample 1 one document over
    every rank but the first and last few tokens."""
    m = n // P
    cuts0 = sorted({1, 2, 3, m, m + 1, m + 2 + m + 3, n - 4, n - 3, n - 1} - {0, n})
    cuts0 = [c for c in cuts0 if 0 < c < n]
    cuts1 = [2, n - 3]
    return [torch.tensor([0, *cuts0, n], dtype=torch.int32),
            torch.tensor([0, *cuts1, n], dtype=torch.int32)]


# ------------------------------------------------------------------ pure pieces


def _pairs_seen(cu, shards, n, causal):
    """(n, n) int: how often the plans of every (queries, keys) shard pair compute each
    (query, key) pair; and how many of the blocks needed an explicit mask."""
    seen, masked = torch.zeros(n, n, dtype=torch.int32), 0
    for q_pos in shards:
        for k_pos in shards:
            for blk in doc_plan(cu.long(), q_pos, k_pos, causal):
                L, S = blk.q1 - blk.q0, blk.k1 - blk.k0
                vis = (torch.ones(L, S, dtype=torch.bool).tril() if blk.causal
                       else blk.mask if blk.mask is not None
                       else torch.ones(L, S, dtype=torch.bool))
                masked += blk.mask is not None
                qi = q_pos[blk.q0:blk.q1, None].expand(L, S)[vis]
                ki = k_pos[None, blk.k0:blk.k1].expand(L, S)[vis]
                seen.index_put_((qi, ki), torch.ones_like(qi, dtype=torch.int32),
                                accumulate=True)
    return seen, masked


@pytest.mark.quick
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_plan_computes_every_visible_pair_once(layout, P):
    """Exactly the document-causal pairs, and with every layout without an explicit mask
    (full, causal, staircase and by-runs blocks only: the kernels' fast paths)."""
    n = S_LOCAL * P
    for cu in edge_case_docs(n, P):
        for causal in (True, False):
            shards = [rank_positions(n, r, P, layout) for r in range(P)]
            seen, masked = _pairs_seen(cu, shards, n, causal)
            assert torch.equal(seen, reference_mask(cu.long(), n, causal).int()), \
                (layout, P, cu.tolist(), causal)
            assert masked == 0, (layout, P, cu.tolist(), causal)


def test_plan_masks_explicitly_where_no_kernel_shape_fits():
    """Shards of scattered positions (no layout makes them) fall back to masked blocks,
    still computing every visible pair once."""
    n, g = 24, torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g)
    shards = [perm[i::3].sort().values for i in range(3)]
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    seen, masked = _pairs_seen(cu, shards, n, True)
    assert torch.equal(seen, reference_mask(cu.long(), n, True).int())
    assert masked > 0
    # ... and the kernels' masked path is exact.
    _masked_blocks_match_reference(("sdpa", "math"))


def _masked_blocks_match_reference(backends):
    """Shard 0's queries (scattered positions) against every shard, forward merged by LSE,
    backward from the merged out/lse, against the dense reference."""
    n, g = 24, torch.Generator().manual_seed(0)
    perm = torch.randperm(n, generator=g)
    shards = [perm[i::3].sort().values for i in range(3)]
    cu = torch.tensor([0, 5, 17, 24], dtype=torch.int32)
    from ctxpar.context_parallel.blocks import QueryRows, backward_block, forward_block_
    from ctxpar.context_parallel.kernels import BACKENDS
    from ctxpar.context_parallel.merge import empty_accumulators
    q, k, v, dout = (x[:1] for x in _inputs(n)[(4, 2, 16)])
    want_o, want_lse = masked_reference(q.requires_grad_(), k, v, [cu], True, 0.25)
    (want_dq,) = torch.autograd.grad(want_o, q, dout)
    qp = shards[0]
    for backend in backends:
        kernel, out, lse = BACKENDS[backend], *empty_accumulators(q[:, qp].detach())
        plan = [(kp, blk) for kp in shards for blk in doc_plan(cu.long(), qp, kp, True)]
        for kp, blk in plan:
            forward_block_(kernel, q[:, qp].detach(), k[:, kp], v[:, kp], blk, 0.25, out, lse)
        rows, dq = QueryRows(dout[:, qp], q[:, qp].detach(), out, lse), torch.zeros_like(out)
        for kp, blk in plan:
            qs, _, grads = backward_block(kernel, rows, k[:, kp], v[:, kp], blk, 0.25)
            dq[:, qs] += grads[0]
        for name, a, b in (("out", out, want_o[:, qp]), ("lse", lse, want_lse[:, :, qp]),
                           ("dq", dq, want_dq[:, qp])):
            torch.testing.assert_close(a, b.detach(), **tolerance(torch.float32, b),
                                       msg=lambda m: f"{backend} {name}: {m}")


@pytest.mark.quick
@pytest.mark.parametrize("cu, msg", [
    (torch.tensor([0, 5, 7], dtype=torch.int32), "must start at 0 and end at the sequence "
                                                 "length 8"),
    (torch.tensor([1, 5, 8], dtype=torch.int32), "must start at 0"),
    (torch.tensor([0, 5, 5, 8], dtype=torch.int32), "must be strictly increasing"),
    (torch.tensor([0, 6, 3, 8], dtype=torch.int32), "must be strictly increasing"),
    (torch.tensor([0, 5, 9], dtype=torch.int32), "end at the sequence length 8"),
    (torch.tensor([0, 5, 8]), "must be a 1-D int32 tensor, got torch.int64"),
    ([torch.tensor([0, 8], dtype=torch.int32)] * 3, "a list of 2 (one per sample)"),
])
def test_bad_boundaries_are_refused_in_one_line(cu, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        check_cu_seqlens(cu, 8, 2, "ring_attention")


@pytest.fixture
def flash_on_cpu(monkeypatch):
    from ctxpar.context_parallel import kernels
    monkeypatch.setitem(kernels.BACKENDS, "flash_attn", FlashOnCpu())


def test_document_masking_runs_on_a_backend_without_masks(flash_on_cpu):
    """flash_attn takes no explicit mask (but a window): every document block is one of
    its dense or causal calls, and the rare irregular block goes to the math kernel
    (block_kernel); sdpa takes masks (CPU and CUDA) but no window. Scattered shards force
    such blocks; the result is still exact."""
    from ctxpar.context_parallel.kernels import BACKENDS, block_kernel
    q = torch.zeros(1, 4, 2, 8)
    assert block_kernel(BACKENDS["flash_attn"], q, masked=True) is BACKENDS["math"]
    assert block_kernel(BACKENDS["flash_attn"], q, masked=False) is BACKENDS["flash_attn"]
    assert block_kernel(BACKENDS["flash_attn"], q, windowed=True) is BACKENDS["flash_attn"]
    assert block_kernel(BACKENDS["sdpa"], q, masked=True) is BACKENDS["sdpa"]  # CPU op masks
    assert block_kernel(BACKENDS["sdpa"], q, windowed=True) is BACKENDS["math"]
    assert not BACKENDS["sdpa"].takes_mask(torch.zeros(1, device="meta"))  # no op there
    _masked_blocks_match_reference(("flash_attn",))


# ------------------------------------------------------------------ the ring on P ranks


def _cases(world):
    """(comm, u, layout, causal, heads, backend): both CPU kernels and flash_attn's adapter
    (FlashOnCpu: no masks, as on a GPU) for the ring, sdpa for all-gather, Ulysses and
    hybrid (PATTERNS: those that fit P)."""
    out = []
    for comm, u in PATTERNS[world]:
        backends = ("sdpa", "math", "flash_attn") if comm == "ring" else ("sdpa",)
        out += [(comm, u, layout, causal, heads, backend)
                for layout in LAYOUTS for causal in (True, False)
                for heads in ((4, 4, 16), (4, 2, 16)) for backend in backends]
    return out


def _masked_cp(rank, world, payload):
    from ctxpar import init_parallel_state
    from ctxpar.context_parallel import context_parallel_attention, cp_stats, kernels
    kernels.BACKENDS["flash_attn"] = FlashOnCpu()  # this worker process only
    states = {u: init_parallel_state(cp=world, ulysses=u) for _, u in PATTERNS[world]}
    out = []
    for comm, u, layout, causal, (H, Hkv, D), backend in _cases(world):
        n, st = S_LOCAL * world, states[u]
        groups = dict(ulysses_group=st.ulysses_group, ring_group=st.ring_group) \
            if comm == "hybrid" else dict(cp_group=st.cp_group)
        q, k, v, dout = pickle.loads(payload)[(H, Hkv, D)]
        cus = edge_case_docs(n, world)
        shard = lambda x: shard_sequence(x, 1, st.cp_group, layout, u)  # noqa: E731
        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        with cp_stats() as stats:
            o, lse = context_parallel_attention(ql, kl, vl, comm=comm, causal=causal,
                                                layout=layout, backend=backend,
                                                return_lse=True, cu_seqlens=cus, **groups)
            o.backward(shard(dout))
        out.append((o.detach(), lse, ql.grad, kl.grad, vl.grad, stats.fwd_flops))
    return out


def _inputs(n):
    g = torch.Generator().manual_seed(7)
    return {h: tuple(torch.randn(2, n, c, h[2], generator=g) for c in (h[0], h[1], h[1], h[0]))
            for h in ((4, 4, 16), (4, 2, 16))}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_masked_attention_matches_one_process_for_every_pattern(world):
    n = S_LOCAL * world
    inputs = _inputs(n)
    results = run_distributed(_masked_cp, world, pickle.dumps(inputs), timeout=400)
    cus = edge_case_docs(n, world)
    for i, (comm, u, layout, causal, heads, backend) in enumerate(_cases(world)):
        q, k, v, dout = (x.clone().requires_grad_() for x in inputs[heads])
        want_o, want_lse = masked_reference(q, k, v, cus, causal, heads[2] ** -0.5)
        want = (want_o.detach(), want_lse.detach(),
                *torch.autograd.grad(want_o, (q, k, v), dout.detach()))
        flops = 0
        for rank in range(world):
            pos = rank_positions(n, rank, world, layout, ulysses=u)
            got = results[rank][i]
            flops += got[5]
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[:5], want):
                b = b[:, :, pos] if name == "lse" else b[:, pos]
                torch.testing.assert_close(
                    a, b, **tolerance(torch.float32, b),
                    msg=lambda m: f"P={world} {comm} u={u} {layout} causal={causal} {heads} "
                                  f"{backend} rank {rank} {name}: {m}")
        # The kernels evaluate exactly the documents' pairs, sum len (len + 1) / 2 (causal)
        # or sum len^2, never the n^2/2 of the unmasked sample. (Ulysses and hybrid count
        # H/u heads per rank: the sum over ranks is the same total.)
        lens = [torch.diff(cu.long()) for cu in cus]
        doc_pairs = sum(int((x * (x + 1) // 2 if causal else x * x).sum()) for x in lens)
        per_pair = 4 * heads[0] * heads[2]  # fwd FLOPs per (query, key) pair, per sample
        where = (comm, u, layout, causal)
        assert flops == doc_pairs * per_pair, (where, flops, doc_pairs * per_pair)


SHORT_DOCS = {  # boundaries at P = 4, n = 48 -> how many ring steps carry work per layout
    # contiguous shards: all local. zigzag: [24, 36) is rank 3's chunk 4 + rank 2's chunk 5,
    # rank 2 needs rank 3's keys at step 3. striped: every document spans all ranks.
    "shard-aligned": (list(range(0, 49, 12)), {"contiguous": 1, "zigzag": 4, "striped": 4}),
    # zigzag's chunks of 6: every document on one rank (zigzag too: no communication)
    "chunk-aligned": (list(range(0, 49, 6)), {"contiguous": 1, "zigzag": 1, "striped": 4}),
    # striped: a document of 3 spans ranks r..r+2, the last step is 2 (dK,dV: 2 hops home)
    "length 3": (list(range(0, 49, 3)), {"contiguous": 1, "zigzag": 1, "striped": 3}),
    # contiguous: documents cross one shard edge, the last step is 1 (dK,dV: 3 hops home)
    "length 5": ([*range(0, 48, 5), 48], {"contiguous": 2, "zigzag": 4, "striped": 4}),
}


def _short_docs(rank, world, payload):
    from ctxpar.context_parallel import blocks, cp_stats
    inputs, out = pickle.loads(payload), {}
    for name, (cu, _) in SHORT_DOCS.items():
        cu = torch.tensor(cu, dtype=torch.int32)
        for layout in LAYOUTS:
            q, k, v, dout = inputs[(4, 2, 16)]
            ql, kl, vl = (shard_sequence(x, 1, None, layout).requires_grad_() for x in (q, k, v))
            with cp_stats() as st:
                o, lse = ring_attention(ql, kl, vl, causal=True, layout=layout,
                                        return_lse=True, cu_seqlens=cu)
                o.backward(shard_sequence(dout, 1, None, layout))
            steps = blocks.ring_steps(layout, True, S_LOCAL, world,
                                     AttentionMask(True, cu_seqlens=[cu.long()]))
            out[name, layout] = (o.detach(), lse, ql.grad, kl.grad, vl.grad, steps,
                                 st.fwd_comm_ops, st.bwd_comm_ops)
    return out


def test_the_ring_stops_when_no_rank_has_work_left():
    """Documents that stay within a few shards end the ring early: the forward makes only
    the steps some rank needs, the backward's dK,dV then go straight home (a shortcut of
    several hops), and nothing moves at all when every document is rank-local. Still
    exact."""
    world, n = 4, 4 * S_LOCAL
    inputs = _inputs(n)
    results = run_distributed(_short_docs, world, pickle.dumps(inputs), timeout=300)
    for name, (cu, want_steps) in SHORT_DOCS.items():
        cus = [torch.tensor(cu, dtype=torch.int32)] * 2
        q, k, v, dout = (x.clone().requires_grad_() for x in inputs[(4, 2, 16)])
        want_o, want_lse = masked_reference(q, k, v, cus, True, 0.25)
        want = (want_o.detach(), want_lse.detach(),
                *torch.autograd.grad(want_o, (q, k, v), dout.detach()))
        for layout in LAYOUTS:
            for rank in range(world):
                got, pos = results[rank][name, layout], rank_positions(n, rank, world, layout)
                steps, f_ops, b_ops = got[5:]
                assert steps == want_steps[layout], (name, layout, steps)
                # forward: steps - 1 K,V hops; backward: as many K,V hops plus one dK,dV
                # message per step (none when no step leaves the rank)
                assert (f_ops, b_ops) == (steps - 1, 2 * steps - 1 if steps > 1 else 0)
                for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got[:5], want):
                    b = b[:, :, pos] if what == "lse" else b[:, pos]
                    torch.testing.assert_close(a, b, **tolerance(torch.float32, b),
                                               msg=lambda m: f"{name} {layout} rank {rank} "
                                                             f"{what}: {m}")


def test_masked_attention_on_one_process_matches_the_dense_reference(flash_on_cpu):
    """No process group (the GPT reference's path): the same plan on a rank alone."""
    n = 4 * S_LOCAL
    cus = edge_case_docs(n, 4)
    for heads in ((4, 4, 16), (4, 2, 16)):
        q, k, v, dout = (x.clone().requires_grad_() for x in _inputs(n)[heads])
        for backend in ("sdpa", "math", "flash_attn"):
            o, lse = ring_attention(q, k, v, causal=True, backend=backend, return_lse=True,
                                    cu_seqlens=cus)
            got = (o, lse, *torch.autograd.grad(o, (q, k, v), dout))
            want_o, want_lse = masked_reference(q, k, v, cus, True, heads[2] ** -0.5)
            want = (want_o, want_lse, *torch.autograd.grad(want_o, (q, k, v), dout))
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, **tolerance(torch.float32, b),
                                           msg=lambda m: f"{heads} {backend} {name}: {m}")


def _one_document(rank, world):
    n = S_LOCAL * world
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 4, 16, generator=g) for _ in range(3))
    out = {}
    for layout in LAYOUTS:
        args = [shard_sequence(x, 1, None, layout) for x in (q, k, v)]
        plain = ring_attention(*args, causal=True, layout=layout)
        one = ring_attention(*args, causal=True, layout=layout,
                             cu_seqlens=torch.tensor([0, n], dtype=torch.int32))
        out[layout] = (plain, one)
    return out


def test_one_document_per_sample_equals_no_masking():
    for rank, res in enumerate(run_distributed(_one_document, 4, timeout=120)):
        for layout, (plain, one) in res.items():
            # The same attention through other blocks (the plan cuts by document, not by
            # the layout's chunks): fp32 merge order only.
            torch.testing.assert_close(one, plain, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank} {layout}: {m}")


# ------------------------------------------------------------------ the GPT with documents

GPT_CASES = [(1, 4, "zigzag", "none"), (2, 2, "striped", "selective"),
             (1, 4, "contiguous", "full")]  # (tp, cp, layout, activation checkpointing)
N_GPT = 32


def _gpt_cfg():
    from ctxpar.config import ModelConfig
    return ModelConfig(vocab_size=64, seq_len=N_GPT, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=2)


def _gpt_batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, N_GPT), generator=g)
    labels = torch.randint(0, 64, (2, N_GPT), generator=g)
    return tokens, labels, edge_case_docs(N_GPT, 4)


def _gpt_documents(rank, world):
    from ctxpar import init_parallel_state, sequence_positions
    from ctxpar.context_parallel.documents import document_positions
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.gpt import GPT
    from models.loss import (deepspeed_style_reduce_, global_mean_loss, global_token_count,
                             loss_for_backward)

    tokens, labels, cus = _gpt_batch()
    out = []
    for tp, cp, layout, ckpt in GPT_CASES:
        st = init_parallel_state(tp=tp, cp=cp)
        model = GPT(_gpt_cfg(), ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                    ModelOptions(layout=layout, activation_checkpointing=ckpt, seed=11))
        tok, lab = (shard_sequence(x, 1, st.cp_group, layout) for x in (tokens, labels))
        pos = document_positions(cus, sequence_positions(N_GPT, st.cp_group, layout))
        n_tokens = global_token_count(lab, st.dp_cp_group)
        loss_sum = model(tok, pos, lab, cu_seqlens=cus)
        loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
        deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
        out.append((global_mean_loss(loss_sum, n_tokens, st.dp_cp_group).item(),
                    gather_full_state_dict(model, st.tp_group, grads=True)))
    return out


def test_gpt_with_documents_matches_one_process():
    """tp x cp GPTs with document masking and RoPE positions restarting per document equal
    one process doing the same (loss and every gradient), in every checkpointing mode."""
    from ctxpar.context_parallel.documents import document_positions
    from models.gpt import GPT

    tokens, labels, cus = _gpt_batch()
    model = GPT(_gpt_cfg(), options=ModelOptions(seed=11))
    pos = document_positions(cus, torch.arange(N_GPT))
    loss = model(tokens, pos, labels, cu_seqlens=cus) / labels.numel()
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    with torch.no_grad():  # the documents matter: without them the loss is another number
        plain = model(tokens, torch.arange(N_GPT), labels) / labels.numel()
    assert abs(plain.item() - loss.item()) > 1e-3
    for rank, res in enumerate(run_distributed(_gpt_documents, 4, timeout=300)):
        for (tp, cp, layout, ckpt), (got_loss, grads) in zip(GPT_CASES, res):
            where = f"tp{tp} cp{cp} {layout} {ckpt} rank {rank}"
            assert abs(got_loss - loss.item()) <= 1e-5 * abs(loss.item()), where
            for name, g in want.items():
                # fp32, other summation order (ring merge, TP partial sums): as test_gpt.
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where} {name}: {m}")
