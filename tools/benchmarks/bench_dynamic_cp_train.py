"""Dynamic CP against static ring CP through train.py, as a user runs it: tokens/s, both arms
interleaved so that they share whatever else the machine is running.

    python -m tools.benchmarks.bench_dynamic_cp_train --mix lognormal bimodal \\
        --hybrid bimodal --moe bimodal --world 4 --rounds 2 --steps 6

For each mix, a token file of random documents is written once (their lengths below),
then train.py runs on --world local ranks (torchrun) with data.dynamic_cp on both arms,
alternating static, dynamic, static, dynamic, ... for --rounds rounds:

    static    data.dynamic_cp_schedule=static: static CP's packing of the same documents
              (in order, samples of world x tokens_per_rank tokens, each over all ranks,
              document masking), ring, the striped layout (balanced with documents;
              zigzag for the hybrid, whose state passing takes no striped layout;
              --static-layout sets it: zigzag keeps short documents on one rank)
    dynamic   data.dynamic_cp_schedule=balanced (ctxpar/dynamic_cp/balance.py), ring,
              zigzag

The dynamic arm trades documents within windows of --window steps
(data.dynamic_cp_window: part of dynamic CP, which evens the steps out); static CP takes
the steps as drawn. With --same-documents, and always for the MoE model (issue: its
losses against static CP's), the static arm trades them too, so both train on the same
documents step by step and their losses must agree to 1e-5 relative (fp32; only the
order of the reductions differs): checked on every round.

Both train --steps steps of --docs documents at --tokens-per-rank tokens per rank on the
model of --config (configs/tiny_cpu.yaml's, fp32, ZeRO 1). A run's tokens/s is its
steps' tokens over their seconds after step 1 (warmup), from its metrics.jsonl; an arm's
figure is the median over its rounds, its schedule's max/mean (makespan over the mean
rank's work, the planner's seconds) and predicted / bound the means over its steps; the
predicted speedup is the arms' tokens over their steps' predicted seconds (the cost
model's Schedule.makespan, metrics' predicted_s), to set beside the measured one. CPU
seconds are the whole run's (torchrun's ranks, start-up included), a figure that
contention changes less than the wall clock's.

Mixes (lengths in tokens, seeded; --min-len and --max-len clip):
    lognormal  log-normal, median --median-len, sigma --sigma
    bimodal    --short-share (80%) uniform in --short-len (40..420), the rest log-normal of
               median --long-median (3,000) and sigma 0.5: most documents short, a few long
--hybrid MIX adds a hybrid model on that mix (Gated DeltaNet, Mamba2, attention, Gated
DeltaNet layers; state passing over each pack's group). Each MIX of --mix, --hybrid and
--moe may set its own options and documents per step: 'lognormal:median=150,docs=128'
(dynamic_cp_runs.mix_spec), so one command runs every arm. Each run's metrics also give
the steps' CPU seconds over all ranks (step_cpu_s): the arms' CPU per token is printed
beside their tokens/s, a ratio that contention changes less.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ctxpar.distributed.parallel_state import free_port
from tools.benchmarks.dynamic_cp_runs import (HYBRID, MOE, add_mix_options, mix_lengths,
                                               mix_spec)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def write_corpus(prefix: str, lengths) -> None:
    """A token file of random documents of these lengths (inputs; EOS appended)."""
    from ctxpar.data import IndexedDatasetWriter
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, vocab_size=256, eos_id=0) as w:
        for n in lengths:
            w.add_document(rng.integers(1, 256, int(n)).tolist())


def train(run_dir: str, prefix: str, arm: str, a, model_sets, same: bool) -> dict:
    """One train.py run of an arm; its metrics per step. same: the static arm trades
    documents in the dynamic arm's windows."""
    sets = ["data.kind=tokens", "data.dynamic_cp=true", f"data.path={prefix}",
            "data.eval_fraction=0.02", "train.eval_samples=1",  # the final evaluation: short
            f"data.tokens_per_rank={a.tokens_per_rank}",
            f"model.seq_len={a.tokens_per_rank * a.world}", f"parallel.cp={a.world}",
            "parallel.dp=1", "parallel.cp_comm=ring", f"train.steps={a.steps}",
            f"train.global_batch_size={a.docs}", "train.eval_interval=0",
            "train.warmup_steps=1", "logging.log_interval=1", "logging.wandb.mode=disabled",
            f"logging.run_dir={run_dir}", *model_sets, *a.set]
    linear = any(s.startswith("model.layer_types") for s in model_sets)
    static_layout = a.static_layout or ("zigzag" if linear else "striped")  # state
    # passing takes no striped layout
    if arm == "dynamic" or same:
        sets += [f"data.dynamic_cp_window={a.window}"]
    sets += (["data.dynamic_cp_schedule=static", f"parallel.layout={static_layout}"]
             if arm == "static"
             else ["data.dynamic_cp_schedule=balanced", "parallel.layout=zigzag"])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.world),
           "--master_port", str(free_port()), os.path.join(ROOT, "train.py"),
           "--config", a.config, "--set", *sets]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train.py ({arm}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = {r["step"]: r for r in rows if "step_tokens" in r}
    steps[0] = {"cpu_s": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime}
    return steps


def summary(steps: dict) -> dict:
    """tokens/s after step 1, and the schedule's mean balance and distance to its bound."""
    timed = [r for s, r in steps.items() if s > 1]
    tokens = sum(r["step_tokens"] for r in timed)
    return {"tokens_per_s": tokens / sum(r["step_time_s"] for r in timed),
            "cpu_us_per_token": 1e6 * sum(r["step_cpu_s"] for r in timed) / tokens,
            "predicted_tokens_per_s": tokens / sum(r["predicted_s"] for r in timed),
            "cpu_s": steps[0]["cpu_s"], "losses": {s: r["loss"] for s, r in steps.items()
                                                   if s > 0},
            "max_over_mean": statistics.mean(r["schedule_max_over_mean"] for r in timed),
            "predicted_over_bound": statistics.mean(r["predicted_over_bound"] for r in timed)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", nargs="*", default=["lognormal", "bimodal"],
                    help="mixes to run the dense model on: NAME[:key=value,...]")
    ap.add_argument("--hybrid", nargs="*", default=["bimodal"],
                    help="mixes to run a hybrid model on")
    ap.add_argument("--moe", nargs="*", default=["bimodal"],
                    help="mixes to run a MoE model on")
    ap.add_argument("--ep", type=int, default=2, help="the MoE model's parallel.ep")
    ap.add_argument("--same-documents", action="store_true",
                    help="the static arm trades documents too; the losses are compared")
    ap.add_argument("--static-layout", choices=["striped", "zigzag", "contiguous"],
                    help="the static arm's parallel.layout (default: striped; zigzag for "
                         "the hybrid)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="static/dynamic pairs per case")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--docs", type=int, default=48, help="documents per step")
    ap.add_argument("--window", type=int, default=4, help="data.dynamic_cp_window")
    add_mix_options(ap)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.yaml"))
    ap.add_argument("--set", nargs="*", default=[], help="config overrides for both arms")
    ap.add_argument("--json", default="runs/bench/dynamic_cp_train.json")
    a = ap.parse_args(argv)
    cases = [(m, "dense", []) for m in a.mix] + [(m, "hybrid", HYBRID) for m in a.hybrid] \
        + [(m, "moe", [*MOE, f"parallel.ep={a.ep}"]) for m in a.moe]
    specs = sorted({spec for spec, _, _ in cases})
    parsed = {spec: mix_spec(spec, a) for spec in specs}  # every spec checked before a run
    out, tmp = [], tempfile.mkdtemp(prefix="bench_dyn_")
    for spec, model, model_sets in cases:
        mix, ma = parsed[spec]
        name = f"mix{specs.index(spec)}"
        prefix = os.path.join(tmp, name)
        if not os.path.exists(prefix + ".idx"):
            write_corpus(prefix, mix_lengths(mix, int(1.2 * ma.docs * (ma.steps + ma.window)),
                                             ma))
        runs = {"static": [], "dynamic": []}
        same = a.same_documents or model == "moe"
        for r in range(a.rounds):
            for arm in ("static", "dynamic"):  # interleaved: the same contention for both
                t0 = time.time()
                steps = train(os.path.join(tmp, f"{name}-{model}-{arm}-{r}"), prefix, arm, ma,
                              model_sets, same)
                runs[arm].append(summary(steps))
                x = runs[arm][-1]
                print(f"{spec} {model} {arm} round {r}: {x['tokens_per_s']:>8,.0f} "
                      f"tokens/s (predicted {x['predicted_tokens_per_s']:,.0f}), schedule "
                      f"max/mean {x['max_over_mean']:.3f}, predicted/bound "
                      f"{x['predicted_over_bound']:.3f}, steps' CPU {x['cpu_us_per_token']:.0f} "
                      f"us/token ({time.time() - t0:.0f} s wall, {x['cpu_s']:.0f} CPU s)",
                      flush=True)
            if not same:
                continue
            loss_diff = max(abs(d - s) / abs(s) for s, d in zip(
                runs["static"][-1]["losses"].values(), runs["dynamic"][-1]["losses"].values()))
            runs["dynamic"][-1]["loss_rel_diff"] = loss_diff
            print(f"{spec} {model} losses over {ma.steps} steps: dynamic within "
                  f"{loss_diff:.1e} (relative) of static "
                  f"{'(within 1e-5)' if loss_diff <= 1e-5 else 'NOT WITHIN 1e-5'}", flush=True)
        med = {arm: statistics.median(x["tokens_per_s"] for x in v) for arm, v in runs.items()}
        predicted = {arm: statistics.median(x["predicted_tokens_per_s"] for x in v)
                     for arm, v in runs.items()}
        cpu = {arm: statistics.median(x["cpu_us_per_token"] for x in v)
               for arm, v in runs.items()}
        row = dict(mix=spec, model=model, static_tokens_per_s=med["static"],
                   dynamic_tokens_per_s=med["dynamic"],
                   speedup=med["dynamic"] / med["static"],
                   predicted_speedup=predicted["dynamic"] / predicted["static"],
                   cpu_us_per_token=cpu, cpu_speedup=cpu["static"] / cpu["dynamic"],
                   cpu_s={arm: statistics.median(x["cpu_s"] for x in v)
                          for arm, v in runs.items()},
                   loss_rel_diff=max(x["loss_rel_diff"] for x in runs["dynamic"])
                   if same else None,
                   dynamic_max_over_mean=statistics.mean(x["max_over_mean"]
                                                         for x in runs["dynamic"]),
                   dynamic_predicted_over_bound=statistics.mean(
                       x["predicted_over_bound"] for x in runs["dynamic"]), runs=runs)
        out.append(row)
        print(f"{spec} {model}: dynamic {row['dynamic_tokens_per_s']:,.0f} / static "
              f"{row['static_tokens_per_s']:,.0f} tokens/s = {row['speedup']:.2f}x (predicted "
              f"{row['predicted_speedup']:.2f}x; steps' CPU per token {row['cpu_speedup']:.2f}x; "
              f"run CPU s static {row['cpu_s']['static']:.0f}, "
              f"dynamic {row['cpu_s']['dynamic']:.0f}); dynamic "
              f"schedule max/mean {row['dynamic_max_over_mean']:.3f}, predicted/bound "
              f"{row['dynamic_predicted_over_bound']:.3f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"args": vars(a), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
