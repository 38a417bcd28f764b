"""MLA over the ring: the latent ring (latent_attention) against the ring of expanded K,V.

P local ranks (gloo on CPU), one causal fwd+bwd per pattern per iteration, both on the
same inputs (each rank's q, latent, kv_b weight, dout; the expanded K,V made from them
once, outside the timing), taking turns (attention_timing.timed):

    latent     latent_attention(comm="ring"): latent blocks (R + dr a token) travel and are
               expanded per block; backward re-expands and sends the latent's fp32 gradient
    expanded   context_parallel_attention(comm="ring") on k (H, dn + dr) and v (H, dv)
               zero-padded to dn + dr (the CPU kernel wants one head dim, and a ring of
               expanded K,V would send what its kernel takes)
    one / P    one process over all n tokens (latent_attention with no group: one fused
               call on the expanded K,V), timed on rank 0 alone after the ranks are done,
               divided by P: the ideal a rank's share would cost

Reported per pattern: wall time per rank (max over ranks; --stat over --iters), MiB sent
per rank forward and backward (cp_stats), MiB autograd saves on a rank.

    python -m tools.benchmarks.bench_latent_ring --seq-len 8192 --world-size 4 --heads 16
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctxpar.context_parallel import LOCAL, context_parallel_attention, cp_stats
from ctxpar.context_parallel.latent import LatentDims, expand_latent
from ctxpar.context_parallel.latent_api import latent_attention
from ctxpar.testing import run_distributed, save_results
from ctxpar.testing.memory import saved_tensor_bytes
from tools.benchmarks.attention_timing import DTYPES, STATS, timed

MiB = 2 ** 20


def _inputs(a, dims, seq, seed):
    """q (B, seq, H, dqk), latent (B, seq, R + dr), W, dout (B, seq, H, dv) in a's dtype."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[a.dtype]
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    q = mk(a.batch, seq, a.heads, dims.qk_head_dim)
    latent = mk(a.batch, seq, dims.latent_dim)
    weight = (mk(a.heads * dims.kv_b_rows_per_head, dims.kv_lora_rank)
              * dims.kv_lora_rank ** -0.5).to(dtype)
    return q, latent, weight, mk(a.batch, seq, a.heads, dims.v_head_dim)


def _latent_fn(q, latent, weight, dout, dims, a, group):
    leaves = [x.detach().requires_grad_() for x in (q, latent, weight)]

    def run():
        out = latent_attention(*leaves, dims, comm="ring", cp_group=group, causal=True,
                               layout=a.layout, backend=a.backend)
        out.backward(dout)
    return run, leaves[2]


def _expanded_fn(q, latent, weight, dout, dims, a, group):
    with torch.no_grad():
        k, v = expand_latent(latent, weight, dims)
        pad = dims.qk_head_dim - dims.v_head_dim
        v = F.pad(v, (0, pad))
    leaves = [x.contiguous().requires_grad_() for x in (q.detach(), k, v)]
    dout = F.pad(dout, (0, pad))

    def run():
        out = context_parallel_attention(*leaves, comm="ring", cp_group=group, causal=True,
                                         layout=a.layout, backend=a.backend)
        out.backward(dout)
    return run, None


def _rank(rank, world, a) -> dict:
    dims = LatentDims(a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim)
    inputs = _inputs(a, dims, a.seq_len // world, seed=rank)
    fns, row = {}, {}
    for name, make in (("latent", _latent_fn), ("expanded", _expanded_fn)):
        fn, param = make(*inputs, dims, a, None)
        with saved_tensor_bytes([] if param is None else [param]) as seen, cp_stats() as st:
            fn()  # also the warmup of the first iteration's caches
        row[name] = dict(saved_mib=sum(seen.values()) / MiB,
                         fwd_mib=st.fwd_bytes_sent / MiB, bwd_mib=st.bwd_bytes_sent / MiB)
        fns[name] = fn
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    t = timed(fns, torch.device("cpu"), a.iters, a.warmup, clock, STATS[a.stat])
    for name in fns:
        row[name]["time_s"] = t[name]
    fns = None
    dist.barrier()
    if rank == 0:  # one process over all n, alone on the machine
        fn, _ = _latent_fn(*_inputs(a, dims, a.seq_len, seed=world), dims, a, LOCAL)
        row["one_process_s"] = timed({"one": fn}, torch.device("cpu"), 1, 0, clock)["one"]
    dist.barrier()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-nope-head-dim", type=int, default=128)
    p.add_argument("--qk-rope-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--warmup", type=int, default=0, help="beyond the counted first run")
    p.add_argument("--stat", choices=list(STATS), default="median")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default="", help="also write the rows here")
    a = p.parse_args(argv)
    ranks = run_distributed(_rank, a.world_size, a, timeout=a.timeout, threads=a.threads)
    P = a.world_size
    one = ranks[0]["one_process_s"]
    print(f"n={a.seq_len} P={P} heads={a.heads} R={a.kv_lora_rank} dn={a.qk_nope_head_dim} "
          f"dr={a.qk_rope_head_dim} dv={a.v_head_dim} {a.dtype} {a.layout} causal; "
          f"one process {one:.2f} s, / P = {one / P:.2f} s")
    print("| ring | time/rank s (max) | / (one process / P) | MiB sent/rank fwd | bwd "
          "| MiB saved/rank |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name in ("latent", "expanded"):
        t = max(r[name]["time_s"] for r in ranks)
        r0 = ranks[0][name]
        print(f"| {name} | {t:.2f} | {t / (one / P):.2f} | {r0['fwd_mib']:.1f} | "
              f"{r0['bwd_mib']:.1f} | {r0['saved_mib']:.1f} |")
        rows.append(dict(ring=name, time_s_max=t, one_process_s=one, **r0))
    if a.json:
        save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
