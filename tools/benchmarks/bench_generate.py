"""Benchmark CP generation: prefill and decode speed, KV-cache bytes, bytes per decode step.

For every prompt length n and CP degree P, P local ranks (gloo on CPU, NCCL on GPUs)
build the same random GPT and generate --new-tokens greedy tokens for one prompt of n
random tokens (ctxpar.inference.generate: ring prefill into a CP-sharded KV cache, then
decode steps merged over CP). Per rank it records:
    prefill     seconds to the first new token: n / that = prefill tokens/s
    decode      seconds of the decode steps after it: steps * batch / that = decode tokens/s
    KV bytes    this rank's cache (keys and values of every layer): ~1/P of P = 1's
    bytes/step  what the decode merges moved into this rank per step, measured by the
                cache's counters, next to the formula: per layer P - 1 partials of
                B * H * (D + 1) fp32 values (ctxpar/inference/decode.py)
One untimed warmup generation (a short prompt) runs first on every rank.

    python -m tools.benchmarks.bench_generate --seq-len 4096 8192 16384 32768 --cp 1 2 4
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ctxpar.config import ModelConfig
from ctxpar.inference import decode_bytes_per_step, generate
from ctxpar.testing import run_distributed, save_results
from models.gpt import GPT
from models.options import ModelGroups, ModelOptions


def _model_config(a, n: int) -> ModelConfig:
    return ModelConfig(vocab_size=256, seq_len=n + a.new_tokens, n_layers=a.layers,
                       d_model=a.d_model, n_heads=a.heads, n_kv_heads=a.kv_heads)


def _rank_main(rank, world, device, a, n) -> dict:
    group = dist.group.WORLD
    model = GPT(_model_config(a, n), ModelGroups(cp_group=group), ModelOptions(layout=a.layout),
                device=device).eval()
    g = torch.Generator().manual_seed(0)  # the same prompt on every rank
    prompts = torch.randint(1, 256, (a.batch, n), generator=g).tolist()
    kw = dict(layout=a.layout, cp_group=group)
    generate(model, [p[:256] for p in prompts], 4, **kw)  # warmup
    out = generate(model, prompts, a.new_tokens, **kw)
    return dict(prefill_s=out.prefill_s, decode_s=out.decode_s, decode_steps=out.decode_steps,
                kv_bytes=out.cache.nbytes(), bytes_recv=out.cache.stats.bytes_recv,
                calls=out.cache.stats.calls)


def run(a, n: int, world: int) -> dict:
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    ranks = run_distributed(_rank_main, world, torch.device(a.device), a, n, timeout=a.timeout,
                            device_type=a.device, threads=threads)
    steps = ranks[0]["decode_steps"]
    prefill, decode = max(r["prefill_s"] for r in ranks), max(r["decode_s"] for r in ranks)
    formula = decode_bytes_per_step(a.layers, a.batch, a.heads, a.d_model // a.heads, world)
    return dict(n=n, P=world, threads_per_rank=threads, prefill_s=prefill,
                prefill_tok_s=a.batch * n / prefill, decode_ms_per_step=1e3 * decode / steps,
                decode_tok_s=a.batch * steps / decode,
                kv_mib_per_rank=max(r["kv_bytes"] for r in ranks) / 2**20,
                bytes_per_step=max(r["bytes_recv"] for r in ranks) / steps,
                bytes_per_step_formula=formula,
                merges_per_step=ranks[0]["calls"] / steps, per_rank=ranks)


def _table(rows) -> str:
    lines = ["| n | P | prefill s | prefill tok/s | decode ms/token | decode tok/s | "
             "KV MiB/rank | vs P=1 | bytes/step (measured) | formula |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["n"]: r["kv_mib_per_rank"] for r in rows if r["P"] == 1}
    for r in rows:
        ratio = f"{r['kv_mib_per_rank'] / base[r['n']]:.3f}" if r["n"] in base else ""
        lines.append(f"| {r['n']} | {r['P']} | {r['prefill_s']:.2f} | "
                     f"{r['prefill_tok_s']:,.0f} | {r['decode_ms_per_step']:.1f} | "
                     f"{r['decode_tok_s']:.1f} | {r['kv_mib_per_rank']:.2f} | {ratio} | "
                     f"{r['bytes_per_step']:,.0f} | {r['bytes_per_step_formula']:,} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="prompt lengths n")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layout", choices=["contiguous", "zigzag", "striped"], default="zigzag")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads per rank (0: cores / P, the same cores for every P)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default="runs/bench_generate.json", help="output file")
    a = p.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < max(a.cp):
        p.error("CUDA needs one GPU per rank")
    rows = []
    for n in a.seq_len:
        for world in a.cp:
            rows.append(run(a, n, world))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print(_table(rows))
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
