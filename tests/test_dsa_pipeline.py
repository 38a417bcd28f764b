"""DeepSeek sparse attention through the pipeline (models/dsa_pipe.py) equals one process.

One spawned world, cp2 x pp2 (and tp2 x pp2), DeepSpeed's pipeline engine with two
micro-batches (its 1F1B schedule runs the second's forward before the first's backward),
against a single-process GPT on the same global batch: the step's loss, every parameter's
gradient and the metrics' indexer loss. The stage boundary falls after block 2 of five
whose model.dsa.indexer_types are GLM-5's kind, [full, shared, shared, shared, full]:
blocks 1 and 2 take block 0's selection inside stage 0, block 3 across the boundary,
block 4 has its own indexer. Cases: GLM-5-shaped (MoE with the z-loss, interleaved indexer
RoPE) under stage 'sparse' (the indexer's KL travels to the last stage's loss, its
gradient back to stage 0's indexer) with full recompute (a recomputed shared block must
attend over its own micro-batch's selection), ring zigzag and packed documents; stage
'frozen' (the selection alone travels) with selective recompute, all-gather contiguous;
the dense warm-up (GLM-5-shaped, only the indexers train: the stages' frozen hidden states
linked by a zero gradient, the KL and the recall travel); and a dense model (no MoE) under
'sparse' at tp2 x pp2: the indexer sums take a gradient, so DeepSpeed's TP split of the
stage output is off for them too (ctxpar/config/kv_layers.py carries_between_stages; with
it on, DeepSpeed's pipeline engine asserts). Before the step, pipeline_logits
(evaluation's path) gives one process's logits.
"""
import dataclasses
import pickle

import pytest
import torch

from ctxpar.config import ModelConfig
from ctxpar.config.dsa import DSAConfig
from ctxpar.config.mla import MLAConfig
from ctxpar.config.moe import MoEConfig
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import RecordingSGD, random_batch
from models.dsa_pipe import DSATail
from models.gpt import GPT
from models.options import ModelOptions

SEQ, BATCH, SEED, LR = 32, 2, 5, 0.1
DOCS = torch.tensor([0, 13, 32], dtype=torch.int32)  # two packed documents
TYPES = ["full", "shared", "shared", "shared", "full"]


def _model(stage: str, moe: bool) -> ModelConfig:
    mla = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=12)
    dsa = DSAConfig(index_n_heads=4, index_head_dim=16, index_topk=6, indexer_types=TYPES,
                    rope_interleave=moe, stage=stage, loss_weight=0.5)
    experts = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, z_loss_coef=1e-2) \
        if moe else None
    return ModelConfig(vocab_size=96, seq_len=SEQ, n_layers=5, d_model=32, n_heads=4,
                       tie_embeddings=False, mla=mla, dsa=dsa, moe=experts)


CASES = [  # (stage, MoE, layout, cp_comm, activation checkpointing, documents, tp, cp)
    ("sparse", True, "zigzag", "ring", "full", True, 1, 2),
    ("frozen", False, "contiguous", "allgather", "selective", False, 1, 2),
    ("dense_warmup", True, "zigzag", "ring", "none", False, 1, 2),
    ("sparse", False, "contiguous", "ring", "selective", False, 2, 1),  # whole tuples
]


def _batch():
    return random_batch(96, BATCH, SEQ, seed=17)


def _one_process(stage, moe, documents):
    """The first sample's logits, the logged loss (the global token mean with the indexer's
    term: what models/step_kinds.py logs), the indexer loss as the metrics give it, and
    every gradient (of that loss plus the routers')."""
    tokens, labels = _batch()
    model = GPT(_model(stage, moe), options=ModelOptions(seed=SEED))
    docs = DOCS if documents else None
    with torch.no_grad():
        logits = model(tokens[:1], torch.arange(SEQ), cu_seqlens=docs)
    n = (labels != -100).sum()
    loss = model(tokens, torch.arange(SEQ), labels, cu_seqlens=docs) / n
    (loss + (model.router_losses.share if moe else 0.0)).backward()
    sums = model.indexer_sums  # (KL, recall sum, queries)
    index = None if sums is None else dict(indexer_loss=(sums[0] / n).item())
    if sums is not None and sums[2] > 0:  # the dense warm-up's recall
        index["indexer_recall"] = (sums[1] / sums[2]).item()
    return logits, loss.detach(), index, {name: p.grad for name, p in
                                          model.named_parameters() if p.grad is not None}


def _pipeline(rank, world, payload):
    import deepspeed
    from types import SimpleNamespace
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.config import deepspeed_config
    from ctxpar import gather_sequence
    from ctxpar.tensor_parallel import (gather_from_tensor_model_parallel_region,
                                        gather_full_state_dict)
    from models.gpt_pipe import GPTPipe, pipeline_logits, train_step
    from models.loss import global_token_count
    from models.step_kinds import pipeline_indexer_metrics
    from tests.helpers.pipeline_config import pipeline_config

    out = []
    tokens, labels = _batch()
    for stage, moe, layout, comm, ckpt, documents, tp, cp in pickle.loads(payload):
        model_cfg = dataclasses.asdict(_model(stage, moe))
        cfg = pipeline_config(model_cfg, dict(tp=tp, cp=cp, layout=layout, cp_comm=comm),
                              ckpt, BATCH, SEED, world)
        st = init_parallel_state(tp=tp, cp=cp, pp=2, order=cfg.parallel.order)
        ds_config = deepspeed_config(cfg, st.dp_size)
        model = GPTPipe.from_config(cfg, st, ds_config["gradient_accumulation_steps"])
        assert model.parts == [0, 4, 8], model.parts  # blocks 0-2 | blocks 3, 4
        opt = RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        pos = sequence_positions(SEQ, st.cp_group, layout)
        micro = [{"tokens": shard_sequence(tokens[m:m + 1], 1, st.cp_group, layout),
                  "labels": shard_sequence(labels[m:m + 1], 1, st.cp_group, layout),
                  "positions": pos, **({"cu_seqlens": [DOCS]} if documents else {})}
                 for m in range(BATCH)]
        n_tokens = sum(global_token_count(mb["labels"], st.dp_cp_group) for mb in micro)
        logits = pipeline_logits(model, st, micro[0])  # evaluation's path, before the step
        if logits is not None:  # (1, T, V) whole: the CP shards joined, the TP vocabulary
            logits = gather_from_tensor_model_parallel_region(
                gather_sequence(logits, 1, st.cp_group, layout), st.tp_group)
        loss = train_step(engine, micro, n_tokens, st)
        metrics = pipeline_indexer_metrics(engine, n_tokens, loss, st)
        for p, g in opt.grads.items():  # the gradients the step applied, by GPT's names
            p.grad = g
        named = SimpleNamespace(named_parameters=model.gpt_named_parameters)
        out.append(dict(loss=loss, metrics=metrics, logits=logits,
                        grads=gather_full_state_dict(named, st.tp_group, True)))
    return out


# fp32; the pipeline sums the same terms in another order (the ring's LSE merges, the two
# micro-batches, the gradients summed over CP): 1e-5 relative as tests/test_pipeline.py.
# The top-k is exact (ties to the lower position), so a wrong selection moves the loss
# far more. The indexer's KL of these near-uniform distributions is ~5e-5 a token, a sum
# of terms ~1e-1 that cancel: its value is held to 1e-3 relative (measured 2e-4), its
# gradient to TOL; the recall (a share of counts) likewise.
TOL = dict(rtol=1e-5, atol=1e-6)


def test_glm5_shared_topk_and_indexer_loss_through_the_pipeline_equal_one_process():
    refs = [_one_process(stage, moe, docs) for stage, moe, *_, docs, _, _ in CASES]
    results = run_distributed(_pipeline, 4, pickle.dumps(CASES), timeout=300)
    for i, (case, (logits, loss, index, grads)) in enumerate(zip(CASES, refs)):
        seen = set()
        for rank, per_case in enumerate(results):
            got, where = per_case[i], f"rank {rank} {case}"
            if rank >= 2:  # the last stage: pipeline_logits' (the selection sent by hand)
                torch.testing.assert_close(got["logits"], logits, **TOL, msg=where)
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            if index is None:
                assert "indexer_loss" not in got["metrics"], where
            else:
                for key, want in index.items():
                    assert got["metrics"][key] == pytest.approx(want, rel=1e-3), (where, key)
            for name, grad in got["grads"].items():
                if name not in grads:  # no gradient at pp 1 ('frozen' indexers): DeepSpeed's 0
                    assert not grad.any(), f"{where} {name}"
                    continue
                torch.testing.assert_close(grad, grads[name], **TOL, msg=f"{where} {name}")
                seen.add(name)
        assert seen == set(grads), set(grads) ^ seen  # the stages hold every gradient


@pytest.mark.quick
def test_the_pipe_tuple_carries_a_selection_into_shared_layers_only():
    """The DSA tail into each block (5: the final norm) of the parity test's model: the
    selection into shared blocks, the indexer's sums everywhere under 'sparse'; the dense
    warm-up selects nothing. Where the sums travel (they take a gradient) DeepSpeed's TP
    split of the stage output is off, also without MoE; the selection alone keeps it."""
    from ctxpar.config.kv_layers import carries_between_stages
    sizes = {stage: [DSATail(_model(stage, False)).size(i) for i in range(6)]
             for stage in ("frozen", "sparse", "dense_warmup")}
    assert sizes == {"frozen": [0, 1, 1, 1, 0, 0], "sparse": [1, 2, 2, 2, 1, 1],
                     "dense_warmup": [1, 1, 1, 1, 1, 1]}
    assert {stage: carries_between_stages(_model(stage, False)) for stage in sizes} == \
        {"frozen": False, "sparse": True, "dense_warmup": True}
