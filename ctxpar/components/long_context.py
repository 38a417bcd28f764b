"""Does a model use its context? Task scores by CP generation and the loss by position.

    grid = task_grid(tokenizer, ["needle"], lengths, depths, samples=4)
    cells = run_tasks(model, tokenizer, grid, layout=..., cp_group=..., tp_group=...)
    plot_heatmap(cells, "heatmap.png")                      # length x depth, the classic
    buckets = loss_by_position(model, samples, layout=..., cp_group=..., tp_group=...)
    plot_loss_by_position(buckets, "loss_by_position.png")

Tasks come from ctxpar/data/long_context.py and are answered greedily by the KV-cached
CP generation (ctxpar/inference: the training ring's prefill, the LSE-merged decode), so a
cell's score is the same at every tp x cp (tested at cp 1, 2 and 3). The loss by position
runs the model over whole held-out samples and buckets each token's loss by its position
in log2 steps (1, 2-3, 4-7, ...): a model that uses its context has a loss falling with
the position, and a context extension shows where that stops. Its head is the tiled
evaluation head (memory/tiled_eval.py): no whole (tokens, V/tp) logits.

The model is any ctxpar.interfaces.CausalLM; collective over its CP and TP groups.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..context_parallel.comm import group_rank_and_size
from ..context_parallel.layouts import num_chunks, sequence_positions, shard_sequence
from ..data.long_context import Haystack, Task, make_task
from ..inference import generate
from ..memory.tiled_eval import tiled_eval_head
from ..tensor_parallel.cross_entropy import IGNORE_INDEX


@dataclass
class Cell:
    task: str
    length: int
    depth: float
    score: float          # mean over the cell's samples of Task.score
    samples: int
    completions: List[str]


def max_new_tokens(task: Task, tokenizer) -> int:
    """Room for every answer, comma-separated, and a little more."""
    return len(tokenizer.encode(", ".join(task.answers))) + 2


def task_grid(tokenizer, tasks: Sequence[str], lengths: Sequence[int],
              depths: Sequence[float], samples: int, haystack: Haystack = None,
              seed: int = 0, n: int = 4, digits: int = 2) -> List[List[Task]]:
    """Every task at every length x depth, `samples` prompts per cell (seeds seed..): pure,
    so an entry point makes them (and refuses a length too short) before any collective."""
    haystack = haystack or Haystack.filler(tokenizer, seed)
    return [[make_task(name, tokenizer, haystack, length, depth, seed + i, n, digits)
             for i in range(samples)]
            for name in tasks for length in lengths for depth in depths]


def run_tasks(model, tokenizer, grid: List[List[Task]], *, layout: str, cp_group=None,
              tp_group=None) -> List[Cell]:
    """Each cell of task_grid answered greedily, one generate call per cell."""
    cells = []
    for ts in grid:
        new = max(max_new_tokens(t, tokenizer) for t in ts)
        out = generate(model, [t.prompt for t in ts], new, layout=layout, cp_group=cp_group,
                       tp_group=tp_group, eos_id=tokenizer.eos_id, max_positions=None)
        texts = [tokenizer.decode(tok) for tok in out.tokens]
        score = sum(t.score(c) for t, c in zip(ts, texts)) / len(ts)
        cells.append(Cell(ts[0].name, ts[0].length, ts[0].depth, score, len(ts), texts))
    return cells


def cells_table(cells: List[Cell]) -> str:
    """A markdown table: one row per task and length, one column per depth."""
    depths = sorted({c.depth for c in cells})
    lines = ["| task | length | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
             "|---|---:|" + "---:|" * len(depths)]
    rows: Dict[tuple, Dict[float, float]] = {}
    for c in cells:
        rows.setdefault((c.task, c.length), {})[c.depth] = c.score
    for (task, length), by_depth in rows.items():
        lines.append(f"| {task} | {length} | " + " | ".join(
            f"{by_depth[d]:.2f}" if d in by_depth else "" for d in depths) + " |")
    return "\n".join(lines)


def trained_length_mark(lengths: List[int], trained: Optional[int]) -> Optional[float]:
    """Where a heatmap's sorted length columns cross the trained length: x = j - 0.5
    between the last column within it and the first past it; None when no column is past
    it (or none is within it: every cell is an extrapolation, the title says so)."""
    if trained is None:
        return None
    past = [j for j, n in enumerate(lengths) if n > trained]
    return past[0] - 0.5 if past and past[0] > 0 else None


def plot_heatmap(cells: List[Cell], path: str, title: str = "",
                 trained_length: Optional[int] = None) -> None:
    """heatmap_figure(cells, title, trained_length) saved to path (PNG)."""
    import matplotlib.pyplot as plt

    fig = heatmap_figure(cells, title, trained_length)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def heatmap_figure(cells: List[Cell], title: str = "", trained_length: Optional[int] = None):
    """One panel per task: context length (x) by needle depth (y), the score in colour
    (green 1 = every answer found, red 0 = none); with trained_length (model.seq_len) a
    dashed line where the lengths pass it, said in the panel's title (a label beside the
    line would sit on the title). Constrained layout keeps the figure's title, the
    panels' titles and the colour bar apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(c.task for c in cells))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 3.8), squeeze=False,
                             layout="constrained")
    for k, (ax, task) in enumerate(zip(axes[0], tasks)):
        mine = [c for c in cells if c.task == task]
        lengths = sorted({c.length for c in mine})
        depths = sorted({c.depth for c in mine})
        grid = torch.full((len(depths), len(lengths)), float("nan"))
        for c in mine:
            grid[depths.index(c.depth), lengths.index(c.length)] = c.score
        im = ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        if k == 0:  # the panels share the rows
            ax.set_ylabel("needle depth")
        mark = trained_length_mark(lengths, trained_length)
        if mark is not None:  # right of it: longer than any sequence the model trained on
            ax.axvline(mark, color="black", linestyle="--", linewidth=1.2)
            ax.set_title(f"{task}\n(dashed: the trained {trained_length})", fontsize=10)
        elif trained_length is not None and min(lengths) > trained_length:
            ax.set_title(f"{task}\n(all past the trained {trained_length})", fontsize=10)
        else:
            ax.set_title(task)
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not math.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="score")
    if title:
        fig.suptitle(title)
    return fig


@dataclass
class Bucket:
    first: int      # positions first..last (0-based) of the full sequence
    last: int
    loss: float     # mean token loss there
    tokens: int


def position_buckets(seq_len: int) -> List[tuple]:
    """[(0, 0), (1, 2), (3, 6), ...]: positions p with floor(log2(p + 1)) = k."""
    out, k = [], 0
    while 2 ** k - 1 < seq_len:
        out.append((2 ** k - 1, min(2 ** (k + 1) - 2, seq_len - 1)))
        k += 1
    return out


@torch.no_grad()
def loss_by_position(model, inputs: torch.Tensor, *, layout: str, cp_group=None,
                     tp_group=None, tile_tokens="auto") -> List[Bucket]:
    """Mean next-token loss per log2 position bucket over held-out samples.

    inputs (N, T) full token sequences, cut to the longest length the layout divides;
    every token but the last is scored against the next one. Each CP rank scores its layout
    shard; the bucket sums are all-reduced over CP (TP ranks hold the same losses)."""
    T = inputs.shape[1] - inputs.shape[1] % num_chunks(group_rank_and_size(cp_group)[1],
                                                         layout)
    inputs = inputs[:, :T]
    N = inputs.shape[0]
    labels = torch.cat([inputs[:, 1:], torch.full((N, 1), IGNORE_INDEX)], dim=1)
    device = next(model.parameters()).device
    pos = sequence_positions(T, cp_group, layout, device)                # (T/cp,)
    tok = shard_sequence(inputs.to(device), 1, cp_group, layout)
    lab = shard_sequence(labels.to(device), 1, cp_group, layout)
    x = model.hidden_states(tok, pos)                                    # (N, T/cp, d)
    losses, _ = tiled_eval_head(x, model.head_weight(), lab, tp_group, tile_tokens)
    spans = position_buckets(T)
    which = torch.floor(torch.log2(pos.double() + 1)).long()             # (T/cp,) bucket
    valid = (lab != IGNORE_INDEX).double()                               # (N, T/cp)
    sums = torch.zeros(2, len(spans), dtype=torch.float64, device=device)
    sums[0].index_add_(0, which, (losses.double() * valid).sum(0))
    sums[1].index_add_(0, which, valid.sum(0))
    if group_rank_and_size(cp_group)[1] > 1:
        dist.all_reduce(sums, group=cp_group)
    return [Bucket(a, b, float(s / max(c, 1)), int(c))
            for (a, b), s, c in zip(spans, sums[0].tolist(), sums[1].tolist()) if c > 0]


def plot_loss_by_position(buckets: List[Bucket], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    mid = [(b.first + b.last) / 2 + 1 for b in buckets]
    ax.plot(mid, [b.loss for b in buckets], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position (log2 buckets)")
    ax.set_ylabel("mean next-token loss")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def as_json(cells: List[Cell], buckets: List[Bucket]) -> Dict:
    return {"tasks": [asdict(c) for c in cells], "loss_by_position": [asdict(b) for b in buckets]}


def default_lengths(seq_len: int, room: int) -> List[int]:
    """A quarter, half, three quarters and all of seq_len, less `room` for the answer."""
    top = seq_len - room
    return sorted({max(16, top * k // 4) for k in (1, 2, 3)} | {top})


class LongContextEval:
    """train.py's long_context_eval: its task grid answered at every evaluation, the cells
    shared out over the DP ranks (each answers all when an EP group spans DP ranks),
    logged as metrics (lc_<task>: the mean score; per length lc_<task>_<length>) and, on
    rank 0, a heatmap PNG under run_dir/long_context/ that goes to wandb with a table of
    the cells."""

    def __init__(self, cfg, tokenizer):
        """Pure: makes every prompt now (DataError, e.g. a length too short for a task),
        so train.py refuses before any collective."""
        lc, m = cfg.long_context_eval, cfg.model
        self.cfg, self.tokenizer = cfg, tokenizer
        digits = lc.digits or (cfg.data.passkey_digits if cfg.data.kind == "passkey" else 4)
        self.lengths = lc.lengths or default_lengths(m.seq_len, lc.needles * (digits + 2) + 4)
        self.grid = task_grid(tokenizer, lc.tasks, self.lengths, lc.depths, lc.samples,
                              seed=cfg.train.seed, n=lc.needles, digits=digits)

    @torch.no_grad()
    def run(self, model, state, step: int, logger) -> Dict[str, float]:
        """Collective over the grid: every rank calls it."""
        was_training = model.training
        model.eval()
        # The cells shared out over DP, unless a mixture of experts' EP group reaches over
        # DP ranks (ep not dividing cp): its all-to-alls need every member to run as many
        # forwards, which DP ranks answering other cells (more cells, longer answers, an
        # early stop at EOS) do not; every DP rank then answers every cell.
        ep = state.ep_size
        share = state.dp_size if ep == 1 or state.cp_size % ep == 0 else 1
        mine = list(range(state.dp_rank % share, len(self.grid), share))  # this DP rank's
        got = run_tasks(model, self.tokenizer, [self.grid[i] for i in mine],
                        layout=self.cfg.parallel.layout, cp_group=state.cp_group,
                        tp_group=state.tp_group)
        model.train(was_training)
        parts = [None] * state.dp_size
        if share > 1:
            dist.all_gather_object(parts, list(zip(mine, got)), group=state.dp_group)
        else:
            parts = [list(zip(mine, got))]
        cells = [c for _, c in sorted((p for part in parts for p in part),
                                      key=lambda p: p[0])]
        metrics, means = {"step": step}, {}
        for task in dict.fromkeys(c.task for c in cells):
            of_task = [c for c in cells if c.task == task]
            means[task] = metrics[f"lc_{task}"] = sum(c.score for c in of_task) / len(of_task)
            for n in self.lengths:
                at = [c.score for c in of_task if c.length == n]
                metrics[f"lc_{task}_{n}"] = sum(at) / len(at)
        logger.log(metrics)
        if logger.enabled:
            folder = os.path.join(self.cfg.logging.run_dir, "long_context")
            os.makedirs(folder, exist_ok=True)
            png = os.path.join(folder, f"step_{step:08d}.png")
            plot_heatmap(cells, png, f"step {step}", self.cfg.model.seq_len)
            with open(os.path.join(folder, f"step_{step:08d}.json"), "w") as f:
                json.dump(as_json(cells, []), f, indent=1)
            logger.write(f"step {step}: long context " + ", ".join(
                f"{task} {v:.2f}" for task, v in means.items()) + f" ({png})")
            if logger.wandb is not None:
                import wandb
                table = wandb.Table(columns=["task", "length", "depth", "score"],
                                    data=[[c.task, c.length, c.depth, c.score] for c in cells])
                logger.wandb.log({"long_context/heatmap": wandb.Image(png),
                                  "long_context/cells": table}, step=step)
        return metrics
