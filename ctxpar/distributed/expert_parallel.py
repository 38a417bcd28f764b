"""Expert parallelism through DeepSpeed's own MoE machinery (deepspeed 0.19.8).

Under EP each rank holds E/ep of every MoE layer's experts (models/moe.py), so the experts'
gradients must be summed over the ranks holding the *same* experts (the expert-data-parallel
group, EDP: dp x cp / ep ranks) while every other gradient is summed over dp x cp. DeepSpeed
already computes exactly that for its own MoE layers, and the division it applies is
ctxpar's loss divisor (ctxpar/distributed/zero.py):

    engine, ZeRO 0      _reduce_expert_gradients: all-reduce over EDP, / |dp|
    ZeRO 1 and 2        the MoE param groups partition over EDP; a bucket is divided by
                        |dp x cp| / cp = |dp| and reduced over EDP
    non-expert (0-2)    all-reduce / reduce-scatter over dp x cp, / |dp|
    pipeline (ZeRO 0, 1) every gradient / |dp x cp| (the grid's data axis is DeepSpeed's
                        data group there): the experts' over EDP, the rest over dp x cp
    ZeRO 3              per-parameter partition groups: the experts over EDP, the rest
                        over dp x cp, every gradient / |dp x cp| (zero3_expert_placement)

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
  whose one job is that registration (not under ZeRO-3, which refuses a DeepSpeed MoE:
  there ctxpar registers the groups itself, ``zero3_expert_placement``);
- the optimizer's expert parameters in param groups of their own marked ``moe`` and named
  by the EP group, as ``split_params_into_different_moe_groups_for_optimizer`` marks them
  and ZeRO 1 and 2 require (models/training.py builds the same four groups at every ep
  instead of calling it: its groups' number and order depend on ep, so an optimizer state
  could not be resumed on another ep group by group).

Checkpoints are where DeepSpeed's MoE path does not fit: the engine's MoE format is
written for its own layer (per-expert files found by the
``deepspeed_moe.experts.deepspeed_experts.<i>`` name, engine.py ``_save_moe_checkpoint``;
nothing of ctxpar's fused expert tensors), and its model file is written by every rank of
DP rank 0 (``groups._get_data_parallel_rank() == 0``): under ctxpar's fold that is every CP
rank, each holding other experts, writing the one file. So the engine keeps
``has_moe_layers`` (ZeRO-0's gradient reduction reads it in every backward) and ctxpar turns
it off only while the engine saves or loads (``dense_format``, every ZeRO stage): the
engine then saves as for a dense model, the module file from one rank, every rank's ZeRO
partition in its own shard. Each rank's own experts come back from per-rank state
(ctxpar/checkpoint/expert_states.py): under ZeRO 1/2 its shard (fp32 weights and Adam
states; ``update_lp_params`` copies them into the weights), under ZeRO-3 its shard as for
every parameter, under ZeRO-0 a file per EP rank that ctxpar writes beside the engine's,
the experts' weights and the whole optimizer state (DeepSpeed's own stage-0 MoE checkpoint
keeps an optimizer file per EP rank too). The module file's experts are EP rank 0's only
and nothing reads them: a layout change, model.init_from and the export go through the
universal conversion, which takes every expert from those per-rank sources
(ctxpar/checkpoint/expert_universal.py; a ZeRO-3 checkpoint at ep > 1 has none and resumes
on its own layout only). Refused (ctxpar/config/moe.py): 16-bit ZeRO-0 (DeepSpeed's
FP16_UnfusedOptimizer clips by a norm without the experts) and ZeRO-3 with tp > 1 (its
norm skips the TP sum for expert parameters).
"""
from __future__ import annotations

import contextlib

import torch.nn as nn
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name for the EP group of size ep (deepspeed/moe/layer.py)."""
    return f"ep_size_{ep}"


def register_expert_groups(name: str, ep_group, edp_group, ep_ranks, edp_ranks) -> None:
    """ctxpar's EP and EDP groups under DeepSpeed's name for them (deepspeed.utils.groups)."""
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = ep_ranks
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = edp_ranks


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
        register_expert_groups(self.expert_group_name, *self._groups)

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertGroups only registers process groups; ctxpar's MoE layers "
                           "(models/moe.py) compute")


def prepare_expert_parallel(model: nn.Module, state, num_experts: int, stage: int = 0) -> str:
    """Before ``partition_for_zero3`` and deepspeed.initialize, ep > 1: flag the experts'
    parameters (``expert_shard``, set by models/moe.py) as DeepSpeed's MoE parameters of this
    EP group and attach the ExpertGroups module, or under ZeRO-3 place them for DeepSpeed's
    stage-3 expert partitioning (``zero3_expert_placement``; stage: the ZeRO stage, only 3
    differs); the EP group's name, which the optimizer's expert groups carry
    (models/training.py's param_groups)."""
    name = expert_group_name(state.ep_size)
    experts = [p for p in model.parameters() if getattr(p, "expert_shard", None) is not None]
    for p in experts:
        p.allreduce, p.group_name = False, name
    if stage == 3:
        zero3_expert_placement(experts, state, name)
    else:
        model.deepspeed_expert_groups = ExpertGroups(num_experts, state)
    return name


def zero3_expert_placement(experts, state, name: str) -> None:
    """ZeRO-3: the experts partitioned over their EDP group, the rest over dp x cp.

    DeepSpeed 0.19.8's stage 3 keeps a partition group per parameter and computes, for the
    parameters it calls AutoEP experts (``ds_zero_placement_family = "autoep_expert"``),
    what ctxpar's experts need: ``zero.Init`` partitions each over its
    ``ds_zero_partition_process_group`` (partition_parameters.py ``_convert_to_deepspeed_
    param``); stage3.py buckets and reduce-scatters gradients per group, rescales an
    expert's to the division by |dp x cp| that every other gradient gets
    (``_gradient_averaging_world_size``: ctxpar's ZeRO-3 divisor, distributed/zero.py), keeps
    the fp32 partitions and Adam states per group, and adds the gradient norm over the EP
    group (``_autoep_expert_parallel_group``, by ``ds_zero_partition_group_name``). The
    engine's own path to that placement (``_resolve_zero3_param_placement``) runs only for
    AutoEP layers, and with a DeepSpeed ``MoE`` in the model the engine refuses stage 3
    (``_validate_zero3_moe_compatibility``), so ctxpar sets the three attributes itself,
    before ``partition_for_zero3`` converts the model, registers the groups, and attaches no
    ExpertGroups. Config refuses tp > 1 here: that norm skips the TP sum for these
    parameters (``_grad_norm_counts_every_rank``: AutoEP's EP group spans TP, ctxpar's not).
    """
    register_expert_groups(name, state.ep_group, state.edp_group, state.ranks("ep"),
                           state.ranks("edp"))
    for p in experts:
        p.ds_zero_placement_family = "autoep_expert"
        p.ds_zero_partition_group_name = name
        p.ds_zero_partition_process_group = state.edp_group


@contextlib.contextmanager
def dense_format(engine):
    """While the engine saves or loads a checkpoint: its dense format (the module
    docstring), has_moe_layers back as it was after. A no-op without experts (the flag is
    off)."""
    had = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = had
