"""The ``deepspeed`` section as DeepSpeed gets it: batch sizes and clipping from ``train``,
ZeRO's bucket sizes where the user set none."""
from __future__ import annotations

import copy
from typing import Any, Dict

from .kv_layers import carries_between_stages
from .sections import Config


def grad_accum_steps(cfg: Config, dp: int) -> int:
    """Micro-batches per optimizer step on each DP rank."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)


# ZeRO's buckets when the user sets none (deepspeed_config). DeepSpeed 0.19.8's defaults are
# sized for nothing in particular: reduce_bucket_size = allgather_bucket_size = 5e8 elements,
# and ZeRO 1/2 allocate a reduce buffer of that many elements (2 GB in fp32, twice with
# overlap_comm) whatever the model; ZeRO-3 keeps every gathered parameter that is used again
# within stage3_max_reuse_distance = 1e9 elements, i.e. a model of under ~5e8 parameters
# stays whole from forward to backward.
BUCKET_MIN = 40_000_000        # Megatron-Core's DDP bucket: max(4e7, 1e6 x dp) parameters
BUCKET_PER_RANK = 1_000_000    # (distributed_data_parallel_config.bucket_size)
BUCKET_MAX = 500_000_000       # DeepSpeed's reduce/allgather_bucket_size default: never more
PREFETCH_MAX = 50_000_000      # DeepSpeed's stage3_prefetch_bucket_size default: never more


def zero_bucket_size(zero_group: int) -> int:
    """Elements per ZeRO bucket: Megatron-Core's max(4e7, 1e6 x D) over the ZeRO group
    D = dp x cp (ctxpar/distributed/zero.py), at most DeepSpeed's 5e8. Larger groups get
    larger buckets so the collectives stay bandwidth-bound, not latency-bound (Megatron's
    reason)."""
    return min(max(BUCKET_MIN, BUCKET_PER_RANK * zero_group), BUCKET_MAX)


def zero_bucket_defaults(stage: int, zero_group: int) -> Dict[str, int]:
    """What deepspeed_config fills into zero_optimization when the user set none of it,
    with B = zero_bucket_size(D):

        stage 1, 2   reduce_bucket_size = allgather_bucket_size = B
        stage 3      reduce_bucket_size = B, stage3_prefetch_bucket_size = min(B, 5e7),
                     stage3_max_live_parameters = stage3_max_reuse_distance = 2 B
                     (the module running plus one prefetched bucket)

    Device bytes they bound: ZeRO 1/2 allocate a B-element reduce buffer of the gradients'
    dtype (the model's; at ZeRO-1 deepspeed.data_types.grad_accum_dtype when set), twice
    with overlap_comm; ZeRO-3 one B-element bucket, plus at most 2 B gathered parameters
    kept for reuse. Stage 0 has no buckets (DeepSpeed's all-reduce flattens the gradients
    it has)."""
    b = zero_bucket_size(zero_group)
    if stage in (1, 2):
        return {"reduce_bucket_size": b, "allgather_bucket_size": b}
    if stage == 3:
        return {"reduce_bucket_size": b,
                "stage3_prefetch_bucket_size": min(b, PREFETCH_MAX),
                "stage3_max_live_parameters": 2 * b, "stage3_max_reuse_distance": 2 * b}
    return {}


def deepspeed_config(cfg: Config, dp: int) -> Dict[str, Any]:
    """The ``deepspeed`` section with batch sizes and clipping filled in from ``train``, and
    ZeRO's bucket sizes from ``zero_bucket_defaults`` where the user set none (a key the
    user set, under either of DeepSpeed's names for it, always wins).

    DeepSpeed checks train_batch_size == micro * grad_accum * dp_world_size, where its
    dp world size comes from the mpu's data-parallel group (DP only; CP ranks share samples).
    With pp > 1 DeepSpeed's pipeline grid is the mpu and its data-parallel group is dp x cp
    (ctxpar/distributed/pipeline_parallel.py), so it counts cp times the samples:
    train_batch_size is scaled by cp for it; the samples per step are still
    train.global_batch_size.
    """
    ds = copy.deepcopy(cfg.deepspeed)
    ds["train_batch_size"] = cfg.train.global_batch_size * (
        cfg.parallel.cp if cfg.parallel.pp > 1 else 1)
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = grad_accum_steps(cfg, dp)
    ds.setdefault("gradient_clipping", cfg.train.grad_clip)
    ds.setdefault("steps_per_print", 10 ** 9)  # train.py logs; keep DeepSpeed quiet
    if cfg.parallel.pp > 1 and cfg.parallel.tp > 1 and carries_between_stages(cfg.model):
        # DeepSpeed splits a stage's output over TP (pipe_partitioned) only when its other
        # tensors take no gradient; Gemma 4's carried K/V and per-layer inputs, the MoE
        # routers' statistics and DSA's indexer sums do: every TP rank sends its stage's
        # whole tuple instead (models/pipe_carry.py, models/dsa_pipe.py)
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    if cfg.data.dynamic_cp:  # each rank runs its own number of packs; step() reduces once
        ds["managed_gradient_accumulation"] = False
    zero = ds.get("zero_optimization")
    if zero:
        for key, value in zero_bucket_defaults(int(zero.get("stage", 0)),
                                               dp * cfg.parallel.cp).items():
            if key not in zero and key.replace("stage3_", "") not in zero:
                zero[key] = value
    return ds
