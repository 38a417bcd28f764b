"""model.mtp with experts (model.mtp.moe) and MLA: DeepSeek-V3's, GLM-4.5's and
Qwen3-Next's multi-token prediction layers.

(1) Validation: model.mtp.moe without model.moe is one ConfigError line.
(2) One process, DeepSeek-V3's shape (tests/helpers/mtp_reference.py's MOE_MTP): the LM +
MTP loss with the routers' losses, each MTP block's router one more MoE layer's, and every
gradient equal the reference written from DeepSeek-V3 §2.2; each MTP depth's correction
bias moves by its own load. (CP x EP parity: tests/test_mtp.py's spawns.)
(3) Folders: DeepSeek-V3's and GLM-4.5's MTP layer (model.layers.{L}.*) imported, its
logits equal transformers' MtpModel's on the same weights (its MtpLayer over the
family's MoE decoder layer), the export keeps every MTP tensor (the embedding's and
head's copies, the router's correction bias) and imports back the same.
"""
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ctxpar.checkpoint import export, hf
from ctxpar.checkpoint.resume import CheckpointError
from ctxpar.checkpoint.weights import copy_full_weights_, load_buffers_
from ctxpar.config import ConfigError, ModelConfig, config_from_dict, rotary_dim
from ctxpar.config.mtp import MTPConfig
from ctxpar.data.mtp import mtp_inputs
from helpers.mtp_folders import numbered_mtp_folder
from helpers.mtp_reference import DOCS, MOE_MTP, make_batch, reference, single_process
from models.gpt import GPT
from models.moe import MoE


def test_mtp_experts_without_model_moe_fail_at_load_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.mtp.moe=true without model.moe") as e:
        config_from_dict({"model": {"mtp": {"moe": True}, "n_layers": 2}})
    assert "\n" not in str(e.value)


@pytest.mark.quick
def test_one_process_mla_and_experts_mtp_loss_and_gradients_equal_the_definition():
    tokens, labels = make_batch(MOE_MTP)
    want_loss, want_grads, want_counts = reference(MOE_MTP, tokens, labels, DOCS)
    loss, grads, model = single_process(MOE_MTP, tokens, labels, DOCS)
    # fp32: one sum then one division against per-depth means, rounding only
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert set(grads) == set(want_grads)
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    # every MTP depth's router and experts learn (its router through the routers' losses
    # and the weights it gives its experts), attention is MLA's
    for k in range(MOE_MTP.mtp.depth):
        block = f"mtp.layers.{k}.block."
        for n in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "attn.kv_b_proj.weight"):
            assert want_grads[block + n].abs().sum() > 0, block + n
    # the routers' rows: the block's MoE layer, then each MTP depth's (2 x B T x top-k)
    router = model.router_losses
    assert torch.equal(router.layer_counts, want_counts) and len(want_counts) == 3
    assert (want_counts.sum(1) == 2 * 32 * 2).all()
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    model.update_router_biases(router.layer_counts)  # aux-free balance, each its own load
    for mlp, counts in zip(moe, router.layer_counts):
        want = MOE_MTP.moe.bias_update_rate * torch.sign(counts.mean() - counts)
        torch.testing.assert_close(mlp.correction_bias(), want)


def _imported(src, depth=1):
    """ctxpar's GPT of a folder with model.mtp (experts), every tensor taken."""
    folder = hf.read_config(src)
    m = ModelConfig(**hf.model_fields(folder, src))
    m.mtp = MTPConfig(depth=depth, loss_weight=0.3, moe=True)
    hf.check_mtp(m, folder, src)
    reader = hf.WeightReader(src, m.tie_embeddings, hf.naming_of(m))
    reader.check(m)  # every MTP tensor taken, with its shape
    model = GPT(m).eval()
    copy_full_weights_(model, reader.get, None)
    load_buffers_(model.named_buffers(), reader.buffers(m))  # correction biases, MTP's too
    reader.check_mtp_copies(m)
    assert reader.unused() == [] and hf.left_out(src, m) is None
    return model


def _weights(model):
    """What an export writes: the parameters and the routers' correction biases."""
    names = set(hf.folder_buffers(model.cfg))
    return itertools.chain(model.named_parameters(),
                           ((n, b) for n, b in model.named_buffers() if n in names))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_numbered_mtp_layer_equals_transformers_mtp_model_and_exports_every_tensor(
        tmp_path, family):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref, mtp = numbered_mtp_folder(tmp_path / "src", family)
    src = str(tmp_path / "src")
    model = _imported(src)
    assert model.cfg.mtp == MTPConfig(depth=1, loss_weight=0.3, moe=True)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    ids = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)  # t_{i+1}
    with torch.no_grad():
        h = ref.model(tokens).last_hidden_state  # final-normed, as the MTP layer takes it
        want = mtp._project_to_logits(mtp.forward_layer(0, h, (pos + 1)[None], None,
                                                        input_ids=ids))
        x = model.hidden_states(tokens, pos)
        got = model.lm_logits(model.mtp.depth_hidden(0, x, model.embed(ids), pos,
                                                     rotary_dim(model.cfg)))
        torch.testing.assert_close(model.lm_logits(x), ref(tokens).logits, rtol=1e-5, atol=1e-5)
        # fp32, the same operations but for the attention kernel's summation order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the training loss's depth 1: the CE of MtpModel's logits against t_{i+2}
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)
        mtp_tokens, mtp_labels = mtp_inputs(tokens, labels, 1)
        model(tokens, pos, labels, mtp_tokens=mtp_tokens, mtp_labels=mtp_labels)
        mtp_ce = F.cross_entropy(want.flatten(0, 1), mtp_labels[:, 0].flatten())
        torch.testing.assert_close(model.mtp_loss_sums[0] / (mtp_labels != -100).sum(), mtp_ce,
                                   rtol=1e-5, atol=1e-6)
    out = tmp_path / "out"
    export.save_folder(str(out), _weights(model), model.cfg)
    back, source = load_file(out / "model.safetensors"), load_file(tmp_path / "src" /
                                                                    "model.safetensors")
    keys = sorted(k for k in source if k.startswith("model.layers.3."))
    assert len(keys) > 40 and sorted(k for k in back if k.startswith("model.layers.3.")) == keys
    for k in keys:
        assert torch.equal(back[k], source[k]), k
    again = _imported(str(out))  # and back: the same model
    theirs = dict(itertools.chain(again.named_parameters(), again.named_buffers()))
    for n, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        assert torch.equal(theirs[n], t), n
    with torch.no_grad():  # transformers reloads the export (and drops layer 3 itself)
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).float()(
            tokens).logits, ref(tokens).logits, rtol=1e-5, atol=1e-5)
    model.cfg.mtp = None  # model.mtp: null leaves them out, the start-up line says so
    assert "model.layers.3.*" in hf.left_out(src, model.cfg)


def test_mtp_copies_of_the_embedding_that_differ_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    numbered_mtp_folder(tmp_path, "deepseek_v3")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.shared_head.head.weight"][0, 0] += 1.0
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.3.shared_head.head.weight differs "
                                              r"from lm_head.weight: ctxpar's MTP layers share"):
        _imported(str(tmp_path))


def _saved_by_mtp(cfg, mode, tiled):
    """Bytes autograd saves in a forward with model.mtp's depths minus one without."""
    from ctxpar.config import MemoryConfig
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.options import ModelOptions

    model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                          seed=1, memory=MemoryConfig(tiled_loss=tiled,
                                                                      loss_tile_tokens=8)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)
    ids, targets = mtp_inputs(tokens, labels, cfg.mtp.depth)
    out = []
    for kw in ({"mtp_tokens": ids, "mtp_labels": targets}, {}):
        with saved_tensor_bytes(model.parameters()) as seen:
            loss = model(tokens, torch.arange(32), labels, **kw)
        loss.backward()
        out.append(sum(seen.values()))
    return out[0] - out[1]


@pytest.mark.parametrize("name", ["dense", "mla_moe"])
def test_planner_counts_the_mtp_depths_activations_as_autograd_saves_them(name):
    """Every checkpointing mode ('full' and 'every_n_layers' leave the MTP blocks whole),
    the loss whole or tiled: exact (the tiled loss's dx and fp32 dW per depth, made in
    forward and held by its Function, are counted beside autograd's, as the head's)."""
    from ctxpar.plan.candidate import Candidate
    from ctxpar.plan.mtp_layers import mtp_activations

    # DeepSeek-V3's blocks without the sequence-level loss, whose saved per-row tensors
    # the planner counts for no MoE layer yet (moe_layers.routed_saved)
    cfg = replace(MOE_MTP, moe=replace(MOE_MTP.moe, seq_aux_loss_coef=0.0)) \
        if name == "mla_moe" else ModelConfig(
        vocab_size=64, seq_len=32, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
        tie_embeddings=False, mtp=MTPConfig(depth=2))
    for mode in ("none", "selective", "full", "every_n_layers"):
        cand = Candidate(1, 1, 1, 1, "ring", 1, "zigzag", activation=mode, every_n_layers=2,
                         micro_batch=2)
        for tiled in (False, True):
            held = 2 * (64 * 32 * 4 + 4 * 64 * 32) if tiled else 0  # D (N d e + 4 V d)
            assert _saved_by_mtp(cfg, mode, tiled) + held == mtp_activations(cfg, cand, 4,
                                                                             tiled), (mode, tiled)
