"""GPU presets and the cluster a plan runs on.

Bandwidths are per GPU and per direction (what one GPU can send while it receives as
much), the convention of every byte count in ctxpar (stats.py counts bytes sent).
Sources (vendor data sheets; docs/planner.md):
- H100 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3; NVLink 4, 900 GB/s total = 450 GB/s per
  direction; one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s.
- H200 SXM: the H100's compute and NVLink, 141 GB HBM3e; NDR 50 GB/s.
- A100 SXM4 80GB: 312 TFLOP/s bf16, NVLink 3 600 GB/s total = 300 per direction; one
  200 Gb/s HDR NIC per GPU = 25 GB/s.
- B200: 2250 TFLOP/s dense bf16, 180 GB HBM3e (DGX B200: 1440 GB for 8), NVLink 5
  1.8 TB/s total = 900 per direction; 400 Gb/s = 50 GB/s.
- cpu: a 2-core CPU machine like the CI's, fitted to train.py's measured steps
  (docs/planner.md: calibration).
Host memory per node (offloads): 2 TB for every 8-GPU preset: DGX H100 and DGX H200
data sheets ("System memory 2TB"), DGX A100 640GB (2 TB), DGX B200 (2 TB, up to 4 TB);
the cpu preset's 24 GiB machine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict


class PlanError(ValueError):
    """Bad planner input, in one line (the CLI exits 2 with it)."""


@dataclass(frozen=True)
class GPU:
    name: str
    flops: float        # peak dense bf16 FLOP/s (fp32 for 'cpu')
    memory: float       # bytes of device memory
    nvlink: float       # bytes/s per direction to another GPU of the node
    network: float      # bytes/s per direction to another node
    # Seconds per layer per micro-batch (forward + backward) that are neither FLOPs nor
    # bytes: Python, op dispatch, kernel launches. It is what small models are made of
    # (configs/tiny_cpu.yaml); fitted on CPU, 0 for the GPU presets (not measured yet).
    overhead: float = 0.0
    # Seconds per document per ring step per layer (forward + backward): the attention
    # block's kernel calls, its merge and its plan, and the step's send and receive, which
    # document-masked CP pays for every document at every ring step it crosses. Fitted on
    # CPU (dynamic CP's benchmark), 0 for the GPU presets (not measured yet).
    block_overhead: float = 0.0
    # Seconds per token per input channel (the short conv's channels) of a linear mixer
    # (Gated DeltaNet, KDA, Mamba2) per layer, forward + backward, beyond its kernel's
    # FLOPs: the gates, norms, conv and the chunk scan's small ops, which the torch kernel
    # runs at a fraction of the FLOP rate. Fitted on CPU (docs/benchmarks.md, dynamic CP
    # through train.py), 0 for the GPU presets (not measured yet).
    linear_overhead: float = 0.0
    host_memory: float = 2e12   # bytes of host memory per node (offloads)
    kind: str = "cuda"          # 'cuda': buckets count whole; 'cpu': only touched pages
    pcie: float = 25e9          # bytes/s per direction between a GPU and its host (offloads)
    host_adam: float = 1e9      # parameters/s the node's CPU Adam steps (optimizer offload)


GPUS: Dict[str, GPU] = {
    # pcie: what a PCIe Gen5 (Gen4 for the A100) x16 link moves per direction in practice.
    "h100": GPU("h100", 989e12, 80e9, 450e9, 50e9, host_memory=2e12, pcie=50e9),
    "h200": GPU("h200", 989e12, 141e9, 450e9, 50e9, host_memory=2e12, pcie=50e9),
    "a100": GPU("a100", 312e12, 80e9, 300e9, 25e9, host_memory=2e12, pcie=25e9),
    "b200": GPU("b200", 2250e12, 180e9, 900e9, 50e9, host_memory=2e12, pcie=50e9),
    # This project's 2-core CPU machine, one core per rank: the per-core FLOP/s and the
    # per-layer overhead at which the time model (with MM_EFF, ATTN_EFF) best matches
    # train.py's measured steps (14 layouts of a compute-bound and an overhead-bound
    # model, two runs; tools/benchmarks/bench_plan_calibration.py, docs/planner.md); gloo on
    # one machine ~ 1 GB/s; detect() shares the cores when ranks outnumber them.
    "cpu": GPU("cpu", 113e9, 12e9, 1e9, 1e9, overhead=0.026, block_overhead=0.0015,
               linear_overhead=1.3e-7, host_memory=24e9, kind="cpu"),
}


def gpu_preset(name: str, **overrides) -> GPU:
    """The preset `name` with any of flops / memory / nvlink / network replaced (not None)."""
    if name not in GPUS:
        raise PlanError(f"--gpu {name!r} is not a known preset (known: {', '.join(GPUS)})")
    given = {k: v for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        strict = k not in ("overhead", "host_memory")  # may be 0 (no overhead, no host)
        if v < 0 or (strict and v == 0):
            raise PlanError(f"--{k} {v} must be {'> 0' if strict else '>= 0'}")
    return replace(GPUS[name], **given)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GPU

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise PlanError(f"--nodes {self.nodes} --gpus-per-node {self.gpus_per_node}: "
                            f"both must be >= 1")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def link(self, span: int) -> float:
        """Bandwidth of a group of `span` adjacent ranks' slowest hop: NVLink when the
        group fits in a node, the network otherwise."""
        return self.gpu.nvlink if span <= self.gpus_per_node else self.gpu.network

    def link_name(self, span: int) -> str:
        return "NVLink" if span <= self.gpus_per_node else "network"
