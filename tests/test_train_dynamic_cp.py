"""train.py with data.dynamic_cp: whole documents of long-tailed lengths, each step's
schedule over the DP x CP ranks, against one process training on the same documents.

The corpus: 400 documents of lognormal lengths between 2 and 250 stored tokens; 16 per
step. dp2 x cp2 holds 64 tokens per rank (model.seq_len 128 / cp 2), so the documents
take CP sizes 1 to 4; the one process holds 256 and runs every document alone. Losses
(<= 1e-6 relative) and gradient norms agree over 6 steps on dp2 x cp2 (ring; ZeRO 1, 2
and 3: the last two in rounds), tp2 x cp2 (Ulysses, full checkpointing: the replay
runs over the pack's group), cp4 (all-gather, ZeRO 0) and cp4 (hybrid, Ulysses degree 2,
striped: sizes 1, 2 and 4), static CP's packing of the same documents
(data.dynamic_cp_schedule=static) and a hybrid model with experts at cp4 x ep2: fp32,
only the order of the reductions differs; a run resumed at step 3, inside a window of
two steps that traded documents, logs the uninterrupted one's losses bit for bit.
"""
import json
import os
import shutil

import numpy as np
import pytest

from ctxpar.config import ConfigError, load_config
from ctxpar.data import DataError, IndexedDatasetWriter, build_data
from ctxpar.dynamic_cp.stream import DynamicStream
from helpers.train_run import CONFIG, HYBRID_MODEL, losses, metric, run_train

# Windows of two steps trade documents (the same steps on every layout; the resume at
# step 3 lands inside one).
DYNAMIC = ["data.dynamic_cp=true", "data.kind=tokens", "data.eval_fraction=0.1",
           "train.steps=6", "train.global_batch_size=16", "logging.wandb.mode=disabled",
           "data.dynamic_cp_window=2"]
# DeepSeek-V3's router as dynamic CP takes it: the aux-free bias and a z-loss (the
# load-balancing and sequence-level losses are refused with it: ctxpar/config/moe.py).
MOE = ["model.moe={num_experts: 8, top_k: 2, expert_hidden: 64, score: sigmoid, "
       "score_correction_bias: true, bias_update_rate: 0.01, n_group: 2, topk_group: 1, "
       "routed_scaling_factor: 2.5, z_loss_coef: 0.001, shared_expert_hidden: 32, "
       "layers: [0, 2]}"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("dyn") / "docs")
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3.5, 1.0, 400), 2, 250).astype(int)
    with IndexedDatasetWriter(prefix, vocab_size=256, eos_id=0) as w:
        for n in lengths:
            w.add_document(rng.integers(1, 256, n - 1).tolist())
    return prefix


def _cfg(corpus, *sets, world=4):
    return load_config(CONFIG, overrides=["model.seq_len=128", f"data.path={corpus}",
                                          *DYNAMIC, *sets], world_size=world)


@pytest.mark.quick
def test_the_stream_is_a_function_of_the_step_and_resumes_from_it(corpus):
    cfg = _cfg(corpus, "parallel.cp=2", "parallel.dp=2")
    cost = lambda n, d: n / d + n * n / (64 * d)  # noqa: E731
    a = DynamicStream(cfg, build_data(cfg).train_source, 4, cost)
    steps = [a.next_step() for _ in range(3)]
    b = DynamicStream(cfg, build_data(cfg).train_source, 4, cost)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    c = DynamicStream(cfg, build_data(cfg).train_source, 4, cost)
    for _ in range(3):
        c.next_step()
    assert b.next_step().schedule == c.next_step().schedule == a.next_step().schedule
    assert steps[0].schedule != steps[1].schedule
    assert steps[0].n_tokens == sum(len(d) - 1 for d in steps[0].documents)
    # only documents wholly in the train split's windows
    src = build_data(cfg).train_source
    end = (src.first + src.n_windows) * src.seq_len + 1
    assert a.dataset.doc_offsets[a.ids[-1] + 1] <= end


@pytest.mark.quick
@pytest.mark.parametrize("sets,msg", [
    (["parallel.pp=2", "parallel.cp=2", "parallel.dp=1"],
     "data.dynamic_cp=true with parallel.pp=2: the pipeline runs the same micro-batches"),
    (["data.tokens_per_rank=1"], "data.tokens_per_rank=1 must be >= 2"),
    (["data.dynamic_cp_schedule=lpt"], "data.dynamic_cp_schedule='lpt': choose 'balanced'"),
    (["data.dynamic_cp_window=0"], "data.dynamic_cp_window=0 must be >= 1"),
    (["model.moe={num_experts: 4, top_k: 2, aux_loss_coef: 0.01}"],
     "model.moe is set; not built with data.dynamic_cp=true and model.moe.aux_loss_coef=0.01"),
    (["model.moe={num_experts: 4, top_k: 2, seq_aux_loss_coef: 0.01}"],
     "not built with data.dynamic_cp=true and model.moe.seq_aux_loss_coef=0.01"),
    (["model.moe={num_experts: 4, top_k: 2, capacity_factor: 1.0}"],
     "not built with data.dynamic_cp=true and model.moe.capacity_factor=1.0"),
    (["model.moe={num_experts: 4, top_k: 2}", "parallel.ep=2", "memory.tiled_mlp=true"],
     "not built with data.dynamic_cp=true, parallel.ep=2 and memory.tiled_mlp=true"),
])
def test_what_dynamic_cp_cannot_run_is_refused_at_load_in_one_line(corpus, sets, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")) as e:
        _cfg(corpus, *sets)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="data.tokens_per_rank=64 is for data.dynamic_cp"):
        load_config(CONFIG, overrides=["data.tokens_per_rank=64"], world_size=4)
    with pytest.raises(ConfigError, match="data.dynamic_cp_window=2 is for data.dynamic_cp"):
        load_config(CONFIG, overrides=["data.dynamic_cp_window=2"], world_size=4)


def test_a_document_no_rank_group_holds_is_refused_in_one_line(corpus):
    cfg = _cfg(corpus, "parallel.cp=2", "parallel.dp=2", "data.tokens_per_rank=32")
    stream = DynamicStream(cfg, build_data(cfg).train_source, 4, lambda n, d: n)
    with pytest.raises(DataError, match=r"docs\.idx: document \d+, the longest: a document "
                                        r"of \d+ tokens does not fit 4 ranks of 32 tokens"):
        stream.check_lengths()
    # static CP's packing holds a document on one CP group of parallel.cp ranks
    cfg = _cfg(corpus, "parallel.cp=2", "parallel.dp=2", "data.dynamic_cp_schedule=static")
    stream = DynamicStream(cfg, build_data(cfg).train_source, 4, lambda n, d: n)
    with pytest.raises(DataError, match=r"does not fit 2 ranks of 64 tokens"):
        stream.check_lengths()


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("one"))
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", "data.tokens_per_rank=256",
                     "deepspeed.zero_optimization.stage=0", f"data.path={corpus}", *DYNAMIC])
    return d


@pytest.fixture(scope="module")
def cp2dp2(corpus, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cp2dp2"))
    run_train(d, 4, ["parallel.cp=2", "parallel.dp=2", "checkpoint.save_interval=3",
                     f"data.path={corpus}", *DYNAMIC])
    return d


def _assert_same_losses(got_dir, want_dir):
    want, got = losses(want_dir), losses(got_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    want_norm, got_norm = metric(want_dir, "grad_norm"), metric(got_dir, "grad_norm")
    for s in got:
        assert abs(got[s] - want[s]) <= 1e-6 * abs(want[s]), (s, got[s], want[s])
        assert abs(got_norm[s] - want_norm[s]) <= 1e-5 * want_norm[s], (s, got_norm[s])
    assert metric(got_dir, "step_tokens") == metric(want_dir, "step_tokens")


def test_dp2_cp2_matches_one_process_and_logs_the_balance(cp2dp2, one_process):
    _assert_same_losses(cp2dp2, one_process)
    shares = metric(cp2dp2, "cp_size_share")
    assert set().union(*shares.values()) >= {"1", "2", "3"}, shares  # not only powers of 2
    assert all(abs(sum(v.values()) - 1) < 1e-9 for v in shares.values())
    assert all(v == {"1": 1.0} for v in metric(one_process, "cp_size_share").values())
    assert all(b >= 1.0 for b in metric(cp2dp2, "work_max_over_mean").values())
    # the step's CPU seconds (summed over the 4 ranks) on every line
    cpu, wall = metric(cp2dp2, "step_cpu_s"), metric(cp2dp2, "step_time_s")
    assert sorted(cpu) == sorted(wall) and all(c > 0 for c in cpu.values()), cpu
    # throughput counts the step's own tokens, not global_batch_size x seq_len
    rate, dt, n = (metric(cp2dp2, k) for k in ("tokens_per_s", "step_time_s", "step_tokens"))
    assert all(abs(rate[s] * dt[s] - n[s]) <= 1e-6 * n[s] for s in n), (rate, dt, n)
    assert sum(n.values()) == metric(cp2dp2, "tokens")[6] < 6 * 16 * 128


@pytest.mark.parametrize("sets", [
    ["parallel.tp=2", "parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=ulysses",
     "data.tokens_per_rank=128", "activation_checkpointing.mode=full"],
    ["parallel.cp=4", "parallel.dp=1", "parallel.cp_comm=allgather",
     "parallel.layout=striped", "deepspeed.zero_optimization.stage=0", "data.tokens_per_rank=64"],
    # ZeRO 2 runs the packs in the same rounds as ZeRO 3 (train.py: rounds for stage >= 2);
    # stage 3 adds the forward's parameter gathers, so it is the one run here.
    ["parallel.cp=2", "parallel.dp=2", "deepspeed.zero_optimization.stage=3"],
    # hybrid, Ulysses degree 2: sizes 1, 2 (pure Ulysses) and 4 (a ring of 2 over the
    # static ring groups, reused); striped, whose two-level layout differs from the plain
    ["parallel.cp=4", "parallel.dp=1", "parallel.cp_comm=hybrid", "parallel.ulysses=2",
     "parallel.layout=striped", "data.tokens_per_rank=64"],
], ids=["tp2-cp2-ulysses", "cp4-allgather-zero0", "cp2-dp2-zero3", "cp4-hybrid-u2"])
def test_other_layouts_match_one_process(corpus, one_process, tmp_path, sets):
    d = str(tmp_path / "run")
    run_train(d, 4, [*sets, f"data.path={corpus}", *DYNAMIC])
    _assert_same_losses(d, one_process)


def test_static_cps_packing_of_the_same_documents_logs_the_same_losses(corpus, cp2dp2,
                                                                      one_process, tmp_path):
    """data.dynamic_cp_schedule=static (what the balanced schedule is measured against):
    the same steps' documents in order, samples of cp x 128 tokens (the longest
    document's 249 fit one) over each CP group of two, dealt to the two DP groups; the losses of the balanced schedule and of one
    process. The balanced schedule logs its prediction, never below its work bound."""
    d = str(tmp_path / "static")
    run_train(d, 4, ["parallel.cp=2", "parallel.dp=2", "data.dynamic_cp_schedule=static",
                     "parallel.layout=striped", "data.tokens_per_rank=128", f"data.path={corpus}", *DYNAMIC])
    _assert_same_losses(d, one_process)
    _assert_same_losses(d, cp2dp2)
    assert all(v == {"2": 1.0} for v in metric(d, "cp_size_share").values())
    for s, ratio in metric(cp2dp2, "predicted_over_bound").items():
        assert ratio >= 1 - 1e-9 and metric(cp2dp2, "bound_s")[s] > 0, (s, ratio)
        assert metric(cp2dp2, "schedule_max_over_mean")[s] >= 1 - 1e-9


def test_a_hybrid_moe_model_matches_one_process(corpus, tmp_path):
    """Gated DeltaNet and Mamba2 layers with experts in layers 0 and 2, at cp4 x ep2: each
    pack's state passing and conv halo over the pack's group (sizes 1 to 4), every
    document's state from its own start; the experts' all-to-alls over EP groups whose
    ranks run different packs, in rounds; the z-loss over the step's tokens and the
    aux-free bias from the step's counts, padding left out (the bias moves every step, so
    the losses after step 1 hold it too)."""
    one = str(tmp_path / "one")
    run_train(one, 1, ["parallel.cp=1", "parallel.dp=1", "data.tokens_per_rank=256",
                       "deepspeed.zero_optimization.stage=0", f"data.path={corpus}",
                       *DYNAMIC, *HYBRID_MODEL, *MOE])
    d = str(tmp_path / "run")
    run_train(d, 4, ["parallel.cp=4", "parallel.dp=1", "parallel.ep=2",
                     "data.tokens_per_rank=64", f"data.path={corpus}", *DYNAMIC,
                     *HYBRID_MODEL, *MOE])
    _assert_same_losses(d, one)
    assert set().union(*metric(d, "cp_size_share").values()) >= {"1", "2", "3", "4"}
    for key in ("moe_z_loss", "moe_aux_loss", "moe_expert_load"):
        want, got = metric(one, key), metric(d, key)
        for s in want:  # a count can flip on a tie of two experts' scores after step 1
            tol = 1e-3 if key == "moe_expert_load" and s > 1 else 1e-5  # (test_moe.py)
            assert abs(got[s] - want[s]) <= tol * abs(want[s]), (key, s, got[s], want[s])


def test_a_resumed_run_reproduces_the_uninterrupted_one(cp2dp2, corpus, tmp_path):
    d = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(cp2dp2, "checkpoints", "step_00000003"),
                    os.path.join(d, "checkpoints", "step_00000003"))
    proc = run_train(d, 4, ["parallel.cp=2", "parallel.dp=2", f"data.path={corpus}",
                            *DYNAMIC], extra=["--resume", "auto"])
    assert "resumed from" in proc.stdout
    want, got = losses(cp2dp2), losses(d)
    assert sorted(got) == [4, 5, 6]
    for s in got:  # same ranks, same documents, same order: bit-identical
        assert got[s] == want[s], (s, got[s], want[s])
    assert metric(d, "tokens") == {s: metric(cp2dp2, "tokens")[s] for s in got}


FEW = ["train.global_batch_size=2", "train.micro_batch_size=1", "train.steps=2"]


@pytest.fixture(scope="module")
def one_process_few(corpus, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("one_few"))
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", "data.tokens_per_rank=256",
                     "deepspeed.zero_optimization.stage=0", f"data.path={corpus}", *DYNAMIC,
                     *FEW])
    return d


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_the_schedule_leaves_idle_still_join_the_reduction(corpus, one_process_few,
                                                                 tmp_path, stage):
    """Two documents on four ranks: the idle ranks add zero gradients (ZeRO 1) or run
    empty packs in their rounds (ZeRO 3), and nobody waits."""
    dyn = str(tmp_path / "dyn")
    run_train(dyn, 4, ["parallel.cp=2", "parallel.dp=2", f"data.path={corpus}", *DYNAMIC,
                       *FEW, f"deepspeed.zero_optimization.stage={stage}"])
    want, got = losses(one_process_few), losses(dyn)
    assert sorted(got) == sorted(want) == [1, 2]
    for s in got:
        assert abs(got[s] - want[s]) <= 1e-6 * abs(want[s]), (s, got[s], want[s])
