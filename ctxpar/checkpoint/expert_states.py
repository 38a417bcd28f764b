"""Each EP rank's experts in a checkpoint, at every ZeRO stage (expert parallelism, ep > 1).

The engine saves an ep > 1 model in its dense format (ctxpar/distributed/expert_parallel.py,
``dense_format``): one module file, written by one rank, holds EP rank 0's experts only.
Every rank's own experts are restored from per-rank state instead:

    ZeRO 1/2   the rank's ZeRO shard: the fp32 partitions of its experts and their Adam
               states (DeepSpeed's MoE param groups, partitioned over the EDP group);
               DeepSpeed restores them, ``update_lp_params`` copies them into the weights
    ZeRO 3     the rank's ZeRO shard, its expert partitions with every other (DeepSpeed
               restores them; the model carries no ExpertGroups there, so nothing here)
    ZeRO 0     one file per (EP rank, model file), written here beside the engine's by the
               EDP group's first rank (its EDP peers hold the same experts and states);
               MM is the index of the engine's own mp_rank_MM file on this rank (the TP
               rank, or under a pipeline the (stage, TP rank) position: each stage's
               experts are its own layers'):

                   experts_ep<EE>_mp_rank_<MM>.pt
                       module     {name: this EP rank's slice of an expert tensor}
                       optimizer  the optimizer's whole state_dict (torch AdamW at fp32;
                                  FP16_Optimizer's fp32 master and moments at 16 bits)

               restored over the dense load: the weights copied into the experts, the
               optimizer state loaded whole (its dense entries equal every other rank's).

The whole optimizer state, not the experts' entries alone, because a stage-0 optimizer's
state is keyed by position (torch) or flattened per group (FP16_Optimizer): the file is the
same object DeepSpeed's own stage-0 MoE checkpoint keeps per EP rank
(``expp_rank_<e>_mp_rank_<t>_optim_states.pt``, engine.py ``_save_moe_checkpoint``), which
ctxpar cannot have the engine write (the docstring of expert_parallel.py). The universal
conversion of a ZeRO-0 checkpoint reads these files for the experts (``full_experts``).
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict, List

import torch


def experts_file(tag_dir: str, ep_rank: int, mp_rank: int) -> str:
    return os.path.join(tag_dir, f"experts_ep{ep_rank:02d}_mp_rank_{mp_rank:02d}.pt")


def _ranks(engine):
    """(EP rank, EDP rank, model-file index) of this rank, from the groups ctxpar
    registered under DeepSpeed's name (expert_parallel.ExpertGroups); the index is the one
    DeepSpeed names its mp_rank file by (its mpu's model-parallel rank: TP, or a pipeline
    grid's pipe x model position)."""
    from deepspeed.utils import groups

    name = engine.module.deepspeed_expert_groups.expert_group_name
    return (groups._get_expert_parallel_rank(name), groups._get_expert_data_parallel_rank(name),
            engine.mpu.get_model_parallel_rank())


def _has_experts(engine) -> bool:
    """ep > 1 at ZeRO 0-2 (expert_parallel.prepare_expert_parallel attaches ExpertGroups)."""
    return getattr(engine.module, "deepspeed_expert_groups", None) is not None


def _expert_params(engine) -> Dict[str, torch.nn.Parameter]:
    return {n: p for n, p in engine.module.named_parameters()
            if getattr(p, "expert_shard", (0, 1))[1] > 1}


def save_experts(engine, tag_dir: str) -> None:
    """After the engine's save, ZeRO-0 with ep > 1: the EDP group's first rank writes its EP
    rank's experts and optimizer state (module docstring); nothing otherwise."""
    if not _has_experts(engine) or engine.zero_optimization():
        return
    ep_rank, edp_rank, mp_rank = _ranks(engine)
    if edp_rank != 0:
        return
    module = {n: p.detach().cpu().clone() for n, p in _expert_params(engine).items()}
    torch.save({"module": module, "optimizer": engine.optimizer.state_dict()},
               experts_file(tag_dir, ep_rank, mp_rank))


@torch.no_grad()
def restore_experts(engine, tag_dir: str) -> None:
    """After the engine's load at the saving layout, ep > 1: this rank's own experts into
    the weights (and at ZeRO-0 their optimizer state), over the module file's EP rank 0's."""
    if not _has_experts(engine):
        return
    if engine.zero_optimization():
        engine.optimizer.update_lp_params()  # the shard's fp32 partitions -> the weights
        return
    ep_rank, _, mp_rank = _ranks(engine)
    path = experts_file(tag_dir, ep_rank, mp_rank)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: a ZeRO-0 checkpoint at ep > 1 keeps EP rank "
                                f"{ep_rank}'s experts there")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    params = _expert_params(engine)
    if set(saved["module"]) != set(params):
        raise RuntimeError(f"{path} holds experts {sorted(saved['module'])}, the model has "
                           f"{sorted(params)}")
    for name, p in params.items():
        p.copy_(saved["module"][name])
    engine.optimizer.load_state_dict(saved["optimizer"])


def full_experts(tag_dir: str, sd: Dict[str, Any], ep: int, mp_rank: int) -> Dict[str, Any]:
    """The ZeRO-0 mp_rank_<mp_rank> file's state (its module, None under a pipeline, and
    torch optimizer state, holding EP rank 0's experts) with every expert tensor (in the
    module) and Adam moment made whole: the EP ranks' files' slices concatenated along the
    expert dim in EP rank order (ParallelState's EP ranks hold experts e E/ep ...). For the
    universal conversion (universal.zero0_to_universal)."""
    files: List[Dict[str, Any]] = []
    for e in range(ep):
        path = experts_file(tag_dir, e, mp_rank)
        if not os.path.isfile(path):
            found = sorted(os.path.basename(f) for f in glob.glob(
                os.path.join(tag_dir, "experts_ep*_mp_rank_*.pt")))
            raise FileNotFoundError(f"{path} is missing (a ZeRO-0 checkpoint at ep={ep} has "
                                    f"one per EP rank; found {found})")
        files.append(torch.load(path, map_location="cpu", weights_only=False))
    ids = [i for g in sd["optimizer"]["param_groups"] for i in g["params"]]
    names = [n for g in sd["optimizer_param_names"] for n in g]
    module, state = dict(sd["module"] or {}), dict(sd["optimizer"]["state"])
    for name, idx in zip(names, ids):
        if name not in files[0]["module"]:
            continue  # a dense parameter: the same on every rank
        module[name] = torch.cat([f["module"][name] for f in files])
        moments = [f["optimizer"]["state"][idx] for f in files]
        state[idx] = {**moments[0], **{k: torch.cat([m[k] for m in moments])
                                       for k in ("exp_avg", "exp_avg_sq")}}
    return {**sd, "module": module, "optimizer": {**sd["optimizer"], "state": state}}
