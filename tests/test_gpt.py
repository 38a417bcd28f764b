"""The GPT under TP x CP x DP equals the single-process model on the same global batch.

Layers of checks: (1) the tp=cp=1 model against an independent naive implementation
(RoPE, causal GQA, the MLP) and the checkpointing modes against each other, in-process;
(2) meta builds of 1.3B/7B shapes and config errors, no processes; (3) layout parity:
for (tp, cp, dp), layouts and CP communication patterns (ring, all-gather, Ulysses,
hybrid), gathered logits, the token-mean loss, every gradient (gathered to full size
after the DeepSpeed-style reduction: sum over CP, mean over DP) and the parameters after
one SGD step equal the reference computed here in the parent process, and the CP
communication calls show that no checkpointing mode but full/every_n_layers replays any.
One spawn per world size; the cases loop inside it.
"""
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F

from ctxpar import ring_stats
from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.mla import MLAConfig
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.testing import run_distributed
from ctxpar.testing.attention import comm_ops_per_layer
from models.gpt import GPT
from models.loss import global_mean_loss, global_token_count, loss_for_backward
from models.options import ModelGroups, ModelOptions

from tools.benchmarks.bench_activation_memory import measure

CONFIGS = {
    # GQA, SwiGLU, RMSNorm, untied head; kv=2 splits over tp=2.
    "gqa": ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                       n_kv_heads=2, mlp="swiglu", norm="rmsnorm", tie_embeddings=False),
    # MQA (kv=1 is replicated over tp=2), GELU, LayerNorm, tied head, biases everywhere.
    "mqa": ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                       n_kv_heads=1, mlp="gelu", norm="layernorm", tie_embeddings=True,
                       bias=True),
    # The fields Hugging Face families map onto (Qwen2's q/k/v biases, Qwen3/Gemma's
    # per-head q/k norms and head_dim != d_model/n_heads, Gemma's (1 + w) norms, norms
    # after attention and MLP, sqrt(d) embedding, GeGLU, softmax scale, YaRN).
    "fields": ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                          n_kv_heads=2, head_dim=24, attention_bias=True, qk_norm=True,
                          norm_offset=1.0, post_norms=True, scale_embeddings=True,
                          mlp="geglu", ffn_hidden=96, query_pre_attn_scalar=20.0,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 16},
                          tie_embeddings=False),
}
# The same with one kv head, replicated over tp2: its bias and k norm on every rank.
CONFIGS["fields_mqa"] = dataclasses.replace(CONFIGS["fields"], n_kv_heads=1,
                                            tie_embeddings=True)
# Qwen3.5's and Qwen3-Next's full attention: q_proj's rows per head [q | gate], the output
# times sigmoid(gate), RoPE on a quarter of each head (4 of 16 channels), (1 + w) q/k norms.
CONFIGS["gated"] = ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                               n_kv_heads=2, head_dim=16, qk_norm=True, norm_offset=1.0,
                               attention_output_gate=True, partial_rotary_factor=0.25,
                               tie_embeddings=False)
# DeepSeek-V3's multi-head latent attention (models/mla.py): q through a rank-24 bottleneck,
# a latent of 16 + a shared RoPE key of 8 on the wire, value heads (12) narrower than the
# qk heads (16), interleaved RoPE, YaRN's mscale in the softmax scale; and V2-Lite's form
# (q_proj, rotate-half)
CONFIGS["mla"] = ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                             mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                           qk_rope_head_dim=8, v_head_dim=12),
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                           "mscale_all_dim": 0.8,
                                           "original_max_position_embeddings": 16},
                             tie_embeddings=False)
CONFIGS["mla_lite"] = dataclasses.replace(
    CONFIGS["mla"], rope_scaling=None,
    mla=MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=12, rope_interleave=False))
# MiMo-V2-Flash's attention: a full layer with one K/V head (replicated over tp2 and
# Ulysses' 2 ranks), a sliding one with two (split) and sinks; q/k heads of 24, value heads
# of 16 (V zero-padded on the wire) scaled by 0.7; RoPE on a third of each head, its own
# base on the sliding layer; the window (20) crosses the CP ranks' boundaries
CONFIGS["mimo"] = ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                              n_kv_heads=1, head_dim=24, v_head_dim=16,
                              layer_types=["full_attention", "sliding_attention"],
                              sliding_window=20, layer_kv_heads={"sliding_attention": 2},
                              attention_sinks=["sliding_attention"], attention_value_scale=0.7,
                              partial_rotary_factor=1 / 3, attention_bias=True,
                              layer_rope={"sliding_attention": {"rope_theta": 100.0}},
                              tie_embeddings=False)
BATCH, LR, SEED = 4, 0.1, 7  # global batch (split over dp), SGD step, init seed
# fp32 everywhere; the parallel model sums the same terms in another order (TP partial
# products all-reduced, per-block softmax merged by LSE across the ring, gradients summed
# over CP and DP), so values agree to ~1e-6 relative (measured on the world-4 cases:
# gradient errors <= 1.2e-6 of each tensor's max, <= 1.2e-7 absolute): rtol 1e-5, and
# atol 1e-6 for entries near zero (typical gradient entries are 1e-4..1e-1).
TOL = dict(rtol=1e-5, atol=1e-6)


def make_batch(cfg, cp, layout, ulysses=1):
    """A global batch; with cp > 1 every label held by CP rank 0 is ignored (a shard with
    no counted token), plus ~20% ignored at random everywhere."""
    g = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    if cp > 1:
        labels[:, rank_positions(cfg.seq_len, 0, cp, layout, ulysses=ulysses)] = -100
    return tokens, labels


def reference(cfg, tokens, labels):
    """Single process: logits, token-mean loss, gradients, parameters after one SGD step."""
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    positions = torch.arange(cfg.seq_len)
    logits = model(tokens, positions).detach()
    loss = model(tokens, positions, labels) / (labels != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logits, loss.detach(), grads, params


def _parity(rank, world, payload):
    """Run each case on this rank; return what it gathered (compared in the parent, where
    assert_close's torch.distributed.tensor import is paid once, not once per rank)."""
    from ctxpar import (cp_stats, gather_sequence, init_parallel_state, sequence_positions,
                        shard_sequence)
    from ctxpar.tensor_parallel import gather_from_tensor_model_parallel_region, gather_full_state_dict
    from models.loss import deepspeed_style_reduce_, loss_for_backward

    out = []
    for (tp, cp, dp, layout, name, ckpt, comm, u), tokens, labels in pickle.loads(payload):
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=tp, cp=cp, dp=dp, ulysses=u)
        model = GPT(cfg,
                    ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group,
                                ulysses_group=st.ulysses_group, ring_group=st.ring_group),
                    ModelOptions(layout=layout, cp_comm=comm, activation_checkpointing=ckpt,
                                 every_n_layers=2, seed=SEED))
        rows = slice(st.dp_rank * BATCH // dp, (st.dp_rank + 1) * BATCH // dp)  # this DP rank's samples
        tok = shard_sequence(tokens[rows], 1, st.cp_group, layout, u)  # (B/dp, T/cp)
        lab = shard_sequence(labels[rows], 1, st.cp_group, layout, u)
        pos = sequence_positions(cfg.seq_len, st.cp_group, layout, ulysses=u)  # (T/cp,) global

        with torch.no_grad():
            logits = model(tok, pos)  # (B/dp, T/cp, V/tp)
            logits = gather_from_tensor_model_parallel_region(logits, st.tp_group)
            logits = gather_sequence(logits, 1, st.cp_group, layout, u)  # (B/dp, T, V)

        n_tokens = global_token_count(lab, st.dp_cp_group)
        with cp_stats() as calls:  # CP communication of one training forward + backward
            loss_sum = model(tok, pos, lab)
            loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
        deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
        mean = global_mean_loss(loss_sum, n_tokens, st.dp_cp_group)
        grads = gather_full_state_dict(model, st.tp_group, grads=True)
        torch.optim.SGD(model.parameters(), lr=LR).step()
        params = gather_full_state_dict(model, st.tp_group)
        out.append(dict(rows=rows, logits=logits, loss=mean, grads=grads, params=params,
                        calls=calls.as_dict()))
    return out


CASES = {  # world size -> (tp, cp, dp, layout, config, activation checkpointing, cp_comm, u)
    1: [(1, 1, 1, "zigzag", "gqa", "none", "ring", 1)],
    2: [(2, 1, 1, "zigzag", "gqa", "selective", "ring", 1),
        (2, 1, 1, "zigzag", "fields", "selective", "ring", 1),
        (2, 1, 1, "striped", "fields_mqa", "none", "ring", 1),
        (2, 1, 1, "striped", "mqa", "none", "ring", 1),
        (1, 2, 1, "zigzag", "gqa", "full", "ring", 1),
        (1, 2, 1, "striped", "gqa", "none", "ring", 1),
        (1, 2, 1, "zigzag", "mqa", "selective", "ulysses", 2),  # kv 1 replicated to 2
        (1, 2, 1, "contiguous", "gqa", "full", "allgather", 1),
        (2, 1, 1, "zigzag", "gated", "selective", "ring", 1),  # the gate split with its heads
        (1, 2, 1, "zigzag", "gated", "none", "ulysses", 2),
        (2, 1, 1, "zigzag", "mla", "selective", "ring", 1),  # heads split, latent f
        (1, 2, 1, "zigzag", "mla", "none", "ring", 1),  # the latent on the ring
        (1, 2, 1, "striped", "mla_lite", "full", "ulysses", 2),
        (1, 2, 1, "contiguous", "mla", "selective", "allgather", 1),
        (1, 2, 1, "zigzag", "mimo", "selective", "ring", 1),  # per-type K/V heads, v 16
        (1, 2, 1, "zigzag", "mimo", "none", "ulysses", 2)],
    4: [(1, 4, 1, "zigzag", "gqa", "none", "ring", 1),
        (1, 4, 1, "striped", "gqa", "every_n_layers", "ring", 1),
        (2, 2, 1, "zigzag", "gqa", "none", "ring", 1),
        (2, 2, 1, "striped", "fields", "none", "ring", 1),
        (2, 2, 1, "striped", "mqa", "selective", "ring", 1),
        (1, 2, 2, "zigzag", "gqa", "selective", "ring", 1),
        (1, 2, 2, "striped", "gqa", "full", "ring", 1),
        (1, 4, 1, "striped", "gqa", "selective", "hybrid", 2),  # two-level striped layout
        (1, 4, 1, "zigzag", "gqa", "every_n_layers", "ulysses", 4),
        (2, 2, 1, "striped", "mqa", "selective", "allgather", 1),
        (1, 2, 2, "zigzag", "mqa", "full", "hybrid", 2),  # u = cp: Ulysses via hybrid
        (2, 2, 1, "striped", "gated", "full", "ring", 1),
        (2, 2, 1, "zigzag", "mla", "selective", "ring", 1),
        (1, 4, 1, "striped", "mla_lite", "none", "hybrid", 2),
        (2, 2, 1, "zigzag", "mimo", "selective", "ring", 1)],
    8: [(2, 2, 2, "zigzag", "gqa", "full", "ring", 1),
        (2, 2, 2, "striped", "mqa", "none", "ring", 1),
        (2, 4, 1, "zigzag", "gqa", "selective", "hybrid", 2)],  # tp2 x (u2 x r2)
}


def replayed_layers(ckpt, n_layers):
    """Blocks whose forward (and its CP communication) runs again in backward."""
    return {"full": n_layers, "every_n_layers": (n_layers + 1) // 2}.get(ckpt, 0)


# the quick tier runs the 2-rank worlds: every pattern once (make test-quick < 90 s)
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.quick) if w == 2 else w
                                   for w in sorted(CASES)])
def test_layout_parity_with_single_process(world):
    cases, refs = [], []
    for case in CASES[world]:
        tp, cp, dp, layout, name, _, _, u = case
        tokens, labels = make_batch(CONFIGS[name], cp, layout, u)
        cases.append((case, tokens, labels))
        refs.append(reference(CONFIGS[name], tokens, labels))
    # Plain pickle bytes: multiprocessing would send each tensor as a shared-memory fd.
    results = run_distributed(_parity, world, pickle.dumps(cases), timeout=240)
    for rank, per_case in enumerate(results):  # every rank, so replicas must agree too
        for (case, _, _), (logits, loss, grads, params), got in zip(cases, refs, per_case):
            where = "rank {} tp{} cp{} dp{} {} {} ckpt={} {} u={}".format(rank, *case)
            tp, cp, dp, layout, name, ckpt, comm, u = case
            # Communication calls: each layer's forward once, plus the replayed blocks of
            # full / every_n_layers checkpointing; selective never replays any.
            n = CONFIGS[name].n_layers
            fwd, bwd = comm_ops_per_layer(comm, cp, u, latent=CONFIGS[name].mla is not None)
            assert (got["calls"]["fwd_comm_ops"], got["calls"]["bwd_comm_ops"]) == \
                ((n + replayed_layers(ckpt, n)) * fwd, n * bwd), (where, got["calls"])
            torch.testing.assert_close(got["logits"], logits[got["rows"]], **TOL, msg=where)
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            for n in grads:
                torch.testing.assert_close(got["grads"][n], grads[n], **TOL, msg=f"{where} grad {n}")
                torch.testing.assert_close(got["params"][n], params[n], **TOL,
                                           msg=f"{where} param {n}")


@pytest.mark.quick
def test_loss_for_backward_with_gradient_accumulation():
    # Two micro-batches with different token counts; DeepSpeed divides each backward by
    # gas and sums: the result must be the gradient of the mean over all tokens of the step.
    cfg = CONFIGS["gqa"]
    tokens, labels = make_batch(cfg, 1, "contiguous")
    labels[:2, : cfg.seq_len // 2] = -100  # the first micro-batch counts fewer tokens
    positions, gas = torch.arange(cfg.seq_len), 2
    ref = GPT(cfg, options=ModelOptions(seed=SEED))
    (ref(tokens, positions, labels) / (labels != -100).sum()).backward()
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    n_tokens = sum(global_token_count(lab) for lab in labels.chunk(gas))
    for tok, lab in zip(tokens.chunk(gas), labels.chunk(gas)):
        loss = loss_for_backward(model(tok, positions, lab), n_tokens, divisor=1,
                                 grad_accum_steps=gas)
        (loss / gas).backward()  # engine.backward's scale_wrt_gas
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)  # fp32, summed in 2 parts


def naive_gpt(cfg, sd, tokens):
    """The same maths written plainly from the full state dict (no ctxpar code)."""
    B, T = tokens.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.d_model // cfg.n_heads
    ang = torch.arange(T)[:, None] * cfg.rope_theta ** (-torch.arange(0, hd, 2) / hd)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (T, 1, hd/2)

    def rope(x):
        a, b = x.chunk(2, -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(x, p):
        if cfg.norm == "rmsnorm":
            return F.rms_norm(x, (cfg.d_model,), sd[p + ".weight"], cfg.norm_eps)
        return F.layer_norm(x, (cfg.d_model,), sd[p + ".weight"], sd.get(p + ".bias"), cfg.norm_eps)

    def lin(x, p):
        return F.linear(x, sd[p + ".weight"], sd.get(p + ".bias"))

    x = sd["embed.weight"][tokens]
    for i in range(cfg.n_layers):
        L = f"layers.{i}."
        h = norm(x, L + "attn_norm")
        q = rope(lin(h, L + "attn.q_proj").view(B, T, nh, hd)).transpose(1, 2)
        k = rope(lin(h, L + "attn.k_proj").view(B, T, nkv, hd)).transpose(1, 2)
        v = lin(h, L + "attn.v_proj").view(B, T, nkv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + lin(o.transpose(1, 2).reshape(B, T, -1), L + "attn.o_proj")
        h = norm(x, L + "mlp_norm")
        if cfg.mlp == "swiglu":
            h = F.silu(lin(h, L + "mlp.gate_proj")) * lin(h, L + "mlp.up_proj")
        else:
            h = F.gelu(lin(h, L + "mlp.up_proj"), approximate="tanh")
        x = x + lin(h, L + "mlp.down_proj")
    x = norm(x, "final_norm")
    return F.linear(x, sd["embed.weight" if cfg.tie_embeddings else "lm_head.weight"])


@pytest.mark.quick
# The naive model writes out the plain GPT (the families' fields are held to transformers'
# own models in tests/test_hf.py).
@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_model_matches_naive_implementation(name):
    cfg = CONFIGS[name]
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens, labels = make_batch(cfg, 1, "contiguous")
    sd = {n: p.detach() for n, p in model.named_parameters()}
    want = naive_gpt(cfg, sd, tokens)
    torch.testing.assert_close(model(tokens, torch.arange(cfg.seq_len)), want, **TOL)
    loss = model(tokens, torch.arange(cfg.seq_len), labels) / (labels != -100).sum()
    ref = F.cross_entropy(want.transpose(1, 2), labels, ignore_index=-100)
    torch.testing.assert_close(loss, ref, **TOL)


def test_checkpointing_modes_same_gradients_less_memory():
    cfg = CONFIGS["gqa"]
    tokens, labels = make_batch(cfg, 1, "contiguous")
    grads, ring_calls = {}, {}
    for mode in ("none", "selective", "full", "every_n_layers"):
        model = GPT(cfg,
                    options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                         seed=SEED))
        with ring_stats() as st:  # counts attention kernel calls, forward and backward
            model(tokens, torch.arange(cfg.seq_len), labels).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
        ring_calls[mode] = st.fwd_blocks
    # Selective keeps the attention core's saved tensors: the ring is never replayed;
    # full replays every block's ring in backward, every_n_layers=2 one of the two layers.
    n = cfg.n_layers
    assert ring_calls == {"none": n, "selective": n, "full": 2 * n, "every_n_layers": n + 1}
    for mode in ("selective", "full", "every_n_layers"):
        for n, g in grads["none"].items():
            # The replay runs the same kernels on the same inputs: equal up to rounding
            # that could only come from alignment-dependent SIMD paths (none seen on CPU).
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-6, atol=1e-7, msg=f"{mode} {n}")
    saved = {m: measure(cfg, m, batch=2) for m in ("none", "selective", "full", "every_n_layers")}
    assert saved["none"] > saved["every_n_layers"] > saved["full"], saved
    assert saved["none"] > saved["selective"] > saved["full"], saved


def test_gated_attention_equals_transformers_qwen3_5():
    """Attention under model.attention_output_gate and partial_rotary_factor against
    transformers' Qwen3_5Attention on the same weights (q_proj's rows [q | gate] per head,
    RoPE on the first quarter of each head, (1 + w) q/k norms): output and every
    gradient, fp32."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5Attention,
                                                              Qwen3_5TextRotaryEmbedding)
    from models.rope import layer_rotary
    from ctxpar.config import rotary_dim

    cfg, T = CONFIGS["gated"], 32
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    ours = model.layers[0].attn
    hf = Qwen3_5TextConfig(hidden_size=cfg.d_model, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=cfg.norm_eps, num_hidden_layers=1,
                           layer_types=["full_attention"],
                           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                            "partial_rotary_factor": 0.25,
                                            "mrope_section": [1, 1, 0],
                                            "mrope_interleaved": True})
    hf._attn_implementation = "eager"
    theirs = Qwen3_5Attention(hf, 0)
    with torch.no_grad():  # away from init's zeros: the (1 + w) norms' weights count
        for p in (ours.q_norm.weight, ours.k_norm.weight):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    theirs.load_state_dict({n: p.detach().clone() for n, p in ours.named_parameters()})
    x = torch.randn(2, T, cfg.d_model, generator=torch.Generator().manual_seed(0))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = layer_rotary(torch.arange(T), rotary_dim(cfg), model.layer_attention)[0]
    q, k, v, gate = ours.qkv(x1, cos, sin)
    y_ours = ours.out(ours.core(q, k, v), gate)
    # text positions: Qwen3.5's three M-RoPE sections all read the same position
    pe = Qwen3_5TextRotaryEmbedding(hf)(x2, torch.arange(T)[None].expand(3, 1, T))
    y_theirs, _ = theirs(x2, pe, torch.full((T, T), float("-inf")).triu(1)[None, None])
    dy = torch.randn(y_ours.shape, generator=torch.Generator().manual_seed(2))
    (y_ours * dy).sum().backward()
    (y_theirs * dy).sum().backward()
    torch.testing.assert_close(y_ours, y_theirs, **TOL)
    torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **TOL, msg=name)


@pytest.mark.parametrize("name", ["gated", "mla"])
def test_the_kv_cache_generates_what_full_forwards_choose(name):
    """The KV cache's decode path gates each step's attention output as training does;
    an MLA layer's cache keeps the latent and expands it per step with kv_b_proj."""
    from ctxpar.inference import KVCache, generate
    from ctxpar.testing.generation import reference_generate

    model = GPT(CONFIGS[name], options=ModelOptions(seed=SEED)).eval()
    prompts = [[3, 9, 27, 81, 115], [5, 7, 11, 13, 17, 19, 23, 29, 31]]
    want, _ = reference_generate(model, prompts, 6)
    assert generate(model, prompts, 6).tokens == want
    if name == "mla":  # 24 numbers a token a layer, not 4 heads x (16 + 12)
        cache = KVCache.for_model(model, 2, 10)
        assert cache.nbytes() == 2 * 2 * 10 * 24 * 4 and cache.keys == []


@pytest.mark.parametrize("shape,want", [
    # Llama-2-7B: 32 x (4*4096^2 + 3*4096*11008 + 2*4096) + 2*32000*4096 + 4096, untied.
    (dict(vocab_size=32000, n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008,
          tie_embeddings=False), 6_738_415_616),
    # GPT-3 XL-like 1.3B: 24 layers, d 2048, gelu 4x, tied 50304 vocab, biases, layernorm.
    (dict(vocab_size=50304, n_layers=24, d_model=2048, n_heads=16, mlp="gelu",
          norm="layernorm", bias=True, tie_embeddings=True),
     24 * (4 * 2048**2 + 4 * 2048 + 2 * 2048 * 8192 + 8192 + 2048 + 4 * 2048)
     + 50304 * 2048 + 2 * 2048),
])
def test_big_configs_build_on_meta(shape, want):
    model = GPT(ModelConfig(seq_len=4096, **shape), device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    assert sum(p.numel() for p in model.parameters()) == want


@pytest.mark.parametrize("model,parallel,key", [
    (dict(n_heads=6, d_model=96, n_kv_heads=6), dict(tp=4), "model.n_heads=6"),
    (dict(n_heads=5, d_model=64), dict(tp=1), "model.d_model=64"),
    (dict(n_heads=8, d_model=64, n_kv_heads=3), dict(tp=1), "model.n_kv_heads=3"),
    (dict(n_heads=8, d_model=64, n_kv_heads=4), dict(tp=8, cp=1), None),  # replicated kv: ok
    (dict(n_heads=12, d_model=96, n_kv_heads=6), dict(tp=4), "model.n_kv_heads=6"),
    (dict(n_heads=4, d_model=64, partial_rotary_factor=0.1), dict(tp=1),
     r"model.partial_rotary_factor=0.1 must be in \(0, 1\] and turn an even number of "
     r"head_dim=16 channels \(it turns 1.6\)"),
    (dict(n_heads=4, d_model=64, partial_rotary_factor=0.0), dict(tp=1),
     "model.partial_rotary_factor=0.0 must be in"),
    # multi-head latent attention: the rope part turns pairs, heads split over TP, every
    # head its own keys
    (dict(n_heads=4, d_model=64, mla=dict(kv_lora_rank=16, qk_rope_head_dim=7)), dict(tp=1),
     r"model.mla.qk_rope_head_dim=7 must be even"),
    (dict(n_heads=6, d_model=96, mla=dict(kv_lora_rank=16)), dict(tp=4), "model.n_heads=6"),
    (dict(n_heads=4, d_model=64, n_kv_heads=2, mla=dict(kv_lora_rank=16)), dict(tp=1),
     r"model.n_kv_heads=2 with model.mla: every MLA head has its own keys"),
    (dict(n_heads=4, d_model=64, mla=dict(kv_lora_rank=0)), dict(tp=1),
     r"model.mla.kv_lora_rank=0 must be an integer >= 1"),
    (dict(n_heads=4, d_model=64, rope=False, mla=dict(kv_lora_rank=16, qk_rope_head_dim=7)),
     dict(tp=1), None),  # NoPE MLA (Kimi Linear's): nothing turns, any width
    (dict(n_heads=4, d_model=64, n_layers=2, nope_layers=[1], mla=dict(kv_lora_rank=16)),
     dict(tp=1), r"model.nope_layers=\[1\] with model.mla: MLA turns every layer's rope"),
    # MiMo-V2-Flash's per-type heads and value width (ctxpar/config/attention_heads.py)
    (dict(n_heads=4, d_model=64, sliding_window=8, layer_kv_heads={"sliding_attention": 3}),
     dict(tp=1), r"model.layer_kv_heads.sliding_attention=3 must be an integer >= 1 "
                 r"dividing model.n_heads=4"),
    (dict(n_heads=8, d_model=64, n_kv_heads=2, sliding_window=8,
          layer_kv_heads={"sliding_attention": 8}), dict(tp=8), None),  # 2 replicated, 8 split
    (dict(n_heads=12, d_model=96, sliding_window=8, layer_kv_heads={"sliding_attention": 6}),
     dict(tp=4), r"model.layer_kv_heads.sliding_attention=6 and parallel.tp=4"),
    (dict(n_heads=4, d_model=64, layer_kv_heads={"linear_attention": 2}), dict(tp=1),
     r"model.layer_kv_heads: unknown layer type 'linear_attention'"),
    (dict(n_heads=4, d_model=64, attention_sinks=["mamba"]), dict(tp=1),
     r"model.attention_sinks=\['mamba'\] must be true, false or a non-empty list"),
    (dict(n_heads=4, d_model=64, v_head_dim=24), dict(tp=1),
     r"model.v_head_dim=24 must be <= head_dim=16"),
    (dict(n_heads=4, d_model=64, v_head_dim=8, attention_output_gate=True), dict(tp=1),
     r"model.v_head_dim=8 with model.attention_output_gate=true"),
    (dict(n_heads=4, d_model=64, attention_sinks=["sliding_attention"]), dict(tp=1),
     r"model.attention_sinks=\['sliding_attention'\] names a layer type no layer is"),
    (dict(n_heads=4, d_model=64, layer_kv_heads={"sliding_attention": 2}), dict(tp=1),
     r"model.layer_kv_heads.sliding_attention is set but no layer is"),
    (dict(n_heads=4, d_model=64, attention_value_scale=0.0), dict(tp=1),
     r"model.attention_value_scale=0.0 must be a number > 0"),
    # MiMo's per-type fields beside Gemma 4's: one count per layer type, V as wide as K
    (dict(n_heads=4, d_model=64, layer_types=["full_attention", "sliding_attention"],
          n_layers=2, sliding_window=8, global_n_kv_heads=1, query_pre_attn_scalar=1.0,
          layer_kv_heads={"full_attention": 2}), dict(tp=1),
     r"model.layer_kv_heads.full_attention=2 with model.global_n_kv_heads=1"),
    (dict(n_heads=4, d_model=64, v_head_dim=8, attention_k_eq_v=True,
          layer_types=["full_attention"], n_layers=1), dict(tp=1),
     r"model.v_head_dim=8 with Gemma 4's attention_k_eq_v"),
])
def test_bad_model_configs_fail_at_load(model, parallel, key):
    data = {"model": dict(vocab_size=256, seq_len=256, **model), "parallel": parallel}
    if key is None:
        config_from_dict(data)
        return
    with pytest.raises(ConfigError, match=key):
        config_from_dict(data)
