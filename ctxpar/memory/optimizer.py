"""The optimizer under ZeRO-Offload: which Adam runs where, and what moves to host memory.

``deepspeed.zero_optimization.offload_optimizer: {device: cpu, pin_memory: true}`` (ZeRO
1, 2 or 3, pipelines at ZeRO-1 included) keeps ZeRO's fp32 master partition, Adam's m and v
and the gradient partition in host memory and runs the optimizer step on the host
(DeepSpeed 0.19.8, runtime/zero/stage_1_and_2.py and stage3.py); the updated partition is
copied back into the device's weights and all-gathered as usual. ``offload_param`` (ZeRO-3)
also keeps the parameters' partitions on the host, gathered onto the device per module.
Both are exact on every CP pattern (tests/test_train_memory.py: losses equal the
unoffloaded run's to 1e-6 relative after 6 fp32 steps, measured ~1e-7; bf16 offloaded vs
not on the same layout: equal to 1e-7). NVMe, partial (``ratio``) and Superchip offload
are refused at load (ctxpar/config/validation.py).

DeepSpeed wants its own ``DeepSpeedCPUAdam`` there (AVX C++, JIT-built on first use, which takes
minutes on a small CPU machine; prebuilt with DS_BUILD_CPU_ADAM=1) and refuses a
torch optimizer unless ``zero_force_ds_cpu_optimizer: false`` (runtime/engine.py
``_configure_optimizer``). ``build_optimizer`` decides, first match wins:

=================================================  ======================  ==========
case                                               Adam                    runs on
=================================================  ======================  ==========
no offload                                         torch.optim.AdamW       the device
offload, deepspeed.zero_force_ds_cpu_optimizer     DeepSpeedCPUAdam        the host
  set by the user: true
offload, zero_force_ds_cpu_optimizer: false        torch.optim.AdamW       the host
offload, the model on a CUDA device                DeepSpeedCPUAdam        the host
offload, the model on the CPU (CI, dev boxes)      torch.optim.AdamW       the host
=================================================  ======================  ==========

Why: on GPUs the host's Adam is the offload's bottleneck and DeepSpeedCPUAdam is the fast
one (DeepSpeed's default, ZeRO-Offload's point); with the model already on the CPU nothing
moves and the compile would only cost time. Both are exact: torch's AdamW on the fp32
partitions is the unoffloaded torch AdamW's arithmetic, and DeepSpeedCPUAdam is the same
AdamW in another association order (against torch's on the same tensors: 1e-7 of the
largest weight after one step, 8e-7 after 50; through train.py, ZeRO 1 and 3 at cp4,
the losses match the one-process run to 1.0e-7). Set ``zero_force_ds_cpu_optimizer:
false`` on GPUs for torch's AdamW on the host (bit-for-bit the device's arithmetic, slower).

Bytes per rank that move to host (Psi = this rank's parameters, D = dp x cp the ZeRO
group (ctxpar/distributed/zero.py), e = bytes of the training dtype, L = this rank's
largest single parameter; measured on DeepSpeed's engine at cp2 x dp2, fp32 and bf16):

    ZeRO 1, 2    fp32 master 4 Psi/D + fp32 gradient partition 4 Psi/D + Adam m, v 8 Psi/D
                 + a copy of the weights' partition e Psi/D (the copy back) + e L (a
                 gradient staging buffer); ZeRO-2 with gradient accumulation also
                 e Psi/D of accumulation buffers (ZeRO-1 accumulates on the device).
                 The device gives up 12 Psi/D (master, Adam) and the step's transient fp32
                 gradient partition (4 Psi/D), and gains e L (the other staging buffer).
    ZeRO 3       fp32 master 4 Psi/D + Adam 8 Psi/D + the gradient partition Psi/D in
                 DeepSpeed's accumulation dtype (fp32 for fp32, the model's for bf16), and
                 at the step a transient fp32 copy of it (4 Psi/D).
    + offload_param   the weights' partition (Psi/D of the partition's dtype) as well; the
                 device keeps only the parameters gathered for the module running, the
                 prefetch and those kept for reuse (zero_bucket_defaults,
                 ctxpar/config/deepspeed.py).

With ``pin_memory`` the host buffers are page-locked (faster copies; pinned memory cannot
be swapped, mind ``ulimit -l``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


def offload_device(ds_config: Dict[str, Any], key: str = "offload_optimizer") -> Optional[str]:
    """'cpu' or 'nvme' when zero_optimization.<key> offloads, else None."""
    spec = (ds_config.get("zero_optimization") or {}).get(key) or {}
    device = spec.get("device", "none")
    return None if device in (None, "none") else str(device)


def uses_cpu_adam(ds_config: Dict[str, Any], device: torch.device) -> bool:
    """Whether the optimizer step is DeepSpeedCPUAdam (the table in the module docstring)."""
    if offload_device(ds_config) is None:
        return False
    forced = ds_config.get("zero_force_ds_cpu_optimizer")
    if forced is not None:
        return bool(forced)
    return device.type == "cuda"


def build_optimizer(param_groups: List[Dict[str, Any]], train, ds_config: Dict[str, Any],
                    device: torch.device) -> torch.optim.Optimizer:
    """AdamW with train's lr and betas over ``param_groups`` (each with its weight_decay):
    DeepSpeedCPUAdam or torch's, by the rule above. When torch's AdamW runs under offload,
    ``ds_config`` gets ``zero_force_ds_cpu_optimizer: false`` so DeepSpeed accepts it."""
    betas = (train.beta1, train.beta2)
    if uses_cpu_adam(ds_config, device):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(param_groups, lr=train.lr, betas=betas, adamw_mode=True)
    if offload_device(ds_config) is not None:
        ds_config["zero_force_ds_cpu_optimizer"] = False
    return torch.optim.AdamW(param_groups, lr=train.lr, betas=betas)


def describe(cfg, ds_config: Dict[str, Any], device: torch.device) -> Optional[str]:
    """train.py's start line: the memory options that are on, or None when none is.

        memory: tiled_loss (tile 48 tokens), tiled_mlp (tile auto), offload_activations
        (full checkpointing), offload_optimizer cpu pinned (torch AdamW on the host)
    """
    mem, on = cfg.memory, []

    def tile(v):
        return f"tile {v} tokens" if isinstance(v, int) else f"tile {v}"
    if mem.tiled_loss:
        on.append(f"tiled_loss ({tile(mem.loss_tile_tokens)})")
    if mem.tiled_mlp:
        on.append(f"tiled_mlp ({tile(mem.mlp_tile_tokens)})")
    if mem.offload_activations:
        on.append(f"offload_activations ({cfg.activation_checkpointing.mode} checkpointing)")
    where = offload_device(ds_config)
    if where is not None:
        spec = ds_config["zero_optimization"]["offload_optimizer"]
        pinned = " pinned" if spec.get("pin_memory", True) else ""  # DeepSpeed pins by default
        adam = "DeepSpeedCPUAdam" if uses_cpu_adam(ds_config, device) else "torch AdamW"
        on.append(f"offload_optimizer {where}{pinned} ({adam} on the host)")
    if offload_device(ds_config, "offload_param") is not None:
        on.append("offload_param cpu (ZeRO-3's weight partitions on the host)")
    return "memory: " + ", ".join(on) if on else None
