"""MLA under CP (latent_attention): one process against plain attention on the expanded K,V
and against transformers' DeepseekV3Attention; every comm at cp 2 and 4 against one
process; the bytes on the wire are the latent's; bad input raises before communicating.

Tolerances (fp32): outputs, lse, dq and the latent's gradient are O(1) sums over a few
dozen keys done blockwise (LSE merge, block-by-block re-expansion) instead of at once:
differences seen are ~1e-6, so atol = rtol = 1e-5 catches any real error (a missed or
doubled block, a wrong head's W rows, a token out of place move results by O(0.1)). dW
and the projections' gradients sum over every (token, head) pair, entries up to ~100: the
same relative budget, 1e-5 of the tensor's largest entry absolute (rel_tolerance).
"""
import pytest
import torch
import torch.distributed as dist

from ctxpar.context_parallel import cp_stats, shard_sequence
from ctxpar.context_parallel.comm import NoComm
from ctxpar.context_parallel.kernels import MathBackend, PaddedHeadDims, SdpaBackend
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.context_parallel.latent import LatentDims
from ctxpar.context_parallel.latent_api import latent_attention
from ctxpar.context_parallel.mask import AttentionMask, dense_mask
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import tolerance
from ctxpar.testing.mla import ReferenceMLA, expanded_reference, mla_inputs

DIMS = LatentDims(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
B, H, S_LOCAL = 2, 4, 8  # H divides over 2 and 4 Ulysses ranks
SCALE = 0.3
GRADS = ("dq", "dlatent", "dweight", "dsinks")


def rel_tolerance(expected):
    """1e-5 relative, and 1e-5 of the tensor's largest entry absolute (module docstring)."""
    return dict(rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))


def visible(n, opts):
    """(B, n, n) bool of a case's mask (mask.dense_mask per sample's boundaries)."""
    cus = opts.get("cu_seqlens")
    cus = cus if isinstance(cus, list) else [cus] * B
    return torch.stack([dense_mask(n, opts.get("causal", False), opts.get("sliding_window"),
                                   cu) for cu in cus])


def mask_of(opts, sinks):
    return AttentionMask(causal=opts.get("causal", False),
                         sliding_window=opts.get("sliding_window"),
                         cu_seqlens=opts.get("cu_seqlens"),
                         sinks=sinks if opts.get("sinks") else None)


def inputs(n, opts):
    """mla_inputs, rounded to bf16 where the case says so (the sinks stay fp32)."""
    q, latent, weight, dout, sinks = mla_inputs(B, n, H, DIMS)
    dtype = torch.bfloat16 if opts.get("bf16") else torch.float32
    return (*(x.to(dtype) for x in (q, latent, weight, dout)), sinks)


def reference(n, opts):
    q, latent, weight, dout, sinks = inputs(n, opts)
    return expanded_reference(q, latent, weight, DIMS, dout, visible(n, opts), SCALE,
                              sinks if opts.get("sinks") else None)


def assert_matches(got, want, names, bf16=False):
    """fp32: rel_tolerance; bf16: ctxpar.testing.attention.tolerance's bf16 budget (2e-2
    relative, 1e-2 of the largest entry absolute: the kernels round P, out and every
    gradient to bf16, the ring's latent gradient travels in fp32)."""
    for name in names:
        tol = tolerance(torch.bfloat16, want[name]) if bf16 else rel_tolerance(want[name])
        torch.testing.assert_close(got[name].float(), want[name], **tol,
                                   msg=lambda m: f"{name}: {m}")


# --- (a) one process against plain attention on the expanded K,V -------------------------

ONE_PROCESS = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "documents, window and sinks": dict(causal=True, sliding_window=3, sinks=True,
                                        cu_seqlens=torch.tensor([0, 5, 6, 16],
                                                                dtype=torch.int32)),
}


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == "causal"
                                  else c for c in ONE_PROCESS])
def test_one_process_equals_attention_on_the_expanded_kv(case, backend):
    opts, n = ONE_PROCESS[case], 16
    q, latent, weight, dout, sinks = mla_inputs(B, n, H, DIMS)
    leaves = [x.requires_grad_() for x in (q, latent, weight, sinks)]
    out, lse = latent_attention(q, latent, weight, DIMS, mask=mask_of(opts, sinks),
                                softmax_scale=SCALE, backend=backend, return_lse=True)
    grads = torch.autograd.grad(out, leaves if opts.get("sinks") else leaves[:3], dout)
    got = {"out": out, "lse": lse, **dict(zip(GRADS, grads))}
    assert_matches(got, reference(n, opts), ["out", "lse", *GRADS[:len(grads)]])


@pytest.mark.parametrize("v_dim", [6, 20])  # narrower than q's 12 (MLA), and wider
def test_padded_head_dims_give_the_math_kernel_results(v_dim):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 8, 3, 12, generator=gen) for _ in range(2))
    v, dout = (torch.randn(2, 8, 3, v_dim, generator=gen) for _ in range(2))
    padded, math = PaddedHeadDims(SdpaBackend()), MathBackend()
    out, lse = padded.forward(q, k, v, True, 0.3)
    ref_out, ref_lse = math.forward(q, k, v, True, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    for g, r in zip(padded.backward(dout, q, k, v, out, lse, True, 0.3),
                    math.backward(dout, q, k, v, ref_out, ref_lse, True, 0.3)):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


# --- (b) one process against transformers' DeepseekV3Attention ----------------------------

HF_CASES = {  # (q_lora_rank, rope_interleave, yarn)
    "q_proj, interleaved rope": (None, True, False),
    "q_lora, rotate_half rope, yarn": (8, False, True),
    "q_lora, interleaved rope, yarn": (8, True, True),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_reference_layer_equals_transformers_deepseek_v3_attention(case):
    tf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config
    q_lora, interleave, yarn = HF_CASES[case]
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
             "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0} if yarn
            else {"rope_type": "default", "rope_theta": 10000.0})
    config = DeepseekV3Config(
        hidden_size=32, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora,
        kv_lora_rank=DIMS.kv_lora_rank, qk_nope_head_dim=DIMS.qk_nope_head_dim,
        qk_rope_head_dim=DIMS.qk_rope_head_dim, v_head_dim=DIMS.v_head_dim,
        rope_interleave=interleave, rope_parameters=rope, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.DeepseekV3Attention(config, layer_idx=0)
    for p in hf.parameters():  # random norms too, so that their gradients are checked
        torch.nn.init.normal_(p, std=0.3)
    ours = ReferenceMLA.from_config(config)
    ours.load_state_dict(hf.state_dict())
    assert ours.softmax_scale == pytest.approx(hf.scaling, rel=1e-12)
    n = 16
    x = torch.randn(B, n, 32, requires_grad=True)
    cos, sin = tf.DeepseekV3RotaryEmbedding(config)(x, torch.arange(n)[None].expand(B, n))
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    want, _ = hf(x, (cos, sin), causal)
    got = ours(x, cos, sin, causal=True)
    dout = torch.randn_like(want)
    names = [name for name, _ in hf.named_parameters()]
    ours_params = dict(ours.named_parameters())
    g_want = torch.autograd.grad(want, [x, *hf.parameters()], dout)
    g_got = torch.autograd.grad(got, [x, *(ours_params[m] for m in names)], dout)
    torch.testing.assert_close(got, want, **rel_tolerance(want))
    for name, g, w in zip(["hidden", *names], g_got, g_want):
        torch.testing.assert_close(g, w, **rel_tolerance(w), msg=lambda m: f"{name}: {m}")


@pytest.mark.quick
@pytest.mark.parametrize("q_lora", [None, 8])
def test_nope_mla_layer_equals_transformers_kimi_linear_attention(q_lora):
    """models/mla.py under model.rope=false against transformers' KimiLinearAttention on the
    same weights: the rope parts and the shared key enter unrotated, the scale is
    (dn + dr) ** -0.5 (output, input and every parameter's gradient). cos and sin are
    random: a NoPE layer that turned anything would use them."""
    tf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig
    from ctxpar.config import ModelConfig
    from ctxpar.config.mla import MLAConfig
    from models.gpt import GPT
    mla = dict(q_lora_rank=q_lora, kv_lora_rank=DIMS.kv_lora_rank,
               qk_nope_head_dim=DIMS.qk_nope_head_dim, qk_rope_head_dim=DIMS.qk_rope_head_dim,
               v_head_dim=DIMS.v_head_dim)
    config = KimiLinearConfig(hidden_size=32, num_attention_heads=H, num_key_value_heads=H,
                              num_hidden_layers=1, layer_types=["full_attention"], **mla)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = tf.KimiLinearAttention(config, layer_idx=0)
    for p in hf.parameters():  # random norms too, so that their gradients are checked
        torch.nn.init.normal_(p, std=0.3)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=H, n_layers=1, rope=False,
                      mla=MLAConfig(**mla))
    ours = GPT(cfg).layers[0].attn
    ours.load_state_dict(hf.state_dict())
    n = 16
    x = torch.randn(B, n, 32, requires_grad=True)
    cos, sin = torch.randn(n, DIMS.qk_rope_head_dim // 2), torch.randn(n, DIMS.qk_rope_head_dim // 2)
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    want, _ = hf(x, causal)
    inputs, carry = ours.project_in(x, cos, sin)
    got = ours.project_out(ours.mix(inputs), *carry)
    dout = torch.randn_like(want)
    names = [name for name, _ in hf.named_parameters()]
    ours_params = dict(ours.named_parameters())
    g_want = torch.autograd.grad(want, [x, *hf.parameters()], dout)
    g_got = torch.autograd.grad(got, [x, *(ours_params[m] for m in names)], dout)
    torch.testing.assert_close(got, want, **rel_tolerance(want))
    for name, g, w in zip(["hidden", *names], g_got, g_want):
        torch.testing.assert_close(g, w, **rel_tolerance(w), msg=lambda m: f"{name}: {m}")


# --- (c, d) under CP: every comm against one process; the latent's bytes ------------------

DOCS2 = [torch.tensor(c, dtype=torch.int32) for c in ([0, 3, 4, 11, 16], [0, 8, 9, 16])]
DOCS4 = torch.tensor([0, 5, 6, 19, 20, 32], dtype=torch.int32)
CASES = {  # world -> [(name, comm, layout, ulysses degree, mask options)]
    2: [("ring zigzag", "ring", "zigzag", 1, dict(causal=True)),
        ("ring striped", "ring", "striped", 1, dict(causal=True)),
        ("ring contiguous documents", "ring", "contiguous", 1,
         dict(causal=True, cu_seqlens=DOCS2)),
        ("ring zigzag documents window sinks", "ring", "zigzag", 1,
         dict(causal=True, cu_seqlens=DOCS2, sliding_window=3, sinks=True)),
        ("ring bidirectional", "ring", "zigzag", 1, dict(causal=False)),
        ("allgather zigzag", "allgather", "zigzag", 1, dict(causal=True)),
        ("allgather striped documents", "allgather", "striped", 1,
         dict(causal=True, cu_seqlens=DOCS2)),
        ("ulysses zigzag", "ulysses", "zigzag", 2, dict(causal=True)),
        ("ulysses striped documents sinks", "ulysses", "striped", 2,
         dict(causal=True, cu_seqlens=DOCS2, sinks=True)),
        ("hybrid u1 zigzag", "hybrid", "zigzag", 1, dict(causal=True)),
        ("ring zigzag bf16", "ring", "zigzag", 1, dict(causal=True, bf16=True)),
        ("ulysses zigzag bf16", "ulysses", "zigzag", 2, dict(causal=True, bf16=True))],
    4: [("ring zigzag", "ring", "zigzag", 1, dict(causal=True)),
        ("ring zigzag documents", "ring", "zigzag", 1, dict(causal=True, cu_seqlens=DOCS4)),
        ("ring contiguous documents window, stopped early", "ring", "contiguous", 1,
         dict(causal=True, cu_seqlens=DOCS4, sliding_window=3)),
        ("allgather striped", "allgather", "striped", 1, dict(causal=True)),
        ("ulysses zigzag documents", "ulysses", "zigzag", 4,
         dict(causal=True, cu_seqlens=DOCS4)),
        ("hybrid u2 zigzag documents", "hybrid", "zigzag", 2,
         dict(causal=True, cu_seqlens=DOCS4)),
        ("hybrid u2 striped", "hybrid", "striped", 2, dict(causal=True))],
}


def _hybrid_groups(rank, world):
    """{u: (ulysses_group, ring_group)} of this rank: u = 1 (groups of one, the ring over
    the world) and, on 4 ranks, u = 2 (cp rank = ring rank * 2 + Ulysses rank). Every
    rank makes every group (new_group is collective)."""
    singles = [dist.new_group([r]) for r in range(world)]
    groups = {1: (singles[rank], dist.group.WORLD)}
    if world == 4:
        u2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        r2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups[2] = (u2[rank // 2], r2[rank % 2])
    return groups


def _every_case(rank, world):
    """{case name: out, lse, gradients of this rank (dweight, dsinks: its shares), cp_stats
    forward and backward bytes}, each case one forward and backward."""
    groups, res = _hybrid_groups(rank, world), {}
    for name, comm, layout, u, opts in CASES[world]:
        n = S_LOCAL * world
        q, latent, weight, dout, sinks = inputs(n, opts)
        q, latent, dout = (shard_sequence(x, 1, None, layout, u) for x in (q, latent, dout))
        leaves = [x.detach().clone().requires_grad_() for x in (q, latent, weight, sinks)]
        ug, rg = groups[u] if comm == "hybrid" else (None, None)
        with cp_stats() as st:
            out, lse = latent_attention(*leaves[:3], DIMS, comm=comm, layout=layout,
                                        ulysses_group=ug, ring_group=rg,
                                        mask=mask_of(opts, leaves[3]), softmax_scale=SCALE,
                                        backend="sdpa", return_lse=True)
            out.backward(dout)
        res[name] = {"out": out.detach(), "lse": lse, "dsinks": leaves[3].grad,
                     **dict(zip(GRADS, (x.grad for x in leaves[:3]))), **st.as_dict()}
    if world == 2:
        res["layer"] = _layer_run(None, "zigzag", comm="ring", causal=True)
    return res


def _layer_run(group, layout, **cp):
    """ReferenceMLA (q_lora, YaRN-free default RoPE) on this rank's tokens of one hidden
    sequence: {out, dhidden, each parameter's gradient (this rank's share)}."""
    n, hidden_size = S_LOCAL * 2, 32
    torch.manual_seed(0)
    layer = ReferenceMLA(hidden_size, H, DIMS, q_lora_rank=8, rope_interleave=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    gen = torch.Generator().manual_seed(5)
    x, dout = (torch.randn(B, n, hidden_size, generator=gen) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, DIMS.qk_rope_head_dim, 2) / DIMS.qk_rope_head_dim)
    freqs = torch.arange(n)[:, None] * inv_freq                    # transformers' default RoPE
    emb = torch.cat((freqs, freqs), dim=-1).expand(B, n, -1)
    x, dout, cos, sin = (shard_sequence(t, 1, group, layout)
                         for t in (x, dout, emb.cos(), emb.sin()))
    x.requires_grad_()
    out = layer(x, cos, sin, cp_group=group, layout=layout, **cp)
    out.backward(dout)
    return {"out": out.detach(), "dhidden": x.grad,
            **{name: p.grad for name, p in layer.named_parameters()}}


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_every_case, 2, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_every_case, 4, timeout=300)


def _check_case(per_rank, world, case):
    """Reassemble the ranks' shards (sequence dims at their global positions; shares of
    dweight, dsinks summed, as the CP gradient reduction does) and compare."""
    name, comm, layout, u, opts = case
    n = S_LOCAL * world
    want = reference(n, opts)
    got = {k: torch.zeros_like(want[k]) for k in want}
    dtype = torch.bfloat16 if opts.get("bf16") else torch.float32
    for r, res in enumerate(per_rank):
        pos = rank_positions(n, r, world, layout, ulysses=u)
        assert res[name]["out"].dtype == res[name]["dlatent"].dtype == dtype
        for k, dim in (("out", 1), ("dq", 1), ("dlatent", 1), ("lse", 2)):
            got[k].index_copy_(dim, pos, res[name][k].float())
        got["dweight"] += res[name]["dweight"].float()
        if opts.get("sinks"):
            got["dsinks"] += res[name]["dsinks"]
    assert_matches(got, want, ["out", "lse", *GRADS[:4 if opts.get("sinks") else 3]],
                   bf16=opts.get("bf16", False))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick, id=c[0])
                                  if c[0] == "ring zigzag" else pytest.param(c, id=c[0])
                                  for c in CASES[2]])
def test_two_ranks_equal_one_process(world2, case):
    _check_case(world2, 2, case)


@pytest.mark.parametrize("case", CASES[4], ids=[c[0] for c in CASES[4]])
def test_four_ranks_equal_one_process(world4, case):
    _check_case(world4, 4, case)


def test_reference_layer_on_two_ranks_equals_one_process(world2):
    """The model-side path: projections, RoPE at each rank's global positions, the latent
    ring over zigzag shards, o_proj; parameter gradients summed over CP as DeepSpeed's
    reduction does."""
    from ctxpar.context_parallel.comm import LOCAL
    want = _layer_run(LOCAL, "contiguous", comm="ring", causal=True)
    n = S_LOCAL * 2
    for name, w in want.items():
        if name in ("out", "dhidden"):
            got = torch.zeros_like(w)
            for r, res in enumerate(world2):
                got[:, rank_positions(n, r, 2, "zigzag")] = res["layer"][name]
        else:
            got = sum(res["layer"][name] for res in world2)
        torch.testing.assert_close(got, w, **rel_tolerance(w), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_the_ring_moves_the_latent_not_the_expanded_kv(world, world2, world4):
    """Forward: P-1 latent blocks (B, s, R + dr) fp32 out; backward: P-1 again plus P of
    its fp32 gradient. The expanded K,V would be H (dqk + dv) values a token, not R + dr."""
    latent_block = B * S_LOCAL * DIMS.latent_dim * 4
    for res in (world2 if world == 2 else world4):
        st = res["ring zigzag"]
        assert st["fwd_bytes_sent"] == st["fwd_bytes_recv"] == (world - 1) * latent_block
        assert st["bwd_bytes_sent"] == (2 * world - 1) * latent_block
    assert DIMS.latent_dim < H * (DIMS.qk_head_dim + DIMS.v_head_dim)


def test_flops_count_each_visible_pair_at_both_head_dims(world2):
    """cp_stats: 2 B H (dqk + dv) per causally visible pair forward (q k^T at dqk, p v at
    dv; the kernel's padding of v not counted), 2.5x that backward, over the ranks."""
    n = 2 * S_LOCAL
    fwd = 2 * B * H * (DIMS.qk_head_dim + DIMS.v_head_dim) * n * (n + 1) // 2
    assert sum(res["ring zigzag"]["fwd_flops"] for res in world2) == fwd
    assert sum(res["ring zigzag"]["bwd_flops"] for res in world2) == fwd * 5 // 2


def test_allgather_and_ulysses_move_the_latent_once(world2):
    """All-gather: the latent gathered (P-1 blocks), backward gathered again and its fp32
    gradient reduce-scattered. Ulysses: q and out all-to-all'd by heads ((P-1)/P of them),
    the latent all-gathered whole (it has no heads)."""
    P, latent_block = 2, B * S_LOCAL * DIMS.latent_dim * 4
    by_heads = [B * S_LOCAL * H * d * 4 for d in (DIMS.qk_head_dim, DIMS.v_head_dim, 1)]
    for res in world2:  # by heads: q, out, and the lse (the cases return it)
        ag, ul = res["allgather zigzag"], res["ulysses zigzag"]
        assert ag["fwd_bytes_sent"] == (P - 1) * latent_block
        assert ag["bwd_bytes_sent"] == 2 * (P - 1) * latent_block
        assert ul["fwd_bytes_sent"] == (P - 1) * latent_block + sum(
            (P - 1) * b // P for b in by_heads)
        # backward: dout in, dq out by heads; the latent's gradient reduce-scattered
        assert ul["bwd_bytes_sent"] == (P - 1) * latent_block + sum(
            (P - 1) * b // P for b in by_heads[:2])


# --- (e) bad input: one ValueError line, before any communication -------------------------

def _call(**change):
    q, latent, weight, _, _ = mla_inputs(B, S_LOCAL, H, DIMS)
    args = dict(q=q, latent=latent, kv_b_weight=weight, dims=DIMS, comm="ring",
                cp_group=NoComm(0, 2), causal=True, layout="zigzag")
    args.update(change)
    return latent_attention(args.pop("q"), args.pop("latent"), args.pop("kv_b_weight"),
                            args.pop("dims"), **args)


BAD = {
    "odd rope head dim": (lambda: LatentDims(16, 8, 3, 6), "qk_rope_head_dim=3"),
    "heads not divisible over ulysses": (
        lambda: _call(comm="ulysses", cp_group=NoComm(0, 3)), "heads=4 is not divisible"),
    "latent width disagrees": (
        lambda: _call(latent=torch.zeros(B, S_LOCAL, 17)), "latent (2, 8, 17)"),
    "latent length disagrees": (
        lambda: _call(latent=torch.zeros(B, 4, DIMS.latent_dim)), "latent (2, 4, 20)"),
    "q head dim disagrees": (
        lambda: _call(q=torch.zeros(B, S_LOCAL, H, 10)), "q's head dim 10"),
    "kv_b weight for other heads": (
        lambda: _call(kv_b_weight=torch.zeros(3 * 14, 16)), "kv_b_weight (42, 16)"),
    "odd local length under zigzag": (
        lambda: _call(q=torch.zeros(B, 7, H, 12), latent=torch.zeros(B, 7, 20)),
        "even local_seq"),
    "mixed dtypes": (lambda: _call(latent=torch.zeros(B, S_LOCAL, 20, dtype=torch.float64)),
                     "one floating dtype"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_one_clear_line_before_communicating(case):
    """NoComm groups: a call that got past validation would run (and on a real group
    communicate); these raise first."""
    fn, words = BAD[case]
    with pytest.raises(ValueError, match=None) as err:
        fn()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_backward_saves_the_latent_not_the_expanded_kv():
    """Autograd keeps q, the latent, out and the lse (W is the parameter itself): the
    expanded K,V (here H (dqk + dv) = 72 values a token against the latent's 20) are
    made again block by block in backward."""
    from ctxpar.testing.memory import saved_tensor_bytes
    q, latent, weight, _, _ = mla_inputs(B, 16, H, DIMS)
    q, latent, weight = (x.requires_grad_() for x in (q, latent, weight))
    with saved_tensor_bytes([weight]) as seen:
        out = latent_attention(q, latent, weight, DIMS, causal=True, backend="sdpa")
    lse_bytes = B * H * 16 * 4
    assert sum(seen.values()) == sum(x.numel() * 4 for x in (q, latent, out)) + lse_bytes


def test_bf16_one_process_is_within_bf16_rounding_of_fp32():
    """bf16 inputs against the fp32 reference on the same (bf16-rounded) values, with
    ctxpar.testing.attention.tolerance's bf16 budget (2e-2 relative, 1e-2 of the largest
    entry absolute: the kernels round P, out and every gradient to bf16)."""
    from ctxpar.testing.attention import tolerance
    q, latent, weight, dout, _ = (x.to(torch.bfloat16) for x in mla_inputs(B, 16, H, DIMS))
    leaves = [x.requires_grad_() for x in (q, latent, weight)]
    out = latent_attention(*leaves, DIMS, causal=True, softmax_scale=SCALE, backend="sdpa")
    grads = torch.autograd.grad(out, leaves, dout)
    want = expanded_reference(q, latent, weight, DIMS, dout, visible(16, dict(causal=True)),
                              SCALE)
    for name, got in zip(("out", *GRADS), (out, *grads)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want[name],
                                   **tolerance(torch.bfloat16, want[name]),
                                   msg=lambda m: f"{name}: {m}")


def test_context_parallel_bundle_runs_latent_attention_on_its_groups():
    """ContextParallel.latent_attention is latent_attention with the bundle's comm, groups
    and layout (here one process: LOCAL, the same bits as the plain call)."""
    from ctxpar.context_parallel import LOCAL, ContextParallel
    q, latent, weight, _, _ = mla_inputs(B, 16, H, DIMS)
    cp = ContextParallel(comm="allgather", cp_group=LOCAL, layout="striped")
    got = cp.latent_attention(q, latent, weight, DIMS, causal=True)
    want = latent_attention(q, latent, weight, DIMS, comm="ring", causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
