"""model.mtp under the pipeline (models/mtp_pipe.py) against one process.

(1) Validation without processes: MTP layers beside experts split over EP under the pipeline, and a
pipeline whose stage would hold no layer once the head and the depths sit on the last
stage, are one ConfigError line; a dense MTP block at pp 2 loads.
(2) Parity, one spawned world of 4 gloo ranks: cp2 zigzag x pp2 (two micro-batches per
step), untied (the embedding's copy for the depths alone); pp2 x dp2, tied (the head's
copy read by the depths too) under memory.tiled_loss; tp2 x pp2 (the copy and the
depths split over TP, the tied gradient reduced per TP rank); cp2 zigzag x pp2 of DeepSeek-V3's
shape with MoE MTP blocks (their routers' statistics joining the stages', the routers'
losses and every MoE layer's correction bias after the step's update too); with packed documents whose
boundaries fall at a CP rank's last position and one token before it: the step's loss
(LM + lambda/D sum_k), every depth's mtp_loss_k and lm_loss as train.py logs them, and
every gradient DeepSpeed hands the optimizer (after its dp x cp and tied-weight
all-reduces, gathered over TP) equal the single-process GPT's (which tests/test_mtp.py holds to the
definition); the stages' boundaries are the ones the config's checks predict, and each
parameter's name in the stage the one checkpoint conversion gives it (names.to_pipe).
"""
import dataclasses
import pickle

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.mtp import MTPConfig
from ctxpar.testing import run_distributed
from helpers.mtp_reference import DOCS, MOE_MTP, SEED, T, make_batch, single_process

CONFIGS = {
    # a projection per depth (DeepSeek-V3's, GLM-4.5's), untied head, depth 2
    "per_depth": ModelConfig(vocab_size=64, seq_len=T, n_layers=2, d_model=32, n_heads=4,
                             n_kv_heads=2, tie_embeddings=False,
                             mtp=MTPConfig(depth=2, loss_weight=0.3)),
    # Qwen3.5's: one shared fc, (1 + w) norms, gated attention, partial RoPE; tied head
    "shared": ModelConfig(vocab_size=64, seq_len=T, n_layers=2, d_model=32, n_heads=4,
                          n_kv_heads=2, head_dim=16, qk_norm=True, norm_offset=1.0,
                          attention_output_gate=True, partial_rotary_factor=0.25,
                          tie_embeddings=True,
                          mtp=MTPConfig(depth=2, loss_weight=0.5, shared_projection=True)),
    # DeepSeek-V3's: MLA, sigmoid-routed experts with groups, the correction bias and its
    # update, a shared expert, the sequence-level loss (the load-balancing one is the
    # softmax routers', refused at load with sigmoid); the MTP blocks MLA + those experts
    # (model.mtp.moe), two depths
    "moe": dataclasses.replace(MOE_MTP, moe=dataclasses.replace(MOE_MTP.moe,
                                                                aux_loss_coef=0.0)),
}
# fp32: the pipelined step sums the same terms in another order (the ring's LSE merge,
# the micro-batches, the dp x cp and tied-weight all-reduces): ~1e-7 relative measured
# (tests/test_pipeline.py, tests/test_mtp.py), so 1e-5 / 1e-6.
TOL = dict(rtol=1e-5, atol=1e-6)


# ---- (1) validation ------------------------------------------------------------------

def _load(model, parallel, world):
    return config_from_dict({"model": {"seq_len": 256, **model}, "parallel": parallel,
                             "train": {"global_batch_size": 8}}, world_size=world)


@pytest.mark.quick
def test_mtp_loads_at_pp2_and_what_the_pipeline_does_not_build_is_refused_in_one_line():
    cfg = _load({"n_layers": 2, "mtp": {"depth": 2}}, {"pp": 2, "cp": 2}, 4)
    assert cfg.model.mtp.depth == 2
    moe = {"num_experts": 4, "top_k": 2, "expert_hidden": 16}
    for model, parallel, world, msg in [
        ({"n_layers": 4, "moe": moe, "mtp": {"moe": True}},
         {"pp": 2, "ep": 2, "pp_partition": "uniform"}, 4,
         "model.mtp with parallel.pp=2 and parallel.ep=2: the MTP layers on the last stage"),
        # 11 layers in uniform stages of 2, 2, 2, 2, 2, 1: the head (8) on, stage 4 emptied
        ({"n_layers": 6, "tie_embeddings": False, "mtp": {"depth": 1}},
         {"pp": 6, "pp_partition": "uniform"}, 6,
         "model.mtp with parallel.pp=6: pipeline stage 4 holds no layer")]:
        with pytest.raises(ConfigError) as e:
            _load(model, parallel, world)
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- (2) parity ----------------------------------------------------------------------

def _parity(rank, world, payload):
    """Each case for one step through DeepSpeed's pipeline engine: the logged loss and
    MTP metrics, and the gradients the optimizer is handed (GPT's names, this stage's)."""
    import deepspeed
    from ctxpar import init_parallel_state
    from ctxpar.config import deepspeed_config
    from ctxpar.checkpoint.weights import gpt_named_buffers
    from ctxpar.data.loader import shard_batch
    from models.gpt_pipe import GPTPipe, train_step
    from models.step_kinds import attach_mtp_weights, count_step_tokens, pipeline_mtp_metrics

    class Recorder(torch.optim.SGD):
        """Keeps the gradients DeepSpeed hands step() (lr 0: nothing moves)."""

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.recorded = None if p.grad is None else p.grad.clone()

    out = []
    for (tp, cp, pp, dp, layout, name, tiled, mbs), tokens, labels in pickle.loads(payload):
        mcfg = CONFIGS[name]
        cfg = config_from_dict({
            "model": dataclasses.asdict(mcfg),
            "parallel": dict(tp=tp, cp=cp, pp=pp, dp=dp, layout=layout),
            "train": dict(micro_batch_size=mbs, global_batch_size=tokens.shape[0], seed=SEED,
                          grad_clip=0.0),
            "memory": dict(tiled_loss=tiled, loss_tile_tokens=8),
            "data": dict(kind="tokens", path="unused"),
            "deepspeed": {"zero_optimization": {"stage": 0},
                          "zero_allow_untested_optimizer": True},
        }, world_size=world, check_paths=False)
        st = init_parallel_state(tp=tp, cp=cp, pp=pp, dp=dp, order=cfg.parallel.order)
        ds_config = deepspeed_config(cfg, st.dp_size)
        gas = ds_config["gradient_accumulation_steps"]
        model = GPTPipe.from_config(cfg, st, gas)
        engine, *_ = deepspeed.initialize(model=model, optimizer=Recorder(
            model.parameters(), lr=0.0), config=ds_config)
        micro = []
        for m in range(gas):  # the loader's order: micro-batch m, then DP rank
            rows = slice((m * dp + st.dp_rank) * mbs, (m * dp + st.dp_rank + 1) * mbs)
            micro.append(shard_batch({"tokens": tokens[rows], "labels": labels[rows],
                                      "cu_seqlens": DOCS[rows]},
                                     st, layout, mtp_depth=mcfg.mtp.depth))
        n = attach_mtp_weights(micro, count_step_tokens(micro, st), mcfg.mtp)
        loss = train_step(engine, micro, n, st)
        metrics = pipeline_mtp_metrics(model, micro, n, loss, st)
        for p in model.parameters():  # what step() was handed, gathered over TP
            p.grad = p.recorded
        grads = model.full_state_dict(grads=True)
        pipe_name = {id(p): name_ for name_, p in model.named_parameters()}
        names = {name_: pipe_name[id(p)] for name_, p in model.gpt_named_parameters()}
        router = model.loss_fn.router  # the last stage's routers' losses (model.moe)
        if mcfg.moe is not None:  # then the aux-free balance update of this stage's layers
            model.update_router_biases()
        biases = {n_: b.clone() for n_, b in gpt_named_buffers(model)}
        out.append(dict(loss=loss, metrics=metrics, grads=grads, parts=list(model.parts),
                        router=router, biases=biases, names=names))
    return out


CASES = [  # (tp, cp, pp, dp, layout, config, memory.tiled_loss, micro-batch), world 4
    (1, 2, 2, 1, "zigzag", "per_depth", False, 1),
    (1, 1, 2, 2, "contiguous", "shared", True, 1),
    (2, 1, 2, 1, "contiguous", "per_depth", False, 1),
    # the routers' losses are a micro-batch's: one of the whole batch, as the reference
    (1, 2, 2, 1, "zigzag", "moe", False, 2),
]


def _single(name, tokens, labels):
    """The single-process step: the LM + MTP loss, gradients, each depth's token mean,
    and under model.moe the routers' (aux, z, sequence-level) losses and every MoE
    layer's correction bias after the step's update."""
    from ctxpar.data.mtp import mtp_inputs

    cfg = CONFIGS[name]
    loss, grads, model = single_process(cfg, tokens, labels, DOCS)
    _, mtp_labels = mtp_inputs(tokens, labels, cfg.mtp.depth, DOCS)
    per_depth = model.mtp_loss_sums / (mtp_labels != -100).sum(dim=(0, 2))
    router = biases = None
    if cfg.moe is not None:
        r = model.router_losses
        loss, router = loss - r.share, torch.stack([r.aux_loss, r.z_loss, r.seq_aux_loss])
        model.update_router_biases(r.layer_counts)
        biases = {n: b for n, b in model.named_buffers() if n.endswith("correction_bias")}
    return loss, grads, per_depth, router, biases


@pytest.fixture(scope="module")
def parity():
    runs, refs = [], []
    for case in CASES:
        tokens, labels = make_batch(CONFIGS[case[5]])
        runs.append((case, tokens, labels))
        refs.append(_single(case[5], tokens, labels))
    return refs, run_distributed(_parity, 4, pickle.dumps(runs), timeout=400)


def test_pipeline_mtp_loss_metrics_and_every_gradient_equal_one_process(parity):
    from ctxpar.checkpoint.names import pipeline_ties_embedding, to_pipe
    from ctxpar.config.pipeline_stages import pipeline_parts

    refs, got = parity
    for i, (case, (loss, grads, per_depth, router, biases)) in enumerate(zip(CASES, refs)):
        seen = set()
        cfg = CONFIGS[case[5]]
        lm = loss - cfg.mtp.loss_weight / cfg.mtp.depth * per_depth.sum()
        for rank, result in enumerate(got):
            res, where = result[i], "rank {} tp{} cp{} pp{} dp{} {} {} tiled={} mbs={}".format(
                rank, *case)
            torch.testing.assert_close(res["loss"], loss, **TOL, msg=where)
            metrics = res["metrics"]  # every stage logs the last stage's
            for k in range(cfg.mtp.depth):
                torch.testing.assert_close(torch.tensor(metrics[f"mtp_loss_{k + 1}"]),
                                           per_depth[k], **TOL, msg=where)
            torch.testing.assert_close(torch.tensor(metrics["lm_loss"]), lm, **TOL, msg=where)
            assert res["parts"] == pipeline_parts(cfg, case[2], case[0], 1, "parameters"), where
            for n, pipe in res["names"].items():  # the checkpoints' names (names.py)
                assert to_pipe(n, cfg.n_layers, pipeline_ties_embedding(cfg)) == pipe, (where, n)
            for n, g in res["grads"].items():  # this stage's, the embedding's on both ends
                assert g is not None, f"{where} {n}: no gradient"
                torch.testing.assert_close(g, grads[n], **TOL, msg=f"{where} {n}")
                seen.add(n)
            if router is not None and res["router"] is not None:  # the last stage's
                torch.testing.assert_close(res["router"]["values"], router, **TOL, msg=where)
                seen.add("router")
            for n, b in res["biases"].items():  # this stage's layers, the depths' last
                if n.endswith("correction_bias"):
                    torch.testing.assert_close(b, biases[n], **TOL, msg=f"{where} {n}")
                    seen.add(n)
        want = set(grads) | ({"router"} | set(biases) if router is not None else set())
        assert seen == want, want ^ seen
        assert any(n.startswith("mtp.") for n in seen)


def test_the_depths_and_the_head_sit_on_the_last_stage_whatever_the_partition():
    from ctxpar.config.pipeline_stages import keep_on_last_stage, pipeline_parts

    assert keep_on_last_stage([0, 3, 6, 9], 5) == [0, 3, 5, 9]
    m = dataclasses.replace(CONFIGS["per_depth"], n_layers=4)
    for method in ("uniform", "parameters"):  # head at 6, then the depths and the copy
        parts = pipeline_parts(m, 3, 1, 1, method)
        assert parts[-2] <= 6 and parts[-1] == 9, (method, parts)
