"""verify.py: every CP pattern passes against the reference layout on CPU (with TP, PP,
fp32 and bf16; a mixture of experts at cp2 x ep2), a broken LSE merge and an ungathered
expert gradient fail naming the tensors, and the budgets' rules.

One spawn of 4 ranks runs every verify (each builds two layouts in the same processes);
the small tests assert its named results.
"""
import math

import pytest
import torch

from ctxpar.components.parity import (Row, compare, parity_budget, precision_of, ring_size,
                                      verdict)
from ctxpar.testing import run_distributed
from tests.helpers.train_run import HYBRID_MODEL

TINY = "configs/tiny_cpu.yaml"
MOE_MODEL = ["model.moe={num_experts: 4, top_k: 2, expert_hidden: 32, aux_loss_coef: 0.01, "
             "layers: [0]}"]
EXPERTS = {"layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"}
FAST = ["train.micro_batch_size=1", "model.seq_len=128"]
CASES = {
    "ring": [TINY, *FAST],                                               # cp2 x dp2 zigzag
    "allgather_tp2_bf16": [TINY, *FAST, "parallel.cp_comm=allgather", "parallel.tp=2",
                           "parallel.dp=1", "deepspeed.bf16={enabled: true}"],
    "ulysses_pp2": ["configs/tiny_cpu_4d.yaml", *FAST, "parallel.cp_comm=ulysses"],
    "hybrid": [TINY, *FAST, "parallel.cp=4", "parallel.dp=1", "parallel.cp_comm=hybrid",
               "parallel.ulysses=2"],
    "broken_merge": [TINY, *FAST, "parallel.cp=4", "parallel.dp=1"],
    # Gated DeltaNet, Mamba2, attention, Gated DeltaNet: state passing over cp2 x tp2
    "linear_state_tp2": [TINY, *FAST, *HYBRID_MODEL, "parallel.tp=2", "parallel.dp=1",
                         "parallel.linear_cp=state"],
    # layer 0 a mixture of 4 experts, 2 on each EP rank (folded over cp2 x dp2), layer 1
    # dense; the load-balancing loss on (both layouts then take the same micro-batches)
    "moe_cp2_ep2": [TINY, *FAST, *MOE_MODEL, "parallel.ep=2"],
    "moe_ep2_ungathered": [TINY, *FAST, *MOE_MODEL, "parallel.ep=2"],
}
OPTIONS = {"moe_ep2_ungathered": ["--steps", "1"]}  # verify.py's own, beside --set


def broken_merge_block_(out, lse, block_out, block_lse):
    """The LSE merge weighing each incoming block as if its log-sum-exp were 0.1 larger (a
    block's softmax scale off, say). The first block of a row still gets weight 1, so one
    rank's attention (the reference's single block) is unaffected; every merge after it
    is wrong."""
    w = torch.sigmoid(block_lse.float() + 0.1 - lse).nan_to_num_(nan=0.0)
    out.lerp_(block_out.float(), w.transpose(1, 2).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, block_lse.float()))


def ungathered_experts(gather_full_tensor):
    """verify's gather with the EP step dropped: an expert tensor's E/ep local experts
    repeated ep times (the full (E, ...) shape, this rank's slice in every EP rank's place)."""
    from ctxpar.tensor_parallel.utils import expert_shard

    def gather(local, param, tp_group, ep_group=None):
        ep = expert_shard(param)[1]
        if ep == 1:
            return gather_full_tensor(local, param, tp_group, ep_group)
        return torch.cat([local.detach().float()] * ep)
    return gather


def _verify_all(rank, world, cases):
    import verify
    from ctxpar.context_parallel import blocks

    out = {}
    for name, (config, *sets) in cases.items():
        merge, gather = blocks.merge_block_, verify.gather_full_tensor
        if name == "broken_merge":
            blocks.merge_block_ = broken_merge_block_
        if name == "moe_ep2_ungathered":
            verify.gather_full_tensor = ungathered_experts(gather)
        try:
            args = verify.parse_args(["--config", config, *OPTIONS.get(name, []),
                                      "--set", *sets])
            out[name] = verify.verify(args, world)
        finally:
            blocks.merge_block_, verify.gather_full_tensor = merge, gather
    return out


@pytest.fixture(scope="module")
def results():
    """{case: (rows, line, exit code)}, as every rank got them (rank 0's)."""
    per_rank = run_distributed(_verify_all, 4, CASES, timeout=600)
    assert all(r == per_rank[0] for r in per_rank[1:])  # every rank exits alike
    return per_rank[0]


@pytest.mark.parametrize("case", ["ring", "allgather_tp2_bf16", "ulysses_pp2", "hybrid"])
def test_every_cp_pattern_passes_against_the_reference(results, case):
    rows, line, code = results[case]
    assert code == 0 and line.startswith("verify: PASS"), line
    kinds = {kind: [r for r in rows if r.kind == kind] for kind in ("loss", "grad", "attn")}
    # 2 steps x (the loss, 20 parameters of the 2-layer tied GPT, 2 attention cores)
    assert [len(kinds[k]) for k in ("loss", "grad", "attn")] == [2, 40, 4]
    assert {r.name for r in kinds["attn"]} == {"layers.0.attn", "layers.1.attn"}
    # Nothing missing on either side (a missing tensor is an infinite difference).
    assert all(math.isfinite(r.diff) and r.ok for r in rows)


def test_a_hybrid_model_compares_its_linear_mixers_outputs(results):
    """Each Gated DeltaNet's and Mamba2's output (T, d), gathered over CP, beside the
    attention core's: all within the fp32 budget at cp2 x tp2 with state passing."""
    rows, line, code = results["linear_state_tp2"]
    assert code == 0 and line.startswith("verify: PASS"), line
    assert {r.name for r in rows if r.kind == "attn"} == {
        "layers.0.linear_attn", "layers.1.mamba", "layers.2.attn", "layers.3.linear_attn"}
    # the outputs as close as the other fp32 layouts'; the gradients within their 1e-4
    # budget (the largest 3.6e-5 when this was written)
    assert max(r.diff for r in rows if r.kind == "attn") < 1e-5


def test_expert_gradients_are_gathered_over_ep_against_every_expert(results):
    """cp2 x dp2 x ep2 against cp1 x dp4 x ep1: each expert tensor's gradient gathered over
    its EP group to the full (E, ...) tensor (a shape mismatch would be an infinite
    difference) and within fp32's budget beside the router's, whose load-balancing loss
    is the same because both layouts take the same micro-batches (verify.batch_sizes)."""
    rows, line, code = results["moe_cp2_ep2"]
    assert code == 0 and line.startswith("verify: PASS"), line
    grads = {r.name: r for r in rows if r.kind == "grad" and r.step == 2}
    assert EXPERTS < set(grads) and "layers.0.mlp.gate.weight" in grads
    assert max(grads[n].diff for n in EXPERTS | {"layers.0.mlp.gate.weight"}) < 1e-5


def test_expert_gradients_compared_without_the_ep_gather_fail(results):
    """The mutation: each rank's own experts in every EP rank's place fail, the expert
    tensors alone (the rest of the run is the same)."""
    rows, line, code = results["moe_ep2_ungathered"]
    assert code == 1 and line.startswith("verify: FAIL"), line
    assert {r.name for r in rows if not r.ok} == EXPERTS
    assert all(r.diff > 0.1 for r in rows if r.name in EXPERTS)


def test_fp32_layouts_agree_to_reduction_order(results):
    for case in ("ring", "ulysses_pp2", "hybrid"):
        assert max(r.diff for r in results[case][0]) < 1e-5, case


def test_bf16_is_held_to_the_16_bit_budget(results):
    rows = results["allgather_tp2_bf16"][0]
    assert {r.budget for r in rows if r.kind == "attn"} == {1e-2}
    assert {r.budget for r in rows if r.kind == "grad"} == {5e-2 * math.sqrt(2)}
    assert max(r.diff for r in rows) > 1e-4  # really bf16: far above fp32's differences


def test_a_broken_merge_fails_naming_the_worst_tensor(results):
    rows, line, code = results["broken_merge"]
    assert code == 1
    worst = max(rows, key=lambda r: r.ratio)
    assert line.startswith("verify: FAIL") and f"{worst.kind} {worst.name} at step" in line
    # Every attention output is off, at every step, by far more than fp32's budget.
    attn = [r for r in rows if r.kind == "attn"]
    assert len(attn) == 4 and all(r.diff > 100 * r.budget for r in attn)


@pytest.mark.quick
def test_budgets_fp32_flat_bf16_gradients_growing_with_the_ring():
    assert parity_budget("fp32", 8) == parity_budget("fp32", 1)
    bf16_4, bf16_1 = parity_budget("bf16", 4), parity_budget("bf16", 1)
    assert bf16_4["grad"] == pytest.approx(2 * bf16_1["grad"])
    assert (bf16_4["attn"], bf16_4["loss"]) == (bf16_1["attn"], bf16_1["loss"])  # fp32 merge
    assert parity_budget("fp32", 1, scale=3)["attn"] == pytest.approx(3e-5)
    assert precision_of({"bf16": {"enabled": True}}) == "bf16"
    assert precision_of({"fp16": {"enabled": True}}) == "bf16"
    assert precision_of({"zero_optimization": {"stage": 1}}) == "fp32"
    assert [ring_size(8, c, u) for c, u in (("ring", 1), ("allgather", 1), ("ulysses", 8),
                                              ("hybrid", 2))] == [8, 8, 1, 4]


def test_verdict_names_the_tensor_furthest_over_its_budget():
    budget = parity_budget("fp32", 1)
    rows = [compare(1, "loss", "loss", 2.0, 2.0, budget),
            compare(1, "layers.0.attn", "attn", torch.ones(3), torch.ones(3) * 1.001, budget),
            compare(2, "embed.weight", "grad", torch.ones(3), torch.ones(3) * 1.01, budget),
            Row(2, "final_norm.weight", "grad", float("nan"), budget["grad"])]
    line, code = verdict(rows)
    assert code == 1 and "worst grad final_norm.weight at step 2" in line  # NaN fails first
    line, code = verdict(rows[:3])
    assert code == 1 and "2 of 3" in line and "attn layers.0.attn at step 1" in line
    line, code = verdict(rows[:1])
    assert code == 0 and line.startswith("verify: PASS")


@pytest.mark.quick
def test_bad_input_exits_2_before_any_collective(monkeypatch, capsys):
    import verify
    monkeypatch.setenv("RANK", "0")
    for argv in (["--reference-cp", "3"], ["--steps", "0"], ["--set", "parallel.cp=3"]):
        with pytest.raises(SystemExit) as e:
            verify.check_inputs(verify.parse_args(["--config", TINY, *argv]), 4)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0], err
