"""DeepSpeed 0.19.8's model state on one rank, phase by phase: what its code allocates and when.

psi = this rank's parameters (its TP shard of its pipeline stage), D = the ZeRO group (dp x
cp, ctxpar/distributed/zero.py; under expert parallelism the routed experts among psi are
partitioned over their expert-data-parallel group of D/ep instead, DeepSpeed's MoE param
groups: ctxpar/distributed/expert_parallel.py), e = the parameters' element size (2 bf16, 4 fp32), B = the
reduce bucket in elements (zero_optimization.reduce_bucket_size, from ctxpar.config's
deepspeed_config: the planner reads the config train.py hands DeepSpeed). Read from
runtime/engine.py, runtime/zero/stage_1_and_2.py, stage3.py and torch/optim/adam.py:

    stage  between steps (resident)          backward, grads              step (the optimizer)
    0      params psi e, Adam psi (8; bf16   param.grad psi e; at the end  Adam's temporaries
           4: DDP_BFLOAT16 steps the torch   one flat copy of <= 5e8      on top of params,
           optimizer on the bf16 params)      elements to all-reduce       grads, moments
    1      params psi e, fp32 master 4psi/D,  param.grad psi e, bucket B   + the grads of the
           Adam 8psi/D                        (allocated at the first      partition psi/D e,
                                              hook); at the end grads move  their flat fp32
                                              into it + one flat copy       copy 4psi0/D and
                                                                            Adam's temporaries
    2      as 1                              each grad moves into the      as 1
                                              bucket when produced; a full
                                              bucket is reduced (one flat
                                              copy) into the partition
    3      params psi e/D, fp32 grad          the params gathered whole     as 1 with params/D
           partition 4psi/D, master, Adam,   (kept: stage3_max_live_
           the bucket (allocated at init)     parameters), grads reduced
                                              through the bucket

Buckets are allocated whole on CUDA (torch.empty of B elements is B elements of the caching
allocator) but on CPU only the pages written count (glibc maps them on first touch): there
a bucket costs min(B, what went through it). `device` picks one.

Adam's temporaries (torch 2.13, AdamW, decoupled weight decay in place): on CUDA the
foreach path allocates one tensor per state tensor of the group (``_foreach_sqrt``) -- 1x
the group; on CPU (no foreach kernels) the single-tensor path computes
``exp_avg_sq.sqrt() / bias_correction2_sqrt`` -- 2x the largest tensor, momentarily. Under
ZeRO 1-3 the optimizer steps one flat fp32 partition per parameter group, and train.py's
largest group is the weight matrices' (psi0 of psi).

offload_optimizer (device cpu; ctxpar/memory/optimizer.py's table): the fp32 master,
Adam's moments and the fp32 gradient partition live on the host, with (ZeRO 1, 2) a copy
of the weights' partition and a gradient staging buffer of the largest parameter
(``host``); the device keeps the parameters, the gradients in their dtype until reduced
(bucket and stage 0/1 grads) and its own staging buffer. The step runs on the host:
DeepSpeedCPUAdam in place on CUDA machines, torch's AdamW (its CPU temporaries) on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from ..memory.optimizer import offload_device

ALLREDUCE_BUCKET = 500_000_000   # engine.py MEMORY_OPT_ALLREDUCE_SIZE: stage 0's flat copies

# DeepSpeed's zero_optimization defaults (runtime/zero/config.py), used for keys a config
# leaves out.
DS_DEFAULTS = dict(reduce_bucket_size=500_000_000, stage3_max_live_parameters=1_000_000_000,
                   stage3_prefetch_bucket_size=50_000_000,
                   stage3_param_persistence_threshold=100_000)


@dataclass(frozen=True)
class Shard:
    """What one rank's parameters look like to DeepSpeed."""
    psi: int          # parameters on this rank
    psi0: int         # of which in the largest optimizer group (train.py: the matrices)
    largest: int      # the largest single parameter tensor
    layer: int        # one block's parameters (ZeRO-3 gathers a block at a time)
    experts: int = 0  # of psi, the routed experts' when they are optimizer groups of their own


def zero_config(ds: Dict[str, Any]) -> Dict[str, Any]:
    """zero_optimization of a deepspeed config with DeepSpeed's defaults for absent keys."""
    z = dict(ds.get("zero_optimization") or {})
    for k, v in DS_DEFAULTS.items():
        z.setdefault(k, v)
    z.setdefault("stage", 0)
    return z


def optimizer_offloaded(z: Dict[str, Any]) -> bool:
    """The optimizer on the host: train.py's own reading of the section."""
    return offload_device({"zero_optimization": z}) == "cpu"


class ZeroState:
    """Bytes of model state on one rank at each point of a step (see the module docstring).

    Each method returns a dict term -> bytes; the terms' names are what the planner prints.
    """

    def __init__(self, shard: Shard, zero: Dict[str, Any], D: int, bf16: bool, device: str,
                 ep: int = 1):
        self.s, self.z, self.D, self.device = shard, zero, D, device
        self.edp = D // ep  # the experts' ZeRO group: ranks holding the same experts
        self.stage = int(zero["stage"])
        self.e = 2 if bf16 else 4
        self.bf16 = bf16
        self.B = int(zero["reduce_bucket_size"])
        self.offload = optimizer_offloaded(zero) and self.stage > 0

    # -- helpers
    def _part(self, n: float) -> float:
        """Elements of a ZeRO partition of n of this rank's parameters (n: psi or psi0,
        both holding every expert of the rank): the dense ones over D, the experts over
        their expert-data-parallel group of D/ep (DeepSpeed's MoE param groups; under ZeRO-3
        its per-parameter groups: ctxpar/distributed/expert_parallel.py)."""
        return (n - self.s.experts) / self.D + self.s.experts / self.edp

    def _largest_group(self) -> float:
        """Elements of the largest optimizer group's partition: train.py's matrices (psi0);
        a mixture of experts' experts a group of their own (models/training.py's
        param_groups), partitioned over D/ep."""
        if not self.s.experts:
            return self.s.psi0 / self.D
        return max((self.s.psi0 - self.s.experts) / self.D, self.s.experts / self.edp)

    def _bucket(self, through: float) -> float:
        """Bytes of a B-element bucket through which `through` elements went."""
        n = self.B if self.device == "cuda" else min(self.B, through)
        return n * self.e

    def _adam_temps(self, group: float, largest: float, e: int = 4) -> float:
        """torch AdamW's step temporaries over a group of `group` elements whose largest
        tensor has `largest` (foreach on CUDA: 1x the group; CPU: 2x the largest)."""
        return (group if self.device == "cuda" else 2 * largest) * e

    # -- phases
    def resident(self) -> Dict[str, float]:
        """Between steps and under the forward: parameters, master, moments (+ ZeRO-3's)."""
        psi, D, e = self.s.psi, self.D, self.e
        if self.stage == 0:
            adam = psi * (4 if self.bf16 else 8)  # DDP_BFLOAT16: Adam's moments in bf16
            return {"params": psi * e, "optimizer": adam}
        out = {"params": e * (self._part(psi) if self.stage == 3 else psi)}
        if not self.offload:
            out.update(master=4 * self._part(psi), optimizer=8 * self._part(psi))
        elif self.stage in (1, 2):
            out["offload staging"] = e * self.s.largest
        if self.stage == 3:
            out["grad partition"] = 0.0 if self.offload else 4 * self._part(psi)
            # the reduce bucket, allocated at init; on CPU its pages once a backward ran
            out["buckets"] = self._bucket(psi)
        return out

    def gathered(self) -> Dict[str, float]:
        """ZeRO-3 under the forward and backward: parameters gathered whole and kept while
        stage3_max_live_parameters allows (released before the step), and one coalesced
        fetch's flat all-gather buffer (stage3_prefetch_bucket_size elements, or the block
        being fetched if larger) from which torch.cat makes the parameters (measured at
        prefetch 5e7 and 4e7 elements: docs/benchmarks.md)."""
        if self.stage != 3:
            return {}
        psi, e = self.s.psi, self.e
        live = min(psi, max(int(self.z["stage3_max_live_parameters"]), self.s.layer))
        fetch = min(psi, max(int(self.z["stage3_prefetch_bucket_size"]), self.s.layer))
        return {"gathered params": live * e, "all-gather buffer": fetch * e}

    def host(self, step: bool = False) -> Dict[str, float]:
        """On the host (offload_optimizer): fp32 master, Adam's moments, the fp32 grads,
        (ZeRO 1, 2) the weights' partition copy and a staging buffer; during the step on a
        CPU machine torch AdamW's temporaries."""
        if not self.offload:
            return {}
        psi, e = self.s.psi, self.e
        part = self._part(psi)
        out = {"master": 4 * part, "optimizer": 8 * part, "grad partition": 4 * part}
        if self.stage in (1, 2):
            out["weights copy, staging"] = e * part + e * self.s.largest
        if step and self.device == "cpu":
            out["optimizer temporaries"] = 2 * 4 * self._largest_group()
        return out

    def backward(self, frac: float) -> Dict[str, float]:
        """Gradients held when a fraction `frac` of this rank's parameters has its gradient
        (the backward's own grads; the end-of-backward reduction is ``reduction``)."""
        psi, e = self.s.psi, self.e
        done = frac * psi
        if self.stage == 0:
            return {"grads": done * e}
        if self.stage == 1:  # grads stay in param.grad until the epilogue; CUDA: bucket
            return {"grads": done * e,
                    "buckets": self.B * e if self.device == "cuda" else 0.0}
        if self.stage == 2:  # each grad moves into the bucket; full buckets reduced
            part = self._part(psi) * e if done > self.B and not self.offload else 0.0
            return {"grads": part, "buckets": self._bucket(min(done, self.B))}
        return {}  # stage 3: reduced into the resident partition through the resident bucket

    def reduction(self) -> Dict[str, float]:
        """The end of the backward: the last (or only) bucket reduced, one flat copy of it."""
        psi, e, B = self.s.psi, self.e, self.B
        if self.stage == 0:
            return {"grads": psi * e, "reduction copy": min(psi, ALLREDUCE_BUCKET) * e}
        if self.stage == 3:
            return {"reduction copy": min(psi, B) * e}
        part = 0.0 if self.offload else self._part(psi) * e
        if self.stage == 1:
            # grads moving into the bucket (their storage freed as they go), one flat copy
            # of the bucket; the partition exists from the second bucket on
            grads = psi * e - min(psi, B) * e
            return {"grads": grads + (part if psi > B else 0.0),
                    "buckets": self._bucket(psi), "reduction copy": min(psi, B) * e}
        last = psi - (psi // B) * B if psi > B else psi  # stage 2: the last bucket's
        return {"grads": part if psi > B else 0.0, "buckets": self._bucket(min(psi, B)),
                "reduction copy": last * e}

    def step(self) -> Dict[str, float]:
        """The optimizer step's peak on the device, on top of ``resident``."""
        s, e = self.s, self.e
        if self.stage == 0:
            grads = s.psi * e
            temps = self._adam_temps(s.psi0, s.largest, e if self.bf16 else 4)
            return {"grads": grads, "optimizer temporaries": temps}
        if self.offload:  # the step runs on the host; the device only receives params
            return {}
        if not s.experts:
            return self._group_step(s.psi0 / self.D, self._part(s.psi))
        # DeepSpeed steps the groups in order, each one's grads freed once flattened: the
        # dense matrices first (every partition's grads still held), the experts' groups
        # (models/training.py's param_groups puts them after the dense ones) last, alone
        first = self._group_step((s.psi0 - s.experts) / self.D, self._part(s.psi))
        last = self._group_step(s.experts / self.edp, 0.0)
        return max(first, last, key=lambda t: sum(t.values()))

    def _group_step(self, part: float, held: float) -> Dict[str, float]:
        """ZeRO 1/2's step of one optimizer group of `part` elements on this rank, with
        `held` elements of partition gradients (its own among them) still held."""
        e = self.e
        out = {"flat fp32 grads": 4 * part}
        if self.stage in (1, 2) and held:
            out["grads"] = held * e  # the partition's grads, until every group stepped
        # bf16: the flat bf16 partition and its fp32 copy coexist before the step; the
        # temporaries come after the bf16 one is freed
        temps = self._adam_temps(part, part)
        out["optimizer temporaries"] = max(temps, part * e if self.bf16 else 0.0)
        return out
