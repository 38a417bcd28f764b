"""Ring attention vs one-process fp32 attention on the gathered sequence, on gloo ranks.

Spawning costs ~1 s, so one spawned function per world size loops over every
(layout, causal, heads, head_dim, dtype, backend) combination on small tensors.
"""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel.kernels import FlashAttnBackend, MathBackend, SdpaBackend
from ctxpar.context_parallel import NoComm, ring_attention, ring_stats
from ctxpar.context_parallel.blocks import block_plan
from ctxpar.context_parallel.layouts import LAYOUTS, rank_positions, shard_sequence
from ctxpar.context_parallel.merge import merge_block_
from dist_harness import run_distributed

B, S_LOCAL = 2, 8                       # batch, tokens per rank
HEADS = [(4, 4, 40), (8, 2, 64), (8, 1, 40)]  # (heads, kv_heads, head_dim): MHA, GQA, MQA;
                                              # 40 is not a power of two
BACKENDS = ["sdpa", "math"]
EXACT = dict(atol=0, rtol=0)  # byte and FLOP counts are integers: must match exactly


def tolerance(dtype, expected):
    """Why these tolerances. fp32: ring and reference do the same math in fp32 in another
    order (blockwise LSE merge, the kernels' tiling); values are O(1) and the differences
    seen are ~1e-6, so 1e-5 catches any real error (a missed or doubled block moves
    results by O(0.1)). bf16: both start from the same bf16 inputs, but the kernels round
    P, out and the gradients to bf16 (relative step 2^-8 = 4e-3), and a gradient sums tens
    of such terms as large as the tensor's largest entry (dv under MQA reaches ~10, where
    one bf16 step is 0.06). So: 2e-2 relative, plus 1e-2 of the tensor's max magnitude
    absolute (~2.5 bf16 steps there), still far below what a wrong mask or block does."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=1e-2 * max(1.0, expected.abs().max().item()), rtol=2e-2)


def reference_attention(q, k, v, causal, scale):
    """Plain softmax(q k^T * scale) v in fp32 over the full sequence; (out, lse)."""
    H = q.shape[2]
    kr = k.float().repeat_interleave(H // k.shape[2], dim=2)
    vr = v.float().repeat_interleave(H // v.shape[2], dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kr) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhls,bshd->blhd", s.softmax(-1), vr), torch.logsumexp(s, -1)


def visible_pairs(positions, n, causal):
    """(query, key) pairs a rank's queries may see: key position <= query position."""
    return int((positions + 1).sum()) if causal else positions.numel() * n


def global_inputs(n, H, Hkv, D, dtype):
    """The full-sequence q, k, v, dout; the same on every rank and in the parent."""
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, n, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    return q, k, v, torch.randn(B, n, H, D, generator=gen).to(dtype)


COMBOS = list(itertools.product((False, True), HEADS, (torch.float32, torch.bfloat16),
                                LAYOUTS, BACKENDS))


def _ring_outputs(rank, world):
    """Each rank's ring results for every combo; the parent compares them (a child's first
    assert_close would import torch.distributed.tensor, ~2 s of CPU per rank)."""
    results = []
    for causal, (H, Hkv, D), dtype, layout, backend in COMBOS:
        q, k, v, dout = global_inputs(world * S_LOCAL, H, Hkv, D, dtype)
        ql, kl, vl = (shard_sequence(x, 1, None, layout).detach().requires_grad_()
                      for x in (q, k, v))
        with ring_stats() as st:
            out, lse = ring_attention(ql, kl, vl, causal=causal, layout=layout,
                                      backend=backend, return_lse=True)
            out.backward(shard_sequence(dout, 1, None, layout))
        results.append(dict(out=out.detach(), lse=lse, dq=ql.grad, dk=kl.grad, dv=vl.grad,
                            stats=st.as_dict()))
    # NoComm (the benchmark's flag): the same schedule with the local KV, no bytes moved.
    q = torch.randn(B, S_LOCAL, 4, 64, requires_grad=True)
    with ring_stats() as st:
        ring_attention(q, q, q, NoComm(rank, world), causal=True,
                       layout="zigzag").sum().backward()
    return results, st.as_dict()


def _reference(n, causal, H, Hkv, D, dtype):
    q, k, v, dout = global_inputs(n, H, Hkv, D, dtype)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, causal, 1 / math.sqrt(D))
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout.float())
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_matches_full_attention(world):
    per_rank = run_distributed(_ring_outputs, world, timeout=300)
    n = world * S_LOCAL
    refs = {}
    for i, (causal, (H, Hkv, D), dtype, layout, backend) in enumerate(COMBOS):
        combo = f"P={world} {layout} causal={causal} H={H}/{Hkv} D={D} {dtype} {backend}"
        key = (causal, H, Hkv, D, dtype)
        if key not in refs:
            refs[key] = _reference(n, *key)
        ref = refs[key]
        flops = []
        for rank, (results, _) in enumerate(per_rank):
            got, pos = results[i], rank_positions(n, rank, world, layout)
            where = f"{combo} rank {rank}"
            assert got["out"].dtype == dtype and got["out"].shape == (B, S_LOCAL, H, D), where
            assert got["lse"].dtype == torch.float32 and got["lse"].shape == (B, H, S_LOCAL)
            for name in ("out", "lse", "dq", "dk", "dv"):
                expected = ref[name][:, :, pos] if name == "lse" else ref[name][:, pos]
                torch.testing.assert_close(got[name].float(), expected,
                                           **tolerance(dtype, expected),
                                           msg=lambda m: f"{where} {name}: {m}")
            # Bytes: the ring's minimum. Forward: P-1 KV blocks at kv_heads width in k's
            # dtype. Backward: the same P-1 KV blocks again, plus P hops of the fp32 dK,dV
            # block (the last hop brings each rank's gradient home).
            kv_bytes = 2 * B * S_LOCAL * Hkv * D * dtype.itemsize
            dkv_bytes = 2 * B * S_LOCAL * Hkv * D * 4
            fwd_bytes = (world - 1) * kv_bytes
            bwd_bytes = (world - 1) * kv_bytes + world * dkv_bytes if world > 1 else 0
            st, ex = got["stats"], dict(EXACT, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close((st["fwd_bytes_sent"], st["fwd_bytes_recv"]),
                                       (fwd_bytes, fwd_bytes), **ex)
            torch.testing.assert_close((st["bwd_bytes_sent"], st["bwd_bytes_recv"]),
                                       (bwd_bytes, bwd_bytes), **ex)
            # FLOPs: exactly the visible pairs: no future block computed, none missed.
            pairs = visible_pairs(pos, n, causal)
            torch.testing.assert_close((st["fwd_flops"], st["bwd_flops"]),
                                       (4 * B * H * D * pairs, 10 * B * H * D * pairs), **ex)
            flops.append(st["fwd_flops"])
        unit = 4 * B * H * D  # FLOPs per (query, key) pair
        if not causal or layout == "zigzag":  # exactly the same work on every rank
            torch.testing.assert_close(flops, [flops[0]] * world, **EXACT)
        elif layout == "striped":
            # Equal up to the diagonal: rank r's query i sees i*P + r + 1 keys, so ranks
            # differ by S_LOCAL pairs per rank index, well under one block (S_LOCAL^2/2).
            torch.testing.assert_close(flops, [flops[0] + unit * S_LOCAL * r
                                               for r in range(world)], **EXACT)
        elif world > 1:  # contiguous: the last rank does ~2P-1 times the first's work
            assert max(flops) >= 2 * min(flops), (combo, flops)
    for rank, (_, st) in enumerate(per_rank):  # NoComm: zigzag causal FLOPs, zero bytes
        pairs = visible_pairs(rank_positions(n, rank, world, "zigzag"), n, True)
        torch.testing.assert_close((st["fwd_bytes_sent"], st["bwd_bytes_sent"], st["fwd_flops"]),
                                   (0, 0, 4 * B * 4 * 64 * pairs), **EXACT)


def test_single_rank_needs_no_process_group():
    assert not dist.is_initialized()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, h, 40, generator=gen, requires_grad=True) for h in (6, 3, 3))
    out, lse = ring_attention(q, k, v, causal=True, layout="striped", return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, True, 40 ** -0.5)
    torch.testing.assert_close(out, ref_out, **tolerance(torch.float32, ref_out))
    torch.testing.assert_close(lse, ref_lse, **tolerance(torch.float32, ref_lse))


def _subgroup_ring(rank, world):
    """Two CP rings inside a world of 4, [0, 2] and [1, 3]: the P2P peers must be the
    ring neighbours' *global* ranks. Each ring gets its own sequence."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # collective: all ranks
    group, cp_rank = groups[rank % 2], rank // 2
    q, k, v, dout = global_inputs(2 * S_LOCAL, 8, 2, 40, torch.float32)
    q = q + rank % 2  # a different problem per ring: a cross-ring message would show
    ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, group, causal=True, layout="zigzag", backend="math")
    out.backward(shard_sequence(dout, 1, group, "zigzag"))
    return cp_rank, out.detach(), ql.grad, kl.grad, vl.grad


def test_ring_on_subgroups_uses_global_peers():
    n = 2 * S_LOCAL
    for rank, (cp_rank, *got) in enumerate(run_distributed(_subgroup_ring, 4, timeout=60)):
        q, k, v, dout = global_inputs(n, 8, 2, 40, torch.float32)
        qr, kr, vr = ((q + rank % 2).requires_grad_(), k.requires_grad_(), v.requires_grad_())
        out, _ = reference_attention(qr, kr, vr, True, 40 ** -0.5)
        want = (out.detach(), *torch.autograd.grad(out, (qr, kr, vr), dout))
        pos = rank_positions(n, cp_rank, 2, "zigzag")
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b[:, pos], **tolerance(torch.float32, b),
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# ------------------------------------------------------------------ pure pieces


def test_block_plan_covers_exactly_the_visible_pairs():
    """For every layout/P/rank: the union over the ring of the blocks (with the kernel's
    top-left causal mask) is exactly the causal mask by global position, no pair twice."""
    for layout, world in itertools.product(LAYOUTS, (1, 2, 3, 4)):
        S = 6
        n = world * S
        for rank in range(world):
            qpos = rank_positions(n, rank, world, layout)
            seen = torch.zeros(S, n, dtype=torch.int64)
            for src in range(world):
                blk = block_plan(layout, True, rank, src, S)
                if blk is None:
                    continue
                kpos = rank_positions(n, src, world, layout)
                L, T = blk.q1 - blk.q0, blk.k1 - blk.k0
                mask = torch.ones(L, T, dtype=torch.int64)
                if blk.causal:
                    assert L == T, (layout, blk)  # causal kernel only on square blocks
                    mask = mask.tril()
                seen[blk.q0:blk.q1].index_add_(1, kpos[blk.k0:blk.k1], mask)
            want = (torch.arange(n)[None, :] <= qpos[:, None]).long()
            torch.testing.assert_close(seen, want, **EXACT,
                                       msg=lambda m: f"{layout} P={world} r={rank}: {m}")


def test_merge_handles_empty_rows_without_nan():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 8, generator=gen)  # (B, L, H, D)
    lse_a, lse_b = torch.randn(1, 2, 4, generator=gen), torch.randn(1, 2, 4, generator=gen)
    out_b = torch.randn(1, 4, 2, 8, generator=gen)
    ninf = torch.full((1, 2, 4), float("-inf"))
    # Empty accumulator + block = block; block with no visible key (-inf) changes nothing;
    # both empty stays (0, -inf), no NaN.
    out, lse = torch.zeros_like(x), ninf.clone()
    merge_block_(out, lse, x, lse_a)
    torch.testing.assert_close((out, lse), (x, lse_a), **EXACT)
    merge_block_(out, lse, out_b, ninf)
    torch.testing.assert_close((out, lse), (x, lse_a), **EXACT)
    out, lse = torch.zeros_like(x), ninf.clone()
    merge_block_(out, lse, torch.zeros_like(x), ninf)
    torch.testing.assert_close((out, lse), (torch.zeros_like(x), ninf), **EXACT)
    # Two real blocks: the softmax-weighted average (seed 001), fp32 rounding only.
    out, lse = x.clone(), lse_a.clone()
    merge_block_(out, lse, out_b, lse_b)
    wa = torch.exp(lse_a - torch.logaddexp(lse_a, lse_b)).transpose(1, 2).unsqueeze(-1)
    torch.testing.assert_close(out, wa * x + (1 - wa) * out_b, atol=1e-6, rtol=1e-6)


def _flash_v23(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    out, lse = MathBackend().forward(q, k, v, causal, softmax_scale)
    return out, q, k, v, out, lse, None, None  # <= 2.5 returns 8 values


def _flash_v26(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
               window_size_right, softcap, alibi_slopes, return_softmax):
    assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
    out, lse = MathBackend().forward(q, k, v, causal, softmax_scale)
    return out, lse, None, None


def _flash_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
               causal, window_size, deterministic, rng_state=None):
    for buf, g in zip((dq, dk, dv), MathBackend().backward(dout, q, k, v, out, softmax_lse,
                                                           causal, softmax_scale)):
        buf.copy_(g)


@pytest.mark.parametrize("fwd", [_flash_v23, _flash_v26])
def test_flash_attn_adapter_follows_the_signature(fwd):
    """The flash_attn backend's calling convention, with stand-ins for two flash-attn
    signatures (the real package needs CUDA); head_dim 40 exercises the padding to 48."""
    be = FlashAttnBackend(fwd, _flash_bwd, device_types=("cpu",))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 8, h, 40, generator=gen) for h in (4, 2, 2, 4))
    ref = MathBackend()
    out, lse = be.forward(q, k, v, True, 0.2)
    r_out, r_lse = ref.forward(q, k, v, True, 0.2)
    torch.testing.assert_close((out, lse), (r_out, r_lse), **EXACT)  # same code underneath
    grads = be.backward(do, q, k, v, out, lse, True, 0.2)
    torch.testing.assert_close(grads, ref.backward(do, q, k, v, out, lse, True, 0.2),
                               atol=1e-6, rtol=1e-6)  # padded D: fp32 re-association only


def test_sdpa_cuda_path_shapes_on_meta():
    """The CUDA branch of the sdpa backend cannot run here; on the meta device it checks the
    op signatures and our layout handling (padding, lse slice, GQA reduction)."""
    be = SdpaBackend()
    for dtype in (torch.bfloat16, torch.float32):  # flash kernel, efficient kernel
        q = torch.empty(2, 12, 8, 40, dtype=dtype, device="meta")
        k = torch.empty(2, 12, 2, 40, dtype=dtype, device="meta")
        out, lse = be.forward(q, k, k, True, 0.1)
        assert out.shape == q.shape and out.dtype == dtype, (dtype, out.shape)
        assert lse.shape == (2, 8, 12) and lse.is_contiguous(), (dtype, lse.shape)
        dq, dk, dv = be.backward(out, q, k, k, out, lse, True, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape), dtype


# ------------------------------------------------------------------ bad inputs


def _bad_inputs(rank, world):
    t = lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype)  # noqa: E731
    good = t(1, 8, 4, 16)
    cases = {
        "3-D q": dict(q=t(8, 4, 16)),
        "batch": dict(k=t(2, 8, 4, 16), v=t(2, 8, 4, 16)),
        "local_seq q vs k": dict(k=t(1, 6, 4, 16), v=t(1, 6, 4, 16)),
        "head_dim": dict(k=t(1, 8, 4, 8), v=t(1, 8, 4, 8)),
        "k vs v": dict(v=t(1, 8, 2, 16)),
        "dtype": dict(k=t(1, 8, 4, 16, dtype=torch.bfloat16)),
        "integer": dict(q=good.long(), k=good.long(), v=good.long()),
        "device": dict(k=torch.empty(1, 8, 4, 16, device="meta")),
        "heads % kv_heads": dict(q=t(1, 8, 6, 16), k=t(1, 8, 4, 16), v=t(1, 8, 4, 16)),
        "layout": dict(layout="diagonal"),
        "backend": dict(backend="cudnn"),
        "zigzag odd local_seq": dict(q=t(1, 7, 4, 16), k=t(1, 7, 4, 16), v=t(1, 7, 4, 16),
                                     layout="zigzag"),
    }
    msgs = {}
    for name, kw in cases.items():
        args = dict(q=good, k=good, v=good, causal=True)
        args.update(kw)
        try:
            ring_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        except ValueError as e:
            msgs[name] = str(e)
    # Nothing was sent: a good call afterwards still pairs up its messages.
    out = ring_attention(good, good, good, causal=True, layout="striped")
    return msgs, out.shape


def test_bad_inputs_raise_on_every_rank():
    res = run_distributed(_bad_inputs, 3, timeout=60)
    msgs = [m for m, _ in res]
    assert len(msgs[0]) == 12, sorted(msgs[0])  # every case raised ValueError
    assert all(m == msgs[0] for m in msgs), msgs  # the same message on every rank
    assert "heads=6 is not a multiple of kv_heads=4" in msgs[0]["heads % kv_heads"]
    assert "'diagonal'" in msgs[0]["layout"] and "'cudnn'" in msgs[0]["backend"]
    assert all(shape == (1, 8, 4, 16) for _, shape in res)
