"""The DeepSpeed ``mpu`` adapter over a ParallelState.

DeepSpeed asks the mpu for groups by Megatron's names (deepspeed/utils/groups.py,
deepspeed/runtime/engine.py, deepspeed 0.19.8):

- ``get_model_parallel_*`` / ``get_tensor_model_parallel_*`` = TP. The engine uses it for
  the checkpoint's mp_rank and to sum the gradient norm over TP-split parameters.
- ``get_data_parallel_*`` = DP (replicas holding different samples).
- ``get_sequence_parallel_*`` = CP (ranks holding different tokens of the same samples).
- ``get_sequence_data_parallel_*`` = DP x CP. Without a pipeline the engine all-reduces
  gradients over this group and divides by ``|dp x cp| / cp = dp`` (engine.py
  ``_reduce_non_expert_gradients``; ZeRO: stage_1_and_2.py divides by
  ``world(dp_process_group) / sequence_parallel_size``), so gradients are **summed over CP
  and averaged over DP**. ZeRO partitions optimizer state over DP x CP.
- ``get_pipe_parallel_*`` / ``get_pipeline_model_parallel_*`` = PP.

``DeepSpeedMPU(state)`` is built from a ParallelState, which knows nothing of DeepSpeed
(the dependency goes one way). There is deliberately no ``initialize_sequence_parallel`` method: its mere presence makes
DeepSpeed treat the mpu as a Ulysses-style SP object and return no data-parallel group.
See docs/parallelism.md for what that reduction rule means for the loss.
"""
from __future__ import annotations

from typing import List

from .parallel_state import ParallelState


class DeepSpeedMPU:
    """Megatron-named accessors DeepSpeed calls; each returns this rank's group/rank/size."""

    def __init__(self, state: ParallelState):
        self.state = state

    # Tensor (model) parallel
    def get_model_parallel_group(self): return self.state.tp_group
    def get_model_parallel_rank(self) -> int: return self.state.tp_rank
    def get_model_parallel_world_size(self) -> int: return self.state.tp_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group."""
        return self.state.ranks("tp")[0]

    # Data parallel (DP only: CP ranks are not replicas of each other's data)
    def get_data_parallel_group(self): return self.state.dp_group
    def get_data_parallel_rank(self) -> int: return self.state.dp_rank
    def get_data_parallel_world_size(self) -> int: return self.state.dp_size
    def get_data_parallel_group_ranks(self) -> List[int]: return self.state.ranks("dp")

    # Context parallel, by DeepSpeed's name for it
    def get_sequence_parallel_group(self): return self.state.cp_group
    def get_sequence_parallel_rank(self) -> int: return self.state.cp_rank
    def get_sequence_parallel_world_size(self) -> int: return self.state.cp_size

    # DP x CP: the group gradients are reduced over and ZeRO partitions over
    def get_sequence_data_parallel_group(self): return self.state.dp_cp_group
    def get_sequence_data_parallel_rank(self) -> int: return self.state.dp_cp_rank
    def get_sequence_data_parallel_world_size(self) -> int: return self.state.dp_cp_size

    # Pipeline parallel, under both names DeepSpeed uses
    def get_pipe_parallel_group(self): return self.state.pp_group
    def get_pipe_parallel_rank(self) -> int: return self.state.pp_rank
    def get_pipe_parallel_world_size(self) -> int: return self.state.pp_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
