"""Manifold-constrained hyper-connections (model.hyper_connections, models/hyper_connections.py):
the whole stream path (embedding expanded to N streams, every block's collapse, expand and
Sinkhorn mix around both sublayers, the head's collapse, the final norm) against
transformers' DeepseekV4Model on the same weights, its attention and MoE replaced by our
blocks' own mixers (V4's attention is other work; the streams are what is tested here);
activation checkpointing; a MoE GPT with mHC and a hash-routed layer (model.moe.hash_layers,
tests/test_hash_moe.py) at cp2 x ep2 and tp2 x cp2 against one process, and generation (KV
cache) at tp2 x cp2 against full forwards; the planner's saved bytes; the config's
refusals."""
import pickle
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from ctxpar.config import ConfigError, ModelConfig, config_from_dict, rotary_dim
from ctxpar.config.hyper_connections import HyperConnectionsConfig
from ctxpar.config.moe import MoEConfig
from ctxpar.tensor_parallel import gather_full_state_dict
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import random_batch
from ctxpar.testing.generation import reference_generate
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions
from models.rope import layer_rotary

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 on both sides; sums in another order only
N, BATCH, SEED = 16, 2, 5
HC = HyperConnectionsConfig(streams=3, sinkhorn_iters=5, eps=1e-6)
CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=N,
                  ffn_hidden=48, norm_eps=1e-6, tie_embeddings=False, hyper_connections=HC)


class _Attention(nn.Module):
    """Our block's token mixer where transformers' layer calls self_attn."""

    def __init__(self, block, cos, sin):
        super().__init__()
        self.attn, self.cos, self.sin = block.attn, cos, sin

    def forward(self, h, **_):
        inputs, carry = self.attn.project_in(h, self.cos, self.sin)
        return self.attn.project_out(self.attn.mix(inputs, None), *carry), None


class _MLP(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.mlp = block.mlp

    def forward(self, h, input_ids=None):
        return self.mlp(h)


def _theirs_with_our_mixers(ours, positions):
    """transformers' DeepseekV4Model of CFG's shape, its mHC and norms random and copied
    into ours, each layer's attention and MoE replaced by our block's mixers."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model
    theirs = DeepseekV4Model(DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        hc_mult=HC.streams, hc_sinkhorn_iters=HC.sinkhorn_iters, hc_eps=HC.eps,
        rms_norm_eps=CFG.norm_eps, sliding_window=8))
    g = torch.Generator().manual_seed(1)
    names = {"embed_tokens.weight": "embed.weight", "norm.weight": "final_norm.weight",
             "hc_head.hc_fn": "hc_head.fn", "hc_head.hc_base": "hc_head.base",
             "hc_head.hc_scale": "hc_head.scale"}
    for i in range(CFG.n_layers):
        p = f"layers.{i}."
        names.update({p + "input_layernorm.weight": p + "attn_norm.weight",
                      p + "post_attention_layernorm.weight": p + "mlp_norm.weight"})
        for part in ("fn", "base", "scale"):
            names.update({f"{p}attn_hc.{part}": f"{p}attn_hc.{part}",
                          f"{p}ffn_hc.{part}": f"{p}mlp_hc.{part}"})
    mine, rotary = dict(ours.named_parameters()), layer_rotary(
        positions, rotary_dim(CFG), ours.layer_attention)
    with torch.no_grad():
        for theirs_name, our_name in names.items():
            t = theirs.get_parameter(theirs_name)
            # scales and biases away from their init (ones, zeros): every term counts
            t.copy_(torch.randn(t.shape, generator=g) * (0.5 if t.dim() == 1 else 0.2)
                    + (1.0 if "norm" in theirs_name else 0.0))
            mine[our_name].copy_(t)
    for i, layer in enumerate(theirs.layers):
        layer.self_attn = _Attention(ours.layers[i], *rotary[i])
        layer.mlp = _MLP(ours.layers[i])
    return theirs, names


def test_the_streams_equal_deepseek_v4s_on_the_same_weights():
    """Forward (the final-normed hidden states) and every mHC map's gradient equal
    transformers' DeepseekV4Model's, to fp32 rounding."""
    torch.manual_seed(0)
    ours, positions = GPT(CFG, options=ModelOptions(seed=SEED)), torch.arange(N)
    theirs, names = _theirs_with_our_mixers(ours, positions)
    tokens = torch.randint(0, 64, (BATCH, N), generator=torch.Generator().manual_seed(2))
    want = theirs(input_ids=tokens).last_hidden_state
    got = ours.hidden_states(tokens, positions)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (got * w).sum().backward()
    (want * w).sum().backward()  # our mixers' gradients accumulate twice: only hc compared
    mine = dict(ours.named_parameters())
    for theirs_name, our_name in names.items():
        if "_hc." in our_name or our_name.startswith("hc_head."):
            torch.testing.assert_close(mine[our_name].grad, theirs.get_parameter(
                theirs_name).grad, **TOL, msg=our_name)
    assert ours.layers[0].attn_hc.fn.shape == ((2 + 3) * 3, 3 * 32)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_give_the_unchecked_gradients(mode):
    """Activation checkpointing replays a block from its (B, T, N, d) input: the same loss
    and gradients as no checkpointing (selective: the mHC maps pass between its pieces)."""
    tokens = torch.randint(0, 64, (BATCH, N), generator=torch.Generator().manual_seed(4))
    results = []
    for m in ("none", mode):
        model = GPT(CFG, options=ModelOptions(seed=SEED, activation_checkpointing=m))
        loss = model(tokens, torch.arange(N), tokens.roll(-1, 1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, **TOL, msg=name)


# ------------------------------------------------------- a MoE GPT with mHC over the grid

MOE_CFG = replace(CFG, moe=MoEConfig(
    num_experts=8, top_k=2, expert_hidden=24, score="sqrtsoftplus",
    score_correction_bias=True, routed_scaling_factor=1.5, shared_expert_hidden=16,
    aux_loss_coef=0.0, seq_aux_loss_coef=0.1, hash_layers=[0]))  # layer 0 hash-routed
# generation's model: a hash-routed MoE layer (each decode step's id chooses its experts)
# beside a routed one; wide logits: greedy without near-ties
GEN_CFG = replace(MOE_CFG, init_std=0.2, seq_len=64)
PROMPTS, NEW = [list(range(40, 53)), [7, 3, 60, 9, 1]], 5
GRIDS = [(1, 2, 2, "zigzag", "full"),       # tp, cp, ep, layout, activation checkpointing
         (2, 2, 2, "zigzag", "selective")]


def _batch():
    return random_batch(64, BATCH, N, seed=7)


def _reference(cfg):
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens, labels = _batch()
    loss = model(tokens, torch.arange(N), labels) / (labels != -100).sum()
    (loss + model.router_losses.share).backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
            model.layers[0].mlp.gate.tid2eid, model.router_losses.seq_aux_loss)


def _grid_case(rank, world, payload):
    import torch.distributed as dist
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from models.loss import global_mean_loss, global_token_count, loss_for_backward
    out = []
    for tp, cp, ep, layout, mode in pickle.loads(payload):
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp), ep=ep)
        model = GPT(MOE_CFG, ModelGroups.from_state(st), ModelOptions(
            layout=layout, seed=SEED, activation_checkpointing=mode))
        tokens, labels = _batch()
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout) for t in (tokens, labels))
        dp = st.dp_size
        tok, lab = tok.chunk(dp)[st.dp_rank], lab.chunk(dp)[st.dp_rank]
        n = global_token_count(lab, st.dp_cp_group)
        loss_sum = model(tok, sequence_positions(N, st.cp_group, layout), lab)
        (loss_for_backward(loss_sum, n, dp) + model.router_losses.share * dp).backward()
        for p in model.parameters():  # DeepSpeed's reduction: experts over their EDP group
            group = st.edp_group if getattr(p, "expert_shard", (0, 1))[1] > 1 \
                else st.dp_cp_group
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
        out.append(dict(loss=global_mean_loss(loss_sum, n, st.dp_cp_group),
                        grads=gather_full_state_dict(model, st.tp_group, True, st.ep_group),
                        table=model.layers[0].mlp.gate.tid2eid.clone(),
                        seq=model.router_losses.seq_aux_loss))
    from ctxpar.inference import generate
    st = init_parallel_state(tp=2, cp=2)  # generation: prefill over CP, decode merged
    model = GPT(GEN_CFG, ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                ModelOptions(layout="zigzag", seed=SEED)).eval()
    res = generate(model, PROMPTS, NEW, layout="zigzag", cp_group=st.cp_group,
                   tp_group=st.tp_group, keep_logits=True, max_positions=GEN_CFG.seq_len)
    out.append(dict(tokens=res.tokens, logits=torch.stack(res.logits)))
    return out


def test_a_moe_gpt_with_hyper_connections_over_the_grid_equals_one_process():
    """cp2 x ep2 (full checkpointing) and tp2 x cp2 x ep2 (selective), zigzag, layer 0
    hash-routed (each rank's ids its share), layer 1 routed: the loss, the sequence-level
    loss and every gradient (the mHC maps', replicated over TP, summed over DP x CP) as one
    process, the hash table the same;
    generation's tokens and logits (fp32; the cache's merge reorders sums) as full forwards."""
    results = run_distributed(_grid_case, 4, pickle.dumps(GRIDS), timeout=240)
    loss, grads, table, seq = _reference(MOE_CFG)
    tokens, logits = reference_generate(GPT(GEN_CFG, options=ModelOptions(seed=SEED)).eval(),
                                        PROMPTS, NEW)
    for rank, per_case in enumerate(results):  # generation at tp2 x cp2 (zigzag, KV cache)
        assert per_case[-1]["tokens"] == tokens, rank
        torch.testing.assert_close(per_case[-1]["logits"], logits, rtol=1e-5, atol=1e-4)
    assert any(".mlp_hc." in name for name in grads) and "hc_head.fn" in grads
    for i, grid in enumerate(GRIDS):
        for rank, per_case in enumerate(results):
            got, where = per_case[i], f"tp,cp,ep,layout,mode={grid} rank {rank}"
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            torch.testing.assert_close(got["seq"], seq, **TOL, msg=where)  # layer 1's only
            assert torch.equal(got["table"], table), where  # the same table on every layout
            for name, g in grads.items():
                torch.testing.assert_close(got["grads"][name], g, **TOL, msg=f"{where} {name}")


@pytest.mark.parametrize("model, parallel, msg", [
    ({"hyper_connections": {"streams": 0}}, {}, "model.hyper_connections.streams=0 must be"),
    ({"hyper_connections": {"sinkhorn_iters": 0}}, {},
     "model.hyper_connections.sinkhorn_iters=0 must be"),
    ({"hyper_connections": {"eps": -1.0}}, {}, "model.hyper_connections.eps=-1.0 must be"),
    ({"hyper_connections": {}, "mtp": {}}, {}, "model.hyper_connections with model.mtp="),
    ({"hyper_connections": {}, "layer_scalar": True}, {},
     "model.hyper_connections with model.layer_scalar=True"),
])
def test_bad_hyper_connection_configs_fail_at_load_in_one_line(model, parallel, msg):
    base = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    with pytest.raises(ConfigError, match=msg.replace(".", r"\.").replace("(", r"\(")) as e:
        config_from_dict({"model": {**base, **model}, "parallel": parallel})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layer_types", [None, ["attention", "mlp", "full_attention"]])
def test_the_planner_counts_what_autograd_saves_for_the_streams(layer_types):
    """ctxpar/plan/streams.py: every checkpointing mode, exact (one process, fp32; the
    streams are token-local: TP and CP split them as the rest, tests/test_plan.py), with
    Nemotron-H's single-op blocks (one map each) beside a whole block."""
    from helpers.saved_bytes import assert_planner_saves_what_autograd_saves
    assert_planner_saves_what_autograd_saves(ModelConfig(
        vocab_size=64, seq_len=32, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2,
        layer_types=layer_types, hyper_connections=HyperConnectionsConfig(4, 7)))
