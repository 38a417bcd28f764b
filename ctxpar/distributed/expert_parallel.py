"""Expert parallelism through DeepSpeed's own MoE machinery (deepspeed 0.19.8).

Under EP each rank holds E/ep of every MoE layer's experts (models/moe.py), so the experts'
gradients must be summed over the ranks holding the *same* experts (the expert-data-parallel
group, EDP: dp x cp / ep ranks) while every other gradient is summed over dp x cp. DeepSpeed
already computes exactly that for its own MoE layers, and the division it applies is
ctxpar's loss divisor (ctxpar/distributed/zero.py):

    engine, ZeRO 0      _reduce_expert_gradients: all-reduce over EDP, / |dp|
    ZeRO 1 and 2        the MoE param groups partition over EDP; a bucket is divided by
                        |dp x cp| / cp = |dp| and reduced over EDP
    non-expert (both)   all-reduce / reduce-scatter over dp x cp, / |dp|

so the applied gradient is the gradient of the global loss for every parameter. What
DeepSpeed reads, and what this module sets:

- a parameter is an expert's when ``allreduce`` is False (``deepspeed.moe.utils
  .is_moe_param``); ``group_name`` names its EP group in ``deepspeed.utils.groups``
  (``ep_size_<ep>``, DeepSpeed's own naming);
- the groups under that name: DeepSpeed would build its EP groups from the DP ranks alone
  (``groups._create_expert_and_data_parallel``); ctxpar's fold EP over DP x CP
  (``ParallelState.ep_group`` / ``edp_group``, Megatron's MoE parallel folding), so they
  are registered under the name instead, when the engine asks a MoE layer to
  ``set_deepspeed_parallelism``;
- the engine turns its MoE paths on only when ``named_modules()`` holds an instance of
  ``deepspeed.moe.layer.MoE``. ctxpar's MoE is not DeepSpeed's layer (fused expert tensors
  with transformers' names, dropless variable all-to-all, TP inside each expert), so the
  model carries ``ExpertGroups``: a DeepSpeed ``MoE`` with no parameters and no forward
  whose one job is that registration;
- the optimizer's expert parameters in param groups of their own marked ``moe`` and named
  by the EP group, as ``split_params_into_different_moe_groups_for_optimizer`` marks them
  and ZeRO 1 and 2 require (models/training.py builds the same four groups at every ep
  instead of calling it: its groups' number and order depend on ep, so an optimizer state
  could not be resumed on another ep group by group).

Checkpoints are where DeepSpeed's MoE path does not fit: the engine's MoE format is
written for its own layer (per-expert files found by the
``deepspeed_moe.experts.deepspeed_experts.<i>`` name; the model states written by every CP
rank of DP rank 0). So after ``deepspeed.initialize`` the engine's ``has_moe_layers`` is
turned off again (``dense_checkpoints``): the ZeRO 1/2 optimizer keeps its own MoE groups
and reductions, and the engine saves as for a dense model: the module file from one rank,
every rank's ZeRO partition (its experts' fp32 weights and Adam states) in its own shard.
A resume on the same layout restores every expert from the shards (DeepSpeed's
``load_from_fp32_weights``, on by default; ctxpar/checkpoint/reshard.py then copies them
into the weights); the module file's experts are EP rank 0's only and nothing reads them:
a layout change, model.init_from and the export go through the universal conversion, which
takes every expert from the shards (ctxpar/checkpoint/expert_universal.py). Refused
(ctxpar/config/moe.py): ZeRO-0, whose weights live in that module file alone, and ZeRO-3
(DeepSpeed 0.19.8 refuses its native MoE under stage 3).
"""
from __future__ import annotations

import torch.nn as nn
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name for the EP group of size ep (deepspeed/moe/layer.py)."""
    return f"ep_size_{ep}"


class ExpertGroups(DeepSpeedMoE):
    """Tells DeepSpeed's engine that the model has experts, and registers ctxpar's EP and
    EDP groups under DeepSpeed's name for them (the module docstring). No parameters, no
    forward: ctxpar's MoE layers do the computing."""

    def __init__(self, num_experts: int, state):
        nn.Module.__init__(self)  # not DeepSpeed's: it would build its own experts and gate
        self.num_experts = num_experts
        self.ep_size = state.ep_size
        self.num_local_experts = num_experts // state.ep_size
        self.expert_group_name = expert_group_name(state.ep_size)
        self._groups = (state.ep_group, state.edp_group, state.ranks("ep"), state.ranks("edp"))

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        ep_group, edp_group, ep_ranks, edp_ranks = self._groups
        name = self.expert_group_name
        groups._EXPERT_PARALLEL_GROUP[name] = ep_group
        groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep_ranks
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp_ranks

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertGroups only registers process groups; ctxpar's MoE layers "
                           "(models/moe.py) compute")


def prepare_expert_parallel(model: nn.Module, state, num_experts: int) -> str:
    """Before deepspeed.initialize, ep > 1: flag the experts' parameters (``expert_shard``,
    set by models/moe.py) as DeepSpeed's MoE parameters of this EP group and attach the
    ExpertGroups module; the EP group's name, which the optimizer's expert groups carry
    (models/training.py's param_groups)."""
    name = expert_group_name(state.ep_size)
    for p in model.parameters():
        if getattr(p, "expert_shard", None) is not None:
            p.allreduce, p.group_name = False, name
    model.deepspeed_expert_groups = ExpertGroups(num_experts, state)
    return name


def dense_checkpoints(engine) -> None:
    """After deepspeed.initialize (ep > 1, ZeRO 1 or 2): the engine's checkpoints in its
    dense format (the module docstring). After initialisation the engine reads the flag only
    to save and load checkpoints, to reduce ZeRO-0's gradients (ZeRO-0 is refused with
    ep > 1) and to log DeepSpeed MoE layers' timers (there are none)."""
    engine.has_moe_layers = False
