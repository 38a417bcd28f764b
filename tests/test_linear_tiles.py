"""Tiled linear blocks (memory.tiled_linear; ctxpar/context_parallel/linear/tiles.py).

(1) One process: a hybrid GPT whose Gated DeltaNet, Mamba2 or KDA blocks run in tiles
gives the untiled GPT's loss and every parameter's gradient, with packed documents
(starts mid-tile, on a tile's first token, one-token documents), tiles of three chunks
and of five (a short last tile). (2) Two ranks, 'state' strategy: cp2 contiguous and
zigzag with documents crossing ranks, recompute 'full', tp2, and ZeRO-3 (DeepSpeed's
engine, every parameter partitioned): the tiled GPT equals the untiled one process. (3) What one tiled GDN layer's forward saves: its input and each
tile's entering (state, conv tail), nothing else. (4) The refusals' one line. (5) bf16:
as close to fp32 as the untiled bf16 GPT.

Tolerance: the tiles run the kernels' own chunks from the same states, so outputs agree
to the last bit on one process (measured: losses equal, gradients within 5e-7 of their
scale: parameter gradients are summed per tile); over CP the state comes from state
passing's composition instead of LASP-2's correction, ~1e-6. 1e-5 of the scale is the
bound, tests/test_hybrid_gpt.py's. Checked by hand to fail: the conv tail not carried
into a tile (every parity test), the tail handed on unmasked at a document start (two
of the four), the CP incoming state not reset where a rank starts a document (cp2), the
tiled mixer not a ZeRO-3 leaf (the ZeRO-3 case: DeepSpeed's hooks meet the detached
parameters ChunkedScan's backward swaps in). ZeRO-3 sets its persistence threshold to 0:
at the default every parameter of these models stays whole and the case proves nothing.
"""
import dataclasses
import pickle

import pytest
import torch

from ctxpar.config import ConfigError, MemoryConfig, config_from_dict
from ctxpar.testing import run_distributed
from ctxpar.testing.batches import random_batch
from ctxpar.testing.linear import (GDN_MAMBA_CONFIG, HYBRID_CONFIGS, KIMI_LINEAR_CONFIG,
                                   documents)
from ctxpar.testing.memory import saved_tensor_bytes
from ctxpar.tensor_parallel import gather_full_state_dict
from models.gpt import GPT
from models.loss import global_mean_loss, global_token_count, loss_for_backward
from models.options import ModelGroups, ModelOptions

N, BATCH, SEED = 48, 2, 5
CONFIGS = {**HYBRID_CONFIGS, "kimi-linear": KIMI_LINEAR_CONFIG,  # linear chunks of 4
           "gdn+mamba2": GDN_MAMBA_CONFIG}
DOCS = documents(N)


def close(got, want, msg=""):
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5, msg=msg)


def _options(tile: int, **kw) -> ModelOptions:
    mem = MemoryConfig(tiled_linear=bool(tile), linear_tile_tokens=tile or 2048)
    return ModelOptions(seed=SEED, memory=mem, **kw)


def one_process(name, cu, tile=0, dtype=torch.float32):
    """Token-mean loss and every gradient (fp32 copies) of the GPT on one process."""
    cfg = CONFIGS[name]
    model = GPT(cfg, options=_options(tile)).to(dtype)
    tokens, labels = random_batch(cfg.vocab_size, BATCH, N)
    loss = model(tokens, torch.arange(N), labels, cu_seqlens=cu) / (labels != -100).sum()
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def _assert_same(got, want, where):
    close(got[0], want[0], f"{where} loss")
    for n, g in want[1].items():
        close(got[1][n], g, f"{where} grad {n}")


@pytest.mark.quick
def test_tiled_gated_delta_gpt_equals_the_untiled_one():
    """Qwen3.5's pattern with documents, tiles of 12 tokens (three chunks; documents start
    mid-tile, on a tile's first token (12, 36), and one is a single token)."""
    _assert_same(one_process("qwen3.5", DOCS, tile=12), one_process("qwen3.5", DOCS), "")


@pytest.mark.parametrize("name", ["nemotron-h", "kimi-linear"])
def test_tiled_mamba2_and_kda_gpts_equal_the_untiled_ones(name):
    """Mamba2 (conv bias, B/C groups, D) and KDA (a decay per key channel) with
    documents, tiles of five chunks (a short last tile)."""
    _assert_same(one_process(name, DOCS, 20), one_process(name, DOCS), name)


def test_tiled_bf16_gpt_is_as_close_to_fp32_as_the_untiled_bf16_one():
    """bf16 parameters and activations (states and tails fp32, the weights' gradients
    summed over tiles in fp32): the tiled loss and every gradient within 4 x max(untiled
    bf16's distance to fp32, 2^-8 of the fp32 scale) of the untiled bf16 GPT's, the bound
    of tests/test_hybrid_gpt.py's bf16 cases."""
    loss32, grads32 = one_process("qwen3.5", DOCS)
    loss16, grads16 = one_process("qwen3.5", DOCS, dtype=torch.bfloat16)
    tiled_loss, tiled = one_process("qwen3.5", DOCS, 12, torch.bfloat16)
    assert (tiled_loss - loss16).abs() <= 4 * max((loss16 - loss32).abs().item(),
                                                  2 ** -8 * loss32.abs().item())
    for n, g32 in grads32.items():
        scale = max((grads16[n] - g32).abs().max().item(), 2 ** -8 * g32.abs().max().item())
        assert (tiled[n] - grads16[n]).abs().max().item() <= 4 * scale, n


def _zero3_engine(model, st):
    """DeepSpeed's ZeRO-3 engine over model, every parameter partitioned over dp x cp
    (persistence threshold 0: the default keeps those < 1e5 elements whole, never gathered
    by ZeRO-3's hooks), and its ds config."""
    import deepspeed
    from ctxpar import DeepSpeedMPU
    from ctxpar.distributed.zero import partition_for_zero3

    ds = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH,
          "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    partition_for_zero3(model, st, ds)
    engine, *_ = deepspeed.initialize(model=model, config=ds, mpu=DeepSpeedMPU(st),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0))
    return engine, ds


def _over_cp(rank, world, payload):
    from deepspeed.utils import safe_get_full_grad
    from ctxpar import init_parallel_state, sequence_positions, shard_sequence
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.distributed.zero import grad_divisor
    from models.loss import deepspeed_style_reduce_

    init_deepspeed_comm()
    out = []
    for name, tp, layout, cu, tile, ckpt, zero3 in pickle.loads(payload):
        cfg = CONFIGS[name]
        st = init_parallel_state(tp=tp, cp=world // tp, dp=1)
        model = GPT(cfg, ModelGroups.from_state(st),
                    _options(tile, layout=layout, activation_checkpointing=ckpt))
        tokens, labels = random_batch(cfg.vocab_size, BATCH, N)
        tok, lab = (shard_sequence(t, 1, st.cp_group, layout) for t in (tokens, labels))
        n_tokens = global_token_count(lab, st.dp_cp_group)
        pos = sequence_positions(N, st.cp_group, layout)
        if zero3:  # gradients reduce-scattered by DeepSpeed, gathered whole to compare
            engine, ds = _zero3_engine(model, st)
            loss_sum = engine(tok, pos, lab, cu_seqlens=cu)
            engine.backward(loss_for_backward(loss_sum, n_tokens, grad_divisor(st, ds)))
            grads = {n: safe_get_full_grad(p).clone()
                     for n, p in engine.module.named_parameters()}
            engine.destroy()
        else:
            loss_sum = model(tok, pos, lab, cu_seqlens=cu)
            loss_for_backward(loss_sum, n_tokens, st.dp_size).backward()
            deepspeed_style_reduce_(model.parameters(), st.dp_cp_group, st.dp_size)
            grads = gather_full_state_dict(model, st.tp_group, grads=True)
        out.append((global_mean_loss(loss_sum.detach(), n_tokens, st.dp_cp_group), grads))
    return out


CP_CASES = [  # (config, tp, layout, cu_seqlens, tile, recompute, ZeRO-3): 2 ranks, 'state'
    ("qwen3.5", 1, "contiguous", DOCS, 4, "none", False),  # cp2: six tiles a rank
    ("kimi-linear", 1, "zigzag", DOCS, 8, "none", False),  # two segments a rank, a short
    #                                                        last tile in each
    ("qwen3.5", 2, "zigzag", DOCS, 12, "none", False),     # tp2: heads split, out_proj's
    #                                                        all-reduce and the norm's f per tile
    ("gdn+mamba2", 1, "zigzag", DOCS, 8, "full", True),    # ZeRO-3 (below), both mixin
]                                                          # families replayed under 'full'


def test_tiled_hybrid_gpts_over_cp_equal_one_process():
    """The CP cases, the last in DeepSpeed's ZeRO-3 engine with every parameter
    partitioned over the two ranks: the tiled mixer is a ZeRO-3 leaf (models/linear_tiles.py
    set_tile), so its parameters are gathered around its forward and its backward, where
    the tiles and ChunkedScan's recomputation call its modules, and each gradient is
    reduced once, summed over tiles."""
    results = run_distributed(_over_cp, 2, pickle.dumps(CP_CASES), timeout=240)
    for i, (name, tp, layout, cu, tile, ckpt, zero3) in enumerate(CP_CASES):
        want = one_process(name, cu)
        for rank, got in enumerate(results):
            _assert_same(got[i], want, f"{name} tp{tp} cp{2 // tp} {layout} docs="
                                       f"{cu is not None} tile {tile} {ckpt} zero3={zero3} "
                                       f"rank {rank}")


def test_a_tiled_gated_delta_layer_saves_its_input_and_the_tile_states_only():
    """One GDN mixer, 64 tokens in tiles of 16: saved are x (B, T, d) and the three
    entering (state, tail) rows, (B, Hv Dk Dv + (K-1) C) fp32, nothing of the tiles."""
    cfg = CONFIGS["qwen3.5"]
    mixer = GPT(dataclasses.replace(cfg, seq_len=64), options=_options(16)).layers[0].linear_attn
    x = torch.randn(BATCH, 64, cfg.d_model, requires_grad=True)
    with saved_tensor_bytes(mixer.parameters()) as seen:
        y = mixer(x)
    (state, channels, kernel) = mixer.tile_shapes()
    per_row = state[0] * state[1] * state[2] + (kernel - 1) * channels
    assert sum(seen.values()) == x.numel() * 4 + 3 * BATCH * per_row * 4, seen
    y.sum().backward()


LINEAR = {"vocab_size": 256, "seq_len": 128, "n_layers": 2, "d_model": 32, "n_heads": 4,
          "layer_types": ["linear_attention", "full_attention"], "linear_chunk_size": 8}


@pytest.mark.parametrize("parallel, memory, extra, message", [
    ({}, {"linear_tile_tokens": 12}, {},
     "memory.linear_tile_tokens=12 must be a positive multiple of the linear chunk size 8"),
    ({"cp": 2, "linear_cp": "heads", "layout": "striped"}, {}, {},
     "memory.tiled_linear=true is not built with parallel.linear_cp='heads' at "
     "parallel.cp=2"),
])
def test_tiled_linear_refusals_are_one_line(parallel, memory, extra, message):
    d = {"model": LINEAR, "parallel": {"dp": 1, **parallel},
         "train": {"global_batch_size": 1}, "memory": {"tiled_linear": True, **memory},
         **extra}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d, check_paths=False)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
