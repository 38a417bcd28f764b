"""Keep DeepSpeed from JIT-loading its CPU shared-memory comm op, which ctxpar never calls.

On the CPU accelerator every ``deepspeed.init_distributed`` (``deepspeed.initialize`` calls it)
loads ``deepspeed_shm_comm`` through torch's C++ extension loader. That op serves only
``deepspeed.comm.inference_all_reduce``; ctxpar's collectives are torch.distributed calls on
its own groups. Loading it costs two things a training framework cannot afford:

- a first build (~30 s, minutes on a loaded 2-core machine) inside the first run's start-up;
- a lock file under ``TORCH_EXTENSIONS_DIR`` held by every rank while it checks the build.
  A rank killed inside that window (a timeout, a preemption's SIGKILL) leaves the file
  behind, and every later start on that machine then waits on it forever, silently.

DeepSpeed keeps its probed ``deepspeed.ops.__compatible_ops__`` in one module-level dict
("edits to it persist") and ``build_shm_op`` returns None for an op marked incompatible there,
which is the path DeepSpeed already takes off Linux. On CUDA the op is not built at all.
"""
from __future__ import annotations

SHM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Mark DeepSpeed's CPU shm comm op unavailable in this process (idempotent; no-op off CPU)."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError:  # generate.py on a machine without DeepSpeed: nothing to skip
        return
    if get_accelerator().device_name() != "cpu":
        return
    deepspeed.ops.__compatible_ops__[SHM_OP] = False


def init_deepspeed_comm() -> None:
    """Start deepspeed.comm over the torch.distributed world already up, without the shm op.

    Call it wherever DeepSpeed is first touched (zero.Init, PipelineModule, deepspeed.initialize):
    each would otherwise start deepspeed.comm itself and load the op. Idempotent.
    """
    import deepspeed
    import torch.distributed as dist

    skip_shm_comm_op()
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())
