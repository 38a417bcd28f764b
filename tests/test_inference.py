"""Generation with a CP-sharded KV cache equals a single process recomputing everything.

The reference (``reference_generate``) runs no cache at all: every step is a full forward
of the whole sequence so far, one prompt at a time, unpadded, on one process. The parallel
side prefills right-padded prompts of lengths no layout divides (13, 5, 22) with the
training ring, then decodes with the cross-rank LSE merge, on every cp in {1, 2, 4} x
tp in {1, 2} x layout (one 8-rank spawn looping over the cases; idle ranks are DP
replicas and must agree too), for plain GQA/MQA models and one mixing windowed, chunked
and full layers with sinks. Checked: greedy tokens identical, the logits of every step
close, seeded sampling identical on every rank and to the reference, the KV cache's bytes
1/cp of one rank's, and the bytes each decode step moves equal to the formula.
"""
import math
import pickle

import pytest
import torch

from ctxpar.config import ModelConfig, resolved_head_dim
from ctxpar.inference import (SamplingParams, check_prompts, decode_bytes_per_step,
                              decode_capacity, filter_logits, generate, merge_partials,
                              partial_attention, sample)
from ctxpar.inference.cp_ops import merge_block_
from ctxpar.testing import run_distributed
from ctxpar.testing.generation import reference_generate
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions

# init_std 0.2 (not 0.02) spreads a random model's logits, so greedy never sits on a
# near-tie; reference_generate checks that premise (top-2 gap) rather than assuming it.
CONFIGS = {
    "gqa": ModelConfig(vocab_size=256, seq_len=64, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=2, init_std=0.2),
    # MQA: the single kv head is replicated over tp=2 (ReplicatedHeadLinear); untied head.
    "mqa": ModelConfig(vocab_size=256, seq_len=64, n_layers=2, d_model=32, n_heads=4,
                       n_kv_heads=1, init_std=0.2, tie_embeddings=False, mlp="gelu"),
    # The attention kinds: decode sees only the window's / the chunk's slots (by their
    # global positions, on whichever rank holds them) and the sinks join the merged row.
    "kinds": ModelConfig(vocab_size=256, seq_len=64, n_layers=3, d_model=32, n_heads=4,
                         n_kv_heads=2, init_std=0.2, sliding_window=5, attention_chunk_size=9,
                         layer_types=["sliding_attention", "chunked_attention",
                                      "full_attention"], attention_sinks=True,
                         layer_rope={"sliding_attention": {"rope_theta": 100.0}}),
    # The Hugging Face families' fields: the decode step's softmax scale is the model's
    # (query_pre_attn_scalar), its q/k norms and head_dim apply to the cached keys.
    "fields": ModelConfig(vocab_size=256, seq_len=64, n_layers=2, d_model=32, n_heads=4,
                          n_kv_heads=2, init_std=0.2, head_dim=12, attention_bias=True,
                          qk_norm=True, norm_offset=1.0, post_norms=True,
                          scale_embeddings=True, mlp="geglu", query_pre_attn_scalar=20.0),
}
SEED = 5
PROMPTS = [list(range(40, 53)), [7, 3, 200, 9, 1], [(17 * i) % 251 + 2 for i in range(22)]]
NEW = 7
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
# fp32 on both sides; the parallel side sums in other orders (ring and decode LSE merges,
# TP partial products all-reduced), ~1e-6 relative on logits of size ~1-10 (measured max
# 4e-6). A real fault (a pad key seen, a shard's partial lost, a wrong RoPE position)
# moves logits by > 1e-2.
TOL = dict(rtol=1e-5, atol=1e-4)


def _generate_cases(rank, world, cases):
    from ctxpar import init_parallel_state

    out = []
    for tp, cp, layout, name, sampling in cases:
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=tp, cp=cp)  # dp = world / (tp * cp) replicas
        model = GPT(cfg, ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                    ModelOptions(layout=layout, seed=SEED)).eval()
        res = generate(model, PROMPTS, NEW, layout=layout, cp_group=st.cp_group,
                       tp_group=st.tp_group, sampling=sampling, keep_logits=True,
                       max_positions=cfg.seq_len)
        out.append(dict(tokens=res.tokens, logits=torch.stack(res.logits),
                        bytes_recv=res.cache.stats.bytes_recv, calls=res.cache.stats.calls,
                        kv_bytes=res.cache.nbytes(), filled=res.cache.filled))
    return out


def _cases():
    cases = [(tp, 1, "contiguous", "gqa", SamplingParams()) for tp in (1, 2)]
    cases += [(tp, cp, layout, "gqa", SamplingParams()) for cp in (2, 4) for tp in (1, 2)
              for layout in ("zigzag", "striped", "contiguous")]
    cases += [(2, 2, "zigzag", "mqa", SamplingParams()), (2, 2, "striped", "gqa", SAMPLED),
              (2, 2, "zigzag", "fields", SamplingParams()),
              (1, 4, "zigzag", "mqa", SAMPLED)]
    cases += [(1, 1, "contiguous", "kinds", SamplingParams()),
              (2, 2, "zigzag", "kinds", SamplingParams()), (1, 4, "striped", "kinds", SAMPLED)]
    return cases


def test_generation_matches_single_process_for_every_layout():
    cases = _cases()
    refs = {}
    for _, _, _, name, sampling in cases:
        if (name, sampling) not in refs:
            model = GPT(CONFIGS[name], options=ModelOptions(seed=SEED)).eval()
            refs[name, sampling] = reference_generate(model, PROMPTS, NEW, sampling)
    results = run_distributed(_generate_cases, 8, cases, timeout=600)
    B = len(PROMPTS)
    for rank, per_case in enumerate(results):
        for (tp, cp, layout, name, sampling), got in zip(cases, per_case):
            where = f"rank {rank} tp{tp} cp{cp} {layout} {name} greedy={sampling.greedy}"
            tokens, logits = refs[name, sampling]
            assert got["tokens"] == tokens, where
            torch.testing.assert_close(got["logits"], logits, **TOL, msg=where)
            # The merge: one all_gather per layer and decode step (NEW - 1 steps).
            cfg = CONFIGS[name]
            L, heads, hd = cfg.n_layers, cfg.n_heads // tp, resolved_head_dim(cfg)
            assert got["calls"] == (L * (NEW - 1) if cp > 1 else 0), where
            assert got["bytes_recv"] == (NEW - 1) * decode_bytes_per_step(
                L, B, heads, hd, cp), where
            # The cache: T_pad/cp prompt slots + this rank's share of the NEW - 1 decoded
            # tokens; balanced within one slot. T_pad = 22 rounded up to P (2P zigzag).
            chunks = 2 * cp if layout == "zigzag" else cp
            t_pad = math.ceil(22 / chunks) * chunks
            assert sorted(got["filled"]) == sorted(
                t_pad // cp + (NEW - 1) // cp + (r < (NEW - 1) % cp) for r in range(cp)), where
            n_kv = cfg.n_kv_heads // tp if cfg.n_kv_heads % tp == 0 else 1
            assert got["kv_bytes"] == 2 * L * B * decode_capacity(t_pad, NEW - 1, cp) \
                * n_kv * hd * 4, where


@pytest.mark.quick
def test_partial_attention_merged_over_splits_is_full_attention():
    # The decode maths without processes: the keys split into 3 uneven shards with
    # invalid (padding) slots, one shard holding no valid key of row 1, merged in order.
    g = torch.Generator().manual_seed(0)
    B, S, H, Hkv, D = 2, 11, 4, 2, 8
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[1, 7:] = False
    valid[:, 0] = True
    scale = D ** -0.5
    kf, vf = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    s = torch.einsum("bhd,bshd->bhs", q[:, 0], kf) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    want = torch.einsum("bhs,bshd->bhd", s.softmax(-1), vf)                 # (B, H, D)
    out, lse = torch.zeros(B, 1, H, D), torch.full((B, H, 1), float("-inf"))
    for sl in (slice(0, 4), slice(4, 7), slice(7, S)):
        o, l = partial_attention(q, k[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2),
                                 valid[:, sl], scale)
        assert torch.isfinite(o).all()
        merge_block_(out, lse, o, l)
    torch.testing.assert_close(out[:, 0], want, rtol=1e-5, atol=1e-6)  # fp32, 3 merges
    torch.testing.assert_close(lse[..., 0], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-6)
    # one rank: no collective, the partial is the answer
    assert merge_partials(out, lse, None) is out


@pytest.mark.quick
def test_absorbed_latent_decode_is_the_expanded_cache():
    # MLA's decode step with kv_b_proj absorbed (latent_decode.py) against the same step on
    # the expanded K,V (what transformers' DeepseekV3Attention caches); both run their
    # attention in fp32 (partial_attention), so the reassociated sums agree to fp32's
    # rounding; padding slots, and a row without a valid key here (out 0, lse -inf).
    from ctxpar.context_parallel.latent import LatentDims, expand_latent
    from ctxpar.inference.latent_decode import absorbed_partial_attention
    g = torch.Generator().manual_seed(0)
    dims, B, S, H = LatentDims(16, 8, 4, 6), 3, 9, 4
    q = torch.randn(B, 1, H, dims.qk_head_dim, generator=g, dtype=torch.float64)
    latent = torch.randn(B, S, dims.latent_dim, generator=g, dtype=torch.float64)
    w = torch.randn(H * dims.kv_b_rows_per_head, dims.kv_lora_rank, generator=g,
                    dtype=torch.float64)
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[2] = False
    scale = dims.qk_head_dim ** -0.5
    k, v = expand_latent(latent, w, dims)
    want, want_lse = partial_attention(q, k.transpose(1, 2), v.transpose(1, 2), valid, scale)
    got, lse = absorbed_partial_attention(q, latent, w, dims, valid, scale)
    assert got.shape == (B, 1, H, dims.v_head_dim) and (got[2] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def test_eos_stops_a_row_and_batch_rows_are_independent():
    model = GPT(CONFIGS["gqa"], options=ModelOptions(seed=SEED)).eval()
    tokens, _ = reference_generate(model, PROMPTS, NEW)
    eos = tokens[1][2]  # row 1 stops before its third token
    out = generate(model, PROMPTS, NEW, eos_id=eos)
    for row, want in zip(out.tokens, tokens):
        assert row == (want[:want.index(eos)] if eos in want else want)
    # a single prompt alone gives the same tokens as inside the batch
    assert generate(model, PROMPTS[2:], NEW).tokens[0] == tokens[2]


def test_sampling_filters_and_seeds():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = logits.softmax(-1)[0]
    kept = torch.isfinite(filter_logits(logits, top_k=2))[0]
    assert kept.tolist() == [True, True, False, False, False]
    # nucleus: keep while the mass before a token is < top_p; the top token always stays
    cum = torch.cumsum(p, 0) - p
    for top_p in (0.05, float(p[0]) + 1e-3, 0.9, 0.999):
        kept = torch.isfinite(filter_logits(logits, top_p=top_p))[0]
        assert kept.tolist() == (cum < top_p).tolist(), top_p
    # top-k 1 is greedy; a seed fixes the draws; temperature -> 0 tends to greedy
    big = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_k=1, seed=3)
    assert sample(big, params, params.generator()).tolist() == big.argmax(-1).tolist()
    params = SamplingParams(temperature=0.7, top_p=0.8, seed=3)
    a = [sample(big, params, g).tolist() for g in [params.generator()] * 5]
    b = [sample(big, params, g).tolist() for g in [params.generator()] * 5]
    assert a == b
    # the draws follow softmax(logits / T): 4000 draws, each frequency within 4 sigma
    params = SamplingParams(temperature=2.0, seed=0)
    draws = sample(logits.expand(4000, -1), params, params.generator())
    want = (logits[0] / 2.0).softmax(-1)
    freq = torch.bincount(draws, minlength=5).double() / 4000
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / 4000).sqrt() + 1e-9).all()


@pytest.mark.parametrize("kw,msg", [
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[list(range(60))], new=6), "prompt 0 has 60 tokens; with "
                                             "--max-new-tokens=6 it needs 65 positions"),
    (dict(prompts=[[1, 300]]), "token id 300 >= model.vocab_size=256"),
    (dict(new=0), "--max-new-tokens=0 must be >= 1"),
])
def test_bad_prompts_are_refused_with_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("-", "\\-").replace(".", "\\.")) as e:
        check_prompts(kw.get("prompts", [[1]]), kw.get("new", 4), 64, 256)
    assert "\n" not in str(e.value)
    for bad in (SamplingParams(temperature=-1), SamplingParams(top_k=-2),
                SamplingParams(top_p=0.0)):
        with pytest.raises(ValueError):
            bad.check()
