"""DeepSeek sparse attention over CP (sparse_latent.py): the indexer's memory, the bytes,
the sparse layer's time against dense MLA.

1. Memory (one process, rank 0's schedule under comm.NoComm(0, P): the local keys stand in
   for every block, the tiles and shapes are rank 0's): the CPU allocator's peak
   (ctxpar.testing.memory.allocator_peaks) of indexer_topk, streamed, against the
   gathered-scores form (Megatron's all_gather DSA: every indexer key gathered, the
   (local queries x n) fp32 score matrix accumulated head by head, masked, top-k'd).
   Asserted: streamed <= 1/8 of gathered.
2. Bytes and time (P gloo ranks, same inputs): per rank, the forward bytes per local
   token of the indexer pass (its keys, D a token) and of the sparse attention (the
   latent, R + dr), asserted equal to (P - 1) x width x element size; the wall time of
   the sparse layer (indexer_topk + sparse_latent_attention forward and backward) and of
   dense MLA (latent_attention, causal, forward and backward), max over ranks.

    python -m tools.benchmarks.bench_dsa --seq-len 16384 --world-size 4 --top-k 512
"""
from __future__ import annotations

import argparse
import time

import torch

from ctxpar.context_parallel import cp_stats, shard_sequence
from ctxpar.context_parallel.comm import NoComm
from ctxpar.context_parallel.latent import LatentDims
from ctxpar.context_parallel.latent_api import latent_attention
from ctxpar.context_parallel.layouts import rank_positions
from ctxpar.context_parallel.sparse_latent import indexer_topk, sparse_latent_attention
from ctxpar.testing import run_distributed, save_results
from ctxpar.testing.dsa import dsa_inputs
from ctxpar.testing.memory import allocator_peaks
from ctxpar.testing.mla import mla_inputs

MiB = 2 ** 20


def _dims(a):
    return LatentDims(a.kv_lora_rank, a.nope_dim, a.rope_dim, a.v_dim)


def _local(a, rank, group):
    """This rank's fp32 inputs (zigzag): q, latent, W, dout, index_q, index_k, index_w."""
    q, latent, weight, dout, _ = mla_inputs(1, a.seq_len, a.heads, _dims(a))
    iq, ik, iw = dsa_inputs(1, a.seq_len, a.heads, _dims(a), a.index_heads, a.index_dim)
    shard = lambda x: shard_sequence(x, 1, group, "zigzag").contiguous()  # noqa: E731
    return (shard(q), shard(latent), weight, shard(dout), shard(iq), shard(ik), shard(iw))


def gathered_scores_topk(iq, ik, iw, positions, n, top_k):
    """The all_gather form: (s x n) fp32 scores over every gathered key, head by head."""
    keys = ik.repeat(1, n // ik.shape[1], 1)            # stands in for the gathered (n, D)
    scores = torch.zeros(iq.shape[0], iq.shape[1], n)
    for h in range(iq.shape[2]):
        dots = torch.einsum("bqd,bkd->bqk", iq[:, :, h], keys).mul_(iq.shape[-1] ** -0.5)
        scores.addcmul_(iw[:, :, h, None], dots.relu_())  # in place: one head's dots extra
    hidden = torch.arange(n)[None, :] > positions[:, None]
    return scores.masked_fill_(hidden, float("-inf")).topk(top_k, dim=-1).indices


def memory(a):
    P, s = a.world_size, a.seq_len // a.world_size
    group = NoComm(0, P)
    _, _, _, _, iq, ik, iw = _local(a, 0, group)
    pos = rank_positions(a.seq_len, 0, P, "zigzag")
    with torch.no_grad():
        streamed = allocator_peaks(lambda region: indexer_topk(
            iq, ik, iw, a.top_k, cp_group=group, layout="zigzag"))[None]
        gathered = allocator_peaks(lambda region: gathered_scores_topk(
            iq, ik, iw, pos, a.seq_len, a.top_k))[None]
    row = dict(streamed_MiB=streamed / MiB, gathered_MiB=gathered / MiB,
               ratio=streamed / gathered, local_tokens=s)
    print(f"indexer peak per rank: streamed {row['streamed_MiB']:.1f} MiB, gathered-scores "
          f"{row['gathered_MiB']:.1f} MiB, ratio {row['ratio']:.3f} (target <= 1/8)")
    assert row["ratio"] <= 1 / 8, row
    return row


def _rank(rank, world, a):
    dims = _dims(a)
    q, latent, weight, dout, iq, ik, iw = _local(a, rank, None)
    cp = dict(comm="ring", layout="zigzag")
    s = q.shape[1]
    times = {"sparse": [], "dense": [], "indexer": []}
    for _ in range(a.iters):
        leaves = [x.clone().requires_grad_() for x in (q, latent, weight)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with cp_stats() as index_st:
            idx = indexer_topk(iq, ik, iw, a.top_k, **cp)
        t1 = time.perf_counter()
        with cp_stats() as attn_st:
            sparse_latent_attention(*leaves, dims, idx, **cp).backward(dout)
        times["sparse"].append(time.perf_counter() - t0)
        times["indexer"].append(t1 - t0)
        leaves = [x.clone().requires_grad_() for x in (q, latent, weight)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        latent_attention(*leaves, dims, causal=True, **cp).backward(dout)
        times["dense"].append(time.perf_counter() - t0)
    return dict(index_bytes_per_token=index_st.fwd_bytes_sent / s,
                latent_bytes_per_token=attn_st.fwd_bytes_sent / s,
                skipped=attn_st.fwd_blocks_skipped,
                sparse_s=min(times["sparse"]), dense_s=min(times["dense"]),
                indexer_s=min(times["indexer"]))


def ring(a):
    per_rank = run_distributed(_rank, a.world_size, a, timeout=3600)
    P, dims = a.world_size, _dims(a)
    want_index, want_latent = (P - 1) * a.index_dim * 4, (P - 1) * dims.latent_dim * 4
    for r in per_rank:
        assert r["index_bytes_per_token"] == want_index, (r, want_index)
        assert r["latent_bytes_per_token"] == want_latent, (r, want_latent)
    row = dict(index_bytes_per_token=want_index, latent_bytes_per_token=want_latent,
               sparse_s=max(r["sparse_s"] for r in per_rank),
               dense_s=max(r["dense_s"] for r in per_rank),
               indexer_s=max(r["indexer_s"] for r in per_rank),
               skipped_blocks=[r["skipped"] for r in per_rank])
    print(f"bytes per rank per local token (forward): indexer key {want_index}, latent "
          f"{want_latent}; sparse layer {row['sparse_s']:.2f} s (indexer "
          f"{row['indexer_s']:.2f} s), dense MLA "
          f"{row['dense_s']:.2f} s (fwd+bwd, max over ranks)")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-lora-rank", type=int, default=64)
    p.add_argument("--nope-dim", type=int, default=32)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--v-dim", type=int, default=32)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--skip-ring", action="store_true", help="the memory part only")
    p.add_argument("--save", default="")
    a = p.parse_args()
    rows = {"memory": memory(a)}
    if not a.skip_ring:
        rows["ring"] = ring(a)
    if a.save:
        save_results(a.save, a, rows)


if __name__ == "__main__":
    main()
