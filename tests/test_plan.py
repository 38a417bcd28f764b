"""The layout planner's counts against the code they model, and its command line.

- parameters per rank: the TP layers' real shapes, tp 1/2/4, tied or not, GQA with kv
  heads replicated when tp exceeds them;
- activations per rank: autograd's saved tensors of a real tp x cp GPT on gloo ranks,
  13 layouts (every CP pattern) x every checkpointing mode, exact;
- model state per ZeRO stage 0-3: every tensor DeepSpeed's engine holds after a step,
  on 4 layouts (dp x cp groups of 2 and 4), within 5% (DeepSpeed's bucket padding is the rest);
- CP bytes: tests/test_context_parallel.py holds comm_bytes.cp_bytes to cp_stats() exactly,
  tests/test_attention_mask.py masked_cp_bytes and the busiest rank's pairs of windowed
  and chunked layers; here, the search's layout for a windowed model and its reason, and
  --max-seq-len's gain from a window;
- phases: the forward and backward peaks of a one-process GPT (plain, full checkpointing,
  tiled loss and MLP) against the CPU allocator's live bytes, and torch AdamW's step
  temporaries against the tensors it allocates (tools/benchmarks/bench_plan_memory.py holds the
  whole start line to train.py's measured peaks);
- the command line: the table, --explain, --write (a config train.py accepts), --plot,
  and one line with exit 2 for a bad preset, an impossible cluster or nothing fitting.
"""
import gc
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from ctxpar.config import ModelConfig, layer_attention, load_config
from ctxpar.plan import comm_bytes, counts
from ctxpar.plan.candidate import Candidate
from ctxpar.plan.memory import model_state
from ctxpar.plan.timing import thresholds
from ctxpar.testing import run_distributed
from ctxpar.testing.memory import allocator_peaks
from models.options import ModelGroups, ModelOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(vocab_size=64, seq_len=32, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2)


# ------------------------------------------------------------------ parameters


def _params(rank, world, cases):
    from ctxpar import init_parallel_state
    from models.gpt import GPT
    out = []
    for tp, kw in cases:
        st = init_parallel_state(tp=tp, dp=world // tp)
        model = GPT(ModelConfig(**{**CFG, **kw}),
                    ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group), device="meta")
        out.append(sum(p.numel() for p in model.parameters()))
    return out


@pytest.mark.quick
def test_parameters_per_rank_equal_the_tp_layers():
    cases = [(tp, kw) for tp in (1, 2, 4) for kw in (
        {}, {"tie_embeddings": False, "bias": True, "norm": "layernorm"},
        {"n_kv_heads": 1, "mlp": "gelu"})]
    got = run_distributed(_params, 4, cases)[0]
    for (tp, kw), n in zip(cases, got):
        m = ModelConfig(**{**CFG, **kw})
        assert n == counts.stage_params(m, tp, 1, 0), (tp, kw)
    assert counts.total_params(ModelConfig(**CFG)) == got[0]


# ------------------------------------------------------------------ activations

# (tp, cp, cp_comm, ulysses degree): 13 layouts of 4 ranks (dp fills the rest).
ACT_LAYOUTS = [(1, 1, "ring", 1), (2, 1, "ring", 1), (4, 1, "ring", 1),
               (1, 2, "ring", 1), (1, 2, "allgather", 1), (1, 2, "ulysses", 2),
               (1, 4, "ring", 1), (1, 4, "allgather", 1), (1, 4, "ulysses", 4),
               (1, 4, "hybrid", 2), (2, 2, "ring", 1), (2, 2, "ulysses", 2),
               (2, 2, "allgather", 1)]
MODES = ("none", "selective", "full", "every_n_layers")


def _saved(rank, world):
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from models.gpt import GPT
    from ctxpar.testing.memory import saved_tensor_bytes

    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 32))
    out = {}
    for tp, cp, comm, u in ACT_LAYOUTS:
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp), ulysses=u)
        for mode in MODES:
            model = GPT(ModelConfig(**CFG),
                        ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group,
                                    ulysses_group=st.ulysses_group, ring_group=st.ring_group),
                        ModelOptions(layout="zigzag", cp_comm=comm, activation_checkpointing=mode,
                                     every_n_layers=2, seed=1))
            tok = shard_sequence(tokens, 1, st.cp_group, "zigzag", u)
            pos = sequence_positions(32, st.cp_group, "zigzag", ulysses=u)
            with saved_tensor_bytes(model.parameters()) as seen:
                loss = model(tok, pos, tok)
            out[tp, cp, comm, mode] = sum(seen.values())
            loss.backward()
    return out


def test_activation_bytes_equal_what_autograd_saves():
    """Per rank, per checkpointing mode, per CP pattern: the formula is exact."""
    results = run_distributed(_saved, 4, timeout=300)
    m = ModelConfig(**CFG)
    for tp, cp, comm, u in ACT_LAYOUTS:
        for mode in MODES:
            cand = Candidate(tp, cp, 1, 4 // (tp * cp), comm, u, "zigzag", activation=mode,
                         every_n_layers=2, micro_batch=2)
            want = counts.activation_bytes(m, cand, 4)
            for rank, res in enumerate(results):
                assert res[tp, cp, comm, mode] == want, (cand.name(), rank)


@pytest.mark.parametrize("fields", [
    dict(qk_norm=True, post_norms=True),  # Qwen3's q/k norms, Gemma's norms after
    dict(qk_norm=True, norm_offset=1.0, post_norms=True, scale_embeddings=True, head_dim=12,
         mlp="geglu", attention_bias=True, query_pre_attn_scalar=10.0),  # Gemma 3's all
    dict(qk_norm=True, qk_norm_scope="all_heads", reordered_norms=["full_attention"]),  # OLMo 2's
    # MiMo-V2-Flash's: K/V heads per layer type (1 full, 4 sliding), value heads of 6
    # beside q/k's 12 (o_proj's input a vd-wide copy of the padded core's output), sinks,
    # RoPE on a third of each head with its own base on the sliding layers (two cos/sin)
    dict(n_kv_heads=1, head_dim=12, v_head_dim=6, sliding_window=8,
         layer_types=["full_attention", "sliding_attention", "sliding_attention"],
         layer_kv_heads={"sliding_attention": 4}, attention_sinks=["sliding_attention"],
         attention_value_scale=0.7, partial_rotary_factor=1 / 3,
         layer_rope={"sliding_attention": {"rope_theta": 100.0}})])
def test_activation_bytes_of_the_families_fields_equal_what_autograd_saves(fields):
    """One process (the fields are per head or per token: TP and CP split them as the
    rest, test_activation_bytes_equal_what_autograd_saves)."""
    from helpers.saved_bytes import assert_planner_saves_what_autograd_saves
    assert_planner_saves_what_autograd_saves(ModelConfig(**{**CFG, **fields}), MODES, fields)


def _with_kda():
    """The hybrids of ctxpar.testing.linear, Kimi Linear's (KDA layers) with them."""
    from ctxpar.testing.linear import HYBRID_CONFIGS, KIMI_LINEAR_CONFIG
    return {**HYBRID_CONFIGS, "kimi-linear": KIMI_LINEAR_CONFIG}


def _hybrid_one_process(rank, world):
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.gpt import GPT
    out = {}
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    for name, m in _with_kda().items():
        for mode in MODES:
            model = GPT(replace(m, attention_output_gate=True),
                        options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                             seed=1))
            with saved_tensor_bytes(model.parameters()) as seen:
                model(tokens, torch.arange(48), tokens)
            out[name, mode] = sum(seen.values())
    return out


@pytest.mark.quick
def test_activation_bytes_of_a_hybrid_equal_what_autograd_saves():
    """One process (a fresh one: the counts are per storage, and an earlier test's cached
    tensors can share one with this model's), Gated DeltaNet (and KDA) with gated
    attention and Mamba2 with Nemotron-H's single-op blocks, every checkpointing mode, exact: the conv's
    taps, the chunked kernels' intermediates and fp32 states per chunk
    (ctxpar/plan/linear_saved.py)."""
    got = run_distributed(_hybrid_one_process, 1)[0]
    for (name, mode), saved in got.items():
        m = replace(_with_kda()[name], attention_output_gate=True)
        cand = Candidate(1, 1, 1, 1, activation=mode, every_n_layers=2, micro_batch=2)
        assert saved == counts.activation_bytes(m, cand, 4), (name, mode)


def test_linear_mixers_saved_bytes_at_realistic_shapes_and_bf16():
    """linear_saved's formulas against one mixer's saved tensors at wider heads and
    chunks than the tiny hybrids, fp32 and bf16, within 1% (measured: 0.0-0.6%; the
    rest: where matmul copies a chunk's view or reuses it depends on the strides, which
    the formula takes at its most common)."""
    from ctxpar.plan import linear_saved as ls
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.gated_delta import GatedDeltaNet
    from models.gpt import context_parallel_of
    from models.kda import KimiDeltaAttention
    from models.mamba2 import Mamba2
    cp = context_parallel_of("ring", None, None, None, "contiguous", "fp32")
    cases = [("linear_attention", dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=16, linear_value_head_dim=16,
                                       linear_chunk_size=16), ls.GatedDeltaShapes(2, 4, 16, 16, 4, 16)),
             ("mamba", dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=32,
                            n_groups=2, linear_chunk_size=16), ls.MambaShapes(4, 16, 32, 2, 4, 16)),
             ("kimi_delta_attention", dict(linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           linear_chunk_size=16),
              ls.GatedDeltaShapes(2, 4, 16, 16, 4, 16))]
    mixers = {"linear_attention": (GatedDeltaNet, ls.gdn_saved), "mamba": (Mamba2, ls.mamba_saved),
              "kimi_delta_attention": (KimiDeltaAttention, ls.kda_saved)}
    for kind, kw, sh in cases:
        m = ModelConfig(vocab_size=64, seq_len=128, d_model=16, n_heads=4, n_layers=1,
                        layer_types=[kind], **kw)
        for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
            mod = mixers[kind][0](m, cp).to(dtype)
            for p in mod.parameters():
                torch.nn.init.normal_(p, std=0.1)
            x = torch.randn(2, 128, 16, dtype=dtype)
            with saved_tensor_bytes([*mod.parameters(), x]) as seen:
                mod(x.requires_grad_())
            got = sum(seen.values()) - 128 * 4 * 8  # the conv's tap index: once a model
            want = mixers[kind][1](2, 128, sh, e)
            assert abs(want / got - 1) < 0.01, (kind, e, got, want)


@pytest.mark.parametrize("shape", [(1, 256, 2, 32, 16, 64), (2, 128, 4, 16, 16, 32),
                                   (1, 128, 2, 64, 64, 64), (2, 96, 2, 16, 32, 16)])
def test_kda_kernels_working_set_is_close_to_what_autograd_keeps(shape):
    """linear_saved.kda_kernel_saved (what the lean KDA kernel keeps while one segment's
    backward runs) against kda_fp32's saved tensors under autograd, one sub-chunk to four
    a chunk: within 8% (measured -6.8% .. +5.6%: the sub-chunks' stacked products and the
    reference points' decays, counted at their most common strides)."""
    from ctxpar.context_parallel.linear.kda import kda_fp32
    from ctxpar.plan.linear_saved import kda_kernel_saved
    from ctxpar.testing.memory import saved_tensor_bytes
    B, T, H, Dk, Dv, C = shape
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, T, H, Dk, generator=gen), torch.randn(B, T, H, Dk, generator=gen),
              torch.randn(B, T, H, Dv, generator=gen), -torch.rand(B, T, H, Dk, generator=gen),
              torch.rand(B, T, H, generator=gen)]
    leaves = [x.requires_grad_() for x in leaves]
    with saved_tensor_bytes(leaves) as seen:
        kda_fp32(*leaves, 0.3, None, None, C, True)
    got, want = sum(seen.values()), kda_kernel_saved(B, T, H, Dk, Dv, C)
    assert abs(want / got - 1) < 0.08, (shape, got, want)


HYBRID_CP = [(1, cp, linear, layout) for cp in (2, 4) for linear, layout in (
    ("state", "contiguous"), ("state", "zigzag"), ("heads", "zigzag"))] + [
    (2, 2, "state", "zigzag")]  # the mixers split over TP by heads


def _hybrid_saved(rank, world):
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.testing.memory import saved_tensor_bytes
    from models.gpt import GPT
    out = {}
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    for tp, cp, linear, layout in HYBRID_CP:
        st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp))
        for name, m in _with_kda().items():
            model = GPT(m, ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                        ModelOptions(layout=layout, linear_cp=linear, seed=1))
            tok = shard_sequence(tokens, 1, st.cp_group, layout)
            with saved_tensor_bytes(model.parameters()) as seen:
                loss = model(tok, sequence_positions(48, st.cp_group, layout), tok)
            out[tp, cp, linear, layout, name] = sum(seen.values())
            loss.backward()
    return out


def test_activation_bytes_of_a_hybrid_over_cp_are_close_to_what_autograd_saves():
    """cp 2 and 4, state passing (contiguous, zigzag) and heads, and tp2 x cp2 (the mixers
    split by heads): each rank's saved bytes within 7% of the planner's (measured 0.0-6.6%: the strategies' kernels run on segments
    or gathered heads whose padded and copied tensors the count takes from the cp-1
    formula at those shapes, linear_layers.mixer_saved; the attention layers are exact;
    Kimi Linear's KDA layers with them)."""
    results = run_distributed(_hybrid_saved, 4, timeout=300)
    for (tp, cp, linear, layout, name), _ in results[0].items():
        cand = Candidate(tp, cp, 1, 4 // (tp * cp), "ring", 1, layout, micro_batch=2,
                         linear_cp=linear)
        want = counts.activation_bytes(_with_kda()[name], cand, 4)
        for res in results:
            got = res[tp, cp, linear, layout, name]
            assert abs(want / got - 1) < 0.07, (tp, cp, linear, layout, name, got, want)


# ------------------------------------------------------------------ model state (DeepSpeed)


def _engine_state(rank, world, stage, tp, cp):
    """(this rank's parameter count, bytes of every tensor the process gained while the
    model and DeepSpeed's engine were built and took one step). One case per process:
    a fresh process has nothing freed whose address a new tensor could reuse."""
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.distributed.zero import partition_for_zero3
    from models.gpt import GPT
    from tests.helpers.engine_state import bytes_after_one_step, live_tensor_bytes

    init_deepspeed_comm()
    cfg = ModelConfig(vocab_size=512, seq_len=32, n_layers=2, d_model=128, n_heads=4,
                      n_kv_heads=2)
    st = init_parallel_state(tp=tp, cp=cp, dp=world // (tp * cp))
    tok = shard_sequence(torch.randint(0, 512, (2, 32)), 1, st.cp_group, "zigzag")
    pos = sequence_positions(32, st.cp_group, "zigzag")
    gc.collect()
    before = live_tensor_bytes()
    model = GPT(cfg, ModelGroups(tp_group=st.tp_group, cp_group=st.cp_group),
                ModelOptions(layout="zigzag", seed=1))
    psi = sum(p.numel() for p in model.parameters())
    # Small buckets, stated: the planner adds reduce_bucket_size itself (ZeRO-3).
    zero = {"stage": stage, "reduce_bucket_size": 20000}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                    stage3_max_live_parameters=0)
    ds = {"train_batch_size": 2 * st.dp_size, "train_micro_batch_size_per_gpu": 2,
          "gradient_accumulation_steps": 1, "zero_optimization": zero}
    partition_for_zero3(model, st, ds)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return psi, bytes_after_one_step(model, opt, st, ds, tok, pos, before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_per_zero_stage_matches_deepspeed(stage):
    """Params + fp32 master + Adam (and for stage 3 the grad partition and bucket
    DeepSpeed keeps allocated) after a step, per rank, within 5% of the planner (the
    rest: DeepSpeed's alignment padding and small buffers); the gradients of stages 0-2
    are freed by then, so they are compared without them. tp1 x cp2 x dp2 (ZeRO group
    D = 4), tp1 x cp4 (D = 4, CP ranks only), tp2 x cp2 (D = 2), tp2 x dp2 (D = 2)."""
    for tp, cp in ((1, 2), (1, 4), (2, 2), (2, 1)):
        D = 4 // tp
        for psi, held in run_distributed(_engine_state, 4, stage, tp, cp, timeout=300):
            s = model_state(psi, stage, D, bf16=False, reduce_bucket=20000)
            want = s["params"] + s["master"] + s["optimizer"] + (
                s["grads"] + s["buckets"] if stage == 3 else 0)
            assert abs(held - want) <= 0.05 * want, (stage, tp, cp, held, want)


# ------------------------------------------------------------------ phases vs the allocator


def _step_peaks_and_plan(model, cfg, mode, memory=None, **cand):
    """(the allocator's forward and backward peaks of one step of `model` on 512 tokens,
    after a warm step; the plan's phases of the same model and mode, one process)."""
    from ctxpar.config import Config
    from ctxpar.plan.memory import stage_memory
    from ctxpar.plan.zero_state import zero_config
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
    if memory is not None:
        c.memory = memory
    phases = stage_memory(c, Candidate(1, 1, 1, 1, zero=0, activation=mode, **cand), False, 1,
                          0, "cpu", zero_config({})).phases
    state = phases[-1].terms["params"] + phases[-1].terms["optimizer"]
    want = {region: max(p.total for p in phases if p.name.startswith(prefix)) - state
            for region, prefix in (("FWD", "forward"), ("BWD", "backward"))}
    return got, want


@pytest.mark.parametrize("mode,tiled", [("none", False), ("full", True)])
def test_forward_and_backward_peaks_equal_the_allocators(mode, tiled):
    """One process, tp = cp = 1: the planner's forward and backward peaks above the model
    state are the allocator's, within 2% (untiled they agree to 0.1%; the tiled MLP's
    backward makes its weights' gradients at a slightly different point than charged)."""
    from ctxpar.config import MemoryConfig
    from models.gpt import GPT

    cfg = ModelConfig(vocab_size=2048, seq_len=512, n_layers=2, d_model=64, n_heads=4,
                      n_kv_heads=2)
    mem = MemoryConfig(tiled_loss=tiled, tiled_mlp=tiled)
    model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode, memory=mem, seed=1))
    got, want = _step_peaks_and_plan(model, cfg, mode, mem, tiled_loss=tiled,
                                     tiled_mlp=tiled)
    for region in ("FWD", "BWD"):
        assert got[region] == pytest.approx(want[region], rel=0.02), (region, got, want)


MLP_CASES = [("swiglu", None, ("full", "tiled")), ("swiglu", 0.5, ("full",)),
             ("geglu", None, ("full",)), ("gelu", None, ("none", "full", "tiled")),
             ("relu2", None, ("none", "full", "tiled"))]


@pytest.mark.parametrize("mlp,limit,layouts", MLP_CASES)
def test_each_mlp_kinds_working_sets_equal_the_allocators(mlp, limit, layouts):
    """Every model.mlp (SwiGLU clamped by model.swiglu_limit too), an MLP wide enough (ffn
    4096 on 512 tokens) that its (N, f) intermediates make the phases' peaks: the
    planner's forward and backward peaks are the allocator's to within 1/20 of one (N, f)
    tensor (measured: within 0.02, small buffers), in mode none (what it saves; squared
    ReLU's up beside it), under full recompute (the replayed forward's intermediates at
    once, the backward's gradients: mlp_widths.py) and full with a tiled MLP of four
    128-token tiles (a tile's intermediates, a quarter (N, f) each). The gated kinds'
    mode none is test_forward_and_backward_peaks_equal_the_allocators', their clamped
    tile test_tiled_mlp_backward_term_against_live_bytes'; 'selective' replays the same
    MLP (measured as close by hand). The counts before mlp_widths fail: GELU's and
    squared ReLU's saved 4 (N, f) for 2, squared ReLU's replayed forward 2 for 3 and its
    backward 1 for 3, the tiled backward's weight gradient beside the activation's."""
    from ctxpar.config import CHOICES, MemoryConfig
    from models.gpt import GPT
    assert {case[0] for case in MLP_CASES} == set(CHOICES["model.mlp"])  # a case per kind
    cfg = ModelConfig(vocab_size=2048, seq_len=512, n_layers=2, d_model=64, n_heads=4,
                      n_kv_heads=2, ffn_hidden=4096, mlp=mlp, swiglu_limit=limit)
    one = 512 * 4096 * 4  # one (N, f) tensor, fp32
    for layout in layouts:
        mode, tile = ("full" if layout == "tiled" else layout), (128 if layout == "tiled" else None)
        # mode none's loss tiled: its forward peak is then the last MLP's, not the logits'
        mem = MemoryConfig(tiled_mlp=tile is not None, mlp_tile_tokens=tile or "auto",
                           tiled_loss=mode == "none")
        model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode, memory=mem, seed=1))
        got, want = _step_peaks_and_plan(model, cfg, mode, mem, tiled_mlp=tile is not None,
                                         tiled_loss=mode == "none")
        for region in ("FWD", "BWD"):
            assert abs(got[region] - want[region]) < one / 20, (mode, tile, region,
                                                                got[region] / one,
                                                                want[region] / one)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_forward_and_backward_peaks_of_a_hybrid_equal_the_allocators(mode):
    """One process, a Qwen3.5-like (3 GDN : 1 attention) and a Nemotron-H-like (mamba,
    attention, mlp, mamba) stack at 512 tokens, the lean kernels' (lean.py) segments of
    256 tokens (GDN, chunk 8: its backward recomputes two) and 512 (Mamba2, chunk 16): the
    forward and backward peaks above the model state within 2% of the allocator's
    (measured: -0.3% to +0.3%, linear_layers.mixer_working_set's segment)."""
    from models.gpt import GPT
    stacks = [(["linear_attention"] * 3 + ["full_attention"],
               dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_chunk_size=8)),
              (["mamba", "attention", "mlp", "mamba"],
               dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                    linear_chunk_size=16))]
    for types, kw in stacks:
        cfg = ModelConfig(vocab_size=2048, seq_len=512, n_layers=4, d_model=64, n_heads=4,
                          n_kv_heads=2, layer_types=types, **kw)
        model = GPT(cfg, options=ModelOptions(activation_checkpointing=mode, seed=1))
        got, want = _step_peaks_and_plan(model, cfg, mode)
        for region in ("FWD", "BWD"):
            assert got[region] == pytest.approx(want[region], rel=0.02), (types[0], region,
                                                                          got, want)


def test_evaluation_phase_is_below_the_step_and_charges_one_head_tile():
    """bench_plan_memory's "logits: cp2, vocab 32000, tiled loss" layout (the one
    tools/benchmarks/bench_eval_memory.py measures): the evaluation is a phase of the plan,
    below the step's peak, at its head: the model state, the hidden states, one loss tile's
    (n, V/tp) logits and fp32 softmax, and the per-token results."""
    from ctxpar.memory.tiled_loss import loss_tile_tokens
    from ctxpar.plan.memory import ds_zero, stage_memory
    from ctxpar.plan.startup import config_candidate
    sets = ["model.seq_len=8192", "model.d_model=256", "model.n_heads=4",
            "model.n_kv_heads=2", "model.vocab_size=32000", "model.n_layers=2",
            "parallel.tp=1", "parallel.cp=2", "parallel.dp=1", "train.micro_batch_size=1",
            "train.global_batch_size=1", "memory.tiled_loss=true"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), sets, world_size=2,
                      check_paths=False)
    cand = config_candidate(cfg, 2)
    mem = stage_memory(cfg, cand, False, 1, 0, "cpu", ds_zero(cfg, cand))
    ev = mem.phase("evaluation")
    assert ev.total < mem.peak and mem.peak_phase != "evaluation"
    N, V, d = 4096, 32000, 256  # one rank's tokens at cp 2
    tile = loss_tile_tokens(N, V, d)
    assert ev.terms["eval head tile"] == tile * V * (4 + 4)  # fp32 logits + fp32 exp
    assert ev.terms["hidden states"] == N * d * 4 and ev.terms["eval results"] == N * 12
    state = mem.phase("optimizer step").terms
    resident = ("params", "master", "optimizer")
    assert {k: ev.terms[k] for k in resident} == {k: state[k] for k in resident}
    # bench_eval_memory's measured live peak of the tiled evaluation (docs/benchmarks.md,
    # "The evaluation's peak against a training step's"), parameters not counted there
    above_state = ev.total - sum(ev.terms[k] for k in resident)
    assert above_state / 2 ** 20 == pytest.approx(129.1, rel=0.02)
    # the same toggle off: evaluation is tiled whatever memory.tiled_loss says
    untiled = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                          sets[:-1] + ["memory.tiled_loss=false"], world_size=2,
                          check_paths=False)
    cand = config_candidate(untiled, 2)
    off = stage_memory(untiled, cand, False, 1, 0, "cpu", ds_zero(untiled, cand))
    assert off.phase("evaluation").terms["eval head tile"] == ev.terms["eval head tile"]


def test_evaluation_phase_equals_the_live_bytes_of_the_tiled_eval_head():
    """One process, tp = cp = 1: the evaluation phase above the model state against the
    live bytes of what the evaluation runs (hidden states under no_grad, then
    tiled_eval_head), within 2%. Counted: the larger of a block's no_grad forward and the
    head's point (hidden states, one tile's logits and fp32 exp, per-token losses and
    predictions). Not counted here: the parameters and optimizer state (made before the
    measurement; the phase's resident terms, subtracted), and the batch's tokens and labels."""
    from ctxpar.components.evaluation import head_inputs
    from ctxpar.config import Config, MemoryConfig
    from ctxpar.memory.tiled_eval import tiled_eval_head
    from ctxpar.plan.memory import stage_memory
    from ctxpar.plan.zero_state import zero_config
    from ctxpar.testing.memory import LiveBytes
    from models.gpt import GPT

    cfg = ModelConfig(vocab_size=8192, seq_len=1024, n_layers=2, d_model=64, n_heads=4,
                      n_kv_heads=2)
    mem = MemoryConfig(loss_tile_tokens=256)
    model = GPT(cfg, options=ModelOptions(memory=mem, seed=1))
    mb = {"tokens": torch.randint(0, 8192, (1, 1024)), "positions": torch.arange(1024)}
    labels = torch.randint(0, 8192, (1, 1024))

    @torch.no_grad()
    def evaluate():
        tiled_eval_head(*head_inputs(model, mb), labels, tile_tokens=256)
    evaluate()  # warm: lazily built buffers are not the evaluation's
    with LiveBytes() as live:
        evaluate()
    c = Config()
    c.model, c.memory = cfg, mem
    cand = Candidate(1, 1, 1, 1, zero=0, activation="none")
    ev = next(p for p in stage_memory(c, cand, False, 1, 0, "cpu", zero_config({})).phases
              if p.name == "evaluation")
    want = ev.total - ev.terms["params"] - ev.terms["optimizer"]
    assert ev.terms["eval head tile"] == 256 * 8192 * 8
    assert live.peak == pytest.approx(want, rel=0.02), (live.peak, ev.terms)


def test_adam_temporaries_on_cpu_are_twice_the_largest_tensor():
    """torch AdamW's single-tensor step (CPU: no foreach kernels) makes sqrt(v) and its
    quotient at once: 2x the largest tensor, what zero_state charges a CPU step."""
    from ctxpar.plan.zero_state import Shard, ZeroState

    big, small = torch.nn.Parameter(torch.randn(1 << 20)), torch.nn.Parameter(torch.randn(99))
    opt = torch.optim.AdamW([big, small], lr=1e-3)
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()  # the moments exist from here on

    got = allocator_peaks(lambda region: opt.step())[None]
    st = ZeroState(Shard(big.numel() + 99, big.numel() + 99, big.numel(), 0), {"stage": 0,
                   "reduce_bucket_size": 1}, 1, False, "cpu")
    # 8 MiB, and a few bytes of step counters
    assert got == pytest.approx(st.step()["optimizer temporaries"], abs=1024)


# ------------------------------------------------------------------ thresholds


def test_the_seeds_rule_is_the_mha_bf16_case_of_the_thresholds():
    F, B = 989e12, 450e9  # H100 bf16 peak, NVLink per direction
    t = thresholds(F, B, h=32, hk=32, e=2, g=2, c=1.0, eff=1.0)
    assert t["fwd"] == pytest.approx(F / B)                    # the ring's overlap condition C >= F/B
    assert thresholds(F, B, 32, 8, 2, 4, 1.0, 1.0)["fwd"] == pytest.approx(F / B / 4)  # GQA 4
    assert t["bwd"] == pytest.approx(F / B * 4 / 5)            # 2.5x compute, K,V + dK,dV


def test_step_time_charges_each_memory_option():
    """timing.py's terms for the memory options, each against the same layout without it:
    the tiled MLP's forward again; the tiled loss's fourth head matmul only at TP > 1;
    activation offload hidden on CUDA unless PCIe is slower than the layer, whole on CPU;
    optimizer offload's copies and host Adam once per step."""
    from dataclasses import replace

    from ctxpar.config import Config
    from ctxpar.plan.cluster import GPUS, Cluster
    from ctxpar.plan.timing import MM_EFF, step_time

    c = Config()
    c.model = ModelConfig(vocab_size=32000, seq_len=8192, n_layers=4, d_model=1024,
                          n_heads=8, n_kv_heads=8, ffn_hidden=4096)
    c.train.global_batch_size = 2
    gpu = GPUS["h100"]
    cluster = Cluster(1, 8, gpu)

    def t(**kw):
        return step_time(c, Candidate(kw.pop("tp", 1), 2, 1, 1, activation="full", **kw),
                         kw.pop("cluster", cluster), True)

    base = t()
    micro, N, F = base.micro_batches, 1 * 8192 // 2, gpu.flops * MM_EFF
    mlp = 2 * N * 4 * 3 * 1024 * 4096 / F * micro
    assert t(tiled_mlp=True).compute - base.compute == pytest.approx(mlp)
    assert t(tiled_loss=True).total == base.total
    head2 = 2 * N * 1024 * 16000 / F * micro
    assert t(tp=2, tiled_loss=True).compute - t(tp=2).compute == pytest.approx(head2)
    assert t(offload_activations=True).offload == 0.0  # 8 MiB per layer hides at 50 GB/s
    slow = Cluster(1, 8, replace(gpu, pcie=1e6))
    copy = 4 * N * 1024 * 2 / 1e6  # each layer's input, bf16, at 1 MB/s
    got = step_time(c, Candidate(1, 2, 1, 1, activation="full", offload_activations=True),
                    slow, True).offload
    assert 2 * copy * micro > got > copy * micro  # both ways, minus what compute hides
    cpu = Cluster(1, 2, replace(GPUS["cpu"], pcie=1e6))
    plain = step_time(c, Candidate(1, 2, 1, 1, activation="full"), cpu, True)
    off = step_time(c, Candidate(1, 2, 1, 1, activation="full", offload_activations=True), cpu,
                    True)
    assert off.offload == pytest.approx(2 * copy * micro) and off.total > plain.total
    psi = counts.stage_params(c.model, 1, 1, 0)  # one stage: psi, over D = cp 2
    opt = t(zero=1, offload_optimizer=True).offload - t(zero=1).offload
    # fp32 grads out, bf16 params back; the node's Adam steps both ranks' partitions
    assert opt == pytest.approx(psi / 2 * (4 + 2) / gpu.pcie + psi / 2 * 2 / gpu.host_adam)


# ------------------------------------------------------------------ the command line


def plan_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_cli_table_explain_write_plot(tmp_path):
    out = tmp_path / "best.yaml"
    proc = plan_cli("--config", "configs/gpt1b_32k_3d.yaml", "--nodes", "1", "--top", "5",
                    "--explain", "2", "--write", str(out), "--plot", str(tmp_path / "p.png"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(ln.startswith("| ") and ln[2:3].isdigit() for ln in lines) == 5
    # Layouts that differ only in token layout (or ZeRO stage) and tie share a row.
    assert "ring/zigzag,striped" in proc.stdout
    # ... and the header says so: how many rows the fitting layouts make, and why fewer.
    header = lines[0]
    n_rows = int(header.split(" fit, in ")[1].split()[0])
    assert "(layouts that differ only in ZeRO stage or token layout" in header
    assert f" of {n_rows} rows)" in proc.stdout or "(does not fit)" in proc.stdout
    assert "ring chunk C" in proc.stdout or "cp1" in proc.stdout
    assert "memory per GPU" in proc.stdout and "bottleneck" in proc.stdout
    cfg = load_config(str(out), check_paths=False)   # runnable: validates as a config
    p = cfg.parallel
    assert p.tp * p.cp * p.pp * p.dp == 8
    assert (tmp_path / "p.png").stat().st_size > 10_000


@pytest.mark.parametrize("args,msg", [
    (["--gpu", "h1000"], "--gpu 'h1000' is not a known preset (known: h100, h200"),
    (["--nodes", "0"], "--nodes 0 --gpus-per-node 8: both must be >= 1"),
    (["--nodes", "1", "--gpus-per-node", "1", "--memory", "1e9"],
     "nothing fits in 1 GB per GPU: the smallest layout"),
    (["--nodes", "1", "--gpus-per-node", "1", "--memory", "1e9"],
     "the memory options (memory.tiled_loss, memory.tiled_mlp, memory.offload_activations, "
     "zero_optimization.offload_optimizer), or a shorter model.seq_len (--max-seq-len finds"),
    (["--nodes", "1", "--gpus-per-node", "1", "--memory", "1e9", "--max-seq-len",
      "--options", "tiled_loss", "--host-memory", "1e12"],
     "more GPUs (--nodes 2), a larger GPU, or the options --options leaves out (tiled_mlp, "
     "offload_activations, offload_optimizer)"),
    (["--network", "-1"], "--network -1.0 must be > 0"),
    (["--overhead", "-1"], "--overhead -1.0 must be >= 0"),
    (["--set", "memory.loss_tile_tokens=0"], "memory.loss_tile_tokens=0 must be 'auto' or"),
    (["--host-memory", "0", "--set", "memory.offload_activations=true"],
     "--host-memory 0: the config offloads (offload_activations)"),
    (["--max-seq-len", "--options", "tiled_logits"], "--options tiled_logits: unknown"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, msg, capsys):
    """In-process (the same main() tools/plan.py runs): no interpreter start per case."""
    from ctxpar.plan.__main__ import main
    assert main(["--config", os.path.join(ROOT, "configs", "gpt1b_32k_3d.yaml"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], lines


def test_cli_max_seq_len_ends_with_the_longest_line():
    """One GPU: a short search; the last line names the length and its layout, a multiple
    of the layout's chunks, and the breakdown above it says what fills the memory."""
    proc = plan_cli("--config", "configs/gpt1b_32k_3d.yaml", "--nodes", "1",
                    "--gpus-per-node", "1", "--max-seq-len", "--top", "3")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("longest seq_len: ") and " tokens (layout tp1 cp1 " in last, last
    n = int(last.split()[2].replace(",", ""))
    assert n > 32768 and n % 2 == 0, n  # past 32K; zigzag's 2 chunks even at cp 1
    assert "what fills it: " in proc.stdout and "memory per GPU" in proc.stdout
    from ctxpar.plan.longest import unit  # config.validate's rule, cp 1 included
    assert [unit(Candidate(1, cp, 1, 1, token_layout=tokens)) for cp, tokens in
            ((1, "zigzag"), (1, "contiguous"), (2, "zigzag"), (4, "striped"))] == [2, 1, 4, 4]
    # no row repeats another's length and layout at another tile size
    rows = [ln.split(" | ") for ln in proc.stdout.splitlines() if ln.startswith("| ")
            and ln[2:3].isdigit()]
    keys = [(r[2], re.sub(r"\(\d+\)", "", r[1])) for r in rows]
    assert len(rows) == 3 and len(set(keys)) == len(keys), rows


MISTRAL = ["model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
           "model.ffn_hidden=14336", "model.rope_theta=10000.0", "train.global_batch_size=1",
           "parallel.dp=1"]  # Mistral 7B v0.1's shapes on gpt1b's vocabulary and batch


def test_the_search_picks_contiguous_for_a_windowed_model_and_says_why():
    """A 4,096-token window on every layer: the halo (one neighbour's tail under
    contiguous, two under zigzag, whole blocks under striped) makes contiguous the
    fastest; without the window the same model's best ring is not contiguous (its causal
    work is unbalanced). The windowed layer's CP bytes do not grow with seq_len."""
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.report import layout_reason
    from ctxpar.plan.search import search
    from ctxpar.plan.timing import rank_pairs
    base = ["model.n_layers=2", "train.global_batch_size=1", "parallel.dp=1",
            "model.seq_len=262144"]
    cluster = Cluster(1, 2, gpu_preset("h100"))
    best, cfgs = {}, {}
    for window in (None, 4096):
        cfg = cfgs[window] = load_config(
            os.path.join(ROOT, "configs/gpt1b_32k_3d.yaml"),
            base + ([f"model.sliding_window={window}"] if window else []), check_paths=False)
        best[window] = next(p for p in search(cfg, cluster) if p.fits)
    assert best[None].candidate.cp == 2 and best[None].candidate.token_layout != "contiguous"
    cand = best[4096].candidate
    assert (cand.cp, cand.cp_comm, cand.token_layout) == (2, "ring", "contiguous"), cand
    assert layout_reason(cfgs[None], best[None]) == ""  # it speaks of windows only
    why = layout_reason(cfg, best[4096])
    assert why.startswith("token layout contiguous: 2 of 2 layers see a 4,096-token window")
    mb = [float(x.replace(",", "")) for x in re.findall(r"(\S+) MB \((?:halo|blocks)\)", why)]
    assert re.findall(r"MB \((\w+)\)", why) == ["halo", "halo", "blocks"], why
    assert mb[0] < mb[1] < mb[2], why  # contiguous < zigzag < striped
    # attention pairs about n w on the busiest rank, not n^2 / 2
    assert rank_pairs(262144, 2, "contiguous", 4096) == 131072 * 4096
    attn = layer_attention(cfg.model)[0]
    e, longer = 2, replace(cfg.model, seq_len=4 * 262144)
    assert comm_bytes.layer_cp_bytes(cfg.model, cand, e, attn) \
        == comm_bytes.layer_cp_bytes(longer, cand, e, attn)
    assert comm_bytes.layer_cp_bytes(cfg.model, cand, e) < comm_bytes.layer_cp_bytes(longer, cand, e)


def test_max_seq_len_of_a_windowed_mistral_exceeds_the_same_model_without_it():
    """--max-seq-len's search (ring, tiled loss and MLP, tp 1, pp 1 on 4 H100s): the
    window's halo holds a few thousand tokens' K,V where the ring holds two blocks, so a
    Mistral-like model with its 4,096-token window reaches further, under contiguous."""
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.longest import Allowed, search_longest
    allowed = Allowed(patterns=("ring",), options=("tiled_loss", "tiled_mlp"), tp=1, pp=1)
    longest = {}
    for extra in ([], ["model.sliding_window=4096"]):
        cfg = load_config(os.path.join(ROOT, "configs/gpt1b_32k_3d.yaml"), MISTRAL + extra,
                          check_paths=False)
        longest[bool(extra)] = search_longest(cfg, Cluster(1, 4, gpu_preset("h100")),
                                              allowed)[0]
    assert longest[True][0] > longest[False][0], (longest[True][:2], longest[False][:2])
    assert longest[True][1].token_layout == "contiguous", longest[True][1]


def test_longest_rows_keep_one_tile_size_per_layout_and_length():
    from ctxpar.plan.longest import merge_tiles
    a = Candidate(1, 8, 1, 1, "ulysses", 8, zero=3, tiled_mlp=True)
    rows = [(100, a, "m1"), (100, replace(a, loss_tile=4096), "m2"),
            (100, replace(a, zero=2), "m3"), (96, replace(a, mlp_tile=4096), "m4")]
    assert [m for _, _, m in merge_tiles(rows)] == ["m1", "m3", "m4"]


def test_plot_gives_each_term_its_colour_and_draws_the_device_lines():
    """The memory plot: distinct colours per term, lines at the device's memory and the
    planned 90%, and the tallest bar inside the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.report import plot_figure
    from ctxpar.plan.search import search
    cluster = Cluster(1, 8, gpu_preset("h100"))
    cfg = load_config(os.path.join(ROOT, "configs", "gpt1b_32k_3d.yaml"), check_paths=False)
    plans = [p for p in search(cfg, cluster) if p.fits][:8]
    fig = plot_figure(plans, cluster)
    mem_ax = fig.axes[0]
    handles, labels = mem_ax.get_legend_handles_labels()
    bars = [h for h in handles if hasattr(h, "patches")]
    colours = [tuple(b.patches[0].get_facecolor()) for b in bars]
    assert len(bars) >= 10 and len(set(colours)) == len(colours), labels
    lines = {ln.get_label(): ln.get_ydata()[0] for ln in mem_ax.get_lines()}
    assert lines == {"device memory (80 GB)": 80.0, "planned (90%: 72 GB)": 72.0}
    tallest = max(r.get_y() + r.get_height() for b in bars for r in b.patches)
    assert mem_ax.get_ylim()[1] >= max(tallest, 80.0)
    names = [t for t in fig.texts if "#1: " in t.get_text()]
    assert len(names) == 1 and names[0].get_fontsize() >= 9
    assert names[0].get_text().count("\n") == len(plans) - 1
    plt.close(fig)


# ------------------------------------------------------------------ train.py's start line


def test_startup_line_and_its_two_warnings():
    """What train.py prints on rank 0: memory per rank and, on a known device, tokens/s;
    a warning when the ring's chunk is below the F/B threshold of its link, and when the
    predicted memory exceeds the device's."""
    from ctxpar.plan.cluster import GPUS
    from ctxpar.plan.startup import preset_for, startup_report
    assert preset_for("NVIDIA H100 80GB HBM3") is GPUS["h100"]
    assert preset_for("NVIDIA H200") is GPUS["h200"] and preset_for("Tesla T4") is None

    one_node = load_config(os.path.join(ROOT, "configs", "gpt1b_32k_3d.yaml"), world_size=8,
                           check_paths=False)  # tp2 cp2 dp2: the ring stays on NVLink
    line, warns = startup_report(one_node, GPUS["h100"], "h100 preset", 1, 8)
    assert line.startswith("plan: tp2 cp2 ring") and "tokens/s" in line and "MFU" in line
    assert warns == []
    # tp4 x cp8 (order tp-cp-dp-pp): each ring spans 32 ranks, 4 nodes of 8, so its hops
    # cross InfiniBand, where MHA's zigzag half blocks hide K,V only from ~17.8K tokens
    # (at the planner's 45% attention efficiency) and the chunk is 131072 / 8 = 16,384.
    cfg = load_config(os.path.join(ROOT, "configs", "gpt7b_128k_3d.yaml"), world_size=64,
                      check_paths=False)
    line, warns = startup_report(cfg, GPUS["h100"], "h100 preset", 8, 8)
    assert len(warns) == 1 and "C = 16,384 tokens per step is below the 17,802" in warns[0]
    assert "network" in warns[0], warns
    # An 8 GB device: the layout's ~13.6 GB per rank no longer fits.
    small = GPUS["h100"].__class__("small", 989e12, 8e9, 450e9, 50e9)
    _, warns = startup_report(cfg, small, "small", 8, 8)
    assert any("exceeds the device's 8.0 GB" in w for w in warns), warns
    # An unknown device: memory only, and no warnings it could not stand behind.
    line, warns = startup_report(cfg, None, "Tesla T4", 8, 8)
    assert "GB per rank" in line and "no time prediction for Tesla T4" in line
    assert warns == []


QWEN35_LIKE = ["model.layer_types=[" + ",".join(
    (["linear_attention"] * 3 + ["full_attention"]) * 6) + "]",
    "model.linear_num_key_heads=16", "model.linear_num_value_heads=32",
    "model.linear_key_head_dim=128", "model.linear_value_head_dim=128",
    "model.attention_output_gate=true", "parallel.tp=1", "parallel.dp=1",
    "train.global_batch_size=4"]  # gpt1b's 24 layers as Qwen3.5's 3 GDN : 1 gated attention


def test_hybrids_and_gated_attention_get_a_prediction_and_unknown_layers_none():
    """Gated DeltaNet, KDA, Mamba2 and Nemotron-H's single-op blocks, and gated attention,
    are counted: every entry predicts them (train.py's start line, the search,
    --max-seq-len); a layer type the counts do not know is one PlanError line."""
    from ctxpar.plan.cluster import GPUS, Cluster, PlanError
    from ctxpar.plan.longest import Allowed, search_longest
    from ctxpar.plan.search import check_modelled, search
    from ctxpar.plan.startup import startup_report

    cluster = Cluster(1, 2, GPUS["h100"])
    for sets in (["model.n_layers=2", "model.layer_types=[mamba,full_attention]"],
                 ["model.attention_output_gate=true"]):
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), sets,
                          check_paths=False)
        line, _ = startup_report(cfg, GPUS["h100"], "h100 preset", 1, 2)
        assert "GB per rank" in line, line
        assert search(cfg, cluster)[0].fits
        assert search_longest(cfg, cluster, Allowed(patterns=("ring",), tp=1, pp=1))[0][0] > 0
    kda = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), [
        "model.n_layers=2", "model.layer_types=[kimi_delta_attention,full_attention]",
        "model.linear_num_key_heads=4"], check_paths=False)  # the search's code is shared
    assert "GB per rank" in startup_report(kda, GPUS["h100"], "h100 preset", 1, 2)[0]
    assert search(kda, cluster)[0].fits
    weird = replace(cfg, model=replace(cfg.model, n_layers=1, layer_types=["moe"]))
    with pytest.raises(PlanError, match=r"model.layer_types has \['moe'\] layers: the "
                       r"planner does not count them"):
        check_modelled(weird)


def test_the_search_picks_state_passing_for_a_hybrid_and_says_why():
    """A Qwen3.5-like hybrid (18 Gated DeltaNet, 6 gated attention layers) at 256K on 4
    H100s: the search weighs parallel.linear_cp and picks 'state' over CP, whose fp32
    summaries do not grow with seq_len, where heads' all-to-alls do; the report says so
    with both figures. The linear layers' compute is linear in n, the attention's not."""
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.linear_layers import linear_shapes, mixer_cp_bytes, mixer_flops
    from ctxpar.plan.report import linear_reason
    from ctxpar.plan.search import search
    cfg = load_config(os.path.join(ROOT, "configs/gpt1b_32k_3d.yaml"),
                      QWEN35_LIKE + ["model.seq_len=262144"], check_paths=False)
    plans = search(cfg, Cluster(1, 4, gpu_preset("h100")))
    assert {p.candidate.linear_cp for p in plans} == {"state", "heads"}
    best = next(p for p in plans if p.fits).candidate
    assert best.cp > 1 and best.linear_cp == "state", best
    fitting = [p.tokens_per_s_per_gpu for p in plans if p.fits]
    assert all(a >= b * 0.999 for a, b in zip(fitting, fitting[1:]))  # fastest (0.1%)
    why = linear_reason(cfg, next(p for p in plans if p.fits))
    assert why.startswith("parallel.linear_cp state: a rank sends per micro-batch 18 "
                          "linear_attention layers, each: state "), why
    state, heads = [float(x.replace(",", "")) for x in re.findall(r"(?:state|heads) (\S+) MB",
                                                                  why)]
    assert state < heads, why
    sh = linear_shapes(cfg.model, "linear_attention", 1)
    assert (sh.Hk, sh.Hv, sh.Dk, sh.Dv, sh.K, sh.C) == (16, 32, 128, 128, 4, 64)
    short, long_ = (mixer_cp_bytes("linear_attention", sh, 1, n, 2, 4, "state", "zigzag")
                    for n in (65536, 4 * 65536))
    assert short == long_  # state: independent of n
    a2a = [mixer_cp_bytes("linear_attention", sh, 1, n, 2, 4, "heads", "zigzag")[0]
           for n in (65536, 2 * 65536)]
    assert a2a[1] - 2 * a2a[0] == -mixer_cp_bytes("linear_attention", sh, 1, 0, 2, 4,
                                                  "heads", "zigzag")[0]  # affine: halo + n
    f1, f2 = (mixer_flops("linear_attention", sh, n, "state", 4) for n in (1000, 2000))
    assert f2 == 2 * f1


def test_the_search_ranks_slow_layouts_fastest_first_too():
    """18 and 22 tokens/s per GPU (a 70B at 4M tokens) are not a tie: equal speeds are
    within 0.1%, not within tens of tokens/s; ties go to the smaller peak."""
    from types import SimpleNamespace as NS
    from ctxpar.plan.search import rank
    plans = [NS(fits=True, tokens_per_s_per_gpu=t, memory=NS(peak=m), name=n)
             for t, m, n in [(18.0, 1, "slow"), (22.0, 2, "fast"), (5000.4, 9, "tie-more"),
                             (5001.9, 3, "tie-less"), (9e9, 0, "unfit")]]
    plans[-1].fits = False
    assert [p.name for p in sorted(plans, key=rank)] == [
        "tie-less", "tie-more", "fast", "slow", "unfit"]


@pytest.mark.parametrize("strategy,layout", [("heads", "zigzag"), ("state", "zigzag")])
def test_gpu_libraries_per_segment_hold_one_segment_beside_the_inputs_gradients(strategy,
                                                                              layout):
    """Qwen3.5-9B's GDN (16 key / 32 value heads of 128) and Nemotron-H-8B's Mamba2 in bf16
    on CUDA over cp 8: past one segment (2,048 tokens a kernel row) the libraries run per
    segment (gpu_kernels.py), so what their backward holds beyond the layer's saved set
    grows only by the inputs' gradients (linear_saved.*_kernel_inputs), and the layer
    saves the inputs and the states between segments; a row within one segment is one
    library call, its whole backward counted (fla_gdn_backward, mamba_ssm_backward)."""
    from ctxpar.plan import linear_saved as ls
    from ctxpar.plan.linear_layers import mixer_saved, mixer_working_set, segmented
    gdn = ls.GatedDeltaShapes(16, 32, 128, 128, 4, 64)
    mamba = ls.MambaShapes(128, 64, 128, 8, 4, 128)
    key = lambda sh: 16 if sh is gdn else 8  # noqa: E731 - the heads' replicated key heads
    for kind, sh, inputs in (("linear_attention", gdn, ls.gdn_kernel_inputs),
                             ("mamba", mamba, ls.mamba_kernel_inputs)):
        args = (2, 8, strategy, layout, "cuda")
        heads = key(sh) if strategy == "heads" else 0
        small, big, bigger = 128, 2 ** 19, 2 ** 20  # local tokens
        assert not segmented(sh, 1, small, 8, strategy, layout)
        assert segmented(sh, 1, big, 8, strategy, layout)
        grew = mixer_working_set(kind, sh, 1, bigger, *args) \
            - mixer_working_set(kind, sh, 1, big, *args)
        extra = 1 * (bigger - big) * sh.Hv * sh.Dk * 2 if (kind == "linear_attention"
                                                          and strategy == "state") else 0
        assert grew == inputs(1, bigger, sh, 2, heads) - inputs(1, big, sh, 2, heads) + extra
        whole = (ls.fla_gdn_backward if sh is gdn else ls.mamba_ssm_backward)
        if strategy == "heads":  # one call: its backward over the rank's tokens
            assert mixer_working_set(kind, sh, 1, small, *args) == whole(1, small, sh, 2)
        # per segment the layer saves the inputs, not the library's tensors
        per_token = mixer_saved(kind, sh, 1, bigger, *args) / bigger
        assert per_token < mixer_saved(kind, sh, 1, small, *args) / small


def test_max_seq_len_of_a_hybrid_is_bounded_by_its_linear_layers_replay():
    """--max-seq-len of the Qwen3.5-like hybrid on 4 H100s (ring, tiled loss and MLP):
    it has a longest context, a multiple of its layout's chunks, shorter than the same
    widths with attention in every layer: on H100s fla runs once per recompute segment
    (its backward's tensors are one segment's), but the replayed GDN block still saves its
    conv's input, the kernel's inputs, the gated norm's x and z and out_proj's input over
    the rank's whole sequence (linear_layers.mixer_saved) where attention keeps q, k, v
    and its output, so a GDN block's replay, not the K,V, is what fills the device."""
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.longest import Allowed, search_longest
    allowed = Allowed(patterns=("ring",), options=("tiled_loss", "tiled_mlp"), tp=1, pp=1)
    longest = {}
    for hybrid in (False, True):
        sets = QWEN35_LIKE if hybrid else QWEN35_LIKE[-4:]
        cfg = load_config(os.path.join(ROOT, "configs/gpt1b_32k_3d.yaml"), sets,
                          check_paths=False)
        longest[hybrid] = search_longest(cfg, Cluster(1, 4, gpu_preset("h100")), allowed)[0]
    n, cand, mem = longest[True]
    assert 0 < n < longest[False][0] and n % (2 * cand.cp) == 0, (n, cand)
    assert cand.cp == 4 and cand.activation == "full", cand


# ------------------------------------------------------------------ tools/plot_runs.py


def _plot(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_runs.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=120)


def test_plot_runs_draws_curves_and_refuses_bad_input(tmp_path):
    import json
    runs = []
    for name, acc in (("a", True), ("b", False)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for step in range(1, 41):
                f.write(json.dumps({"step": step, "loss": 4.0 / step ** 0.5,
                                    "tokens_per_s": 1000.0 + step}) + "\n")
                if step % 10 == 0:
                    row = {"step": step, "eval_loss": 3.0 / step ** 0.5}
                    if acc:
                        row["eval_accuracy"] = step / 40
                    f.write(json.dumps(row) + "\n")
        runs.append(d)
    out = tmp_path / "c.png"
    proc = _plot(*runs, "--labels", "zigzag", "striped", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000
    for args, msg in (([runs[0], "--labels", "x", "y"], "--labels: 2 given for 1 runs"),
                      ([tmp_path / "nope"], "no such file")):
        proc = _plot(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and msg in lines[0], proc.stderr


@pytest.mark.quick
@pytest.mark.parametrize("dtype,limit,mlp", [
    (torch.float32, None, "swiglu"), (torch.bfloat16, None, "swiglu"),
    (torch.float32, 0.5, "swiglu"), (torch.float32, None, "gelu"),
    (torch.bfloat16, None, "relu2")])
def test_tiled_mlp_backward_term_against_live_bytes(dtype, limit, mlp):
    # transients.mlp_backward against the live bytes of the Function's backward (one
    # process), eight tiles and one: the tile's saved intermediates and its (t, d) output,
    # dx, the fp32 sums, and at down's backward its input's gradient and weight's tile
    # gradient, at the activation's its gradients (mlp_widths.py); one tile makes the sums
    # as it goes. Measured equal; 1% allowed. Charging the tile gradient beside the
    # activation's gradients overshoots by one (d, f) weight (+3%), clamped
    # (model.swiglu_limit) without the clamps' two inputs it falls 16% short.
    from ctxpar.testing.memory import LiveBytes
    from ctxpar.memory.tiled_mlp import TiledMLP
    from ctxpar.plan import transients
    N, d, f = 2048, 128, 512
    gated = mlp == "swiglu"
    for tile in (256, N):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, d, dtype=dtype, generator=g, requires_grad=True)
        ws = [torch.randn(*shape, dtype=dtype, generator=g, requires_grad=True)
              for shape in ((f, d),) * (2 if gated else 1) + ((d, f),)]
        y = TiledMLP.apply(x, tile, None, ws[0] if gated else None, None, ws[-2], None,
                           ws[-1], mlp, limit)
        dy = torch.randn_like(y)
        live = LiveBytes()
        with live:
            torch.autograd.grad(y, [x] + ws, dy)
        s = counts.RankShapes(N=N, B=1, T=N, d=d, h=1, hk=1, hd=d, f=f, V=1, L=1, tp=1)
        e = torch.tensor([], dtype=dtype).element_size()
        predicted = transients.mlp_backward(s, mlp, e, tile, len(ws) * f * d, f * d,
                                            0 if limit is None else 2)
        assert abs(predicted / live.peak - 1) < 0.01, (tile, predicted, live.peak)


def test_the_model_checks_itself_against_the_description():
    # models/gpt.py and the planner read one description (ctxpar/config/parameters.py): a
    # parameter the description lacks, or a config whose shapes differ, fails loudly.
    from ctxpar.config.parameters import check_parameters
    from models.gpt import GPT
    m = ModelConfig(**CFG)
    model = GPT(m, device="meta")
    check_parameters(model.named_parameters(), m, 1)
    with pytest.raises(AssertionError, match="ffn|mlp"):
        check_parameters(model.named_parameters(), ModelConfig(**CFG, ffn_hidden=96), 1)
    model.layers[0].mlp.extra = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.extra"):
        check_parameters(model.named_parameters(), m, 1)


def test_block_fields_are_all_block_specs_reads():
    # The planner caches block_specs by block_fields: a field outside the key must not
    # change a block's parameters.
    import dataclasses
    from ctxpar.config.mtp import MTPConfig
    from ctxpar.config.parameters import block_fields, block_specs
    m = ModelConfig(**CFG)
    other = dict(vocab_size=128, seq_len=64, n_layers=5, norm_eps=1e-6, rope_theta=5e5,
                 rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_embeddings=False,
                 init_std=0.01, init_from="elsewhere", norm_offset=1.0, scale_embeddings=True,
                 query_pre_attn_scalar=8.0, family="qwen2", sliding_window=16,
                 attention_chunk_size=32, layer_types=["full_attention"] * CFG["n_layers"],
                 layer_rope={"full_attention": {"rope_theta": 100.0}}, linear_chunk_size=16,
                 time_step_min=0.01, time_step_max=0.2, time_step_floor=1e-3,
                 partial_rotary_factor=0.5, rope=False, linear_allow_neg_eigval=True,
                 linear_norm_eps=1e-5, nope_layers=[0], attn_temperature_tuning=True,
                 floor_scale=4, attn_scale=0.2, qk_l2_norm=True, mtp=MTPConfig(depth=1),
                 attention_value_scale=0.7, value_norm=True, layer_scalar=True,
                 final_logit_softcapping=30.0, swiglu_limit=10.0)
    for f in dataclasses.fields(ModelConfig):
        changed = dataclasses.replace(m, **{f.name: other[f.name]}) if f.name in other else None
        if changed is not None:
            assert block_fields(changed) == block_fields(m), f.name
            assert block_specs(changed) == block_specs(m), f.name
    assert set(other) | {"d_model", "n_heads", "n_kv_heads", "ffn_hidden", "mlp", "norm",
                         "bias", "attention_bias", "qk_norm", "head_dim", "post_norms",
                         "attention_sinks", "attention_output_gate", "qk_norm_scope",
                         "reordered_norms", "linear_num_key_heads", "linear_num_value_heads",
                         "linear_key_head_dim", "linear_value_head_dim",
                         "linear_conv_kernel_dim", "mamba_num_heads", "mamba_head_dim",
                         "ssm_state_size", "n_groups", "conv_kernel", "use_conv_bias", "moe",
                         "mla", "layer_kv_heads", "v_head_dim", "global_head_dim",
                         "global_n_kv_heads", "attention_k_eq_v", "num_kv_shared_layers",
                         "per_layer_input_dim", "dsa", "double_wide_mlp", "hyper_connections",
                         "compressed_attention"} == \
        {f.name for f in dataclasses.fields(ModelConfig)}


@pytest.mark.quick
def test_on_a_machine_without_cuda_the_default_h100_is_said_and_cpu_is_in_gflops(
        monkeypatch, capsys):
    """--gpu left out plans for H100s, which on a CPU machine is said on stderr with the
    flags that plan for the machine; the cpu preset's 113 GFLOP/s core is not '0 TFLOP/s'."""
    from ctxpar.plan.__main__ import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tiny = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
    assert main(["--config", tiny, "--gpus-per-node", "2", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert "on 1 x 2 h100 (989 TFLOP/s," in out.out
    note = out.err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("note: planning for 2 h100 per node "
                                                 "(--gpu's default)") \
        and "--gpu cpu --gpus-per-node " in note[0], note
    assert main(["--config", tiny, "--gpu", "cpu", "--gpus-per-node", "2", "--top", "1"]) == 0
    out = capsys.readouterr()
    assert "on 1 x 2 cpu (113 GFLOP/s," in out.out and out.err == ""


def test_longest_search_with_top_finds_the_full_searchs_first_rows():
    """--max-seq-len bisects only the layouts that could reach its table (search_longest's
    top): its rows are the full search's first ones, and it skipped some."""
    from ctxpar.plan.cluster import Cluster, gpu_preset
    from ctxpar.plan.longest import Allowed, merge_tiles, search_longest
    cfg = load_config(os.path.join(ROOT, "configs/gpt1b_32k_3d.yaml"), check_paths=False)
    cluster = Cluster(1, 4, gpu_preset("h100"))
    allowed = Allowed(patterns=("ring", "ulysses"), options=("tiled_loss",), tp=1, pp=1)
    full = search_longest(cfg, cluster, allowed)
    some = search_longest(cfg, cluster, allowed, top=3)
    rows = lambda found: [(n, cand) for n, cand, _ in merge_tiles(found)[:3]]
    assert rows(some) == rows(full), (rows(some), rows(full))
    assert some.fitting == full.fitting == len(full) > len(some), (len(full), len(some))
