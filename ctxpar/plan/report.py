"""What the planner prints: the ranked table, one layout's breakdown, a config, a plot."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from typing import List

from ..config import to_dict
from ..config.kv_layers import uses_kv_layers
from ..config.layers import layer_attention, layer_types
from ..config.parameters import layer_head_dim, per_layer_embedding_specs
from ..context_parallel.linear import LINEAR_CP_STRATEGIES, check_linear_cp
from .linear_layers import KINDS, linear_shapes, mixer_cp_bytes
from .mla_layers import mla_cp_bytes
from . import comm_bytes, counts, kv_layers
from .candidate import apply_candidate
from .cluster import Cluster
from .search import MEMORY_MARGIN, Plan, is_bf16
from .timing import rank_pairs

GB = 1e9


def merge_ties(plans: List[Plan]) -> List[List[Plan]]:
    """Consecutive plans that differ only in ZeRO stage or token layout and predict the
    same memory and time, as one row each (the first is the one --explain / --write use)."""
    rows: List[List[Plan]] = []
    for p in plans:
        if rows:
            q = rows[-1][0]
            same = replace(p.candidate, zero=q.candidate.zero,
                           token_layout=q.candidate.token_layout) == q.candidate
            if same and round(p.memory.peak / GB, 1) == round(q.memory.peak / GB, 1) \
                    and round(p.time.total, 2) == round(q.time.total, 2):
                rows[-1].append(p)
                continue
        rows.append([p])
    return rows


def row_name(group: List[Plan]) -> str:
    """One name for tied layouts: 'tp2 cp16 ring/zigzag,striped pp1 dp2 z1,z2 none mb1'
    (commas, not bars: the table is markdown)."""
    parts = [re.split(r"([ /])", p.candidate.name()) for p in group]
    return "".join(",".join(dict.fromkeys(col)) for col in zip(*parts))


def table(rows: List[List[Plan]], cluster: Cluster, top: int = 10) -> str:
    """Markdown: the best fitting layouts (merge_ties' rows), fastest first."""
    lines = ["| # | layout | memory/GPU | step | tokens/s/GPU | MFU | bottleneck | "
             "ring C vs C* fwd/bwd |", "|---:|---|---:|---:|---:|---:|---|---|"]
    for i, group in enumerate(rows[:top], 1):
        p = group[0]
        t = p.time
        c = "-" if not t.ring_chunk else (
            f"{t.ring_chunk:,} vs {t.thresholds['fwd']:,.0f}/{t.thresholds['bwd']:,.0f} "
            f"({t.cp_link})")
        lines.append(f"| {i} | {row_name(group)} | {p.memory.peak / GB:.1f} GB | "
                     f"{t.total:.2f} s | {p.tokens_per_s_per_gpu:,.0f} | {100 * p.mfu:.1f}% | "
                     f"{t.bottleneck()} | {c} |")
    return "\n".join(lines)


def explain(plan: Plan, cluster: Cluster) -> str:
    """Every term of one layout's memory and time."""
    t = plan.time
    lines = [f"layout: {plan.candidate.name()} on {cluster.nodes} x {cluster.gpus_per_node} "
             f"{cluster.gpu.name}"]
    lines += memory_lines(plan, cluster)
    lines.append(f"step time: {t.total:.3f} s ({t.micro_batches} micro-batches per rank)")
    for k, v in (("compute", t.compute), ("per-op overhead", t.overhead),
                 ("TP all-reduce", t.tp), ("CP exposed", t.cp_exposed),
                 ("pipeline bubble", t.bubble), ("DP reduction", t.dp),
                 *([("MoE all-to-all", t.moe)] if t.moe else [])):
        lines.append(f"  {k:<16} {v:9.3f} s")
    lines.append(f"  (CP traffic in all: {t.cp_total:.3f} s over {t.cp_link})")
    if t.ring_chunk:
        lines.append(f"ring chunk C = {t.ring_chunk:,} tokens per step; the transfer hides "
                     f"when C >= {t.thresholds['fwd']:,.0f} (forward), "
                     f"{t.thresholds['bwd']:,.0f} (backward)")
    lines.append(f"tokens/s per GPU {plan.tokens_per_s_per_gpu:,.0f}, MFU "
                 f"{100 * plan.mfu:.1f}%, bottleneck: {t.bottleneck()}")
    return "\n".join(lines)


def memory_lines(plan: Plan, cluster: Cluster) -> List[str]:
    """The peak phase's terms, every phase's total, and the host's share."""
    m = plan.memory
    lines = [f"memory per GPU: {m.peak / GB:.2f} GB of {cluster.gpu.memory / GB:.0f} "
             f"(peak in the {m.peak_phase}){'' if plan.fits else '  DOES NOT FIT'}"]
    for k, v in sorted(m.as_dict().items(), key=lambda kv: -kv[1]):
        if v:
            lines.append(f"  {k:<34} {v / GB:9.3f} GB")
    lines.append("  phases: " + ", ".join(f"{p.name} {p.total / GB:.2f}" for p in m.phases))
    if m.host:
        per_node = m.host_total * cluster.gpus_per_node
        lines.append(f"host memory per node: {per_node / GB:.1f} GB of "
                     f"{cluster.gpu.host_memory / GB:.0f} ({cluster.gpus_per_node} GPUs x "
                     + ", ".join(f"{k} {v / GB:.2f}" for k, v in m.host.items()) + " GB)")
    return lines


# What frees each term of the peak: (remedy, the Candidate flag that is that remedy or None).
REMEDIES = {
    "activations": [("memory.offload_activations", "offload_activations"),
                    ("full checkpointing", None), ("more CP", None)],
    "recompute": [("memory.tiled_mlp", "tiled_mlp"), ("memory.tiled_linear", "linear_tile"),
                  ("more CP or TP", None)],
    "layer working set": [("memory.tiled_mlp (smaller tiles)", None),
                          ("memory.tiled_linear", "linear_tile"), ("more CP or TP", None)],
    "block working set": [("memory.tiled_mlp", "tiled_mlp"), ("more CP or TP", None)],
    "logits": [("memory.tiled_loss", "tiled_loss"), ("smaller loss tiles", None),
               ("more TP (V/tp)", None)],
    "params": [("more TP or PP", None), ("ZeRO-3 over a larger dp x cp", None)],
    "grads": [("ZeRO-2/3", None), ("smaller buckets", None)],
    "master": [("offload_optimizer", "offload_optimizer"), ("a larger ZeRO group", None)],
    "optimizer": [("offload_optimizer", "offload_optimizer"), ("a larger ZeRO group", None)],
    "grad partition": [("offload_optimizer", "offload_optimizer")],
    "buckets": [("a smaller zero_optimization.reduce_bucket_size", None)],
    "activation grads": [("more CP or TP (the residual stream's (N, d) gradient)", None)],
    "gathered params": [("a smaller stage3_max_live_parameters", None)],
}


def layout_reason(cfg, plan: Plan) -> str:
    """One line: why this token layout, for a model with windowed or chunked layers
    under a ring or all-gather: per such layer, the busiest rank's CP bytes (a halo
    exchange under contiguous, two neighbours' under zigzag, whole blocks where the
    reach exceeds the slabs) and its attention pairs under each layout; '' otherwise."""
    m, cand = cfg.model, plan.candidate
    kinds = layer_attention(m)
    masked = [a for a in kinds if a.sliding_window or a.chunk_size]
    if not masked or cand.cp == 1 or cand.cp_comm == "ulysses":
        return ""
    a, e = masked[0], 2 if is_bf16(cfg) else 4
    what = (f"a {a.sliding_window:,}-token window" if a.sliding_window
            else f"{a.chunk_size:,}-token chunks")
    parts = []
    for layout in ("contiguous", "zigzag", "striped"):
        other = replace(cand, token_layout=layout)
        f, b = comm_bytes.layer_cp_bytes(m, other, e, a)
        halo = comm_bytes.halo_received(m, other, a) >= 0
        pairs = rank_pairs(m.seq_len, cand.ring if cand.cp_comm == "hybrid" else cand.cp,
                           layout, a.sliding_window, a.chunk_size)
        parts.append(f"{layout} {(f + b) / 1e6:,.1f} MB ({'halo' if halo else 'blocks'}), "
                     f"{pairs / 1e6:,.1f}M pairs")
    full = len(kinds) - len(masked)
    return (f"token layout {cand.token_layout}: {len(masked)} of {len(kinds)} layers see "
            f"{what}; such a layer's busiest rank sends and does: " + "; ".join(parts)
            + (f" ({full} full layers: zigzag and striped balance their causal work, "
               f"contiguous does not)" if full else ""))


def ep_reason(cfg, plan: Plan, cluster: Cluster) -> str:
    """One line: why this parallel.ep, for a mixture of experts: the layout's peak memory,
    all-to-all seconds and step time at each ep the search weighs for it (search.ep_sizes),
    at the layout's ZeRO stage or, where the trainer refuses that with this ep (16-bit
    ZeRO 0, ZeRO 3 with tp > 1), at ZeRO 2 or 1, or the config validation's reason where
    it refuses them all; balanced routing assumed; '' without model.moe."""
    from .search import _valid, ep_sizes, evaluate, refusal
    cand = plan.candidate
    if cfg.model.moe is None:
        return ""
    parts = []
    for ep in ep_sizes(cfg, cand.dp * cand.cp):
        other = next((c for c in (replace(cand, ep=ep, zero=z) for z in (cand.zero, 2, 1))
                      if _valid(cfg, c)), None)
        if other is None:
            why = refusal(cfg, replace(cand, ep=ep))
            why = why[len(f"{cfg.source}: "):] if why.startswith(f"{cfg.source}: ") else why
            parts.append(f"ep{ep} refused by the trainer ({why.rstrip('.')})")
            continue
        p = plan if other == cand else evaluate(cfg, other, cluster)
        zero = f" (z{other.zero})" if other.zero != cand.zero else ""
        parts.append(f"ep{ep}{zero} {p.memory.peak / GB:.1f} GB, all-to-alls "
                     f"{p.time.moe:.2f} s, step {p.time.total:.2f} s")
    return (f"parallel.ep {cand.ep}: {cfg.model.moe.num_experts} experts over ep of dp x cp "
            f"= {cand.dp * cand.cp} ranks (fewer experts a rank: less memory; more of its "
            f"rows off the rank: longer all-to-alls; balanced routing assumed): "
            + "; ".join(parts))


def linear_reason(cfg, plan: Plan) -> str:
    """One line: why this parallel.linear_cp, for a model with linear layers over CP: per
    linear layer and micro-batch, the bytes a rank sends (forward + backward) under state
    passing (fp32 summaries: independent of seq_len) and heads (all-to-alls: proportional
    to it), where the layout allows each; '' otherwise."""
    m, cand = cfg.model, plan.candidate
    linear = [t for t in dict.fromkeys(layer_types(m)) if t in KINDS]
    if not linear or cand.cp == 1:
        return ""
    e, s = 2 if is_bf16(cfg) else 4, counts.rank_shapes(m, cand)
    parts = []
    for kind in linear:
        sh = linear_shapes(m, kind, cand.tp)
        sent = []
        for strategy in LINEAR_CP_STRATEGIES:
            try:
                check_linear_cp(strategy, cand.token_layout, sh.H if kind ==
                                "mamba" else sh.Hv, cand.cp, sh.C)
            except ValueError:
                sent.append(f"{strategy} not with this layout")
                continue
            f, b = mixer_cp_bytes(kind, sh, s.B, s.N // s.B, e, cand.cp, strategy,
                                  cand.token_layout)
            sent.append(f"{strategy} {(f + b) / 1e6:,.2f} MB")
        n = sum(t == kind for t in layer_types(m))
        parts.append(f"{n} {kind} layers, each: " + ", ".join(sent))
    return (f"parallel.linear_cp {cand.linear_cp}: a rank sends per micro-batch "
            + "; ".join(parts) + " (state: fp32 summaries, the same at any seq_len; heads: "
            "all-to-alls that grow with it)")


def mla_reason(cfg, plan: Plan, cluster: Cluster) -> str:
    """One line for a model with MLA over CP: this layout's step time with the latent on
    the wire (what ctxpar runs) against the what-if of a ring of expanded K,V
    (mla_layers), the bytes a rank sends per layer and micro-batch, the kv_b_proj seconds
    and the CP seconds not hidden of each; '' otherwise (and under model.dsa, whose
    sparse attention reads the latent rows it selects: no expanded ring to weigh)."""
    from .timing import step_time
    cand = plan.candidate
    if cfg.model.mla is None or cfg.model.dsa is not None or cand.cp == 1:
        return ""
    e, bf16 = 2 if is_bf16(cfg) else 4, is_bf16(cfg)
    s, g = counts.rank_shapes(cfg.model, cand), counts.ring_grad_bytes(cand.ring_grad_dtype)
    parts = []
    for expanded in (False, True):
        t = plan.time if not expanded else step_time(cfg, cand, cluster, bf16, expanded=True)
        sent = sum(mla_cp_bytes(cfg.model, cand.cp_comm, cand.cp, cand.ulysses, s.B,
                                s.N // s.B, s.h, e, g, expanded))
        parts.append((t.total, f"{'expanded K,V' if expanded else 'latent'} "
                               f"{sent / 1e6:,.1f} MB a layer, step {t.total:.2f} s (CP not "
                               f"hidden {t.cp_exposed:.2f} s)"))
    faster = "latent" if parts[0][0] <= parts[1][0] else "expanded K,V"
    return (f"model.mla on {cand.cp_comm}: the latent on the wire against a what-if of the "
            f"expanded K,V (kv_b_proj once per token, no expansion per visiting block): "
            + "; ".join(p for _, p in parts) + f": the {faster} is faster "
            f"(python -m ctxpar.plan.mla_ring: the terms of one layer)")


def what_frees(m, cand) -> str:
    """One line: the peak phase's three largest terms and what would free each (options
    the layout already uses left out)."""
    top = sorted(m.as_dict().items(), key=lambda kv: -kv[1])[:3]

    def remedy(term):
        ways = [text for text, flag in REMEDIES.get(term, [("see docs/memory.md", None)])
                if not (flag and getattr(cand, flag))
                and not (text == "full checkpointing" and cand.activation == "full")]
        return ", ".join(ways) or "nothing the planner has left"
    return "what fills it: " + "; ".join(f"{k} {v / GB:.1f} GB ({remedy(k)})" for k, v in top)


def write_config(cfg, plan: Plan, path: str) -> str:
    """The config with the plan's layout, as a runnable YAML at path (written whole or
    not at all)."""
    import yaml

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"# written by python -m ctxpar.plan: {plan.candidate.name()}\n"
                f"#   {' '.join(['python -m ctxpar.plan', *sys.argv[1:]])}\n")
        yaml.safe_dump(to_dict(apply_candidate(cfg, plan.candidate)), f, sort_keys=False)
    os.replace(tmp, path)
    return path


def plot(plans: List[Plan], path: str, cluster: Cluster, top: int = 8) -> str:
    """The top layouts' memory and step time as a PNG at path (plot_figure)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_figure(plans[:top], cluster)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_figure(plans: List[Plan], cluster: Cluster):
    """Stacked bars: memory by kind and step time by term, with the device's memory and
    the planned fraction of it as lines; the layouts' names below."""
    import matplotlib.pyplot as plt

    names = [f"#{i}" for i in range(1, len(plans) + 1)]
    keys = list(dict.fromkeys(k for p in plans for k in p.memory.as_dict()))
    # one colour per term: tab20 has 20, more than the memory model's terms
    colours = plt.get_cmap("tab20").colors
    text_in = 0.2 + 0.17 * len(plans)  # inches of layout names under the plots
    height = 4.2 + text_in
    low, high = (text_in + 0.5) / height, 1 - 0.4 / height
    fig = plt.figure(figsize=(13, height))
    ax1 = fig.add_axes((0.05, low, 0.36, high - low))
    ax2 = fig.add_axes((0.62, low, 0.36, high - low))
    bottom = [0.0] * len(plans)
    for i, k in enumerate(keys):
        vals = [p.memory.as_dict().get(k, 0.0) / GB for p in plans]
        ax1.bar(names, vals, bottom=bottom, label=k, color=colours[i % len(colours)])
        bottom = [b + v for b, v in zip(bottom, vals)]
    device = cluster.gpu.memory / GB
    ax1.axhline(device, color="black", linewidth=1.2,
                label=f"device memory ({device:.0f} GB)")
    ax1.axhline(MEMORY_MARGIN * device, color="black", linestyle="--", linewidth=1.0,
                label=f"planned ({100 * MEMORY_MARGIN:.0f}%: {MEMORY_MARGIN * device:.0f} GB)")
    ax1.set_ylim(0, 1.08 * max([device, *bottom]))
    ax1.set_ylabel("GB per GPU")
    ax1.set_title("memory at each layout's peak phase")
    ax1.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    bottom = [0.0] * len(plans)
    for k, label in (("compute", "compute"), ("overhead", "overhead"), ("tp", "TP"),
                     ("cp_exposed", "CP exposed"), ("bubble", "bubble"), ("dp", "DP")):
        vals = [getattr(p.time, k) for p in plans]
        ax2.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_ylim(0, 1.08 * max(bottom))
    ax2.set_ylabel("seconds per step")
    ax2.set_title("step time")
    ax2.legend(fontsize=7, loc="lower right")
    fig.text(0.05, 0.1 / height,
             "\n".join(f"#{i}: {p.candidate.name()}" for i, p in enumerate(plans, 1)),
             fontsize=9, family="monospace", va="bottom")
    return fig


def kv_layers_reason(cfg, plan) -> str:
    """One line for a model with Gemma 4's fields: the blocks sharing K/V (none kept: the
    saved K/V bytes they spare per micro-batch), the per-layer input embedding's
    parameters on a rank, the head dims and the kernels that cannot take them; ''
    otherwise."""
    m, cand = cfg.model, plan.candidate
    if not uses_kv_layers(m):
        return ""
    s, e = counts.rank_shapes(m, cand), 2 if is_bf16(cfg) else 4
    producers = [kv_layers.layer_rank_shapes(s, m, cand.tp, a.kv_source)
                 for a in layer_attention(m) if a.kv_source is not None]
    spared = sum(2 * s.N * p.hk * p.hd * e for p in producers)  # the K, V they would save
    ple = sum(spec.numel(cand.tp) for spec in per_layer_embedding_specs(m))
    dims = sorted({layer_head_dim(m, a) for a in layer_attention(m)})
    refusing = kv_layers.kernels_refusing(m)
    return (f"Gemma 4 attention: {len(producers)} of {m.n_layers} layers share an earlier "
            f"layer's K/V (no K/V kept: {spared / 1e9:.2f} GB of saved K/V per micro-batch "
            f"not made); per-layer input embedding {ple / 1e6:,.1f} M parameters a rank; "
            f"head dims {dims}" + (f"; {refusing}" if refusing else ""))
