"""Pipeline parallel (TP x CP x PP x DP through DeepSpeed's pipeline engine) equals one process.

(1) Pure: the DeepSpeed topology derived from the order string has exactly ctxpar's
groups; orders DeepSpeed cannot express and ZeRO-2/3 with pp > 1 fail at config load.
(2) Parity, spawned gloo ranks: for pp2, cp2·pp2 (also a hybrid whose linear blocks run
in tiles, memory.tiled_linear), pp2·dp2 and tp2·cp2·pp2 the pipelined
GPTPipe, trained by ``engine.train_batch`` with the loss of models/gpt_pipe.py, logs per
step the same global token-mean loss as a single-process GPT trained on the same global
batches (SGD, clipping active), and after the first step its gradient norm and its
parameters, gathered to full size under GPT's names, equal the reference.
(3) train.py end to end with configs/tiny_cpu_4d.yaml: learns, saves, resumes exactly.
"""
import json
import os
import pickle
import shutil

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.distributed.parallel_state import rank_grid
from ctxpar.distributed.pipeline_parallel import pipeline_axes, pipeline_topology
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.testing import run_distributed
from ctxpar.testing.linear import GDN_MAMBA_CONFIG
from models.gpt import GPT
from helpers.train_run import ROOT, losses, run_train
from models.options import ModelOptions

CONFIGS = {
    # GQA, SwiGLU, RMSNorm, tied embeddings (a TiedLayerSpec on the first and last stage).
    "tied": ModelConfig(vocab_size=128, seq_len=32, n_layers=3, d_model=32, n_heads=4,
                        n_kv_heads=2, mlp="swiglu", norm="rmsnorm", tie_embeddings=True),
    # MQA (kv=1 replicated over tp2), GELU, LayerNorm with biases, untied head.
    "untied": ModelConfig(vocab_size=128, seq_len=32, n_layers=3, d_model=32, n_heads=4,
                          n_kv_heads=1, mlp="gelu", norm="layernorm", tie_embeddings=False,
                          bias=True),
    # The Hugging Face families' fields (q/k/v biases, per-head q/k norms, head_dim !=
    # d_model/n_heads, (1 + w) norms after attention and MLP, sqrt(d) embedding, GeGLU,
    # softmax scale) on the pipeline's stages.
    "fields": ModelConfig(vocab_size=128, seq_len=32, n_layers=3, d_model=32, n_heads=4,
                          n_kv_heads=2, head_dim=12, attention_bias=True, qk_norm=True,
                          norm_offset=1.0, post_norms=True, scale_embeddings=True,
                          mlp="geglu", ffn_hidden=64, query_pre_attn_scalar=10.0,
                          tie_embeddings=True),
    # Gated DeltaNet, Mamba2, attention, MLP blocks over 48 tokens, the linear blocks in
    # tiles of 8 tokens (MEMORY; two chunks of 4): a rank's zigzag segments of 12 end in a
    # short tile. The reference runs them untiled.
    "hybrid-tiled": GDN_MAMBA_CONFIG,
}
MEMORY = {"hybrid-tiled": dict(tiled_linear=True, linear_tile_tokens=8)}  # memory section
BATCH, MICRO, STEPS, LR, CLIP, SEED = 4, 1, 3, 0.5, 0.05, 7
# fp32. The pipelined model sums the same terms in another order (TP partial products,
# the ring's LSE merge, micro-batch accumulation, the dp x cp all-reduce, the tied-weight
# all-reduce). Measured on these cases: losses <= 2e-7 relative, gradient norm <= 1.5e-7,
# parameters <= 4e-9 absolute (<= 5e-7 of each tensor's max): rtol 1e-5, atol 1e-6. One
# step moves an entry by ~1e-4 (LR x CLIP spread over ~5e4 entries), so an error of a
# few % in the update (a wrong norm or loss scale) is caught. CLIP is far below every step's gradient
# norm (0.8-2.0): clipping is always active and a wrong norm changes the parameters.
TOL = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- (1) pure

@pytest.mark.quick
@pytest.mark.parametrize("order,sizes", [
    ("tp-cp-dp-pp", dict(tp=2, cp=2, pp=2, dp=2)),
    ("cp-dp-tp-pp", dict(tp=2, cp=2, pp=2, dp=2)),
    ("pp-tp-dp-cp", dict(tp=2, cp=2, pp=2, dp=2)),
    ("tp-cp-pp-dp", dict(tp=2, cp=2, pp=2, dp=1)),  # dp of size 1 between: still one block
    ("tp-cp-dp-pp", dict(tp=1, cp=1, pp=4, dp=1)),
])
def test_topology_reproduces_the_grid(order, sizes):
    world = sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"]
    want = rank_grid(world, order=order, **sizes)
    topo = pipeline_topology(order, sizes)
    for ds_axis, family in (("pipe", "pp"), ("model", "tp"), ("data", "dp_cp")):
        got = sorted(sorted(g) for g in topo.get_axis_comm_lists(ds_axis))
        assert got == sorted(want[family]), (ds_axis, got, want[family])


def test_topology_of_the_documented_4d_grid():
    # docs/parallelism.md: tp2·cp2·pp2·dp2, tp-cp-dp-pp -> ['pipe', 'data', 'model'] [2, 4, 2].
    assert pipeline_axes("tp-cp-dp-pp", dict(tp=2, cp=2, pp=2, dp=2)) == \
        (["pipe", "data", "model"], [2, 4, 2])
    topo = pipeline_topology("tp-cp-dp-pp", dict(tp=2, cp=2, pp=2, dp=2))
    assert topo.get_coord(13) == topo.ProcessCoord(pipe=1, data=2, model=1)  # dp1 cp0 tp1


@pytest.mark.quick
@pytest.mark.parametrize("sets,msg", [
    ({"parallel": dict(pp=2, cp=2, tp=2, order="tp-cp-pp-dp"), "_world": 16},
     "parallel.order='tp-cp-pp-dp' puts pp between dp and cp"),
    ({"parallel": dict(pp=2), "deepspeed": {"zero_optimization": {"stage": 2}}, "_world": 2},
     "deepspeed.zero_optimization.stage=2 with parallel.pp=2: DeepSpeed's pipeline engine "
     "supports ZeRO stage 0 or 1 only (use stage 1)"),
    ({"parallel": dict(pp=2), "deepspeed": {"zero_optimization": {"stage": 3}}, "_world": 2},
     "deepspeed.zero_optimization.stage=3 with parallel.pp=2"),
])
def test_pipeline_configs_refused_in_one_line(sets, msg):
    world = sets.pop("_world")
    data = {"model": dict(n_layers=2, seq_len=256), "train": dict(global_batch_size=8), **sets}
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, world_size=world)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_deepspeed_batch_counts_dp_times_cp_with_a_pipeline():
    from ctxpar.config import deepspeed_config
    data = {"model": dict(n_layers=2, seq_len=256), "train": dict(global_batch_size=8),
            "parallel": dict(tp=2, cp=2, pp=2)}
    cfg = config_from_dict(data, world_size=16)  # dp 2: 8 = micro 1 x gas 4 x dp 2
    ds = deepspeed_config(cfg, dp=2)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 4)


# ---------------------------------------------------------------- (2) parity

def make_batches(cfg, cp, layout):
    """STEPS global batches (BATCH, T); ~20% labels ignored, and with cp > 1 every label of
    CP rank 0 in the first sample, so shards and micro-batches count different N."""
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
        if cp > 1:
            labels[0, rank_positions(cfg.seq_len, 0, cp, layout)] = -100
        out.append((tokens, labels))
    return out


def reference(cfg, batches):
    """Single process: per-step token-mean loss; grad norm and parameters after step 1."""
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    positions, losses_, norm, params = torch.arange(cfg.seq_len), [], None, None
    for step, (tokens, labels) in enumerate(batches):
        loss = model(tokens, positions, labels) / (labels != -100).sum()
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses_.append(loss.detach())
        if step == 0:
            norm = total
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses_), norm, params


def _parity(rank, world, payload):
    """Train each case for STEPS steps through DeepSpeed's pipeline engine on this rank;
    return what the parent compares (it pays assert_close's import once)."""
    import deepspeed
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.config import deepspeed_config, ulysses_degree
    from ctxpar.distributed.grad_norm import record_fp32_grad_norm
    from models.gpt_pipe import GPTPipe, train_step
    from models.loss import global_token_count

    out = []
    for (tp, cp, pp, dp, layout, name, ckpt, zero, partition, comm), batches in \
            pickle.loads(payload):
        mcfg = CONFIGS[name]
        cfg = config_from_dict({
            "model": vars(mcfg), "parallel": dict(tp=tp, cp=cp, pp=pp, dp=dp, layout=layout,
                                                   pp_partition=partition, cp_comm=comm),
            "train": dict(micro_batch_size=MICRO, global_batch_size=BATCH, grad_clip=CLIP,
                          seed=SEED),
            "data": dict(kind="tokens", path="unused"),
            "activation_checkpointing": dict(mode=ckpt, every_n_layers=2),
            "memory": MEMORY.get(name, {}),
            "deepspeed": {"zero_optimization": {"stage": zero},
                          "zero_allow_untested_optimizer": True},
        }, world_size=world, check_paths=False)
        st = init_parallel_state(tp=tp, cp=cp, pp=pp, dp=dp, order=cfg.parallel.order,
                                 ulysses=ulysses_degree(cfg.parallel))
        ds_config = deepspeed_config(cfg, st.dp_size)
        gas = ds_config["gradient_accumulation_steps"]
        model = GPTPipe.from_config(cfg, st, gas)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        record_fp32_grad_norm(engine, st)  # fp32 ZeRO-0: the right norm, recorded
        pos = sequence_positions(mcfg.seq_len, st.cp_group, layout)  # (T/cp,)
        losses_, ds_losses, norm, params = [], [], None, None
        for step, (tokens, labels) in enumerate(batches):
            micro = []
            for m in range(gas):  # the loader's order: micro-batch m, then DP rank
                first = (m * dp + st.dp_rank) * MICRO
                rows = slice(first, first + MICRO)
                micro.append({"tokens": shard_sequence(tokens[rows], 1, st.cp_group, layout),
                              "labels": shard_sequence(labels[rows], 1, st.cp_group, layout),
                              "positions": pos})  # (MICRO, T/cp) x 2, (T/cp,)
            n_tokens = sum(global_token_count(mb["labels"], st.dp_cp_group) for mb in micro)
            losses_.append(train_step(engine, micro, n_tokens, st))
            ds_losses.append(engine.agg_train_loss.detach().clone())
            if step == 0:
                norm = torch.tensor(float(engine.get_global_grad_norm()))
                params = model.full_state_dict()
        out.append(dict(losses=torch.stack(losses_), ds_losses=torch.stack(ds_losses),
                        norm=norm, params=params))
    return out


CASES = {  # world -> (tp, cp, pp, dp, layout, config, activation ckpt, ZeRO, partition, cp_comm)
    2: [(1, 1, 2, 1, "zigzag", "tied", "none", 0, "parameters", "ring"),
        (1, 1, 2, 1, "zigzag", "fields", "selective", 0, "parameters", "ring")],
    4: [(1, 2, 2, 1, "zigzag", "untied", "full", 1, "uniform", "allgather"),
        (1, 1, 2, 2, "striped", "tied", "selective", 1, "parameters", "ring"),
        (1, 2, 2, 1, "zigzag", "hybrid-tiled", "full", 1, "uniform", "ring")],
    8: [(2, 2, 2, 1, "zigzag", "tied", "every_n_layers", 0, "parameters", "ring"),
        (2, 2, 2, 1, "striped", "untied", "selective", 1, "uniform", "ulysses")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_parity_with_single_process(world):
    cases, refs = [], []
    for case in CASES[world]:
        tp, cp, pp, dp, layout, name, *_ = case
        batches = make_batches(CONFIGS[name], cp, layout)
        cases.append((case, batches))
        refs.append(reference(CONFIGS[name], batches))
    results = run_distributed(_parity, world, pickle.dumps(cases), timeout=300)
    for i, ((case, _), (want_losses, want_norm, want_params)) in enumerate(zip(cases, refs)):
        seen = set()
        for rank, per_case in enumerate(results):
            got = per_case[i]
            where = "rank {} tp{} cp{} pp{} dp{} {} {} ckpt={} zero={} {} {}".format(rank, *case)
            # The logged loss, every step, on every rank (all stages): the global token mean.
            torch.testing.assert_close(got["losses"], want_losses, **TOL, msg=where)
            # DeepSpeed's own aggregate (sum over micro-batches / gas, mean over dp x cp)
            # of our per-micro-batch loss is the same number.
            torch.testing.assert_close(got["ds_losses"], want_losses, **TOL, msg=where)
            torch.testing.assert_close(got["norm"], want_norm, **TOL, msg=where)
            for n, p in got["params"].items():
                torch.testing.assert_close(p, want_params[n], **TOL, msg=f"{where} {n}")
                seen.add(n)
        assert seen == set(want_params), set(want_params) ^ seen  # every stage's share


# ---------------------------------------------------------------- (3) train.py

CONFIG_4D = os.path.join(ROOT, "configs", "tiny_cpu_4d.yaml")
# The config as is (cp2·pp2, dp auto = 1 on 4 processes, ZeRO-1, selective checkpointing),
# shortened: 6 steps of 16 samples x 128 tokens, checkpoints at 3 and 6, eval at the end.
SHORT = ["model.seq_len=128", "train.steps=6", "train.warmup_steps=2", "train.eval_interval=0",
         "train.eval_samples=8", "logging.log_interval=1", "checkpoint.save_interval=3",
         "logging.wandb.mode=disabled"]


def run_4d(run_dir, nproc, sets=(), extra=()):
    # SHORT sets every key of helpers.train_run's BASE, and later --set values win.
    return run_train(run_dir, nproc, [*SHORT, *sets], extra, timeout=300, config=CONFIG_4D)


def eval_loss(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


def test_train_py_4d_config_equals_single_process_and_resumes(tmp_path):
    piped, single, resumed = (str(tmp_path / n) for n in ("pp", "single", "resumed"))
    run_4d(piped, 4)
    run_4d(single, 1, ["parallel.pp=1", "parallel.cp=1"])  # the same global batches
    want, got = losses(single), losses(piped)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert got[6] < got[1] - 0.5, got  # it learns (from ~ln 256)
    for s in want:
        # fp32; only the order of reductions differs (ring merge, micro-batch and dp x cp
        # sums): measured <= 1e-7 relative, well inside 1e-4.
        assert abs(got[s] - want[s]) <= 1e-4 * abs(want[s]), (s, got[s], want[s])
    (e_got,), (e_want,) = eval_loss(piped), eval_loss(single)  # the pipelined eval forward
    assert abs(e_got - e_want) <= 1e-4 * e_want, (e_got, e_want)

    # Resume from step 3's checkpoint (layer files per stage, ZeRO-1 shards over dp x cp).
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(os.path.join(piped, "checkpoints", "step_00000003"),
                    os.path.join(resumed, "checkpoints", "step_00000003"))
    proc = run_4d(resumed, 4, extra=["--resume", "auto"])
    assert "resumed from" in proc.stdout and "step_00000003" in proc.stdout, proc.stdout[-2000:]
    again = losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for s in again:
        # Same ranks, same reduction order, same data: bit-identical.
        assert again[s] == got[s], (s, again[s], got[s])
