"""Hash-routed MoE layers (model.moe.hash_layers; DeepSeek-V4's 'hash_moe'): the layer
against transformers' DeepseekV4SparseMoeBlock with its DeepseekV4HashRouter on the same
weights and table; the table's init and its place among the buffers; the config's
refusals. The parallel parity (cp2 x ep2, tp2 x cp2 x ep2 with a hash layer beside a
routed one) is tests/test_hyper_connections.py's grid (one spawned world for both)."""
from dataclasses import replace

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.moe import MoEConfig
from models.gpt import GPT
from models.moe import MoE
from models.options import ModelOptions

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 on both sides; sums in another order only
CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=16,
                  moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=24, score="sqrtsoftplus",
                                routed_scaling_factor=1.5, shared_expert_hidden=24,
                                score_correction_bias=True, hash_layers=[0]))


@pytest.mark.quick
@pytest.mark.parametrize("limit", [None, 0.5], ids=["unclamped", "clamped"])
def test_a_hash_layer_equals_deepseek_v4s_hash_routed_block(limit):
    """Output and every gradient (router, experts, shared expert) as transformers' block
    on the same weights and tid2eid; with model.swiglu_limit V4's clamped SwiGLU in the
    experts and the shared expert (0.5: reached by most gate and up values here; None:
    transformers' limit out of reach)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock
    torch.manual_seed(0)
    theirs = DeepseekV4SparseMoeBlock(DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=24, routed_scaling_factor=1.5,
        mlp_layer_types=["hash_moe", "moe"], swiglu_limit=limit or 1e9), layer_idx=0)
    ours = MoE(replace(CFG, swiglu_limit=limit), hash_routed=True)
    assert not hasattr(ours.gate, "e_score_correction_bias")  # transformers' has none
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        theirs.gate.tid2eid.copy_(torch.rand(64, 8, generator=g).topk(2).indices)
        names = {"gate.weight": "gate.weight", "gate.tid2eid": "gate.tid2eid",
                 "experts.gate_up_proj": "experts.gate_up_proj",
                 "experts.down_proj": "experts.down_proj",
                 **{f"shared_experts.{n}.weight": f"shared_expert.{n}.weight"
                    for n in ("gate_proj", "up_proj", "down_proj")}}
        mine = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
        for t, o in names.items():
            mine[o].copy_(theirs.get_parameter(t) if "tid2eid" not in t
                          else theirs.get_buffer(t))
    assert set(mine) == set(names.values())
    x = torch.randn(2, 16, 32, generator=g)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ids = torch.randint(0, 64, (2, 16), generator=g)
    want = theirs(x_theirs, input_ids=ids)
    ours.token_ids = ids.reshape(-1)
    got = ours(x_ours)
    torch.testing.assert_close(got, want, **TOL)
    w = torch.randn(want.shape, generator=g)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    for t, o in names.items():
        if "tid2eid" not in t:
            # 1e-6 of each gradient's scale: the router's (up to ~30 here) sums 32 tokens'
            # terms in another order than transformers' loop over experts
            want_g = theirs.get_parameter(t).grad
            torch.testing.assert_close(mine[o].grad, want_g, rtol=1e-5,
                                       atol=1e-6 * max(1.0, want_g.abs().max().item()), msg=o)
    if limit is not None:  # the clamp matters: without it, another output
        unclamped = MoE(CFG, hash_routed=True)
        unclamped.load_state_dict(ours.state_dict())
        unclamped.token_ids = ours.token_ids
        assert not torch.allclose(unclamped(x), want.detach(), **TOL)
    # the choice is the table's: another table, other experts
    ours.gate.tid2eid.copy_((ours.gate.tid2eid + 1) % 8)
    assert not torch.allclose(ours(x), want.detach(), **TOL)


@pytest.mark.parametrize("tile", [None, 5], ids=["whole", "tiled"])
def test_v4s_clamped_mlp_equals_transformers(tile):
    """model.swiglu_limit in the dense MLP, whole and under memory.tiled_mlp's tiles (their
    backward recomputes the clamp): DeepseekV4MLP's output and every gradient."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP
    from models.mlp import MLP
    torch.manual_seed(0)
    theirs = DeepseekV4MLP(DeepseekV4Config(hidden_size=32, intermediate_size=40,
                                            swiglu_limit=0.5))
    ours = MLP(replace(CFG, moe=None, ffn_hidden=40, swiglu_limit=0.5), None, tile_tokens=tile)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 16, 32)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(got, want, **TOL)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)
    ours.limit = None
    assert not torch.allclose(ours(x), want.detach(), **TOL)


def test_the_table_is_a_saved_buffer_of_distinct_experts_drawn_from_the_seed():
    """gate.tid2eid (transformers' name under layers.N.mlp) is in the state dict, int64
    through a bf16 cast, k distinct experts per id, the same for the same seed; the hash
    layer adds no router statistics and the routed layer's bias still moves."""
    a, b = GPT(CFG, options=ModelOptions(seed=3)), GPT(CFG, options=ModelOptions(seed=3))
    name = "layers.0.mlp.gate.tid2eid"
    table = a.state_dict()[name]
    assert torch.equal(table, b.state_dict()[name]) and table.shape == (64, 2)
    assert (table[:, 0] != table[:, 1]).all() and 0 <= table.min() and table.max() < 8
    assert not torch.equal(table, GPT(CFG, options=ModelOptions(seed=4)).state_dict()[name])
    assert "layers.1.mlp.gate.tid2eid" not in a.state_dict()
    assert a.bfloat16().state_dict()[name].dtype == torch.int64
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    b(tokens, torch.arange(16), tokens)
    assert b.router_losses.layer_counts.shape == (1, 8)  # layer 1's only
    cfg = replace(CFG, moe=replace(CFG.moe, bias_update_rate=0.01))
    c = GPT(cfg, options=ModelOptions(seed=3))
    c(tokens, torch.arange(16), tokens)
    c.update_router_biases(c.router_losses.layer_counts)
    assert c.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


@pytest.mark.parametrize("moe, extra, msg", [
    ({"hash_layers": [2]}, {}, r"model\.moe\.hash_layers=\[2\] must be distinct MoE layers"),
    ({"hash_layers": [0, 0]}, {}, r"must be distinct MoE layers"),
    ({"hash_layers": [0, 1]}, {}, r"covers every MoE layer"),
    ({"hash_layers": [0]}, {"parallel": {"pp": 2}}, r"hash_layers with parallel\.pp=2"),
    ({"hash_layers": [0], "capacity_factor": 1.0}, {},
     r"hash_layers with model\.moe\.capacity_factor=1\.0"),
])
def test_bad_hash_layer_configs_fail_at_load_in_one_line(moe, extra, msg):
    model = dict(vocab_size=256, d_model=32, n_heads=4, n_layers=2, seq_len=128,
                 moe={"num_experts": 8, "top_k": 2, **moe})
    with pytest.raises(ConfigError, match=msg) as e:
        config_from_dict({"model": model, **extra})
    assert "\n" not in str(e.value)
