"""Data: token files, packing, the sample stream (determinism, resume, DP/CP split), passkey."""
import json
import os
import re

import numpy as np
import pytest
import torch

from ctxpar.config import ConfigError, config_from_dict
from ctxpar.data import (ByteTokenizer, DataError, HFTokenizer, IndexedDataset,
                         IndexedDatasetWriter, PasskeyTask, TokenWindows,
                         build_data, build_sample_stream, passkey_accuracy, passkey_correct)
from ctxpar.data.passkey import NEEDLE, QUESTION, min_seq_len
from ctxpar.testing import run_distributed


rng = np.random.default_rng(0)
DOCS = [rng.integers(1, 256, size=n).tolist() for n in (5, 40, 1, 17, 90, 33, 8, 61)]


def write(prefix, docs=DOCS, vocab=256, eos=0):
    with IndexedDatasetWriter(str(prefix), vocab, eos) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


# ---------------------------------------------------------------- the .bin/.idx format

@pytest.mark.quick
@pytest.mark.parametrize("vocab,dtype", [(256, np.uint16), (70_000, np.uint32)])
def test_format_round_trip(tmp_path, vocab, dtype):
    docs = [d + [vocab - 1] for d in DOCS]  # the largest id must survive the dtype
    ds = IndexedDataset(write(tmp_path / "c", docs, vocab, eos=3))
    assert ds.tokens.dtype == dtype and ds.vocab_size == vocab and ds.eos_id == 3
    assert len(ds) == len(docs) and ds.n_tokens == sum(len(d) + 1 for d in docs)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d + [3]  # every document ends with its EOS
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]  # no temporary files left


def test_failed_write_leaves_old_pair_and_no_temporaries(tmp_path):
    prefix = write(tmp_path / "c")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        with IndexedDatasetWriter(prefix, 256, 0) as w:
            w.add_document([1, 2])
            w.add_document([300])  # not a byte: refused mid-write
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]
    assert IndexedDataset(prefix)[1].tolist() == DOCS[1] + [0]  # the old pair, untouched


def one_line_error(fn, *match):
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for m in match:
        assert m in msg, msg
    return msg


@pytest.mark.quick
def test_bad_token_files_give_one_line(tmp_path):
    one_line_error(lambda: IndexedDataset(str(tmp_path / "missing")), "missing.idx",
                   "does not exist")
    prefix = write(tmp_path / "c")
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    good_idx, good_bin = open(idx, "rb").read(), open(bin_, "rb").read()

    open(bin_, "wb").write(good_bin[:-2])  # one token short
    one_line_error(lambda: IndexedDataset(prefix), "c.bin", "truncated")
    open(bin_, "wb").write(good_bin)
    open(idx, "wb").write(b"NOTANIDX" + good_idx[8:])
    one_line_error(lambda: IndexedDataset(prefix), "c.idx", "magic")
    open(idx, "wb").write(good_idx[:20])
    one_line_error(lambda: IndexedDataset(prefix), "c.idx", "truncated")
    open(idx, "wb").write(good_idx[:-8])
    one_line_error(lambda: IndexedDataset(prefix), "c.idx", "corrupt")
    open(idx, "wb").write(good_idx)
    os.remove(bin_)
    os.mkdir(bin_)  # present but unreadable as a token file
    one_line_error(lambda: IndexedDataset(prefix), "c.bin", "not a regular file")


def test_build_data_bad_path_one_line(tmp_path):
    cfg = config_from_dict({"model": {"seq_len": 16}, "data": {
        "kind": "tokens", "path": str(tmp_path / "nope")}}, check_paths=False)
    one_line_error(lambda: build_data(cfg), "nope.idx", "does not exist")
    with pytest.raises(ConfigError, match="nope.bin does not exist"):  # the load-time check
        config_from_dict({"data": {"kind": "tokens", "path": str(tmp_path / "nope")}})
    big = write(tmp_path / "big", vocab=512)  # ids fit 512, the model has 256
    cfg = config_from_dict({"model": {"seq_len": 16}, "data": {"kind": "tokens", "path": big}})
    one_line_error(lambda: build_data(cfg), "model.vocab_size=256")


# ---------------------------------------------------------------- packing and the stream

def test_packing_windows_cover_the_stream(tmp_path):
    T = 16
    ds = IndexedDataset(write(tmp_path / "c"))
    win = TokenWindows(str(tmp_path / "c"), T, seed=1)
    n = (ds.n_tokens - 1) // T
    assert win.n_windows == n
    flat = ds.tokens.astype(np.int64)
    starts = []
    for i in range(n):  # one epoch
        x, y = win[i]
        assert x.shape == y.shape == (T,)
        np.testing.assert_array_equal(y[:-1], x[1:])  # labels = inputs shifted by one
        start = int(np.flatnonzero([np.array_equal(flat[s:s + T], x) for s in
                                    range(0, n * T, T)])[0]) * T
        np.testing.assert_array_equal(y, flat[start + 1:start + T + 1])
        starts.append(start)
    assert sorted(starts) == list(range(0, n * T, T))  # each window exactly once per epoch
    assert starts != sorted(starts)  # and shuffled
    # Documents are packed back to back with EOS between them.
    assert (flat == 0).sum() == len(DOCS) and flat[len(DOCS[0])] == 0
    epoch1 = [int(win[n + i][0][0]) for i in range(n)]  # a second epoch, another order
    assert epoch1 != [int(win[i][0][0]) for i in range(n)]


def test_too_short_token_file(tmp_path):
    prefix = write(tmp_path / "c", [[1, 2, 3]])
    one_line_error(lambda: TokenWindows(prefix, 16), "fewer than one sample")


def _tokens_cfg(prefix, seq_len=16, **data):
    return config_from_dict({"model": {"seq_len": seq_len},
                             "data": {"kind": "tokens", "path": prefix, **data}})


def _window_starts(source, n):
    """The file offset each of the first n samples of a TokenWindows starts at (by content)."""
    flat, T = source.data.tokens, source.seq_len
    starts = []
    for i in range(n):
        x = source[i][0]
        hits = [s for s in range(0, len(flat) - T, T) if np.array_equal(flat[s:s + T], x)]
        assert len(hits) == 1  # random bytes: a 16-token window is unique in the file
        starts.append(hits[0])
    return starts


def test_token_eval_split_is_held_out(tmp_path):
    prefix = write(tmp_path / "c")  # 263 tokens: 16 windows of 16
    data = build_data(_tokens_cfg(prefix, eval_fraction=0.25))
    train, held = data.train_source, data.eval_source
    assert (train.n_windows, held.n_windows) == (12, 4)  # round(16 * 0.25), at the end
    # Over 3 epochs train visits exactly windows 0..11, eval exactly 12..15: disjoint
    # stretches of text, together the whole file.
    assert set(_window_starts(train, 36)) == set(range(0, 12 * 16, 16))
    assert set(_window_starts(held, 8)) == set(range(12 * 16, 16 * 16, 16))
    # The default: at least one window held out; 0 and no eval_path: nothing to evaluate.
    assert build_data(_tokens_cfg(prefix)).eval_source.n_windows == 1
    assert not build_data(_tokens_cfg(prefix, eval_fraction=0.0)).has_eval
    with pytest.raises(DataError, match="no held-out eval data"):
        build_sample_stream(_tokens_cfg(prefix, eval_fraction=0.0), split="eval")
    # A held-out file: train keeps every window of path, eval reads all of eval_path.
    other = write(tmp_path / "held", [d[::-1] for d in DOCS])
    data = build_data(_tokens_cfg(prefix, eval_path=other))
    assert data.train_source.n_windows == 16 and data.eval_source.data.n_tokens == 263
    assert set(_window_starts(data.eval_source, 16)) == set(range(0, 256, 16))
    # Holding out everything is refused in one line naming the numbers.
    one_line_error(lambda: build_data(_tokens_cfg(write(tmp_path / "s", [[1] * 40]), 16,
                                                  eval_fraction=0.9)),
                   "data.eval_fraction=0.9 holds out 2 of its 2 samples", "none to train on")


@pytest.mark.parametrize("data,msg", [
    ({"kind": "tokens", "eval_fraction": 1.0}, "data.eval_fraction=1.0 must be in [0, 1)"),
    ({"kind": "tokens", "eval_path": "/nonexistent/held"},
     "data.eval_path='/nonexistent/held': /nonexistent/held.bin does not exist"),
    ({"eval_path": "x"}, "data.eval_path is set but data.kind='passkey'"),
])
def test_bad_eval_data_config(tmp_path, data, msg):
    data = {"path": write(tmp_path / "c"), **data} if data.get("kind") else data
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"seq_len": 96}, "data": data})
    assert msg in str(e.value) and "\n" not in str(e.value)


def collect(stream, n):
    return [stream.next_batch() for _ in range(n)]


def same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("tokens", "labels"))


@pytest.mark.parametrize("kind", ["passkey", "tokens"])
def test_stream_deterministic_resumable_dp_disjoint(tmp_path, kind):
    data = {"kind": "tokens", "path": write(tmp_path / "c")} if kind == "tokens" else {}
    cfg = config_from_dict({"model": {"seq_len": 96 if kind == "passkey" else 8},
                            "train": {"micro_batch_size": 2, "seed": 7}, "data": data})
    B, T = 2, cfg.model.seq_len
    a = collect(build_sample_stream(cfg, 0, 1), 6)
    assert a[0]["tokens"].shape == a[0]["labels"].shape == (B, T)
    assert a[0]["tokens"].dtype == torch.int64
    assert same(a, collect(build_sample_stream(cfg, 0, 1), 6))  # same seed, same samples
    other = config_from_dict({"model": {"seq_len": T},
                              "train": {"micro_batch_size": 2, "seed": 8}, "data": data})
    assert not same(a, collect(build_sample_stream(other, 0, 1), 6))

    # Resume: state after 3 micro-batches, a fresh stream continues identically.
    s = build_sample_stream(cfg, 0, 1)
    collect(s, 3)
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint's serialisation
    assert state["samples_consumed"] == 3 * B
    resumed = build_sample_stream(cfg, 0, 1)
    resumed.load_state_dict(state)
    assert same(a[3:], collect(resumed, 3))
    with pytest.raises(DataError, match="seed"):
        build_sample_stream(other, 0, 1).load_state_dict(state)
    with pytest.raises(DataError, match="a data.dynamic_cp stream's .step 3.: resume it"):
        build_sample_stream(cfg, 0, 1).load_state_dict({"kind": "dynamic_cp", "step": 3,
                                                         "tokens_seen": 99})

    # DP: rank r of dp=2 takes global samples [c + 2r, c + 2r + 2) of each 4-sample step,
    # so the two ranks together walk the single-rank stream in order, disjointly.
    r0, r1 = collect(build_sample_stream(cfg, 0, 2), 3), collect(build_sample_stream(cfg, 1, 2), 3)
    for k in range(3):
        assert same([r0[k]], [a[2 * k]]) and same([r1[k]], [a[2 * k + 1]])
    rows = [tuple(b["tokens"][i].tolist()) for b in r0 + r1 for i in range(B)]
    assert len(set(rows)) == len(rows)  # no sample on two DP ranks


# ---------------------------------------------------------------- passkey

def test_passkey_sample_format():
    T, d = 128, 2
    task = PasskeyTask(T, d, seed=3)
    depths, keys = [], set()
    for i in range(300):
        text, key, depth = task.text(i)
        x, y = task[i]
        assert len(text) == T + 1 and x.shape == y.shape == (T,)
        assert text.count(NEEDLE.format(key=key)) == 1 and text.count("pass key is") == 2
        assert text.endswith(QUESTION + key) and text.index(NEEDLE.format(key=key)) == depth
        assert re.findall(r"\d", text) == list(key) * 2  # digits: the needle and the answer
        assert bytes(x.tolist()).decode() == text[:-1]
        assert (y[:-d] == -100).all() and bytes(y[-d:].tolist()).decode() == key
        depths.append(depth / T)
        keys.add(key)
    assert min(depths) < 0.1 and max(depths) > 0.35  # the needle moves through the filler
    assert len(keys) > 90  # ~all 100 keys in 300 draws (P(<=90) is negligible)
    np.testing.assert_array_equal(task[5][0], PasskeyTask(T, d, seed=3)[5][0])
    assert task.text(5) != PasskeyTask(T, d, seed=3, split="eval").text(5)
    assert task.text(5) != PasskeyTask(T, d, seed=4).text(5)


def test_passkey_length_limits():
    PasskeyTask(min_seq_len(3), 3)[0]
    with pytest.raises(DataError, match="needs seq_len >= "):
        PasskeyTask(min_seq_len(3) - 1, 3)
    with pytest.raises(ConfigError, match="too short for data.kind='passkey'"):
        config_from_dict({"model": {"seq_len": 64}})


def test_passkey_accuracy():
    task = PasskeyTask(96, 2, seed=0)
    labels = torch.from_numpy(np.stack([task[i][1] for i in range(4)]))  # (4, 96)
    preds = torch.where(labels == -100, torch.zeros_like(labels), labels)  # all correct
    preds[1, -1] = (preds[1, -1] - 48 + 1) % 10 + 48   # sample 1: last digit wrong
    preds[2, -2] = (preds[2, -2] - 48 + 1) % 10 + 48   # sample 2: first digit wrong
    preds[3, :-2] = 7  # sample 3: garbage off the answer does not matter
    assert passkey_correct(preds, labels).tolist() == [True, False, False, True]
    assert passkey_accuracy(preds, labels) == 0.5
    logits = torch.nn.functional.one_hot(preds, 256).float()  # (4, 96, 256) -> same argmax
    assert passkey_accuracy(logits, labels) == 0.5
    assert not passkey_correct(preds, torch.full_like(labels, -100)).any()  # no answer: wrong


# ---------------------------------------------------------------- tokenizers

def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\x00!")
    assert max(ids) < tok.vocab_size == 256 and tok.eos_id not in ids  # NUL is dropped
    assert tok.decode(ids + [tok.eos_id]) == "héllo!"


def test_hf_tokenizer_adapter(tmp_path):
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:  # not a dependency: the adapter must say how to get it
        (tmp_path / "t.json").write_text("{}")
        with pytest.raises(ImportError, match="pip install tokenizers"):
            HFTokenizer(str(tmp_path / "t.json"))
        return
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "t.json"))
    hf = HFTokenizer(str(tmp_path / "t.json"))
    assert hf.eos_token == "</s>" and hf.vocab_size == 5 and hf.decode(hf.encode("a c")) == "a c"


# ---------------------------------------------------------------- DP x CP on gloo ranks

def _dp_cp_stream(rank, world, prefix):
    from ctxpar.components.evaluation import evaluate
    from ctxpar.tensor_parallel import vocab_parallel_argmax
    from ctxpar.distributed.parallel_state import init_parallel_state
    from ctxpar.context_parallel.layouts import gather_sequence
    state = init_parallel_state(cp=2, dp=2)
    out = {}
    for kind, layout in (("passkey", "zigzag"), ("tokens", "striped"), ("passkey", "contiguous")):
        cfg = config_from_dict({"model": {"seq_len": 96}, "parallel": {"cp": 2, "layout": layout},
                                "train": {"micro_batch_size": 2, "global_batch_size": 4,
                                          "eval_samples": 10},
                                "data": {"kind": kind, "path": prefix}}, world_size=world)
        data = build_data(cfg)
        mb = data.train_stream(state).next_microbatch()
        assert mb["tokens"].shape == mb["labels"].shape == (2, 48) and mb["positions"].shape == (48,)
        full = {k: gather_sequence(mb[k], 1, state.cp_group, layout) for k in ("tokens", "labels")}
        want = build_sample_stream(cfg, state.dp_rank, 2).next_batch()  # unsharded reference
        for k in full:
            assert torch.equal(full[k], want[k]), (kind, layout, k)
            assert torch.equal(mb[k], want[k][:, mb["positions"]])  # token i at positions[i]
        out[(kind, layout)] = (full["tokens"].tolist(), mb["positions"].tolist())
    out["eval"] = evaluate(_KeyOracle(state.cp_group, "zigzag"), _eval_data(world), state)
    text = build_data(config_from_dict({
        "model": {"seq_len": 96}, "parallel": {"cp": 2, "layout": "striped"},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "eval_samples": 10},
        "data": {"kind": "tokens", "path": prefix, "eval_fraction": 0.5}}, world_size=world))
    out["text_eval"] = evaluate(_Repeat(), text, state)
    # vocab_parallel_argmax over a 2-rank group (the dp group stands in for TP).
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 8).round()  # rounding makes ties: the first max must win
    mine = logits.chunk(2, dim=-1)[state.dp_rank]
    assert torch.equal(vocab_parallel_argmax(mine, state.dp_group), logits.argmax(-1))
    return out


def _eval_data(world):
    return build_data(config_from_dict({
        "model": {"seq_len": 96}, "parallel": {"cp": 2, "layout": "zigzag"},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "eval_samples": 10}},
        world_size=world))


class _Repeat(torch.nn.Module):
    """Logits 2 on the current token, 0 elsewhere: CE = log(e^2 + 255) - 2*[next == current]."""

    def forward(self, tokens, positions):
        return 2.0 * torch.nn.functional.one_hot(tokens, 256).float()  # (B, T/cp, V)


class _KeyOracle(torch.nn.Module):
    """Cheats across CP to find the key, then answers right only when key % 3 != 0."""

    def __init__(self, cp_group, layout):
        super().__init__()
        self.cp_group, self.layout = cp_group, layout

    def forward(self, tokens, positions):
        from ctxpar.context_parallel.layouts import gather_sequence
        full = gather_sequence(tokens, 1, self.cp_group, self.layout)  # (B, T)
        logits = torch.zeros(*full.shape, 256)
        for b, row in enumerate(full.tolist()):
            key = re.search(r"pass key is (\d+)\.", bytes(row).decode()).group(1)
            answer = [ord(c) for c in key] if int(key) % 3 else [ord("x")] * len(key)
            for j, tok in enumerate(answer):  # label at T-d+j is digit j
                logits[b, full.shape[1] - len(key) + j, tok] = 1.0
        return logits[:, positions]  # this rank's positions: (B, T/cp, V)


def test_dp_cp_streams_shards_and_eval(tmp_path):
    prefix = write(tmp_path / "c", DOCS * 4)
    res = run_distributed(_dp_cp_stream, 4, prefix, timeout=240)
    # grid tp-cp-dp-pp: cp groups [0,1], [2,3]; dp groups [0,2], [1,3]
    for key in res[0]:
        if key in ("eval", "text_eval"):
            continue
        assert res[0][key][0] == res[1][key][0] and res[2][key][0] == res[3][key][0]  # CP same
        assert not set(map(tuple, res[0][key][0])) & set(map(tuple, res[2][key][0]))  # DP apart
        assert res[0][key][1] != res[1][key][1]  # CP ranks hold different positions
    # Eval: 10 samples round up to 3 micro-batches x 2 x dp 2 = 12; the oracle is right on
    # exactly the eval samples whose key is not a multiple of 3.
    task = PasskeyTask(96, 2, seed=1234, split="eval")
    want = sum(int(task.text(i)[1]) % 3 != 0 for i in range(12)) / 12
    for r in res:
        assert r["eval"]["eval_samples"] == r["eval"]["eval_distinct_samples"] == 12
        assert r["eval"]["eval_accuracy"] == pytest.approx(want, abs=1e-12)
    # Text eval: the token mean over the 12 held-out samples (DP x CP), not a mean of
    # per-rank means. The held-out half of the file is windows 5..9 (seq_len 96).
    cfg = config_from_dict({"model": {"seq_len": 96}, "train": {"seed": 1234},
                            "data": {"kind": "tokens", "path": prefix, "eval_fraction": 0.5}})
    held = build_data(cfg).eval_source
    assert (held.first, held.n_windows) == (5, 5)
    pairs = [held[i] for i in range(12)]
    same_next = np.mean([np.mean(x == y) for x, y in pairs])
    want_loss = np.log(np.exp(2.0) + 255) - 2.0 * same_next
    for r in res:
        assert set(r["text_eval"]) == {"eval_loss", "eval_ppl", "eval_samples",
                                       "eval_distinct_samples"}
        # 12 samples over the 5 held-out windows, cycled: said, not hidden
        assert (r["text_eval"]["eval_samples"], r["text_eval"]["eval_distinct_samples"]) \
            == (12, 5)
        # fp32 logits/CE per token, fp64 sums: ~1e-7 relative.
        assert r["text_eval"]["eval_loss"] == pytest.approx(want_loss, rel=1e-6)
        assert r["text_eval"]["eval_ppl"] == pytest.approx(np.exp(want_loss), rel=1e-6)


# ---------------------------------------------------------------- packed documents


def test_window_documents_and_eod_positions_follow_the_index(tmp_path):
    """Each window's cu_seqlens are the .idx's document ends inside it (a document ends
    after its EOS, and no EOS occurs inside a document here), eod_positions the EOS
    positions; the stream masks the label after each EOS with eod_mask_loss."""
    from ctxpar.data import SampleStream
    docs = [rng.integers(1, 256, size=n).tolist() for n in (1, 2, 15, 16, 3, 40, 1, 7, 30)]
    source = TokenWindows(write(tmp_path / "c", docs), 16)
    for i in range(source.n_windows):
        inputs, labels = source[i]
        eos = np.flatnonzero(inputs == 0)
        assert source.eod_positions(i).tolist() == eos.tolist(), i
        cu = source.documents(i)
        assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == 16
        assert cu[1:-1].tolist() == [e + 1 for e in eos if e + 1 < 16], i
    stream = SampleStream(source, 2, documents=True, eod_mask_loss=True)
    batch = stream.next_batch()
    for b in range(2):
        eos = batch["tokens"][b] == 0
        assert (batch["labels"][b][eos] == -100).all() and (batch["labels"][b][~eos] >= 0).all()
        assert torch.equal(batch["cu_seqlens"][b], torch.from_numpy(source.documents(b)))
    # The stream's only state is still the sample count: resuming needs nothing else.
    assert set(stream.state_dict()) == {"samples_consumed", "source"}


def test_packed_passkey_documents():
    task = PasskeyTask(256, 2, seed=1, docs=3)
    assert task.fingerprint["docs"] == 3 and "docs" not in PasskeyTask(256, 2).fingerprint
    for i in range(20):
        text, key, depth, starts = task.sample(i)
        cu = task.documents(i)
        assert len(text) == 257 and cu.tolist() == [*starts, 256] and len(starts) == 3
        pieces = [text[a:b] for a, b in zip(starts, [*starts[1:], 257])]
        keys = [re.search(r"The pass key is (\d+)\. Remember it\.", p).group(1) for p in pieces]
        assert keys[-1] == key and key not in keys[:-1], (keys, key)  # others: other keys
        assert QUESTION not in "".join(pieces[:-1]) and pieces[-1].endswith(QUESTION + key)
        assert text[depth:].startswith(NEEDLE.format(key=key))
    # One document per sample: the task as before, boundaries [0, T].
    assert PasskeyTask(256, 2).documents(0).tolist() == [0, 256]
    with pytest.raises(DataError, match="3 document\\(s\\) per sample needs seq_len >= 162"):
        PasskeyTask(128, 2, docs=3)


def test_reset_positions_restart_per_document_on_every_shard():
    from ctxpar.context_parallel import NoComm
    from ctxpar.data import shard_batch
    cu = torch.tensor([0, 1, 5, 11, 16], dtype=torch.int32)
    batch = {"tokens": torch.arange(32).view(2, 16), "labels": torch.arange(32).view(2, 16),
             "cu_seqlens": [cu, torch.tensor([0, 16], dtype=torch.int32)]}
    want = torch.tensor([[0, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4], list(range(16))])
    for layout in ("contiguous", "zigzag", "striped"):
        for r in range(2):
            local = shard_batch(batch, NoComm(r, 2), layout, reset_positions=True)
            pos = local["positions"]
            assert pos.shape == (2, 8) and local["cu_seqlens"] is batch["cu_seqlens"]
            glob = shard_batch(batch, NoComm(r, 2), layout)["positions"]
            assert torch.equal(pos, want[:, glob]), (layout, r)


@pytest.mark.quick
def test_more_eval_samples_than_held_out_windows_is_warned_in_one_line(tmp_path):
    """train.eval_samples past the held-out split's windows: one line naming both counts
    and the key that sets the split (train.py warns it at start); none when they fit."""
    from ctxpar.components.evaluation import eval_shortfall
    prefix = write(tmp_path / "c", DOCS * 4)
    cfg = config_from_dict({"model": {"seq_len": 96}, "train": {"eval_samples": 32},
                            "data": {"kind": "tokens", "path": prefix, "eval_fraction": 0.2}})
    data = build_data(cfg)
    k = data.eval_source.n_windows
    assert 1 <= k < 32
    line = eval_shortfall(cfg, data)
    assert line.startswith(f"train.eval_samples=32 but the held-out split (data.eval_fraction"
                           f"=0.2 of {prefix}) holds {k} window") and "\n" not in line, line
    assert f"cycles over those {k}" in line and "eval_distinct_samples" in line
    fits = config_from_dict({"model": {"seq_len": 96}, "train": {"eval_samples": k},
                             "data": {"kind": "tokens", "path": prefix, "eval_fraction": 0.2}})
    assert eval_shortfall(fits, build_data(fits)) is None
    passkey = config_from_dict({"model": {"seq_len": 96}, "train": {"eval_samples": 10**6}})
    assert eval_shortfall(passkey, build_data(passkey)) is None  # never repeats
