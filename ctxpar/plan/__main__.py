"""python -m ctxpar.plan --config X.yaml --nodes N --gpus-per-node G --gpu h100 [...]

Ranks every valid layout of the config's model, sequence length and global batch on the
cluster (the config's own layout keys are ignored, then shown for comparison) and prints
the best that fit. Exit 2 with one line on bad input or when nothing fits.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..config import ConfigError, load_config
from .bound import bound_by
from . import compressed_layers
from .candidate import apply_candidate
from .cluster import Cluster, PlanError, gpu_preset
from .dynamic import add_layouts, compare, describe, document_lengths, other_layouts
from .longest import OPTIONS, PATTERNS, Allowed, merge_tiles, search_longest, with_seq_len
from .report import (ep_reason, explain, kv_layers_reason, layout_reason, linear_reason,
                     memory_lines, mla_reason, merge_ties, plot, table, what_frees, write_config)
from .search import (MEMORY_MARGIN, config_options, evaluate, is_bf16, nothing_fits,
                     option_applies, search)
from .startup import config_candidate


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ctxpar.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config: model, seq_len, batch")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default=None,
                   help="preset: h100 (the default), h200, a100, b200, cpu (this project's "
                        "2-core CPU machine, a core per rank: with --gpus-per-node 2)")
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
    p.add_argument("--max-seq-len", action="store_true",
                   help="the longest model.seq_len any layout and memory option fits "
                        "(the last line); --write writes it")
    p.add_argument("--host-memory", type=float,
                   help="override: bytes of host memory per node (offloads)")
    p.add_argument("--options", default=",".join(OPTIONS),
                   help="--max-seq-len: memory options it may use, comma-separated, or "
                        "'none' (default all: " + ", ".join(OPTIONS) + ")")
    p.add_argument("--cp-comm", default=",".join(PATTERNS),
                   help="--max-seq-len: CP patterns it may use, or 'none' (no CP)")
    p.add_argument("--documents", metavar="MEDIAN,SIGMA,MIN,MAX",
                   help="static or dynamic CP for log-normal document lengths, at the "
                        "config's layout (ctxpar/plan/dynamic.py)")
    p.add_argument("--tp", type=int, help="--max-seq-len: only this TP degree")
    p.add_argument("--pp", type=int, help="--max-seq-len: only this pipeline degree")
    p.add_argument("--target-seq-len", type=int, metavar="TOKENS",
                   help="--max-seq-len: what TOKENS would need on the best layout, at the "
                        "rate its binding memory grows (the 'bound by' line)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        cluster = cluster_of(a)
        cfg = load_config(a.config, a.set, check_paths=False)
        check_host(cfg, cluster, a.host_memory)
        if a.max_seq_len:
            return longest_main(cfg, cluster, a)
        if a.documents:
            steps = document_lengths(a.documents, cfg.train.global_batch_size, 8)
            cmp = add_layouts(compare(cfg, cluster, steps),
                              other_layouts(a.config, a.set, cfg), cluster, steps)
            note_machine(a)
            print(f"{cfg.source}: {cfg.train.global_batch_size} documents per step of "
                  f"log-normal lengths ({a.documents}), {cmp.tokens_per_step:,.0f} tokens "
                  f"on average, on {cluster.nodes} x {cluster.gpus_per_node} "
                  f"{cluster.gpu.name}, 8 steps:")
            print(describe(cmp, cfg))
            return 0
        plans = search(cfg, cluster)
        fitting = [p for p in plans if p.fits]
        if not fitting:
            off = [k for k, on in config_options(cfg).items()
                   if not on and option_applies(cfg, k)]
            raise PlanError(nothing_fits(plans, cluster, off))
        rows = merge_ties(fitting)  # a row: layouts that differ only in ZeRO / token layout
        k = a.explain or 1
        if not 1 <= k <= len(rows):
            raise PlanError(f"--explain {k}: there are {len(rows)} rows of fitting layouts")
    except (PlanError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note_machine(a)
    g = cluster.gpu
    print(f"{cfg.source}: {cfg.model.n_layers} layers, d {cfg.model.d_model}, seq_len "
          f"{cfg.model.seq_len:,}, global batch {cfg.train.global_batch_size} on "
          f"{cluster.nodes} x {cluster.gpus_per_node} {g.name} ({flop_rate(g.flops)}, "
          f"{g.memory / 1e9:.0f} GB, NVLink {g.nvlink / 1e9:.0f} GB/s, network "
          f"{g.network / 1e9:.0f} GB/s per direction); {len(plans)} valid layouts, "
          f"{len(fitting)} fit, in {len(rows)} rows (layouts that differ only in ZeRO stage "
          f"or token layout and predict the same memory and step time share a row: "
          f"'z1,z2', 'ring/zigzag,striped')\n")
    print(table(rows, cluster, a.top))
    for reason in (layout_reason(cfg, rows[k - 1][0]), linear_reason(cfg, rows[k - 1][0]),
                   ep_reason(cfg, rows[k - 1][0], cluster),
                   mla_reason(cfg, rows[k - 1][0], cluster),
                   kv_layers_reason(cfg, rows[k - 1][0]),
                   compressed_layers.model_line(cfg, rows[k - 1][0],
                                                 2 if is_bf16(cfg) else 4)):
        if reason:
            print(f"\n{reason}")
    own = own_layout(cfg, cluster, rows)
    if own:
        print(f"\n{own}")
    if a.explain:
        print("\n" + explain(rows[k - 1][0], cluster))
    if a.write:
        print(f"\nwrote {write_config(cfg, rows[k - 1][0], a.write)}")
    if a.plot:
        print(f"plotted {plot([g[0] for g in rows], a.plot, cluster)}")
    return 0


def flop_rate(flops: float) -> str:
    """'989 TFLOP/s', or under one TFLOP/s '113 GFLOP/s' (the cpu preset's core)."""
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.0f} GFLOP/s"


def note_machine(a) -> None:
    """On stderr, where --gpu was left to its default h100 on a machine with no CUDA
    device: the plan is for H100s, and the flags that plan for this machine instead. The
    machine is not taken as the default: a plan is mostly made on a login node or laptop
    for the GPUs of a cluster."""
    import torch

    if a.gpu is None and not torch.cuda.is_available():
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count()
        print(f"note: planning for {a.gpus_per_node} h100 per node (--gpu's default); this "
              f"machine has no CUDA device: --gpu cpu --gpus-per-node {cores} plans for its "
              f"{cores} cores", file=sys.stderr, flush=True)


def cluster_of(a) -> Cluster:
    """The cluster parse_args' flags describe (--gpu left out: h100)."""
    return Cluster(a.nodes, a.gpus_per_node,
                   gpu_preset(a.gpu or "h100", flops=a.flops, memory=a.memory, nvlink=a.nvlink,
                              network=a.network, overhead=a.overhead,
                              host_memory=a.host_memory))


def own_layout(cfg, cluster: Cluster, rows=None) -> str:
    """The line on the config's own layout (its memory, speed and row among `rows`), or ''
    when its layout does not fill the cluster. The extension configs quote it
    (tests/test_config.py holds them to it)."""
    own = config_candidate(cfg, cluster.world)
    if own.world != cluster.world:
        return ""
    mine = evaluate(cfg, own, cluster)
    rank = next((i for i, g in enumerate(rows or [], 1)
                 if any(p.candidate == mine.candidate for p in g)), None)
    return (f"the config's own layout: {mine.candidate.name()}: "
            f"{mine.memory.peak / 1e9:.1f} GB, {mine.tokens_per_s_per_gpu:,.0f} tokens/s "
            f"per GPU, MFU {100 * mine.mfu:.1f}%"
            + (f" (row {rank} of {len(rows)} rows)" if rank else
               ("" if mine.fits or rows is None else " (does not fit)")))

def check_host(cfg, cluster: Cluster, given) -> None:
    """--host-memory 0 leaves an offloading config nowhere to offload to."""
    if given is not None and given <= 0:
        opts = config_options(cfg)
        on = [k for k in ("offload_activations", "offload_optimizer") if opts[k]]
        if on:
            raise PlanError(f"--host-memory {given:g}: the config offloads ({', '.join(on)}) "
                            f"to host memory; give the host's bytes per node (> 0)")


def allowed_from(a) -> Allowed:
    """--options / --cp-comm / --tp as the search's limits (one line on an unknown name)."""
    def names(value: str, known, flag: str):
        got = () if value == "none" else tuple(v for v in value.split(",") if v)
        bad = [v for v in got if v not in known]
        if bad:
            raise PlanError(f"{flag} {value}: unknown {', '.join(bad)} (known: "
                            f"{', '.join(known)}, or 'none')")
        return got
    for flag, v in (("--tp", a.tp), ("--pp", a.pp)):
        if v is not None and v < 1:
            raise PlanError(f"{flag} {v} must be >= 1")
    return Allowed(names(a.options, OPTIONS, "--options"),
                   names(a.cp_comm, PATTERNS, "--cp-comm"), a.tp, a.pp)


def longest_main(cfg, cluster: Cluster, a) -> int:
    """--max-seq-len: the table of the longest layouts, the best one's memory, the line."""
    allowed = allowed_from(a)
    found = search_longest(cfg, cluster, allowed, top=max(1, a.top))
    rows = merge_tiles(found)
    if not rows:
        left_out = [k for k in OPTIONS if k not in allowed.options and option_applies(cfg, k)]
        host = ("; --host-memory for the offloads" if cluster.gpu.host_memory <= 0
                and {"offload_activations", "offload_optimizer"} - set(left_out) else "")
        raise PlanError(f"nothing fits at any model.seq_len on {cluster.nodes} x "
                        f"{cluster.gpus_per_node} {cluster.gpu.name}: the model state alone "
                        f"exceeds {MEMORY_MARGIN * cluster.gpu.memory / 1e9:.0f} GB per GPU; "
                        f"more GPUs (--nodes {cluster.nodes * 2}), a larger GPU"
                        + (f", or the options --options leaves out ({', '.join(left_out)})"
                           if left_out else "") + host)
    note_machine(a)
    g = cluster.gpu
    print(f"{cfg.source}: {cfg.model.n_layers} layers, d {cfg.model.d_model}, vocab "
          f"{cfg.model.vocab_size:,}, global batch {cfg.train.global_batch_size} on "
          f"{cluster.nodes} x {cluster.gpus_per_node} {g.name} ({g.memory / 1e9:.0f} GB, host "
          f"{g.host_memory / 1e9:,.0f} GB per node); {found.fitting} layouts fit at some length "
          f"(tile sizes counted apart; the table's rows exact, every layout that could reach "
          f"its last row bisected)\n")
    print("| # | layout | longest seq_len | memory/GPU | peak phase | host/node |")
    print("|---:|---|---:|---:|---|---:|")
    for i, (n, cand, m) in enumerate(rows[:a.top], 1):
        print(f"| {i} | {cand.name()} | {n:,} | {m.peak / 1e9:.1f} GB | {m.peak_phase} | "
              f"{m.host_total * cluster.gpus_per_node / 1e9:.0f} GB |")
    n, cand, m = rows[0]
    best = evaluate(with_seq_len(apply_candidate(cfg, cand), n), cand, cluster)
    print("\n" + "\n".join(memory_lines(best, cluster)))
    print(what_frees(best.memory, cand))
    print(bound_by(cfg, cand, cluster, n, a.target_seq_len))
    if a.write:
        print(f"wrote {write_config(with_seq_len(cfg, n), best, a.write)}")
    print(f"longest seq_len: {n:,} tokens (layout {cand.name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
