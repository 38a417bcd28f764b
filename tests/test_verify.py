"""verify.py: every CP pattern passes against the reference layout on CPU (with TP, PP,
fp32 and bf16; a mixture of experts at cp2 x ep2), a broken LSE merge and an ungathered
expert gradient fail naming the tensors, and the budgets' rules.

One spawn of 4 ranks runs every verify (each builds two layouts in the same processes);
the small tests assert its named results. One spawn of 2 ranks runs the hybrids (Gated
DeltaNet and gated attention, experts over ep2): correct layouts pass, with the ill-
conditioned gradients held to their measured rounding floor, and three real mutations of
the CP code in those ranks fail naming the tensor.
"""
import math

import pytest
import torch

from ctxpar.components.parity import (FLOOR_FACTOR, Row, compare, parity_budget,
                                      precision_of, ring_size, rounding_noise, verdict,
                                      with_floors)
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
    # multi-head latent attention, its heads over tp2, the latent on cp2's ring
    "mla_tp2": [TINY, *FAST, "model.n_kv_heads=null",
                "model.mla={q_lora_rank: 24, kv_lora_rank: 16, qk_nope_head_dim: 8, "
                "qk_rope_head_dim: 8, v_head_dim: 12}", "parallel.tp=2", "parallel.dp=1"],
}
OPTIONS = {"moe_ep2_ungathered": ["--steps", "1"]}  # verify.py's own, beside --set


# Qwen3-Next-shaped: three Gated DeltaNet layers and one gated full attention (partial
# rotary, qk norm), 4 experts with a gated shared expert on every layer.
QWEN3_NEXT = [TINY, *FAST, "model.n_layers=4",
              "model.layer_types=[linear_attention,linear_attention,linear_attention,"
              "full_attention]", "model.linear_num_key_heads=2", "model.linear_key_head_dim=16",
              "model.linear_chunk_size=16", "model.attention_output_gate=true",
              "model.partial_rotary_factor=0.25", "model.qk_norm=true",
              "model.moe={num_experts: 4, top_k: 2, expert_hidden: 32, shared_expert_hidden: 32, "
              "shared_expert_gate: true}", "parallel.dp=1", "parallel.ep=2"]
# Qwen3.5-shaped: the same 3:1 pattern, twice as many value heads as key heads
# (a value head reads key head h // 2), at 256 tokens.
QWEN3_5 = QWEN3_NEXT + ["model.linear_num_value_heads=4", "model.seq_len=256"]
DOCS = ["data.passkey_docs=2", "data.document_mask=true"]
HYBRID_CASES = {
    "qwen3_next_cp2_ep2_state": [*QWEN3_NEXT, "parallel.linear_cp=state"],
    "qwen3_next_cp2_ep2_heads_docs": [*QWEN3_NEXT, *DOCS, "parallel.linear_cp=heads"],
    "qwen3_5_cp2_ep2_heads": [*QWEN3_5, "parallel.linear_cp=heads"],
    "qwen3_5_cp2_ep2_state_docs": [*QWEN3_5, *DOCS, "parallel.linear_cp=state"],
    "qwen3_next_cp1_dp2_ep2": [*QWEN3_NEXT, "parallel.cp=1", "parallel.dp=2"],
    "qwen3_5_cp1_dp2_ep2": [*QWEN3_5, "parallel.cp=1", "parallel.dp=2"],
    # the mutations, each a real change to the CP code in the spawned ranks
    "hybrid_broken_merge": [*QWEN3_NEXT, "parallel.linear_cp=state"],
    "hybrid_dropped_summary": [*QWEN3_NEXT, "parallel.linear_cp=state"],
    "hybrid_skipped_document_reset": [*QWEN3_NEXT, *DOCS, "parallel.linear_cp=state"],
}
CORRECT_HYBRIDS = [c for c in HYBRID_CASES if not c.startswith("hybrid_")]


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


def dropped_summaries(compose):
    """State passing's composition with every other rank's (M, E) summary dropped
    (zeros: its segment passes no state on), this rank's own kept: each rank's first
    segment starts from a zero state instead of its predecessors'."""
    def compose_own(gathered, initial, combine, rank, order):
        own = torch.zeros_like(gathered)
        own[rank] = gathered[rank]
        return compose(own, initial, combine, rank, order)
    return compose_own


def skipped_document_resets(gated_delta_state):
    """The Gated DeltaNet's state passing with its documents dropped: the local passes and
    the summaries carry the state across every document start (the reference, one rank,
    still resets)."""
    def no_resets(q, k, v, g, beta, group, layout, doc, kernel, initial_state):
        return gated_delta_state(q, k, v, g, beta, group, layout, None, kernel, initial_state)
    return no_resets


def _verify_hybrids(rank, world, cases):
    import verify
    from ctxpar.context_parallel import blocks
    from ctxpar.context_parallel.linear import api, state_passing

    out = {}
    for name, (config, *sets) in cases.items():
        merge, compose, gdn = blocks.merge_block_, state_passing._compose, api._gated_delta_state
        if name == "hybrid_broken_merge":
            blocks.merge_block_ = broken_merge_block_
        if name == "hybrid_dropped_summary":
            state_passing._compose = dropped_summaries(compose)
        if name == "hybrid_skipped_document_reset":
            api._gated_delta_state = skipped_document_resets(gdn)
        try:
            args = verify.parse_args(["--config", config, "--steps", "3", "--set", *sets])
            out[name] = verify.verify(args, world)
        finally:
            blocks.merge_block_, state_passing._compose = merge, compose
            api._gated_delta_state = gdn
    return out


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


@pytest.fixture(scope="module")
def hybrids():
    """{case: (rows, line, exit code)} of HYBRID_CASES on 2 ranks, 3 steps each."""
    per_rank = run_distributed(_verify_hybrids, 2, HYBRID_CASES, timeout=600)
    assert per_rank[0] == per_rank[1]
    return per_rank[0]


@pytest.mark.parametrize("case", CORRECT_HYBRIDS)
def test_a_correct_hybrid_passes_at_cp2_ep2_and_cp1_dp2_ep2_over_3_steps(hybrids, case):
    """Qwen3-Next- and Qwen3.5-shaped hybrids (state passing and heads, with documents
    too) and CP-less cp1 x dp2 x ep2, against cp1 ep1: every loss, gradient and mixer
    output within its budget or its measured rounding floor, at steps 1-3."""
    rows, line, code = hybrids[case]
    assert code == 0 and line.startswith("verify: PASS"), line
    assert {r.step for r in rows} == {1, 2, 3}
    assert {r.name for r in rows if r.kind == "attn"} == {
        "layers.0.linear_attn", "layers.1.linear_attn", "layers.2.linear_attn", "layers.3.attn"}
    # the outputs and the loss need no floor: fp32's flat budgets hold them
    assert all(r.diff <= r.budget for r in rows if r.kind != "grad")


def test_the_ill_conditioned_gradients_pass_by_a_measured_rounding_floor(hybrids):
    """cp1 x dp2 x ep2 moves the Gated DeltaNet's A_log and dt_bias gradients (one scalar
    per head, summed over every token) past fp32's flat 1e-4 on this CPU; the reference
    rerun from rounding-moved weights moves them as far: they pass by their floor, which
    the line says, while every well-conditioned gradient stays under the flat budget."""
    rows, line, code = hybrids["qwen3_next_cp1_dp2_ep2"]
    floored = [r for r in rows if r.by_floor]
    assert code == 0 and floored and "only within their rounding floor" in line, line
    assert {r.name.rsplit(".", 1)[-1] for r in floored} <= {"A_log", "dt_bias", "weight"}
    assert all(".linear_attn." in r.name for r in floored)
    # the floor is measured (20x the reference's own movement), not assumed: the others'
    # is far below the flat budget, so the flat budget still holds them
    measured = [r for r in rows if r.kind == "grad" and r.floor]
    assert len(measured) == len([r for r in rows if r.kind == "grad"])
    assert sorted(r.floor for r in measured)[len(measured) // 2] < 1e-4


@pytest.mark.parametrize("case, tensor", [
    ("hybrid_broken_merge", "layers.3.attn"),
    ("hybrid_dropped_summary", ".linear_attn"),
    ("hybrid_skipped_document_reset", ".linear_attn")])
def test_a_broken_hybrid_fails_naming_the_tensor(hybrids, case, tensor):
    """A broken ring merge (the attention layer), a state summary dropped between ranks
    and the documents' resets skipped in the linear layers' state passing: the first
    output they change is far over its budget, and the verdict names the worst tensor
    (a gradient or an output of the broken mixer)."""
    rows, line, code = hybrids[case]
    assert code == 1 and line.startswith("verify: FAIL"), line
    worst = max(rows, key=lambda r: r.ratio)
    assert tensor in worst.name and f"{worst.kind} {worst.name} at step" in line
    assert "not rounding" in line  # outputs over the flat budget: no floor was measured
    outputs = [r for r in rows if r.kind == "attn" and tensor in r.name]
    assert any(r.diff > 10 * r.budget for r in outputs)  # rounding gives < 0.1 x
    assert not any(r.floor for r in rows)


@pytest.mark.parametrize("case", ["ring", "allgather_tp2_bf16", "ulysses_pp2", "hybrid",
                                  "mla_tp2"])
def test_every_cp_pattern_passes_against_the_reference(results, case):
    rows, line, code = results[case]
    assert code == 0 and line.startswith("verify: PASS"), line
    kinds = {kind: [r for r in rows if r.kind == kind] for kind in ("loss", "grad", "attn")}
    # 2 steps x (the loss, 20 parameters of the 2-layer tied GPT (MLA's 26: q_a_proj,
    # q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj in
    # place of q/k/v/o), 2 attention cores)
    params = 26 if case == "mla_tp2" else 20
    assert [len(kinds[k]) for k in ("loss", "grad", "attn")] == [2, 2 * params, 4]
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
def test_a_floor_is_the_largest_movement_so_far_times_the_factor():
    """Two perturbed runs' movements: the larger of the two, and never below an earlier
    step's (Adam's rounding-decided steps only add up); a NaN movement is infinite."""
    runs = [{(1, "a"): 1e-5, (2, "a"): 1e-6, (1, "b"): float("nan")},
            {(1, "a"): 3e-5, (2, "a"): 2e-6, (2, "b"): 1e-7}]
    noise = rounding_noise(runs)
    assert noise == {(1, "a"): 3e-5, (2, "a"): 3e-5, (1, "b"): math.inf, (2, "b"): math.inf}
    budget = parity_budget("fp32", 2)
    rows = with_floors([Row(2, "a", "grad", 5e-4, budget["grad"]),
                        Row(2, "a", "attn", 5e-4, budget["attn"]),
                        Row(1, "b", "grad", 5e-4, budget["grad"])], noise)
    assert rows[0].floor == pytest.approx(FLOOR_FACTOR * 3e-5) and rows[0].by_floor
    assert rows[1].floor == 0 and not rows[1].ok  # outputs keep the flat budget
    assert rows[2].floor == 0 and not rows[2].ok  # no finite noise, no floor


@pytest.mark.quick
def test_the_verdict_says_whether_a_floor_held_or_was_exceeded():
    floored = Row(3, "layers.1.linear_attn.A_log", "grad", 5e-4, 1e-4, floor=2e-3)
    line, code = verdict([floored, Row(3, "loss", "loss", 1e-7, 1e-5)])
    assert code == 0 and "1 gradients only within their rounding floor" in line
    assert "layers.1.linear_attn.A_log at step 3" in line and "floor 2.00e-03" in line
    line, code = verdict([Row(3, "x.A_log", "grad", 5e-2, 1e-4, floor=2e-3)])
    assert code == 1 and "over its measured rounding floor too: not rounding" in line
    line, code = verdict([Row(3, "x.A_log", "grad", 5e-4, 1e-4)])
    assert code == 1 and "no rounding floor measured" in line


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
