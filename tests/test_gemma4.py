"""Gemma 4's attention under CP: a tiny Gemma 4 GPT (sliding layers of head dim 24 beside
full layers of head dim 32 with one kv head whose values are their keys' projection, the
last two layers attending with layers 2's and 1's K/V, per-layer inputs, layer scalars,
logits capped at 2: each TP rank caps its vocabulary shard) at cp2 ring zigzag, cp2
Ulysses, cp2 all-gather (striped: the producers' gathered K/V held for the consumers),
tp2 x cp2 and hybrid u2 x r2, under each activation recompute: the loss and every
gradient (gathered over TP) equal one process's; the full layers' k_proj x travels
alone, K and V made where it arrives. The same with Gemma 4's experts beside every dense
MLP (26B-A4B's form: its router's scales, four experts, two a token) and the shared-KV
layers' MLPs twice as wide, at cp2 x ep2 and tp2 x cp2 x ep2 (the experts gathered over
EP). One spawn of four ranks, the layouts looped inside. The consumer layers read their
producer's K/V as the producer's own ranks hold them, so a layout that computed them
anew, or on other tokens, would change both; the folder's equality to transformers is
tests/test_hf.py's. The bytes: Ulysses' and the all-gather's consumers send no K/V, and
each layer's, per pattern, are the planner's (comm_bytes.layer_cp_bytes).
"""
import pickle
from dataclasses import replace

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.moe import MoEConfig
from ctxpar.config.parameters import parameter_specs
from ctxpar.tensor_parallel import gather_full_state_dict
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import RecordingSGD, random_batch
from models.gpt import GPT
from models.loss import global_mean_loss, global_token_count, loss_for_backward
from models.options import ModelGroups, ModelOptions

N, BATCH, SEED = 48, 2, 5
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
         "full_attention"]
GEMMA4 = ModelConfig(
    vocab_size=96, seq_len=N, n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, head_dim=24,
    ffn_hidden=96, mlp="geglu", norm_eps=1e-6, post_norms=True, scale_embeddings=True,
    qk_norm=True, query_pre_attn_scalar=1.0, layer_types=TYPES, sliding_window=6,
    rope_theta=1e6, rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
    layer_rope={"sliding_attention": {"rope_theta": 1e4}}, global_head_dim=32,
    global_n_kv_heads=1, attention_k_eq_v=True, value_norm=True, num_kv_shared_layers=2,
    per_layer_input_dim=16, layer_scalar=True, final_logit_softcapping=2.0)
# Gemma 4 26B-A4B's form (model.moe.beside_mlp): experts beside each dense MLP, Gemma 4's
# router; the shared-KV layers' (3, 4) MLPs twice as wide (model.double_wide_mlp)
GEMMA4_MOE = replace(GEMMA4, double_wide_mlp=True, moe=MoEConfig(
    num_experts=4, top_k=2, expert_hidden=24, beside_mlp=True, scaled_router=True))
MODELS = {"dense": GEMMA4, "moe": GEMMA4_MOE}
# fp32; CP reorders the softmax's sums (partials merged by LSE, gradients summed over CP
# and DP) over five layers: ~1e-6 of a tensor's largest value (sqrt(d)-scaled embeddings
# and softmax scale 1 make this model's gradients up to ~1), so each tensor is compared
# to 1e-5 of its own scale
TOL = dict(rtol=1e-5, atol=1e-6)


def close(got, want, msg):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=msg)


def _batch():
    return random_batch(96, BATCH, N, seed=11)


def reference(cfg, cu_seqlens=None):
    """One process: token-mean loss and every gradient (cu_seqlens: each sample's
    documents)."""
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    tokens, labels = _batch()
    loss = model(tokens, torch.arange(N), labels, cu_seqlens) / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _parity(rank, world, payload):
    import torch.distributed as dist
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence

    out = []
    for tp, cp, layout, comm, ckpt, ep, name in pickle.loads(payload):
        u = 2 if comm == "hybrid" else 1
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp), ep=ep, ulysses=u)
        model = GPT(MODELS[name], ModelGroups.from_state(st),
                    ModelOptions(layout=layout, cp_comm=comm, seed=SEED,
                                 activation_checkpointing=ckpt))
        tokens, labels = _batch()
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout, u) for t in (tokens, labels))
        pos = sequence_positions(N, st.cp_group, layout, ulysses=u)
        n_tokens = global_token_count(lab, st.dp_cp_group)
        loss_sum = model(tok, pos, lab)
        loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
        for p in model.parameters():  # DeepSpeed's reduction: experts over their EDP group
            group = st.edp_group if getattr(p, "expert_shard", (0, 1))[1] > 1 \
                else st.dp_cp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(st.dp_size)
        out.append(dict(loss=global_mean_loss(loss_sum, n_tokens, st.dp_cp_group),
                        grads=gather_full_state_dict(model, st.tp_group, True, st.ep_group)))
    out.append({case: _bytes_sent(world, *case) for case in BYTES_CASES})
    return out


# (cp, comm, layout, keys equal to values, recompute): the bytes on the wire, layer by
# layer (under 'full' the step's alone: the replay runs inside the blocks' backward)
BYTES_CASES = [(2, "ring", "zigzag", True, "none"),  # consumers send k_proj x again
               (2, "allgather", "zigzag", True, "none"),  # the windows' halo: per layer
               (2, "allgather", "striped", True, "none"),  # held slots: k_proj x, K,V
               (2, "allgather", "striped", False, "none"),
               (2, "ulysses", "zigzag", True, "none"),  # regrouped once by the producer
               (2, "ulysses", "zigzag", False, "none"),
               (4, "hybrid", "zigzag", True, "none"),  # u2 x r2: consumers send again
               (2, "allgather", "striped", True, "full")]  # the producers' replay gathers


def _bytes_sent(world, cp, comm, layout, k_eq_v, mode):
    """{'step': (forward, backward) bytes a rank sends in one step (dp beside), 'layers':
    each block's, forward from its forward hooks, backward between its full backward
    hooks (mode 'none' only)}."""
    from contextlib import ExitStack
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.context_parallel import cp_stats
    u = 2 if comm == "hybrid" else 1
    st = init_parallel_state(cp=cp, dp=world // cp, ulysses=u)
    model = GPT(replace(GEMMA4, attention_k_eq_v=k_eq_v), ModelGroups.from_state(st),
                ModelOptions(layout=layout, cp_comm=comm, seed=SEED,
                             activation_checkpointing=mode))
    tokens, labels = _batch()
    tok, lab = (shard_sequence(t, 1, st.cp_group, layout, u) for t in (tokens, labels))
    layers, opened = [], {}

    def count(i, phase, start):  # a cp_stats() block per (layer, phase), open or closed
        if start:
            opened[i, phase] = ExitStack()
            layers[i][phase] = opened[i, phase].enter_context(cp_stats())
        else:
            opened.pop((i, phase)).close()
    for i, block in enumerate(model.layers if mode == "none" else []):
        layers.append({})
        block.register_forward_pre_hook(lambda *_, i=i: count(i, "fwd", True))
        block.register_forward_hook(lambda *_, i=i: count(i, "fwd", False))
        block.register_full_backward_pre_hook(lambda *_, i=i: count(i, "bwd", True))
        block.register_full_backward_hook(lambda *_, i=i: count(i, "bwd", False))
    with cp_stats() as stats:
        model(tok, sequence_positions(N, st.cp_group, layout, ulysses=u), lab).backward()
    return dict(step=(stats.fwd_bytes_sent, stats.bwd_bytes_sent),
                layers=[(c["fwd"].fwd_bytes_sent, c["bwd"].bwd_bytes_sent) for c in layers])


CASES = [(1, 2, "zigzag", "ring", "none", 1, "dense"),  # dp2 beside: each CP pair its batch
         (1, 2, "zigzag", "ulysses", "selective", 1, "dense"),  # one global kv head to both
         (2, 2, "zigzag", "ring", "full", 1, "dense"),  # the global kv head replicated over TP
         (1, 2, "zigzag", "ring", "selective", 2, "moe"),  # the experts over each CP pair
         (2, 2, "zigzag", "allgather", "none", 2, "moe"),  # their widths over TP too
         (1, 2, "striped", "allgather", "none", 1, "dense"),  # consumers: the held gather
         (1, 4, "zigzag", "hybrid", "none", 1, "dense")]  # u2 x r2: k_proj x on both


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_parity, 4, pickle.dumps(CASES), timeout=240)


@pytest.fixture(scope="module")
def one_process():
    return {name: reference(cfg) for name, cfg in MODELS.items()}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_shared_kv_and_k_eq_v_over_cp_equal_one_process(world4, one_process, case):
    tp, cp, layout, comm, ckpt, ep, name = CASES[case]
    loss, grads = one_process[name]
    where = f"{name} tp{tp} cp{cp} ep{ep} {layout} {comm} {ckpt}"
    for rank, per_case in enumerate(world4):
        got = per_case[case]  # (the last entry: _bytes_sent's)
        torch.testing.assert_close(got["loss"], loss, **TOL, msg=f"{where} rank {rank}")
        assert sorted(got["grads"]) == sorted(grads)
        for n, g in grads.items():
            close(got["grads"][n], g, f"{where} rank {rank} grad {n}")


# ---------------------------------------------------------------- cp2 x pp2

# the last three layers share: block 2 reads block 0's K/V on the same stage, blocks 3 and 4
# read blocks 0's and 1's from the stage before
PIPE = replace(GEMMA4, num_kv_shared_layers=3)


def _pipe_parity(rank, world, payload):
    """cp2 x pp2 (and tp2 x pp2) through DeepSpeed's pipeline engine, blocks 0-2 on stage 0
    and 3-4 on stage 1 (uniform), two micro-batches (1F1B: stage 0 runs both forwards
    before the first backward, so a recomputed consumer must replay with its own
    micro-batch's K/V): the loss and every gradient, taken by the optimizer at its step
    (lr 0, no clipping) and gathered over TP under GPT's names; then pipeline_logits'
    logits of sample 0. With documents, their packed boundaries travel before the carried
    tensors (models/pipe_carry.py's tuple)."""
    import deepspeed
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.config import deepspeed_config
    from models.gpt_pipe import GPTPipe, pipeline_logits, train_step

    out = []
    for tp, cp, ckpt, offload, partition, docs in pickle.loads(payload):
        fields = {k: v for k, v in vars(PIPE).items() if v is not None}
        cfg = config_from_dict({
            "model": fields, "parallel": dict(tp=tp, cp=cp, pp=2, dp=1, pp_partition=partition),
            "train": dict(micro_batch_size=1, global_batch_size=BATCH, grad_clip=0.0,
                          seed=SEED),
            "data": dict(kind="tokens", path="unused"),
            "activation_checkpointing": dict(mode=ckpt),
            "memory": dict(offload_activations=offload)}, world_size=world,
            check_paths=False)
        st = init_parallel_state(tp=tp, cp=cp, pp=2, dp=1, order=cfg.parallel.order)
        ds_config = deepspeed_config(cfg, st.dp_size)
        model = GPTPipe.from_config(cfg, st, ds_config["gradient_accumulation_steps"])
        opt = RecordingSGD(model.parameters(), lr=0.0)  # the gradients it is handed
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        tokens, labels = _batch()
        pos = sequence_positions(N, st.cp_group, "zigzag")
        micro = [{"tokens": shard_sequence(tokens[b:b + 1], 1, st.cp_group, "zigzag"),
                  "labels": shard_sequence(labels[b:b + 1], 1, st.cp_group, "zigzag"),
                  "positions": pos, **({"cu_seqlens": [docs[b]]} if docs else {})}
                 for b in range(BATCH)]
        n_tokens = sum(global_token_count(mb["labels"], st.dp_cp_group) for mb in micro)
        loss = train_step(engine, micro, n_tokens, st)
        for p in model.parameters():  # the step's gradients, gathered over TP
            p.grad = opt.grads[p]
        grads = model.full_state_dict(grads=True)
        logits = pipeline_logits(model, st, micro[0])  # (1, T/cp, V/tp)
        out.append(dict(loss=loss, grads=grads, parts=model.parts, positions=pos,
                        logits=logits, vocab=st.tp_rank * PIPE.vocab_size // tp))
    return out


def test_shared_kv_and_per_layer_inputs_cross_pipeline_stages_exactly():
    from ctxpar.config.pipeline_stages import pipeline_stage_layers
    docs = [torch.tensor(cu, dtype=torch.int32) for cu in ([0, 20, 48], [0, 7, 31, 48])]
    # cp2: full recompute with what it keeps offloaded to host memory (the producers' (x,
    # k, v) outputs through ActivationOffload.run), selective with documents; tp2: each TP
    # rank's heads' K/V carried, the whole tuple sent by every TP rank
    modes = [(1, 2, "full", True, "uniform", None),
             (1, 2, "selective", False, "parameters", docs),
             (2, 1, "none", False, "uniform", None)]
    want = [reference(PIPE), reference(PIPE, docs), reference(PIPE)]
    world = run_distributed(_pipe_parity, 4, pickle.dumps(modes), timeout=240)
    model = GPT(PIPE, options=ModelOptions(seed=SEED))
    for i, mode in enumerate(modes):
        (loss, grads), seen = want[i], set()
        with torch.no_grad():  # sample 0's logits
            want_logits = model.lm_logits(model.hidden_states(
                _batch()[0][:1], torch.arange(N), cu_seqlens=mode[5] and mode[5][:1]))
        for rank, per_case in enumerate(world):
            got = per_case[i]
            where = f"tp, cp, pp2 {mode[:5]} documents {mode[5] is not None} rank {rank}"
            # uniform: blocks 0-2 | 3-4; by parameters: 0-1 | 2-4, as the config's check
            # predicts them (the first layer's per-layer embedding counted)
            stages = pipeline_stage_layers(PIPE, 2, mode[0], 1, mode[4])
            assert got["parts"][1] - 1 == stages[1].start == {"uniform": 3}.get(mode[4], 2)
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            for n, g in got["grads"].items():
                close(g, grads[n], f"{where} grad {n}")
                seen.add(n)
            if got["logits"] is not None:  # the last stage: its CP and TP shard
                rows = slice(got["vocab"], got["vocab"] + got["logits"].shape[-1])
                # 1e-5 of the logits' scale, as the gradients (TP sums in another order)
                close(got["logits"], want_logits[:, got["positions"], rows], where)
        assert seen == set(grads), set(grads) ^ seen  # the stages' union is every tensor


@pytest.mark.quick
@pytest.mark.parametrize("dim", [16, 512])
def test_pipeline_stages_count_the_per_layer_embedding_on_the_first(dim):
    """config.pipeline_stages (what pp x ep's check reads) splits as DeepSpeed does the
    pipeline's layers by parameters: the first holds the embedding and the per-layer
    input embedding (512 wide: a stage of its own), the tied head the embedding."""
    from deepspeed.runtime.utils import partition_balanced
    from ctxpar.config.pipeline_stages import pipeline_stage_layers
    cfg = replace(PIPE, per_layer_input_dim=dim)
    model = GPT(cfg)
    count = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
    weights = [count(model.embed, model.per_layer_input), *map(count, model.layers),
               count(model.final_norm), count(model.embed)]
    parts = partition_balanced(weights, 2)
    assert pipeline_stage_layers(cfg, 2, 1, 1, "parameters")[1].start == parts[1] - 1 == \
        {16: 2, 512: 0}[dim]


def test_ulysses_consumers_send_no_kv(world4):
    """Under Ulysses a producer's K/V are regrouped by heads once, its consumers attend with
    those (ulysses_heads_kv): a consumer layer's all-to-alls are q's and out's alone (and
    dout's and dq's), each all-to-all of b bytes a rank sending b/2 at cp2. K/V at Ulysses'
    kv-head width (the full layers' one head replicated to 2); the full layers' keys equal
    to values travel as one tensor (k_proj x, expanded on arrival: held_latent)."""
    B, S, H, e = BATCH, N // 2, 4, 4
    want = 0
    for i, kind in enumerate(TYPES):
        hd = 32 if kind == "full_attention" else 24
        q = B * S * H * hd * e                        # q and out alike
        tensors = 1 if kind == "full_attention" else 2  # k_eq_v: k_proj x alone
        kv = 0 if i >= 3 else tensors * B * S * 2 * hd * e  # the producers' only
        want += (2 * q + kv) // 2
    for rank, per_case in enumerate(world4):
        got = per_case[-1][2, "ulysses", "zigzag", True, "none"]["step"]
        assert got == (want, want), (rank, got, want)


def test_all_gather_consumers_gather_nothing(world4):
    """Under the all-gather (striped: no halo) a producer's K/V are gathered once and held
    (ContextParallel.held_kv; the full layer's k_proj x alone, held_latent), its consumers
    attend with those slots: no gather of their own in forward, none again in backward,
    and the slots' summed gradient reduce-scattered once. Layer 0 shares nothing: its K,V
    gathered in forward, again in backward, their gradient reduce-scattered. At cp2 a rank
    sends its own K,V (fp32) once per gather or reduce-scatter."""
    B, S, e = BATCH, N // 2, 4
    sliding, full = 2 * B * S * 2 * 24 * e, B * S * 1 * 32 * e  # K and V; k_proj x alone
    want = (sliding + full + sliding,  # layers 0, 1, 2 gather; the consumers 3, 4 nothing
            3 * sliding + full)  # layer 0 gathers again, every producer reduce-scatters
    for rank, per_case in enumerate(world4):
        got = per_case[-1][2, "allgather", "striped", True, "none"]["step"]
        assert got == want, (rank, got, want)


@pytest.mark.parametrize("case", BYTES_CASES)
def test_the_planner_prices_each_layers_cp_bytes_as_sent(world4, case):
    """comm_bytes.layer_cp_bytes, layer by layer, is what the layer sends (the busiest rank's;
    here every rank's): a consumer whose producer holds the exchange (kv_layers.
    exchange_held) sends no K/V, under Ulysses its q's and out's all-to-alls alone, under
    the all-gather nothing, and that producer gathers once, its backward the reduce-scatter
    alone; a consumer under the ring, hybrid or a window's halo sends as its producer.
    Under 'full' the step's forward is the layers' twice (the replay), backward once."""
    from ctxpar.config.layers import layer_attention
    from ctxpar.plan.candidate import Candidate
    from ctxpar.plan.comm_bytes import layer_cp_bytes
    cp, comm, layout, k_eq_v, mode = case
    m = replace(GEMMA4, attention_k_eq_v=k_eq_v)
    u = {"ulysses": cp, "hybrid": 2}.get(comm, 1)
    cand = Candidate(1, cp, 1, 4 // cp, comm, u, layout, activation=mode, micro_batch=BATCH)
    want = [layer_cp_bytes(m, cand, 4, a) for a in layer_attention(m)]
    step = tuple(map(sum, zip(*want)))
    for rank, per_case in enumerate(world4):
        got = per_case[-1][case]
        if mode == "none":
            assert got["layers"] == want, (rank, got["layers"], want)
        assert got["step"] == (step[0] * (2 if mode == "full" else 1), step[1]), (rank, got)


def test_tiled_experts_and_mlps_beside_them_equal_untiled(one_process):
    """memory.tiled_mlp on Gemma 4's MoE: the dense MLPs (double-wide too) and the experts
    run over tiles of 16 tokens; the loss and every gradient equal the untiled model's."""
    from ctxpar.config import MemoryConfig
    model = GPT(GEMMA4_MOE, options=ModelOptions(
        seed=SEED, memory=MemoryConfig(tiled_mlp=True, mlp_tile_tokens=16)))
    tokens, labels = _batch()
    (model(tokens, torch.arange(N), labels) / (labels != -100).sum()).backward()
    loss, grads = one_process["moe"]
    for n, p in model.named_parameters():
        close(p.grad, grads[n], f"tiled grad {n}")


@pytest.mark.quick
def test_consumer_layers_hold_no_kv_projection_and_read_their_producers():
    model = GPT(GEMMA4)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.3.attn.k_proj.weight" not in names  # consumers: q, o, q_norm only
    assert "layers.4.attn.k_norm.weight" not in names
    assert "layers.1.attn.v_proj.weight" not in names  # k_eq_v: values from k_proj
    assert model.layers[1].attn.k_proj.weight.shape == (32, 64)  # one head of 32
    assert model.layers[3].attn.kv_producer[0] is model.layers[2].attn
    assert model.layers[4].attn.kv_producer[0] is model.layers[1].attn
    # dropping the sharing computes other K/V: the loss moves
    tokens, labels = _batch()
    with torch.no_grad():
        shared = model(tokens, torch.arange(N), labels)
        own = GPT(replace(GEMMA4, num_kv_shared_layers=0), options=ModelOptions(seed=SEED))
        assert not torch.allclose(own(tokens, torch.arange(N), labels), shared)


@pytest.mark.parametrize("model,parallel,message", [
    (dict(num_kv_shared_layers=5), {}, "model.num_kv_shared_layers=5: each of the last 5"),
    (dict(layer_types=["full_attention"] * 3 + ["sliding_attention"] * 2),
     {}, "needs an earlier layer of its type"),
    (dict(global_n_kv_heads=3), {}, "model.global_n_kv_heads=3 must divide model.n_heads=4"),
    (dict(query_pre_attn_scalar=None), {}, "needs model.query_pre_attn_scalar"),
    (dict(layer_types=["sliding_attention"] * 5, num_kv_shared_layers=0, global_head_dim=None,
          global_n_kv_heads=None), {}, "model.attention_k_eq_v is set but no layer"),
    (dict(double_wide_mlp=True, num_kv_shared_layers=0), {}, "model.double_wide_mlp=true "
                                                             "needs model.num_kv_shared_layers"),
    (dict(moe={"num_experts": 4, "top_k": 2}), {}, "needs model.moe.beside_mlp=true"),
    (dict(moe={"num_experts": 4, "beside_mlp": "yes"}), {}, "model.moe.beside_mlp='yes' must"),
])
def test_bad_gemma4_configs_fail_at_load_in_one_line(model, parallel, message):
    fields = {k: v for k, v in vars(GEMMA4).items() if v is not None}
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {**fields, **model},
                          "parallel": {"tp": 1, "cp": 1, "dp": 1, **parallel}})
    assert message in str(e.value), str(e.value)


# ---------------------------------------------------------------- the planner and kernels

@pytest.mark.quick
@pytest.mark.parametrize("name", MODELS)
def test_the_planner_counts_the_parameters_the_model_holds(name):
    from ctxpar.plan import counts
    cfg = MODELS[name]
    model = GPT(cfg)
    assert counts.total_params(cfg) == sum(p.numel() for p in model.parameters())
    assert counts.stage_vector_params(cfg, 1, 1, 0) == sum(
        p.numel() for p in model.parameters() if p.dim() == 1)
    for ep in (2, 4):  # E/ep experts a rank
        assert counts.stage_params(cfg, 1, 1, 0, ep) == sum(
            s.numel(1, ep) for s in parameter_specs(cfg))


@pytest.mark.quick
def test_the_planner_counts_what_the_experts_beside_the_mlp_and_wide_mlps_save():
    """Autograd's saved bytes (one process, fp32, mode none) of Gemma 4's MoE and wide MLPs
    beyond the dense Gemma 4 equal the planner's difference (its dense Gemma 4 count
    leaves some of Gemma 4's own tensors out: the difference is what this adds); on a
    Llama-style model the experts beside the MLP and the scaled router are exact whole."""
    from ctxpar.plan import counts
    from ctxpar.plan.candidate import Candidate
    from ctxpar.testing.memory import forward_saved_bytes
    cand = Candidate(1, 1, 1, 1, micro_batch=BATCH)

    def gap(cfg):
        model = GPT(cfg, options=ModelOptions(seed=SEED))
        return forward_saved_bytes(model, 96, BATCH, N) - counts.activation_bytes(cfg, cand, 4)
    dense = gap(GEMMA4)
    for cfg in (replace(GEMMA4, double_wide_mlp=True), replace(GEMMA4_MOE, double_wide_mlp=False),
                GEMMA4_MOE):
        assert gap(cfg) == dense
    llama = ModelConfig(vocab_size=96, seq_len=N, n_layers=2, d_model=64, n_heads=4,
                        n_kv_heads=2, ffn_hidden=96)
    for beside, scaled in ((True, False), (False, True), (True, True)):
        assert gap(replace(llama, moe=replace(GEMMA4_MOE.moe, beside_mlp=beside,
                                              scaled_router=scaled))) == 0, (beside, scaled)


@pytest.mark.quick
def test_the_planner_counts_what_a_later_pipeline_stage_receives():
    """counts.activations of a stage starting at block i holds twice (DeepSpeed's received
    copy and its forward's clone) the tensors models/pipe_carry.py carries after block
    i - 1: the producers' K/V as their attention made them, the later blocks' z."""
    from ctxpar.plan import counts
    from ctxpar.plan.candidate import Candidate
    from models.pipe_carry import carried_after
    model = GPT(PIPE)
    tokens, labels = _batch()
    with torch.no_grad():
        model(tokens, torch.arange(N), labels)  # the producers keep their (k, v)
    cand = Candidate(1, 1, 2, 1, micro_batch=BATCH)
    for start in range(1, PIPE.n_layers):
        carried = carried_after(PIPE, start - 1)
        kv = sum(t.numel() for j in carried.producers for t in model.layers[j].attn.shared_kv)
        z = BATCH * N * (PIPE.n_layers - start) * PIPE.per_layer_input_dim
        first, later = (counts.activations(PIPE, cand, 4, 1, s == 0, False, start=start)
                        for s in (0, start))
        assert later.embed - (first.embed - 8 * BATCH * N - 4) == 2 * 4 * (kv + z), start


def test_layers_sharing_kv_keep_no_kv_in_the_planners_activations():
    """A consumer block saves q, out and lse (its K/V are its producer's tensors, and it has
    no k_norm); the same block computing its own K/V would save them too: at least
    2 N Hkv hd e more (and its k_norm's tensors)."""
    from ctxpar.plan import counts
    from ctxpar.plan.candidate import Candidate
    cand = Candidate(1, 2, 1, 1)
    shared = counts.activations(GEMMA4, cand, 2).layers
    own = counts.activations(replace(GEMMA4, num_kv_shared_layers=0), cand, 2).layers
    n = N // 2  # tokens a rank
    assert own[3] - shared[3] >= 2 * n * 2 * 24 * 2  # sliding: 2 kv heads of 24
    assert own[4] - shared[4] >= 2 * n * 1 * 32 * 2  # full: 1 kv head of 32
    assert own[:3] == shared[:3]


def test_head_dim_512_is_refused_by_the_fused_kernels_that_cannot_take_it():
    from ctxpar.context_parallel.kernels import BACKENDS
    from ctxpar.plan.kv_layers import kernels_refusing
    big = replace(GEMMA4, global_head_dim=512)
    assert "flash_attn, sdpa (CUDA bf16/fp16), flash_attn4 cannot take it" in \
        kernels_refusing(big)
    assert kernels_refusing(GEMMA4) is None  # 24 and 32
    q = torch.empty(1, 4, 2, 512, dtype=torch.bfloat16)
    assert BACKENDS["flash_attn"].why_not(q) == "head_dim 512 > 256"
    assert BACKENDS["flash_attn"].why_not(q[..., :256]) != "head_dim 256 > 256"


# ---------------------------------------------------------------- generation

def test_cached_generation_keeps_the_producers_kv_alone_and_equals_full_forwards():
    """One process: generate() with the KV cache (per-layer head dims and kv heads, the
    consumer layers reading their producer's slots, which they never write) continues as
    a full forward per token does, past the sliding window; the cache holds three layers'
    K/V, not five."""
    from ctxpar.inference import generate
    from ctxpar.testing.generation import reference_generate
    model = GPT(GEMMA4, options=ModelOptions(seed=SEED)).eval()
    prompts = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71], [12, 4, 90]]
    want, _ = reference_generate(model, prompts, 6)
    out = generate(model, prompts, 6)
    assert out.tokens == want
    assert [tuple(k.shape[1::2]) for k in out.cache.keys] == [(2, 24), (1, 32), (2, 24)]


@pytest.mark.quick
def test_the_time_model_charges_each_layer_its_own_cp_bytes():
    """No process: timing.cp_time's CP seconds are the layers' comm_bytes.layer_cp_bytes over
    the link, a consumer's own (nothing under the all-gather; the per-kind memo keys the
    shared-KV role), not its producer's; with the attention slow enough to hide every
    gather what stays exposed is the reduce-scatters: layer 0's backward less its gather
    again, the producers' (1, 2) whole backward (no gather again: their slots are held),
    as cp_stats() counts them (test_the_planner_prices_each_layers_cp_bytes_as_sent)."""
    from ctxpar.config import Config
    from ctxpar.config.layers import layer_attention
    from ctxpar.plan.candidate import Candidate
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.comm_bytes import layer_cp_bytes
    from ctxpar.plan.timing import cp_time
    cfg = Config()
    cfg.model = m = replace(GEMMA4, attention_k_eq_v=False)
    cand = Candidate(1, 2, 1, 2, "allgather", 1, "striped", micro_batch=BATCH)
    cluster, stage = Cluster(1, 8, gpu_preset("h100")), layer_attention(m)
    bw, per = cluster.link(2), [layer_cp_bytes(m, cand, 4, a) for a in stage]
    assert per[3:] == [(0, 0), (0, 0)]
    total, exposed, *_ = cp_time(cfg, cand, cluster, 4, 4, stage, [1e3] * 5, 0.0, 1.0)
    assert total == pytest.approx(sum(f + b for f, b in per) / bw)
    assert exposed == pytest.approx((per[0][1] - per[0][0] + per[1][1] + per[2][1]) / bw)
