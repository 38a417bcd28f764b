"""Hybrid GPTs: Gated DeltaNet (Qwen3.5's 'linear_attention'), KDA (Kimi Linear's
'kimi_delta_attention') and Mamba2 (Nemotron-H's 'mamba') layers beside attention, under CP.

(1) Each mixer against transformers' own module on the same weights (one process, fp32:
outputs and every parameter's gradient); OLMo Hybrid's options as a whole GPT against
OlmoHybridForCausalLM. (2) Four tiny hybrids, Qwen3.5's three linear layers per
full-attention one, a Nemotron-H mamba/attention/mlp pattern, OLMo Hybrid's options
(post-norm attention, q/k norms over all heads, beta in [0, 2]) and Kimi Linear's three
KDA layers per attention one, at cp2 and
cp4 with parallel.linear_cp 'state' (contiguous, zigzag) and 'heads' (striped, zigzag),
and at tp2 x cp2 (the mixers split by heads), with and without packed documents crossing
ranks, under each activation recompute: the loss and every gradient (gathered over TP)
equal the single process's. One spawn per world size, the cases looped inside; in bf16 at
cp2, as close to one bf16 process as bf16 is to fp32. (3) Each refusal's one line.
"""
import pickle

import pytest
import torch

from ctxpar.config import ConfigError, config_from_dict
from ctxpar.testing import run_distributed
from ctxpar.tensor_parallel import gather_full_state_dict
from ctxpar.testing.batches import random_batch
from ctxpar.testing.linear import (HYBRID_CONFIGS, KIMI_LINEAR_CONFIG, OLMO_HYBRID_CONFIG,
                                   documents)
from models.gpt import GPT
from models.loss import global_mean_loss, global_token_count, loss_for_backward
from models.options import ModelGroups, ModelOptions

N, BATCH, SEED = 48, 2, 5  # cp4 zigzag: 12 tokens a rank, two segments of 6
# Qwen3.5's and Nemotron-H's patterns and OLMo Hybrid's options, model.seq_len N
CONFIGS = {**HYBRID_CONFIGS, "olmo-hybrid": OLMO_HYBRID_CONFIG,
           "kimi-linear": KIMI_LINEAR_CONFIG}
# fp32 throughout; CP reorders the sums (summaries composed across ranks, gradients summed
# over CP), so values agree to ~1e-6 relative, as tests/test_gpt.py's layouts do.
TOL = dict(rtol=1e-5, atol=1e-6)


def close(got, want, msg=""):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5, msg=msg)


# ------------------------------------------------------------ the mixers vs transformers

def _compare_module(ours, theirs, x, cu=None):
    """Same weights (names equal: a load is the import, shapes as transformers' views of
    the same values: KDA's A_log), same input: output and every parameter's gradient."""
    shapes = {n: p.shape for n, p in theirs.named_parameters()}
    theirs.load_state_dict({n: p.detach().clone().view(shapes[n])
                            for n, p in ours.named_parameters()})
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x1, cu), theirs(x2)
    dy = torch.randn_like(y_theirs)
    (y_ours * dy).sum().backward()
    (y_theirs * dy).sum().backward()
    close(y_ours, y_theirs, "output")
    close(x1.grad, x2.grad, "input grad")
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        close(p.grad, grads[name].grad.view(p.shape), name)


def _one_layer(name):
    cfg = CONFIGS[name]
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    block = model.layers[0]
    return cfg, getattr(block, {"qwen3.5": "linear_attn", "kimi-linear": "kda"}.get(name,
                                                                                   "mamba"))


@pytest.mark.quick
def test_gated_delta_net_equals_transformers_qwen3_5():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg, ours = _one_layer("qwen3.5")
    hf = Qwen3_5TextConfig(hidden_size=cfg.d_model, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=8,
                           linear_value_head_dim=6, linear_conv_kernel_dim=4,
                           rms_norm_eps=cfg.norm_eps, hidden_act="silu", num_hidden_layers=1,
                           layer_types=["linear_attention"])
    theirs = Qwen3_5GatedDeltaNet(hf, 0)
    with torch.no_grad():  # away from init's ones: the norm's weight and dt_bias count
        for p in (ours.norm.weight, ours.dt_bias):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(2, 37, cfg.d_model, generator=torch.Generator().manual_seed(0))
    _compare_module(ours, theirs, x)  # 37: transformers pads to its chunk of 64, ours 4


@pytest.mark.quick
def test_kimi_delta_attention_equals_transformers_kimi_linear():
    """KimiLinearDeltaAttention on the same weights: q/k/v convs, the per-channel forget
    gate (f_a, f_b, dt_bias, A_log), beta, the sigmoid-gated output norm (g_a, g_b)."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg, ours = _one_layer("kimi-linear")
    hf = KimiLinearConfig(hidden_size=cfg.d_model, rms_norm_eps=cfg.norm_eps,
                          hidden_act="silu", num_hidden_layers=2,
                          linear_attn_config=dict(num_heads=4, head_dim=8,
                                                  short_conv_kernel_size=4, kda_layers=[1],
                                                  full_attn_layers=[2]))
    theirs = KimiLinearDeltaAttention(hf, 0)
    with torch.no_grad():  # away from init's ones: the norm's weight counts
        ours.o_norm.weight.add_(0.3 * torch.randn(
            ours.o_norm.weight.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(2, 37, cfg.d_model, generator=torch.Generator().manual_seed(0))
    _compare_module(ours, theirs, x)  # 37: transformers' chunks of 64, ours 4


def test_mamba2_equals_transformers_nemotron_h():
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg, ours = _one_layer("nemotron-h")
    hf = NemotronHConfig(hidden_size=cfg.d_model, mamba_num_heads=4, mamba_head_dim=6,
                         ssm_state_size=8, n_groups=2, conv_kernel=4, use_conv_bias=True,
                         chunk_size=16, time_step_min=0.01, use_bias=False,
                         layer_norm_epsilon=cfg.norm_eps, layers_block_type=["mamba"])
    theirs = NemotronHMamba2Mixer(hf, 0).eval()  # eval: its torch path, not the fused kernel
    with torch.no_grad():
        for p in (ours.norm.weight, ours.D, ours.conv1d.bias):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(2, 37, cfg.d_model, generator=torch.Generator().manual_seed(0))
    _compare_module(ours, theirs, x)


@pytest.mark.quick
def test_olmo_hybrid_gpt_equals_transformers(tmp_path):
    """OLMo Hybrid's options (post-norm attention blocks, q/k norms over all heads, beta in
    [0, 2], the gated norm's eps) against OlmoHybridForCausalLM on the same weights (the
    export is the import): the loss and every gradient, the gradients mapped to
    transformers' names by exporting them as a folder."""
    from transformers import AutoModelForCausalLM
    from ctxpar.checkpoint import export

    cfg = CONFIGS["olmo-hybrid"]
    ours = GPT(cfg, options=ModelOptions(seed=SEED))
    with torch.no_grad():  # away from init's ones: every norm's weight and dt_bias count
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    export.save_folder(tmp_path / "w", ours.named_parameters(), cfg)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "w").float()
    tokens, labels = _batch(cfg)
    loss = ours(tokens, torch.arange(N), labels) / (labels != -100).sum()
    loss.backward()
    logits = theirs(tokens, use_cache=False).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref.backward()
    close(loss, ref, "loss")
    export.save_folder(tmp_path / "g", ((n, p.grad) for n, p in ours.named_parameters()), cfg)
    grads = AutoModelForCausalLM.from_pretrained(tmp_path / "g").float().state_dict()
    for name, p in theirs.named_parameters():
        close(grads[name], p.grad, name)


# ------------------------------------------------------------ hybrids over CP

def _batch(cfg):
    return random_batch(cfg.vocab_size, BATCH, N)


def reference(cfg, cu):
    """One process: token-mean loss and every gradient."""
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens, labels = _batch(cfg)
    loss = model(tokens, torch.arange(N), labels, cu_seqlens=cu) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _parity(rank, world, payload):
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from models.loss import deepspeed_style_reduce_

    out = []
    for name, tp, cp, layout, strategy, cu, ckpt in pickle.loads(payload):
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp))
        model = GPT(cfg, ModelGroups.from_state(st),
                    ModelOptions(layout=layout, seed=SEED, linear_cp=strategy,
                                 activation_checkpointing=ckpt))
        tokens, labels = _batch(cfg)
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout) for t in (tokens, labels))
        pos = sequence_positions(N, st.cp_group, layout)
        n_tokens = global_token_count(lab, st.dp_cp_group)
        loss_sum = model(tok, pos, lab, cu_seqlens=cu)
        loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
        deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
        out.append(dict(loss=global_mean_loss(loss_sum, n_tokens, st.dp_cp_group),
                        grads=gather_full_state_dict(model, st.tp_group, grads=True)))
    return out


DOCS = documents(N)  # mid-rank starts, one-token documents, one spanning three cp4 ranks
CASES = {  # world -> (config, tp, cp, layout, parallel.linear_cp, cu_seqlens, recompute)
    2: [("qwen3.5", 1, 2, "zigzag", "state", None, "none"),
        ("nemotron-h", 1, 2, "zigzag", "state", None, "full"),  # replays its all-gather
        ("qwen3.5", 1, 2, "striped", "heads", None, "selective"),
        ("nemotron-h", 1, 2, "striped", "heads", DOCS, "none"),
        ("qwen3.5", 1, 2, "contiguous", "state", DOCS, "full"),
        # OLMo Hybrid's options: post-norm attention, q/k norms over all heads, beta in [0, 2]
        ("olmo-hybrid", 1, 2, "zigzag", "state", DOCS, "none"),
        ("olmo-hybrid", 1, 2, "striped", "heads", None, "selective"),
        # Kimi Linear's KDA: a decay per key channel, the sigmoid-gated norm, low-rank gates
        ("kimi-linear", 1, 2, "zigzag", "state", DOCS, "none"),
        ("kimi-linear", 1, 2, "striped", "heads", None, "selective")],
    4: [("qwen3.5", 1, 4, "zigzag", "state", DOCS, "none"),
        ("nemotron-h", 1, 4, "zigzag", "state", None, "selective"),
        ("nemotron-h", 1, 4, "contiguous", "state", DOCS, "none"),
        ("qwen3.5", 1, 4, "zigzag", "heads", DOCS, "none"),
        # TP splits the mixers by heads (one key head, two value heads; one B/C group a rank)
        ("qwen3.5", 2, 2, "zigzag", "state", DOCS, "none"),
        ("nemotron-h", 2, 2, "striped", "heads", DOCS, "full"),
        ("olmo-hybrid", 2, 2, "zigzag", "state", DOCS, "none"),  # q/k norms' squares over TP
        ("kimi-linear", 1, 4, "zigzag", "state", DOCS, "full"),
        ("kimi-linear", 2, 2, "zigzag", "state", DOCS, "none")],  # f_a, g_a replicated over TP
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_hybrid_gpt_over_cp_equals_one_process(world):
    cases = CASES[world]
    results = run_distributed(_parity, world, pickle.dumps(cases), timeout=240)
    for case_index, (name, tp, cp, layout, strategy, cu, ckpt) in enumerate(cases):
        loss, grads = reference(CONFIGS[name], cu)
        where = f"{name} tp{tp} cp{cp} {layout} {strategy} docs={cu is not None} {ckpt}"
        for rank, per_case in enumerate(results):
            got = per_case[case_index]
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=f"{where} rank {rank}")
            for n, g in grads.items():
                torch.testing.assert_close(got["grads"][n], g, **TOL,
                                           msg=f"{where} rank {rank} grad {n}")


def _bf16_cases(rank, world, payload):
    """Each case's loss and gradients with the GPT's parameters and activations in bf16."""
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from models.loss import deepspeed_style_reduce_

    out = []
    for name, layout, strategy, cu in pickle.loads(payload):
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=1, cp=world, dp=1)
        model = GPT(cfg, ModelGroups(cp_group=st.cp_group),
                    ModelOptions(layout=layout, seed=SEED, linear_cp=strategy)).bfloat16()
        tokens, labels = _batch(cfg)
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout) for t in (tokens, labels))
        n_tokens = global_token_count(lab, st.dp_cp_group)
        loss_sum = model(tok, sequence_positions(N, st.cp_group, layout), lab, cu_seqlens=cu)
        loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
        deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
        out.append(dict(loss=global_mean_loss(loss_sum, n_tokens, st.dp_cp_group).float(),
                        grads={n: p.grad.float() for n, p in model.named_parameters()}))
    return out


def _one_process(cfg, cu, dtype):
    model = GPT(cfg, options=ModelOptions(seed=SEED)).to(dtype)
    tokens, labels = _batch(cfg)
    loss = model(tokens, torch.arange(N), labels, cu_seqlens=cu) / (labels != -100).sum()
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


BF16_CASES = [("qwen3.5", "zigzag", "state", DOCS), ("nemotron-h", "contiguous", "state", DOCS),
              ("qwen3.5", "striped", "heads", None), ("nemotron-h", "zigzag", "heads", DOCS)]


def test_hybrid_gpt_in_bf16_over_cp_adds_no_error_to_bf16s_own():
    """bf16 parameters and activations (the kernels' states and summaries stay fp32): at
    cp2 the loss and every gradient are as close to one bf16 process as bf16 itself is to
    fp32. Per tensor: |cp - one| <= 4 max(|one - fp32|, 2^-8 max|fp32|), 2^-8 being
    bf16's relative step; a state not passed, a halo missed or a document leaking between
    ranks moves a gradient by order one, far past the bound."""
    results = run_distributed(_bf16_cases, 2, pickle.dumps(BF16_CASES), timeout=240)
    for i, (name, layout, strategy, cu) in enumerate(BF16_CASES):
        (loss32, grads32), (loss16, grads16) = (_one_process(CONFIGS[name], cu, dt)
                                                 for dt in (torch.float32, torch.bfloat16))
        where = f"{name} cp2 {layout} {strategy} docs={cu is not None} bf16"
        for rank, per_case in enumerate(results):
            got = per_case[i]
            bound = 4 * max((loss16 - loss32).abs().item(), 2 ** -8 * loss32.abs().item())
            assert (got["loss"] - loss16).abs().item() <= bound, (where, rank, got["loss"])
            for n, g32 in grads32.items():
                scale = max((grads16[n] - g32).abs().max().item(),
                            2 ** -8 * g32.abs().max().item())
                err = (got["grads"][n] - grads16[n]).abs().max().item()
                assert err <= 4 * scale, (where, rank, n, err, scale)


def test_documents_change_the_linear_layers_gradients():
    """The cases above hold a real document mask: without cu_seqlens the mixers' decay
    gradients move by far more than TOL."""
    for name, mixer in (("qwen3.5", "linear_attn"), ("nemotron-h", "mamba"),
                        ("kimi-linear", "kda.forget_gate")):
        with_docs, without = (reference(CONFIGS[name], cu)[1] for cu in (DOCS, None))
        key = f"layers.0.{mixer}.A_log"
        diff = (with_docs[key] - without[key]).abs().max() / without[key].abs().max()
        assert diff > 1e-2, (name, float(diff))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_documents_are_run_as_if_alone(name):
    """One process: each document's logits in a packed sample equal the document's run
    alone at the same positions (the mixers' state and conv window restart at its start;
    the CP cases above hold the same model at every layout)."""
    cfg = CONFIGS[name]
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens = _batch(cfg)[0][:1]
    cu = torch.tensor([0, 5, 6, 30, N], dtype=torch.int32)
    with torch.no_grad():
        packed = model(tokens, torch.arange(N), cu_seqlens=cu)       # (1, N, V)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(tokens[:, a:b], torch.arange(a, b))
            close(packed[:, a:b], alone, f"{name} document [{a}, {b})")


# ------------------------------------------------------------ refusals, one line each

QWEN = dict(n_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], seq_len=128)
KIMI = dict(n_layers=4, layer_types=["kimi_delta_attention"] * 3 + ["full_attention"],
            seq_len=128)
MAMBA = dict(n_layers=2, layer_types=["mamba", "mlp"], seq_len=128)


@pytest.mark.parametrize("model, parallel, extra, message", [
    (dict(n_layers=2, layer_types=["linear_attention", "gated_delta"]), {}, {},
     "model.layer_types: unknown type(s) ['gated_delta']"),
    (dict(QWEN, linear_num_key_heads=2, linear_num_value_heads=6), {"cp": 4, "linear_cp": "heads"},
     {},
     "parallel.linear_cp='heads' needs model.linear_num_value_heads=6 divisible by cp_size=4"),
    (dict(MAMBA, mamba_num_heads=6, n_groups=2), {"cp": 4, "linear_cp": "heads"}, {},
     "needs model.mamba_num_heads=6 divisible by cp_size=4"),
    (dict(QWEN), {"cp": 2, "layout": "striped"}, {},
     "parallel.linear_cp='state' takes layouts ['contiguous', 'zigzag'], not layout='striped'"),
    (dict(QWEN), {"linear_cp": "ring"}, {},
     "parallel.linear_cp='ring' must be one of 'state', 'heads'"),
    (dict(QWEN, linear_chunk_size=0), {}, {}, "model.linear_chunk_size=0 must be an integer >= 1"),
    (dict(QWEN, mamba_num_heads=4), {}, {},
     "model.mamba_num_heads=4 is set but no layer in model.layer_types is 'mamba'"),
    (dict(MAMBA, linear_num_key_heads=4), {}, {},
     "model.linear_num_key_heads=4 is set but no layer in model.layer_types is "
     "'linear_attention'"),
    (dict(n_layers=2, linear_chunk_size=32), {}, {}, "model.linear_chunk_size=32 is set but no"),
    (dict(QWEN, linear_num_key_heads=4, linear_num_value_heads=6), {}, {},
     "model.linear_num_value_heads=6 is not a multiple of model.linear_num_key_heads=4"),
    (dict(MAMBA, mamba_num_heads=4, n_groups=3), {}, {},
     "model.mamba_num_heads=4 is not divisible by model.n_groups=3"),
    (dict(QWEN, linear_num_key_heads=1, linear_num_value_heads=2), {"tp": 2}, {},
     "model.linear_num_key_heads=1 is not divisible by parallel.tp=2"),
    (dict(MAMBA, mamba_num_heads=4, n_groups=1), {"tp": 2}, {},
     "model.n_groups=1 is not divisible by parallel.tp=2"),
    (dict(MAMBA, mamba_num_heads=4, n_groups=2), {"tp": 2, "cp": 4, "linear_cp": "heads"},
     {}, "needs model.mamba_num_heads / parallel.tp=2 divisible by cp_size=4"),
    (dict(QWEN), {"linear_cp": "heads"},
     {"data": {"dynamic_cp": True, "kind": "tokens", "path": "x"}},
     "not built with data.dynamic_cp=true and parallel.linear_cp='heads'"),
    (dict(QWEN), {"cp": 4, "cp_comm": "hybrid", "ulysses": 2, "layout": "striped",
                  "linear_cp": "heads"}, {}, "not built with parallel.cp_comm='hybrid'"),
    (dict(QWEN, reordered_norms=["sliding_attention"]), {}, {},
     "model.reordered_norms=['sliding_attention'] must list layer types the model has"),
    (dict(QWEN, reordered_norms=["full_attention"], post_norms=True), {}, {},
     "model.reordered_norms and model.post_norms=true both set"),
    (dict(QWEN, qk_norm=True, qk_norm_scope="all_heads", n_kv_heads=1), {"tp": 2}, {},
     "model.qk_norm_scope='all_heads' needs model.qk_norm=true and the kv heads split"),
    (dict(QWEN, qk_norm_scope="heads"), {}, {},
     "model.qk_norm_scope='heads' must be one of 'head', 'all_heads'"),
    (dict(MAMBA, linear_allow_neg_eigval=True), {}, {},
     "model.linear_allow_neg_eigval=True is set but no layer in model.layer_types is "
     "'linear_attention'"),
    (dict(QWEN, linear_norm_eps=0), {}, {}, "model.linear_norm_eps=0.0 must be a number > 0"),
    (dict(KIMI, linear_num_key_heads=6), {"cp": 4, "linear_cp": "heads"}, {},
     "parallel.linear_cp='heads' needs model.linear_num_value_heads=6 divisible by cp_size=4"),
    (dict(KIMI, linear_num_key_heads=3), {"tp": 2}, {},
     "model.linear_num_key_heads=3 is not divisible by parallel.tp=2"),
    (dict(KIMI), {"cp": 2, "layout": "striped"}, {},
     "parallel.linear_cp='state' takes layouts ['contiguous', 'zigzag'], not layout='striped'"),
    (dict(MAMBA, linear_key_head_dim=8), {}, {},
     "model.linear_key_head_dim=8 is set but no layer in model.layer_types is "
     "'linear_attention' or 'kimi_delta_attention'"),
])
def test_bad_hybrid_configs_fail_at_load_in_one_line(model, parallel, extra, message):
    d = {"model": {"vocab_size": 256, **model}, "parallel": {"dp": 1, **parallel},
         "train": {"global_batch_size": 1}, **extra}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d, check_paths=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_good_hybrid_configs_load():
    config_from_dict({"model": {"vocab_size": 256, **QWEN}, "parallel": {"dp": 1}},
                     training=False)  # generation (tests/test_hybrid_generation.py)
    config_from_dict({"model": {"vocab_size": 256, **QWEN},
                      "parallel": {"cp": 2, "dp": 1, "linear_cp": "heads",
                                   "layout": "striped"}})
    config_from_dict({"model": {"vocab_size": 256, **MAMBA, "mamba_num_heads": 4},
                      "parallel": {"cp": 4, "dp": 1, "layout": "zigzag"}})
    config_from_dict({"model": {"vocab_size": 256, **KIMI, "linear_num_key_heads": 4},
                      "parallel": {"cp": 2, "dp": 1, "linear_cp": "heads",
                                   "layout": "striped"}})
