"""The planner's memory per rank against train.py's measured peak, layout by layout (CPU).

    python -m tools.benchmarks.bench_plan_memory                      # every layout: the docs table
    python -m tools.benchmarks.bench_plan_memory --only z3 --save /tmp/mem.json
    python -m tools.benchmarks.bench_plan_memory --load /tmp/mem.json # the table again, no runs

Each layout runs train.py (torchrun, 2 ranks as local processes, 2 steps, fp32, real
DeepSpeed) twice: with its model and with a negligible one (same layout and keys, d 16,
seq_len 64, vocab 64, 1 layer). glibc is told to return freed memory
(MALLOC_MMAP_THRESHOLD_=131072: every block above 128 KiB is its own mapping, unmapped
when freed), so the resident set follows the live tensors.

What is measured, per rank: the resident set's high-water mark (VmHWM of
/proc/self/status), read and reset (`echo 5 > /proc/self/clear_refs`) at the boundaries
of DeepSpeed's engine.forward / backward / step, so each phase has its own peak; the
rank's peak is the largest over the training steps (the imports before and the final
evaluation and teardown after are left out: the planner models a step; with them it is
what resource.getrusage's ru_maxrss says, train.py's peak_mem_bytes on CPU). The layout's
figure is max over ranks of (peak - the negligible run's peak on the same rank): the
interpreter, torch, DeepSpeed and gloo are in both and cancel.

Offloads: on CPU the "host" copies are in the same RAM, so the figure compared is the
prediction's device + host bytes at each phase (Memory.same_ram); the offloader's own
counters (host bytes, restored device bytes) are recorded beside it.

What is predicted: ctxpar.plan.startup's numbers for that config on device 'cpu' (the
start line train.py prints), minus its prediction for the negligible run.
"""
from __future__ import annotations

import argparse
import json

from ctxpar.testing.results import measure_missing
from tools.benchmarks.memory_probe import describe, measure, predicted

# 2 ranks each; what dominates differs (activations, model state, logits), as do the ZeRO
# stage, the checkpointing mode and the memory options.
ACT = ["model.seq_len=8192", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
       "model.vocab_size=256", "parallel.tp=1", "parallel.cp=2", "parallel.dp=1",
       "train.micro_batch_size=1", "train.global_batch_size=1"]
STATE = ["model.seq_len=128", "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=8",
         "model.n_layers=4", "model.vocab_size=256", "train.micro_batch_size=1"]
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "parallel.ep=2"]
# a Qwen3.5-like hybrid (3 Gated DeltaNet layers : 1 attention), full recompute: the lean
# torch kernels (lean.py), state passing over cp 2, at two lengths
HYBRID = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
          "model.n_layers=4", "model.layer_types=[linear_attention,linear_attention,"
          "linear_attention,full_attention]", "model.linear_num_key_heads=2",
          "model.linear_num_value_heads=4", "model.linear_key_head_dim=32",
          "model.linear_value_head_dim=32", "parallel.tp=1", "parallel.cp=2", "parallel.dp=1",
          "train.micro_batch_size=1", "train.global_batch_size=1",
          "activation_checkpointing.mode=full"]
LAYOUTS = {  # name: --set overrides
    "activations: cp2 ring, none, z1": ACT + ["model.n_layers=4"],
    "activations: cp2 ring, full, z1": ACT + ["model.n_layers=8",
                                              "activation_checkpointing.mode=full"],
    "activations: cp2 ring, selective, z1": ACT + ["model.n_layers=4",
                                                   "activation_checkpointing.mode=selective"],
    "model state: dp2 z0": STATE + ["parallel.cp=1", "parallel.dp=2",
                                    "train.global_batch_size=2",
                                    "deepspeed.zero_optimization.stage=0"],
    "model state: tp2 z1 selective": STATE + [
        "model.seq_len=1024", "parallel.tp=2", "parallel.cp=1", "parallel.dp=1",
        "train.global_batch_size=1", "activation_checkpointing.mode=selective"],
    "model state: dp2 z2, 1M-element bucket": STATE + [
        "parallel.cp=1", "parallel.dp=2", "train.global_batch_size=2",
        "deepspeed.zero_optimization.stage=2",
        "deepspeed.zero_optimization.reduce_bucket_size=1000000"],
    "model state: cp2 z3": STATE + ["parallel.cp=2", "parallel.dp=1",
                                    "train.global_batch_size=1",
                                    "deepspeed.zero_optimization.stage=3"],
    "logits: cp2, vocab 32000": ACT + ["model.n_layers=2", "model.vocab_size=32000"],
    "logits: cp2, vocab 32000, tiled loss": ACT + ["model.n_layers=2",
                                                   "model.vocab_size=32000",
                                                   "memory.tiled_loss=true"],
    "activations: cp2 ring, none, tiled MLP": ACT + ["model.n_layers=4",
                                                     "memory.tiled_mlp=true"],
    "activations: cp2 ring, full, activation offload": ACT + [
        "model.n_layers=8", "activation_checkpointing.mode=full",
        "memory.offload_activations=true"],
    "model state: dp2 z1, optimizer offload": STATE + [
        "parallel.cp=1", "parallel.dp=2", "train.global_batch_size=2",
        "deepspeed.zero_optimization.stage=1",
        "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
    # a mixture of experts (8, top 2) split over ep 2 of the cp 2 ranks
    "moe state: cp2 ep2 z2": STATE + MOE + [
        "model.moe.expert_hidden=1024", "parallel.cp=2", "parallel.dp=1",
        "train.global_batch_size=1", "deepspeed.zero_optimization.stage=2"],
    "moe activations: cp2 ep2 none z1": ACT + MOE + [
        "model.n_layers=2", "model.moe.expert_hidden=256", "deepspeed.zero_optimization.stage=1"],
    # dense and MoE layers mixed (layer 0 MoE, 1-3 dense), the experts under ZeRO-3 and ZeRO-0
    "moe mixed state: cp2 ep2 z3": STATE + MOE + [
        "model.moe.expert_hidden=1024", "model.moe.layers=[0]", "parallel.cp=2",
        "parallel.dp=1", "train.global_batch_size=1", "deepspeed.zero_optimization.stage=3"],
    "moe mixed state: cp2 ep2 z0": STATE + MOE + [
        "model.moe.expert_hidden=1024", "model.moe.layers=[0]", "parallel.cp=2",
        "parallel.dp=1", "train.global_batch_size=1", "deepspeed.zero_optimization.stage=0"],
    "hybrid: cp2 state, full, 4K tokens": HYBRID + ["model.seq_len=4096"],
    "hybrid: cp2 state, full, 16K tokens": HYBRID + ["model.seq_len=16384"],
    "hybrid: dp2 (cp1), full, 4K tokens": HYBRID + [
        "model.seq_len=4096", "parallel.cp=1", "parallel.dp=2", "train.global_batch_size=2"],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="layouts whose name contains this")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for the runs (4096: the lean linear "
                        "kernels' many small tensors are their own mappings too)")
    p.add_argument("--save", help="write the measurements (JSON) here")
    p.add_argument("--load", help="a --save file: the table without running")
    a = p.parse_args()
    results = json.load(open(a.load)) if a.load else {}
    for name, r in results.items():  # the current model's predictions for old measurements
        if name in LAYOUTS:
            r.update(predicted(LAYOUTS[name], a.nproc))
    measure_missing(LAYOUTS, results, lambda name, sets: measure(name, sets, a.nproc,
                                                       mmap_threshold=a.mmap_threshold),
                    lambda name, r: f"{name}: {describe(r)}", only=a.only, save=a.save)
    print("\n| layout | measured | predicted | error | predicted peak phase |")
    print("|---|---:|---:|---:|---|")
    for name, r in results.items():
        if a.only in name:
            err = 100 * (r["predicted"] / r["measured"] - 1)
            print(f"| {name} | {r['measured'] / 1e6:,.0f} MB | {r['predicted'] / 1e6:,.0f} MB | "
                  f"{err:+.1f}% | {r['predicted_phase']} |")


if __name__ == "__main__":
    main()
