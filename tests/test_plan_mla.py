"""The planner's counts of multi-head latent attention (model.mla, ctxpar/plan/mla_layers.py)
against the code they model: autograd's saved tensors of a real tp x cp MLA GPT on gloo
ranks (every CP pattern, every checkpointing mode, q through its bottleneck or q_proj),
exact; the bytes cp_stats() counts in a training step, exact; one process's forward and
backward peaks against the CPU allocator; the what-if of the expanded ring's verdicts.
"""
from dataclasses import replace

import pytest
import torch

from ctxpar.config import ModelConfig
from ctxpar.config.mla import MLAConfig
from ctxpar.plan import comm_bytes, counts, mla_layers
from ctxpar.plan.candidate import Candidate
from ctxpar.testing import run_distributed
from models.options import ModelGroups, ModelOptions

# tests/test_gpt.py's two small MLA GPTs: DeepSeek-V3's form (q through a rank-24
# bottleneck, YaRN with mscale) and V2-Lite's (q_proj, rotate-half RoPE); value heads (12)
# narrower than the qk heads (16), so the kernels pad v
MLA = ModelConfig(vocab_size=128, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                  mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=8, v_head_dim=12),
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                "mscale_all_dim": 0.8, "original_max_position_embeddings": 16},
                  tie_embeddings=False)
CONFIGS = {"mla": MLA, "mla_lite": replace(
    MLA, rope_scaling=None, mla=MLAConfig(q_lora_rank=None, kv_lora_rank=16,
                                          qk_nope_head_dim=8, qk_rope_head_dim=8,
                                          v_head_dim=12, rope_interleave=False))}

# (tp, cp, cp_comm, ulysses degree) of 4 ranks (dp fills the rest): every pattern at cp 2,
# hybrid at cp 4, TP's split heads beside the replicated latent
LAYOUTS = [(1, 1, "ring", 1), (2, 1, "ring", 1), (1, 2, "ring", 1), (1, 2, "allgather", 1),
           (1, 2, "ulysses", 2), (1, 4, "hybrid", 2), (2, 2, "ring", 1), (2, 2, "ulysses", 2)]
MODES = ("none", "selective", "full", "every_n_layers")
MODELS = {"mla": CONFIGS["mla"], "mla_lite": CONFIGS["mla_lite"]}  # q_lora_rank 24 / null
BATCH = 2


def _saved_and_sent(rank, world):
    from ctxpar import cp_stats, init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.gpt import GPT

    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (BATCH, 32))
    out = {}
    for tp, cp, comm, u in LAYOUTS:
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp), ulysses=u)
        groups = ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group,
                             ulysses_group=st.ulysses_group, ring_group=st.ring_group)
        tok = shard_sequence(tokens, 1, st.cp_group, "zigzag", u)
        pos = sequence_positions(32, st.cp_group, "zigzag", ulysses=u)
        for name, m in MODELS.items():
            for mode in MODES if name == "mla" else ("none", "selective"):
                model = GPT(m, groups, ModelOptions(layout="zigzag", cp_comm=comm,
                                                    activation_checkpointing=mode,
                                                    every_n_layers=2, seed=1))
                with cp_stats() as calls, saved_tensor_bytes(model.parameters()) as seen:
                    loss = model(tok, pos, tok)
                    saved = sum(seen.values())
                    loss.backward()
                out[tp, cp, comm, name, mode] = saved, calls.as_dict()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_distributed(_saved_and_sent, 4, timeout=300)


def _cand(tp, cp, comm, u, mode):
    return Candidate(tp, cp, 1, 4 // (tp * cp), comm, u, "zigzag", activation=mode,
                     every_n_layers=2, micro_batch=BATCH)


def test_mla_saved_bytes_equal_what_autograd_saves_per_pattern_and_mode(measured):
    """q, the latent (gathered under Ulysses), out, lse, the bottlenecks' norms, RoPE at
    the rope width: the formula is exact on every rank."""
    for (tp, cp, comm, name, mode), (saved, _) in measured[0].items():
        u = u_of(tp, cp, comm)
        want = counts.activation_bytes(MODELS[name], _cand(tp, cp, comm, u, mode), 4)
        for rank, res in enumerate(measured):
            assert res[tp, cp, comm, name, mode][0] == want, (tp, cp, comm, name, mode, rank)


def u_of(tp, cp, comm):
    return next(u for t, c, k, u in LAYOUTS if (t, c, k) == (tp, cp, comm))


def test_mla_bytes_on_the_wire_equal_cp_stats_per_pattern(measured):
    """The latent (R + dr a token) forward, its fp32 gradient backward (ring, all-gather),
    Ulysses' q/out all-to-alls and gathered latent: cp_stats of a step without replay, per
    rank, both directions, equal to the planner's per-layer bytes times the layers."""
    for (tp, cp, comm, name, mode), (_, calls) in measured[0].items():
        if cp == 1 or mode != "none":
            continue
        m, u = MODELS[name], u_of(tp, cp, comm)
        fwd, bwd = comm_bytes.layer_cp_bytes(m, _cand(tp, cp, comm, u, mode), 4)
        for res in measured:
            st = res[tp, cp, comm, name, mode][1]
            got = (st["fwd_bytes_sent"], st["fwd_bytes_recv"], st["bwd_bytes_sent"],
                   st["bwd_bytes_recv"])
            assert got == (m.n_layers * fwd,) * 2 + (m.n_layers * bwd,) * 2, (tp, cp, comm)


@pytest.mark.quick
def test_the_latent_ring_sends_far_fewer_bytes_than_the_expanded_one():
    """DeepSeek-V3's widths: 576 numbers a token against 128 x (192 + 128) = 40,960."""
    m = replace(CONFIGS["mla"], n_heads=128, d_model=7168)
    m = replace(m, mla=replace(m.mla, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536))
    latent = mla_layers.mla_cp_bytes(m, "ring", 8, 1, 1, 4096, 128, 2, 2)
    expanded = mla_layers.mla_cp_bytes(m, "ring", 8, 1, 1, 4096, 128, 2, 2, expanded=True)
    assert latent[0] * 40960 == expanded[0] * 576
    assert mla_layers.ring_widths(m, 128) == 576


def test_expanded_rows_follow_the_block_plans():
    """zigzag: every step expands a whole block but the earlier ranks' (their first
    halves); contiguous: the busiest (last) rank expands every block."""
    assert mla_layers.expanded_rows("contiguous", 4, 8) == 32
    assert mla_layers.expanded_rows("zigzag", 4, 8) == 32  # rank 0: all later ranks' whole
    assert mla_layers.expanded_rows("zigzag", 1, 8) == 8


def test_the_ring_what_if_picks_expanded_over_nvlink_and_the_latent_over_the_network():
    """DeepSeek-V3's MLA layer at 128K on a cp8 ring (python -m ctxpar.plan.mla_ring): over
    NVLink both transfers hide and the latent's kv_b_proj on every visiting block is the
    larger cost; over the network the expanded K,V's blocks do not hide."""
    from ctxpar.plan.mla_ring import deepseek_v3, placements
    from ctxpar.plan.mla_ring import mla_layer_time
    m = deepseek_v3(131072)
    (_, nvlink, cand), (_, network, _), _ = placements("h100")
    for cluster, faster in ((nvlink, "expanded"), (network, "latent")):
        lat, exp = (mla_layer_time(m, cand, cluster, 2, x) for x in (False, True))
        assert (lat["total"] < exp["total"]) == (faster == "latent")
        assert lat["attention"] == exp["attention"] and lat["kv_b_proj"] > exp["kv_b_proj"]
        assert exp["bytes"] > 60 * lat["bytes"]


def test_without_cp_the_latent_pays_one_more_kv_b_proj_pass_than_the_expanded_form():
    """At cp 1 a rank expands its own N rows once either way; the latent attention expands
    them again in backward (3 passes beside dW and the latent's gradient, against 2)."""
    from ctxpar.plan.mla_ring import deepseek_v3, placements
    from ctxpar.plan.mla_ring import mla_layer_time
    m, (_, cluster, _) = deepseek_v3(8192), placements("h100")[0]
    cand = Candidate(1, 1, 1, 1)
    lat, exp = (mla_layer_time(m, cand, cluster, 2, x) for x in (False, True))
    assert lat["kv_b_proj"] * 3 == pytest.approx(exp["kv_b_proj"] * 4)
    assert lat["bytes"] == exp["bytes"] == 0


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_mla_forward_and_backward_peaks_equal_the_allocators(mode):
    """One process, an MLA GPT whose attention's buffers lead the peaks (16 heads at 512
    tokens: the expansion, the padded v and out, backward's fp32 dK,dV and the kernel's
    padded gradients): the planner's peaks above the model state within 2% of the CPU
    allocator's (measured -1.2% to +1.1%; the rest is the norms' and RoPE's temporaries)."""
    from ctxpar.config import Config
    from ctxpar.plan.memory import stage_memory
    from ctxpar.plan.zero_state import zero_config
    from ctxpar.testing.memory import allocator_peaks
    from models.gpt import GPT
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=2048, seq_len=512, n_layers=2, d_model=64, n_heads=16,
                      mla=MLAConfig(q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=64,
                                    qk_rope_head_dim=32, v_head_dim=48))
    model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode, seed=1))
    tok, pos = torch.randint(0, 2048, (1, 512)), torch.arange(512)
    model(tok, pos, tok).backward()  # warm: lazily built buffers are not the step's
    model.zero_grad(set_to_none=True)

    def step(region):
        with region("FWD"):
            loss = model(tok, pos, tok)
        with region("BWD"):
            loss.backward()
    got = allocator_peaks(step)
    c = Config()
    c.model, c.activation_checkpointing.mode = cfg, mode
    phases = stage_memory(c, Candidate(1, 1, 1, 1, zero=0, activation=mode), False, 1, 0,
                          "cpu", zero_config({})).phases
    state = phases[-1].terms["params"] + phases[-1].terms["optimizer"]
    for region, prefix in (("FWD", "forward"), ("BWD", "backward")):
        want = max(p.total for p in phases if p.name.startswith(prefix)) - state
        assert got[region] == pytest.approx(want, rel=0.02), (region, got[region], want)
