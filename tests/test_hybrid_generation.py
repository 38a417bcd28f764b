"""Generation through a hybrid GPT's Gated DeltaNet, KDA and Mamba2 layers (ctxpar/inference/
linear_cache.py): a CP prefill with the training ops, then recurrent decode steps.

(1) The recurrent steps against the chunked kernels: the conv, the gated delta rule and
SSD stepped token by token give the chunked forms' outputs and final states. (2) One
process: prompts of different lengths (right padding that must neither write nor decay
a state) decode what full forwards without a cache choose. (3) cp 2 and 3, state passing
and heads, contiguous, zigzag and striped: the same tokens and logits as one process.
(4) generate.py on a hybrid train.py run at 1, 2 and 3 ranks: the same continuation.
"""
import os
import pickle

import pytest
import torch

from ctxpar.context_parallel.linear import (causal_conv1d, chunk_gated_delta_rule,
                                            conv_step, gated_delta_step, ssd_chunk_scan,
                                            ssd_step)
from ctxpar.inference import generate
from ctxpar.testing import run_distributed
from ctxpar.testing.generation import reference_generate
from ctxpar.testing.linear import HYBRID_CONFIGS, KIMI_LINEAR_CONFIG
from helpers.train_run import HYBRID_MODEL, ROOT, run_train
from helpers.warm_launch import run_warm
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions

CONFIGS = {**HYBRID_CONFIGS, "kimi-linear": KIMI_LINEAR_CONFIG}  # Qwen3.5's, Nemotron-H's,
#                                                                    Kimi Linear's patterns
SEED = 3
# 5 and 10 tokens: padded to 12 at cp 2 zigzag and cp 3, so every rank holds pad tokens of
# the short row, and the long row's last prompt token sits on a middle rank at cp 3
PROMPTS = [[1, 5, 9, 3, 7], [2, 4, 6, 8, 10, 12, 14, 16, 3, 33]]
NEW = 6
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; CP reorders the state passing's sums


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------ steps vs chunked kernels

@pytest.mark.quick
def test_recurrent_steps_equal_the_chunked_kernels():
    B, T, Hk, Hv, Dk, Dv = 2, 11, 2, 4, 8, 6
    q, k = rand(B, T, Hk, Dk, seed=1), rand(B, T, Hk, Dk, seed=2)
    v, beta = rand(B, T, Hv, Dv, seed=3), rand(B, T, Hv, seed=4).sigmoid()
    g, s0 = -rand(B, T, Hv, seed=5).abs(), rand(B, Hv, Dk, Dv, seed=6)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=4,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    S, outs = s0, []
    for t in range(T):
        o_t, S = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S,
                                  use_qk_l2norm_in_kernel=True)
        outs.append(o_t)
    torch.testing.assert_close(torch.stack(outs, 1), o, **TOL)
    torch.testing.assert_close(S, final, **TOL)

    H, P, G, N = 4, 6, 2, 8
    x, dt = rand(B, T, H, P, seed=7), rand(B, T, H, seed=8).exp() * 0.1
    A, D = -rand(H, seed=9).abs(), rand(H, seed=10)
    Bm, Cm, h0 = rand(B, T, G, N, seed=11), rand(B, T, G, N, seed=12), rand(B, H, P, N, seed=13)
    y, final = ssd_chunk_scan(x, dt, A, Bm, Cm, 4, D=D, initial_states=h0,
                              return_final_states=True)
    h, ys = h0, []
    for t in range(T):
        y_t, h = ssd_step(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], h, D)
        ys.append(y_t)
    torch.testing.assert_close(torch.stack(ys, 1), y, **TOL)
    torch.testing.assert_close(h, final, **TOL)

    C, K = 5, 4
    xc, w, b = rand(B, T, C, seed=14), rand(C, K, seed=15), rand(C, seed=16)
    want = causal_conv1d(xc, w, b, activation="silu")
    window, got = torch.zeros(B, K - 1, C), []
    for t in range(T):
        out, window = conv_step(window, xc[:, t], w, b, "silu")
        got.append(out)
    torch.testing.assert_close(torch.stack(got, 1), want, **TOL)


# ------------------------------------------------------------ one process

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_generation_equals_full_forwards(name):
    model = GPT(CONFIGS[name], options=ModelOptions(seed=SEED)).eval()
    want, _ = reference_generate(model, PROMPTS, NEW)
    out = generate(model, PROMPTS, NEW)
    assert out.tokens == want
    linear = [c for c in out.cache.linear.values()]
    assert len(linear) == (2 if name == "nemotron-h" else 3) and len(out.cache.k) == 1
    assert out.cache.nbytes() == sum(x.nbytes for x in (*out.cache.k, *out.cache.v)) + sum(
        c.nbytes() for c in linear)


# ------------------------------------------------------------ over CP

def _generate_cases(rank, world, payload):
    from ctxpar import init_parallel_state

    out = []
    for name, tp, layout, strategy in pickle.loads(payload):
        st = init_parallel_state(tp=tp, cp=world // tp, dp=1)
        model = GPT(CONFIGS[name], ModelGroups.from_state(st),
                    ModelOptions(layout=layout, seed=SEED, linear_cp=strategy)).eval()
        res = generate(model, PROMPTS, NEW, layout=layout, cp_group=st.cp_group,
                       tp_group=st.tp_group, keep_logits=True)
        out.append((res.tokens, torch.stack(res.logits)))
    return out


CASES = {  # world -> (config, tp, layout, parallel.linear_cp); cp = world / tp
    2: [("qwen3.5", 1, "zigzag", "state"), ("nemotron-h", 1, "contiguous", "state"),
        ("qwen3.5", 1, "striped", "heads"), ("nemotron-h", 1, "zigzag", "heads"),
        ("qwen3.5", 2, "zigzag", "state"), ("nemotron-h", 2, "zigzag", "state"),
        ("kimi-linear", 1, "zigzag", "state"), ("kimi-linear", 1, "striped", "heads")],
    3: [("qwen3.5", 1, "contiguous", "state"), ("nemotron-h", 1, "zigzag", "state"),
        ("kimi-linear", 1, "zigzag", "state")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_cp_generation_equals_one_process(world):
    cases = CASES[world]
    results = run_distributed(_generate_cases, world, pickle.dumps(cases), timeout=240)
    for i, (name, tp, layout, strategy) in enumerate(cases):
        model = GPT(CONFIGS[name], options=ModelOptions(seed=SEED)).eval()
        one = generate(model, PROMPTS, NEW, keep_logits=True)
        for rank, per_case in enumerate(results):
            tokens, logits = per_case[i]
            where = f"{name} tp{tp} cp{world // tp} {layout} {strategy} rank {rank}"
            assert tokens == one.tokens, where
            torch.testing.assert_close(logits, torch.stack(one.logits), **TOL, msg=where)


# ------------------------------------------------------------ generate.py on a trained run

HYBRID_RUN = [*HYBRID_MODEL, "parallel.cp=1", "parallel.dp=1", "train.steps=8",
              "train.eval_samples=8", "logging.wandb.mode=disabled"]


def test_generate_py_prints_the_same_continuation_at_cp_1_2_and_3(tmp_path):
    """A hybrid of Qwen3.5's and Nemotron-H's mixers trained by train.py, then generate.py
    with two prompts of different lengths on 1, 2 and 3 ranks (the run's zigzag layout,
    state passing): the same tokens."""
    run = str(tmp_path / "run")
    run_train(run, 1, HYBRID_RUN)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT}
    args = ["--run-dir", run, "--prompt", "The passkey is 4", "--prompt", "Remember: the "
            "sun is warm and the passkey", "--max-new-tokens", "12", "--output-format",
            "jsonl"]
    outs = {}
    for nproc in (1, 2, 3):
        proc = run_warm("generate.py", args, nproc, env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[nproc] = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert len(outs[nproc]) == 2, proc.stdout
        if nproc > 1:
            assert f"cp={nproc} (zigzag)" in proc.stderr, proc.stderr[-2000:]
    assert outs[1] == outs[2] == outs[3]
