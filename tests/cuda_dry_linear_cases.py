"""The linear mixers' CUDA path on fake CUDA tensors (run by tests/test_cuda_dry.py).

Gated DeltaNet, KDA, Mamba2's SSD and the short conv in bf16 on device "cuda", through the
GPU libraries' stand-ins (tests/cuda_dry_linear.py: real signatures, their kernels' input
rules enforced, every call recorded): on one rank and on every rank of a simulated 4-rank
group (comm.NoComm), state passing and heads, with and without documents, forward and
backward; and a hybrid GPT (Qwen3.5's, Nemotron-H's and Kimi Linear's tiny ones) forward
and backward.
Each case asserts that the library kernels ran and the torch kernels did not, the
arguments ctxpar passed (initial state, final state asked for, cu_seqlens int32 on the
device with its host copy, seq_idx int32, the conv's channel-last layout), gradients on
CUDA, and no host sync.
"""
import logging
import os

import pytest
import torch

import cuda_dry as dry

if dry.private_api_problem():
    raise RuntimeError(dry.private_api_problem())
if not os.environ.get("CTXPAR_FAKE_CUDA_LIBRARY"):
    raise RuntimeError("tests/cuda_dry_linear_cases.py runs in the fake-CUDA process: "
                       "python tests/fake_cuda.py [-k EXPR], or tests/test_cuda_dry.py")

import cuda_dry_linear as lin  # noqa: E402
from ctxpar.context_parallel import LOCAL, NoComm  # noqa: E402
from ctxpar.context_parallel.linear import (causal_conv1d_cp, gated_delta_rule_cp,  # noqa: E402
                                            kda_cp, kernels, ssd_cp)

BF16, FP32 = torch.bfloat16, torch.float32
P, S = 4, 8  # simulated ranks, tokens per rank
RUNS = [("state", "contiguous"), ("state", "zigzag"), ("heads", "zigzag"),
        ("heads", "striped")]


def rand(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()


def docs(n):
    """Host int32 boundaries per sample (as the loader gives them), crossing ranks."""
    return [torch.tensor([0, 1, n // 2 + 1, n - 1, n], dtype=torch.int32),
            torch.tensor([0, n // 2 + 1, n], dtype=torch.int32)]


def groups():
    yield LOCAL
    for rank in range(P):
        yield NoComm(rank, P)


def check_grads(inputs, grads):
    for x, g in zip(inputs, grads):
        assert g is not None and g.shape == x.shape and g.device.type == "cuda", x.shape


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("strategy,layout", RUNS)
def test_gated_delta_runs_fla(strategy, layout, documents, monkeypatch):
    """GVA (Hk 2, Hv 4), Dk 16, Dv 8: fla with the initial state and the final state asked
    for; documents as cu_seqlens int32 on the device over the rows flattened to one, its
    host copy as cu_seqlens_cpu; state passing widens v to Dk + Dv."""
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        for group in groups():
            n = S * group.world_size
            q, k = rand(2, S, 2, 16), rand(2, S, 2, 16)
            v, beta, g = rand(2, S, 4, 8), rand(2, S, 4), rand(2, S, 4, dtype=FP32)
            h0 = rand(2, 4, 16, 8, dtype=FP32)
            start = len(lin.CALLS)
            o, final = gated_delta_rule_cp(
                q, k, v, g, beta, cp_group=group, layout=layout, strategy=strategy,
                initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=docs(n) if documents else None, chunk_size=4)
            assert o.shape == v.shape and o.dtype == BF16 and final.shape == h0.shape
            grads = torch.autograd.grad((o.float().sum() + final.sum()), (q, k, v, g, beta, h0))
            check_grads((q, k, v, g, beta, h0), grads)
            (call,) = lin.CALLS[start:]
            a = call.args
            assert call.library == "fla" and a["output_final_state"] and a["l2norm"]
            wide = group.world_size > 1 and strategy == "state"
            assert a["v"][0][-1] == (16 + 8 if wide else 8), a["v"]
            assert a["initial_state"] is not None and a["initial_state"][1] == FP32
            if documents:
                assert a["q"][0][0] == 1 and a["cu_seqlens"][1:] == (torch.int32, "cuda")
                assert a["cu_seqlens_cpu"][1:] == (torch.int32, "cpu")
            else:
                assert a["cu_seqlens"] is None
        assert mode.host_syncs == 0


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("strategy,layout", RUNS)
def test_kda_runs_fla_chunk_kda(strategy, layout, documents, monkeypatch):
    """KDA, GVA (Hk 2, Hv 4), Dk 16, Dv 8, g (B, T, Hv, Dk) fp32: fla's chunk_kda with the
    gate computed outside it (use_gate_in_kernel off, no chunk_size passed: its 64), the
    initial state fp32 and the final state asked for, documents as for Gated DeltaNet;
    state passing widens v to Dk + Dv."""
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        for group in groups():
            n = S * group.world_size
            q, k = rand(2, S, 2, 16), rand(2, S, 2, 16)
            v, beta, g = rand(2, S, 4, 8), rand(2, S, 4), rand(2, S, 4, 16, dtype=FP32)
            h0 = rand(2, 4, 16, 8, dtype=FP32)
            start = len(lin.CALLS)
            o, final = kda_cp(q, k, v, g, beta, cp_group=group, layout=layout,
                              strategy=strategy, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True,
                              cu_seqlens=docs(n) if documents else None, chunk_size=4)
            assert o.shape == v.shape and o.dtype == BF16 and final.shape == h0.shape
            grads = torch.autograd.grad((o.float().sum() + final.sum()), (q, k, v, g, beta, h0))
            check_grads((q, k, v, g, beta, h0), grads)
            (call,) = lin.CALLS[start:]
            a = call.args
            assert call.library == "fla_kda" and a["output_final_state"] and a["l2norm"]
            assert not a["gate_in_kernel"] and a["kwargs"] == [] and a["g"][1] == FP32
            wide = group.world_size > 1 and strategy == "state"
            assert a["v"][0][-1] == (16 + 8 if wide else 8), a["v"]
            assert a["initial_state"] is not None and a["initial_state"][1] == FP32
            if documents:
                assert a["q"][0][0] == 1 and a["cu_seqlens"][1:] == (torch.int32, "cuda")
                assert a["cu_seqlens_cpu"][1:] == (torch.int32, "cpu")
            else:
                assert a["cu_seqlens"] is None
        assert mode.host_syncs == 0


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("strategy,layout", RUNS)
def test_ssd_runs_mamba(strategy, layout, documents, monkeypatch):
    """Mamba2 (H 4, P 8, G 2, N 16): mamba_chunk_scan_combined on dt already through
    dt_bias and softplus (fp32), the final states asked for, the initial states on one
    rank and the heads strategy (state passing runs its segments from zero), documents as
    seq_idx (b, T) int32 on the device."""
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        for group in groups():
            n = S * group.world_size
            x, dt = rand(2, S, 4, 8), rand(2, S, 4, dtype=FP32)
            B, C = rand(2, S, 2, 16), rand(2, S, 2, 16)
            A, D, dt_bias = rand(4, dtype=FP32), rand(4), rand(4)
            h0 = rand(2, 4, 8, 16, dtype=FP32)
            start = len(lin.CALLS)
            y, final = ssd_cp(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias,
                              dt_softplus=True, initial_states=h0, return_final_states=True,
                              cp_group=group, layout=layout, strategy=strategy,
                              cu_seqlens=docs(n) if documents else None)
            assert y.shape == x.shape and y.dtype == BF16 and final.shape == h0.shape
            leaves = (x, dt, A, B, C, D, dt_bias, h0)
            check_grads(leaves, torch.autograd.grad(y.float().sum() + final.sum(), leaves))
            (call,) = lin.CALLS[start:]
            a = call.args
            assert call.library == "mamba_ssm" and a["return_final_states"]
            assert a["dt"][1] == FP32 and not a["dt_softplus"]
            from_zero = group.world_size > 1 and strategy == "state"
            assert (a["initial_states"] is None) == from_zero, a
            assert a["seq_idx"] == ((a["x"][0][:2], torch.int32, "cuda") if documents
                                    else None)
        assert mode.host_syncs == 0


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_conv_runs_causal_conv1d_channel_last(layout, documents, monkeypatch):
    """The conv (K 4, 24 channels, bias, silu) on causal_conv1d_fn: x channel-last, the
    halo before each run of positions, seq_idx (B, E) int32 with documents; on one
    process the rows themselves (no copy)."""
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        for group in groups():
            n = S * group.world_size
            x, w, b = rand(2, S, 24), rand(24, 4), rand(24)
            start = len(lin.CALLS)
            out = causal_conv1d_cp(x, w, b, activation="silu", cp_group=group, layout=layout,
                                   cu_seqlens=docs(n) if documents else None)
            assert out.shape == x.shape and out.dtype == BF16
            check_grads((x, w, b), torch.autograd.grad(out.float().sum(), (x, w, b)))
            (call,) = lin.CALLS[start:]
            a = call.args
            assert a["x_stride"][1] == 1 and a["activation"] == "silu"
            if group.world_size == 1:
                assert a["x"][0] == (2, 24, S)  # the rows as they are
            E = a["x"][0][2]
            assert a["seq_idx"] == (((2, E), torch.int32, "cuda") if documents else None)
        assert mode.host_syncs == 0


@pytest.mark.parametrize("family", ["qwen3.5", "nemotron-h", "kimi-linear"])
def test_hybrid_gpt_bf16_forward_backward(family, monkeypatch):
    """A tiny hybrid GPT in bf16 on CUDA with documents, forward to the loss and backward:
    every linear layer on the libraries (the torch kernels refuse to run), attention on
    sdpa's flash op, a gradient for every parameter, no host sync."""
    from ctxpar.testing.linear import HYBRID_CONFIGS, KIMI_LINEAR_CONFIG
    from models.gpt import GPT
    cfg = {**HYBRID_CONFIGS, "kimi-linear": KIMI_LINEAR_CONFIG}[family]
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        model = GPT(cfg, device="cuda", dtype=BF16)
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), device="cuda")
        loss = model(tokens, torch.arange(cfg.seq_len, device="cuda"), tokens.roll(-1, 1),
                     cu_seqlens=docs(cfg.seq_len))
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, name
        mixers = sum(t in ("linear_attention", "kimi_delta_attention", "mamba")
                     for t in cfg.layer_types)
        ran = [c.library for c in lin.CALLS]
        mixer = {"qwen3.5": "fla", "kimi-linear": "fla_kda"}.get(family, "mamba_ssm")
        assert ran.count(mixer) == mixers and ran.count("causal_conv1d") == mixers, ran
        assert mode.host_syncs == 0


@pytest.mark.parametrize("mixer,strategy,layout", [
    ("gdn", "state", "contiguous"), ("kda", "heads", "zigzag"), ("ssd", "heads", "zigzag")])
def test_libraries_run_per_recompute_segment(mixer, strategy, layout, monkeypatch):
    """recompute_chunks=1 (segments of one chunk, 4 tokens): each library is called once
    per segment in forward (the first from the initial state or none, the next ones from
    the fp32 state handed on, the final state always asked for, documents per segment as
    cu_seqlens with its host copy or as seq_idx) and once per segment again in backward
    (lean.ChunkedScan); gradients on CUDA, no host sync. One process and every rank of 4."""
    library = {"gdn": "fla", "kda": "fla_kda", "ssd": "mamba_ssm"}[mixer]
    with dry.fake_cuda(monkeypatch) as mode:
        lin.install(monkeypatch)
        for group in groups():
            P_ = group.world_size
            n = S * P_
            cp = dict(cp_group=group, layout=layout, strategy=strategy, cu_seqlens=docs(n),
                      chunk_size=4, recompute_chunks=1)
            start = len(lin.CALLS)
            if mixer == "ssd":
                x, dt, B, C = rand(2, S, 4, 8), rand(2, S, 4, dtype=FP32), rand(2, S, 2, 16), \
                    rand(2, S, 2, 16)
                A, D, h0 = rand(4, dtype=FP32), rand(4), rand(2, 4, 8, 16, dtype=FP32)
                y, final = ssd_cp(x, dt, A, B, C, D=D, initial_states=h0,
                                  return_final_states=True, **cp)
                leaves = (x, dt, A, B, C, D, h0)
            else:
                q, k, v = rand(2, S, 2, 16), rand(2, S, 2, 16), rand(2, S, 4, 8)
                g = rand(2, S, 4, *((16,) if mixer == "kda" else ()), dtype=FP32)
                beta, h0 = rand(2, S, 4), rand(2, 4, 16, 8, dtype=FP32)
                op = kda_cp if mixer == "kda" else gated_delta_rule_cp
                y, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **cp)
                leaves = (q, k, v, g, beta, h0)
            forward = list(lin.CALLS[start:])
            check_grads(leaves, torch.autograd.grad(y.float().sum() + final.sum(), leaves))
            backward = lin.CALLS[start + len(forward):]
            tokens = n if strategy == "heads" else S  # the kernel's per row
            assert len(forward) == len(backward) == tokens // 4, (len(forward), len(backward))
            L = len(forward)  # backward recomputes the segments last to first
            for i, call in enumerate(forward + list(backward)):
                a, segment = call.args, (i if i < L else 2 * L - 1 - i)
                assert call.library == library and a.get("output_final_state",
                                                          a.get("return_final_states"))
                state = a.get("initial_state", a.get("initial_states"))
                if segment:  # a later segment: the state handed on, fp32
                    assert state is not None and state[1] == FP32, (i, a)
                if mixer == "ssd":
                    assert a["seq_idx"] == (((2, 4), torch.int32, "cuda")), a
                else:
                    assert a["cu_seqlens"][1:] == (torch.int32, "cuda")
                    assert a["cu_seqlens_cpu"][1:] == (torch.int32, "cpu") and a["q"][0][1] == 8
        assert mode.host_syncs == 0


def test_fp32_stays_on_the_torch_kernel_and_says_so(monkeypatch, caplog):
    """fp32 on CUDA: auto passes fla over (its Triton dots would round to TF32) with the
    reason in the log line, and the torch kernel runs on the device without a sync."""
    with dry.fake_cuda(monkeypatch) as mode:
        from ctxpar.context_parallel.linear import gpu_kernels
        monkeypatch.setitem(kernels.KERNELS["gated_delta"], "fla",
                            gpu_kernels.FlaGatedDelta(lin.chunk_gated_delta_rule))
        kernels._LOGGED.clear()
        q, k, v = rand(1, S, 2, 16, dtype=FP32), rand(1, S, 2, 16, dtype=FP32), \
            rand(1, S, 2, 8, dtype=FP32)
        with caplog.at_level(logging.INFO, logger=kernels.__name__):
            o, _ = gated_delta_rule_cp(q, k, v, rand(1, S, 2, dtype=FP32),
                                       rand(1, S, 2, dtype=FP32), chunk_size=4)
        assert o.device.type == "cuda" and o.dtype == FP32
        assert "gated_delta auto -> torch for cuda float32 (fla: needs float16/bfloat16)" in \
            caplog.text
        assert mode.host_syncs == 0
