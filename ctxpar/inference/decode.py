"""Flash-decoding across CP ranks: one query per sequence against a KV cache split over ranks.

Each rank attends the new token's query to its own share of the cache and gets a partial
result (out, lse) over its keys only (seed 001, "Flash Decoding": split the keys, keep each
split's log-sum-exp). The partials of the P ranks are merged with the same LSE rule the
ring uses (``merge_block_``), which makes the result exactly softmax attention over the
union of the shards: no key or value ever leaves its rank.

The collective: one ``all_gather`` per layer and decode step of every rank's partial,
packed as (B, H, D + 1) fp32 values (out, then lse, per head), so each rank receives the
P - 1 other partials, (P - 1) * B * H * (D + 1) * 4 bytes, and merges all P in rank
order. Why all_gather and not the all-reduce form (max-lse all-reduce, then a sum of
exp(lse - max)-weighted outputs): at decode sizes (kilobytes) a collective costs its
latency, not its bytes, and all_gather is one collective where the all-reduce form is two;
and every rank merging the same P partials in the same order gives bit-identical results
on every rank, which an all-reduce does not promise across backends. That keeps the
hidden states of the CP ranks identical, so they sample the same token without a
broadcast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cp_ops import group_rank_and_size, merge_block_


@dataclass
class DecodeStats:
    """What this rank's decode merges moved (all_gather calls, bytes sent and received)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      valid: torch.Tensor, scale: float):
    """Attention of one query per row over this rank's keys, with its log-sum-exp.

    q (B, 1, H, D); k, v (B, Hkv, S, D), the cache's head-major layout, with H % Hkv == 0
    (query head h reads kv head h // (H / Hkv), as in training); valid (B, S) bool, the
    cache slots that hold a token of that row (prompt padding and unused slots are
    False). Returns out (B, 1, H, D) fp32 and lse (B, H, 1) fp32; a row with no valid key
    here gets out 0 and lse -inf, which the merge weighs 0. Two batched matmuls in fp32:
    one query row per head is bound by reading the cache, which head-major slots let the
    matmuls stream without a copy.
    """
    B, _, H, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]  # Dv: MLA's value heads are narrower than its qk
    qg = q[:, 0].float().view(B, Hkv, H // Hkv, D)                      # (B, Hkv, G, D)
    s = torch.matmul(qg, k.float().transpose(-1, -2)) * scale           # (B, Hkv, G, S)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                     # (B, Hkv, G)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))          # exp(-inf) = 0
    out = torch.matmul(p, v.float())                                     # (B, Hkv, G, Dv)
    return out.reshape(B, 1, H, Dv), lse.reshape(B, H, 1)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group,
                   stats: DecodeStats = None, return_lse: bool = False):
    """The exact attention output (B, 1, H, D) fp32 from every CP rank's partial (and with
    return_lse its log-sum-exp (B, H, 1) fp32, for the sinks' term).

    out (B, 1, H, D) fp32, lse (B, H, 1) fp32: this rank's partial. Collective over group
    (one all_gather of B * H * (D + 1) fp32 values per rank); identity for one rank.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return (out, lse) if return_lse else out
    B, _, H, D = out.shape
    packed = torch.cat([out[:, 0], lse], dim=-1).contiguous()           # (B, H, D + 1)
    gathered = torch.empty((world, *packed.shape), dtype=packed.dtype, device=packed.device)
    # A list of views into one buffer: all_gather is the same call on gloo and NCCL (the
    # tensor form wants a flat first dim on gloo and is deprecated in torch 2.13).
    dist.all_gather(list(gathered.unbind(0)), packed, group=group)      # (P, B, H, D + 1)
    if stats is not None:
        nbytes = packed.numel() * packed.element_size()
        stats.calls += 1
        stats.bytes_sent += nbytes
        stats.bytes_recv += (world - 1) * nbytes
    merged = torch.zeros_like(out)
    merged_lse = torch.full_like(lse, float("-inf"))
    for p in range(world):  # rank order on every rank: bit-identical results everywhere
        merge_block_(merged, merged_lse, gathered[p, :, :, :D].unsqueeze(1),
                     gathered[p, :, :, D:])
    return (merged, merged_lse) if return_lse else merged


def decode_bytes_per_step(n_layers: int, batch: int, heads: int, head_dim: int,
                          cp: int) -> int:
    """Bytes each rank receives per decode step: per layer P - 1 partials of B*H*(D+1) fp32.

    heads: query heads on this rank (n_heads / tp). The formula the measurement is
    checked against (tests/test_inference.py, tools/benchmarks/bench_generate.py).
    """
    return n_layers * (cp - 1) * batch * heads * (head_dim + 1) * 4
