"""Hugging Face Llama exchange, checked against transformers itself (test dependency, CPU).

(1) In process: ctxpar's RoPE frequencies (plain, linear, Llama 3.1) equal transformers';
a tiny random LlamaForCausalLM built here (no downloads) imported into ctxpar's GPT gives
its logits; GPT -> Llama folder -> transformers gives GPT's logits; Llama -> ctxpar ->
Llama returns the same tensors bit for bit; what ctxpar cannot represent is refused
naming the field. (2) train.py: a tp2·cp2 run started from a Llama folder
(model.init_from) logs, at step 1, the loss transformers computes on the same global
batch; its checkpoint exported by tools/convert_checkpoint.py (with the run's
tokenizer) is the same model in transformers, and imports back to the same parameters.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")  # the dev extra; not a runtime dependency
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from ctxpar.checkpoint import CheckpointError, hf, read_manifest  # noqa: E402
from ctxpar.checkpoint.universal import full_weights, to_universal  # noqa: E402
from ctxpar.checkpoint.weights import copy_full_weights_, resolve_checkpoint  # noqa: E402
from ctxpar.config import ModelConfig  # noqa: E402
from ctxpar.data import PasskeyTask  # noqa: E402
from models.gpt import GPT, rope_inv_freq  # noqa: E402
from helpers.train_run import ROOT, losses, run_train  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# fp32 on both sides; the same math in another order (fused SDPA vs eager softmax, RoPE
# frequencies computed separately): logits agree to ~3e-7 relative; 1e-5 leaves margin.
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_llama(path, tied=True, rope_scaling=None, **overrides):
    """A random 2-layer GQA LlamaForCausalLM saved to path (built here, no downloads)."""
    torch.manual_seed(0)
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=5000.0, rms_norm_eps=1e-5)
    cfg = LlamaConfig(**{**fields, **overrides}, rope_scaling=rope_scaling,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return model


def ctxpar_from(path):
    m = ModelConfig(**hf.model_fields(hf.read_config(path), path))
    model = GPT(m).eval()
    reader = hf.WeightReader(path, m.tie_embeddings)
    copy_full_weights_(model, reader.get, None)
    assert reader.unused() == []
    return model


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_rope_frequencies_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5000.0,
                      rope_scaling=scaling)
    kind = (scaling or {}).get("rope_type")
    if kind is None:
        want = 1.0 / (5000.0 ** (torch.arange(0, 16, 2).float() / 16))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(16, 5000.0, scaling), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("tied,scaling", [(True, None), (False, LLAMA3)])
def test_import_export_match_transformers_logits(tmp_path, tied, scaling):
    ref = tiny_llama(tmp_path / "llama", tied, scaling)
    model = ctxpar_from(tmp_path / "llama")
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens, torch.arange(48))
        torch.testing.assert_close(got, want, **TOL)
        hf.save_folder(tmp_path / "out", ((n, p) for n, p in model.named_parameters()),
                       model.cfg)
        back = LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
        torch.testing.assert_close(back(tokens).logits, got, **TOL)
    # Llama -> ctxpar -> Llama: the same tensors, bit for bit.
    a, b = ref.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("field,value,msg", [
    ("attention_bias", True, "attention_bias=True: ctxpar's attention has no biases"),
    ("mlp_bias", True, "mlp_bias=True: ctxpar's MLP has no biases"),
    ("hidden_act", "gelu", "hidden_act='gelu': ctxpar's MLP is SwiGLU"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0},
     "rope_scaling.rope_type='yarn' is not implemented by ctxpar"),
    ("head_dim", 32, "head_dim=32: ctxpar's head dim is hidden_size/num_attention_heads = 16"),
    ("model_type", "mistral", "model_type='mistral': ctxpar imports Llama models only"),
])
def test_unrepresentable_llamas_are_refused_naming_the_field(tmp_path, field, value, msg):
    cfg = hf.llama_config(ModelConfig(vocab_size=96, d_model=64, n_heads=4))
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    assert msg in str(e.value) and "config.json" in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match=r"model.mlp='gelu' cannot be exported"):
        hf.llama_config(ModelConfig(mlp="gelu"))


def test_init_from_checks_the_architecture(tmp_path):
    tiny_llama(tmp_path, vocab_size=256)
    fields = hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    same = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_hidden=96, seq_len=1024, rope_theta=5e5)
    # context extension: a longer sequence and another RoPE base may differ
    assert hf.check_matches(same, fields, "x") == {"seq_len": (128, 1024),
                                                   "rope_theta": (5000.0, 5e5)}
    with pytest.raises(CheckpointError, match=r"model.n_layers=4 but model.init_from=x has "
                                              r"n_layers=2: set model.n_layers=2"):
        hf.check_matches(ModelConfig(**{**vars(same), "n_layers": 4}), fields, "x")


def tiny_tokenizer(path):
    """A word-level tokenizers JSON with EOS '</s>' (tokenizers comes with transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("the key is".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def passkey_loss(model, n_samples=16, seq_len=128):
    """The token-mean loss over the first global batch of train.py's passkey stream."""
    task = PasskeyTask(seq_len, 2, 1234, "train")
    pairs = [task[i] for i in range(n_samples)]
    x = torch.from_numpy(np.stack([p[0] for p in pairs]))
    y = torch.from_numpy(np.stack([p[1] for p in pairs]))
    with torch.no_grad():
        logits = model(x).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                             ignore_index=-100).item()


def test_train_py_from_a_llama_folder_and_back(tmp_path):
    # configs/tiny_cpu.yaml's model (swiglu ffn 192, tied, theta 1e4) as a Llama
    ref = tiny_llama(tmp_path / "llama", vocab_size=256, intermediate_size=192,
                     rope_theta=10000.0)
    tiny_tokenizer(tmp_path / "tokenizer.json")
    run = tmp_path / "run"
    proc = run_train(str(run), 4, [
        "parallel.tp=2", "parallel.cp=2", "parallel.dp=1", "train.steps=1",
        f"model.init_from={tmp_path / 'llama'}", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
        "logging.wandb.mode=disabled"])
    assert "initialized from" in proc.stdout and "Hugging Face Llama folder" in proc.stdout
    # Step 1's loss is computed before any update: the imported model's loss on the batch.
    want = passkey_loss(ref)
    got = losses(str(run))[1]
    assert abs(got - want) <= 1e-5 * want, (got, want)  # fp32, TP/CP reduction order only

    # Export the trained checkpoint (tp2·cp2, ZeRO-1) with the CLI.
    out = tmp_path / "exported"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                        str(run), "--to", "hf", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "</s>" and json.loads((out / "config.json").read_text())[
        "eos_token_id"] == 1
    exported = LlamaForCausalLM.from_pretrained(out).float().eval()
    # ctxpar -> Llama -> ctxpar: the checkpoint's full fp32 weights, bit for bit.
    tag = resolve_checkpoint(str(run))
    u = str(tmp_path / "universal")
    to_universal(tag, u, read_manifest(tag)["layout"], 2, lambda n: n)
    saved = full_weights(u)
    back = ctxpar_from(out)
    for name, p in back.named_parameters():
        assert torch.equal(p, saved[name]), name
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(64)), exported(tokens).logits, **TOL)


def test_train_py_refuses_an_unrepresentable_init_from_with_exit_2(tmp_path):
    tiny_llama(tmp_path / "llama", vocab_size=256, attention_bias=True)
    proc = run_train(str(tmp_path / "run"), 1, [
        "parallel.cp=1", "parallel.dp=1", f"model.init_from={tmp_path / 'llama'}"],
        check=False, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "attention_bias=True: ctxpar's attention has no biases" in lines[0]
