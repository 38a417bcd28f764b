"""One Gated DeltaNet block's step on CPU: the autograd torch kernel, the lean one, lean + tiles.

    PYTHONPATH=. python tools/benchmarks/bench_linear_lean.py [--seq 16384] [--heads 8]
        [--checkpointing full] [--kernels today tiles]

A one-layer GPT whose layer is Gated DeltaNet (Qwen3.5's head dims: value and key heads
of 128, two value heads per key head, conv 4, chunk 64; --heads value heads, d_model
1024, a 256-token vocabulary so that the block, not the head, is the step), fp32, under
--checkpointing (default none; 'full': the block replayed in backward, the recompute the
tiles are built for, so every kernel runs its forward again), one sample of --seq tokens. For each kernel: the CPU allocator's peak above
the model state in the forward and in the backward (the profiler's allocation events, as
tests/test_plan.py's peak tests read them) and the step's time (the median of --repeat
after a warm step); for the lean kernel also the planner's prediction of both peaks
(stage_memory, the same model and mode, device 'cpu'). "today" is gated_delta_fp32 under
autograd (what the torch kernel was before lean.py); "lean" is lean.gated_delta_lean,
segments of lean.SEGMENT_CHUNKS chunks; "tiles" is the lean kernel with the block tiled
(memory.tiled_linear, tiles of --tile tokens: context_parallel/linear/tiles.py), with the
planner's prediction of it too. Results: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from ctxpar.config import Config, MemoryConfig, ModelConfig
from ctxpar.context_parallel.linear import kernels
from ctxpar.context_parallel.linear.gated_delta import gated_delta_fp32
from ctxpar.plan.candidate import Candidate
from ctxpar.plan.memory import stage_memory
from ctxpar.plan.zero_state import zero_config
from ctxpar.testing.memory import allocator_peaks
from models.gpt import GPT
from models.options import ModelOptions


def today(q, k, v, g, beta, scale, initial_state, seq_idx, chunk_size, l2norm, segments):
    """The kernel as it was: gated_delta_fp32 under autograd (segments ignored)."""
    return gated_delta_fp32(q, k, v, g, beta, scale, initial_state, seq_idx, chunk_size, l2norm)


def predicted(cfg: ModelConfig, tile: int = 0, mode: str = "none",
              tiled_mlp: bool = False) -> dict:
    c = Config()
    c.model, c.activation_checkpointing.mode = cfg, mode
    cand = Candidate(1, 1, 1, 1, zero=0, activation=mode, linear_tile=tile,
                     tiled_mlp=tiled_mlp, mlp_tile=tile if tiled_mlp else 0)
    phases = stage_memory(c, cand, False, 1, 0, "cpu", zero_config({})).phases
    state = phases[-1].terms["params"] + phases[-1].terms["optimizer"]
    return {region: max(p.total for p in phases if p.name.startswith(prefix)) - state
            for region, prefix in (("FWD", "forward"), ("BWD", "backward"))}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8, help="value heads (key heads: half)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tile", type=int, default=2048, help="tokens per tile of the block")
    p.add_argument("--checkpointing", default="none", choices=("none", "full"))
    p.add_argument("--tiled-mlp", action="store_true",
                   help="the tiles row tiles the block's MLP too (memory.tiled_mlp, the "
                        "same tile): the whole block, conv, mixer, gated norm and MLP")
    p.add_argument("--kernels", nargs="+", default=["today", "lean", "tiles"],
                   choices=("today", "lean", "tiles"), help="the rows to run")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, seq_len=a.seq, n_layers=1, d_model=1024, n_heads=8,
                      n_kv_heads=8, ffn_hidden=1024, layer_types=["linear_attention"],
                      linear_num_key_heads=a.heads // 2, linear_num_value_heads=a.heads,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_chunk_size=64)
    untiled = GPT(cfg, options=ModelOptions(activation_checkpointing=a.checkpointing, seed=1))
    tiled = GPT(cfg, options=ModelOptions(activation_checkpointing=a.checkpointing, seed=1,
                                          memory=MemoryConfig(tiled_linear=True,
                                                              linear_tile_tokens=a.tile,
                                                              tiled_mlp=a.tiled_mlp,
                                                              mlp_tile_tokens=a.tile)))
    tok, pos = torch.randint(0, 256, (1, a.seq)), torch.arange(a.seq)
    model = untiled

    def step(region):
        with region("FWD"):
            loss = model(tok, pos, tok)
        with region("BWD"):
            loss.backward()
        model.zero_grad(set_to_none=True)

    def nothing(name):
        return torch.autograd.profiler.record_function(name)
    rows = {}
    for name in a.kernels:
        model = tiled if name == "tiles" else untiled
        with mock.patch.object(kernels, "gated_delta_lean", today) if name == "today" \
                else mock.patch.object(kernels, "gated_delta_lean", kernels.gated_delta_lean):
            step(nothing)  # warm
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                step(nothing)
                times.append(time.perf_counter() - t0)
            rows[name] = (allocator_peaks(step), statistics.median(times))
    want = {"lean": predicted(cfg, 0, a.checkpointing),
            "tiles": predicted(cfg, a.tile, a.checkpointing, a.tiled_mlp)}
    print(f"one GDN block, T={a.seq}, {a.heads} value heads of 128, fp32, checkpointing "
          f"{a.checkpointing}, tiles of {a.tile}{' (the MLP too)' if a.tiled_mlp else ''}")
    print("| kernel | forward peak | backward peak | step time | planner forward | "
          "planner backward |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (peaks, t) in rows.items():
        w = want.get(name)
        pred = (f"{w['FWD'] / 1e6:,.0f} MB ({w['FWD'] / peaks['FWD'] - 1:+.1%}) | "
                f"{w['BWD'] / 1e6:,.0f} MB ({w['BWD'] / peaks['BWD'] - 1:+.1%})"
                if w else "- | -")
        print(f"| {name} | {peaks['FWD'] / 1e6:,.0f} MB | {peaks['BWD'] / 1e6:,.0f} MB | "
              f"{t:.2f} s | {pred} |")
    t = rows.get("today")
    for name in [n for n in ("lean", "tiles") if n in rows and t]:
        r = rows[name]
        print(f"{name} / today: peak {max(r[0].values()) / max(t[0].values()):.2f}x, "
              f"time {r[1] / t[1]:.2f}x")


if __name__ == "__main__":
    main()
