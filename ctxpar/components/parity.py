"""Parity between two layouts of one run: tolerance budgets, the comparison, the verdict.

What verify.py (at the repository root) reports: each step's loss, every parameter's
gradient and every attention core's output of a run at its layout against the same run
at a reference layout, as relative differences held to a budget per dtype and ring size.

    budget = parity_budget("bf16", ring_size=4)
    rows = [compare(step, "layers.0.attn.q_proj.weight", "grad", got, want, budget), ...]
    print(format_table(rows)); line, code = verdict(rows)      # code 0 pass, 1 fail

The budgets (why, in docs/parallelism.md, "Verify"; what CPU runs measure against them,
in docs/benchmarks.md):

- fp32: the two layouts compute the same sums in another order (the LSE merge of the
  ring's blocks, TP's partial sums, the DP x CP all-reduce), each term rounded at 2^-24
  relative, so they differ by a few multiples of that. The budgets sit about two orders
  of magnitude above, and orders below what a wrong mask, a lost or misweighted block or
  a wrong reduction gives.
- bf16 (and fp16): each layout rounds at 2^-8 relative at other points (every matmul
  output; the weight gradients' partial sums over a rank's T/cp tokens before the
  all-reduce; each attention block's output): the floor is a few bf16 roundings, about
  1e-3 to 1e-2 relative, and the budgets sit a few times above it. The attention output
  and the loss do not grow with the ring: the blocks merge in fp32 (merge.py) and each
  block's rounding enters a weighted mean whose weights sum to 1. The gradients may: with
  parallel.ring_grad_dtype bf16 the travelling dK, dV are rounded once per hop, and
  independent roundings add up as sqrt(hops), so the gradients' 16-bit budget is a base
  times sqrt(ring size), the number of blocks a query row's keys come in (cp for ring and
  all-gather, the ring degree cp/u for hybrid, 1 for Ulysses). A subtle attention bug
  can hide under 16-bit budgets: fp32's are the sharp check (the docs: verify in fp32 first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch

KINDS = ("loss", "grad", "attn")

# Relative differences allowed at ring size 1, per dtype and kind (the module docstring);
# at 16 bits the gradients' grows as sqrt(ring size).
BASE_BUDGETS: Dict[str, Dict[str, float]] = {
    "fp32": {"loss": 1e-5, "grad": 1e-4, "attn": 1e-5},
    "bf16": {"loss": 1e-2, "grad": 5e-2, "attn": 1e-2},
}


def precision_of(ds_config: dict) -> str:
    """'bf16' when the deepspeed section trains in bf16 or fp16 (16-bit budgets), else 'fp32'."""
    for key in ("bf16", "fp16"):
        if (ds_config.get(key) or {}).get("enabled"):
            return "bf16"
    return "fp32"


def ring_size(cp: int, cp_comm: str, ulysses: int = 1) -> int:
    """How many blocks a query row's keys come in: cp for the ring and all-gather, the
    ring degree cp/u for hybrid, 1 for Ulysses (one block over the gathered sequence)."""
    if cp_comm == "ulysses":
        return 1
    return cp // ulysses if cp_comm == "hybrid" else cp


def parity_budget(precision: str, ring_size: int, scale: float = 1.0) -> Dict[str, float]:
    """{kind: allowed relative difference}: fp32 flat; 16-bit gradients growing as
    sqrt(ring_size); ``scale`` multiplies all (verify.py --budget-scale)."""
    if precision not in BASE_BUDGETS:
        raise ValueError(f"precision={precision!r} must be one of {sorted(BASE_BUDGETS)}")
    grow = 1.0 if precision == "fp32" else math.sqrt(max(1, ring_size))
    return {kind: b * (grow if kind == "grad" else 1.0) * scale
            for kind, b in BASE_BUDGETS[precision].items()}


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64 (0 when both are zero, inf when only want is)."""
    got, want = got.detach().double().flatten(), want.detach().double().flatten()
    if got.shape != want.shape:
        return math.inf
    diff, norm = torch.linalg.vector_norm(got - want).item(), torch.linalg.vector_norm(want).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


@dataclass(frozen=True)
class Row:
    """One compared tensor: its step (1-based), name, kind ('loss', 'grad', 'attn'), the
    relative difference and the budget it is held to."""

    step: int
    name: str
    kind: str
    diff: float
    budget: float

    @property
    def ok(self) -> bool:
        return self.diff <= self.budget  # NaN and inf fail

    @property
    def ratio(self) -> float:
        """diff / budget: above 1 fails; the worst row has the largest."""
        return math.inf if math.isnan(self.diff) else self.diff / self.budget


def compare(step: int, name: str, kind: str, got, want, budget: Dict[str, float]) -> Row:
    """A Row for a tensor (relative L2) or a loss (relative |got - want| / |want|)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    return Row(step, name, kind, relative_l2(torch.as_tensor(got), torch.as_tensor(want)),
               budget[kind])


def worst(rows: Iterable[Row]) -> Row:
    return max(rows, key=lambda r: r.ratio)


def format_table(rows: List[Row], every_row: bool = True) -> str:
    """One line per row: step, kind, name, relative difference, budget, ok/FAIL; without
    every_row, one line per kind: its worst row and how many of its rows fail."""
    width = max([len(r.name) for r in rows] + [6])
    head = f"{'step':>4}  {'kind':<4}  {'tensor':<{width}}  {'rel diff':>9}  {'budget':>9}  ok"
    if not every_row:
        lines = [head + "  (the worst of each kind)"]
        for kind in KINDS:
            of_kind = [r for r in rows if r.kind == kind]
            if of_kind:
                r, failed = worst(of_kind), sum(not x.ok for x in of_kind)
                lines.append(f"{r.step:>4}  {r.kind:<4}  {r.name:<{width}}  {r.diff:>9.2e}  "
                             f"{r.budget:>9.2e}  {'ok' if r.ok else 'FAIL'}  "
                             f"({len(of_kind)} compared, {failed} over budget)")
        return "\n".join(lines)
    lines = [head]
    for r in rows:
        lines.append(f"{r.step:>4}  {r.kind:<4}  {r.name:<{width}}  {r.diff:>9.2e}  "
                     f"{r.budget:>9.2e}  {'ok' if r.ok else 'FAIL'}")
    return "\n".join(lines)


def verdict(rows: List[Row]) -> Tuple[str, int]:
    """(one line, exit code): 0 when every row is within its budget, 1 naming the worst."""
    if not rows:
        return "verify: FAIL: nothing was compared", 1
    w = worst(rows)
    failed = [r for r in rows if not r.ok]
    where = f"{w.kind} {w.name} at step {w.step}: rel diff {w.diff:.2e}, budget {w.budget:.2e}"
    if failed:
        return (f"verify: FAIL: {len(failed)} of {len(rows)} tensors over budget; worst "
                f"{where}"), 1
    return f"verify: PASS: {len(rows)} tensors within budget; closest {where}", 0
