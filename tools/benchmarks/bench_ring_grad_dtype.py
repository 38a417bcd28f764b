"""The error of the ring's bf16 dK,dV wire (parallel.ring_grad_dtype: bf16) against fp32.

    python -m tools.benchmarks.bench_ring_grad_dtype --seq-len 8192 16384 32768 65536 --world 4

P local gloo ranks run one causal zigzag ring attention forward + backward twice on the
same fp32 inputs, once with dK,dV travelling in fp32 (exact) and once in bf16, and report
per n: the bytes each rank sent in backward for both, and the relative error of the bf16
run's dK and dV against the fp32 run's (max |diff| / max |ref| and ||diff|| / ||ref||,
over all ranks). Forward and dQ are bit-identical by construction (checked here too).
"""
from __future__ import annotations

import argparse

import torch

from ctxpar.testing import run_distributed, save_results


def _rank_main(rank, world, device, n, heads, kv_heads, head_dim):
    import torch.distributed as dist

    from ctxpar.context_parallel import context_parallel_attention, cp_stats, shard_sequence

    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(1, n, heads, head_dim, generator=g)
    k, v = (torch.randn(1, n, kv_heads, head_dim, generator=g) for _ in range(2))
    dout = torch.randn(1, n, heads, head_dim, generator=g)
    group = dist.group.WORLD
    dout = shard_sequence(dout, 1, group, "zigzag")
    res = {}
    for wire in ("fp32", "bf16"):
        ql, kl, vl = (shard_sequence(x, 1, group, "zigzag").requires_grad_() for x in (q, k, v))
        with cp_stats() as st:
            out = context_parallel_attention(ql, kl, vl, comm="ring", cp_group=group,
                                             causal=True, layout="zigzag",
                                             ring_grad_dtype=wire)
            out.backward(dout)
        res[wire] = (out.detach(), ql.grad, kl.grad, vl.grad, st.bwd_bytes_sent)
    (out, dq, dk, dv, sent), (out16, dq16, dk16, dv16, sent16) = res["fp32"], res["bf16"]
    assert torch.equal(out, out16) and torch.equal(dq, dq16)  # untouched by the wire dtype
    diff = torch.cat([(dk16 - dk).flatten(), (dv16 - dv).flatten()])
    ref = torch.cat([dk.flatten(), dv.flatten()])
    # Plain floats back (tensors through the queue would outlive their process's memory).
    return dict(max_diff=diff.abs().max().item(), max_ref=ref.abs().max().item(),
                sq_diff=diff.pow(2).sum().item(), sq_ref=ref.pow(2).sum().item(),
                sent_fp32=sent, sent_bf16=sent16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--json", default="runs/bench/ring_grad_dtype.json")
    a = ap.parse_args(argv)
    rows = []
    print(f"{'n':>7} {'P':>2} {'bwd MiB fp32':>12} {'bwd MiB bf16':>12} "
          f"{'dK,dV max rel':>13} {'dK,dV norm rel':>14}")
    for n in a.seq_len:
        per_rank = run_distributed(_rank_main, a.world, torch.device("cpu"), n, a.heads,
                                   a.kv_heads, a.head_dim, timeout=3600)
        max_rel = max(r["max_diff"] for r in per_rank) / max(r["max_ref"] for r in per_rank)
        norm_rel = (sum(r["sq_diff"] for r in per_rank)
                    / sum(r["sq_ref"] for r in per_rank)) ** 0.5
        mib = [per_rank[0][f"sent_{w}"] / 2 ** 20 for w in ("fp32", "bf16")]
        rows.append(dict(n=n, world=a.world, bwd_mib_fp32=mib[0], bwd_mib_bf16=mib[1],
                         max_rel=max_rel, norm_rel=norm_rel))
        print(f"{n:>7} {a.world:>2} {mib[0]:>12.2f} {mib[1]:>12.2f} {max_rel:>13.2e} "
              f"{norm_rel:>14.2e}")
    save_results(a.json, a, rows)


if __name__ == "__main__":
    main()
