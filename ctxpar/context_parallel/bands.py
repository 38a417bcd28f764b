"""flash-attn's ``window_size`` on one block: what it shows, and a block's band as window calls.

flash-attn (>= 2.1) and FlashAttention-4 align a block of L queries and S keys at the
bottom right: with ``window_size=(left, right)`` query row i sees key column j iff

    i + S - L - left  <=  j  <=  i + S - L + right          (-1 / None: no limit that side)

(flash-attn csrc/flash_attn/src/mask.h ``apply_mask_local``: col_idx_limit_left/right;
flash_attn/cute/mask.py: local_row_offset_left/right). ``causal`` is (left -1, right 0).
flash-attn 2 also rewrites its arguments before the kernel (flash_api.cpp mha_fwd/mha_bwd,
v2.5 .. v2.8): a side >= S becomes -1, and in set_params_fprop a -1 side opposite a set
one becomes S, so "right -1" there still ends row i at i + 2S - L (not at S - 1 when
L > S + 1). FlashAttention-4 takes None for "no limit" and rewrites nothing but
(None, 0) into causal (interface.py ``_resolve_causal_local_window``). ``band_rows``
implements both; a window is used only where both show exactly the block's pairs.

A causal sliding window over two runs of positions that go up by the same step (one
rank's contiguous rows, a zigzag chunk, striped's every P-th token) leaves each query an
interval of keys whose ends move one key per row: such a band is one window call
(``fit_band``), or, when some rows see every key of the block, three (the rows before,
the rows seeing all, unwindowed, the rows after), so that no flash-attn 2 rewrite bites.
Windows here use flash-attn 2's convention: (left, right) ints, -1 = no limit.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

import torch

Window = Tuple[int, int]


def band_rows(L: int, S: int, window: Window, flash_attn2: bool = True,
              device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): row i of an (L, S) block under ``window`` sees key columns [lo[i], hi[i])
    (hi <= lo: none). flash_attn2: with flash-attn 2's argument rewrites; else
    FlashAttention-4's (-1 there is passed as None)."""
    left, right = window
    if flash_attn2:
        left, right = (-1 if left >= S else left), (-1 if right >= S else right)
        if left < 0 and right < 0:  # not local: every pair
            i = torch.zeros(L, dtype=torch.long, device=device)
            return i, i + S
        left, right = (S if left < 0 else left), (S if right < 0 else right)
    i = torch.arange(L, device=device)
    lo = (i + S - L - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + 1 + S - L + right).clamp(max=S) if right >= 0 else torch.full_like(i, S)
    return lo, hi


def band_mask(L: int, S: int, window: Window, device=None) -> torch.Tensor:
    """(L, S) bool, True = visible: the pairs flash-attn 2 computes under ``window``."""
    lo, hi = band_rows(L, S, window, device=device)
    j = torch.arange(S, device=device)
    return (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])


@lru_cache(maxsize=4096)
def band_pairs(L: int, S: int, window: Window) -> int:
    """How many (query, key) pairs an (L, S) block under ``window`` computes."""
    lo, hi = band_rows(L, S, window)
    return int((hi - lo).clamp(min=0).sum())


def _shows(L: int, S: int, window: Window, lo, hi) -> bool:
    """Whether flash-attn 2 and FlashAttention-4 both show exactly rows [lo, hi)."""
    return all(torch.equal(torch.stack(band_rows(L, S, window, fa2)), torch.stack((lo, hi)))
               for fa2 in (True, False))


def fit_band(lo: torch.Tensor, hi: torch.Tensor
             ) -> Optional[List[Tuple[int, int, int, int, Optional[Window]]]]:
    """Rows whose visible keys are columns [lo[i], hi[i]) (each row sees one at least) as
    flash-attn window calls: [(row0, row1, col0, col1, window)], window None where every
    pair of the piece is visible; None when no window expresses them (the caller masks).

    The window is read off the rows that pin it: the last row's first key gives left
    (its distance to the bottom-right diagonal S - 1), the first row's last key gives
    right (its distance past the diagonal S - L); then every row is checked.
    """
    L = len(lo)
    c0, c1 = int(lo.min()), int(hi.max())
    S = c1 - c0
    lo, hi = lo - c0, hi - c0
    full = (lo == 0) & (hi == S)
    if bool(full.all()):
        return [(0, L, c0, c1, None)]
    left = -1 if int(lo[-1]) == 0 else S - 1 - int(lo[-1])
    right = -1 if int(hi[0]) == S else int(hi[0]) - 1 - (S - L)
    if min(left, right) >= -1 and _shows(L, S, (left, right), lo, hi):
        return [(0, L, c0, c1, (left, right))]
    rows = full.nonzero().flatten()
    if not len(rows) or int(rows[-1]) - int(rows[0]) + 1 != len(rows):
        return None
    a, b = int(rows[0]), int(rows[-1]) + 1  # rows [a, b) see every key
    pieces = [(a, b, c0, c1, None)]
    for r0, r1 in ((0, a), (b, L)):
        if r0 < r1:
            sub = fit_band(lo[r0:r1], hi[r0:r1])
            if sub is None:
                return None
            pieces += [(r0 + s0, r0 + s1, c0 + k0, c0 + k1, w) for s0, s1, k0, k1, w in sub]
    return sorted(pieces)
