"""Mixture of experts (models/moe.py, ctxpar/moe/): the layer against transformers' own
sparse blocks on the same weights (Qwen3-MoE; Qwen3-Next with its gated shared expert),
the router losses against transformers' load_balancing_loss_func, and a tiny MoE GPT over
every grid that fits four ranks (ep folded over DP x CP, with TP and the CP patterns)
against one process: loss, load-balancing and z losses, every gradient."""
import pickle
import shutil
from dataclasses import replace

import pytest
import torch

from ctxpar.config import ConfigError, MemoryConfig, ModelConfig, config_from_dict
from ctxpar.config.moe import MoEConfig
from ctxpar.moe import RouterStats, moe_stats, reset_moe_stats
from ctxpar.tensor_parallel import gather_full_state_dict
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import random_batch
from models.gpt import GPT
from models.moe import MoE
from models.options import ModelGroups, ModelOptions
from tests.helpers.train_run import assert_same_run, losses, metric, run_train

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32; sums in another order only


def _moe_cfg(**moe):
    return ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                       seq_len=32, ffn_hidden=48,
                       moe=MoEConfig(**{"num_experts": 8, "top_k": 2, "expert_hidden": 24,
                                        **moe}))


def _copy_from(ours, theirs):
    """transformers' block's tensors into ours (the same names and shapes)."""
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            mine[name].copy_(p)
    assert set(mine) == {n for n, _ in theirs.named_parameters()}


@pytest.mark.quick
@pytest.mark.parametrize("family,experts,top_k,norm", [
    ("qwen3_moe", 8, 2, True), ("qwen3_next", 8, 2, True),
    ("qwen3_moe", 16, 8, True),   # Qwen3-30B-A3B's top-8 (of 128)
    ("qwen3_moe", 8, 1, False),   # Switch's top-1, weighted by its probability
], ids=["qwen3_moe", "qwen3_next", "qwen3_moe-top8", "qwen3_moe-top1"])
def test_moe_layer_equals_transformers(family, experts, top_k, norm):
    from transformers import Qwen3MoeConfig, Qwen3NextConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    shared = family == "qwen3_next"
    kw = dict(hidden_size=32, num_experts=experts, num_experts_per_tok=top_k,
              moe_intermediate_size=24, norm_topk_prob=norm)
    torch.manual_seed(0)
    theirs = (Qwen3NextSparseMoeBlock(Qwen3NextConfig(**kw, shared_expert_intermediate_size=40))
              if shared else Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**kw)))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    cfg = _moe_cfg(shared_expert_hidden=40 if shared else 0, shared_expert_gate=shared,
                   num_experts=experts, top_k=top_k, norm_topk=norm)
    ours = MoE(cfg)
    _copy_from(ours, theirs)
    x = torch.randn(2, 16, 32, requires_grad=True)
    dy = torch.randn(2, 16, 32)
    want = theirs(x)
    gx_want, *g_want = torch.autograd.grad(want, [x, *theirs.parameters()], dy)
    got = ours(x)
    gx, *g = torch.autograd.grad(got, [x, *(dict(ours.named_parameters())[n]
                                            for n, _ in theirs.named_parameters())], dy)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(gx, gx_want, **TOL)
    for (name, _), a, b in zip(theirs.named_parameters(), g, g_want):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_gpt_oss_experts_equal_transformers_and_their_biases_do_not_decay():
    """gpt-oss's MLP (router bias, softmax over the top-k logits, expert biases, the
    clamped SwiGLU reached by the weights, [gate | up] interleaved and transposed in its
    tensors: checkpoint/families/gpt_oss.py): output and every gradient; the (E, n) bias
    stacks join the norms and biases without weight decay."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from ctxpar.checkpoint.families.gpt_oss import gpt_oss_from_hf
    from models.training import param_groups
    torch.manual_seed(0)
    theirs = GptOssMLP(GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3,
                                    intermediate_size=24, swiglu_limit=0.5))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    ours = MoE(_moe_cfg(top_k=3, router_bias=True, expert_bias=True, swiglu_limit=0.5))
    names = {"router.weight": "gate.weight", "router.bias": "gate.bias"}
    mine = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            mine[names.get(name, name)].copy_(gpt_oss_from_hf(name, p))
    x = torch.randn(2, 16, 32, requires_grad=True)
    dy = torch.randn(2, 16, 32)
    want = theirs(x)[0]
    gx_want, *g_want = torch.autograd.grad(want, [x, *theirs.parameters()], dy)
    got = ours(x)
    gx, *g = torch.autograd.grad(got, [x, *(mine[names.get(n, n)]
                                            for n, _ in theirs.named_parameters())], dy)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(gx, gx_want, **TOL)
    for (name, _), a, b in zip(theirs.named_parameters(), g, g_want):
        torch.testing.assert_close(a, gpt_oss_from_hf(name, b), **TOL, msg=name)
    no_decay = {id(p) for g in param_groups(ours, 0.1) if g["weight_decay"] == 0
                for p in g["params"]}
    assert {n for n, p in ours.named_parameters() if id(p) in no_decay} == {
        "gate.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"}


def assert_sigmoid_moe_equals(theirs, ours, renamed):
    """transformers' sigmoid-routed MoE block (DeepSeek-V3's, Nemotron 3's) and ctxpar's on
    the same weights and correction bias: output and every gradient (their names ->
    ctxpar's: shared_experts -> shared_expert and `renamed`)."""
    mine = dict(ours.named_parameters())
    names = {}
    for n, _ in theirs.named_parameters():
        names[n] = n.replace("shared_experts.", "shared_expert.")
        for a, b in renamed.items():
            names[n] = names[n].replace(a, b)
    assert set(names.values()) == set(mine)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            mine[names[n]].copy_(p)
        ours.gate.e_score_correction_bias.copy_(theirs.gate.e_score_correction_bias)
    x = torch.randn(2, 16, 32, requires_grad=True)
    dy = torch.randn(2, 16, 32)
    want, got = theirs(x), ours(x)
    g_want = torch.autograd.grad(want, [x, *(p for _, p in theirs.named_parameters())], dy)
    g = torch.autograd.grad(got, [x, *(mine[names[n]] for n in names)], dy)
    torch.testing.assert_close(got, want, **TOL)
    for name, a, b in zip(["x", *names], g, g_want):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_deepseek_v3_routing_equals_transformers():
    """Sigmoid scores, the top-k chosen on scores + e_score_correction_bias among each
    token's topk_group best of n_group groups, weights from the scores without the bias,
    normalised and scaled by routed_scaling_factor, an ungated shared expert: transformers'
    DeepseekV3MoE on the same weights and bias (output and every gradient)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        theirs.gate.e_score_correction_bias.normal_(0, 0.3)
    ours = MoE(_moe_cfg(num_experts=16, top_k=4, score="sigmoid", score_correction_bias=True,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        shared_expert_hidden=24))
    assert_sigmoid_moe_equals(theirs, ours, {})
    model = GPT(_moe_cfg(score="sigmoid", score_correction_bias=True)).bfloat16()
    name = "layers.0.mlp.gate.e_score_correction_bias"  # transformers' name, under layers.0
    assert name in model.state_dict() and name not in dict(model.named_parameters())
    assert model.state_dict()[name].dtype == torch.float32  # through a bf16 engine's cast


def test_sqrtsoftplus_routing_equals_deepseek_v4s_router():
    """DeepSeek-V4's router: p = sqrt(softplus(z)), the top-k on p + e_score_correction_bias,
    the weights from p normalised and scaled (transformers' DeepseekV4TopKRouter on the
    same weight and bias: the same experts, weights to fp32 rounding); the sequence-level
    balance loss normalises the same scores."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
    from ctxpar.moe.router import route, router_scores
    torch.manual_seed(0)
    theirs = DeepseekV4TopKRouter(DeepseekV4Config(
        hidden_size=32, num_local_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5))
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 32)
    logits, want_w, want_e = theirs(x)
    w, e = route(logits, 4, "sqrtsoftplus", bias=theirs.e_score_correction_bias, scaling=1.5)
    order, want_order = e.sort(dim=-1), want_e.sort(dim=-1)  # transformers: sorted=False
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))
    assert not torch.allclose(router_scores(logits, "sqrtsoftplus"), torch.sigmoid(logits))


def test_nemotron_h_moe_equals_transformers():
    """Nemotron 3's MoE block: squared-ReLU experts without a gate (up_proj (E, f, d) as
    ctxpar's gate_up_proj of model.mlp 'relu2'), DeepSeek-V3's grouped sigmoid router with
    its correction bias and scaling, an ungated squared-ReLU shared expert: transformers'
    NemotronHMoE on the same weights (output and every gradient)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
    torch.manual_seed(0)
    theirs = NemotronHMoE(NemotronHConfig(
        hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True))
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        theirs.gate.e_score_correction_bias.normal_(0, 0.3)
    cfg = replace(_moe_cfg(num_experts=8, top_k=3, score="sigmoid", score_correction_bias=True,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5,
                           shared_expert_hidden=40), mlp="relu2")
    assert_sigmoid_moe_equals(theirs, MoE(cfg), {"experts.up_proj": "experts.gate_up_proj"})


@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 8), (8, 1)])
def test_router_losses_equal_transformers_load_balancing_loss(experts, top_k):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(40, experts, generator=g, requires_grad=True) for _ in range(3)]
    stats = RouterStats(experts)
    for logits in layers:
        stats.add(logits, torch.topk(torch.softmax(logits, -1), top_k, dim=-1).indices)
    got = stats.losses(1.0, 0.0)
    want = load_balancing_loss_func(tuple(layers), experts, top_k)
    torch.testing.assert_close(got.aux_loss, want.detach(), **TOL)
    torch.testing.assert_close(got.share, want, **TOL)  # one process: the share is all
    for a, b in zip(torch.autograd.grad(got.share, layers), torch.autograd.grad(want, layers)):
        torch.testing.assert_close(a, b, **TOL)
    z = torch.cat([torch.logsumexp(x, -1) for x in layers]).square().mean()
    torch.testing.assert_close(stats.losses(0.0, 1.0).share, z, **TOL)


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_sequence_balance_loss_is_deepseek_v3s(score):
    """DeepSeek-V3's eqs. 17-20 written out per sequence (f_e = E/(kT) c_e, P_e the mean of
    the normalised scores, sum_e f_e P_e), averaged over the rows and summed over the layers:
    RouterStats' value and share (one process: the share is all) and their gradients."""
    E, k, B, T = 8, 2, 3, 10
    g = torch.Generator().manual_seed(2)
    layers = [torch.randn(B * T, E, generator=g, requires_grad=True) for _ in range(2)]
    stats, want = RouterStats(E, score, sequences=True), 0.0
    for logits in layers:
        s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
        chosen = torch.topk(s, k, dim=-1).indices
        stats.add(logits, chosen, batch=B)
        for b in range(B):  # each sequence on its own
            rows = slice(b * T, (b + 1) * T)
            f = E / (k * T) * torch.bincount(chosen[rows].reshape(-1), minlength=E)
            P = (s[rows] / s[rows].sum(-1, keepdim=True)).mean(0)
            want = want + (f * P).sum() / B
    got = stats.losses(0.0, 0.0, seq_coef=1.0)
    torch.testing.assert_close(got.seq_aux_loss, want.detach(), **TOL)
    torch.testing.assert_close(got.share, want, **TOL)
    for a, b in zip(torch.autograd.grad(got.share, layers), torch.autograd.grad(want, layers)):
        torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------ a MoE GPT over the grid

N, BATCH, SEED = 32, 4, 3
GPT_CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                      seq_len=N, ffn_hidden=48, tie_embeddings=False,
                      moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=24,
                                    shared_expert_hidden=16, shared_expert_gate=True,
                                    aux_loss_coef=0.1, z_loss_coef=0.01))


def _batch():
    return random_batch(64, BATCH, N, seed=7)


def _set_biases(model):
    """Distinct correction biases per layer (the same on every rank), wide enough to change
    the choice: each layer's e_score_correction_bias where it has one."""
    g = torch.Generator().manual_seed(11)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _biases(model):
    return {n: b.clone() for n, b in model.named_buffers() if "e_score_correction" in n}


def _reference(cfg, cu_seqlens=None):
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    _set_biases(model)
    tokens, labels = _batch()
    loss = model(tokens, torch.arange(N), labels, cu_seqlens=cu_seqlens) / \
        (labels != -100).sum()
    r = model.router_losses
    (loss + r.share).backward()
    model.update_router_biases(r.layer_counts)
    return (loss.detach(), r.aux_loss, r.z_loss,
            {n: p.grad.clone() for n, p in model.named_parameters()}, _biases(model),
            r.seq_aux_loss)


def _reference_rows_apart(cfg):
    """One process, each sample row a forward of its own (a capacity factor's N is a
    rank's tokens: at cp 1 x dp 4 one row); the token loss and gradients only (no router
    loss in the step, their values per row not the batch's)."""
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens, labels = _batch()
    loss = sum(model(tokens[b:b + 1], torch.arange(N), labels[b:b + 1])
               for b in range(BATCH)) / (labels != -100).sum()
    loss.backward()
    return (loss.detach(), None, None,
            {n: p.grad.clone() for n, p in model.named_parameters()}, {}, None)


def _grid_case(rank, world, payload):
    import torch.distributed as dist
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from models.loss import global_mean_loss, global_token_count, loss_for_backward
    out = []
    for routing, (tp, cp, ep, layout, comm) in pickle.loads(payload):
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp), ep=ep)
        model = GPT(ROUTINGS[routing], ModelGroups.from_state(st),
                    ModelOptions(layout=layout, cp_comm=comm, seed=SEED,
                                 memory=TILED.get(routing, MemoryConfig()),
                                 activation_checkpointing=RECOMPUTE.get(routing, "none")))
        _set_biases(model)
        tokens, labels = _batch()
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout) for t in (tokens, labels))
        dp = st.dp_size
        tok, lab = tok.chunk(dp)[st.dp_rank], lab.chunk(dp)[st.dp_rank]
        pos = sequence_positions(N, st.cp_group, layout)
        n = global_token_count(lab, st.dp_cp_group)
        reset_moe_stats()
        loss_sum = model(tok, pos, lab, cu_seqlens=PACKED.get(routing))
        r = model.router_losses
        (loss_for_backward(loss_sum, n, dp) + r.share * dp).backward()
        for p in model.parameters():  # DeepSpeed's reduction: experts over their EDP group
            group = st.edp_group if getattr(p, "expert_shard", (0, 1))[1] > 1 \
                else st.dp_cp_group
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
        model.update_router_biases(r.layer_counts)  # the step's counts over DP x CP
        out.append(dict(biases=_biases(model), seq=r.seq_aux_loss, loss=global_mean_loss(loss_sum, n, st.dp_cp_group),
                        aux=r.aux_loss, z=r.z_loss, grads=gather_full_state_dict(model, st.tp_group, True, st.ep_group),
                        stats=moe_stats()))
    out.append(_dispatch_bytes_case(rank, world))
    return out


GRIDS = [  # (tp, cp, ep, layout, cp_comm) on 4 ranks; dp = 4 / (tp cp)
    (1, 2, 2, "zigzag", "ring"),       # ep = cp: the experts over each sequence's ranks
    (1, 2, 4, "striped", "allgather"), # ep = dp x cp: over two sequences' ranks
    (1, 4, 4, "contiguous", "ulysses"),
    (2, 2, 2, "zigzag", "ring"),       # each expert's width over TP too
    (1, 1, 2, "zigzag", "ring"),       # no CP: ep over DP alone (dp 4)
]

# The routers of the open models, each on the grids where its experts split differently.
ROUTINGS = {
    "top2": GPT_CFG,  # Qwen2-MoE / Qwen3-Next: top-2 of 8, a gated shared expert
    # Qwen3-30B-A3B's top-8 of 16 (it has 128) with an ungated shared expert (DeepSeek's)
    "top8": replace(GPT_CFG, moe=replace(GPT_CFG.moe, num_experts=16, top_k=8,
                                         shared_expert_gate=False)),
    # Switch: top-1, the weight its softmax probability (the router's gradient flows
    # through the output, not only the losses)
    "top1": replace(GPT_CFG, moe=replace(GPT_CFG.moe, top_k=1, norm_topk=False,
                                         shared_expert_hidden=0, shared_expert_gate=False)),
    # DeepSeek-V3: sigmoid, top-4 of 16 chosen with the correction bias in 2 of 4 groups,
    # scaled weights, an ungated shared expert, the aux-free bias update
    "deepseek": replace(GPT_CFG, moe=replace(
        GPT_CFG.moe, num_experts=16, top_k=4, score="sigmoid", score_correction_bias=True,
        bias_update_rate=0.01, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        shared_expert_gate=False, aux_loss_coef=0.0, seq_aux_loss_coef=0.1)),
}
# Three documents packed in each row (attention stays inside each; the sequence-level loss
# is the row's: its counts over the row's CP ranks)
PACKED = {"deepseek": torch.tensor([0, 12, 20, N], dtype=torch.int32)}
# A capacity of ceil(0.5 x 32 x 2 / 8) = 4 assignments per expert and layer on a rank's one
# row: half of them dropped at least, before and across the EP all-to-all
# The experts tiled along the sequence (memory.tiled_mlp): a rank's 2 x 16 tokens in tiles
# of 5 (six and a short one), each dispatched, computed and combined alone: the untiled
# DeepSeek run's numbers (the reference is the same model's)
ROUTINGS["deepseek_tiled"], PACKED["deepseek_tiled"] = ROUTINGS["deepseek"], PACKED["deepseek"]
TILED = {"deepseek_tiled": MemoryConfig(tiled_mlp=True, mlp_tile_tokens=5)}
# ... and with the blocks recomputed (whole, or selective's MLP half): the recompute skips
# the tiles' experts (models/moe.py SkipTiles), and every gradient, loss and count is still
# the untiled run's
for mode in ("full", "selective"):
    ROUTINGS[f"deepseek_tiled_{mode}"] = ROUTINGS["deepseek"]
    PACKED[f"deepseek_tiled_{mode}"] = PACKED["deepseek"]
    TILED[f"deepseek_tiled_{mode}"] = TILED["deepseek_tiled"]
RECOMPUTE = {"deepseek_tiled_full": "full", "deepseek_tiled_selective": "selective"}
ROUTINGS["capacity"] = replace(GPT_CFG, moe=replace(GPT_CFG.moe, capacity_factor=0.5,
                                                    aux_loss_coef=0.0, z_loss_coef=0.0))
CASES = [("top2", grid) for grid in GRIDS] + [
    ("top8", (1, 2, 4, "striped", "allgather")),  # 4 of the 16 experts a rank
    ("top8", (2, 2, 2, "zigzag", "ring")),
    ("top1", (1, 4, 4, "contiguous", "ulysses")),
    ("top1", (1, 1, 2, "zigzag", "ring")),
    ("deepseek", (1, 2, 2, "zigzag", "ring")),   # each rank's half of each sequence
    ("deepseek", (1, 4, 4, "contiguous", "ulysses")),
    ("deepseek", (2, 2, 2, "striped", "allgather")),
    ("deepseek", (1, 1, 2, "zigzag", "ring")),     # cp 1: whole rows on each rank
    ("capacity", (1, 1, 2, "zigzag", "ring")),     # dp 4: a row a rank, as the reference's
    ("capacity", (1, 1, 4, "zigzag", "ring")),
    ("deepseek_tiled", (1, 2, 2, "zigzag", "ring")),
    ("deepseek_tiled_full", (1, 2, 2, "zigzag", "ring")),
    ("deepseek_tiled_selective", (1, 2, 2, "zigzag", "ring")),
]


@pytest.fixture(scope="module")
def grid_results():
    return run_distributed(_grid_case, 4, pickle.dumps(CASES), timeout=240)


def test_moe_gpt_over_the_grid_equals_one_process(grid_results):
    results = grid_results
    references = {name: _reference_rows_apart(cfg) if cfg.moe.capacity_factor else
                  _reference(cfg, PACKED.get(name)) for name, cfg in ROUTINGS.items()}
    for i, (routing, grid) in enumerate(CASES):
        loss, aux, z, grads, biases, seq = references[routing]
        for rank, per_case in enumerate(results):
            got, where = per_case[i], f"{routing} tp,cp,ep,layout,comm={grid} rank {rank}"
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            for key, want in (("aux", aux), ("z", z), ("seq", seq)):
                if want is not None:
                    torch.testing.assert_close(got[key], want, **TOL, msg=f"{where} {key}")
            for name, g in grads.items():
                torch.testing.assert_close(got["grads"][name], g, **TOL,
                                           msg=f"{where} grad {name}")
            assert got["biases"].keys() == biases.keys()
            for name, b in biases.items():  # counts: exact; the biases' update: exact
                assert torch.equal(got["biases"][name], b), f"{where} {name}"
            # per layer one all-to-all pair; tiled, one a tile, and again as backward
            # replays each tile (7 tiles of a rank's 32 tokens); none more in the blocks'
            # recompute (its tiles skipped)
            calls = GPT_CFG.n_layers * (2 * 7 if routing in TILED else 1)
            assert got["stats"]["dispatch_calls"] == (calls if grid[2] > 1 else 0), where


def test_an_expert_without_tokens_gets_a_zero_gradient():
    """A router that never picks experts 6 and 7 (their logits' bias far below): the run
    goes on, their weights' gradients are zeros, the others' are not."""
    cfg = _moe_cfg(router_bias=True, shared_expert_hidden=16)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.bias[6:] = -1e4
    moe(torch.randn(2, 16, 32)).square().sum().backward()
    assert moe.experts.gate_up_proj.grad[6:].abs().max() == 0
    assert moe.experts.down_proj.grad[6:].abs().max() == 0
    assert moe.experts.gate_up_proj.grad[:6].abs().amax(dim=(1, 2)).min() > 0


def _tiled_run(cfg, x, dy, tile):
    """A MoE layer tiled at `tile` (None: untiled): its output, x's and every parameter's
    gradient, and the peak live bytes of a second forward + backward."""
    from ctxpar.testing.memory import LiveBytes
    torch.manual_seed(1)
    moe = MoE(cfg, tile=tile)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    xi = x.clone().requires_grad_()
    out = moe(xi)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    dx = xi.grad.clone()
    moe.zero_grad(set_to_none=True)
    xi.grad = None
    with LiveBytes() as live:
        moe(xi).backward(dy)
    return out.detach(), dx, grads, live.peak


def test_tiled_experts_equal_the_untiled_layer_and_hold_one_tiles_buffers():
    """memory.tiled_mlp on a MoE layer (one process, fp32): 512 tokens in tiles of 64
    give the untiled layer's output, input gradient and every parameter gradient (the
    tiles' sums in another order), and the step's peak live bytes fall below half the
    untiled layer's: the dispatch buffers and expert intermediates exist one tile at a
    time (models/moe.py)."""
    cfg = _moe_cfg(expert_hidden=128, shared_expert_hidden=16)
    torch.manual_seed(0)
    x = torch.randn(1, 512, cfg.d_model)
    dy = torch.randn(1, 512, cfg.d_model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the 2-core machine is shared: one thread is the fastest
    try:
        runs = [_tiled_run(cfg, x, dy, tile) for tile in (None, 64)]
    finally:
        torch.set_num_threads(threads)
    (out, dx, grads, untiled), (t_out, t_dx, t_grads, tiled) = runs
    torch.testing.assert_close(t_out, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(t_dx, dx, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        # a weight's gradient sums 512 tokens' terms, in tiles: fp32 order, ~1e-6 of it
        torch.testing.assert_close(t_grads[name], g, rtol=0, atol=1e-6 * g.abs().max().item(),
                                   msg=name)
    assert tiled < 0.5 * untiled, (tiled, untiled)


@pytest.mark.parametrize("post_norms", [pytest.param(False, marks=pytest.mark.quick), True])
def test_a_recomputed_block_skips_its_tiled_experts_where_nothing_keeps_their_output(post_norms):
    """Tiled experts under whole-block recompute (one process, fp32, 2 layers, 64 tokens in
    13 tiles of 5): loss, router losses and every gradient equal the untiled layer's without
    recompute, and the experts run once a tile in forward and once in its backward replay,
    none in the block's recompute (models/moe.py SkipTiles); with model.post_norms the
    post-MLP norm keeps the layer's output, so the recompute runs them too."""
    cfg = replace(ROUTINGS["deepseek"], post_norms=post_norms)
    tokens, labels = (t[:2] for t in _batch())

    def run(memory, mode):
        model = GPT(cfg, options=ModelOptions(seed=SEED, memory=memory,
                                              activation_checkpointing=mode))
        calls = []
        for m in model.modules():
            if isinstance(m, MoE):
                m.experts.register_forward_hook(lambda *_: calls.append(1))
        loss = model(tokens, torch.arange(N), labels) / labels.numel()
        r = model.router_losses
        (loss + r.share).backward()
        return ([loss.detach(), r.z_loss, r.seq_aux_loss, r.layer_counts],
                {n: p.grad for n, p in model.named_parameters()}, len(calls))

    want, grads, _ = run(MemoryConfig(), "none")
    got, t_grads, calls = run(MemoryConfig(tiled_mlp=True, mlp_tile_tokens=5), "full")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(t_grads[name], g, rtol=0, atol=1e-6 * g.abs().max().item(),
                                   msg=name)
    assert calls == cfg.n_layers * 13 * (3 if post_norms else 2)


def test_a_capacity_factor_drops_the_assignments_past_each_experts_capacity():
    """capacity = ceil(cf N k / E) over the layer's N tokens, taken in token order: the
    dropped assignments by hand, and the layer equals the dropless one with their weights
    zeroed (output, every gradient) while its experts run on the kept rows only."""
    from ctxpar.moe import dispatch_combine, drop_over_capacity, route
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [1, 0], [2, 3]])
    # capacity ceil(1.0 x 6 x 2 / 4) = 3: expert 0's 4th and 5th (tokens 3, 4) drop
    assert drop_over_capacity(chosen, 4, 1.0).tolist() == \
        [[0, 1], [0, 2], [0, 1], [3, -1], [1, -1], [2, 3]]
    assert drop_over_capacity(chosen, 4, 1.5).tolist() == chosen.tolist()  # capacity 5
    torch.manual_seed(0)
    moe = MoE(_moe_cfg(router_bias=True, capacity_factor=1.0))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.bias[0] = 2.0  # expert 0 over-subscribed
    x = torch.randn(2, 16, 32)
    rows = []
    run = moe.experts.forward
    moe.experts.forward = lambda r, c: rows.append(sum(c)) or run(r, c)
    got = moe(x)
    del moe.experts.forward
    weights, chosen = route(moe.gate(x.view(-1, 32)), 2)
    kept = drop_over_capacity(chosen, 8, 1.0) >= 0
    assert 0 < (~kept).sum() and rows == [int(kept.sum())], rows  # some dropped, not run
    want = dispatch_combine(x.view(-1, 32), weights * kept, chosen, 8, moe._experts)
    torch.testing.assert_close(got.view(-1, 32), want, **TOL)
    params = list(moe.parameters())
    for a, b in zip(torch.autograd.grad(got.sum(), params),
                    torch.autograd.grad(want.sum(), params)):
        torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------ through train.py

# Layer 0 the MoE, layer 1 dense: one layer's experts in their optimizer group, so under
# ZeRO an expert tensor's fp32 partition boundary falls inside it (EDP ranks hold pieces),
# and under a pipeline the routers' statistics cross from the first stage to the last.
MOE_RUN = ["model.moe={num_experts: 4, top_k: 2, expert_hidden: 64, aux_loss_coef: 0.01, "
           "z_loss_coef: 0.001, shared_expert_hidden: 32, shared_expert_gate: true, "
           "layers: [0]}",
           "train.steps=6", "train.eval_samples=8", "logging.wandb.mode=disabled"]


# The same micro-batches on every layout (micro_batch_size x dp = 4 samples each, four a
# step): the routers' losses are a micro-batch's statistics over DP x CP
# (models/moe_steps.py), so they are the same numbers on every layout.
ONE_MICRO_BATCH = {1: "train.micro_batch_size=4", 2: "train.micro_batch_size=2"}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moe") / "cp1")
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", ONE_MICRO_BATCH[1], *MOE_RUN])
    return d


@pytest.mark.parametrize("dp,sets", [
    (2, ["parallel.cp=2", "parallel.ep=4", "deepspeed.zero_optimization.stage=2"]),
    (1, ["parallel.tp=2", "parallel.cp=2", "parallel.cp_comm=ulysses", "parallel.ep=2"]),
    (1, ["parallel.cp=2", "parallel.pp=2", "activation_checkpointing.mode=full"]),
], ids=["cp2-dp2-ep4-zero2", "tp2-cp2-ulysses-ep2", "cp2-pp2-recompute"])
def test_train_py_logs_cp1s_losses_with_the_routers_losses(moe_reference, tmp_path, dp, sets):
    """The token loss and the gradient norm (which carries the routers' losses' gradients)
    equal cp 1's over 6 steps, and so do the routers' losses and the experts' load, with
    the experts split over ep ranks folded into DP x CP: their gradients summed over the
    expert-data-parallel group by DeepSpeed's MoE param groups (ZeRO 1 and 2;
    ctxpar/distributed/expert_parallel.py), and through the pipeline (each stage's routers'
    statistics travel to the last stage's loss with the activations, and their gradients
    back, the blocks recomputed in backward: models/gpt_pipe.py)."""
    d = str(tmp_path / "run")
    run_train(d, 4, [*sets, f"parallel.dp={dp}", ONE_MICRO_BATCH[dp], *MOE_RUN])
    assert_same_run(d, moe_reference, 6)
    _assert_same_router_metrics(d, moe_reference)


def _assert_same_router_metrics(d, moe_reference):
    for key in ("moe_aux_loss", "moe_z_loss", "moe_expert_load"):
        want, got = metric(moe_reference, key), metric(d, key)
        # Step 1 is before any update: the same numbers. Later the weights differ by the
        # reductions' order (~1e-6 after Adam's steps), enough to flip a token whose two
        # best experts' scores tie to that precision: one of the step's 8,192 assignments
        # (2 layers x 16 samples x 128 tokens x top-2) moves: 4.9e-4 of max / mean.
        for s in got:
            tol = 1e-5 if s == 1 else 1e-3
            assert abs(got[s] - want[s]) <= tol * abs(want[s]), (key, s, got[s], want[s])


# DeepSeek-V3's router: sigmoid, the correction bias and its aux-free update, 1 of 2
# groups, scaled weights, the sequence-level balance loss (and a z-loss).
DEEPSEEK_RUN = ["model.moe={num_experts: 8, top_k: 2, expert_hidden: 64, score: sigmoid, "
                "score_correction_bias: true, bias_update_rate: 0.01, n_group: 2, "
                "topk_group: 1, routed_scaling_factor: 2.5, z_loss_coef: 0.001, "
                "seq_aux_loss_coef: 0.01, shared_expert_hidden: 32}",
                "train.steps=6", "train.eval_samples=8", "logging.wandb.mode=disabled",
                "checkpoint.save_interval=3"]
DEEPSEEK_CP2 = ["parallel.cp=2", "parallel.dp=2", "parallel.layout=zigzag",
                "train.micro_batch_size=4", *DEEPSEEK_RUN]


def _saved_biases(run_dir):
    path = f"{run_dir}/checkpoints/step_00000006/mp_rank_00_model_states.pt"
    module = torch.load(path, map_location="cpu", weights_only=False)["module"]
    return {k: v for k, v in module.items() if k.endswith("e_score_correction_bias")}


@pytest.fixture(scope="module")
def deepseek_runs(tmp_path_factory):
    """cp 1 at 8 micro-batches a step and cp2 x dp2 at 2, 6 steps, checkpoints at 3 and 6."""
    base = tmp_path_factory.mktemp("deepseek")
    ref, run = str(base / "cp1"), str(base / "cp2")
    run_train(ref, 1, ["parallel.cp=1", "parallel.dp=1", "train.micro_batch_size=2",
                       *DEEPSEEK_RUN])
    run_train(run, 4, DEEPSEEK_CP2)
    return ref, run


def test_train_py_moves_the_correction_biases_as_cp1_does(deepseek_runs):
    """DeepSeek-V3's router through train.py: cp2 x dp2 at 2 micro-batches a step logs cp
    1's losses at 8 micro-batches, and both checkpoints hold the same moved correction
    biases after 6 steps: the aux-free update counts the step's whole batch, every rank
    and micro-batch (models/moe_steps.py), and the biases are saved with the model. The
    sequence-level loss (a mean over equal micro-batches' rows) is logged alike."""
    ref, run = deepseek_runs
    assert_same_run(run, ref, 6)
    want, got = metric(ref, "moe_seq_aux_loss"), metric(run, "moe_seq_aux_loss")
    for s in got:
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])
    want, got = _saved_biases(ref), _saved_biases(run)
    assert sorted(want) == sorted(got) == [f"layers.{i}.mlp.gate.e_score_correction_bias"
                                           for i in range(2)], sorted(got)
    for name, b in want.items():  # integer counts, the same signs: the same sums of +-rate
        assert b.abs().max() > 0 and torch.equal(got[name], b), (name, got[name], b)


@pytest.mark.parametrize("nproc,layout", [
    (4, DEEPSEEK_CP2),
    (2, ["parallel.cp=2", "parallel.dp=1", "parallel.ep=2", "train.micro_batch_size=4",
         *DEEPSEEK_RUN]),
], ids=["same-layout", "dp1-ep2"])
def test_a_resumed_deepseek_run_restores_its_correction_biases(deepseek_runs, tmp_path, nproc,
                                                               layout):
    """cp2 x dp2 resumed from its step-3 checkpoint logs the same losses at steps 4-6 and
    saves the same biases at step 6 as the run that went on: at the same layout (DeepSpeed's
    own load: the module's buffers with its parameters) and at cp2 x ep2, dp 1 (the
    universal conversion, which holds parameters only, and the biases from the model file it
    keeps: ctxpar/checkpoint/universal.py saved_buffers)."""
    _, run = deepseek_runs
    tag = "step_00000003"
    shutil.copytree(f"{run}/checkpoints/{tag}", tmp_path / "checkpoints" / tag)
    run_train(str(tmp_path), nproc, layout, extra=["--resume", "auto"])
    want, got = losses(run), losses(str(tmp_path))
    tol = 1e-6 if layout is DEEPSEEK_CP2 else 1e-5  # the same reductions, or reordered
    assert sorted(got) == [4, 5, 6] and all(
        abs(got[s] - want[s]) <= tol * abs(want[s]) for s in got), (got, want)
    want, got = _saved_biases(run), _saved_biases(str(tmp_path))
    assert len(want) == 2 and want.keys() == got.keys() and all(
        torch.equal(got[k], want[k]) for k in want)


# Pipeline x EP: each stage's experts split over its EP group (folded into its dp x cp),
# with DeepSeek's router: the bias update and the sequence-level loss through the stages.
ZERO0 = "deepspeed.zero_optimization.stage=0"
PP1_EP1 = ["parallel.cp=1", "parallel.dp=1", "train.micro_batch_size=4", *DEEPSEEK_RUN]
CP2_PP2_EP2 = ["parallel.cp=2", "parallel.pp=2", "parallel.ep=2", "parallel.dp=1",
               "train.micro_batch_size=4", *DEEPSEEK_RUN]
PP2_DP2_EP2 = ["parallel.cp=1", "parallel.pp=2", "parallel.ep=2", "parallel.dp=2",
               "train.micro_batch_size=2", ZERO0, *DEEPSEEK_RUN]
# {case: (its layout, [(resumed on, processes, its layout, tolerance against the run)])}:
# the same layout bit for bit (ZeRO-1; ZeRO-0's own files resume as at pp 1), pp 1 x ep 1
# through the universal conversion (reductions reordered).
DEEPSEEK_PP = {
    "cp2-pp2-ep2-zero1": (CP2_PP2_EP2, [("again", 4, CP2_PP2_EP2, 0.0),
                                        ("pp1-ep1", 1, PP1_EP1, 1e-5)]),
    "pp2-dp2-ep2-zero0": (PP2_DP2_EP2, [("pp1-ep1", 1, [*PP1_EP1, ZERO0], 1e-5)]),
    # the experts tiled (a rank's 4 x 64 tokens in tiles of 48), the blocks recomputed
    "cp2-pp2-ep2-tiled-recompute": ([*CP2_PP2_EP2, "memory.tiled_mlp=true",
                                     "memory.mlp_tile_tokens=48",
                                     "activation_checkpointing.mode=full"], []),
}


def _strict(want_dir, got_dir, keys, rtol):
    for key in keys:
        want, got = metric(want_dir, key), metric(got_dir, key)
        assert got and set(got) <= set(want), (key, sorted(got))
        for s in got:
            assert abs(got[s] - want[s]) <= rtol * abs(want[s]), (key, s, got[s], want[s])


def _layer_file_biases(run_dir):
    """A pipelined run's step-6 correction biases by GPT name (DeepSpeed's layer files:
    layer_XX holds block XX - 1)."""
    step = f"{run_dir}/checkpoints/step_00000006"
    return {f"layers.{i}.mlp.gate.e_score_correction_bias": torch.load(
        f"{step}/layer_{i + 1:02d}-model_00-model_states.pt", map_location="cpu",
        weights_only=False)["mlp.gate.e_score_correction_bias"] for i in range(2)}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_PP))
def test_pipeline_x_expert_parallel_trains_resumes_and_reshards_as_cp1(deepseek_runs, tmp_path,
                                                                      name):
    """pp2 x ep2 (one MoE layer a stage), cp2 at ZeRO-1 (also with the experts tiled and
    the blocks recomputed) and dp2 at ZeRO-0: the experts'
    gradients reduced over their EDP group inside a stage (DeepSpeed's MoE path, the
    pipeline's data-axis reduction left to the dense ones: ctxpar/distributed/
    expert_parallel.py), the gradient norm over every stage and EP rank, the sequence-level
    loss's per-layer shares carried with the activations and each stage's layers' counts
    moving their own biases (models/gpt_pipe.py). Over 6 steps the loss, gradient norm, z
    and sequence-level losses and the experts' load equal cp 1's (fp32, reductions
    reordered: 1e-5; the load-balancing loss's value is the micro-batch's, and cp 1 runs
    2 rows a micro-batch, so it is left out), and the step-6 biases are cp 1's exactly
    (sums of +-rate from integer counts). The step-3 checkpoint resumes on its layout bit
    for bit, and at pp 1 x ep 1 through the universal conversion (each stage's experts
    whole from every EP rank's ZeRO shard or ZeRO-0 file, the biases from the layer files)
    to cp 1's losses at 1e-5."""
    ref, _ = deepseek_runs
    sets, resumes = DEEPSEEK_PP[name]
    run = tmp_path / "run"
    run_train(str(run), 4, sets)
    keys = ("loss", "grad_norm", "moe_z_loss", "moe_seq_aux_loss", "moe_expert_load")
    _strict(ref, str(run), keys, 1e-5)
    want = _saved_biases(ref)
    assert all(torch.equal(b, want[k]) and b.abs().max() > 0
               for k, b in _layer_file_biases(str(run)).items())
    tag = "step_00000003"
    for where, nproc, layout, rtol in resumes:
        d = tmp_path / where
        shutil.copytree(run / "checkpoints" / tag, d / "checkpoints" / tag)
        run_train(str(d), nproc, layout, extra=["--resume", "auto"])
        assert sorted(losses(str(d))) == [4, 5, 6], where
        _strict(str(run), str(d), ("loss", "grad_norm"), rtol)


def test_generate_py_loads_the_saved_correction_biases(deepseek_runs):
    """generate.py's loader (ctxpar/inference/checkpoint.py) takes the cp2 x dp2 run's step-6
    checkpoint, biases included, into a one-process model (they were 'unexpected' names)."""
    from ctxpar.inference.checkpoint import (find_checkpoint, inspect_checkpoint,
                                             load_run_config, load_weights_)
    _, run = deepseek_runs
    ckpt = find_checkpoint(run)
    model = GPT(load_run_config(ckpt).model)
    load_weights_(model, inspect_checkpoint(ckpt.path), None)
    saved, loaded = _saved_biases(run), dict(model.named_buffers())
    assert len(saved) == 2 and all(torch.equal(loaded[k], b) for k, b in saved.items())


@pytest.mark.parametrize("model, parallel, msg", [
    ({"moe": {"num_experts": 4, "top_k": 5}}, {}, "model.moe.top_k=5 must be in [1, "
                                                  "model.moe.num_experts=4]"),
    ({"moe": {"num_experts": 6}}, {"ep": 4, "cp": 4}, "model.moe.num_experts=6 is not "
                                                      "divisible by parallel.ep=4"),
    ({"moe": {"num_experts": 8}}, {"ep": 4, "cp": 2}, "parallel.ep=4 must divide dp x cp = "
                                                      "1 x 2"),
    ({}, {"ep": 2, "cp": 2}, "parallel.ep=2 without model.moe"),
    ({"moe": {"score": "sigmoid", "aux_loss_coef": 0.01}}, {},
     "model.moe.aux_loss_coef=0.01 with model.moe.score='sigmoid'"),
    ({"moe": {"shared_expert_gate": True}}, {}, "model.moe.shared_expert_gate=true needs"),
    ({"moe": {"layers": [0, 5]}, "n_layers": 4}, {}, "model.moe.layers=[0, 5] must be"),
    ({"moe": {"layers": [1, 0]}, "n_layers": 2, "layer_types": ["mamba", "mlp"]}, {},
     "model.moe.layers=[1, 0]: layer 0 is a 'mamba' block, which has no MLP"),
    ({"moe": {"num_experts": 8}, "zero": 3}, {"ep": 2, "cp": 2, "tp": 2},
     "not built with parallel.ep=2, parallel.tp=2 and deepspeed.zero_optimization.stage=3"),
    ({"moe": {"num_experts": 8}, "zero": 0, "bf16": True}, {"ep": 2, "cp": 2},
     "not built with parallel.ep=2, deepspeed.zero_optimization.stage=0 and "
     "deepspeed.bf16.enabled=true"),
    ({"moe": {"num_experts": 8, "layers": [0]}, "n_layers": 2, "zero": 1},
     {"pp": 2, "cp": 2, "ep": 2}, "parallel.pp=2 and parallel.ep=2: pipeline stage 1 "
                                  "(blocks [1], parallel.pp_partition='parameters') has no "
                                  "MoE layer"),
    ({"moe": {"num_experts": 8}, "memory": {"tiled_mlp": True, "mlp_tile_tokens": 0}},
     {"ep": 2, "cp": 2}, "memory.mlp_tile_tokens=0 must be 'auto' or an integer >= 1"),
    ({"moe": {"swiglu_limit": 7.0}, "mlp": "gelu"}, {}, "model.moe.swiglu_limit=7.0 needs "
                                                        "model.mlp='swiglu'"),
    ({"swiglu_limit": 10.0, "mlp": "geglu"}, {}, "model.swiglu_limit=10.0 needs "
                                                 "model.mlp='swiglu'"),
    ({"swiglu_limit": 10.0, "moe": {"swiglu_limit": 7.0}}, {},
     "model.swiglu_limit=10.0 (DeepSeek-V4's clamp) and model.moe.swiglu_limit=7.0"),
    ({"moe": {"bias_update_rate": 0.001}}, {}, "model.moe.bias_update_rate=0.001 must be >= 0 "
                                               "and needs model.moe.score_correction_bias"),
    ({"moe": {"score_correction_bias": True, "bias_update_rate": -1}}, {},
     "model.moe.bias_update_rate=-1"),
    ({"moe": {"seq_aux_loss_coef": -0.1}}, {}, "model.moe.seq_aux_loss_coef=-0.1 must be"),
    ({"moe": {"capacity_factor": 0}}, {}, "model.moe.capacity_factor=0.0 must be > 0 (null: "
                                          "dropless)"),
    ({"moe": {"capacity_factor": -1.25}}, {}, "model.moe.capacity_factor=-1.25 must be > 0"),
    ({"moe": {"routed_scaling_factor": 0}}, {}, "model.moe.routed_scaling_factor=0.0 must be"),
    ({"moe": {"num_experts": 8, "n_group": 3}}, {}, "model.moe.n_group=3 must be >= 1 and "
                                                    "divide model.moe.num_experts=8"),
    ({"moe": {"num_experts": 8, "n_group": 8}}, {}, "model.moe.n_group=8 must be"),
    ({"moe": {"num_experts": 8, "n_group": 2, "topk_group": 3}}, {},
     "model.moe.topk_group=3 must be in [1, model.moe.n_group=2]"),
    ({"moe": {"num_experts": 8, "top_k": 6, "n_group": 4, "topk_group": 2}}, {},
     "model.moe.topk_group=2 must be in [1, model.moe.n_group=4] with room for "
     "model.moe.top_k=6"),
])
def test_bad_moe_configs_fail_at_load_in_one_line(model, parallel, msg):
    model = dict(model)
    zero = {"zero_optimization": {"stage": model.pop("zero")}} if "zero" in model else {}
    if model.pop("bf16", False):
        zero["bf16"] = {"enabled": True}
    memory = model.pop("memory", {})
    d = {"model": {"vocab_size": 256, **model}, "parallel": {"dp": 1, **parallel},
         "train": {"global_batch_size": 1}, "deepspeed": zero, "memory": memory}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d, check_paths=False)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_tp2_ep2_checkpoint_of_a_moe_resumes_at_tp1_ep1(moe_reference, tmp_path):
    """tp2 x cp2 x ep2's step-3 checkpoint (ZeRO-1; each expert's [gate | up] and down_proj
    split on their width, the experts over two ranks) through the universal conversion
    (the sub-parameter rule, ctxpar/checkpoint/universal.py; the experts' fragments by EP
    rank, expert_universal.py) at tp1 x cp2 x ep1 logs cp 1's losses to the end."""
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    run_train(str(tp2), 4, ["parallel.tp=2", "parallel.cp=2", "parallel.dp=1", "parallel.ep=2",
                            ONE_MICRO_BATCH[1], "checkpoint.save_interval=3", *MOE_RUN])
    tag = "step_00000003"
    shutil.copytree(tp2 / "checkpoints" / tag, tp1 / "checkpoints" / tag)
    proc = run_train(str(tp1), 2, ["parallel.cp=2", "parallel.dp=1", ONE_MICRO_BATCH[1],
                                   *MOE_RUN], extra=["--resume", "auto"])
    assert "resharded step_00000003" in proc.stdout and "tp 2->1" in proc.stdout \
        and "ep 2->1" in proc.stdout, proc.stdout[-2000:]
    want, got = losses(moe_reference), losses(str(tp1))
    assert sorted(got) == [4, 5, 6], sorted(got)
    for s in got:  # fp32 weights and Adam states restored exactly; reductions reordered
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])


def test_an_expert_parallel_checkpoint_resumes_on_its_layout_and_on_another_ep(
        moe_reference, tmp_path):
    """cp2 x dp2 x ep2 (zigzag; each expert's ZeRO partitions over its two EDP ranks) logs
    cp 1's losses and router metrics; its step-3 checkpoint resumes to cp 1's losses on
    its own layout (each rank's experts from its own ZeRO partition, not from the module
    file, which holds EP rank 0's) and, converted to the universal format expert by expert
    (ctxpar/checkpoint/expert_universal.py: fragments by EP rank, then EDP rank), on
    cp2 x ep2 (dp 1) under ZeRO-2."""
    run = tmp_path / "ep2"
    sets = ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2", "parallel.layout=zigzag",
            ONE_MICRO_BATCH[2], *MOE_RUN]
    run_train(str(run), 4, [*sets, "checkpoint.save_interval=3"])
    assert_same_run(str(run), moe_reference, 6)
    _assert_same_router_metrics(str(run), moe_reference)
    tag = "step_00000003"
    for name, nproc, layout in (
            ("again", 4, sets),
            ("dp1", 2, ["parallel.cp=2", "parallel.dp=1", "parallel.ep=2", ONE_MICRO_BATCH[1],
                        "deepspeed.zero_optimization.stage=2", *MOE_RUN])):
        d = tmp_path / name
        shutil.copytree(run / "checkpoints" / tag, d / "checkpoints" / tag)
        proc = run_train(str(d), nproc, layout, extra=["--resume", "auto"])
        assert ("dp 2->1" in proc.stdout) == (name == "dp1"), proc.stdout[-2000:]
        want, got = losses(moe_reference), losses(str(d))
        assert sorted(got) == [4, 5, 6], sorted(got)
        for s in got:  # fp32 weights and Adam states restored exactly; reductions reordered
            assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (name, s, got[s], want[s])


ZERO0_EP2 = ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2",
             "deepspeed.zero_optimization.stage=0", ONE_MICRO_BATCH[2], *MOE_RUN]


def test_a_zero0_expert_parallel_run_trains_saves_and_resumes_on_its_layout_and_at_ep1(
        moe_reference, tmp_path):
    """ZeRO-0 at cp2 x dp2 x ep2: the engine all-reduces the experts' gradients over their
    EDP group (ctxpar/distributed/expert_parallel.py) and the gradient norm sums the EP
    ranks' experts, so it logs cp 1's losses and gradient norms over 6 steps. Its step-3
    checkpoint keeps each EP rank's experts and optimizer state in a file of its own
    (ctxpar/checkpoint/expert_states.py; the module file holds EP rank 0's): resumed on its
    layout it continues with the saving run's losses and norms bit for bit, and converted to
    the universal format (the experts whole from the EP ranks' files) at cp 1 x ep 1 under
    ZeRO-1 it logs cp 1's."""
    run = tmp_path / "zero0"
    run_train(str(run), 4, [*ZERO0_EP2, "checkpoint.save_interval=3"])
    assert_same_run(str(run), moe_reference, 6)
    tag = "step_00000003"
    files = sorted(p.name for p in (run / "checkpoints" / tag).glob("experts_*"))
    assert files == ["experts_ep00_mp_rank_00.pt", "experts_ep01_mp_rank_00.pt"], files
    for name, nproc, layout in (
            ("again", 4, ZERO0_EP2),
            ("ep1", 1, ["parallel.cp=1", "parallel.dp=1", ONE_MICRO_BATCH[1], *MOE_RUN])):
        d = tmp_path / name
        shutil.copytree(run / "checkpoints" / tag, d / "checkpoints" / tag)
        proc = run_train(str(d), nproc, layout, extra=["--resume", "auto"])
        assert ("ep 2->1" in proc.stdout) == (name == "ep1"), proc.stdout[-2000:]
        want = str(run) if name == "again" else moe_reference
        rtol = 0.0 if name == "again" else 1e-5  # another layout: reductions reordered
        for key in ("loss", "grad_norm"):
            got, ref = metric(str(d), key), metric(want, key)
            assert sorted(got) == [4, 5, 6], sorted(got)
            for s in got:
                assert abs(got[s] - ref[s]) <= rtol * abs(ref[s]), (name, key, s, got[s], ref[s])


def test_zero3_partitions_the_experts_over_their_edp_group_and_resumes(moe_reference, tmp_path):
    """ZeRO-3 at cp2 x dp2 x ep2: the experts partitioned over their EDP group (two ranks
    holding the same experts) through DeepSpeed's stage-3 per-parameter groups, the rest
    over dp x cp (ctxpar/distributed/expert_parallel.py zero3_expert_placement), so each
    expert's gradient is reduce-scattered over its EDP group, divided by |dp x cp| like every
    other, and its norm added over the EP group: cp 1's losses and gradient norms over 6
    steps. Its step-3 checkpoint (every rank's partitions in its ZeRO shard, the experts'
    with the rest) resumes on its layout bit for bit."""
    run, again = tmp_path / "zero3", tmp_path / "again"
    sets = ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2",
            "deepspeed.zero_optimization.stage=3", ONE_MICRO_BATCH[2], *MOE_RUN]
    run_train(str(run), 4, [*sets, "checkpoint.save_interval=3"])
    assert_same_run(str(run), moe_reference, 6)
    tag = "step_00000003"
    shutil.copytree(run / "checkpoints" / tag, again / "checkpoints" / tag)
    run_train(str(again), 4, sets, extra=["--resume", "auto"])
    for key in ("loss", "grad_norm"):
        got, want = metric(str(again), key), metric(str(run), key)
        assert sorted(got) == [4, 5, 6] and all(got[s] == want[s] for s in got), (key, got, want)


def test_a_zero3_expert_parallel_checkpoint_is_refused_by_the_universal_conversion(tmp_path):
    """generate.py, model.init_from and the export read an ep > 1 checkpoint through the
    universal conversion, whose merge of ZeRO-3 shards assumes partitions over dp x cp: a
    ZeRO-3 checkpoint at ep 2 is refused in one line before anything is read."""
    from ctxpar.checkpoint.universal import to_universal
    layout = {"tp": 1, "cp": 2, "pp": 1, "dp": 2, "ep": 2, "zero_stage": 3, "dtype": "fp32"}
    with pytest.raises(ValueError, match=r"a ZeRO-3 checkpoint at ep=2 cannot be converted"):
        to_universal(str(tmp_path / "step_00000003"), str(tmp_path / "out"), layout, 2,
                     lambda n: n, 4)


def test_flops_count_the_active_experts():
    from ctxpar.config.parameters import active_parameters, parameter_specs
    specs = parameter_specs(GPT_CFG)
    experts = sum(s.numel() for s in specs if ".experts." in s.name)
    total = sum(s.numel() for s in specs)
    assert experts > 0 and active_parameters(GPT_CFG) == total - experts * (1 - 2 / 8)


def _dispatch_bytes_case(rank, world):
    """dispatch_combine over ep = world with every all_to_all_single's input bytes bound
    for another rank counted at the call (the counts' exchange included)."""
    import torch.distributed as dist
    import ctxpar.moe.dispatch as dispatch
    from ctxpar.moe import dispatch_combine

    sent = [0]

    class Counting:
        def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, group=None):
            rows = in_splits if in_splits is not None else [inp.shape[0] // world] * world
            row_bytes = inp[0].numel() * inp.element_size()
            sent[0] += sum(n for i, n in enumerate(rows) if i != rank) * row_bytes
            return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)

        def __getattr__(self, name):
            return getattr(dist, name)

    g = torch.Generator().manual_seed(rank)
    N, d, E, k = 37, 8, 8, 2
    x = torch.randn(N, d, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    experts[:5, 0] = 0  # skewed: rank 0's first expert gets more
    dispatch.dist, real = Counting(), dispatch.dist
    try:
        reset_moe_stats()
        dispatch_combine(x, torch.rand(N, k, generator=g), experts, E,
                         lambda rows, counts: rows * 2.0, dist.new_group(list(range(world))))
    finally:
        dispatch.dist = real
    owner = (experts // (E // world)).reshape(-1)         # the rank holding each choice
    return dict(sent=sent[0], stats=moe_stats(), d=d, count_bytes=(world - 1) * E // world * 8,
                to=torch.bincount(owner, minlength=world).tolist())


def test_the_all_to_all_sends_the_routed_rows_bytes(grid_results):
    """Every byte the dispatch hands the all-to-all for another rank is the counts' exchange
    or a routed row (out to the rank holding its expert, its result back): no padding, no
    capacity; moe_stats counts the same rows. Four ranks, ep 4, a skewed routing."""
    runs = [per_rank[-1] for per_rank in grid_results]
    to = [r["to"] for r in runs]  # to[r][j]: rank r's assignments to rank j's experts
    for rank, r in enumerate(runs):
        rows = sum(to[rank][j] + to[j][rank] for j in range(len(runs)) if j != rank)
        assert r["stats"]["rows_sent"] == rows, (rank, r)
        assert r["stats"]["bytes_sent"] == rows * r["d"] * 4, (rank, r)   # fp32 rows
        assert r["sent"] == r["stats"]["bytes_sent"] + r["count_bytes"], (rank, r)
