"""Document masking under CP: packed documents attend only inside themselves.

A sample of n tokens packs several documents; ``cu_seqlens`` gives their boundaries in the
*full* (unsharded) sequence in flash-attn's varlen convention: int32, ascending, starting at
0 and ending at n (documents i span [cu[i], cu[i+1])), one tensor per sample. Query token i
sees key token j iff doc(i) == doc(j) (and j <= i when causal), whatever the layout, at any
document length: no padding of documents to multiples of anything.

How the ring uses it (``doc_plan``): every layout keeps a rank's tokens in ascending global
order, so the tokens of one document are one contiguous run of local rows on every rank.
For a (local queries) x (visiting keys) block the plan is one sub-block per document the
two sides share, nothing else: documents the block does not share cost nothing, and a
step whose keys share no document with the queries is skipped. A sub-block is computed

    full        every key precedes every query (or not causal): no mask
    diagonal    the same positions on both sides (the rank's own keys): the kernel's causal
    staircase   each row sees one key more than the row before (striped's off-diagonal
                blocks, documents a layout cuts): a full part, the kernel's causal on the
                diagonal part, a full part, no mask
    by runs     a document over both of zigzag's chunks: one of the above per (query run,
                key run) of consecutive positions, no mask
    masked      any other shape: an explicit (Lq, Lk) causal mask
    skipped     every key follows every query

so the kernels evaluate ~sum over documents of len^2/2 pairs instead of n^2/2. A causal
sliding window inside each document (``_window_plan``) is planned for the kernel that
runs it: a band per (query run, key run) for kernels that take flash-attn's window_size
(bands.py), else tiles of rows with an explicit mask each.
"""
from __future__ import annotations

import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch

from .bands import Window, band_pairs, fit_band


class DocBlock(NamedTuple):
    """Rows [q0, q1) of the local queries against rows [k0, k1) of the visiting keys."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool                   # the kernel's causal mask (square, same positions)
    mask: Optional[torch.Tensor]   # (q1-q0, k1-k0) bool, True = visible; None = all visible
    window: Optional[Window] = None  # flash-attn's window_size (bands.py), bottom-right

    def pairs(self) -> int:  # visible (query, key) pairs: what the FLOP counters count
        L, S = self.q1 - self.q0, self.k1 - self.k0
        if self.mask is not None:
            return int(self.mask.sum())
        if self.window is not None:
            return band_pairs(L, S, self.window)
        return L * (L + 1) // 2 if self.causal else L * S


def check_cu_seqlens(cu_seqlens, seq_len: int, batch: int, caller: str) -> List[torch.Tensor]:
    """The per-sample boundaries as a list of B int64 CPU tensors; ValueError naming what is
    wrong otherwise (local checks only: the same message on every rank)."""
    cus = list(cu_seqlens) if isinstance(cu_seqlens, (list, tuple)) else None
    if cus is None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1:
        cus = [cu_seqlens] * batch  # one set for every sample of the batch
    if cus is None or len(cus) != batch:
        raise ValueError(f"{caller}: cu_seqlens must be one 1-D tensor or a list of {batch} "
                         f"(one per sample)")
    out = []
    for b, cu in enumerate(cus):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
            raise ValueError(f"{caller}: cu_seqlens[{b}] must be a 1-D int32 tensor, got "
                             f"{getattr(cu, 'dtype', type(cu).__name__)}")
        cu = cu.detach().to("cpu", torch.int64)
        if cu.numel() < 2 or cu[0] != 0 or cu[-1] != seq_len:
            raise ValueError(f"{caller}: cu_seqlens[{b}]={cu.tolist()} must start at 0 and "
                             f"end at the sequence length {seq_len}")
        if (cu[1:] <= cu[:-1]).any():
            raise ValueError(f"{caller}: cu_seqlens[{b}]={cu.tolist()} must be strictly "
                             f"increasing (no empty documents)")
        out.append(cu)
    return out


def doc_ids(cu: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The document index of each global position (ascending positions in, same order out)."""
    return torch.searchsorted(cu[1:], positions, right=True)


def _runs(cu: torch.Tensor, pos: torch.Tensor):
    """{doc: (first row, last row + 1)} of the documents with a row at the ascending
    positions pos (each document's rows are contiguous): two binary searches per
    boundary, not a pass over the rows."""
    cu = cu.to(pos.dtype)
    starts = torch.searchsorted(pos, cu[:-1]).tolist()
    ends = torch.searchsorted(pos, cu[1:]).tolist()
    return {d: (a, b) for d, (a, b) in enumerate(zip(starts, ends)) if b > a}


def doc_plan(cu: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
             causal: bool, window: Optional[int] = None, banded: bool = False
             ) -> List[DocBlock]:
    """The sub-blocks of (queries at q_pos) x (keys at k_pos) that document masking (and a
    causal sliding window inside each document, mask.py) leaves.

    q_pos, k_pos: ascending global positions (rank_positions) of the local queries and of
    the visiting keys. banded: the kernel takes flash-attn's window_size (a window's
    blocks become bands, not masked tiles).
    """
    if window is not None:
        return _window_plan(cu, q_pos, k_pos, window, banded)
    q_runs, k_runs = _runs(cu, q_pos), _runs(cu, k_pos)
    plan = []
    for d, (q0, q1) in q_runs.items():
        if d not in k_runs:
            continue
        k0, k1 = k_runs[d]
        qp, kp = q_pos[q0:q1], k_pos[k0:k1]
        if not causal or kp[-1] <= qp[0]:
            plan.append(DocBlock(q0, q1, k0, k1, False, None))
        elif kp[0] > qp[-1]:
            continue  # every key of this document here follows every query
        elif q1 - q0 == k1 - k0 and torch.equal(qp, kp):
            plan.append(DocBlock(q0, q1, k0, k1, True, None))
        else:
            plan.extend(_causal_part(q0, k0, qp, kp))
    return plan


def _window_plan(cu, q_pos, k_pos, window: int, banded: bool) -> List[DocBlock]:
    """Per shared document, the pairs the causal window leaves: as flash-attn window calls
    where the kernel takes them (``_band_plan``), else as masked tiles (``_tile_plan``).
    Nothing visible: no block."""
    q_runs, k_runs = _runs(cu, q_pos), _runs(cu, k_pos)
    plan = []
    for d, (q0, q1) in q_runs.items():
        if d in k_runs:
            k0, k1 = k_runs[d]
            place = _band_plan if banded else _tile_plan
            plan.extend(place(q0, k0, q_pos[q0:q1], k_pos[k0:k1], window))
    return plan


def _band_plan(q0, k0, qp, kp, window: int, max_runs: int = 16) -> List[DocBlock]:
    """One document's queries (positions qp, rows from q0) and keys (kp, rows from k0) as
    band blocks (bands.fit_band): the whole document at once when both sides go up by one
    step (contiguous, striped), else per (query run, key run) of consecutive positions
    (zigzag's chunks, up to max_runs pairs); a piece no window expresses gets masked tiles.
    O(rows) host work: each row's keys are found by binary search, no (rows, keys) mask
    is made."""
    whole = _bands(q0, k0, qp, kp, window)
    if whole is not None:
        return whole
    q_runs, k_runs = _consecutive_runs(qp), _consecutive_runs(kp)
    if len(q_runs) * len(k_runs) > max_runs:
        return _tile_plan(q0, k0, qp, kp, window)
    plan = []
    for a, b in q_runs:
        for c, e in k_runs:
            part = _bands(q0 + a, k0 + c, qp[a:b], kp[c:e], window)
            plan.extend(part if part is not None
                        else _tile_plan(q0 + a, k0 + c, qp[a:b], kp[c:e], window))
    return plan


def _bands(q0, k0, qp, kp, window: int) -> Optional[List[DocBlock]]:
    """qp x kp under the causal window as band blocks, or None where no window fits."""
    lo = torch.searchsorted(kp, qp - window + 1)    # first key each query sees
    hi = torch.searchsorted(kp, qp, right=True)     # one past its last
    rows = (hi > lo).nonzero().flatten()
    plan = []
    for i, j in (_consecutive_runs(rows) if len(rows) else []):
        a, b = int(rows[i]), int(rows[j - 1]) + 1  # runs of rows that see something
        pieces = fit_band(lo[a:b], hi[a:b])
        if pieces is None:
            return None
        for r0, r1, c0, c1, win in pieces:
            blk = (q0 + a + r0, q0 + a + r1, k0 + c0, k0 + c1)
            if win is None:
                plan.append(DocBlock(*blk, False, None))
            elif win == (-1, 0) and r1 - r0 == c1 - c0:  # the square causal diagonal
                plan.append(DocBlock(*blk, True, None))
            else:
                plan.append(DocBlock(*blk, False, None, win))
    return plan


def _tile_plan(q0, k0, qp, kp, window: int) -> List[DocBlock]:
    """Per tile of `window` query rows (at least 32), the keys with a visible pair under the
    causal window, as one kernel call: unmasked when every pair is visible, the kernel's
    causal on the same positions when the window hides none of the causal pairs, else the
    band as an explicit (tile, <= tile + window) mask. Tiling keeps the masks (and the
    host work) O(rows x window), never O(rows x keys)."""
    tile = max(window, 32)
    plan = []
    for t0 in range(0, len(qp), tile):
        tq = qp[t0:t0 + tile]
        # keys at positions [first query - window + 1, last query]: a column range
        c = int(torch.searchsorted(kp, tq[0] - window + 1))
        e = int(torch.searchsorted(kp, tq[-1], right=True))
        if c >= e:
            continue
        diff = tq[:, None] - kp[None, c:e]
        vis = (diff >= 0) & (diff < window)
        # one block per run of rows that see something (no kernel gets a blind row)
        rows = vis.any(dim=1).nonzero().flatten()
        for i, j in (_consecutive_runs(rows) if len(rows) else []):
            a, b = int(rows[i]), int(rows[j - 1]) + 1
            sub = vis[a:b]
            cols = sub.any(dim=0).nonzero().flatten()
            c2, e2 = int(cols[0]), int(cols[-1]) + 1
            sub = sub[:, c2:e2]
            blk = (q0 + t0 + a, q0 + t0 + b, k0 + c + c2, k0 + c + e2)
            if sub.all():
                plan.append(DocBlock(*blk, False, None))
            elif b - a == e2 - c2 and torch.equal(tq[a:b], kp[c + c2:c + e2]) \
                    and torch.equal(sub, torch.ones_like(sub).tril()):
                plan.append(DocBlock(*blk, True, None))
            else:
                plan.append(DocBlock(*blk, False, sub.clone()))
    return plan


def _consecutive_runs(pos: torch.Tensor):
    """[(first, last + 1)] row ranges of pos whose positions go up by exactly one."""
    cuts = [0, *((torch.diff(pos) != 1).nonzero().flatten() + 1).tolist(), len(pos)]
    return list(zip(cuts[:-1], cuts[1:]))


def _causal_part(q0: int, k0: int, qp: torch.Tensor, kp: torch.Tensor,
                 max_runs: int = 4) -> List[DocBlock]:
    """The causal pairs of one document's queries (positions qp, rows from q0) and keys (kp,
    rows from k0), as unmasked kernel calls where possible:

    - a staircase (striped; a document a layout cuts once): full + causal + full calls;
    - else, when both sides are a few runs of consecutive positions (zigzag's two chunks
      give two each), one block per (query run, key run): each is full, skipped, or the
      same positions (causal), since runs of distinct chunks never interleave;
    - else one explicitly masked block.

    O(rows log keys) host work: each row's visible keys are a prefix of kp (positions
    ascend), counted by binary search; a (rows, keys) mask is made only for the last case.
    """
    stairs = _staircase(q0, k0, _seen(qp, kp), len(kp))
    if stairs is not None:
        return stairs
    q_runs, k_runs = _consecutive_runs(qp), _consecutive_runs(kp)
    if len(q_runs) * len(k_runs) <= max_runs:
        blocks = []
        for a, b in q_runs:
            for c, d in k_runs:
                cnt = _seen(qp[a:b], kp[c:d])
                if int(cnt[0]) == d - c:  # counts never decrease: all rows see all keys
                    blocks.append(DocBlock(q0 + a, q0 + b, k0 + c, k0 + d, False, None))
                elif int(cnt[-1]) > 0:
                    blocks.extend(_staircase(q0 + a, k0 + c, cnt, d - c)
                                  or [DocBlock(q0 + a, q0 + b, k0 + c, k0 + d, False,
                                               kp[None, c:d] <= qp[a:b, None])])
        return blocks
    return [DocBlock(q0, q0 + len(qp), k0, k0 + len(kp), False, kp[None, :] <= qp[:, None])]


def _seen(qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    """How many keys (ascending positions kp) each query (ascending qp) sees causally:
    row i sees exactly kp[:count[i]]. Non-decreasing."""
    return torch.searchsorted(kp, qp, right=True)


def _staircase(q0: int, k0: int, cnt: torch.Tensor, S: int) -> Optional[List[DocBlock]]:
    """Rows that see keys [0, cnt[i]) of S as unmasked kernel calls, when they see 0, ...,
    m, m+1, ..., all keys one more per row (what striped, and documents cut by a layout,
    mostly give): rows seeing nothing dropped, a full block of the keys every row sees,
    the kernel's causal square on the diagonal, a full block of the rows that see
    everything. None when the counts are not that shape (the caller then masks
    explicitly)."""
    L = len(cnt)
    a = int((cnt == 0).sum())                  # rows [0, a) see nothing
    b = L - int((cnt == S).sum())              # rows [b, L) see everything
    mid = cnt[a:b]
    if a >= b:  # no staircase part: rows see nothing or everything
        return [] if b == L else [DocBlock(q0 + b, q0 + L, k0, k0 + S, False, None)]
    if not torch.equal(mid, mid[0] + torch.arange(b - a, dtype=mid.dtype)):
        return None
    m = int(mid[0])  # row a sees keys [0, m); row a + i sees [0, m + i)
    blocks = []
    if m > 1:
        blocks.append(DocBlock(q0 + a, q0 + b, k0, k0 + m - 1, False, None))
    blocks.append(DocBlock(q0 + a, q0 + b, k0 + m - 1, k0 + m - 1 + b - a, True, None))
    if b < L:
        blocks.append(DocBlock(q0 + b, q0 + L, k0, k0 + S, False, None))
    return blocks


def document_positions(cu_seqlens, positions: torch.Tensor) -> torch.Tensor:
    """(B, T/cp) RoPE positions restarting at 0 in each document: global position minus its
    document's start, per sample (cu_seqlens as for attention; positions (T/cp,) global)."""
    cus = cu_seqlens if isinstance(cu_seqlens, (list, tuple)) else [cu_seqlens]
    out = []
    for cu in cus:
        cu = cu.to(positions.device, torch.int64)
        out.append(positions - cu[doc_ids(cu, positions)])
    return torch.stack(out)


def reference_mask(cu: torch.Tensor, seq_len: int, causal: bool) -> torch.Tensor:
    """(seq_len, seq_len) bool: the dense document mask, for tests and references."""
    ids = doc_ids(cu, torch.arange(seq_len))
    mask = ids[:, None] == ids[None, :]
    return mask & torch.ones(seq_len, seq_len, dtype=torch.bool).tril() if causal else mask


def pack_cu_seqlens(cus, seq_len: int) -> torch.Tensor:
    """Per-sample cu_seqlens as one fixed-shape (B, seq_len + 1) int32 tensor, -1 after each
    sample's boundaries: what a pipeline stage sends the next (DeepSpeed's pipeline fixes
    every tensor's shape at the first micro-batch; a sample has at most seq_len documents)."""
    out = torch.full((len(cus), seq_len + 1), -1, dtype=torch.int32)
    for b, cu in enumerate(cus):
        out[b, :len(cu)] = cu
    return out


# The last packed tensor unpacked (a weak reference and its version counter, which any
# in-place write bumps) and its boundaries: every block of a pipeline stage gets the same
# tensor object for a micro-batch (models/gpt_pipe.py passes it along unchanged; DeepSpeed
# 0.19.8 clones what it loads or receives, so each micro-batch brings a new object).
_last_unpacked: Tuple[Optional[weakref.ref], int, List[torch.Tensor]] = (None, 0, [])


def unpack_cu_seqlens(packed: torch.Tensor) -> List[torch.Tensor]:
    """pack_cu_seqlens's inverse: the list of B int32 boundary tensors, on the host.

    A packed tensor on a GPU costs one blocking device-to-host copy, so it is made once per
    tensor, not once per layer: the result for the last tensor seen is kept (the blocks of
    a stage run one micro-batch's forward one after another; a recomputed block reuses the
    boundaries it was given). A stage still pays one copy per micro-batch: DeepSpeed's
    pipeline hands a stage its inputs as device tensors.
    """
    global _last_unpacked
    ref, version, cus = _last_unpacked
    if ref is not None and ref() is packed and version == packed._version:
        return cus
    host = packed.cpu()
    cus = [row[row >= 0] for row in host]
    _last_unpacked = (weakref.ref(packed), packed._version, cus)
    return cus
