"""DeepSeek-V4's compressed entries (HCA's; CSA's with overlap) over a CP group: each rank
compresses the windows it ends, every rank gets them all.

HCA compresses every m consecutive tokens [w*m, (w+1)*m) of the full sequence into one
entry of head_dim numbers (transformers' ``DeepseekV4HCACompressor``):

    entry_w = rope(rmsnorm(sum_j softmax_j(gate_j + position_bias_j) * kv_j), w * m)

with kv, gate the compressor's two projections of the window's hidden states, the softmax
over the window's m tokens per channel (fp32), the RMSNorm weighted, RoPE at position w*m;
a trailing partial window makes no entry; with packed documents the windows restart at
each document (compressed_windows.py: which windows, their rows and RoPE positions; the
rule below holds per window whatever cuts it). CSA's compressor (``overlap``: m = 4, kv and
gate 2D wide) softmaxes over 2m slots instead: the previous window's first series and the
window's own second, so its halo reaches m rows further back.

Under CP (layouts contiguous and zigzag: each rank holds one or two slabs of consecutive
positions) the window ending in a slab belongs to the rank holding that slab. A window
that starts in the slab before (its start not on the slab's) takes the rows before the
slab from that slab's rank, with overlap also its document's previous window's: one P2P
batch of fewer than 2m rows per slab (``HaloRows``; zigzag's rank P-1 finds its second
slab's halo in its own first slab).
Backward sends the halo rows' gradients back and adds them into the sender's rows.

The entries then travel by one all-gather (``GatherEntries``), not around a ring: every
query attends to every complete entry before it, so every rank needs all earlier entries
anyway, and they are tiny (head_dim numbers per m tokens: 4 per token at V4's 512 / 128),
so one collective beats P - 1 dependent ring steps; the attention over them is then one
local block. Ranks own different numbers of windows (the slabs' alignment), so each pads
to the largest count; the all-gather's bytes are those padded rows. Its gradient is
reduce-scattered back: each entry's gradient summed over every rank's queries, on the
rank that made it.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from .comm import all_gather, exchange, group_rank_and_size, reduce_scatter, wait_all
from .compressed_windows import Windows, document_windows

COMPRESS_LAYOUTS = ("contiguous", "zigzag")


class Slab(NamedTuple):
    """One run of consecutive global positions a rank holds, and the windows it ends."""

    start: int        # global position of the slab's first token
    local: int        # its first row in the rank's local sequence
    length: int
    halo: int         # rows before `start` its first entry reads (its window's, and with
                      # overlap the previous window's of the same document)
    first_window: int  # entry id of the first window ending in the slab
    windows: int      # complete windows ending in the slab


def slabs(layout: str, rank: int, world: int, S: int, wins: Windows,
          overlap: bool = False) -> List[Slab]:
    """The slabs `rank` holds (local order = position order) with the windows of `wins`
    (compressed_windows.py) they end; overlap: each entry also reads the window before
    its own (CSA)."""
    if layout == "contiguous":
        runs = [(rank * S, 0, S)]
    else:  # zigzag: chunks rank and 2P-1-rank of S/2
        c = S // 2
        runs = [(rank * c, 0, c), ((2 * world - 1 - rank) * c, c, c)]
    out = []
    for start, local, length in runs:
        first, count = wins.ending_in(start, length)
        halo = max(0, start - wins.reach(first, overlap)) if count else 0
        out.append(Slab(start, local, length, halo, first, count))
    return out


def owner(layout: str, world: int, S: int, pos: int) -> Tuple[int, int]:
    """(rank, local row) holding global position `pos`."""
    if layout == "contiguous":
        return pos // S, pos % S
    c = S // 2
    chunk, row = divmod(pos, c)
    return (chunk, row) if chunk < world else (2 * world - 1 - chunk, c + row)


def check_slabs(layout: str, S: int, m: int, world: int, overlap: bool, caller: str):
    """ValueError (the same on every rank) unless each slab holds a window and its reach."""
    slab, need = (S // 2 if layout == "zigzag" else S), m * (2 if overlap else 1)
    if world > 1 and slab < need:
        raise ValueError(f"{caller}: compress_rate={m} needs slabs of at least {need} tokens "
                         f"(local_seq{'/2' if layout == 'zigzag' else ''} = {slab}): a "
                         "window could otherwise span more than two ranks")


def check_compressor(compressor, batch_seq: tuple, m: int, width: int, dim: int,
                     prefix: str, caller: str):
    """ValueError unless compressor = (kv, gate, position_bias, norm_weight) has the shapes
    (B, S, width) twice, (m, width) and (dim,): width = dim, or 2 * dim with overlap.
    prefix names the tensors (e.g. "index_" for CSA's indexer)."""
    kv, gate, bias, norm = compressor
    want = {"compress_kv": (*batch_seq, width), "compress_gate": (*batch_seq, width),
            "position_bias": (m, width), "norm_weight": (dim,)}
    for (name, shape), t in zip(want.items(), (kv, gate, bias, norm)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
            raise ValueError(f"{caller}: {prefix}{name} must have shape {shape}, got {got}")


def halo_links(layout: str, rank: int, world: int, S: int, wins: Windows,
               overlap: bool = False):
    """(sends [(peer, local rows)], recvs [(peer, slab index, rows)]), remote peers only,
    in one global order (the receiving slab's position) that both sides agree on."""
    sends, recvs = [], []
    for r in range(world):
        for i, sl in enumerate(slabs(layout, r, world, S, wins, overlap)):
            if sl.halo == 0:
                continue
            src, row = owner(layout, world, S, sl.start - sl.halo)
            if src == r:
                continue  # zigzag's rank P-1: its own first slab
            if src == rank:
                sends.append((r, slice(row, row + sl.halo)))
            if r == rank:
                recvs.append((src, i, sl.halo))
    return sends, recvs


class HaloRows(torch.autograd.Function):
    """(B, S + received rows, C): x (B, S, C) followed by the rows the remote halos send
    this rank, in recvs order (x travels through so that every rank's backward runs, the
    senders' included); backward returns the halos' gradients to the senders (fp32, added
    there)."""

    @staticmethod
    def forward(ctx, x, links, group):
        sends, recvs = links
        ctx.links, ctx.group, ctx.shape = links, group, x.shape
        bufs = [(p, x.new_empty((x.shape[0], h, x.shape[2]))) for p, _, h in recvs]
        wait_all(exchange(group, [(p, x[:, rows].contiguous()) for p, rows in sends],
                          bufs, "fwd"))
        return torch.cat([x] + [b for _, b in bufs], dim=1)

    @staticmethod
    def backward(ctx, grad):
        sends, recvs = ctx.links
        B, S, C = ctx.shape
        back, at = [], S
        for p, _, h in recvs:
            back.append((p, grad[:, at:at + h].float().contiguous()))
            at += h
        got = [(p, torch.empty((B, rows.stop - rows.start, C), dtype=torch.float32,
                               device=grad.device)) for p, rows in sends]
        wait_all(exchange(ctx.group, back, got, "bwd"))
        dx = grad[:, :S].to(torch.float32, copy=True)
        for (_, rows), (_, g) in zip(sends, got):
            dx[:, rows] += g
        return dx.to(grad.dtype), None, None


def compress_windows(kv, logits, norm_weight, eps: float):
    """Entries (B, n, D) of n windows: kv, logits (B, n, slots, D) (gate + position_bias);
    the RMSNorm weight (D,) fp32, as transformers keeps it; softmax and norm in fp32."""
    weights = logits.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    pooled = (kv * weights).sum(dim=2).float()
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps)
    return (norm_weight * normed).to(kv.dtype)


def window_rows(rows, first: torch.Tensor, m: int) -> torch.Tensor:
    """(B, n, m, C): rows [first_i, first_i + m) of rows (B, R, C) for each window i
    (first (n,) int64, CPU); a view when the windows tile consecutive rows (no document
    boundary between them off the window grid), else a gather."""
    B, n = rows.shape[0], first.numel()
    f0 = int(first[0]) if n else 0
    if f0 >= 0 and torch.equal(first, f0 + torch.arange(n) * m):
        return rows[:, f0:f0 + n * m].view(B, n, m, rows.shape[-1])
    return rows[:, (first[:, None] + torch.arange(m)).clamp(min=0).to(rows.device)]


def window_entries(rows, base: int, wins: Windows, ids: slice, position_bias, norm_weight,
                   eps, overlap: bool):
    """Entries (B, n, D) of the windows wins[ids] from rows (B, R, 2C) = [kv ; gate] of
    the consecutive tokens from global position `base` on. HCA (C = D): softmax over each
    window's m rows. CSA (overlap, C = 2D): over 2m slots, the previous window's first
    series (kv[..., :D]) and the window's own second (kv[..., D:]); a document's first
    window has no previous one (zero kv, -inf logits: weight 0), as transformers' first
    window of a sequence."""
    m, C = wins.m, rows.shape[-1] // 2
    first = wins.starts[ids] - base                                       # (n,) rows
    cur = window_rows(rows, first, m)                                     # (B, n, m, 2C)
    if not overlap:
        return compress_windows(cur[..., :C], cur[..., C:] + position_bias, norm_weight, eps)
    D = C // 2
    if first.numel() and int(first[0]) < m:  # the first window is its document's first
        prev = torch.cat((cur[:, :1], window_rows(rows, first[1:] - m, m)), dim=1)
    else:
        prev = window_rows(rows, first - m, m)    # where there is none: masked below
    none = wins.first[ids].to(rows.device)[None, :, None, None]
    kv = torch.cat((prev[..., :D].masked_fill(none, 0), cur[..., D:C]), dim=2)  # (B,n,2m,D)
    gate = torch.cat(((prev[..., C:C + D] + position_bias[:, :D]).masked_fill(
        none, float("-inf")), cur[..., C + D:] + position_bias[:, D:]), dim=2)
    return compress_windows(kv, gate, norm_weight, eps)


def local_entries(kv, gate, position_bias, norm_weight, eps: float, wins: Windows,
                  rope: Callable, layout: str, group, overlap: bool = False) -> torch.Tensor:
    """The entries (B, T_rank, D) of the windows this rank ends, in entry order; kv,
    gate (B, S, C) the compressor's projections of the local tokens (C = D, or 2D with
    overlap)."""
    (rank, world), (S, C) = group_rank_and_size(group), kv.shape[1:]
    links = halo_links(layout, rank, world, S, wins, overlap) if world > 1 else ([], [])
    x = torch.cat((kv, gate), dim=-1)                                  # (B, S, 2C)
    if links[0] or links[1]:
        x = HaloRows.apply(x, links, group)                        # (B, S + halos, 2C)
    at, parts = S, []
    for i, sl in enumerate(slabs(layout, rank, world, S, wins, overlap)):
        rows = [x[:, sl.local:sl.local + sl.length]]
        if sl.halo:
            src, row = owner(layout, world, S, sl.start - sl.halo)
            if src == rank or world == 1:
                rows.insert(0, x[:, row:row + sl.halo])
            else:
                rows.insert(0, x[:, at:at + sl.halo])
                at += sl.halo
        if sl.windows == 0:
            continue
        ids = slice(sl.first_window, sl.first_window + sl.windows)
        entries = window_entries(torch.cat(rows, dim=1), sl.start - sl.halo, wins, ids,
                                 position_bias, norm_weight, eps, overlap)
        parts.append(rope(entries, wins.positions[ids].to(kv.device)))
    # no window ends here (documents shorter than m): an empty slice of x, so that this
    # rank's backward still runs the halo's and the gather's collectives as the others'
    return torch.cat(parts, dim=1) if parts else x[:, :0, :C // 2 if overlap else C]


def window_ids(layout: str, rank: int, world: int, S: int, wins: Windows) -> List[int]:
    """The entry ids of the windows `rank` ends, in its entries' order."""
    return [w for sl in slabs(layout, rank, world, S, wins)
            for w in range(sl.first_window, sl.first_window + sl.windows)]


class GatherEntries(torch.autograd.Function):
    """Every rank's entries (B, T_r, D) -> all (B, n // m, D) in window order; backward
    reduce-scatters each entry's gradient to the rank that made it."""

    @staticmethod
    def forward(ctx, mine, ids, group):
        ctx.ids, ctx.group, ctx.mine = ids, group, mine.shape[1]
        B, T, D = mine.shape
        tmax = max(len(i) for i in ids)
        padded = torch.cat((mine, mine.new_zeros((B, tmax - T, D))), dim=1)
        gathered, work = all_gather(padded, group, "fwd")
        if work is not None:
            work.wait()
        full = mine.new_empty((B, sum(len(i) for i in ids), D))
        for p, i in enumerate(ids):
            full[:, i] = gathered[p, :, :len(i)]
        return full

    @staticmethod
    def backward(ctx, grad):
        ids, group = ctx.ids, ctx.group
        B, _, D = grad.shape
        tmax = max(len(i) for i in ids)
        slots = grad.new_zeros((len(ids), B, tmax, D))
        for p, i in enumerate(ids):
            slots[p, :, :len(i)] = grad[:, i]
        return reduce_scatter(slots, group, "bwd")[:, :ctx.mine], None, None


def compressed_entries(kv, gate, position_bias, norm_weight, eps: float, m: int,
                       rope: Callable, layout: str, group, overlap: bool = False,
                       caller: str = "compressed_entries", cu: Optional[torch.Tensor] = None,
                       reset_positions: bool = True) -> torch.Tensor:
    """All entries (B, N, D) of the full sequence on every rank of `group`, in entry order
    (compressed_windows.py: N = n // m, or with documents cu (int64 boundaries of the full
    sequence, shared by the batch) the sum of each document's count): HCA's (overlap
    False: kv, gate (B, S, D), position_bias (m, D)) or CSA's compressor's (overlap True:
    (B, S, 2D) and (m, 2D), the two series of transformers' DeepseekV4CSACompressor).
    rope(entries (B, T, D), positions (T,)) -> (B, T, D); reset_positions: the entries'
    positions restart at each document (compressed_windows.py)."""
    world, S = group_rank_and_size(group)[1], kv.shape[1]
    if layout not in COMPRESS_LAYOUTS:
        raise ValueError(f"{caller}: layout={layout!r} must be one of "
                         f"{list(COMPRESS_LAYOUTS)} (a compressed window needs consecutive "
                         "tokens on a rank)")
    check_slabs(layout, S, m, world, overlap, caller)
    wins = document_windows(cu, S * world, m, reset_positions)
    mine = local_entries(kv, gate, position_bias, norm_weight, eps, wins, rope, layout,
                         group, overlap)
    if world == 1:
        return mine
    ids = [window_ids(layout, r, world, S, wins) for r in range(world)]
    return GatherEntries.apply(mine, ids, group)
