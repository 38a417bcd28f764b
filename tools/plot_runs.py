"""Loss, eval and tokens/s curves of one or more runs (their metrics.jsonl) in one PNG.

    python tools/plot_runs.py runs/tiny_cpu                        # -> runs/tiny_cpu/curves.png
    python tools/plot_runs.py runs/a runs/b --labels zigzag striped --out compare.png

A run is its run_dir (logging.run_dir) or the metrics.jsonl itself. Panels: training loss,
eval loss (and passkey accuracy where the run has it), tokens/s, all against the step;
one colour per run. Bad input (a missing or empty file, labels that do not match) exits 2
with one line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List


def read_metrics(path: str) -> Dict[str, List]:
    """{'train': [(step, loss, tokens_per_s)], 'eval': [(step, eval_loss, accuracy|None)]}."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file (a run_dir with metrics.jsonl, or the file)")
    train, evals = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if "loss" in row:
                train.append((row["step"], row["loss"], row.get("tokens_per_s")))
            if "eval_loss" in row:
                evals.append((row["step"], row["eval_loss"], row.get("eval_accuracy")))
    if not train and not evals:
        raise ValueError(f"{path}: no training or eval rows")
    return {"train": train, "eval": evals}


def plot(runs: Dict[str, Dict[str, List]], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eval, ax_tps) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_acc = None
    for i, (label, m) in enumerate(runs.items()):
        color = f"C{i}"
        if m["train"]:
            steps, loss, tps = zip(*m["train"])
            ax_loss.plot(steps, loss, color=color, label=label)
            pts = [(s, t) for s, t in zip(steps, tps) if t is not None]
            if pts:
                ax_tps.plot(*zip(*pts), color=color, label=label)
        if m["eval"]:
            steps, loss, acc = zip(*m["eval"])
            ax_eval.plot(steps, loss, "o-", color=color, label=f"{label} loss")
            if any(a is not None for a in acc):
                ax_acc = ax_acc or ax_eval.twinx()
                ax_acc.plot([s for s, a in zip(steps, acc) if a is not None],
                            [a for a in acc if a is not None], "s--", color=color,
                            label=f"{label} accuracy")
    ax_loss.set(title="training loss", xlabel="step", yscale="log")
    ax_eval.set(title="eval", xlabel="step", ylabel="eval loss")
    ax_tps.set(title="throughput", xlabel="step", ylabel="tokens/s")
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_eval.grid(alpha=0.3)
    handles, names = ax_eval.get_legend_handles_labels()
    if ax_acc is not None:  # squares, dashed: accuracy on the right axis
        ax_acc.set(ylabel="passkey accuracy", ylim=(0, 1.02))
        more = ax_acc.get_legend_handles_labels()
        handles, names = handles + more[0], names + more[1]
    if handles:
        ax_eval.legend(handles, names, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run_dir or metrics.jsonl, one or more")
    p.add_argument("--labels", nargs="*", help="one per run (default: the run_dir names)")
    p.add_argument("--out", help="PNG (default: curves.png in the first run's directory)")
    a = p.parse_args(argv)
    try:
        if a.labels and len(a.labels) != len(a.runs):
            raise ValueError(f"--labels: {len(a.labels)} given for {len(a.runs)} runs")
        labels = a.labels or [os.path.basename(os.path.normpath(
            r if os.path.isdir(r) else os.path.dirname(os.path.abspath(r)))) for r in a.runs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"runs share a label ({', '.join(labels)}): give --labels")
        runs = {lab: read_metrics(r) for lab, r in zip(labels, a.runs)}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = a.runs[0] if os.path.isdir(a.runs[0]) else os.path.dirname(a.runs[0])
    print(plot(runs, a.out or os.path.join(first, "curves.png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
