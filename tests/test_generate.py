"""generate.py end to end on a train.py checkpoint, and every DeepSpeed checkpoint format.

  formats   one 4-rank spawn saves a GPT through real DeepSpeed engines (ZeRO-1 at tp2 x
            cp2, ZeRO-3 at tp2 x dp2, the pipeline engine at tp2 x pp2) with weights no
            seed makes, then loads each at tp 1, 2 and 4: the full weights must be the saved
            ones exactly (fp32 copies; ZeRO-3's through DeepSpeed's zero_to_fp32).
  run       one short single-process train.py run (module-scoped) shared by the rest:
            --passkey against the teacher-forced argmax of train.py's eval, sample by
            sample; the torchrun cp=2 form prints the same; prompts from a jsonl file equal
            a cache-less reference; bad input exits 2 with one line.
"""
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, load_config
from ctxpar.data import build_source
from ctxpar.inference.checkpoint import (find_checkpoint, inspect_checkpoint,
                                         load_run_config, load_weights_)
from ctxpar.distributed.parallel_state import free_port
from ctxpar.testing import run_distributed
from models.gpt import GPT
from ctxpar.testing.generation import reference_generate
from helpers.train_run import ROOT, run_train
from models.options import ModelGroups, ModelOptions

MODEL = dict(vocab_size=256, seq_len=32, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2)
SAVED_SEED, BUILD_SEED = 99, 5  # saved weights come from one seed, models are built with another


def _save_and_load(rank, world, save_root):
    """Save the seed-99 GPT from each engine, then load every tag at tp 1, 2, 4."""
    import deepspeed
    from ctxpar import DeepSpeedMPU, init_parallel_state
    from ctxpar.checkpoint import resume
    from ctxpar.config import config_from_dict, deepspeed_config
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.tensor_parallel import gather_full_state_dict
    from ctxpar.distributed.zero import partition_for_zero3
    from models.gpt_pipe import GPTPipe

    init_deepspeed_comm()
    cases = {"module": dict(tp=2, cp=2, pp=1, dp=1, zero=1),
             "zero3": dict(tp=2, cp=1, pp=1, dp=2, zero=3),
             "pipeline": dict(tp=2, cp=1, pp=2, dp=1, zero=1)}
    for name, c in cases.items():
        cfg = config_from_dict({
            "model": MODEL, "parallel": dict(tp=c["tp"], cp=c["cp"], pp=c["pp"], dp=c["dp"]),
            "train": dict(micro_batch_size=1, global_batch_size=2 * c["dp"], seed=SAVED_SEED),
            "data": dict(kind="tokens", path="unused"), "deepspeed": {"zero_optimization": {
                "stage": c["zero"], "stage3_param_persistence_threshold": 0}}},
            world_size=world, check_paths=False)
        st = init_parallel_state(tp=c["tp"], cp=c["cp"], pp=c["pp"], dp=c["dp"])
        ds = deepspeed_config(cfg, st.dp_size)
        model = GPTPipe.from_config(cfg, st, ds["gradient_accumulation_steps"]) \
            if c["pp"] > 1 else GPT.from_config(cfg, st)
        partition_for_zero3(model, st, ds)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # never stepped
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds,
                                          mpu=None if c["pp"] > 1 else DeepSpeedMPU(st))
        resume.save(engine, os.path.join(save_root, name), 1, {"step": 1})
        engine.destroy()
    out = {}
    for name in cases:
        files = inspect_checkpoint(os.path.join(save_root, name, "step_00000001"))
        for tp in (1, 2, 4):
            st = init_parallel_state(tp=tp, cp=world // tp)
            model = GPT(ModelConfig(**MODEL),
                        ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                        ModelOptions(seed=BUILD_SEED))
            load_weights_(model, files, st.tp_group)
            out[name, tp] = (files.kind, files.tp, gather_full_state_dict(model, st.tp_group))
    return pickle.dumps(out)


def test_every_checkpoint_format_loads_at_any_tp(tmp_path):
    want = GPT(ModelConfig(**MODEL), options=ModelOptions(seed=SAVED_SEED)).state_dict()
    other = GPT(ModelConfig(**MODEL), options=ModelOptions(seed=BUILD_SEED)).state_dict()
    assert any(not torch.equal(want[n], other[n]) for n in want)  # loading must change them
    for rank, res in enumerate(run_distributed(_save_and_load, 4, str(tmp_path), timeout=300)):
        for (name, tp), (kind, saved_tp, full) in pickle.loads(res).items():
            assert (kind, saved_tp) == (name, 2)
            assert set(full) == set(want)
            for n in want:  # fp32 copies and concatenations: exact
                torch.testing.assert_close(full[n], want[n], rtol=0, atol=0,
                                           msg=f"rank {rank} {name} -> tp{tp} {n}")


# ---------------------------------------------------------------- generate.py on a real run

CONFIG = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
N = 16  # held-out samples: train.py's eval and --passkey read the same ones


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gen") / "run")
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", f"train.eval_samples={N}",
                     "train.steps=30", "logging.wandb.mode=disabled"])
    return d


def generate_py(args, nproc=1, timeout=300):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "generate.py")] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_port", str(free_port()), os.path.join(ROOT, "generate.py")]
    return subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def load_run_model(run_dir):
    ckpt = find_checkpoint(run_dir)
    cfg = load_run_config(ckpt, ["parallel.cp=1", "parallel.dp=1"], world_size=1)
    model = GPT(cfg.model, options=ModelOptions(seed=BUILD_SEED)).eval()
    load_weights_(model, inspect_checkpoint(ckpt.path), None)
    return cfg, model


def passkey_jsonl(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("passkey accuracy")]
    assert len(rows) == N and len(summary) == 1, proc.stdout
    return rows, summary[0]


@pytest.fixture(scope="module")
def passkey_single(run):
    return passkey_jsonl(generate_py(["--run-dir", run, "--passkey", str(N),
                                      "--output-format", "jsonl"]))


def test_passkey_generation_agrees_with_train_eval_sample_by_sample(run, passkey_single):
    rows, summary = passkey_single
    cfg, model = load_run_model(run)
    task, d = build_source(cfg.data, cfg.model.seq_len, cfg.train.seed, "eval"), 2
    T = cfg.model.seq_len
    for i, row in enumerate(rows):
        inputs, labels = task[i]
        with torch.no_grad():  # train.py's eval: argmax at the answer positions, teacher-forced
            pred = model(torch.as_tensor(inputs)[None], torch.arange(T))[0, T - d:].argmax(-1)
        key = bytes(labels[-d:].tolist()).decode()
        assert row["key"] == key
        gen = row["tokens"]
        # Greedy digit 1 is the teacher-forced argmax; digit 2 too once digit 1 is the key's.
        assert gen[0] == pred[0], (i, row, pred)
        if gen[0] == ord(key[0]):
            assert gen[1] == pred[1], (i, row, pred)
        assert row["correct"] == (gen == labels[-d:].tolist()) == bool(
            (pred == torch.as_tensor(labels[-d:])).all())
    # The accuracy line quotes train.py's own eval of the same checkpoint: equal.
    acc = sum(r["correct"] for r in rows) / N
    assert summary.startswith(f"passkey accuracy {acc:.3f} ") and \
        summary.endswith(f"train.py's eval there: {acc:.3f}"), summary


def test_torchrun_cp3_prints_the_same_answers(run, passkey_single):
    # cp=3 zigzag: the trained seq_len (128) splits into neither 3 nor 6 chunks, which
    # training needs and generation does not (prompts are padded to their own length).
    proc = generate_py(["--run-dir", run, "--passkey", str(N), "--output-format", "jsonl"],
                       nproc=3)
    rows, summary = passkey_jsonl(proc)
    assert rows == passkey_single[0]
    assert summary.split(" from ")[0] == passkey_single[1].split(" from ")[0]
    assert "tp=1 x cp=3 (zigzag)" in proc.stderr


@pytest.mark.parametrize("cp,layout", [(3, "striped"), (5, "zigzag"), (6, "contiguous")])
def test_generation_config_takes_a_cp_that_does_not_divide_seq_len(run, cp, layout):
    sets = [f"parallel.cp={cp}", "parallel.dp=1", f"parallel.layout={layout}"]
    ckpt = find_checkpoint(run, "auto")
    cfg = load_run_config(ckpt, sets, world_size=cp)
    chunks = 2 * cp if layout == "zigzag" else cp
    assert cfg.parallel.cp == cp and cfg.model.seq_len % chunks  # the rule really is skipped
    with pytest.raises(ConfigError, match="model.seq_len=128 is not divisible"):
        load_config(os.path.join(ckpt.run_dir, "config.yaml"), sets, world_size=cp,
                    check_paths=False)  # training keeps the rule


def test_prompt_file_matches_a_cacheless_reference(run, tmp_path):
    texts = ["The sky is blue. The pass key is 4", "Here we go. ", "What is the pass key?"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "out.jsonl"
    proc = generate_py(["--run-dir", run, "--prompt-file", str(path), "--max-new-tokens", "6",
                        "--output-format", "jsonl", "--output", str(out), "--batch-size", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    _, model = load_run_model(run)
    prompts = [list(t.encode()) for t in texts]
    tokens, _ = reference_generate(model, prompts, 6, min_gap=1e-5)
    for t, row, ref in zip(texts, rows, tokens):
        want = ref[:ref.index(0)] if 0 in ref else ref  # byte tokenizer: EOS is id 0
        assert row["prompt"] == t and row["completion"] == bytes(want).decode("utf-8", "replace")
        assert row["stop"] == ("eos" if 0 in ref else "length")


@pytest.mark.parametrize("args,msg", [
    (["--run-dir", "{tmp}/nowhere", "--passkey", "4"], "--run-dir {tmp}/nowhere: no such directory"),
    (["--run-dir", "{run}", "--checkpoint", "step_00000007", "--passkey", "4"],
     "checkpoint {run}/checkpoints/step_00000007: no such directory"),
    (["--run-dir", "{incomplete}", "--passkey", "4"], "no complete checkpoint in {incomplete}"),
    (["--run-dir", "{incomplete}", "--checkpoint", "step_00000030", "--passkey", "4"],
     "checkpoint {incomplete}/checkpoints/step_00000030 is incomplete (no COMPLETE marker"),
    (["--run-dir", "{run}", "--prompt", "x" * 120, "--max-new-tokens", "10"],
     "prompt 0 has 120 tokens; with --max-new-tokens=10 it needs 129 positions > "
     "model.seq_len=128"),
    (["--run-dir", "{run}", "--passkey", "4", "--set", "parallel.tp=3"],
     "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["--run-dir", "{run}", "--passkey", "4", "--set", "parallel.dp=2"],
     "--set parallel.dp=2: generate.py runs tp x cp ranks only"),
    (["--run-dir", "{run}", "--passkey", "4", "--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
    (["--run-dir", "{run}", "--prompt", "x", "--max-new-tokens", "0"],
     "--max-new-tokens=0 must be >= 1"),
])
def test_bad_input_exits_2_with_one_line(run, tmp_path, monkeypatch, capsys, args, msg):
    import shutil

    import generate

    incomplete = str(tmp_path / "incomplete")
    shutil.copytree(run, incomplete, ignore=shutil.ignore_patterns("COMPLETE"))
    fill = dict(tmp=str(tmp_path), run=run, incomplete=incomplete)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):  # launcher_env sets them:
        monkeypatch.setenv(k, "")  # recorded, so they are unset again after the test
        monkeypatch.delenv(k)
    with pytest.raises(SystemExit) as e:
        generate.main([a.format(**fill) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg.format(**fill) in err[0], err


def test_hf_tokenizer_text_in_text_out(run, tmp_path, monkeypatch, capsys):
    # A local tokenizers JSON (what preprocess_data.py --tokenizer takes); its ids are
    # < 256 so the byte-level model can read them. In-process: generate.main on one rank.
    tokenizers = pytest.importorskip("tokenizers")
    import torch.distributed as dist

    import generate
    from ctxpar.data import HFTokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the sky is blue the sea is calm"], tokenizers.trainers.
                            WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    try:
        assert generate.main(["--run-dir", run, "--prompt", "the sea is", "--tokenizer",
                              str(tmp_path / "tokenizer.json"), "--max-new-tokens", "5"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _, model = load_run_model(run)
    tokens, _ = reference_generate(model, [hf.encode("the sea is")], 5, min_gap=1e-5)
    ref = tokens[0][:tokens[0].index(hf.eos_id)] if hf.eos_id in tokens[0] else tokens[0]
    assert capsys.readouterr().out == "the sea is" + hf.decode(ref) + "\n\n"


@pytest.mark.quick
def test_generation_prefills_with_the_ring_whatever_the_run_trained_with():
    # A hybrid (ulysses 2 x ring 2) run's config at generate.py's grid of 1 or 2 ranks: the
    # Ulysses degree fits neither, and the weights do not care; prefill is the ring.
    from ctxpar.config import config_from_dict
    from models.inference import layout_overrides
    run = {"model": {"seq_len": 256}, "parallel": {"cp": 4, "cp_comm": "hybrid", "ulysses": 2}}
    for world, sets in ((1, []), (2, ["parallel.cp_comm=ulysses"])):
        cfg = config_from_dict(run, overrides=layout_overrides(sets, world),
                               world_size=world)
        assert (cfg.parallel.cp, cfg.parallel.cp_comm, cfg.parallel.ulysses) == \
            (world, "ring", None)


def test_long_context_eval_writes_heatmap_table_and_loss_by_position(run, tmp_path,
                                                                      monkeypatch, capsys):
    # tools/long_context_eval.py in-process on one rank: the tasks answered by generation,
    # the PNGs and the JSON written; a length too short for a task exits 2 before start-up.
    import json

    import torch.distributed as dist

    from tools import long_context_eval

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    out = str(tmp_path / "lc")
    args = ["--run-dir", run, "--lengths", "140", "--depths", "0", "1", "--samples", "2",
            "--tasks", "needle", "multivalue", "--needles", "2", "--loss-samples", "2",
            "--out", out]
    try:
        assert long_context_eval.main(args) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    res = json.load(open(os.path.join(out, "results.json")))
    assert [(c["task"], c["length"], c["depth"]) for c in res["tasks"]] == [
        ("needle", 140, 0.0), ("needle", 140, 1.0), ("multivalue", 140, 0.0),
        ("multivalue", 140, 1.0)]
    assert all(0 <= c["score"] <= 1 and len(c["completions"]) == 2 for c in res["tasks"])
    assert sum(b["tokens"] for b in res["loss_by_position"]) == 2 * 127  # seq_len 128
    for png in ("heatmap.png", "loss_by_position.png"):
        assert open(os.path.join(out, png), "rb").read(4) == b"\x89PNG"
    assert "| needle | 140 | " in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        long_context_eval.main(args[:2] + ["--lengths", "40"])
    assert e.value.code == 2
    assert "task 'needle' needs more than length=40 tokens" in capsys.readouterr().err


def bpe_tokenizer(path, vocab_size=256):
    """A byte-level BPE tokenizer.json trained on the repository's own docs (no downloads),
    EOS '</s>'; its vocabulary fits tiny_cpu.yaml's 256 rows."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "</s>"], show_progress=False))
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A token-file run as the README makes one: the README's lines (short documents, none
    as long as model.seq_len=128) through tools/preprocess_data.py with a BPE tokenizer,
    train.py on them with data.tokenizer set. (run dir, tokenizer path)."""
    from tools.preprocess_data import main as preprocess_main
    d = tmp_path_factory.mktemp("text")
    tokenizer = bpe_tokenizer(d / "tokenizer.json")
    lines = [ln for ln in open(os.path.join(ROOT, "README.md"), encoding="utf-8")
             if 20 < len(ln) < 200]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": ln}) + "\n" for ln in lines))
    assert preprocess_main(["--input", str(d / "docs.jsonl"), "--output-prefix",
                            str(d / "corpus"), "--tokenizer", tokenizer]) == 0
    run_train(str(d / "run"), 1, ["parallel.cp=1", "parallel.dp=1", "train.steps=2",
                                  "data.kind=tokens", f"data.path={d / 'corpus'}",
                                  f"data.tokenizer={tokenizer}", "logging.wandb.mode=disabled"])
    return str(d / "run"), tokenizer


def unset_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so they are unset again after the test
        monkeypatch.delenv(k)


def test_generation_reads_and_writes_text_with_the_runs_tokenizer(text_run, monkeypatch,
                                                                   capsys):
    # No --tokenizer: the run's data.tokenizer (the BPE), as its checkpoint recorded it.
    import torch.distributed as dist

    import generate
    from ctxpar.data import HFTokenizer
    run, path = text_run
    unset_launcher_env(monkeypatch)
    try:
        assert generate.main(["--run-dir", run, "--prompt", "The ring attention",
                              "--max-new-tokens", "8", "--output-format", "jsonl"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    row = json.loads(capsys.readouterr().out)
    bpe = HFTokenizer(path)
    _, model = load_run_model(run)
    tokens, _ = reference_generate(model, [bpe.encode("The ring attention")], 8, min_gap=1e-5)
    ref = tokens[0][:tokens[0].index(bpe.eos_id)] if bpe.eos_id in tokens[0] else tokens[0]
    assert row["completion"] == bpe.decode(ref) and "\ufffd" not in row["completion"]


def test_a_tokenizer_of_another_vocabulary_is_refused_in_one_line(text_run, run, tmp_path,
                                                                  monkeypatch, capsys):
    # Against the run's data.tokenizer when it had one; else against model.vocab_size (the
    # byte-level passkey run: a smaller vocabulary may be what its folder had).
    import generate
    bpe_run, path = text_run
    small = bpe_tokenizer(tmp_path / "small.json", vocab_size=200)
    big = bpe_tokenizer(tmp_path / "big.json", vocab_size=300)
    unset_launcher_env(monkeypatch)
    for run_dir, tokenizer, msg in (
            (bpe_run, small, f"--tokenizer {small} has a vocabulary of 200 ids, the run's "
                             f"data.tokenizer={path!r} 256: not the tokenizer"),
            (bpe_run, big, "has a vocabulary of 300 ids, the run's data.tokenizer="),
            (run, big, f"--tokenizer {big} has a vocabulary of 300 ids, the model 256 "
                       f"(model.vocab_size): not the tokenizer")):
        with pytest.raises(SystemExit) as e:
            generate.main(["--run-dir", run_dir, "--prompt", "x", "--tokenizer", tokenizer])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_a_tokenizer_other_than_the_runs_is_refused_by_generate_and_the_evaluation(
        text_run, tmp_path, monkeypatch, capsys):
    """Another BPE of the same 256 ids (trained on other text): its digest is not the one
    the run's token file records, so generate.py and the long-context evaluation refuse
    it as train.py refuses the token file: exit 2, one line naming both digests."""
    from ctxpar.data.tokenizer import short_identity, tokenizer_identity
    from tools import long_context_eval
    import generate
    tokenizers = pytest.importorskip("tokenizers")
    bpe_run, path = text_run
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    lines = open(os.path.join(ROOT, "docs", "development.md"), encoding="utf-8").readlines()
    tok.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "</s>"], show_progress=False))
    other = str(tmp_path / "other.json")
    tok.save(other)
    assert tokenizers.Tokenizer.from_file(other).get_vocab_size() == 256
    unset_launcher_env(monkeypatch)
    for main, argv in ((generate.main, ["--prompt", "x"]),
                       (long_context_eval.main, ["--lengths", "64", "--out",
                                                 str(tmp_path / "lc")])):
        with pytest.raises(SystemExit) as e:
            main(["--run-dir", bpe_run, "--tokenizer", other, *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"--tokenizer {other} is the {short_identity(tokenizer_identity(other))} " \
               f"tokenizer, but the run trained with the " \
               f"{short_identity(tokenizer_identity(path))} one" in err[0], err
        assert "corpus.idx records it" in err[0], err


def test_readme_long_context_eval_on_short_documents_scores_windows(text_run, tmp_path,
                                                                    monkeypatch, capsys):
    # The README's command on a token-file run whose held-out documents are all shorter
    # than model.seq_len: the loss by position falls back to the held-out windows, said in
    # one line; the tasks are made with the run's tokenizer.
    import torch.distributed as dist

    from ctxpar.data.tokenizer import tokenizer_identity
    from ctxpar.inference.checkpoint import run_tokenizer
    from tools import long_context_eval
    run, path = text_run
    ckpt = find_checkpoint(run)
    cfg = load_run_config(ckpt, world_size=1)
    assert run_tokenizer(ckpt, cfg).identity == tokenizer_identity(path)
    unset_launcher_env(monkeypatch)
    out = str(tmp_path / "lc")
    try:
        assert long_context_eval.main(["--run-dir", run, "--lengths", "64", "96", "--depths",
                                       "0.5", "--samples", "1", "--loss-samples", "2",
                                       "--out", out]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(err) == 2 and "holds model.seq_len=128 tokens: the loss by position is over " \
        "held-out windows" in err[0], err
    # its held-out split is one window: used once and said, not repeated to make 2
    assert "--loss-samples 2: the held-out split holds 1 window: the loss by position is " \
        "over those 1" in err[1], err
    res = json.load(open(os.path.join(out, "results.json")))
    assert sum(b["tokens"] for b in res["loss_by_position"]) == 1 * 127
    assert res["loss_samples"] == {"asked": 2, "used": 1, "from": "windows"}
    assert [c["length"] for c in res["tasks"]] == [64, 96]
    with pytest.raises(SystemExit) as e:  # asked for by name, documents are still required
        long_context_eval.main(["--run-dir", run, "--lengths", "64", "--loss-from",
                                "documents"])
    assert e.value.code == 2
    assert "use --loss-from windows" in capsys.readouterr().err


def test_cp_generation_leaves_no_gloo_thread_running_at_exit(text_run):
    # After generate.py's main, nothing of torch.distributed may still run: a gloo worker
    # of a group still alive at the interpreter's finalization can be ended there while
    # dropping a finished work, which aborts the exit now and then (SIGABRT after a
    # correct answer; ctxpar.distributed.parallel_state.shutdown_distributed says how).
    run, _ = text_run
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()),
         os.path.join(ROOT, "tests", "helpers", "generate_threads.py"), "--run-dir", run,
         "--prompt", "The ring attention holds every block of the sequence",
         "--max-new-tokens", "4"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(ln for ln in proc.stdout.splitlines() if "threads after main" in ln)
    assert [ln.split(":")[0] for ln in lines] == ["rank 0", "rank 1"], proc.stdout
    for line in lines:
        assert "gloo" not in line, line  # pt_gloo_runloop, gloo_tcp_loop


@pytest.mark.slow
def test_cp_generation_exits_0_every_time_under_load(text_run):
    # The teardown stress (tools/benchmarks/bench_generate_teardown.py) in short: repeated
    # torchrun cp=2 generations, two at a time beside a spinning process; the 50-run form
    # and its before/after counts are in docs/benchmarks.md.
    from tools.benchmarks.bench_generate_teardown import main as stress
    assert stress(["--run-dir", text_run[0], "--runs", "6", "--parallel", "2", "--busy", "1",
                   "--max-new-tokens", "4"]) == 0


@pytest.mark.quick
def test_generation_md_gives_the_tokenizers_default_as_generate_py_has_it():
    """--tokenizer's default is the run's data.tokenizer (run_tokenizer), not the
    byte-level one: the flag's help and docs/generation.md's row say the same."""
    doc = open(os.path.join(ROOT, "docs", "generation.md"), encoding="utf-8").read()
    row = next(ln for ln in doc.splitlines() if ln.startswith("| `--tokenizer"))
    assert "default: the run's `data.tokenizer`" in row and "default the byte-level" not in row
    assert "exits 2 naming both" in row
    source = open(os.path.join(ROOT, "generate.py"), encoding="utf-8").read()
    assert "default: the run's data.tokenizer" in source  # the flag's help
