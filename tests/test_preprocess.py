"""tools/preprocess_data.py and ctxpar/data/corpus.py: every input kind, workers, errors."""
import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys

import pytest
import zstandard

from ctxpar.data import ByteTokenizer, IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tools.preprocess_data import main as preprocess_main

TEXT = "# Title\n\nSome *markdown* text, é.\n"
JSONL = '{"text": "first"}\n\n{"text": "second é", "id": 2}\n'
COMPRESS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress,
            # two frames, as zstd -T / pzstd / concatenated files write them
            "zst": lambda b: b"".join(zstandard.ZstdCompressor().compress(b[i:i + 7])
                                      for i in range(0, len(b), 7))}


def documents(prefix):
    ds = IndexedDataset(str(prefix))
    return [ByteTokenizer().decode(ds[i]) for i in range(len(ds))]


def run(tmp_path, *args):
    """The CLI's exit code, run in this process, writing tmp_path/out/c.bin/.idx."""
    return preprocess_main([*map(str, args), "--output-prefix", str(tmp_path / "out" / "c")])


@pytest.mark.quick
@pytest.mark.parametrize("name,data,fmt,want", [
    ("notes.md", TEXT.encode(), "auto", [TEXT]),
    ("nntplib.py", b"import os\r\n\r\ndef f():\r\n    pass\r\n", "auto",
     ["import os\n\ndef f():\n    pass\n"]),                 # universal newlines
    ("README", b"\xef\xbb\xbfno extension, BOM dropped", "auto",
     ["no extension, BOM dropped"]),
    ("records.json", JSONL.encode(), "auto", ["first", "second é"]),   # JSON lines by content
    ("records.json", JSONL.encode(), "text", [JSONL]),          # --format text: one document
    ("odd.jsonl", b'["a list"]\n', "text", ['["a list"]\n']),
    ("data.jsonl.gz", gzip.compress(JSONL.encode()), "auto", ["first", "second é"]),
    ("notes.md.zst", COMPRESS["zst"](TEXT.encode()), "auto", [TEXT]),
    ("notes.bz2", bz2.compress(TEXT.encode()), "auto", [TEXT]),
    ("notes.xz", lzma.compress(TEXT.encode()), "auto", [TEXT]),
    ("no_suffix", gzip.compress(JSONL.encode()), "auto", ["first", "second é"]),  # by magic
    ("empty.txt", b"", "auto", []),
])
def test_input_kinds(tmp_path, name, data, fmt, want):
    (tmp_path / name).write_bytes(data)
    (tmp_path / "other.txt").write_text("other")  # a run needs one document at least
    assert run(tmp_path, "--input", tmp_path / name, tmp_path / "other.txt",
               "--format", fmt) == 0
    assert documents(tmp_path / "out" / "c") == want + ["other"]


def make_tree(root):
    """A corpus directory: text of several kinds, compressed, nested, hidden, by content."""
    files = {"a.md": TEXT, "src/x.py": "print(1)\n", "src/deep/y.py": "print(2)\n",
             "src/z.txt": "zed", "lines.json": JSONL, ".git/HEAD": "ref: hidden\n",
             "src/.cache.py": "hidden too"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for i, (kind, compress) in enumerate(COMPRESS.items()):
        (root / "packed" / f"part{i}.jsonl.{kind}").parent.mkdir(exist_ok=True)
        (root / "packed" / f"part{i}.jsonl.{kind}").write_bytes(compress(
            "".join(json.dumps({"text": f"{kind} doc {j} " * j}) + "\n"
                    for j in range(1, 30)).encode()))
    return root


def test_directories_globs_and_workers_are_deterministic(tmp_path, capsys):
    tree = make_tree(tmp_path / "corpus")
    assert run(tmp_path, "--input", tree, "--glob", "*.py") == 0  # any depth, hidden skipped
    assert documents(tmp_path / "out" / "c") == ["print(2)\n", "print(1)\n"]

    # The whole tree, walked in sorted order: the same bytes for any number of workers.
    for workers in (1, 3):
        assert preprocess_main(["--input", str(tree), "--output-prefix",
                                str(tmp_path / "o" / f"w{workers}"),
                                "--workers", str(workers)]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == ["w1.bin", "w1.idx", "w3.bin", "w3.idx"]
    for ext in ("bin", "idx"):
        assert (tmp_path / "o" / f"w1.{ext}").read_bytes() == \
            (tmp_path / "o" / f"w3.{ext}").read_bytes()
    docs = documents(tmp_path / "o" / "w3")
    assert docs[:3] == [TEXT, "first", "second é"]  # a.md, lines.json, then packed/...
    assert docs[-3:] == ["print(2)\n", "print(1)\n", "zed"]  # src/deep/y.py, src/x.py, ...
    assert len(docs) == 3 + 4 * 29 + 3 and "ref: hidden\n" not in docs
    out = capsys.readouterr().out.splitlines()[-1]
    assert f"{len(docs)} documents" in out and "from 9 files (5 jsonl, 4 text)" in out, out
    assert "documents/s" in out and "tokens/s" in out and "MB/s" in out


@pytest.mark.parametrize("files,inputs,expect", [
    ({}, ["missing.txt"], "missing.txt: input does not exist"),
    ({"bin.dat": b"\x7fELF\x00\x00\x01"}, ["bin.dat"], "bin.dat: binary file (NUL bytes)"),
    ({"latin1.txt": "caf\xe9".encode("latin-1")}, ["latin1.txt"], "latin1.txt: not UTF-8 text"),
    ({"bad.jsonl": b'{"text": "ok"}\n{oops\n'}, ["bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    ({"log.txt": b'{"text": "looks like json"}\nplain text after\n'}, ["log.txt"],
     "log.txt:2: not valid JSON"),                 # the ambiguous case: --format text reads it
    ({"nokey.json": b'{"body": "x"}\n'}, ["nokey.json"], "nokey.json:1: no string field 'text'"),
    ({"cut.gz": gzip.compress(TEXT.encode() * 50)[:-30]}, ["cut.gz"], "cut.gz: cannot read"),
    ({"cut.zst": COMPRESS["zst"](TEXT.encode() * 50)[:-5]}, ["cut.zst"],
     "cut.zst: cannot read (zstd frame cut off"),
    ({"d/x.md": b"x"}, ["d", "--glob", "*.py"], "d: directory has no files matching --glob *.py"),
    ({"d/a.md": b"a", "d/b.md": b"b", "d/c.bin": b"\x00\x01", "d/e.md": b"e"},
     ["d", "--workers", "2"], "c.bin: binary file"),          # raised in a worker process
])
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(tmp_path, capsys, files, inputs,
                                                            expect):
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    before = sorted(os.listdir(tmp_path))
    # the first argument is a path under tmp_path, the rest options as they are
    assert run(tmp_path, "--input", tmp_path / inputs[0], *inputs[1:]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == before  # no out/, no .bin/.idx, no parts


def test_cli_end_to_end_and_progress_bar(tmp_path, capsys):
    from tools.preprocess_data import preprocess
    (tmp_path / "a.txt").write_text("First document.\nStill the first.\n")
    (tmp_path / "b.jsonl").write_text('{"body": "second"}\n\n{"body": "third é"}\n')
    out = tmp_path / "out" / "corpus"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                        "--output-prefix", str(out), "--jsonl-key", "body"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})  # this tree's ctxpar
    assert r.returncode == 0, r.stderr
    assert "3 documents" in r.stdout and r.stderr == ""  # no terminal: no bar
    assert documents(out) == ["First document.\nStill the first.\n", "second", "third é"]
    info = preprocess([str(tmp_path / "a.txt")], str(tmp_path / "again"), progress=True)
    assert info["documents"] == 1 and "preprocess: 100%" in capsys.readouterr().err


def test_a_model_folders_tokenizer_as_transformers_saves_it(tmp_path, capsys):
    """Gemma 3's shape: '</s>' is an ordinary piece (an HTML tag), EOS is '<eos>' as
    tokenizer_config.json says, and a special token sits past the model's rows
    (<image_soft_token>, id = the embedding's size): the file pair says the vocabulary the
    model has, so a model of that size trains on it; each document is BOS, text, EOS, and
    a long-context eval prompt starts with the BOS too."""
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from ctxpar.config import config_from_dict
    from ctxpar.data import HFTokenizer, build_data
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "</s>": 3,
             **{w: i + 4 for i, w in enumerate("the key is blue".split())}}  # 8 rows
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<image_soft_token>", special=True)])  # id 8
    tok.post_processor = processors.TemplateProcessing(  # BOS first, as Gemma's does
        single="<bos> $A", special_tokens=[("<bos>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>",
                            pad_token="<pad>").save_pretrained(tmp_path / "gemma")
    path = str(tmp_path / "gemma" / "tokenizer.json")
    hf = HFTokenizer(path)
    assert (hf.eos_token, hf.eos_id, hf.vocab_size, hf.bos_ids) == ("<eos>", 1, 8, [2])
    assert HFTokenizer(path, "</s>").eos_id == 3  # --eos-token still decides
    (tmp_path / "a.txt").write_text("the key is blue")
    assert run(tmp_path, "--input", tmp_path / "a.txt", "--tokenizer", path) == 0
    assert "vocab 8 eos 1" in capsys.readouterr().out
    ds = IndexedDataset(str(tmp_path / "out" / "c"))
    assert (ds.vocab_size, ds.eos_id, ds[0].tolist()) == (8, 1, [2, 4, 5, 6, 7, 1])
    cfg = config_from_dict({"model": {"vocab_size": 8, "seq_len": 2}, "data": {
        "kind": "tokens", "path": str(tmp_path / "out" / "c"), "eval_fraction": 0.0,
        "tokenizer": path}})
    assert build_data(cfg).train_source.vocab_size == 8  # accepted by a model of 8 rows
    from ctxpar.data.long_context import TASKS, Haystack, make_task
    task = make_task(TASKS[0], hf, Haystack.filler(hf), 64)  # a long-context eval prompt
    assert task.prompt[0] == 2 and 2 not in task.prompt[1:] and len(task.prompt) == 64


def word_tokenizer(path, words):
    """A word-level tokenizers JSON with EOS '</s>' (id 1) and the given words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in
                                                              enumerate(words)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def train_check_inputs(monkeypatch, capsys, sets):
    """train.py's input checks in this process: (exit code or None, stderr lines)."""
    import train
    monkeypatch.setenv("RANK", "0")
    args = train.parse_args(["--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                             "--set", "parallel.cp=1", "parallel.dp=1", "model.seq_len=16",
                             *sets])
    try:
        train.check_inputs(args, 1)
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_token_file_and_another_data_tokenizer_exit_2_naming_both(tmp_path, monkeypatch,
                                                                   capsys):
    # The .idx records which tokenizer made it: bytes (no --tokenizer) or the digest of the
    # tokenizer.json; train.py refuses, before anything starts, a data.tokenizer that is
    # another one, and either way round.
    pytest.importorskip("tokenizers")
    from ctxpar.data.tokenizer import tokenizer_identity
    bpe = word_tokenizer(tmp_path / "tokenizer.json", "the key is blue".split())
    (tmp_path / "a.txt").write_text("the key is blue " * 40)
    assert run(tmp_path, "--input", tmp_path / "a.txt") == 0  # byte-level ids
    made = str(tmp_path / "out" / "c")
    assert IndexedDataset(made).tokenizer == "byte-level"
    run_dir = f"logging.run_dir={tmp_path / 'run'}"
    code, err = train_check_inputs(monkeypatch, capsys, [
        "data.kind=tokens", f"data.path={made}", f"data.tokenizer={bpe}", run_dir])
    digest = tokenizer_identity(bpe)[:19]
    assert code == 2 and len(err) == 1, err
    assert f"{made}.idx was made with the byte-level tokenizer, not data.tokenizer=" \
        f"{bpe!r} ({digest})" in err[0], err
    # made with the tokenizer, trained as bytes
    assert run(tmp_path, "--input", tmp_path / "a.txt", "--tokenizer", bpe) == 0
    assert IndexedDataset(made).tokenizer == tokenizer_identity(bpe)
    code, err = train_check_inputs(monkeypatch, capsys, [
        "data.kind=tokens", f"data.path={made}", run_dir])
    assert code == 2 and len(err) == 1 and f"{made}.idx was made with the {digest} " \
        f"tokenizer, not the byte-level one (data.tokenizer unset)" in err[0], err
    code, err = train_check_inputs(monkeypatch, capsys, [  # the right one: no word (one
        # held-out window in this small file: evaluate on 1, which it holds)
        "data.kind=tokens", f"data.path={made}", f"data.tokenizer={bpe}", run_dir,
        "train.eval_samples=1"])
    assert code is None and err == [], err


def test_a_token_file_from_before_the_record_loads_with_one_warning(tmp_path):
    # A version-1 .idx (no tokenizer field) still loads: its vocabulary is still checked
    # against model.vocab_size, and the tokenizer is trusted with a one-line warning.
    import numpy as np
    from ctxpar.config import config_from_dict
    from ctxpar.data import DataError, build_data
    from ctxpar.data.indexed import HEADER_V1, MAGIC
    (tmp_path / "a.txt").write_text("old text " * 40)
    assert run(tmp_path, "--input", tmp_path / "a.txt") == 0
    prefix = str(tmp_path / "out" / "c")
    ds = IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:  # the same file as version 1 wrote it
        f.write(HEADER_V1.pack(MAGIC, 1, np.dtype(ds.dtype).itemsize, ds.vocab_size,
                               ds.eos_id, len(ds), ds.n_tokens))
        np.asarray(ds.doc_offsets, dtype="<i8").tofile(f)
    assert IndexedDataset(prefix).tokenizer is None
    data = {"kind": "tokens", "path": prefix, "eval_fraction": 0.0}
    warnings = build_data(config_from_dict({"model": {"seq_len": 16}, "data": data})).warnings
    assert len(warnings) == 1 and warnings[0].startswith(
        f"{prefix}.idx does not say which tokenizer made it") and \
        "trusting that it was the byte-level one (data.tokenizer unset)" in warnings[0]
    with pytest.raises(DataError, match="token ids go up to 255 but model.vocab_size=200"):
        build_data(config_from_dict({"model": {"seq_len": 16, "vocab_size": 200},
                                     "data": data}))
