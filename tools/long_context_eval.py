"""Long-context evaluation of a train.py checkpoint at any tp x cp: needle heatmaps,
RULER-style tasks and the loss by position, as a table, a JSON and two PNGs.

    python -m tools.long_context_eval --run-dir runs/tiny_cpu --lengths 64 128 192 255 \\
        --depths 0 0.25 0.5 0.75 1 --out runs/tiny_cpu/long_context
    torchrun --nproc_per_node 2 -m tools.long_context_eval --run-dir runs/tiny_cpu \\
        --tasks needle multikey variable_tracking --set parallel.cp=2

Tasks (ctxpar/data/long_context.py) are made with the run's tokenizer (its data.tokenizer,
or --tokenizer, as generate.py) from digit-free filler, or with --haystack heldout from the run's held-out
split (data.kind tokens); they are answered greedily by generate.py's CP generation, so a
score does not depend on tp or cp (or ep: a mixture of experts runs every expert on every
rank, or its experts split over the CP ranks with --set parallel.ep=N). The loss by
position scores --loss-samples held-out samples of the run's own data (every next
token): held-out documents of at least model.seq_len tokens, or, when it has none, its
held-out windows (said so); fewer when the split holds fewer (warned, and results.json's
loss_samples records asked, used and from where). Lengths past
model.seq_len are
allowed (how far does an extension reach?) and said so. Writes results.json,
heatmap.png and loss_by_position.png to --out; rank 0 prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from ctxpar.components.cli import add_launcher_args, fail, warn
from ctxpar.components.known_warnings import filter_known_warnings
from ctxpar.components.long_context import (as_json, cells_table, default_lengths,
                                            loss_by_position,
                                            plot_heatmap, plot_loss_by_position, run_tasks,
                                            task_grid)
from ctxpar.config import ConfigError
from ctxpar.data import DataError, build_source
from ctxpar.data.long_context import TASKS, Haystack
from ctxpar.distributed.parallel_state import launcher_env, shutdown_distributed
from ctxpar.inference.checkpoint import (CheckpointError, find_checkpoint, inspect_checkpoint,
                                         load_run_config, run_tokenizer)
from models.inference import DTYPES, layout_overrides, start_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="a train.py run directory")
    p.add_argument("--checkpoint", default="auto", help="'auto' or a tag like step_00000100")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides of the run's config (parallel.cp=2, parallel.layout=...)")
    p.add_argument("--tasks", nargs="+", default=["needle"], choices=TASKS)
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="prompt lengths in tokens (default: 1/4, 1/2, 3/4 and all of "
                        "model.seq_len minus the answer)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--samples", type=int, default=4, help="prompts per length x depth cell")
    p.add_argument("--needles", type=int, default=4,
                   help="keys of the multi-key/value/query tasks, variables of tracking")
    p.add_argument("--digits", type=int, default=None,
                   help="digits of a key (default: the run's data.passkey_digits, else 4)")
    p.add_argument("--haystack", choices=("filler", "heldout"), default="filler")
    p.add_argument("--loss-samples", type=int, default=8,
                   help="held-out samples for the loss by position (0: skip it)")
    p.add_argument("--loss-from", choices=("documents", "windows"), default=None,
                   help="documents: the first seq_len tokens of held-out documents at least "
                        "that long (a position is a position in a document); windows: the "
                        "run's held-out samples as train.py evaluates them (passkey runs: "
                        "always, each sample is one document); default: documents, else "
                        "windows when no held-out document is that long")
    p.add_argument("--seed", type=int, default=None,
                   help="the prompts' seed (default: the run's train.seed, the prompts "
                        "train.py's long_context_eval asks)")
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer.json (default: the run's data.tokenizer)")
    p.add_argument("--eos-token", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/long_context)")
    add_launcher_args(p)
    return p.parse_args(argv)


def heldout(cfg, n: int, loss_from=None):
    """((k, seq_len) tokens of the run's held-out split, where they came from): what
    train.py evaluates on ('windows': each held-out window once, k = min(n, windows) for a
    token file, whose eval stream would only cycle past them), or the first seq_len
    tokens of its documents at least that long ('documents'; None: those, else the windows
    with a warning line). k < n is warned in one line naming both counts."""
    src = build_source(cfg.data, cfg.model.seq_len, cfg.train.seed, "eval")
    docs = src.document_starts(cfg.model.seq_len, n) \
        if loss_from != "windows" and cfg.data.kind == "tokens" else None
    if docs is not None and len(docs) == 0:
        why = (f"no held-out document of {cfg.data.eval_path or cfg.data.path} holds "
               f"model.seq_len={cfg.model.seq_len} tokens")
        if loss_from == "documents":
            raise DataError(f"--loss-from documents: {why}; use --loss-from windows")
        warn(f"{why}: the loss by position is over held-out windows (as train.py "
             f"evaluates; a position is not a position in a document)")
        docs = None
    if docs is None:
        k = min(n, getattr(src, "n_windows", n))  # passkey samples never repeat
        kind, there = "windows", f"{k} window{'s' if k > 1 else ''}"
        inputs = torch.stack([torch.as_tensor(src[i][0]) for i in range(k)])
    else:
        k, kind = len(docs), "documents"
        there = f"{k} document{'s' if k > 1 else ''} of at least model.seq_len=" \
            f"{cfg.model.seq_len} tokens"
        inputs = torch.as_tensor(docs)
    if k < n:
        warn(f"--loss-samples {n}: the held-out split holds {there}: the loss by position "
             f"is over those {k} (results.json's loss_samples)")
    return inputs, kind


def main(argv=None) -> int:
    args = parse_args(argv)
    launcher_env()
    filter_known_warnings()
    world = int(os.environ["WORLD_SIZE"])

    # 1. Checkpoint, config, tokenizer, haystack: pure checks, the same verdict everywhere.
    try:
        ckpt = find_checkpoint(args.run_dir, args.checkpoint)
        cfg = load_run_config(ckpt, layout_overrides(args.set, world), world_size=world)
        files = inspect_checkpoint(ckpt.path)
        tokenizer = run_tokenizer(ckpt, cfg, args.tokenizer, args.eos_token)
        digits = args.digits or (cfg.data.passkey_digits if cfg.data.kind == "passkey" else 4)
        for name, v in (("--samples", args.samples), ("--needles", args.needles),
                        ("--digits", digits)):
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if args.loss_samples < 0:
            raise ValueError(f"--loss-samples={args.loss_samples} must be >= 0")
        lengths = args.lengths or default_lengths(cfg.model.seq_len, 4 * (digits + 2))
        seed = cfg.train.seed if args.seed is None else args.seed
        haystack = Haystack.filler(tokenizer, seed)
        if args.haystack == "heldout":
            if cfg.data.kind != "tokens":
                raise ValueError(f"--haystack heldout needs a run on data.kind=tokens, not "
                                 f"{cfg.data.kind!r}")
            haystack = Haystack.tokens(tokenizer, heldout(cfg, 1, "windows")[0][0].tolist())
        grid = task_grid(tokenizer, args.tasks, lengths, args.depths, args.samples, haystack,
                         seed, args.needles, digits)
        loss_inputs, loss_from = heldout(cfg, args.loss_samples, args.loss_from) \
            if args.loss_samples else (None, None)
        out_dir = args.out or os.path.join(ckpt.run_dir, "long_context")
    except (CheckpointError, ConfigError, DataError, ValueError, FileNotFoundError,
            ImportError) as e:
        fail(str(e))

    # 2. Distributed, the grid, the model with the checkpoint's weights (generate.py's).
    model, state = start_model(cfg, files, args.dtype)
    rank0 = dist.get_rank() == 0
    groups = dict(layout=cfg.parallel.layout, cp_group=state.cp_group, tp_group=state.tp_group)

    # 3. The tasks, the loss by position; rank 0 writes.
    cells = run_tasks(model, tokenizer, grid, **groups)
    buckets = loss_by_position(model, loss_inputs, **groups) if loss_inputs is not None \
        else []
    if rank0:
        os.makedirs(out_dir, exist_ok=True)
        title = f"{os.path.basename(os.path.normpath(ckpt.run_dir))} {ckpt.tag}"
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            used = {"asked": args.loss_samples, "used": len(loss_inputs), "from": loss_from} \
                if loss_inputs is not None else {"asked": 0, "used": 0, "from": None}
            json.dump({"checkpoint": ckpt.path, "model_seq_len": cfg.model.seq_len,
                       **as_json(cells, buckets), "loss_samples": used}, f, indent=1)
        plot_heatmap(cells, os.path.join(out_dir, "heatmap.png"), title, cfg.model.seq_len)
        if buckets:
            plot_loss_by_position(buckets, os.path.join(out_dir, "loss_by_position.png"),
                                  title)
        print(cells_table(cells), flush=True)
        if buckets:
            print(f"loss by position over {len(loss_inputs)} held-out {loss_from} "
                  f"(--loss-samples {args.loss_samples})")
        for b in buckets:
            print(f"positions {b.first:>6}-{b.last:<6} loss {b.loss:.4f} ({b.tokens} tokens)")
        if max(lengths) > cfg.model.seq_len:
            print(f"lengths past model.seq_len={cfg.model.seq_len} (the trained length) "
                  f"were asked", file=sys.stderr)
        print(f"wrote {out_dir}/results.json, heatmap.png"
              + (", loss_by_position.png" if buckets else "") + f" (tp={state.tp_size} x "
              f"cp={state.cp_size}, {cfg.parallel.layout})", file=sys.stderr, flush=True)
    shutdown_distributed()  # every group freed before exit: no gloo thread outlives main
    return 0


if __name__ == "__main__":
    sys.exit(main())
