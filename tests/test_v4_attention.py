"""DeepSeek-V4's attention as the GPT's token mixer (models/compressed_attention.py,
model.compressed_attention): each layer type ('sliding_attention',
'compressed_sparse_attention', 'heavily_compressed_attention') equals transformers' own
DeepseekV4Attention on the same weights (the output, the hidden states' gradient and every
weight's: projections, norms, sinks, the compressor's; the indexer's none in either); the
GPT with the three types equals one process at cp2 (ring zigzag, ring contiguous,
all-gather; zigzag with packed documents) and tp2 x cp2 in one spawned world of four
ranks; what is not built is refused at load in one line. transformers is imported where used: the spawned ranks
import this file and need none of it.

Tolerances (fp32): as tests/test_csa_attention.py's, 1e-5 relative and absolute against
the tensor's largest entry (ctxpar.testing.compressed.close): transformers does one
softmax over [window ; entries ; sink], ctxpar merges blocks by log-sum-exp and sums
gradient shares across ranks and TP; the GPT's layouts as tests/test_dsa_model.py's. The
indexer's heads come in +/- pairs so that no two scores of a row tie (torch.topk orders
ties arbitrarily).
"""
import pytest
import torch
from ctxpar.config import ConfigError, ModelConfig, config_from_dict, rotary_dim
from ctxpar.config.compressed_attention import CompressedAttentionConfig
from ctxpar.config.layers import layer_attention
from ctxpar.context_parallel import ContextParallel
from ctxpar.testing.compressed import close
from models.compressed_attention import CompressedAttention
from models.options import LayerArgs
from models.rope import layer_rotary

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
B, N, HIDDEN, H, D, WINDOW = 2, 24, 16, 4, 8, 5
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
SECTION = dict(q_lora_rank=8, o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=8,
               index_topk=3, compress_rates=RATES)


def hf_layer(kind: str, seed: int = 0):
    """transformers' attention of one layer of `kind` (random weights, the indexer's heads
    in +/- pairs); RoPE on half of each head, the two bases apart."""
    from tests.helpers.v4_attention import tiny_v4_attention
    torch.manual_seed(seed)
    return tiny_v4_attention(kind, hidden=HIDDEN, head_dim=D, heads=H, window=WINDOW,
                             rates=RATES, index_heads=2, index_dim=8, topk=3)


def model_config(kinds, **over) -> ModelConfig:
    """ctxpar's model of the same shapes: V4's compress base on the compressed types."""
    compress = {k: {"rope_theta": 160000.0} for k in set(kinds) if k != "sliding_attention"}
    fields = dict(vocab_size=64, seq_len=N, n_layers=len(kinds), d_model=HIDDEN, n_heads=H,
                  n_kv_heads=1, head_dim=D, partial_rotary_factor=0.5, sliding_window=WINDOW,
                  layer_types=list(kinds), layer_rope=compress or None, norm_eps=1e-6,
                  compressed_attention=CompressedAttentionConfig(**SECTION))
    return ModelConfig(**{**fields, **over})


def reference(attn, hidden, dout):
    """transformers: the output and the gradients of the hidden states and every weight."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    n = hidden.shape[1]
    pos = torch.arange(n)[None].expand(B, -1)
    rotary = hf.DeepseekV4RotaryEmbedding(attn.config)
    embeddings = {kind: rotary(hidden, position_ids=pos, layer_type=kind)
                  for kind in ("main", "compress")}
    i = torch.arange(n)
    seen = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
    mask = torch.zeros(n, n).masked_fill(~seen, float("-inf")).expand(B, 1, n, n)
    out, _ = attn(hidden, embeddings, pos, mask)
    return out, torch.autograd.grad(out, [hidden, *attn.parameters()], dout, allow_unused=True)


def ours(kind, attn, hidden, dout):
    """models/compressed_attention.py with transformers' weights, through the Block's three
    steps and the GPT's rotary."""
    m = model_config([kind])
    layer = layer_attention(m)[0]
    mixer = CompressedAttention.from_layer(LayerArgs(m, layer, ContextParallel(),
                                                     backend="math"))
    mixer.load_state_dict(attn.state_dict())  # transformers' names, strict
    cos, sin = layer_rotary(torch.arange(hidden.shape[1]), rotary_dim(m), [layer])[0]
    inputs, carry = mixer.project_in(hidden, cos, sin)
    out = mixer.project_out(mixer.mix(inputs), *carry)
    params = dict(mixer.named_parameters())
    names = [n for n, _ in attn.named_parameters()]
    grads = torch.autograd.grad(out, [hidden] + [params[n] for n in names], dout,
                                allow_unused=True)
    return out, grads, names


@pytest.mark.quick
@pytest.mark.parametrize("kind", KINDS)
def test_each_v4_layer_type_equals_transformers_attention(kind):
    attn = hf_layer(kind)
    hidden = torch.randn(B, N, HIDDEN, generator=torch.Generator().manual_seed(1))
    dout = torch.randn(B, N, HIDDEN, generator=torch.Generator().manual_seed(2))
    want_out, want = reference(attn, hidden.clone().requires_grad_(), dout)
    out, got, names = ours(kind, attn, hidden.clone().requires_grad_(), dout)
    close(out, want_out)
    for name, g, w in zip(["hidden"] + names, got, want):
        assert (g is None) == (w is None) == (".indexer." in name), name
        if g is not None:
            close(g, w)


# ------------------------------------------------------------ the GPT over CP and TP

V4_KINDS = list(KINDS)
SEQ, SEED = 40, 5  # cp2 zigzag: slabs of 10 tokens, not a multiple of either m
# two packed documents (data.document_mask): the first 13 tokens (3 CSA entries, 1 HCA),
# the second across the zigzag slabs' boundaries (10, 20, 30) and the windows'
DOCS = torch.tensor([0, 13, SEQ], dtype=torch.int32)
GRID = [  # (tp, cp, layout, cp_comm, recompute, documents) on four ranks (dp = 4 / (tp cp))
    (1, 2, "zigzag", "ring", "none", False),
    (1, 2, "contiguous", "ring", "full", False),  # the compressors' collectives replayed
    (1, 2, "zigzag", "allgather", "selective", False),
    (2, 2, "zigzag", "ring", "none", False),    # heads over TP, K = V and indexer replicated
    (1, 2, "zigzag", "ring", "selective", True),  # packed documents
]


def _grid_batch():
    from ctxpar.testing.batches import random_batch
    return random_batch(64, 4, SEQ)


def _grid_reference(documents: bool):
    """One process: the logits, the token-mean loss and every gradient."""
    from models.gpt import GPT
    from models.options import ModelOptions
    model = GPT(model_config(V4_KINDS, seq_len=SEQ), options=ModelOptions(seed=SEED))
    tokens, labels = _grid_batch()
    docs = DOCS if documents else None
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ), cu_seqlens=docs)
    loss = model(tokens, torch.arange(SEQ), labels, cu_seqlens=docs) / (labels != -100).sum()
    loss.backward()
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _grid(rank, world, cases):
    from ctxpar import init_parallel_state
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions
    from tests.helpers.grid_step import grid_step
    out, (tokens, labels) = [], _grid_batch()
    for tp, cp, layout, comm, ckpt, documents in cases:
        docs = DOCS if documents else None
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp))
        model = GPT(model_config(V4_KINDS, seq_len=SEQ), ModelGroups.from_state(st),
                    ModelOptions(layout=layout, cp_comm=comm, activation_checkpointing=ckpt,
                                 seed=SEED))
        rows = slice(st.dp_rank * 4 // st.dp_size, (st.dp_rank + 1) * 4 // st.dp_size)
        step = grid_step(model, st, tokens, labels, rows, layout, docs)
        out.append(dict(step, grads=gather_full_state_dict(model, st.tp_group, grads=True)))
    return out


def test_the_v4_gpt_over_cp_and_tp_equals_one_process():
    """Every layer type, cp2 ring zigzag and contiguous, all-gather, tp2 x cp2, and cp2
    zigzag with packed documents: the logits, the loss and every gradient (the
    compressors', the sinks', the grouped projection's)."""
    from ctxpar.testing import run_distributed
    references = {documents: _grid_reference(documents) for documents in (False, True)}
    # the documents change the attention (the entries and the window restart), and the
    # second equals itself alone at positions from 0 (RoPE is relative; the entries turn
    # at s + w m)
    assert not torch.allclose(references[True][0][:, 13:], references[False][0][:, 13:])
    from models.gpt import GPT
    from models.options import ModelOptions
    alone = GPT(model_config(V4_KINDS, seq_len=SEQ), options=ModelOptions(seed=SEED))
    with torch.no_grad():
        close(references[True][0][:, 13:], alone(_grid_batch()[0][:, 13:],
                                                 torch.arange(SEQ - 13)))
    results = run_distributed(_grid, 4, GRID, timeout=240)
    for rank, per_case in enumerate(results):
        for case, got in zip(GRID, per_case):
            where = f"rank {rank} {case}"
            logits, loss, grads = references[case[-1]]
            close(got["logits"], logits[got["rows"]])
            close(got["loss"], loss)
            assert set(got["grads"]) == set(grads), where
            for n, g in grads.items():
                if ".indexer." in n:  # no gradient reaches the indexer (its top-k)
                    assert g is None and not got["grads"][n].any(), f"{where} {n}"
                else:
                    close(got["grads"][n], g)


# ------------------------------------------------------------ refused at load

def _load(model=None, parallel=None, data=None, training=True):
    m = model_config(KINDS, seq_len=96)
    fields = {f: getattr(m, f) for f in ("vocab_size", "seq_len", "n_layers", "d_model",
                                          "n_heads", "n_kv_heads", "head_dim",
                                          "partial_rotary_factor", "sliding_window",
                                          "layer_types", "layer_rope")}
    fields["compressed_attention"], fields["vocab_size"] = dict(SECTION), 256  # bytes
    data = {"model": {**fields, **(model or {})}, "parallel": parallel or {},
            "data": data or {}}
    return config_from_dict(data, training=training)


@pytest.mark.parametrize("model,parallel,data,msg", [
    (dict(n_kv_heads=2), None, None, r"needs model.n_kv_heads=1 \(one shared K = V head\)"),
    (dict(compressed_attention={**SECTION, "o_groups": 3}), None, None,
     r"model.n_heads=4 must divide into model.compressed_attention.o_groups=3"),
    (dict(compressed_attention={**SECTION, "o_groups": 1}), dict(tp=2), None,
     r"o_groups=1 must divide over parallel.tp=2"),
    (dict(compressed_attention={**SECTION, "compress_rates": {"x": 4}}), None, None,
     r"compress_rates=\{'x': 4\} must map each of"),
    (dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"],
          layer_rope=None), None, None,
     r"with layer types \['full_attention'\]"),
    (dict(compressed_attention=None), None, None,
     r"layers but model.compressed_attention is not set"),
    (dict(qk_norm=True), None, None, r"with model.qk_norm=True: DeepSeek-V4's attention"),
    (None, dict(cp=2, cp_comm="ulysses"), None, r"parallel.cp_comm='ulysses': V4's"),
    (None, dict(cp=2, layout="striped"), None, r"parallel.layout='striped'"),
    (None, dict(cp=8), None, r"leaves slabs of 6 tokens: compressed_sparse_attention's "
                             r"compress rate 4 needs 8"),
    (None, None, dict(reset_positions=True), r"data.reset_positions=true: not built for "
                                             r"V4's layers yet"),
])
def test_what_v4_cannot_run_is_refused_in_one_line(model, parallel, data, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        _load(model, parallel, data)
    assert "\n" not in str(e.value)




# ------------------------------------------------------------ the whole V4 model

LIMIT = 0.5  # V4's swiglu_limit, low enough that the clamps act on these weights

def _v4_pair():
    """transformers' DeepseekV4ForCausalLM (the three layer types, a hash-routed layer, mHC,
    the experts' and shared experts' SwiGLU clamped at LIMIT: within the activations'
    reach) and ctxpar's GPT of the same shapes, on the same random weights and expert
    table; {theirs: ours} names."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from ctxpar.config.hyper_connections import HyperConnectionsConfig
    from ctxpar.config.moe import MoEConfig
    from models.gpt import GPT
    from models.options import ModelOptions
    rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
    theirs = DeepseekV4ForCausalLM(DeepseekV4Config(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=H,
        num_key_value_heads=1, head_dim=D, sliding_window=WINDOW, layer_types=list(KINDS),
        mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates=RATES,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, hc_mult=2,
        swiglu_limit=LIMIT, rope_parameters={"main": {**rope, "rope_theta": 10000.0},
                                           "compress": {**rope, "rope_theta": 160000.0}},
        **{k: v for k, v in SECTION.items() if k != "compress_rates"})).float()
    m = model_config(KINDS, vocab_size=64, tie_embeddings=False, swiglu_limit=LIMIT,
                     hyper_connections=HyperConnectionsConfig(streams=2),
                     moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=12,
                                   score="sqrtsoftplus", routed_scaling_factor=1.5,
                                   shared_expert_hidden=12, score_correction_bias=True,
                                   hash_layers=[0]))
    ours = GPT(m, options=ModelOptions(seed=SEED))
    renames = (("model.embed_tokens.", "embed."), ("model.norm.", "final_norm."),
               ("model.hc_head.hc_", "hc_head."), ("model.layers.", "layers."),
               (".self_attn.", ".attn."), (".input_layernorm.", ".attn_norm."),
               (".post_attention_layernorm.", ".mlp_norm."), (".ffn_hc.", ".mlp_hc."),
               (".shared_experts.", ".shared_expert."))
    names = {}
    for name in theirs.state_dict():
        mine = name
        for a, b in renames:
            mine = mine.replace(a, b)
        names[name] = mine
    g = torch.Generator().manual_seed(3)
    mine = ours.state_dict()
    assert set(names.values()) == set(mine), set(names.values()) ^ set(mine)
    with torch.no_grad():
        for t, o in names.items():
            x = theirs.state_dict()[t]
            if "tid2eid" in t:
                x.copy_(torch.rand(64, 4, generator=g).topk(2).indices)
            else:  # norms and mHC scales away from their init: every term counts
                x.copy_(torch.randn(x.shape, generator=g) * (0.5 if x.dim() == 1 else 0.3)
                        + (1.0 if "norm" in t else 0.0))
            if "indexer.q_b_proj" in t:  # the indexer's heads in +/- pairs: no score ties
                x.view(2, 8, -1)[1::2] = -x.view(2, 8, -1)[0::2]
            mine[o].copy_(x)
    return theirs, ours, names


def test_the_v4_gpt_equals_transformers_deepseek_v4_on_the_same_weights():
    """Logits and every gradient of the token loss: the three layer types, a hash-routed
    and two routed layers (sqrtsoftplus, its correction bias, clamped SwiGLU experts), the
    mHC streams."""
    theirs, ours, names = _v4_pair()
    tokens = torch.randint(0, 64, (B, N), generator=torch.Generator().manual_seed(4))
    want = theirs(input_ids=tokens).logits
    got = ours(tokens, torch.arange(N))
    close(got, want)
    torch.nn.functional.cross_entropy(want.flatten(0, 1), tokens.flatten()).backward()
    (ours(tokens, torch.arange(N), tokens) / tokens.numel()).backward()
    params = dict(ours.named_parameters())
    for t, p in theirs.named_parameters():
        if ".indexer." in t:
            assert p.grad is None and params[names[t]].grad is None, t
        else:
            close(params[names[t]].grad, p.grad)


def test_v4_generation_by_full_forwards_is_transformers_greedy():
    """V4's layers have no decode cache: generate() reruns the sequence a token
    (inference/recompute.py), right-padded rows of unequal prompts included; the tokens
    are transformers' greedy generate's (its own cache) on the same weights."""
    from ctxpar.inference import generate
    theirs, ours, _ = _v4_pair()
    ours.eval()
    prompts = [[5, 9, 2, 33, 7, 1, 40, 12, 3, 8, 19], [4, 4, 60]]
    eos = theirs.config.eos_token_id
    with torch.no_grad():
        got = generate(ours, prompts, 6, eos_id=eos).tokens
        for prompt, tokens in zip(prompts, got):
            want = theirs.generate(torch.tensor([prompt]), max_new_tokens=6,
                                   do_sample=False)[0, len(prompt):].tolist()
            assert tokens == want[:want.index(eos) if eos in want else None], (prompt, want)


def test_v4_models_without_v4s_experts_are_refused_at_export():
    """No family holds V4's attention without its experts (deepseek_v4 is a mixture of
    experts; its folders: tests/test_deepseek_v4_folders.py and test_hf.py)."""
    from ctxpar.checkpoint import CheckpointError, hf
    for kinds in (KINDS, ["sliding_attention"] * 2):
        with pytest.raises(CheckpointError, match=r"no Hugging Face family holds this model"):
            hf.family_config(model_config(kinds))
