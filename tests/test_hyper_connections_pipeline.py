"""DeepSeek-V4's residual streams (model.hyper_connections) and hash-routed MoE layers
(model.moe.hash_layers) through the pipeline (models/gpt_pipe.py, models/pipe_carry.py)
equal one process.

One spawned world, cp2 x pp2 (and tp2 x pp2), DeepSpeed's pipeline engine with two
micro-batches (its 1F1B schedule runs the second's forward before the first's backward, so
a recomputed block must replay with its own micro-batch's token ids), against a
single-process GPT on the same global batch: the step's loss, every parameter's gradient
(the mHC maps', hc_head's on the last stage, the experts' gathered over EP), the hash
tables, and pipeline_logits (the evaluation's path: x sent as (B, T/cp, N, d), the ids
taken from each stage's own tokens). The model: four MoE layers, 0 and 3 hash-routed; the
stage boundary falls after block 2, so the ids cross it to layer 3 and the streams cross it
(B, T/cp, 3, d). Cases: cp2 ring zigzag with full recompute; cp2 all-gather contiguous,
selective, ep2 (over the CP group); tp2 x pp2 selective (DeepSpeed's TP split of the stage
output off: the routers' statistics take a gradient, ctxpar/config/kv_layers.py
carries_between_stages); and tp2 x pp2 full recompute of the model without MoE ("dense":
the streams alone beside the positions, which DeepSpeed splits over TP between the stages).
And the same model with DeepSeek-V4's attention (V4_CFG: sliding, CSA, HCA, CSA layers) at
cp2 ring zigzag with full recompute, and contiguous with selective recompute and two packed
documents: its compressors and indexer inside the blocks of both stages (the indexer takes
no gradient in either).
Each case also counts the backward passes through the first stage: one a micro-batch
(models/pipe_backward.py), not one per tensor the stage hands on.
Then, quick: what the tuple carries after each block.
"""
import dataclasses
import pickle

import pytest
import torch

from ctxpar.config import ModelConfig
from ctxpar.config.compressed_attention import CompressedAttentionConfig
from ctxpar.config.hyper_connections import HyperConnectionsConfig
from ctxpar.config.moe import MoEConfig
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import RecordingSGD, random_batch
from models.gpt import GPT
from models.options import ModelOptions

SEQ, BATCH, SEED, LR = 16, 2, 5, 0.1
CFG = ModelConfig(
    vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4, seq_len=SEQ,
    ffn_hidden=48, norm_eps=1e-6, tie_embeddings=False,
    hyper_connections=HyperConnectionsConfig(streams=3, sinkhorn_iters=5, eps=1e-6),
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, score="sqrtsoftplus",
                  score_correction_bias=True, routed_scaling_factor=1.5,
                  shared_expert_hidden=16, aux_loss_coef=0.0, z_loss_coef=1e-2, seq_aux_loss_coef=0.1,
                  hash_layers=[0, 3]))
# DeepSeek-V4's attention in the same model (model.compressed_attention): a sliding, a CSA
# (entries of 2, their indexer keeping 2), an HCA (entries of 4) and a CSA layer; the slabs
# of cp2 zigzag (4 tokens) hold a CSA window and its predecessor, an HCA window
V4_TYPES = ["sliding_attention", "compressed_sparse_attention",
            "heavily_compressed_attention", "compressed_sparse_attention"]
V4_CFG = dataclasses.replace(
    CFG, n_kv_heads=1, sliding_window=5, partial_rotary_factor=0.5, layer_types=V4_TYPES,
    layer_rope={k: {"rope_theta": 160000.0} for k in V4_TYPES[1:3]},
    compressed_attention=CompressedAttentionConfig(
        q_lora_rank=8, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
        index_topk=2, compress_rates={"compressed_sparse_attention": 2,
                                      "heavily_compressed_attention": 4}))
MODELS = {"gqa": CFG, "v4": V4_CFG, "v4-docs": V4_CFG,
          "dense": dataclasses.replace(CFG, moe=None)}  # mHC, no experts nor hash layers
# v4-docs: two packed documents (data.document_mask), the second across the slabs (4, 8, 12)
DOCUMENTS = {"v4-docs": torch.tensor([0, 7, SEQ], dtype=torch.int32)}
CASES = [  # (tp, cp, layout, cp_comm, activation checkpointing, ep, model)
    (1, 2, "zigzag", "ring", "full", 1, "gqa"),
    (1, 2, "contiguous", "allgather", "selective", 2, "gqa"),
    (2, 1, "zigzag", "ring", "selective", 1, "gqa"),  # the stages' whole tuples on every TP rank
    (1, 2, "zigzag", "ring", "full", 1, "v4"),  # V4's compressors and indexer across stages
    (1, 2, "contiguous", "ring", "selective", 1, "v4-docs"),
    (2, 1, "contiguous", "ring", "full", 1, "dense"),  # x split over TP by DeepSpeed
]
# fp32; the pipeline sums the same terms in another order (the ring's LSE merges, the two
# micro-batches, the gradients summed over CP, the experts' rows in EP's order):
# 1e-5 relative, 1e-6 absolute, as tests/test_pipeline.py.
TOL = dict(rtol=1e-5, atol=1e-6)


def _batch():
    return random_batch(64, BATCH, SEQ, seed=17)


def _one_process(kind):
    """The first sample's logits, the step's token-mean loss, every gradient (of that loss
    plus the routers'), the hash tables."""
    tokens, labels = _batch()
    model = GPT(MODELS[kind], options=ModelOptions(seed=SEED))
    docs = DOCUMENTS.get(kind)
    with torch.no_grad():
        logits = model(tokens[:1], torch.arange(SEQ), cu_seqlens=docs)
    loss = model(tokens, torch.arange(SEQ), labels, cu_seqlens=docs) / (labels != -100).sum()
    (loss + (0.0 if model.router_losses is None else model.router_losses.share)).backward()
    tables = {n: b for n, b in model.named_buffers() if n.endswith("tid2eid")}
    return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}, tables


def _pipeline(rank, world, payload):
    import deepspeed
    import torch.distributed as dist
    from types import SimpleNamespace
    from ctxpar import gather_sequence, init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.config import deepspeed_config
    from ctxpar.distributed.expert_parallel import prepare_expert_parallel
    from ctxpar.tensor_parallel import gather_full_state_dict
    from models.gpt_pipe import GPTPipe, pipeline_logits, train_step
    from models.loss import global_token_count
    from models.training import param_groups
    from tests.helpers.pipeline_config import pipeline_config

    out = []
    tokens, labels = _batch()
    for tp, cp, layout, comm, ckpt, ep, kind in pickle.loads(payload):
        cfg = pipeline_config(dataclasses.asdict(MODELS[kind]),
                              dict(tp=tp, cp=cp, ep=ep, layout=layout, cp_comm=comm), ckpt,
                              BATCH, SEED, world)
        st = init_parallel_state(tp=tp, cp=cp, pp=2, ep=ep, order=cfg.parallel.order)
        ds_config = deepspeed_config(cfg, st.dp_size)
        model = GPTPipe.from_config(cfg, st, ds_config["gradient_accumulation_steps"])
        assert model.parts == [0, 4, 7], model.parts  # embed, blocks 0-2 | block 3, head
        groups = [{"params": list(model.parameters())}]
        if ep > 1:  # the experts as DeepSpeed's MoE groups, reduced over their EDP group
            groups = param_groups(model, 0.0, True, prepare_expert_parallel(
                model, st, CFG.moe.num_experts))
        opt = RecordingSGD(groups, lr=LR)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        # DeepSpeed splits x over TP between the stages unless routers' statistics travel
        assert engine.is_pipe_partitioned == (tp > 1 and MODELS[kind].moe is None)
        pos = sequence_positions(SEQ, st.cp_group, layout)
        micro = [{"tokens": shard_sequence(tokens[m:m + 1], 1, st.cp_group, layout),
                  "labels": shard_sequence(labels[m:m + 1], 1, st.cp_group, layout),
                  "positions": pos, **({"cu_seqlens": [DOCUMENTS[kind]]}
                                       if kind in DOCUMENTS else {})} for m in range(BATCH)]
        n_tokens = sum(global_token_count(mb["labels"], st.dp_cp_group) for mb in micro)
        passes = []  # backward passes through the first stage (its first parameter's)
        hook = next(model.parameters()).register_hook(lambda g: passes.append(1)) \
            if st.pp_rank == 0 else None
        logits = pipeline_logits(model, st, micro[0])  # evaluation's path, before the step
        if logits is not None:  # (1, T, V) whole: the CP shards joined, the TP vocabulary
            logits = gather_sequence(logits, 1, st.cp_group, layout)
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits, group=st.tp_group)
            logits = torch.cat(parts, dim=-1)
        loss = train_step(engine, micro, n_tokens, st)
        if hook is not None:
            hook.remove()
        for p, g in opt.grads.items():  # the gradients the step applied, by GPT's names
            p.grad = g
        named = SimpleNamespace(named_parameters=model.gpt_named_parameters)
        out.append(dict(loss=loss, logits=logits, passes=len(passes),
                        grads=gather_full_state_dict(named, st.tp_group, True,
                                                     st.ep_group if ep > 1 else None),
                        tables={n: b for n, b in model.gpt_named_parameters(buffers=True)
                                if n.endswith("tid2eid")}))
    return out


def test_streams_and_hash_layers_through_the_pipeline_equal_one_process():
    references = {kind: _one_process(kind) for kind in MODELS}
    results = run_distributed(_pipeline, 4, pickle.dumps(CASES), timeout=300)
    for i, case in enumerate(CASES):
        logits, loss, grads, tables = references[case[-1]]
        assert any(".attn_hc." in n for n in grads) and "hc_head.fn" in grads
        seen, seen_tables = set(), set()
        for rank, per_case in enumerate(results):
            got, where = per_case[i], f"rank {rank} {case}"
            if rank >= 2:  # the last stage: pipeline_logits'
                torch.testing.assert_close(got["logits"], logits, **TOL, msg=where)
            else:  # one backward a micro-batch, whatever the stage carries (the routers'
                # statistics beside x: DeepSpeed's backward per output would run it twice)
                assert got["passes"] == BATCH, (where, got["passes"])
            torch.testing.assert_close(got["loss"], loss, **TOL, msg=where)
            for name, grad in got["grads"].items():
                if grads[name] is None:  # V4's indexer: no gradient reaches it (its top-k)
                    assert ".indexer." in name and not grad.any(), f"{where} {name}"
                else:
                    torch.testing.assert_close(grad, grads[name], **TOL,
                                               msg=f"{where} {name}")
                seen.add(name)
            for name, table in got["tables"].items():  # the same draw as one process
                assert torch.equal(table, tables[name]), f"{where} {name}"
                seen_tables.add(name)
        assert seen == set(grads), set(grads) ^ seen  # the stages hold every gradient
        assert seen_tables == set(tables), set(tables) ^ seen_tables


@pytest.mark.quick
def test_the_tuple_carries_the_ids_to_the_last_hash_layer_and_the_streams_throughout():
    """After block i (-1: the embedding) the ids travel while a hash-routed layer (0, 3)
    follows; x is (N, d) a token; hc_head sits in the final norm's layer (checkpoint
    names, and the partition's weight of that layer)."""
    from ctxpar.checkpoint.names import from_pipe, to_pipe
    from ctxpar.config.pipeline_stages import pipeline_parts
    from ctxpar.plan.kv_layers import carried_bytes
    from models.hyper_connections import residual_shape
    from models.pipe_carry import carried_after
    assert [carried_after(CFG, i).ids for i in range(-1, 4)] == [True] * 4 + [False]
    assert [carried_after(CFG, i).size for i in range(-1, 4)] == [1] * 4 + [0]
    assert [carried_bytes(CFG, 1, 10, 4, i) for i in (2, 3)] == [2 * 10 * 8, 0]
    assert residual_shape(CFG) == (3, 32)
    assert to_pipe("hc_head.fn", 4, False) == "5.hc_head.fn"
    assert from_pipe("5.hc_head.fn", 4) == "hc_head.fn"
    assert pipeline_parts(CFG, 2, 1, 1, "uniform") == [0, 4, 7]
