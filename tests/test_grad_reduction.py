"""Pin DeepSpeed's gradient reduction with our mpu: summed over CP, averaged over DP.

docs/parallelism.md builds the loss normalisation on this rule; if a DeepSpeed upgrade
changes it, this test is the one that says so.
"""
import pytest
import torch

from dist_harness import run_distributed


def _reduced_grad(rank, world, stage):
    import deepspeed
    from ctxpar import init_parallel_state

    state = init_parallel_state(tp=1, cp=2, pp=1)  # world 4: cp2 x dp2
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
    ds_config = {
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
        "gradient_clipping": 0.0,
    }
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config,
                                      mpu=state.mpu())
    # Each rank's loss has gradient x_r = (rank+1) * [1, 10, 100] w.r.t. the weight.
    x = torch.tensor([[1.0, 10.0, 100.0]]) * (rank + 1)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    return state.cp_rank, state.dp_rank, state.ranks("cp"), state.ranks("dp"), \
        engine.module.weight.detach().clone()


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_sums_over_cp_and_averages_over_dp(stage):
    res = run_distributed(_reduced_grad, 4, stage, timeout=240)
    g = [torch.tensor([1.0, 10.0, 100.0]) * (r + 1) for r in range(4)]
    # Order tp-cp-dp-pp with tp1 cp2 dp2: cp groups [0,1],[2,3]; dp groups [0,2],[1,3].
    assert res[0][2] == [0, 1] and res[0][3] == [0, 2]
    # sum over CP, mean over DP = (g0 + g2 + g1 + g3) / 2 on every rank.
    want_grad = (g[0] + g[1] + g[2] + g[3]) / 2
    w0 = torch.tensor([[1.0, 2.0, 3.0]])
    for *_, w in res:
        # SGD lr=1: w = w0 - grad. Exact in fp32: all values are small integers / 2.
        torch.testing.assert_close(w, w0 - want_grad, rtol=0, atol=0)
