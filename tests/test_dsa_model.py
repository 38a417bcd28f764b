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
    (dict(loss_weight=-1.0), None, {}, r"model.dsa.loss_weight=-1.0 must be a number >= 0"),
])
def test_dsa_configs_that_cannot_run_are_refused_in_one_line(dsa, parallel, extra, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        _config(dsa, parallel, **extra)
    assert "\n" not in str(e.value)


def test_a_valid_dsa_config_loads():
    cfg = _config(dict(indexer_types=["full", "shared"]), dict(cp=2, cp_comm="allgather"))
    assert cfg.model.dsa.indexer_types == ["full", "shared"]
    # the pipeline carries the selection and the indexer's loss (models/dsa_pipe.py)
    cfg = _config(dict(indexer_types=["full", "shared"], stage="sparse"), dict(pp=2))
    assert cfg.parallel.pp == 2


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
    for dsa in (dict(loss_weight=0.5, indexer_types=["full", "shared"]),):
        frozen, loss0, grads0 = _loss_and_grads("frozen", tokens, labels, **dsa)
        sparse, loss1, grads1 = _loss_and_grads("sparse", tokens, labels, **dsa)
        kl = [b.attn.indexer_loss for b in sparse.layers if b.attn.indexer is not None]
        assert len(kl) == (1 if "indexer_types" in dsa else 2)
        assert all(k > 0 for k in kl)
        torch.testing.assert_close(loss1, loss0 + 0.5 * sum(kl), rtol=1e-6, atol=0)
        assert sparse.indexer_sums[0] == pytest.approx(sum(kl).item(), rel=1e-6)
        assert frozen.indexer_sums is None and set(grads0) == set(grads1)
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
    # the recall metric (indexer_recall over 2 layers x 64 queries): a share of 6 of the
    # dense attention's top keys per query; with top-k beyond the 32 tokens every visible
    # key is selected, so the share is 1 exactly
    kl, recall, queries = model.indexer_sums.tolist()
    assert queries == 2 * 2 * 32 and 0 < recall < queries and kl > 0
    everything, _, _ = _loss_and_grads("dense_warmup", tokens, labels, index_topk=64)
    assert everything.indexer_sums[1] == everything.indexer_sums[2] == queries
    # dense: the same logits as the model without model.dsa (MLA on every earlier token)
    dense = GPT(dataclasses.replace(model.cfg, dsa=None), options=ModelOptions(seed=3))
    sparse = GPT(dataclasses.replace(model.cfg, dsa=DSAConfig(**DSA)),
                 options=ModelOptions(seed=3))
    with torch.no_grad():
        want = dense(tokens, torch.arange(32))
        torch.testing.assert_close(model(tokens, torch.arange(32)), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(sparse(tokens, torch.arange(32)), want, atol=1e-3)


# The CP layouts against one process (the same GPT at cp 1): logits, the token-mean loss
# with the indexer's KL, every gradient and the parameters after one SGD step. fp32; the
# parallel model sums the same terms in another order (LSE merges, TP all-reduces of the
# partial index scores and head outputs, gradients summed over CP): 1e-5 relative as
# tests/test_gpt.py's layouts. The top-k is exact (ties to the lower position on both
# sides), so a changed selection would move the logits by far more.
TOL = dict(rtol=1e-5, atol=1e-6)
BATCH, SEQ, LR = 2, 32, 0.1
DOCS = torch.tensor([0, 11, 32], dtype=torch.int32)  # two packed documents
PARITY_CASES = [  # (tp, cp, dp, layout, cp_comm, stage, indexer_types, recompute, documents)
    (2, 2, 1, "zigzag", "ring", "sparse", None, "selective", True),
    (1, 2, 2, "contiguous", "allgather", "sparse", ["full", "shared"], "full", False),
    (1, 4, 1, "striped", "ring", "dense_warmup", None, "none", False),
]


def _parity_cfg(stage, types):
    return dataclasses.replace(_model_cfg(stage, loss_weight=0.5, indexer_types=types),
                               seq_len=SEQ)


def _batch():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (BATCH * 2, SEQ), generator=g)
    labels = torch.randint(0, 128, (BATCH * 2, SEQ), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return tokens, labels


def _one_process(stage, types, documents):
    tokens, labels = _batch()
    model = GPT(_parity_cfg(stage, types), options=ModelOptions(seed=3))
    docs = DOCS if documents else None
    pos = torch.arange(SEQ)
    with torch.no_grad():
        logits = model(tokens, pos, cu_seqlens=docs)
    loss = model(tokens, pos, labels, cu_seqlens=docs) / (labels != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
    return logits, loss.detach(), grads, {n: p.detach().clone()
                                          for n, p in model.named_parameters()}


def _parity(rank, world, cases):
    from ctxpar import init_parallel_state
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions
    from tests.helpers.grid_step import grid_step
    out = []
    tokens, labels = _batch()
    for tp, cp, dp, layout, comm, stage, types, ckpt, documents in cases:
        st = init_parallel_state(tp=tp, cp=cp, dp=dp)
        model = GPT(_parity_cfg(stage, types),
                    ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                    ModelOptions(layout=layout, cp_comm=comm, activation_checkpointing=ckpt,
                                 seed=3))
        rows = slice(st.dp_rank * 2 * BATCH // dp, (st.dp_rank + 1) * 2 * BATCH // dp)
        step = grid_step(model, st, tokens, labels, rows, layout, DOCS if documents else None)
        grads = gather_full_state_dict(model, st.tp_group, grads=True)
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
        out.append(dict(step, params=gather_full_state_dict(model, st.tp_group), grads=grads))
    return out


def test_dsa_layouts_equal_one_process():
    """ring and all-gather, every token layout, tp2 x cp2, cp4, packed documents, GLM-5's
    shared layer, the three stages' losses and the dense warm-up's frozen model."""
    from ctxpar.testing import run_distributed
    refs = [_one_process(stage, types, docs) for *_, stage, types, _, docs in PARITY_CASES]
    results = run_distributed(_parity, 4, PARITY_CASES, timeout=240)
    for rank, per_case in enumerate(results):
        for case, (logits, loss, grads, params), got in zip(PARITY_CASES, refs, per_case):
            where = f"rank {rank} {case}"
            torch.testing.assert_close(got["logits"], logits[got["rows"]], **TOL, msg=where)
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            for n in params:
                if n in grads:
                    torch.testing.assert_close(got["grads"][n], grads[n], **TOL,
                                               msg=f"{where} grad {n}")
                torch.testing.assert_close(got["params"][n], params[n], **TOL,
                                           msg=f"{where} param {n}")


def test_a_shared_layer_reads_the_previous_selection_but_holds_no_weights_of_it():
    model = GPT(_model_cfg("frozen", indexer_types=["full", "shared"]))
    assert model.layers[1].attn.previous is model.layers[0].attn
    assert model.layers[1].attn.indexer is None
    assert not [k for k in model.state_dict() if "previous" in k or "layers.1.attn.indexer" in k]


def test_a_run_may_train_an_imported_indexer_but_not_change_it():
    """model.dsa.stage and loss_weight are how a run trains, not the model: a folder's
    (imported 'frozen') matches a config training its indexer; its top-k does not."""
    from ctxpar.checkpoint import CheckpointError, hf
    folder = vars(_model_cfg("frozen"))
    hf.check_matches(_model_cfg("sparse", loss_weight=0.3), folder, "/f")
    with pytest.raises(CheckpointError, match=r"model.dsa.index_topk=7 but model.init_from=/f "
                                              r"has dsa.index_topk=6"):
        hf.check_matches(_model_cfg("sparse", index_topk=7), folder, "/f")
