"""python -m ctxpar.plan --config X.yaml --nodes N --gpus-per-node G --gpu h100 [...]

Ranks every valid layout of the config's model, sequence length and global batch on the
cluster (the config's own layout keys are ignored, then shown for comparison) and prints
the best that fit. Exit 2 with one line on bad input or when nothing fits.
"""
from __future__ import annotations

import argparse
import sys

from ..config import ConfigError, load_config
from .cluster import Cluster, PlanError, gpu_preset
from .report import explain, merge_ties, plot, table, write_config
from .search import evaluate, nothing_fits, search
from .startup import own_layout


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ctxpar.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config: model, seq_len, batch")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", help="preset: h100, h200, a100, b200, cpu")
    p.add_argument("--flops", type=float, help="override: peak FLOP/s per GPU")
    p.add_argument("--memory", type=float, help="override: bytes of memory per GPU")
    p.add_argument("--nvlink", type=float, help="override: bytes/s per direction in a node")
    p.add_argument("--network", type=float, help="override: bytes/s per direction across")
    p.add_argument("--overhead", type=float,
                   help="override: seconds per layer per micro-batch beyond FLOPs and bytes")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--explain", type=int, metavar="K", help="full breakdown of row K")
    p.add_argument("--write", metavar="PATH.yaml", help="write row 1 (or --explain K) as a config")
    p.add_argument("--plot", metavar="PNG", help="memory and time of the top layouts")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cluster = Cluster(a.nodes, a.gpus_per_node,
                          gpu_preset(a.gpu, flops=a.flops, memory=a.memory, nvlink=a.nvlink,
                                     network=a.network, overhead=a.overhead))
        cfg = load_config(a.config, a.set, check_paths=False)
        plans = search(cfg, cluster)
        fitting = [p for p in plans if p.fits]
        if not fitting:
            raise PlanError(nothing_fits(plans, cluster))
        rows = merge_ties(fitting)  # a row: layouts that differ only in ZeRO / token layout
        k = a.explain or 1
        if not 1 <= k <= len(rows):
            raise PlanError(f"--explain {k}: there are {len(rows)} rows of fitting layouts")
    except (PlanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = cluster.gpu
    print(f"{cfg.source}: {cfg.model.n_layers} layers, d {cfg.model.d_model}, seq_len "
          f"{cfg.model.seq_len:,}, global batch {cfg.train.global_batch_size} on "
          f"{cluster.nodes} x {cluster.gpus_per_node} {g.name} ({g.flops / 1e12:.0f} "
          f"TFLOP/s, {g.memory / 1e9:.0f} GB, NVLink {g.nvlink / 1e9:.0f} GB/s, network "
          f"{g.network / 1e9:.0f} GB/s per direction); {len(plans)} valid layouts, "
          f"{len(fitting)} fit\n")
    print(table(rows, cluster, a.top))
    own = own_layout(cfg, cluster.world)
    if own.world == cluster.world:
        mine = evaluate(cfg, own, cluster)
        rank = next((i for i, g in enumerate(rows, 1)
                     if any(p.layout == mine.layout for p in g)), None)
        print(f"\nthe config's own layout: {mine.layout.name()}: "
              f"{mine.memory.peak / 1e9:.1f} GB, {mine.tokens_per_s_per_gpu:,.0f} tokens/s "
              f"per GPU, MFU {100 * mine.mfu:.1f}%"
              + (f" (row {rank} of {len(rows)})" if rank else
                 ("" if mine.fits else " (does not fit)")))
    if a.explain:
        print("\n" + explain(rows[k - 1][0], cluster))
    if a.write:
        print(f"\nwrote {write_config(cfg, rows[k - 1][0], a.write)}")
    if a.plot:
        print(f"plotted {plot([g[0] for g in rows], a.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
