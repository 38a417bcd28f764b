"""model.mtp: multi-token prediction depths trained under CP, against one process.

(1) Validation without processes: each bad model.mtp key is one ConfigError line.
(2) The shifted ids and targets (ctxpar/data/mtp.py) against a loop written from the
definition, with document ends at a CP rank's last position and one token before it.
(3) The single-process GPT's loss and every gradient against a reference written from
DeepSeek-V3 §2.2 (each depth's ids, targets, masks, RoPE shift and chaining by hand on the
model's own modules), and one depth against transformers' MtpLayer on the same weights.
(4) CP parity: cp2 zigzag ring, cp2 Ulysses (striped), cp4 contiguous ring, tp2 x cp2,
and DeepSeek-V3's MTP block (MLA and experts, tests/test_mtp_moe.py) at cp2 zigzag x ep2
and tp2 x cp2 x ep2: the token-mean LM + MTP loss (+ the routers' losses) and every
gradient equal the single process's, one spawn per world size.
"""
import dataclasses
import json
import pickle

import pytest
import torch
import torch.nn.functional as F

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.mtp import MTPConfig
from ctxpar.data.mtp import mtp_inputs
from ctxpar.testing import run_distributed
from helpers.mtp_folders import qwen_mtp_folder
from helpers.mtp_reference import (DOCS, MOE_MTP, SEED, T, make_batch, reference,
                                   shifted_by_hand, single_process)
from models.gpt import GPT
from models.options import ModelOptions
# depth 2: the chain and both depths' masks; two configs: a projection per depth
# (DeepSeek-V3, GLM-4.5) and one shared (Qwen3.5's mtp.fc), with Qwen's (1 + w) norms,
# gated attention and partial RoPE.
CONFIGS = {
    "per_depth": ModelConfig(vocab_size=64, seq_len=T, n_layers=1, d_model=32, n_heads=4,
                             n_kv_heads=2, tie_embeddings=False,
                             mtp=MTPConfig(depth=2, loss_weight=0.3)),
    "shared": ModelConfig(vocab_size=64, seq_len=T, n_layers=1, d_model=32, n_heads=4,
                          n_kv_heads=2, head_dim=16, qk_norm=True, norm_offset=1.0,
                          attention_output_gate=True, partial_rotary_factor=0.25,
                          mtp=MTPConfig(depth=2, loss_weight=0.5, shared_projection=True)),
    "moe": MOE_MTP,
}
# fp32: the parallel model sums the same terms in another order (LSE merges over the ring,
# TP partial sums, gradients summed over CP), as tests/test_gpt.py measures: ~1e-6 relative.
TOL = dict(rtol=1e-5, atol=1e-6)


# ---- (1) validation ------------------------------------------------------------------

@pytest.mark.parametrize("mtp,extra,key", [
    ({"depth": 0}, {}, "model.mtp.depth=0"),
    ({"loss_weight": -0.1}, {}, "model.mtp.loss_weight=-0.1"),
    ({"layer_type": "linear_attention"}, {}, "model.mtp.layer_type='linear_attention'"),
    ({}, {"data": {"dynamic_cp": True}}, "data.dynamic_cp=true"),
])
def test_bad_mtp_settings_fail_at_load_naming_the_key(mtp, extra, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace("[", r"\[")) as e:
        config_from_dict({"model": {"mtp": mtp, "n_layers": 2}, **extra})
    assert "\n" not in str(e.value)


# ---- (2) the shifted inputs ----------------------------------------------------------

@pytest.mark.parametrize("docs", [None, DOCS])
def test_shifted_ids_and_targets_match_the_definition(docs):
    tokens, labels = make_batch(CONFIGS["per_depth"])
    ids, tgt = mtp_inputs(tokens, labels, 3, docs)
    for k in (1, 2, 3):
        want_ids, want_tgt = shifted_by_hand(tokens, labels, k, docs)
        assert torch.equal(ids[:, k - 1], want_ids) and torch.equal(tgt[:, k - 1], want_tgt)
    if docs is not None:  # documents [0, 7), [7, 8): at depth 1 positions 5..7 count
        #                   nothing (t_{i+2} is past their document's end), 4 does
        assert (tgt[0, 0, 5:8] == -100).all() and tgt[0, 0, 4] == labels[0, 5]
    else:  # one document: only the last k positions
        assert (tgt[:, 0, -1] == -100).all() and torch.equal(tgt[:, 0, -2], labels[:, -1])


# ---- (3) single process --------------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("name,tiled", [("per_depth", False), ("shared", True)])
def test_one_process_loss_and_gradients_equal_the_definition(name, tiled):
    """tiled: every depth's head and loss through memory.tiled_loss, 8-token tiles."""
    cfg = CONFIGS[name]
    tokens, labels = make_batch(cfg)
    want_loss, want_grads, _ = reference(cfg, tokens, labels, DOCS)
    loss, grads, _ = single_process(cfg, tokens, labels, DOCS, tiled)
    # the same operations in another order (one sum then one division, weights N/N_k):
    # rounding only; fp32
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert set(grads) == set(want_grads) and any("mtp." in n for n in grads)
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        assert want_grads[n].abs().sum() > 0, f"{n}: no gradient reaches it"


# ---- (4) CP parity -------------------------------------------------------------------

def _parity(rank, world, payload):
    """Each case on this rank: the step's token counts, the LM + MTP loss (and the routers'
    share under model.moe) and every gradient after the DeepSpeed-style reduction (the
    experts' over their EDP group, DeepSpeed's MoE path), gathered to full size; the
    routers' assignments per MoE layer over DP x CP."""
    import torch.distributed as dist
    from ctxpar import init_parallel_state
    from ctxpar.data.loader import shard_batch
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.loss import global_mean_loss, loss_for_backward
    from models.options import ModelGroups
    from models.step_kinds import attach_mtp_weights, count_step_tokens

    out = []
    for (tp, cp, ep, layout, comm, u, name), tokens, labels in pickle.loads(payload):
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=tp, cp=cp, dp=1, ulysses=u, ep=ep)
        model = GPT(cfg, ModelGroups.from_state(st),
                    ModelOptions(layout=layout, cp_comm=comm, seed=SEED))
        mb = shard_batch({"tokens": tokens, "labels": labels, "cu_seqlens": DOCS}, st, layout,
                         mtp_depth=cfg.mtp.depth)  # (B, T/cp), (B, D, T/cp)
        n = attach_mtp_weights([mb], count_step_tokens([mb], st), cfg.mtp)
        local = model(mb["tokens"], mb["positions"], mb["labels"], cu_seqlens=DOCS,
                      mtp_tokens=mb["mtp_tokens"], mtp_labels=mb["mtp_labels"],
                      mtp_weights=mb["mtp_weights"])
        router = model.router_losses
        share = router.share * st.dp_size if router is not None else 0.0
        (loss_for_backward(local, n, st.dp_size) + share).backward()
        for p in model.parameters():
            group = st.edp_group if getattr(p, "expert_shard", (0, 1))[1] > 1 \
                else st.dp_cp_group
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(st.dp_size)
        loss = global_mean_loss(local, n, st.dp_cp_group)
        if router is not None:  # the routers' weighted losses of the whole batch
            moe = cfg.moe
            loss = loss + moe.aux_loss_coef * router.aux_loss + \
                moe.z_loss_coef * router.z_loss + moe.seq_aux_loss_coef * router.seq_aux_loss
        out.append(dict(loss=loss,
                        grads=gather_full_state_dict(model, st.tp_group, True, st.ep_group),
                        counts=None if router is None else router.layer_counts))
    gens = {}
    if world == 2:  # generation with drafts at cp2 zigzag: plain and drafted tokens
        st = init_parallel_state(tp=1, cp=2, dp=1)
        for zero_head in (False, True):
            model = gen_model(CONFIGS["per_depth"], zero_head,
                              ModelGroups(cp_group=st.cp_group),
                              ModelOptions(layout="zigzag", seed=SEED))
            gens[zero_head] = generate_both(model, "zigzag", st.cp_group)
    return dict(cases=out, generation=gens)


CASES = {  # world -> (tp, cp, ep, layout, cp_comm, ulysses, config); "moe": DeepSeek-V3's
    # MTP block (MLA, experts over EP)
    2: [(1, 2, 1, "zigzag", "ring", 1, "per_depth"), (1, 2, 1, "striped", "ulysses", 2, "shared"),
        (1, 2, 2, "zigzag", "ring", 1, "moe")],
    4: [(1, 4, 1, "contiguous", "ring", 1, "shared"), (2, 2, 1, "zigzag", "ring", 1, "per_depth"),
        (2, 2, 2, "zigzag", "ring", 1, "moe")],
}
_RESULTS = {}


def parity_results(world):
    """The spawned ranks' results for a world size and the references, once per run."""
    if world not in _RESULTS:
        cases, refs = [], []
        for case in CASES[world]:
            tokens, labels = make_batch(CONFIGS[case[-1]])
            cases.append((case, tokens, labels))
            refs.append(reference(CONFIGS[case[-1]], tokens, labels, DOCS))
        got = run_distributed(_parity, world, pickle.dumps(cases), timeout=300)
        _RESULTS[world] = [c[0] for c in cases], refs, got
    return _RESULTS[world]


@pytest.mark.parametrize("world", sorted(CASES))
def test_cp_loss_and_every_gradient_equal_one_process(world):
    cases, refs, got = parity_results(world)
    for rank, result in enumerate(got):  # every rank: replicas agree too
        for case, (loss, grads, counts), res in zip(cases, refs, result["cases"]):
            where = "rank {} tp{} cp{} ep{} {} {} u={} {}".format(rank, *case)
            torch.testing.assert_close(res["loss"], loss, **TOL, msg=where)
            if counts is not None:  # the MTP blocks' routers' rows last, over DP x CP
                assert torch.equal(res["counts"], counts), where
            assert set(res["grads"]) == set(grads), where
            for n in grads:
                torch.testing.assert_close(res["grads"][n], grads[n], **TOL, msg=f"{where} {n}")


# ---- train.py ------------------------------------------------------------------------

MTP_RUN = ["train.steps=6", "train.global_batch_size=4", "train.micro_batch_size=2",
           "model.mtp.depth=2", "model.mtp.loss_weight=0.3", "data.passkey_docs=2",
           "model.seq_len=256",
           "data.document_mask=true", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory):
    """train.py with model.mtp at cp1 and at cp2 zigzag, 6 steps each (their checkpoints
    serve generate.py below)."""
    from helpers.train_run import run_train

    tmp_path = tmp_path_factory.mktemp("mtp_train")
    run_train(tmp_path / "cp1", 1, MTP_RUN + ["parallel.cp=1", "parallel.dp=1"])
    run_train(tmp_path / "cp2", 2, MTP_RUN + ["parallel.cp=2", "parallel.dp=1",
                                              "parallel.layout=zigzag"])
    return tmp_path


def test_train_logs_the_same_lm_and_mtp_losses_at_cp2_as_at_cp1(mtp_runs):
    from helpers.train_run import metric

    tmp_path = mtp_runs
    for key in ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2"):
        want, got = metric(tmp_path / "cp1", key), metric(tmp_path / "cp2", key)
        assert sorted(got) == list(range(1, 7)), key
        # fp32, 6 AdamW steps: the reductions' order only (~5e-7 measured)
        for s in got:
            assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (key, s, got[s], want[s])
    total = metric(tmp_path / "cp1", "loss")[1]  # loss = LM + lambda/D sum_k
    parts = [metric(tmp_path / "cp1", k)[1] for k in ("lm_loss", "mtp_loss_1", "mtp_loss_2")]
    assert abs(total - (parts[0] + 0.15 * (parts[1] + parts[2]))) < 1e-5


def test_train_refuses_a_bad_depth_in_one_line_exit_2(tmp_path):
    from helpers.train_run import run_train

    proc = run_train(tmp_path, 1, ["parallel.cp=1", "parallel.dp=1", "model.mtp.depth=0"],
                     check=False)
    lines = [line for line in proc.stderr.splitlines() if "model.mtp.depth" in line]
    assert proc.returncode == 2 and len(lines) >= 1 and "must be an integer >= 1" in lines[0]


# ---- Qwen3.5's mtp.* -----------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_qwen_mtp_imports_equals_transformers_mtp_layer_and_exports_its_tensors(tmp_path,
                                                                               family):
    """Qwen3.5's MTP layer (a dense MLP) and Qwen3-Next's (its experts: model.mtp.moe)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ctxpar.checkpoint import export, hf
    from ctxpar.checkpoint.weights import copy_full_weights_
    from ctxpar.config import rotary_dim

    ref, layer = qwen_mtp_folder(tmp_path / "src", family)
    src = str(tmp_path / "src")
    folder = hf.read_config(src)
    m = ModelConfig(**hf.model_fields(folder, src))
    m.mtp = MTPConfig(depth=1, loss_weight=0.3, shared_projection=True,
                      moe=family == "qwen3_next")
    hf.check_mtp(m, folder, src)
    reader = hf.WeightReader(src, m.tie_embeddings, hf.naming_of(m))
    reader.check(m)  # every mtp.* tensor taken, with its shape
    model = GPT(m).eval()
    copy_full_weights_(model, reader.get, None)
    assert reader.unused() == [] and hf.left_out(src, m) is None
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    ids = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)  # t_{i+1}
    with torch.no_grad():
        out = ref.model(tokens)
        h = out.last_hidden_state  # final-normed, as the MTP layer takes it
        emb = ref.model.embed_tokens(ids)
        want = ref.lm_head(layer(emb, h, ref.model.rotary_emb(emb, (pos + 1)[None]), None,
                                 (pos + 1)[None], None))
        x = model.hidden_states(tokens, pos)
        got = model.lm_logits(model.mtp.depth_hidden(0, x, model.embed(ids), pos, rotary_dim(m)))
        torch.testing.assert_close(model.lm_logits(x), ref(tokens).logits, rtol=1e-5, atol=1e-5)
        # fp32, the same operations but for the attention kernel's summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the training loss: LM as transformers' causal-LM loss, depth 1 as the CE of its
        # MtpLayer's logits against t_{i+2} (the last two positions have none)
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)
        mtp_tokens, mtp_labels = mtp_inputs(tokens, labels, 1)
        model(tokens, pos, labels, mtp_tokens=mtp_tokens, mtp_labels=mtp_labels)
        lm = model.loss_sum(x, labels) / (labels != -100).sum()
        torch.testing.assert_close(lm, ref(tokens, labels=tokens).loss, rtol=1e-5, atol=1e-6)
        mtp_ce = F.cross_entropy(want.flatten(0, 1), mtp_labels[:, 0].flatten())
        torch.testing.assert_close(model.mtp_loss_sums[0] / (mtp_labels != -100).sum(), mtp_ce,
                                   rtol=1e-5, atol=1e-6)
    export.save_folder(str(tmp_path / "out"), model.named_parameters(), m)
    back, source = load_file(tmp_path / "out" / "model.safetensors"), load_file(
        tmp_path / "src" / "model.safetensors")
    mtp_keys = sorted(k for k in source if k.startswith("mtp."))
    assert len(mtp_keys) > 10 and sorted(k for k in back if k.startswith("mtp.")) == mtp_keys
    for k in mtp_keys:
        assert torch.equal(back[k], source[k]), k
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["mtp_num_hidden_layers"] == 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    with torch.no_grad():  # transformers reloads the export (and drops mtp.* itself)
        torch.testing.assert_close(again(tokens).logits, ref(tokens).logits, rtol=1e-5,
                                   atol=1e-5)
    m.mtp = None  # model.mtp: null leaves them out, and the start-up line says so
    assert "the multi-token prediction layers" in hf.left_out(src, m)


def test_mtp_a_folder_does_not_hold_is_refused_in_one_line(tmp_path):
    from ctxpar.checkpoint import hf
    from ctxpar.checkpoint.resume import CheckpointError

    qwen_mtp_folder(tmp_path)
    folder = hf.read_config(str(tmp_path))
    m = ModelConfig(**hf.model_fields(folder, str(tmp_path)))
    m.mtp = MTPConfig(depth=2, shared_projection=True)
    with pytest.raises(CheckpointError, match=r"model.mtp.depth=2 but .* has depth=1"):
        hf.check_mtp(m, folder, str(tmp_path))
    m.mtp = MTPConfig(depth=1, shared_projection=True)
    with pytest.raises(CheckpointError, match="has no multi-token prediction layers"):
        hf.check_mtp(m, {**folder, "mtp_num_hidden_layers": 0}, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"model.mtp.moe=False but .* has moe=True: set "
                                              r"model.mtp.moe=True"):  # Qwen3-Next's experts
        hf.check_mtp(m, {**folder, "model_type": "qwen3_next"}, str(tmp_path))
    llama = ModelConfig(vocab_size=96, d_model=64, n_heads=4, mtp=MTPConfig())
    with pytest.raises(CheckpointError, match=r"model.mtp \(multi-token prediction layers: "
                                              r"Llama has none"):
        hf.family_config(llama)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_planner_counts_the_mtp_parameters(name):
    from ctxpar.plan.counts import stage_params, stage_vector_params, total_params

    cfg = CONFIGS[name]
    model = GPT(cfg, device="meta")
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert mtp > 0 and total_params(cfg) == sum(p.numel() for p in model.parameters())
    assert total_params(dataclasses.replace(cfg, mtp=None)) == total_params(cfg) - mtp
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert stage_vector_params(cfg, 1, 1, 0) == vectors and stage_params(cfg, 1, 1, 0) == \
        total_params(cfg)


# ---- generation with MTP drafts ------------------------------------------------------

GEN_PROMPT, GEN_NEW = [3, 17, 9, 40, 22, 5, 31], 7


def gen_model(cfg, zero_head=False, groups=None, options=None):
    """The parity config's model; zero_head: every logit equal, so every draft (argmax 0)
    is accepted, the other path through the verification."""
    from models.options import ModelGroups
    model = GPT(cfg, groups or ModelGroups(), options or ModelOptions(seed=SEED)).eval()
    if zero_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return model


def generate_both(model, layout="contiguous", cp_group=None, tp_group=None):
    """(plain greedy tokens, drafted tokens, accepted per step)."""
    from ctxpar.inference import generate
    from models.mtp_drafts import generate_with_mtp_drafts

    plain = generate(model, [GEN_PROMPT], GEN_NEW, layout=layout, cp_group=cp_group,
                     tp_group=tp_group).tokens[0]
    drafted = generate_with_mtp_drafts(model, GEN_PROMPT, GEN_NEW, layout=layout,
                                       cp_group=cp_group, tp_group=tp_group)
    return plain, drafted.tokens, drafted.accepted


@pytest.mark.parametrize("zero_head", [False, True])
def test_mtp_drafts_give_plain_greedy_tokens_at_cp1(zero_head):
    cfg = CONFIGS["per_depth"]
    plain, drafted, accepted = generate_both(gen_model(cfg, zero_head))
    assert drafted == plain and len(plain) == GEN_NEW
    if zero_head:  # every draft accepted: D + 1 tokens a step
        assert accepted[:-1] == [0] + [cfg.mtp.depth] * (len(accepted) - 2)
    assert sum(a + 1 for a in accepted) >= GEN_NEW


def test_mtp_drafts_give_plain_greedy_tokens_at_cp2():
    _, _, got = parity_results(2)
    cfg = CONFIGS["per_depth"]
    for zero_head in (False, True):
        want, _, _ = generate_both(gen_model(cfg, zero_head))  # one process, plain
        for rank, result in enumerate(got):
            plain, drafted, accepted = result["generation"][zero_head]
            assert plain == want and drafted == want, (rank, zero_head, plain, drafted, want)
            if zero_head:
                assert accepted[1] == cfg.mtp.depth


@pytest.mark.slow
def test_generate_py_with_mtp_drafts_prints_the_plain_tokens_at_cp2(mtp_runs):
    """generate.py --draft mtp on the cp2 run's checkpoint, at cp2 zigzag: the tokens of
    plain decoding, and the drafts' acceptance line."""
    import os
    import subprocess
    import sys

    from ctxpar.distributed.parallel_state import free_port
    from helpers.train_run import ROOT

    def generate_py(*extra):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), os.path.join(ROOT, "generate.py"),
               "--run-dir", str(mtp_runs / "cp2"), "--passkey", "3",
               "--output-format", "jsonl", "--set", "parallel.layout=zigzag", *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return [r["tokens"] for r in rows], proc.stderr

    plain, _ = generate_py()
    drafted, said = generate_py("--draft", "mtp")
    assert len(plain) == 3 and drafted == plain
    line = [x for x in said.splitlines() if x.startswith("mtp drafts: ")]
    assert len(line) == 1 and "accepted of 2 per step" in line[0], said[-2000:]


def test_a_checkpoints_recorded_mtp_section_is_read_back_as_model_mtp():
    """The manifest's plain dict (what convert_checkpoint.py and init_from read): model.mtp
    comes back an MTPConfig, as model.moe a MoEConfig."""
    from ctxpar.checkpoint.weights import saved_model
    m = saved_model({"config": {"model": {"n_layers": 2, "mtp": {"depth": 2,
                                                                 "shared_projection": True}}}},
                    "tag")
    assert m.mtp == MTPConfig(depth=2, shared_projection=True)


@pytest.mark.slow
def test_train_py_from_a_qwen3_5_folder_trains_and_exports_its_mtp_layer(tmp_path):
    """train.py at cp2 zigzag from a Qwen3.5 folder with its MTP layer (model.mtp depth 1):
    step 1's LM loss is transformers' on the batch, its MTP loss the CE of transformers'
    MtpLayer logits (before any update: the imported weights); the export
    (convert_checkpoint.py) holds the folder's mtp.* names, each tensor one step on."""
    import os
    import subprocess
    import sys

    import numpy as np
    from safetensors.torch import load_file

    from ctxpar.checkpoint import hf
    from ctxpar.data.passkey import PasskeyTask
    from helpers.train_run import ROOT, metric, run_train

    ref, layer = qwen_mtp_folder(tmp_path / "src", vocab_size=256)
    fields = hf.model_fields(hf.read_config(tmp_path / "src"), str(tmp_path / "src"))
    sets = [f"model.{k}={json.dumps(v, separators=(',', ':'))}" for k, v in fields.items()
            if k not in ("seq_len", "init_std", "family")]
    run = tmp_path / "run"
    proc = run_train(run, 2, [*sets, "parallel.cp=2", "parallel.dp=1", "train.steps=1",
                              "train.global_batch_size=4", "train.micro_batch_size=4",
                              f"model.init_from={tmp_path / 'src'}", "model.mtp.depth=1",
                              "model.mtp.shared_projection=true", "logging.wandb.mode=disabled"])
    assert "Hugging Face Qwen3_5 folder" in proc.stdout and "left out" not in proc.stdout
    task = PasskeyTask(128, 2, 1234, "train")  # train.py's first batch (BASE: seq_len 128)
    pairs = [task[i] for i in range(4)]
    x, y = (torch.from_numpy(np.stack([p[i] for p in pairs])) for i in (0, 1))
    ids, targets = mtp_inputs(x, y, 1)
    with torch.no_grad():
        lm = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())
        h, emb, pos = ref.model(x).last_hidden_state, ref.model.embed_tokens(ids[:, 0]), \
            torch.arange(1, 129)[None]
        logits = ref.lm_head(layer(emb, h, ref.model.rotary_emb(emb, pos), None, pos, None))
        mtp = F.cross_entropy(logits.flatten(0, 1), targets[:, 0].flatten())
    # fp32, the CP reductions' order only
    assert abs(metric(run, "lm_loss")[1] - lm.item()) <= 1e-5 * lm.item()
    assert abs(metric(run, "mtp_loss_1")[1] - mtp.item()) <= 1e-5 * mtp.item()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                          str(run), "--to", "hf", str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    source, back = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "out"))
    keys = sorted(k for k in source if k.startswith("mtp."))
    assert sorted(k for k in back if k.startswith("mtp.")) == keys
    # one warm-up step moves a weight by at most ~lr_1 (Adam's first step is lr x sign)
    moved = [(back[k] - source[k]).abs().max().item() for k in keys]
    assert max(moved) <= 1e-3 and min(moved) > 0, dict(zip(keys, moved))
