"""DeepSeek-V4's three attention kinds over CP: sliding only, CSA, HCA (compressed.py,
compressed_sparse.py): a rank's time against one process / P, and the bytes a rank sends
against all-gathering the hidden states for the compressors.

1. Time (fp32, forward + backward, best of --iters after a small warm-up call): each
   kind's core on the whole sequence in one process (divided by P), and rank 0's
   schedule of P under comm.NoComm(0, P) (zigzag: its own tokens and shapes, its local
   blocks standing in for the remote ones; nothing moves, so this is the compute a rank
   does, not the wire's).
   Sliding only: context_parallel_attention with the window and the sinks; CSA:
   csa_attention (its indexer included); HCA: hca_attention.
2. Bytes (from the layout, ctxpar.testing.compressed.sent_bytes, the count
   tests/test_compressed_attention.py and tests/test_csa_attention.py assert cp_stats
   equal): the forward bytes rank 0 sends per local token at the benchmark's sizes and
   at DeepSeek-V4-Flash's (hidden 4096, head_dim 512, index_head_dim 128, window 128,
   bf16), beside the form that all-gathers the hidden states so every rank runs the
   compressors on the whole sequence ((P - 1) x hidden x element size a token).

    python -m tools.benchmarks.bench_compressed --seq-len 32768 --world-size 4
"""
from __future__ import annotations

import argparse
import time

import torch

from ctxpar.context_parallel import context_parallel_attention
from ctxpar.context_parallel.comm import LOCAL, NoComm
from ctxpar.context_parallel.compressed import hca_attention
from ctxpar.context_parallel.compressed_sparse import csa_attention
from ctxpar.context_parallel.csa_indexer import IndexerInputs
from ctxpar.context_parallel.halo import halo_tokens
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.context_parallel.mask import AttentionMask
from ctxpar.testing import save_results
from ctxpar.testing.compressed import sent_bytes

V4_FLASH = dict(hidden=4096, head_dim=512, index_dim=128, window=128, element=2)


def no_rope(x, pos):
    """The entries' RoPE does not change the work: identity here."""
    return x


def inputs(a, n):
    """Full-sequence fp32 inputs of every kind (B = 1), made once, sliced per rank."""
    torch.manual_seed(0)
    H, D, Hi, Di, r = a.heads, a.head_dim, a.index_heads, a.index_dim, torch.randn
    return dict(q=r(1, n, H, D), kv=r(1, n, D), csa_kv=r(1, n, 2 * D), csa_gate=r(1, n, 2 * D),
                hca_kv=r(1, n, D), hca_gate=r(1, n, D), iq=r(1, n, Hi, Di),
                iw=r(1, n, Hi), ikv=r(1, n, 2 * Di), igate=r(1, n, 2 * Di), dout=r(1, n, H, D))


def run_kind(kind, a, x, group, layout):
    """One forward + backward of `kind` on the tokens in x; seconds."""
    q, kv = x["q"].clone().requires_grad_(), x["kv"].clone().requires_grad_()
    sinks = torch.zeros(a.heads, requires_grad=True)
    common = dict(sliding_window=a.window, entry_rope=no_rope, cp_group=group,
                  layout=layout, comm="ring", backend="math")
    t0 = time.perf_counter()
    if kind == "sliding":
        k = kv.unsqueeze(2)
        out = context_parallel_attention(
            q, k, k, comm="ring", cp_group=group, layout=layout, backend="math",
            mask=AttentionMask(causal=True, sliding_window=a.window, sinks=sinks))
    elif kind == "csa":
        m, D, Di = a.csa_rate, a.head_dim, a.index_dim
        index = IndexerInputs(x["iq"], x["iw"], x["ikv"], x["igate"], torch.zeros(m, 2 * Di),
                              torch.ones(Di))
        out = csa_attention(q, kv, x["csa_kv"], x["csa_gate"], torch.zeros(m, 2 * D),
                            torch.ones(D), sinks, index, compress_rate=m,
                            index_topk=a.top_k, **common)
    else:
        m = a.hca_rate
        out = hca_attention(q, kv, x["hca_kv"], x["hca_gate"], torch.zeros(m, a.head_dim),
                            torch.ones(a.head_dim), sinks, compress_rate=m, **common)
    out.backward(x["dout"])
    return time.perf_counter() - t0


def times(a):
    n, P = a.seq_len, a.world_size
    full = inputs(a, n)
    pos = rank_positions(n, 0, P, "zigzag")
    local = {k: v[:, pos] for k, v in full.items()}
    rows, small = {}, {k: v[:, :4 * a.window] for k, v in full.items()}
    for kind in ("sliding", "csa", "hca"):
        run_kind(kind, a, small, LOCAL, "contiguous")  # warm-up: first-call costs
        one = min(run_kind(kind, a, full, LOCAL, "contiguous") for _ in range(a.iters))
        rank = min(run_kind(kind, a, local, NoComm(0, P), "zigzag") for _ in range(a.iters))
        rows[kind] = dict(one_process_s=one, rank0_s=rank, ratio=rank / (one / P))
        print(f"{kind:8s} one process {one:7.2f} s, / P {one / P:6.2f} s; rank 0 of {P} "
              f"{rank:6.2f} s ({rank / (one / P):.2f}x one process / P)", flush=True)
    return rows


def bytes_per_token(P, S, sizes, rates, index_dim):
    """Forward bytes rank 0 sends per local token, each kind, and the hidden-state gather's."""
    window = halo_tokens("zigzag", 0, P, S, sliding_window=sizes["window"])
    e, D = sizes["element"], sizes["head_dim"]
    kv_halo = window[0] * 2 * D * e
    csa = sent_bytes(P, "zigzag", S, 0, rates[0], True, window, 1, [D, index_dim], e)[0]
    hca = sent_bytes(P, "zigzag", S, 0, rates[1], False, window, 1, [D], e)[0]
    return dict(sliding=kv_halo / S, csa=csa / S, hca=hca / S,
                gather_hidden=(P - 1) * sizes["hidden"] * e)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--csa-rate", type=int, default=4)
    p.add_argument("--hca-rate", type=int, default=128)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--skip-time", action="store_true", help="the bytes only")
    p.add_argument("--save", default="")
    a = p.parse_args()
    S, rates = a.seq_len // a.world_size, (a.csa_rate, a.hca_rate)
    here = dict(hidden=a.hidden, head_dim=a.head_dim, window=a.window, element=4)
    rows = {"bytes_here": bytes_per_token(a.world_size, S, here, rates, a.index_dim),
            "bytes_v4_flash": bytes_per_token(a.world_size, S, V4_FLASH, rates,
                                              V4_FLASH["index_dim"])}
    for name in ("bytes_here", "bytes_v4_flash"):
        print(name, {k: round(v, 1) for k, v in rows[name].items()}, "bytes/token forward")
    if not a.skip_time:
        rows["time"] = times(a)
    if a.save:
        save_results(a.save, a, rows)


if __name__ == "__main__":
    main()
