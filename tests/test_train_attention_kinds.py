"""train.py on a GPT that mixes the attention kinds of today's open models: a sliding
window (Mistral, Gemma), chunks (Llama 4), full layers, sinks (gpt-oss) and RoPE per layer
type (Gemma 3); and on a hybrid of linear layers (Qwen3.5's three Gated DeltaNet layers per
full-attention one, then Nemotron-H's mamba, attention and mlp blocks), its linear mixers
also split over TP and resharded back to tp1. Every layout logs cp = 1's losses (the attention-level parity over every comm x layout x window is
tests/test_attention_mask.py's, the hybrids' over layouts and documents
tests/test_hybrid_gpt.py's)."""
import shutil

import pytest

from tests.helpers.train_run import assert_same_run, losses, run_train

# seq_len 128: a window of 13 is shorter than a cp4 rank's 32 tokens and a zigzag chunk's
# (the halo exchange); chunks of 48 cross the ranks' boundaries.
KINDS = ["model.n_layers=4", "model.sliding_window=13", "model.attention_chunk_size=48",
         "model.layer_types=[sliding_attention,chunked_attention,full_attention,"
         "sliding_attention]",
         "model.layer_rope={sliding_attention: {rope_theta: 100.0}}",
         "model.attention_sinks=true", "train.steps=6", "train.eval_samples=8",
         "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kinds") / "cp1")
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", *KINDS])
    return d


@pytest.mark.parametrize("sets", [
    ["parallel.cp=4", "parallel.cp_comm=ring", "parallel.layout=contiguous"],
    ["parallel.cp=2", "parallel.pp=2", "parallel.cp_comm=allgather"],
], ids=["cp4-ring-contiguous", "cp2-pp2-allgather-zigzag"])
def test_mixed_layer_types_log_cp1s_losses(reference, tmp_path, sets):
    d = str(tmp_path / "cp")
    run_train(d, 4, ["parallel.dp=1", *KINDS, *sets])
    assert_same_run(d, reference, 6)


# Documents on (passkey_docs 2: a boundary inside a rank's share), kernel chunks of 16
# against a cp2 zigzag segment of 32 tokens.
HYBRID = ["model.n_layers=7",
          "model.layer_types=[linear_attention,linear_attention,linear_attention,"
          "full_attention,mamba,attention,mlp]",
          "model.linear_num_key_heads=2", "model.linear_key_head_dim=16",
          "model.mamba_head_dim=16", "model.ssm_state_size=16", "model.n_groups=2",
          "model.linear_chunk_size=16", "data.passkey_docs=2", "data.document_mask=true",
          "train.steps=6", "train.eval_samples=8", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def hybrid_reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hybrid") / "cp1")
    run_train(d, 1, ["parallel.cp=1", "parallel.dp=1", *HYBRID])
    return d


@pytest.mark.parametrize("nproc,sets", [
    (2, ["parallel.cp=2", "parallel.linear_cp=state"]),
    (4, ["parallel.cp=4", "parallel.layout=zigzag", "parallel.linear_cp=state"]),
    (2, ["parallel.cp=2", "parallel.linear_cp=heads", "parallel.cp_comm=ulysses"]),
    (4, ["parallel.cp=2", "parallel.pp=2", "parallel.linear_cp=state"]),
], ids=["cp2-state", "cp4-zigzag-state", "cp2-heads-ulysses", "cp2-pp2-state"])
def test_hybrid_linear_layers_log_cp1s_losses(hybrid_reference, tmp_path, nproc, sets):
    d = str(tmp_path / "cp")
    proc = run_train(d, nproc, ["parallel.dp=1", *sets, *HYBRID])
    assert_same_run(d, hybrid_reference, 6)
    # the planner counts the linear layers (docs/planner.md): a forecast, not a refusal
    assert "GB per rank predicted" in proc.stdout and "no prediction" not in proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-2000:]


def test_hybrid_split_over_tp_logs_cp1s_losses_and_reshards_to_tp1(hybrid_reference,
                                                                   tmp_path):
    """tp2 x cp2: the mixers split by heads (one key head, one B/C group a rank), their
    fused [q | k | v] and [z | x | B | C | dt] rows section by section; its step-3
    checkpoint (ZeRO-1) resumed at tp1 x cp2 through DeepSpeed's universal conversion (the
    sub-parameter rule, ctxpar/checkpoint/universal.py) logs cp 1's losses to the end."""
    tp2, tp1 = tmp_path / "tp2cp2", tmp_path / "tp1cp2"
    run_train(str(tp2), 4, ["parallel.dp=1", "parallel.tp=2", "parallel.cp=2",
                            "checkpoint.save_interval=3", *HYBRID])
    assert_same_run(str(tp2), hybrid_reference, 6)
    tag = "step_00000003"
    shutil.copytree(tp2 / "checkpoints" / tag, tp1 / "checkpoints" / tag)
    proc = run_train(str(tp1), 2, ["parallel.dp=1", "parallel.cp=2", *HYBRID],
                     extra=["--resume", "auto"])
    assert "resharded step_00000003" in proc.stdout and "tp 2->1" in proc.stdout, \
        proc.stdout[-2000:]
    want, got = losses(hybrid_reference), losses(str(tp1))
    assert sorted(got) == [4, 5, 6], sorted(got)
    for s in got:  # fp32 weights and Adam states restored exactly; reductions reordered
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])


GATED = ["model.qk_norm=true", "model.norm_offset=1.0", "model.attention_output_gate=true",
         "model.partial_rotary_factor=0.25", "train.steps=6", "train.eval_samples=8",
         "logging.wandb.mode=disabled"]


def test_gated_attention_through_the_pipeline_logs_cp1s_losses(tmp_path):
    """Qwen3.5's gated attention with RoPE on a quarter of each head through train.py at
    cp2 x pp2 (the pipeline's blocks compute their own RoPE; tests/test_gpt.py holds the
    GPT at tp and cp) logs cp 1's losses."""
    ref, d = str(tmp_path / "cp1"), str(tmp_path / "cp2pp2")
    run_train(ref, 1, ["parallel.cp=1", "parallel.dp=1", *GATED])
    run_train(d, 4, ["parallel.cp=2", "parallel.pp=2", "parallel.dp=1", *GATED])
    assert_same_run(d, ref, 6)
