"""The tiled MLP (ctxpar/memory/tiled_mlp.py) against the untiled one.

Single process: output and the gradients of x and of every weight, SwiGLU and GELU, with
biases, tile sizes dividing the tokens and not, 'auto'; the GPT under every checkpointing
mode; a dispatch mode that fails if the (tokens, ffn) intermediate is ever made whole.
Two spawned ranks (one spawn): TP=2 against one process, with one all-reduce per layer
forward and one backward whatever the tile count; then ZeRO-3 (dp2, every parameter
partitioned, full checkpointing: the block's replay and the tiles' recompute both run
in backward; activation offload on) with the two ranks using different tile counts (3 and
'auto'), against one process: a collective that depended on the tile count would hang it.

Tolerances, fp32: a tile computes each token's row with the same dot products as the
whole matmul, but the weights' gradients are sums over tokens split into per-tile partial
sums (and BLAS may block a smaller matmul differently), a reordering of N = 48 terms whose
rounding error is up to ~N * eps (1.2e-7) times the largest term, so an entry that
cancels to near zero can differ by ~1e-6 of the tensor's scale: rtol 1e-5 and atol 1e-5
of the reference's largest entry (``close``).
"""
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ctxpar.config import MemoryConfig, ModelConfig
from ctxpar.memory.tiled_mlp import mlp_tile_tokens, tile_spans
from ctxpar.testing import run_distributed
from models.gpt import GPT
from models.mlp import MLP
from models.options import ModelGroups, ModelOptions

def close(got, want, msg=""):
    """assert_close with atol scaled to the reference (module docstring)."""
    atol = 1e-5 * max(want.abs().max().item(), 1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{msg}: {m}")
D, FFN, B, T = 16, 64, 2, 24  # 48 tokens


def _cfg(mlp="swiglu", **kw):
    return ModelConfig(vocab_size=64, seq_len=T, n_layers=2, d_model=D, n_heads=2,
                       mlp=mlp, ffn_hidden=FFN, **kw)


def _mlp_run(mlp: str, tile, tp_group=None, full=None, x=None, dy=None):
    """Output, dx and each weight's full-size gradient of an MLP holding ``full``'s weights."""
    from ctxpar.tensor_parallel import shard_full_tensor
    from ctxpar.tensor_parallel.utils import gather_full_tensor
    m = MLP(_cfg(mlp, bias=True), tp_group, tile_tokens=tile)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(shard_full_tensor(full[n], p, tp_group))
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(dy)
    grads = {n: gather_full_tensor(p.grad, p, tp_group) for n, p in m.named_parameters()}
    return y.detach(), x.grad, grads


def _data(mlp: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ref = MLP(_cfg(mlp, bias=True), None)
    full = {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in ref.named_parameters()}
    return full, torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def test_auto_tile_rule():
    # Equal tiles of about max(d, 512) tokens (ALST's d, with a 512-token floor).
    assert mlp_tile_tokens(8192, 256, 4096, "auto") == 512  # 16 tiles (ALST: 32 of 256)
    assert mlp_tile_tokens(8192, 512, 4096, "auto") == 512  # ALST's own: ceil(8192/512) = 16
    assert mlp_tile_tokens(1000, 256, 1000, "auto") == 500  # ceil(1000/512) = 2 tiles
    assert mlp_tile_tokens(300, 256, 1000, "auto") == 300  # shorter than the floor: one
    t = mlp_tile_tokens(131072, 4096, 14336, "auto")  # Llama-3-8B at tp 1: 32 tiles
    assert t == 4096 and t * 14336 <= 4096 * 14336
    assert mlp_tile_tokens(131072, 4096, 14336 // 8, "auto") == 4096  # independent of tp
    assert mlp_tile_tokens(48, 16, 64, 7) == 7 and mlp_tile_tokens(48, 16, 64, 100) == 48
    assert tile_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]  # the last tile holds the rest


@pytest.mark.quick
@pytest.mark.parametrize("mlp", ["swiglu", "geglu", "gelu", "relu2"])
def test_tiled_equals_untiled(mlp):
    full, x, dy = _data(mlp)
    y0, dx0, g0 = _mlp_run(mlp, None, full=full, x=x, dy=dy)
    for tile in (7, 16, 48, "auto"):  # 7 leaves a 6-token tile; 16 divides 48; 48: one tile
        y, dx, g = _mlp_run(mlp, tile, full=full, x=x, dy=dy)
        close(y, y0, f"{tile} y")
        close(dx, dx0, f"{tile} dx")
        assert set(g) == set(g0) == {n for n in full}
        for n in g0:
            close(g[n], g0[n], f"{tile} {n}")


def test_bf16_weight_grads_summed_in_fp32():
    # Eight tiles in bf16: the weights' gradients are summed over tiles in fp32, so they are
    # as close to the fp64 truth as the untiled bf16 GEMM's (within 2x), not 8 roundings off.
    full, x, dy = _data("swiglu", seed=1)
    x, dy = torch.randn(B, 64, D), torch.randn(B, 64, D)

    def run(tile, dtype):
        m = MLP(_cfg(), None, tile_tokens=tile).to(dtype)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(full[n])
        m(x.to(dtype)).backward(dy.to(dtype))
        return {n: p.grad.double() for n, p in m.named_parameters()}

    exact, untiled, tiled = run(None, torch.float64), run(None, torch.bfloat16), run(16, torch.bfloat16)
    for n in exact:
        err_tiled = (tiled[n] - exact[n]).abs().max()
        err_untiled = (untiled[n] - exact[n]).abs().max()
        assert err_tiled <= 2 * err_untiled + 1e-6, (n, err_tiled, err_untiled)


class NeverWhole(TorchDispatchMode):
    """Fails on any op that produces a tensor with at least tokens * ffn elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.largest = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.limit:
                    raise AssertionError(f"{func} made {tuple(t.shape)}: an MLP intermediate whole")
        return out


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_intermediate_never_whole(mlp):
    full, x, dy = _data(mlp)
    limit = B * T * FFN  # the (tokens, ffn) intermediate; weights are ffn * d < that
    with NeverWhole(limit) as mode:
        _mlp_run(mlp, 16, full=full, x=x, dy=dy)
    assert mode.largest == 16 * FFN  # one tile's intermediate, forward and backward
    with pytest.raises(AssertionError, match="intermediate whole"):  # the check can fail
        with NeverWhole(limit):
            _mlp_run(mlp, None, full=full, x=x, dy=dy)


@pytest.mark.parametrize("mode", ["none", "selective", "full", "every_n_layers"])
def test_gpt_every_checkpointing_mode(mode):
    cfg = _cfg(n_kv_heads=1)
    g = torch.Generator().manual_seed(2)
    tokens, labels = (torch.randint(0, 64, (B, T), generator=g) for _ in range(2))
    out = {}
    for tiled in (False, True):
        model = GPT(cfg,
                    options=ModelOptions(activation_checkpointing=mode, every_n_layers=2,
                                         memory=MemoryConfig(tiled_mlp=tiled, mlp_tile_tokens=5),
                                         seed=5))
        loss = model(tokens, torch.arange(T), labels)
        loss.backward()
        out[tiled] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    close(out[True][0], out[False][0], f"{mode} loss")
    for n, g0 in out[False][1].items():
        close(out[True][1][n], g0, f"{mode} {n}")


# ------------------------------------------------------------- two ranks: TP=2, ZeRO-3

ZERO_CFG = dict(vocab_size=64, seq_len=16, n_layers=2, d_model=16, n_heads=2, ffn_hidden=64)
ZERO_BATCH = 4


def _two_ranks(rank, world, payload):
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from ctxpar import DeepSpeedMPU, init_parallel_state
    from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
    from ctxpar.memory import tiled_mlp as tm
    from ctxpar.distributed.zero import grad_divisor, partition_for_zero3
    from models.loss import global_token_count, loss_for_backward

    tp_cases, zero_cases = pickle.loads(payload)
    calls = []
    reduce = tm.dist.all_reduce
    tm.dist.all_reduce = lambda t, **kw: (calls.append(tuple(t.shape)), reduce(t, **kw))[1]
    tp_out = []
    for mlp, tile, full, x, dy in tp_cases:  # the world is the TP group
        calls.clear()
        tp_out.append((_mlp_run(mlp, tile, dist.group.WORLD, full, x, dy), list(calls)))
    tm.dist.all_reduce = reduce

    init_deepspeed_comm()
    zero_out = []
    for ckpt, tokens, labels in zero_cases:
        st = init_parallel_state(tp=1, cp=1)  # dp 2
        # Each rank its own tile count: collectives must not depend on it (ZeRO-3 leaf).
        memory = MemoryConfig(tiled_mlp=True, mlp_tile_tokens=(3, "auto")[rank],
                              offload_activations=True)
        model = GPT(ModelConfig(**ZERO_CFG), ModelGroups(cp_group=st.cp_group),
                    ModelOptions(activation_checkpointing=ckpt, memory=memory, seed=3))
        model.offload.min_bytes = 0  # offload too: this small model is under the 64 KiB floor
        ds = {"train_batch_size": ZERO_BATCH, "train_micro_batch_size_per_gpu": ZERO_BATCH // 2,
              "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10 ** 9, "gradient_clipping": 0.0}
        partition_for_zero3(model, st, ds)
        assert all(p.ds_tensor.numel() < p.ds_numel for p in model.parameters())  # split
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds,
                                          mpu=DeepSpeedMPU(st))
        rows = slice(rank * ZERO_BATCH // 2, (rank + 1) * ZERO_BATCH // 2)
        lab = labels[rows]
        n = global_token_count(lab, st.dp_cp_group)
        pos = torch.arange(ZERO_CFG["seq_len"])
        engine.backward(loss_for_backward(engine(tokens[rows], pos, lab), n,
                                          grad_divisor(st, ds)))
        zero_out.append(({name: safe_get_full_grad(p).clone()
                          for name, p in engine.module.named_parameters()},
                         model.offload.peak_host_bytes))
        engine.step()
        engine.destroy()
    return tp_out, zero_out


def test_peak_at_most_deepspeeds_at_equal_tiles():
    # tools/benchmarks/bench_alst.py's contenders: ctxpar's tiled MLP and DeepSpeed's TiledMLP, both at
    # 4 tiles of 128 tokens, results asserted equal there. Each tile's weight gradient joins
    # its sum as soon as it is made, so at most one tile's is alive beside the sums, as
    # DeepSpeed's accumulation into .grad.
    from tools.benchmarks.bench_alst import mlp_contenders, peaks
    peak = peaks(mlp_contenders(512, 32, 128, (4,), untiled=True))
    assert peak["ctxpar (tile 128)"] <= peak["DeepSpeed (4 shards, equal)"], peak


def test_tp2_and_zero3_on_two_ranks():
    tp_cases = []
    for mlp in ("swiglu", "gelu"):
        full, x, dy = _data(mlp, seed=3)
        tp_cases += [(mlp, tile, full, x, dy) for tile in (7, "auto")]
    g = torch.Generator().manual_seed(4)
    tokens, labels = (torch.randint(0, 64, (ZERO_BATCH, ZERO_CFG["seq_len"]), generator=g)
                      for _ in range(2))
    zero_cases = [("full", tokens, labels)]  # ~10 s per DeepSpeed engine on 2 cores
    res = run_distributed(_two_ranks, 2, pickle.dumps((tp_cases, zero_cases)), timeout=240)

    for i, (mlp, tile, full, x, dy) in enumerate(tp_cases):
        want = _mlp_run(mlp, None, full=full, x=x, dy=dy)
        for rank in range(2):
            (y, dx, grads), calls = res[rank][0][i]
            # One (N, d) all-reduce forward (g) and one backward (f), not one per tile.
            assert calls == [(B * T, D), (B * T, D)], (mlp, tile, calls)
            close(y, want[0], f"tp2 {mlp} {tile} y")
            close(dx, want[1], f"tp2 {mlp} {tile} dx")
            for n, g0 in want[2].items():
                close(grads[n], g0, f"tp2 {mlp} {tile} {n}")

    for i, (ckpt, tokens, labels) in enumerate(zero_cases):
        ref = GPT(ModelConfig(**ZERO_CFG),
                  options=ModelOptions(activation_checkpointing=ckpt, seed=3))
        loss = ref(tokens, torch.arange(ZERO_CFG["seq_len"]), labels) / labels.numel()
        loss.backward()
        for rank in range(2):
            got, offloaded = res[rank][1][i]
            assert offloaded == 2 * ZERO_BATCH // 2 * ZERO_CFG["seq_len"] * 16 * 4  # 2 inputs
            assert set(got) == {n for n, _ in ref.named_parameters()}
            for n, p in ref.named_parameters():
                close(got[n], p.grad, f"zero3 {ckpt} rank {rank} {n}")
