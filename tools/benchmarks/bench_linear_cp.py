"""A Gated DeltaNet, a KDA and a Mamba2 layer over CP: state passing against the heads
all-to-all and against one process, with the bytes each sends.

Per (mixer, n) this spawns P local ranks (ctxpar/testing/distributed.py: gloo on CPU) that
hold the same layer (models/gated_delta.py's GatedDeltaNet, models/kda.py's
KimiDeltaAttention, models/mamba2.py's Mamba2: the projections, the causal conv with its
halo, the chunked kernel, the gated norm) and time,
in turn within every iteration so that a change of load hits all alike (attention_timing.
timed):
    state   parallel.linear_cp=state: each rank's (M, E) summary all-gathered in fp32
    heads   parallel.linear_cp=heads: all-to-all sequence <-> heads around the kernel
    one     the same layer in one process over all n tokens (no group)
    ratio   (per-rank fwd+bwd time, slowest rank) / (one / P): 1.0 = perfect scaling
Every rank runs `one` too, at the same time as its peers, so the ideal is measured under
the same sharing of the machine's cores as the ranks (P ranks on 2 cores: each runs at
about half speed, ideal and ranks alike). Before timing, each rank checks that both
strategies give its tokens the one-process output and input gradient (largest
difference reported). Bytes are this rank's, forward + backward (cp_stats): for state
they are the summaries' (summary_bytes) plus the conv halo's, the same at every n.

    python -m tools.benchmarks.bench_linear_cp --seq-len 8192 32768 --world-size 4
    python -m tools.benchmarks.bench_linear_cp --mixers kda --seq-len 32768
"""
from __future__ import annotations

import argparse
import zlib

import torch

from ctxpar.config import ModelConfig
from ctxpar.config.layers import gated_delta_dims, mamba_dims
from ctxpar.context_parallel import LOCAL, ContextParallel, cp_stats
from ctxpar.context_parallel.layouts import shard_sequence
from ctxpar.context_parallel.linear import summary_bytes
from ctxpar.testing import run_distributed, save_results
from models.gated_delta import GatedDeltaNet, init_gated_delta
from models.gpt import init_default
from models.kda import KimiDeltaAttention, init_kda
from models.mamba2 import Mamba2, init_mamba2
from tools.benchmarks.attention_timing import STATS, timed

MIXERS = {  # mixer -> (module, its init, layer type, the block's attribute)
    "gated_delta": (GatedDeltaNet, init_gated_delta, "linear_attention", "linear_attn"),
    "kda": (KimiDeltaAttention, init_kda, "kimi_delta_attention", "kda"),
    "mamba2": (Mamba2, init_mamba2, "mamba", "mamba")}


def model_config(a, mixer: str, n: int) -> ModelConfig:
    """One layer of Qwen3.5's GDN (key heads half the value heads), Kimi Linear's KDA
    (ungrouped) or Nemotron-H's Mamba2 shape, scaled to a CPU."""
    key_heads = a.heads if mixer == "kda" else a.heads // 2
    return ModelConfig(vocab_size=256, seq_len=n, d_model=a.d_model, n_layers=1,
                       n_heads=4, layer_types=[MIXERS[mixer][2]], linear_chunk_size=64,
                       linear_num_key_heads=key_heads, linear_num_value_heads=a.heads,
                       linear_key_head_dim=a.head_dim, linear_value_head_dim=a.head_dim,
                       mamba_num_heads=a.heads, mamba_head_dim=a.head_dim,
                       ssm_state_size=a.head_dim, n_groups=1)


def make_layer(cfg: ModelConfig, mixer: str, cp: ContextParallel, strategy: str):
    cls, init, _, attribute = MIXERS[mixer]
    layer = cls(cfg, cp, strategy)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # every rank alike
            full = init(f"layers.0.{attribute}.{name}", p.shape, cfg, g)
            p.copy_(full if full is not None else init_default(name, p.shape, cfg, g))
    return layer


def _rank_main(rank, world, a, mixer, n) -> dict:
    cfg = model_config(a, mixer, n)
    layers = {s: make_layer(cfg, mixer, ContextParallel(layout="contiguous"), s)
              for s in ("state", "heads")}
    one = make_layer(cfg, mixer, ContextParallel(cp_group=LOCAL), "state")
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(1, n, a.d_model, generator=g)
    dy_full = torch.randn(1, n, a.d_model, generator=g)
    x = shard_sequence(x_full, 1).clone().requires_grad_()
    dy = shard_sequence(dy_full, 1)
    xf = x_full.clone().requires_grad_()

    def fwd_bwd(layer, inp, grad):
        inp.grad = None
        layer.zero_grad(set_to_none=True)
        layer(inp).backward(grad)

    # each strategy gives this rank's tokens the one-process output and input gradient
    y_one = one(xf)
    y_one.backward(dy_full)
    want_y = shard_sequence(y_one.detach(), 1)
    want_dx = shard_sequence(xf.grad, 1)
    diff, stats = 0.0, {}
    for s, layer in layers.items():
        x.grad = None
        with cp_stats() as st:
            y = layer(x)
            y.backward(dy)
        stats[s] = st.fwd_bytes_sent + st.bwd_bytes_sent
        diff = max(diff, (y.detach() - want_y).abs().max().item(),
                   (x.grad - want_dx).abs().max().item())
    fns = {s: (lambda layer=layer: fwd_bwd(layer, x, dy)) for s, layer in layers.items()}
    fns["one"] = lambda: fwd_bwd(one, xf, dy_full)
    t = timed(fns, torch.device("cpu"), a.iters, a.warmup, stat=STATS[a.stat])
    return dict(time_s=t, bytes=stats, max_diff=diff)


def expected_state_bytes(a, mixer: str, world: int) -> int:
    """summary_bytes of the layer's kernel, forward + backward (the conv halo aside)."""
    cfg = model_config(a, mixer, world)
    if mixer in ("gated_delta", "kda"):
        d = gated_delta_dims(cfg)
        heads, state = d.num_value_heads, (d.key_head_dim, d.value_head_dim)
    else:
        d = mamba_dims(cfg)
        heads, state = d.num_heads, (d.head_dim, d.state_size)
    kernel = "ssd" if mixer == "mamba2" else mixer
    return 2 * summary_bytes(1, heads, state, "contiguous", world, kernel)


def run(a, mixer: str, n: int) -> dict:
    P = a.world_size
    ranks = run_distributed(_rank_main, P, a, mixer, n, timeout=a.timeout, threads=1)
    ideal = sum(r["time_s"]["one"] for r in ranks) / len(ranks) / P
    row = dict(mixer=mixer, n=n, P=P, ideal_ms=1e3 * ideal,
               max_diff=max(r["max_diff"] for r in ranks),
               summary_bytes=expected_state_bytes(a, mixer, P))
    for s in ("state", "heads"):
        worst = max(r["time_s"][s] for r in ranks)
        row[f"{s}_ms"], row[f"{s}_ratio"] = 1e3 * worst, worst / ideal
        row[f"{s}_bytes"] = max(r["bytes"][s] for r in ranks)
    return row


def _table(rows) -> str:
    lines = ["| layer | n | P | ideal ms (one/P) | state ms | ratio | heads ms | ratio | "
             "state bytes/rank | of which summaries | heads bytes/rank | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['mixer']} | {r['n']} | {r['P']} | {r['ideal_ms']:.0f} | "
            f"{r['state_ms']:.0f} | {r['state_ratio']:.3f} | {r['heads_ms']:.0f} | "
            f"{r['heads_ratio']:.3f} | {r['state_bytes']:,} | {r['summary_bytes']:,} | "
            f"{r['heads_bytes']:,} | {r['max_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768], help="total n")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mixers", nargs="+", choices=sorted(MIXERS), default=sorted(MIXERS))
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="value heads (GDN: key heads half;"
                   " KDA: as many), and Mamba2 heads")
    p.add_argument("--head-dim", type=int, default=32, help="and Mamba2's state size")
    p.add_argument("--iters", type=int, default=6, help="a multiple of 6: every order of "
                   "the three fns once (attention_timing.timed)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--stat", choices=sorted(STATS), default="median")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default="runs/bench_linear_cp.json", help="output file")
    a = p.parse_args(argv)
    rows = []
    for mixer in a.mixers:
        by_n = []
        for n in a.seq_len:
            rows.append(run(a, mixer, n))
            by_n.append(rows[-1])
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
        # state passing's bytes: the summaries plus the conv halo, the same at every n
        assert len({r["state_bytes"] for r in by_n}) == 1, [r["state_bytes"] for r in by_n]
        assert all(r["state_bytes"] >= r["summary_bytes"] for r in by_n), by_n
    print(_table(rows))
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
