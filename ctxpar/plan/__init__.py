"""The layout planner: which TP x CP x PP x DP, CP pattern, ZeRO stage and checkpointing to run.

    python -m ctxpar.plan --config configs/gpt7b_128k_3d.yaml --nodes 8 --gpu h100
    python tools/plan.py --config ... --explain 1 --write best.yaml --plot plan.png
    python -m ctxpar.plan --config ... --nodes 1 --max-seq-len      # the longest context

Every number comes from a formula in terms of shapes that a test holds against the code
itself: parameters per rank (the TP layers' shapes), optimizer state per ZeRO stage
(DeepSpeed's engine on CPU), activations per checkpointing mode (autograd's saved
tensors), CP bytes per pattern (ctxpar.context_parallel.cp_stats), each phase's peak
(the CPU allocator's live bytes, train.py's measured peak). Time is FLOPs at a
stated efficiency plus the communication that cannot hide (docs/planner.md).

    candidate.py one candidate: a rank layout (tp x cp x pp x dp, CP pattern, token
                 layout) with ZeRO, activation checkpointing and memory options
    cluster.py   GPU presets and the cluster (links inside and across nodes)
    counts.py    per-rank shapes, parameters, activation bytes, CP/TP/DP bytes
    memory.py    memory per GPU by phase: forward, backward, reduction, optimizer step
    zero_state.py  DeepSpeed's model state, buckets and Adam temporaries per phase
    transients.py  what a layer holds without saving it (buffers, replay, logits)
    longest.py   --max-seq-len: the longest seq_len over layouts and memory options
    timing.py    step time: compute, TP, CP (hidden or not, C vs F/B), bubble, DP
    sequence_cost.py  one sequence's seconds at a CP degree: dynamic CP's cost model
    dynamic.py   --documents: static or dynamic CP for a length distribution
    search.py    every valid layout of a config on a cluster, modelled and ranked
    report.py    the ranked table, --explain, --write, --plot
    startup.py   train.py's one-look prediction for its own layout
"""
from .candidate import Candidate
from .cluster import GPUS, Cluster, PlanError, gpu_preset

__all__ = ["GPUS", "Candidate", "Cluster", "PlanError", "gpu_preset"]
