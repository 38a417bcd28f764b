"""Keys equal to values (Gemma 4's attention_k_eq_v) with one tensor on the wire:
cp.expanded_attention ships k_proj x (raw) and makes K = RoPE(k_norm(raw)) at the sending
tokens' positions and V = v_norm(raw) where it arrives (expansion.FunctionExpansion over
latent.py's patterns). At cp4 over ring (zigzag, contiguous, striped), all-gather,
Ulysses and hybrid (u2 x r2), one spawn: out and the gradients of q, raw and k_norm's
weight equal plain attention over the whole sequence in one process, and the bytes are
those of one tensor: the ring's and the all-gather's half the K,V path's (forward and
backward), Ulysses' one K,V all-to-all fewer.

Tolerances (fp32): blockwise LSE merges and the per-block refolds sum a few dozen keys in
another order, ~1e-6 seen; 1e-5 of each tensor's scale catches a block at the wrong
positions (RoPE turned by the receiver's own positions moves out by O(0.1)) or a gradient
share lost.
"""
import pytest
import torch

from ctxpar.context_parallel import ContextParallel, cp_stats, shard_sequence
from ctxpar.context_parallel.expansion import FunctionExpansion
from ctxpar.context_parallel.mask import AttentionMask
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import reference_attention
from models.norms import l2_norm, rms_norm
from models.rope import apply_rotary, rotary_cos_sin

B, N, H, KV, D, ROT, EPS, SCALE = 2, 32, 4, 2, 16, 8, 1e-6, 0.3
# (comm, layout, ulysses degree)
CASES = [("ring", "zigzag", 1), ("ring", "contiguous", 1), ("ring", "striped", 1),
         ("allgather", "zigzag", 1), ("ulysses", "zigzag", 4), ("hybrid", "zigzag", 2),
         ("hybrid", "striped", 2)]
COS, SIN = rotary_cos_sin(torch.arange(N), ROT, 1e4)  # (N, ROT/2): the sequence's RoPE


def keys_values(raw, index, weight):
    """Gemma 4's K and V of raw k_proj rows (B, L, h, D) at sequence places index (L,)."""
    k = apply_rotary(rms_norm(raw, weight, EPS), COS[index], SIN[index])
    return k, l2_norm(raw, EPS)


def inputs():
    g = torch.Generator().manual_seed(3)
    q, raw, dout = (torch.randn(B, N, h, D, generator=g) for h in (H, KV, H))
    return q, raw, 1 + 0.5 * torch.randn(D, generator=g), dout


def reference():
    """out, and the gradients of q, raw and the weight, in one process."""
    q, raw, w, dout = (t.requires_grad_() for t in inputs())
    k, v = keys_values(raw, torch.arange(N), w)
    out, _ = reference_attention(q, k, v, True, SCALE)
    out.backward(dout[..., :D])
    return dict(out=out.detach(), dq=q.grad, draw=raw.grad, dweight=w.grad)


@pytest.mark.quick
@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_the_expansion_and_its_autograd_fold_equal_plain_attention_alone(comm):
    """One rank (LOCAL): K,V made from raw in the pattern, and its backward's fold (dK, dV
    through the expansion by autograd) into d raw and the weight's gradient."""
    from ctxpar.context_parallel import LOCAL
    q, raw, w, dout = (t.requires_grad_() for t in inputs())
    out = ContextParallel(comm, LOCAL, layout="zigzag").expanded_attention(
        q, raw, FunctionExpansion(keys_values, (w,), D), softmax_scale=SCALE,
        mask=AttentionMask(causal=True))
    out.backward(dout)
    got = dict(out=out.detach(), dq=q.grad, draw=raw.grad, dweight=w.grad)
    for name, want in reference().items():
        close(got[name], want, f"{comm} {name}")


def _cases(rank, world):
    import torch.distributed as dist
    from ctxpar import init_parallel_state
    results, want = [], reference()
    for comm, layout, u in CASES:
        st = init_parallel_state(cp=world, ulysses=u if comm == "hybrid" else 1)
        cp = ContextParallel.from_state(st, comm, layout)
        shard = lambda t: shard_sequence(t, 1, st.cp_group, layout, u if comm == "hybrid"
                                         else 1).detach().clone()
        q, raw, w, dout = inputs()
        q, raw, dout = shard(q), shard(raw), shard(dout)
        mask = AttentionMask(causal=True)
        got, sent = {}, {}
        for path in ("one tensor", "k and v"):
            ql, rl, wl = (t.clone().requires_grad_() for t in (q, raw, w))
            with cp_stats() as stats:
                if path == "one tensor":
                    out = cp.expanded_attention(ql, rl, FunctionExpansion(keys_values, (wl,), D),
                                                softmax_scale=SCALE, mask=mask)
                else:  # K, V made here at this rank's positions and both sent
                    pos = shard(torch.arange(N))
                    out = cp.attention(ql, *keys_values(rl, pos, wl), softmax_scale=SCALE,
                                       mask=mask)
                out.backward(dout)
            sent[path] = (stats.fwd_bytes_sent, stats.bwd_bytes_sent)
            dist.all_reduce(wl.grad, group=st.cp_group)  # the replicated weight's CP sum
            got[path] = dict(out=out.detach(), dq=ql.grad, draw=rl.grad, dweight=wl.grad)
        full = {n: t if n == "dweight" else shard(t) for n, t in want.items()}
        results.append(dict(got=got, sent=sent, full=full))
    return results


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_cases, 4, timeout=240)


def close(got, want, msg):
    torch.testing.assert_close(got, want, rtol=1e-5,
                               atol=1e-5 * max(1.0, want.abs().max().item()), msg=msg)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_one_tensor_on_the_wire_equals_one_process(world4, case):
    for rank, results in enumerate(world4):
        r = results[case]
        for name, want in r["full"].items():
            close(r["got"]["one tensor"][name], want, f"{CASES[case]} rank {rank} {name}")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_wire_carries_one_tensor_instead_of_two(world4, case):
    comm, _, u = CASES[case]
    itemsize, S = 4, N // 4
    for rank, results in enumerate(world4):
        one, two = results[case]["sent"]["one tensor"], results[case]["sent"]["k and v"]
        if comm in ("ring", "allgather"):  # K,V blocks (and fp32 dK,dV) -> raw's (and fp32 draw)
            assert 2 * one[0] == two[0] > 0 and 2 * one[1] == two[1] > 0, (rank, one, two)
        elif comm == "ulysses":  # one all-to-all of V (forward) and of dV (backward) fewer
            v = B * S * H * D * itemsize * (u - 1) // u  # KV=2 heads replicated to u=4
            assert (two[0] - one[0], two[1] - one[1]) == (v, v), (rank, one, two)
        else:  # hybrid: V's all-to-all and half the ring's K,V gone
            assert two[0] - one[0] > B * S * KV * D * itemsize // 2, (rank, one, two)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_planner_counts_the_bytes_on_the_wire(world4, case):
    """comm_bytes.cp_bytes with kv_tensors 1 (plan/kv_layers.wire_tensors) is what a rank sends."""
    from ctxpar.plan.comm_bytes import cp_bytes
    comm, _, u = CASES[case]
    for n, path in ((1, "one tensor"), (2, "k and v")):
        want = cp_bytes(comm, 4, u, B, N // 4, H, KV, D, 4, kv_tensors=n)
        for rank, results in enumerate(world4):
            assert results[case]["sent"][path] == want, (path, rank, want)
