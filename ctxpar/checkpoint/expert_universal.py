"""The experts in DeepSpeed's universal checkpoint: from any ep, to any ep.

An expert tensor (models/moe.py: ``experts.gate_up_proj`` (E, 2f, d), ``experts.down_proj``
(E, d, f), gpt-oss's ``_bias`` of each) is held E/ep experts a rank, dim 0 split over the EP group, and under ZeRO 1/2
its fp32 weight and Adam states are partitioned over the expert-data-parallel group
(ctxpar/distributed/expert_parallel.py). ds_to_universal merges every parameter's ZeRO
fragments over the whole dp x cp group, which for an expert would stack different ranks'
experts as if they were one tensor's pieces. ``ep_zero_to_universal`` extracts the
fragments itself: the shard of dp x cp position r belongs to EP rank r % ep and EDP rank
r // ep (ParallelState's folding: EP groups are consecutive positions), and EP rank e's
experts are rows e E/ep ... of the full tensor, so the fragments laid in the order
(EP rank, EDP rank) are the full tensor's, flattened. The rest is ds_to_universal's own
merge (TP slices by universal_checkpoint_info) and files.

``mark_experts`` then tags every expert's universal files the way DeepSpeed's loader
slices experts for a target with EP groups (``load_hp_checkpoint_state``:
``EP_IS_EXPERT_PARAM`` / ``EP_NUM_EXPERTS``, rows ep_rank E/ep ... kept), with the
sub-parameter shape's expert dim left free (-1) so the TP split that follows applies to
the E/ep rows kept. At ep = 1 nothing is sliced and the tags are inert.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import re
import shutil
from argparse import Namespace
from typing import Dict, List

import torch

EXPERT_TENSOR = re.compile(r".*\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def is_expert(name: str) -> bool:
    """An expert tensor's name, as GPT or the pipeline module names it."""
    return EXPERT_TENSOR.match(name) is not None


def ep_zero_to_universal(tag_dir: str, out_dir: str, ep: int) -> None:
    """A ZeRO 1/2 checkpoint saved at ep > 1 -> universal (module docstring). Under a
    pipeline each stage's shards hold its own layers' parameters (the stage module's names,
    distinct between stages but for the tied embedding's identical copies), each stage's EP
    and EDP groups folded over its own dp x cp as at pp 1: the stages are read in turn."""
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint import constants as C
    from deepspeed.checkpoint import ds_to_universal as dsu

    ckpt = DeepSpeedCheckpoint(tag_dir)
    tmp, edp = os.path.join(out_dir, "tmp"), ckpt.dp_degree // ep
    for pp, tp in itertools.product(range(ckpt.pp_degree), range(ckpt.tp_degree)):
        for r in range(ckpt.dp_degree):
            optim = ckpt.get_zero_checkpoint_state(pp_index=pp, tp_index=tp,
                                                   dp_index=r)[C.OPTIMIZER_STATE_DICT]
            states = optim[C.BASE_OPTIMIZER_STATE]["state"]
            for g, mapping in enumerate(optim[C.PARAM_SLICE_MAPPINGS]):
                flat = dict(exp_avg=states[g]["exp_avg"], exp_avg_sq=states[g]["exp_avg_sq"],
                            fp32=optim[C.SINGLE_PARTITION_OF_FP32_GROUPS][g])
                if "step" in states[g]:
                    flat["step"] = states[g]["step"]
                for name, frag in mapping.items():
                    index = (r % ep) * edp + r // ep if is_expert(name) else r
                    for key, tensor in flat.items():
                        dsu.dump_param_fragment(tmp, tp, index, key, tensor, name, frag.start,
                                                frag.numel)
    uc_info = ckpt.get_checkpoint_info(C.UNIVERSAL_CHECKPOINT_INFO)
    zero = os.path.join(out_dir, "zero")
    for name, per_tp in _full_shapes(ckpt.mp_rank_files, ep, ckpt.tp_degree).items():
        dsu.merge_tp_slices(uc_info, zero, tmp, ckpt.tp_degree, (name, per_tp))
    dsu._save_optimizer_state(Namespace(output_folder=out_dir), ckpt)
    shutil.rmtree(tmp, ignore_errors=True)
    for f in ckpt.mp_rank_files:
        shutil.copy2(f, out_dir)


def _full_shapes(mp_rank_files: List[str], ep: int, tp_degree: int
                 ) -> Dict[str, List[torch.Size]]:
    """{name: [its shape on TP rank t]} from the model files' ZeRO param_shapes, an expert's
    over all E experts (ep times its E/ep rows). The files are pp-major (file i: stage
    i // tp_degree, TP rank i % tp_degree, as ds_to_universal reads them); a name on several
    stages (the tied embedding) counts once per TP rank."""
    per_tp: List[Dict[str, torch.Size]] = [{} for _ in range(tp_degree)]
    for i, path in enumerate(sorted(mp_rank_files)):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        for group in sd["param_shapes"]:
            for name, shape in group.items():
                if is_expert(name):
                    shape = torch.Size([shape[0] * ep, *shape[1:]])
                per_tp[i % tp_degree].setdefault(name, shape)
    return {name: [shapes[name] for shapes in per_tp] for name in per_tp[0]}


def mark_experts(out_dir: str, num_experts: int) -> None:
    """Tag the expert tensors of a universal folder for DeepSpeed's EP-aware load (module
    docstring); the other parameters' files are left as they are."""
    from deepspeed.checkpoint import constants as C

    zero = os.path.join(out_dir, "zero")
    for name in os.listdir(zero):
        if not is_expert(name):
            continue
        for path in glob.glob(os.path.join(zero, name, "*.pt")):
            if os.path.basename(path) == "step.pt":
                continue
            sd = torch.load(path, map_location="cpu", weights_only=False)
            sd[C.EP_IS_EXPERT_PARAM], sd[C.EP_NUM_EXPERTS] = True, num_experts
            sub = sd.get(C.SUB_PARAM_SHAPE)
            if sub is not None:
                sd[C.SUB_PARAM_SHAPE] = dataclasses.replace(sub, shape=(-1, *sub.shape[1:]))
            torch.save(sd, path)
