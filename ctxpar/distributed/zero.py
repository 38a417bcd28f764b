"""ZeRO under context parallelism: where DeepSpeed 0.19.8 partitions and divides, and the fix.

DeepSpeed reduces gradients over the sequence-data group (dp x cp, the mpu's
``get_sequence_data_parallel_group``) and ZeRO partitions optimizer state over it. ZeRO-3
also partitions the *parameters*, and there DeepSpeed 0.19.8 disagrees with itself:

- ``DeepSpeedZeRoOffload._convert_to_zero_parameters`` (runtime/zero/parameter_offload.py)
  partitions every parameter over ``mpu.get_data_parallel_group()``, which for ctxpar is
  DP only (CP ranks are not replicas), and records that group as ``param.ds_process_group``;
- the stage-3 optimizer (runtime/zero/stage3.py) sizes its fp32 partitions by the dp x cp
  group it was given, but reduce-scatters each gradient bucket over the bucket's
  ``param.ds_process_group``, i.e. over DP only.

So the CP ranks never add their gradients: each CP rank applies the gradient of its own
tokens only (times a constant), the ranks' copies of the model drift apart, and the loss
still looks plausible. ``tests/test_grad_reduction.py`` reproduces it with a 3-weight
linear layer. Without CP (cp = 1) both groups are the DP group and nothing is wrong.

The fix needs no DeepSpeed patch: ``partition_for_zero3`` converts the model to ZeRO-3
parameters over dp x cp *before* ``deepspeed.initialize`` (``deepspeed.zero.Init(module=)``
is DeepSpeed's own conversion, given the right group); the engine then finds every
parameter converted and keeps that group. Gradients are reduce-scattered over dp x cp.

What the reduction divides by, for the loss normalisation (models/loss.py):

=============================  ========================================  ============
engine                         reduction of the summed gradient          divides by
=============================  ========================================  ============
ZeRO 0, 1, 2 (no pipeline)     all-reduce / reduce-scatter over dp x cp  dp (= |dp x cp| / cp)
ZeRO 3, ``reduce_scatter``     reduce_scatter_coalesced over dp x cp     dp x cp (no cp factor)
pipeline engine (ZeRO 0, 1)    its 'data' axis = dp x cp                 dp x cp
=============================  ========================================  ============

Stage 3 with ``reduce_scatter: false`` mixes the two rules (contiguous buckets divide by
dp, a parameter larger than ``reduce_bucket_size`` by dp x cp), so config validation refuses
it when cp > 1.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from .mpu import DeepSpeedMPU


def zero_stage(ds_config: Dict[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 when it has no zero_optimization)."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def grad_divisor(state, ds_config: Dict[str, Any], pipelined: bool = False) -> int:
    """What DeepSpeed divides the gradient summed over dp x cp by (the table above).

    ``loss_for_backward`` scales each rank's loss by it, so the applied gradient is the
    gradient of the global token mean for every engine.
    """
    if pipelined or zero_stage(ds_config) == 3:
        return state.dp_size * state.cp_size
    return state.dp_size


def engine_dtype(ds_config: Dict[str, Any]) -> torch.dtype:
    """The parameter dtype DeepSpeed's engine trains in for this config."""
    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def partition_for_zero3(model: torch.nn.Module, state, ds_config: Dict[str, Any]) -> None:
    """ZeRO-3 only: partition the model's parameters over dp x cp (not DP alone).

    Call after the model is built and initialised, before ``deepspeed.initialize``. Does
    nothing for other stages. Collective over the world (DeepSpeed broadcasts and
    partitions every parameter).
    """
    if zero_stage(ds_config) != 3:
        return
    import deepspeed

    from .deepspeed_comm import init_deepspeed_comm

    init_deepspeed_comm()  # Init reads the world through deepspeed.comm
    # DeepSpeed's engine casts parameters to the training dtype itself, but not those that
    # are ZeRO-3 parameters already (engine._cast_module_mixed_precision skips a zero-init
    # model) and zero.Init(module=) converts without casting: left alone, a bf16/fp16
    # ZeRO-3 run would train fp32 weights while stages 0-2 train bf16 ones. Parameters
    # only, as the engine does (buffers keep their dtype).
    dtype = engine_dtype(ds_config)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    deepspeed.zero.Init(module=model, data_parallel_group=state.dp_cp_group,
                        config_dict_or_path=ds_config, mpu=DeepSpeedMPU(state),
                        dtype=engine_dtype(ds_config))
