"""train.py with packed documents: document masking, RoPE restarting per document and no loss
after EOS (data.document_mask, reset_positions, eod_mask_loss) on every layout.

A text corpus of 700 documents of 1-200 bytes (several per 128-token sample, boundaries
anywhere: length-1 documents, ones cut by a shard edge or spanning every rank) through
tools/preprocess_data.py; each run trains 6 steps and evaluates on held-out windows.
Every layout's losses and gradient norms equal one process's (fp32, <= 1e-4 relative:
only the order of reductions differs): cp 2 (zigzag, dp 2), cp 4 (striped), tp 2 x cp 2
(Ulysses), cp 2 x pp 2 (all-gather; the boundaries travel between stages).
"""
import json
import os
import random
import subprocess
import sys

import pytest

from helpers.train_run import ROOT, assert_same_run, run_train

DOCS = ["data.kind=tokens", "data.eval_fraction=0.1", "data.document_mask=true",
        "data.reset_positions=true", "data.eod_mask_loss=true", "train.steps=6",
        "train.eval_samples=16", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from ctxpar.data.passkey import SENTENCES
    d = tmp_path_factory.mktemp("docs")
    rnd = random.Random(0)
    docs = ["".join(rnd.choice(SENTENCES) for _ in range(rnd.choice([1, 2, 3, 5, 8, 12])))
            [:rnd.randint(1, 200)] for _ in range(700)]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                    "--input", str(d / "docs.jsonl"), "--output-prefix", str(d / "corpus")],
                   check=True, capture_output=True, timeout=120)
    return str(d / "corpus")


@pytest.fixture(scope="module")
def single_docs(corpus, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("single_docs"))
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", "parallel.tp=1",
                     "deepspeed.zero_optimization.stage=0", f"data.path={corpus}", *DOCS])
    return d


def eval_loss(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.mark.parametrize("nproc,sets", [
    (4, ["parallel.cp=2", "parallel.dp=2", "parallel.layout=zigzag"]),
    (4, ["parallel.cp=4", "parallel.layout=striped", "activation_checkpointing.mode=selective"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm=ulysses",
         "activation_checkpointing.mode=full"]),
    (4, ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm=allgather",
         "parallel.layout=striped"]),
], ids=["cp2-zigzag-dp2", "cp4-striped", "tp2-cp2-ulysses", "cp2-pp2-allgather"])
def test_documents_through_train_match_one_process(corpus, single_docs, tmp_path, nproc, sets):
    d = str(tmp_path / "run")
    proc = run_train(d, nproc, ["parallel.dp=auto", *sets, f"data.path={corpus}", *DOCS])
    assert_same_run(d, single_docs, 6)
    # The held-out loss, with the same masking, agrees as well.
    (got,), (want,) = eval_loss(d), eval_loss(single_docs)
    assert abs(got - want) <= 1e-4 * want, (got, want)
    unbalanced = "zigzag" in " ".join(sets)
    assert ("unbalanced with documents" in proc.stderr) == unbalanced, proc.stderr[-2000:]


def test_one_document_per_sample_equals_no_masking(single, tmp_path):
    """Passkey samples are one document each: masking by documents changes nothing (and
    positions restarting at the only document's start are the global ones). The unmasked
    reference is conftest's `single`, the run test_train.py holds every layout to (one
    process, the same seed and global batch; its first 4 steps are a 4-step run's: the
    learning rate depends on train.steps only after the 5 warmup steps)."""
    masked = str(tmp_path / "masked")
    run_train(masked, 4, ["parallel.cp=2", "parallel.dp=2", "parallel.layout=striped",
                          "train.steps=4", "logging.wandb.mode=disabled",
                          "data.document_mask=true", "data.reset_positions=true"])
    assert_same_run(masked, single, 4)


@pytest.mark.quick
@pytest.mark.parametrize("sets,msg", [
    (["data.eod_mask_loss=true"], "data.eod_mask_loss=true is for data.kind='tokens'"),
    (["data.passkey_docs=9"], "data.passkey_docs=9 must be >= 1 and fit in model.seq_len=128"),
])
def test_bad_document_config_exits_2_with_one_line(tmp_path, sets, msg):
    proc = run_train(str(tmp_path / "bad"), 1, ["parallel.cp=1", "parallel.dp=1", *sets],
                     check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and msg in lines[0], proc.stderr[-2000:]


def test_document_mask_on_data_without_document_ends_exits_2(tmp_path):
    """A token file of one document has no boundary to mask at: refused before training."""
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "The sun is warm. " * 400}) + "\n")
    prefix = str(tmp_path / "one")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                    "--input", str(tmp_path / "one.jsonl"), "--output-prefix", prefix],
                   check=True, capture_output=True, timeout=120)
    proc = run_train(str(tmp_path / "bad"), 1, ["parallel.cp=1", "parallel.dp=1",
                                                "data.kind=tokens", f"data.path={prefix}",
                                                "data.document_mask=true"],
                     check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "records 1 document: no document ends" in lines[0], lines
