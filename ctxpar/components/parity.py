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
- The rounding floor (gradients only): a gradient that is a sum of many terms which largely
  cancel (a Gated DeltaNet's A_log, dt_bias: one scalar per head summed over every token)
  is ill-conditioned: its relative rounding is eps times (the sum of the terms' magnitudes
  over the magnitude of their sum), far above eps, and Adam turns a near-zero gradient's
  rounding into a whole +-lr step, so any rounding difference upstream (another summation
  order) moves it by more than the flat budget. verify.py then measures it: the reference
  layout run again from weights moved by PERTURBATION roundings (perturb_weights_), twice
  (PERTURBED_RUNS, other signs), the gradient's own movement is the noise, and
  FLOOR_FACTOR times the largest movement at this step or an earlier one is that tensor's
  floor (rounding_noise: after step 1 the runs' weights differ by Adam's steps on
  rounding-decided signs, which a single sample of one step may miss). The conditioning
  scales the noise as it scales the layouts' difference; a bug is not rounding and stays
  above (a lost state, a wrong merge: O(1) of the outputs, held to the flat budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Tuple

import torch

KINDS = ("loss", "grad", "attn")

# Relative differences allowed at ring size 1, per dtype and kind (the module docstring);
# at 16 bits the gradients' grows as sqrt(ring size).
BASE_BUDGETS: Dict[str, Dict[str, float]] = {
    "fp32": {"loss": 1e-5, "grad": 1e-4, "attn": 1e-5},
    "bf16": {"loss": 1e-2, "grad": 5e-2, "attn": 1e-2},
}
# The unit roundoff of each precision's arithmetic; the perturbation that measures a
# gradient's rounding floor moves every weight by PERTURBATION units of it (a multiple,
# so that each weight really changes: 1 + u rounds back to 1); a floor is FLOOR_FACTOR
# times the movement it causes (one sample of rounding noise against another, the
# layouts', whose reorderings are more: docs/parallelism.md, "Verify").
ROUNDING = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -9}
PERTURBATION = 4.0
PERTURBED_RUNS = 2
FLOOR_FACTOR = 20.0


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
    relative difference, the flat budget and the tensor's rounding floor (0 when not
    measured: with_floors); it is held to the larger."""

    step: int
    name: str
    kind: str
    diff: float
    budget: float
    floor: float = 0.0

    @property
    def allowed(self) -> float:
        return max(self.budget, self.floor)

    @property
    def ok(self) -> bool:
        return self.diff <= self.allowed  # NaN and inf fail

    @property
    def by_floor(self) -> bool:
        """Over the flat budget, within the tensor's rounding floor."""
        return self.ok and self.diff > self.budget

    @property
    def ratio(self) -> float:
        """diff / allowed: above 1 fails; the worst row has the largest."""
        return math.inf if math.isnan(self.diff) else self.diff / self.allowed


def compare(step: int, name: str, kind: str, got, want, budget: Dict[str, float]) -> Row:
    """A Row for a tensor (relative L2) or a loss (relative |got - want| / |want|)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    return Row(step, name, kind, relative_l2(torch.as_tensor(got), torch.as_tensor(want)),
               budget[kind])


def rounding_noise(movements: List[Dict[Tuple[int, str], float]]
                   ) -> Dict[Tuple[int, str], float]:
    """{(step, name): noise}: the largest relative movement of the gradient over the
    perturbed runs (each a {(step, name): rel diff} against the reference) at this step
    or any earlier one (NaN counts as infinite: no floor can be trusted)."""
    noise: Dict[Tuple[int, str], float] = {}
    for step, name in sorted({k for m in movements for k in m}):
        now = max(math.inf if math.isnan(v) else v
                  for m in movements for v in [m.get((step, name), 0.0)])
        noise[(step, name)] = max(now, noise.get((step - 1, name), 0.0))
    return noise


def with_floors(rows: List[Row], noise: Dict[Tuple[int, str], float],
                factor: float = FLOOR_FACTOR) -> List[Row]:
    """rows with each gradient's floor set to factor x noise[(step, name)], the relative
    movement of the reference's own gradient under the rounding perturbation
    (rounding_noise; a missing or infinite noise sets none)."""
    out = []
    for r in rows:
        n = noise.get((r.step, r.name), 0.0) if r.kind == "grad" else 0.0
        out.append(replace(r, floor=factor * n) if math.isfinite(n) else r)
    return out


def worst(rows: Iterable[Row]) -> Row:
    return max(rows, key=lambda r: r.ratio)


def _line(r: Row, width: int) -> str:
    floor = f"{r.floor:>9.2e}" if r.floor else f"{'-':>9}"
    mark = "FAIL" if not r.ok else ("ok (floor)" if r.by_floor else "ok")
    return (f"{r.step:>4}  {r.kind:<4}  {r.name:<{width}}  {r.diff:>9.2e}  {r.budget:>9.2e}  "
            f"{floor}  {mark}")


def format_table(rows: List[Row], every_row: bool = True) -> str:
    """One line per row: step, kind, name, relative difference, budget, rounding floor
    ('-' when not measured), ok / ok (floor) / FAIL; without every_row, one line per kind:
    its worst row and how many of its rows fail and pass by their floor alone."""
    width = max([len(r.name) for r in rows] + [6])
    head = (f"{'step':>4}  {'kind':<4}  {'tensor':<{width}}  {'rel diff':>9}  {'budget':>9}  "
            f"{'floor':>9}  ok")
    if not every_row:
        lines = [head + "  (the worst of each kind)"]
        for kind in KINDS:
            of_kind = [r for r in rows if r.kind == kind]
            if of_kind:
                failed = sum(not x.ok for x in of_kind)
                floored = sum(x.by_floor for x in of_kind)
                lines.append(f"{_line(worst(of_kind), width)}  ({len(of_kind)} compared, "
                             f"{failed} over budget, {floored} within their rounding floor only)")
        return "\n".join(lines)
    return "\n".join([head] + [_line(r, width) for r in rows])


def verdict(rows: List[Row]) -> Tuple[str, int]:
    """(one line, exit code): 0 when every row is within its budget or rounding floor, 1
    naming the worst; the line says which held each: how many passed by their floor alone,
    and whether the worst failure is over a measured floor (not rounding) or over the flat
    budget with no floor measured."""
    if not rows:
        return "verify: FAIL: nothing was compared", 1
    w = worst(rows)
    failed = [r for r in rows if not r.ok]
    floored = [r for r in rows if r.by_floor]
    where = f"{w.kind} {w.name} at step {w.step}: rel diff {w.diff:.2e}, budget {w.budget:.2e}"
    if w.floor:
        where += f", rounding floor {w.floor:.2e}"
    if failed:
        outputs = any(not r.ok for r in failed if r.kind != "grad")
        why = ("over its measured rounding floor too: not rounding" if w.floor else
               "a loss or output over its flat budget too: not rounding" if outputs else
               "no rounding floor measured")
        return (f"verify: FAIL: {len(failed)} of {len(rows)} tensors over budget; worst "
                f"{where} ({why})"), 1
    if floored:
        f = max(floored, key=lambda r: r.diff / r.budget)
        return (f"verify: PASS: {len(rows)} tensors within budget, {len(floored)} gradients "
                f"only within their rounding floor (ill-conditioned sums; worst {f.name} at "
                f"step {f.step}: rel diff {f.diff:.2e}, budget {f.budget:.2e}, floor "
                f"{f.floor:.2e}); closest {where}"), 0
    return f"verify: PASS: {len(rows)} tensors within budget; closest {where}", 0
