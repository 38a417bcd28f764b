"""Pin DeepSpeed's gradient reduction under ctxpar's mpu, for every ZeRO stage.

docs/parallelism.md and models/loss.py build the loss normalisation on these rules; if a
DeepSpeed upgrade changes one, a test here says so:
  - ZeRO 0, 1, 2: gradients summed over CP and averaged over DP (divided by dp);
  - ZeRO 3 (parameters partitioned over dp x cp by ctxpar.distributed.zero.partition_for_zero3):
    averaged over dp x cp (divided by dp*cp);
  - ZeRO 3 left to DeepSpeed alone partitions over DP only and never adds the CP ranks'
    gradients (the root cause of issue "ZeRO-3 with CP trains on wrong gradients").
Then the whole GPT under ZeRO 1, 2 and 3 with CP and TP (ZeRO-3 parameters really
partitioned): every gradient and the gradient norm equal the single-process model's.
"""
import pickle

import pytest
import torch

from ctxpar.config import ModelConfig
from ctxpar.testing import run_distributed
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions


def _ds_config(stage, micro=1, batch=2, **zero):
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, **zero},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.0}


def _linear_steps(rank, world, cases):
    """One SGD step of a 3-weight linear layer per (stage, ctxpar_partitioning) case."""
    import deepspeed
    from ctxpar import DeepSpeedMPU, init_parallel_state
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.distributed.zero import grad_divisor, partition_for_zero3

    state = init_parallel_state(tp=1, cp=2, pp=1)  # world 4: cp2 x dp2
    init_deepspeed_comm()
    out = []
    for stage, ctxpar_partitioning, *bf16 in cases:
        model = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
        ds_config = _ds_config(stage)
        if bf16:
            ds_config["bf16"] = {"enabled": True}
        if ctxpar_partitioning:
            partition_for_zero3(model, state, ds_config)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                          mpu=DeepSpeedMPU(state))
        # Each rank's loss has gradient x_r = (rank+1) * [1, 10, 100] w.r.t. the weight.
        x = torch.tensor([[1.0, 10.0, 100.0]], dtype=engine.module.weight.dtype) * (rank + 1)
        engine.backward(engine(x).sum())
        engine.step()
        if stage == 3:
            from deepspeed.utils import safe_get_full_fp32_param
            w = safe_get_full_fp32_param(engine.module.weight)  # gathered over its partition
            partition_ranks = torch.distributed.get_process_group_ranks(
                engine.module.weight.ds_process_group)
            if bf16:  # the partition DeepSpeed computes with is bf16, as at stages 0-2
                partition_ranks = (partition_ranks, engine.module.weight.ds_tensor.dtype)
        else:
            w, partition_ranks = engine.module.weight.detach(), None
        out.append((grad_divisor(state, ds_config), w.clone(), partition_ranks))
        engine.destroy()
    return state.ranks("cp"), state.ranks("dp"), out


STAGES = [0, 1, 2, 3]
G = [torch.tensor([1.0, 10.0, 100.0]) * (r + 1) for r in range(4)]  # each rank's gradient
W0 = torch.tensor([[1.0, 2.0, 3.0]])


@pytest.fixture(scope="module")
def linear_steps():
    """Every stage with ctxpar's setup, then ZeRO-3 left to DeepSpeed: one spawn."""
    cases = [(stage, True) for stage in STAGES] + [(3, False), (3, True, "bf16")]
    return run_distributed(_linear_steps, 4, cases, timeout=300)


@pytest.mark.quick
@pytest.mark.parametrize("i,stage", list(enumerate(STAGES)))
def test_deepspeed_reduction_matches_grad_divisor(linear_steps, i, stage):
    # Order tp-cp-dp-pp with tp1 cp2 dp2: cp groups [0,1],[2,3]; dp groups [0,2],[1,3].
    assert linear_steps[0][0] == [0, 1] and linear_steps[0][1] == [0, 2]
    divisor = linear_steps[0][2][i][0]
    assert divisor == (4 if stage == 3 else 2)  # dp*cp for ZeRO-3, dp otherwise
    for _, _, out in linear_steps:
        _, w, partition_ranks = out[i]
        # SGD lr=1: w = w0 - sum_r g_r / divisor. Exact in fp32: small integers / 2 or 4.
        torch.testing.assert_close(w, W0 - sum(G) / divisor, rtol=0, atol=0)
        if stage == 3:
            assert partition_ranks == [0, 1, 2, 3]  # dp x cp


def test_zero3_bf16_partitions_train_in_bf16(linear_steps):
    # zero.Init(module=) does not cast and the engine skips casting ZeRO-3 parameters:
    # partition_for_zero3 casts first, or bf16 ZeRO-3 would train fp32 weights.
    for _, _, out in linear_steps:
        _, w, (partition_ranks, dtype) = out[-1]
        assert partition_ranks == [0, 1, 2, 3] and dtype == torch.bfloat16
        # Every term is a small integer times a power of two: exact in bf16 too.
        torch.testing.assert_close(w, W0 - sum(G) / 4, rtol=0, atol=0)


def test_zero3_left_to_deepspeed_never_reduces_over_cp(linear_steps):
    # The root cause, reproduced: DeepSpeed 0.19.8 converts the parameters itself over
    # mpu.get_data_parallel_group() (DP only), and reduce-scatters over that group.
    last = [out[-2] for _, _, out in linear_steps]
    assert [partition_ranks for _, _, partition_ranks in last] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # Each CP rank applies the mean over DP of its own tokens' gradients only: the two CP
    # ranks of a DP replica hold different models after one step.
    for rank, (_, w, _) in enumerate(last):
        torch.testing.assert_close(w, W0 - (G[rank] + G[rank ^ 2]) / 2, rtol=0, atol=0)
    assert not torch.equal(last[0][1], last[1][1])


# ---------------------------------------------------------------- the GPT under ZeRO 1-3

CFG = dict(vocab_size=64, seq_len=32, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2)
BATCH, SEED = 4, 7
# fp32; the parallel model sums the same terms in another order (ring merge, TP partial
# sums, ZeRO's reduce-scatter over dp x cp), ~1e-7 relative: rtol 1e-5 / atol 1e-6 as in
# tests/test_gpt.py. Before the fix gradients were off by factors of 0.2 to 1.8.
TOL = dict(rtol=1e-5, atol=1e-6)


def _reference(cfg, tokens, labels):
    model = GPT(cfg, options=ModelOptions(seed=SEED))
    loss = model(tokens, torch.arange(cfg.seq_len), labels) / (labels != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    return grads, norm


def _gpt_zero3(rank, world, payload):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from ctxpar import DeepSpeedMPU, init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.tensor_parallel.utils import gather_full_tensor
    from ctxpar.distributed.zero import grad_divisor, partition_for_zero3
    from models.loss import global_token_count, loss_for_backward

    init_deepspeed_comm()
    out = []
    for (stage, tp, cp, tie, ckpt, comm), tokens, labels in pickle.loads(payload):
        cfg = ModelConfig(**CFG, tie_embeddings=tie)
        u = ULYSSES[comm](cp)
        st = init_parallel_state(tp=tp, cp=cp, ulysses=u)
        model = GPT(cfg,
                    ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group,
                                ulysses_group=st.ulysses_group, ring_group=st.ring_group),
                    ModelOptions(layout="zigzag", cp_comm=comm, activation_checkpointing=ckpt,
                                 seed=SEED))
        # persistence threshold 0: every parameter is really partitioned and gathered by
        # ZeRO-3's hooks (the default keeps parameters < 1e5 elements whole).
        ds = _ds_config(stage, micro=BATCH // st.dp_size, batch=BATCH,
                        **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
        partition_for_zero3(model, st, ds)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds, mpu=DeepSpeedMPU(st))
        rows = slice(st.dp_rank * BATCH // st.dp_size, (st.dp_rank + 1) * BATCH // st.dp_size)
        tok = shard_sequence(tokens[rows], 1, st.cp_group, "zigzag", u)
        lab = shard_sequence(labels[rows], 1, st.cp_group, "zigzag", u)
        pos = sequence_positions(cfg.seq_len, st.cp_group, "zigzag", ulysses=u)
        n = global_token_count(lab, st.dp_cp_group)
        engine.backward(loss_for_backward(engine(tok, pos, lab), n, grad_divisor(st, ds)))
        # This TP rank's gradient gathered over dp x cp by ZeRO, then over TP to full size.
        full = {name: gather_full_tensor(safe_get_full_grad(p), p, st.tp_group)
                for name, p in engine.module.named_parameters()}
        engine.step()
        out.append((full, float(engine.get_global_grad_norm())))
        engine.destroy()
    return out


# The Ulysses degree of each CP pattern at cp ranks (hybrid: 2 x a ring of cp/2).
ULYSSES = {"ring": lambda cp: 1, "allgather": lambda cp: 1, "ulysses": lambda cp: cp,
           "hybrid": lambda cp: 2}


def test_gpt_zero_stages_with_cp_and_tp_match_single_process():
    # (ZeRO stage, tp, cp, tied head, activation checkpointing, cp_comm); dp = 4 / (tp*cp).
    # ZeRO-3 under every CP pattern: each one's gradients must be summed over dp x cp.
    cases = [(3, 1, 2, True, "none", "ring"), (3, 2, 2, False, "selective", "ring"),
             (3, 1, 4, True, "full", "ring"), (3, 1, 2, True, "none", "allgather"),
             (3, 1, 4, False, "selective", "ulysses"), (3, 1, 4, True, "none", "hybrid"),
             (2, 2, 2, True, "none", "ring"), (1, 1, 2, False, "none", "ring")]
    g = torch.Generator().manual_seed(0)
    payload = []
    for case in cases:
        tokens = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["seq_len"]), generator=g)
        labels = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["seq_len"]), generator=g)
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
        payload.append((case, tokens, labels))
    res = run_distributed(_gpt_zero3, 4, pickle.dumps(payload), timeout=300)
    for i, ((stage, tp, cp, tie, ckpt, comm), tokens, labels) in enumerate(payload):
        want, want_norm = _reference(ModelConfig(**CFG, tie_embeddings=tie), tokens, labels)
        for rank in range(4):
            got, norm = res[rank][i]
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], **TOL,
                                           msg=lambda m: f"zero{stage} tp{tp} cp{cp} {comm} {name}: {m}")
            assert abs(norm - want_norm.item()) <= 1e-5 * want_norm.item(), (stage, tp, cp, comm, norm)
