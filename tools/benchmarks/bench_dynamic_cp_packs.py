"""Dynamic CP's cost model against each pack's measured CPU seconds, per rank.

    python -m tools.benchmarks.bench_dynamic_cp_packs --model hybrid --mix bimodal
    python -m tools.benchmarks.bench_dynamic_cp_packs --model hybrid --packs

On --world local gloo ranks, one thread each, the model of bench_dynamic_cp_train's arms
(--model dense or hybrid; configs/tiny_cpu.yaml, fp32, no DeepSpeed; not the MoE model,
whose packs need train.py's step: models/dynamic_cp.py's router accounting) runs
forward and backward of packs on their rank groups (dynamic_cp_runs.train_pack), each
rank's process CPU seconds per pack recorded: a figure that other work on the machine
changes far less than the wall clock's (no waiting is counted). Beside each, the cost
model's seconds of the pack (ctxpar/plan/sequence_cost.py at one core per rank: its
documents' cost(n, d) and one per-pack overhead).

Default: the packs of static CP's schedule (the documents in order, samples of world x
--tokens-per-rank, every sample over all ranks; zigzag for the hybrid, striped else) and
of the balanced schedule (balance.py), over --steps steps of --docs documents of the mix
(bench_dynamic_cp_train's lengths), summed per CP size; the ratio of the two totals is
the speedup total work allows where ranks outnumber cores (4 on 2 here).
--packs: instead, each of PACKS alone (the rank group from rank 0), --reps times, the
least CPU seconds of its ranks' mean (tests/test_dynamic_cp.py holds the cost model to
the figures of the hybrid's).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from ctxpar.testing import run_distributed
from tools.benchmarks.dynamic_cp_runs import add_mix_options

SHORT = [int(n) for n in np.random.default_rng(0).integers(40, 421, 17)]  # 40-420 tokens
# (CP size, the pack's document lengths): one-rank packs of short, middling and one long
# document, cp2 packs of one document, cp4 packs of one long and a few short ones; then
# 34 and 68 short documents on 1, 2 and 4 ranks beside one document of 68's tokens on 4
# (what a document costs at each ring step, beside its tokens' work)
PACKS = [(1, SHORT), (1, [4000]), (1, [500] * 8), (1, [3445]), (2, [6289]), (2, [5700]),
         (4, [5700, 227, 259]), (4, [4096, 284, 217, 273]), (1, SHORT * 2), (2, SHORT * 4),
         (4, SHORT * 4), (4, [sum(SHORT) * 4])]


def _setup(a, world):
    from ctxpar.plan.cluster import GPUS, Cluster
    from ctxpar.plan.sequence_cost import SequenceCost
    from tools.benchmarks.dynamic_cp_runs import HYBRID, run_config

    sets = {"dense": [], "hybrid": HYBRID}[a.model]
    cfg = run_config(SimpleNamespace(config=a.config, set=[
        f"model.seq_len={a.tokens_per_rank * world}", "parallel.layout=zigzag", *sets]), world)
    return cfg, SequenceCost(cfg, Cluster(1, world, GPUS["cpu"]))  # one core per rank


def _plans(a, world, cost, sizes, lengths):
    from ctxpar.dynamic_cp.balance import balanced_schedule
    from ctxpar.dynamic_cp.schedule import Pack, padded_length, static_schedule

    if a.packs:
        return {"packs": ([Pack(0, d, tuple(range(len(p))), sum(p), padded_length(
            sum(p), d, "zigzag"), cost.pack(p, d, "zigzag") + cost.overhead)
            for d, p in PACKS], "zigzag")}
    static = "zigzag" if a.model == "hybrid" else "striped"  # state passing: no striped
    return {"static": (static_schedule(lengths, world, a.tokens_per_rank, world, cost,
                                       cost.overhead, static,
                                       lambda ns, d: cost.pack(ns, d, static)).packs, static),
            "dynamic": (balanced_schedule(lengths, world, a.tokens_per_rank, cost,
                                          cost.overhead, "zigzag", sizes).packs, "zigzag")}


def _rank(rank, world, a):
    import torch.distributed as dist

    from ctxpar import init_parallel_state
    from ctxpar.dynamic_cp.groups import build_dynamic_cp_groups
    from ctxpar.dynamic_cp.stream import dynamic_cp_sizes_for
    from models.gpt import GPT
    from models.options import ModelGroups, ModelOptions
    from tools.benchmarks.dynamic_cp_runs import mix_lengths, train_pack

    cfg, cost = _setup(a, world)
    state = init_parallel_state(cp=world)
    sizes = dynamic_cp_sizes_for(cfg, world)
    groups = build_dynamic_cp_groups(state, sizes)
    mix = mix_lengths(a.mix, a.docs * (a.steps + 1), a).tolist()
    out = []  # (side, step, pack index, repetition, CP size, predicted s, CPU s)
    for s in range(a.steps + 1):  # step 0 warms up
        lengths = [n for p in PACKS for n in p[1]] if a.packs else mix[s * a.docs:
                                                                        (s + 1) * a.docs]
        for side, (packs, layout) in _plans(a, world, cost, sizes, lengths).items():
            model = GPT(cfg.model, ModelGroups.from_state(state),
                        ModelOptions(layout=layout, cp_comm="ring", seed=1))
            docs = np.cumsum([0] + [len(p[1]) for p in PACKS]) if a.packs else None
            for k, pack in enumerate(packs):
                for rep in range(a.reps if a.packs else 1):
                    dist.barrier()
                    if rank not in pack.ranks:
                        continue
                    own = lengths[docs[k]:docs[k + 1]] if a.packs else lengths
                    c0 = time.process_time()
                    train_pack(model, groups.tile_groups(pack.first, pack.size), layout,
                                pack, s, own)
                    if s > 0:
                        out.append((side, s, k, rep, pack.size, pack.seconds,
                                    time.process_time() - c0))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="hybrid", choices=["dense", "hybrid"])
    ap.add_argument("--mix", default="bimodal", choices=["lognormal", "bimodal"])
    ap.add_argument("--packs", action="store_true", help="time PACKS alone instead")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    add_mix_options(ap)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    a = ap.parse_args(argv)
    rows = [r for rank in run_distributed(_rank, a.world, a, timeout=3600) for r in rank]
    if a.packs:
        for k, (d, lengths) in enumerate(PACKS):
            mine, runs = [r for r in rows if r[2] == k], {}
            for r in mine:  # the mean over the pack's ranks of each repetition
                runs.setdefault((r[1], r[3]), []).append(r[6])
            cpu = min(sum(v) / len(v) for v in runs.values())
            print(f"cp{d} {len(lengths):2d} documents, {sum(lengths):5d} tokens: CPU "
                  f"{cpu:.3f} s, predicted {mine[0][5]:.3f} s ({mine[0][5] / cpu:.2f}x)")
        return
    total = {}
    for side in ("static", "dynamic"):
        for d in sorted({r[4] for r in rows if r[0] == side}):
            mine = [r for r in rows if r[0] == side and r[4] == d]
            cpu, pred = sum(r[6] for r in mine), sum(r[5] for r in mine)
            print(f"{a.model} {a.mix} {side:>7} cp{d}: {len(mine)} rank-packs, CPU "
                  f"{cpu:.2f} s, predicted {pred:.2f} s ({pred / cpu:.2f}x)")
        mine = [r for r in rows if r[0] == side]
        total[side] = (sum(r[6] for r in mine), sum(r[5] for r in mine))
    (sc, sp), (dc, dp) = total["static"], total["dynamic"]
    print(f"{a.model} {a.mix}: total CPU static {sc:.2f} s / dynamic {dc:.2f} s = "
          f"{sc / dc:.2f}x (predicted {sp / dp:.2f}x)")


if __name__ == "__main__":
    main()
