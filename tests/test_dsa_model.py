"""DeepSeek sparse attention as a token mixer (models/dsa.py, model.dsa): its config refused
in one line where it cannot run, and the indexer's training in one process: the loss is
the LM loss plus loss_weight x the KL sum of ctxpar.context_parallel's indexer_kl, which
trains the indexer only (its input detached); 'dense_warmup' freezes the rest. The
transformers parity of the layer is tests/test_hf.py's (deepseek_v32, glm_moe_dsa); the
CP layouts' parity with one process tests/test_gpt.py's."""
import dataclasses

import pytest
import torch

from ctxpar.config import ConfigError, ModelConfig, config_from_dict
from ctxpar.config.dsa import DSAConfig
from ctxpar.config.mla import MLAConfig
from models.gpt import GPT
from models.options import ModelOptions

MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=12)
DSA = dict(index_n_heads=4, index_head_dim=16, index_topk=6)


def _config(dsa=None, parallel=None, mla=MLA, **model):
    data = {"model": dict(vocab_size=256, seq_len=256, n_layers=2, d_model=64, n_heads=4,
                          mla=mla, dsa={**DSA, **(dsa or {})}, **model),
            "parallel": parallel or {}}
    return config_from_dict(data)


@pytest.mark.quick
@pytest.mark.parametrize("dsa,parallel,extra,msg", [
    (dict(index_topk=0), None, {}, r"model.dsa.index_topk=0 must be an integer >= 1"),
    (dict(index_n_heads=3), dict(tp=2), {},
     r"model.dsa.index_n_heads=3 must divide over parallel.tp=2"),
    (dict(index_head_dim=8), None, {},
     r"model.dsa.index_head_dim=8 must be even and above model.mla.qk_rope_head_dim=8"),
    (dict(stage="sparse_warmup"), None, {},
     r"model.dsa.stage='sparse_warmup' must be one of \['frozen', 'dense_warmup', 'sparse'\]"),
    (None, None, dict(mla=None), r"model.dsa without model.mla"),
    (None, None, dict(mla={**MLA, "q_lora_rank": None}), r"model.mla.q_lora_rank=null"),
    (dict(indexer_types=["shared", "full"]), None, {}, r"indexer_types\[0\]='shared'"),
    (dict(indexer_types=["full"]), None, {}, r"one entry per layer \(model.n_layers=2\)"),
    (None, dict(cp=2, cp_comm="ulysses"), {}, r"parallel.cp_comm='ulysses'"),
    (dict(stage="sparse"), dict(pp=2), {}, r"stage='sparse' with parallel.pp=2"),
    (dict(indexer_types=["full", "shared"]), dict(pp=2), {}, r"'shared' layers and "
                                                            r"parallel.pp=2"),
    (dict(loss_weight=-1.0), None, {}, r"model.dsa.loss_weight=-1.0 must be a number >= 0"),
])
def test_dsa_configs_that_cannot_run_are_refused_in_one_line(dsa, parallel, extra, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        _config(dsa, parallel, **extra)
    assert "\n" not in str(e.value)


def test_a_valid_dsa_config_loads():
    cfg = _config(dict(indexer_types=["full", "shared"]), dict(cp=2, cp_comm="allgather"))
    assert cfg.model.dsa.indexer_types == ["full", "shared"]


def _model_cfg(stage, **dsa):
    return ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                       tie_embeddings=False, mla=MLAConfig(**MLA),
                       dsa=DSAConfig(**{**DSA, **dsa}, stage=stage))


def _loss_and_grads(stage, tokens, labels, **dsa):
    model = GPT(_model_cfg(stage, **dsa), options=ModelOptions(seed=3))
    loss = model(tokens, torch.arange(tokens.shape[1]), labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return model, loss, grads


def test_the_sparse_stage_adds_the_indexer_kl_and_trains_only_the_indexer():
    """'sparse' = 'frozen' + loss_weight x the KL sum: every gradient outside the indexers
    is the frozen run's (their input detached), the indexers' are nonzero; GLM-5's shared
    layer adds no loss of its own."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    labels = torch.randint(0, 128, (2, 32), generator=g)
    for dsa in (dict(loss_weight=0.5), dict(loss_weight=0.5, indexer_types=["full", "shared"])):
        frozen, loss0, grads0 = _loss_and_grads("frozen", tokens, labels, **dsa)
        sparse, loss1, grads1 = _loss_and_grads("sparse", tokens, labels, **dsa)
        kl = [b.attn.indexer_loss for b in sparse.layers if b.attn.indexer is not None]
        assert len(kl) == (1 if "indexer_types" in dsa else 2)
        assert all(k > 0 for k in kl)
        torch.testing.assert_close(loss1, loss0 + 0.5 * sum(kl), rtol=1e-6, atol=0)
        assert sparse.indexer_loss_sum == pytest.approx(sum(kl).item(), rel=1e-6)
        assert frozen.indexer_loss_sum is None and set(grads0) == set(grads1)
        for name, grad in grads1.items():
            if ".indexer." in name:
                assert grads0[name] is None and grad.abs().sum() > 0, name
            else:  # the same computation, the KL reaching none of them: bit for bit
                assert torch.equal(grad, grads0[name]), name


def test_the_dense_warmup_freezes_all_but_the_indexers_and_attends_densely():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    labels = torch.randint(0, 128, (2, 32), generator=g)
    model, loss, grads = _loss_and_grads("dense_warmup", tokens, labels)
    assert grads and all(".indexer." in n and gr.abs().sum() > 0 for n, gr in grads.items())
    # dense: the same logits as the model without model.dsa (MLA on every earlier token)
    dense = GPT(dataclasses.replace(model.cfg, dsa=None), options=ModelOptions(seed=3))
    sparse = GPT(dataclasses.replace(model.cfg, dsa=DSAConfig(**DSA)),
                 options=ModelOptions(seed=3))
    with torch.no_grad():
        want = dense(tokens, torch.arange(32))
        torch.testing.assert_close(model(tokens, torch.arange(32)), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(sparse(tokens, torch.arange(32)), want, atol=1e-3)
