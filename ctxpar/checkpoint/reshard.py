"""Resume on the layout that saved a checkpoint, or on another one.

    point = resume_point(save_dir, "auto", cfg, world_size)  # files only: before any collective
    point.configure(ds_config)                               # before deepspeed.initialize
    client_state = restore(engine, point, cfg, state, meta)  # collective; meta: every layer

Same layout (tp, cp, pp, dp, ZeRO stage, dtype all equal): DeepSpeed's own load, the
per-rank RNG states too; bit-identical continuation. Another layout: rank 0 converts the
tag to DeepSpeed's universal checkpoint under ``<save_dir>/universal/<tag>`` (universal.py),
every rank loads its slices from it (DeepSpeed's ``load_universal`` for ZeRO 1-2;
ctxpar's loader for a ZeRO-0 torch optimizer) and the folder is removed.
Restored exactly either way: fp32 master weights, Adam exp_avg / exp_avg_sq / step, the LR
scheduler, DeepSpeed's step counters and the data position (``samples_consumed`` counts
global samples: every DP split of a global batch reads the same samples, see
ctxpar/data/loader.py). Not restored across layouts: the per-rank RNG states (there is no
rank-to-rank correspondence; ctxpar's training draws no random numbers after init: data
comes from per-sample seeded generators and there is no dropout).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from .expert_states import restore_experts
from .names import pipeline_ties_embedding
from .resume import (CheckpointError, latest_complete, load as load_same_layout, resume_problem,
                     run_on_rank0, verify)
from .universal import (check_complete, load_buffers_, load_into_torch_optimizer, load_meta,
                        naming, num_experts, to_universal)
from .weights import checkpoint_buffers, gpt_named_buffers

LAYOUT_KEYS = ("tp", "cp", "pp", "dp", "ep", "zero_stage", "dtype")
# model.* fields a resumed run may change: RoPE's frequencies (context extension); shapes
# must match. model.init_from only matters for a fresh run, model.family for the export.
MODEL_MAY_CHANGE = ("rope_theta", "rope_scaling", "init_from", "family")


def _expert_groups(layout: Dict[str, Any]) -> bool:
    """Whether the optimizer holds the experts in groups of their own on this layout
    (models/training.py param_groups: all but a pipeline at ep 1)."""
    return layout["pp"] == 1 or layout.get("ep", 1) > 1


def layout_of(cfg, dp: int) -> Dict[str, Any]:
    """What decides how a checkpoint is cut into files: the grid, ZeRO stage and dtype."""
    ds = cfg.deepspeed
    dtype = ("bf16" if (ds.get("bf16") or {}).get("enabled") else
             "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32")
    p = cfg.parallel
    return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp, "ep": p.ep,
            "zero_stage": int((ds.get("zero_optimization") or {}).get("stage", 0)),
            "dtype": dtype, "order": p.order}


def describe(layout: Dict[str, Any]) -> str:
    """'tp2·cp2·pp1·dp1 ZeRO-1 fp32' ('·ep2' after dp under expert parallelism)"""
    grid = "·".join(f"{k}{layout[k]}" for k in ("tp", "cp", "pp", "dp"))
    if layout.get("ep", 1) > 1:
        grid += f"·ep{layout['ep']}"
    return f"{grid} ZeRO-{layout['zero_stage']} {layout['dtype']}"


def checkpoint_meta(cfg, dp: int) -> Dict[str, Any]:
    """What the manifest records besides files: the saving layout and the whole config."""
    from ..config import to_dict
    return {"layout": layout_of(cfg, dp), "config": to_dict(cfg)}


def optimizer_kind(layout: Dict[str, Any]) -> Optional[str]:
    """Which optimizer DeepSpeed builds for a layout, as far as resharding is concerned.

    'zero' (ZeRO 1-2) loads universal checkpoints itself; 'torch' (fp32 at stage 0: the
    torch AdamW) is converted and loaded by ctxpar (universal.py). None: the 16-bit
    stage-0 optimizers, FP16_Optimizer (fp16, or bf16 without a pipeline) and
    BF16_Optimizer (bf16 with a pipeline): DeepSpeed 0.19.8 saves no ``param_shapes`` for
    them, so ds_to_universal cannot convert their checkpoints (FP16_Optimizer cannot load
    one either); and ZeRO-3, whose partitions ctxpar lays over dp x cp itself
    (ctxpar/distributed/zero.py): converting those is not covered (resumes on the saving
    layout only).
    """
    stage, dtype = layout["zero_stage"], layout["dtype"]
    if stage in (1, 2):
        return "zero"
    if stage == 0 and dtype == "fp32":
        return "torch"
    return None


@dataclass
class ResumePoint:
    save_dir: str
    tag: str
    manifest: Dict[str, Any]
    now: Dict[str, Any]
    changed: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.save_dir, self.tag)

    @property
    def universal(self) -> bool:
        """Whether the checkpoint must be resharded (saved on another layout)."""
        return bool(self.changed)

    @property
    def universal_dir(self) -> str:
        return os.path.join(self.save_dir, "universal")

    def configure(self, ds_config: Dict[str, Any]) -> None:
        """Ask DeepSpeed's ZeRO optimizer to read a universal checkpoint (before init)."""
        if self.universal and optimizer_kind(self.now) != "torch":
            ds_config.setdefault("checkpoint", {})["load_universal"] = True

    def describe_changes(self) -> str:
        saved = self.manifest["layout"]
        what = ", ".join(f"{k} {a}->{b}" for k, (a, b) in self.changed.items())
        return (f"resharded {self.tag} ({what}): saved on {describe(saved)}, now "
                f"{describe(self.now)}, through DeepSpeed's universal checkpoint; weights, "
                f"Adam states, LR schedule and data position restored exactly, per-rank "
                f"RNG states not (no rank correspondence; training draws none)")


def _check_model(manifest: Dict[str, Any], cfg, tag_dir: str) -> None:
    from ..config import ModelConfig, to_dict
    saved = (manifest.get("config") or {}).get("model")
    if saved is None:
        return
    now = to_dict(cfg)["model"]
    # a field the saving ctxpar did not have yet held its default
    saved = {**vars(ModelConfig()), **saved}
    for key in sorted(set(saved) | set(now)):
        if key in MODEL_MAY_CHANGE or saved.get(key) == now.get(key):
            continue
        raise CheckpointError(
            f"{tag_dir} was saved with model.{key}={saved.get(key)!r}, the config has "
            f"model.{key}={now.get(key)!r}: resuming needs the same model (start a new run "
            f"from its weights with model.init_from={tag_dir} instead)")


def resume_point(save_dir: str, resume: str, cfg, world_size: int,
                on_skip: Optional[Callable[[str], None]] = None) -> Optional[ResumePoint]:
    """Which tag to resume and whether it needs resharding; pure file reads.

    resume: 'auto' (newest tag whose manifest verifies, skipping damaged ones through
    on_skip), 'none', or a tag (must verify). Raises CheckpointError (one line) for a
    damaged tag, another model, or a layout change DeepSpeed cannot convert.
    """
    from ..distributed.parallel_state import resolve_sizes
    if resume == "none":
        return None
    tag = latest_complete(save_dir, on_skip) if resume == "auto" else resume
    if tag is None:
        return None
    problem = resume_problem(save_dir, resume)  # an explicit tag that is missing or unfinished
    if problem:
        raise CheckpointError(problem)
    tag_dir = os.path.join(save_dir, tag)
    manifest = verify(tag_dir)
    _check_model(manifest, cfg, tag_dir)
    p = cfg.parallel
    now = layout_of(cfg, resolve_sizes(world_size, p.tp, p.cp, p.pp, p.dp)["dp"])
    saved = manifest.get("layout")
    if saved is None:  # a marker from before manifests: only the layout that wrote it
        return ResumePoint(save_dir, tag, manifest, now)
    saved = {"ep": 1, **saved}  # manifests from before expert parallelism
    changed = {k: (saved[k], now[k]) for k in LAYOUT_KEYS if saved[k] != now[k]}
    point = ResumePoint(save_dir, tag, manifest, now, changed)
    if point.universal and cfg.model.moe is not None and \
            _expert_groups(saved) != _expert_groups(now):
        raise CheckpointError(
            f"{tag_dir}: cannot resume a mixture of experts saved on {describe(saved)} on "
            f"{describe(now)}: a pipeline at ep 1 keeps the experts in the optimizer's dense "
            f"groups, any other layout gives them groups of their own (models/training.py "
            f"param_groups), and DeepSpeed restores group by group; keep both sides pipelined "
            f"at ep 1, or neither")
    if point.universal:
        for which, layout in (("saved on", saved), ("resumed on", now)):
            if optimizer_kind(layout) is None:
                raise CheckpointError(
                    f"{tag_dir}: cannot change the layout ({', '.join(changed)}) of a run "
                    f"{which} {describe(layout)}: resharding takes fp32 at ZeRO stage 0-2 "
                    f"and 16-bit at stage 1-2 (DeepSpeed cannot convert its 16-bit stage-0 "
                    f"optimizers; ZeRO-3 is not covered); resume on {describe(saved)}")
    return point


def restore(engine, point: ResumePoint, cfg, state, whole_model) -> Dict[str, Any]:
    """Collective: load the point's tag into the engine (resharding if needed); the client_state.

    whole_model: the model's every layer at this run's TP, best on the meta device (as for
    universal_checkpoint_info): its GPT parameter names are the ones the new layout must
    find in the converted checkpoint.
    """
    if not point.universal:
        client_state = load_same_layout(engine, point.save_dir, point.tag)
        # ep > 1: the module file holds EP rank 0's experts; every rank's own come from its
        # ZeRO shard or, at ZeRO-0, its EP rank's file (expert_states.py)
        restore_experts(engine, point.path)
        return client_state
    from ..distributed.expert_parallel import dense_format
    m = cfg.model
    pipelined = cfg.parallel.pp > 1
    target = naming(pipelined, m.n_layers, pipeline_ties_embedding(m))
    out_dir = os.path.join(point.universal_dir, point.tag)
    # every parameter of every stage of the new layout, in its module's names
    wanted = [target(n) for n, _ in whole_model.named_parameters()]

    def convert():
        to_universal(point.path, out_dir, point.manifest["layout"], m.n_layers, target,
                     num_experts(m))
        check_complete(out_dir, wanted)

    run_on_rank0(convert)
    if optimizer_kind(point.now) == "torch":
        load_into_torch_optimizer(engine, out_dir, state.tp_group)
        client_state = load_meta(engine, out_dir)
    else:
        with dense_format(engine):  # ep > 1: DeepSpeed's MoE load wants per-expert files
            path, client_state = engine.load_checkpoint(point.universal_dir, tag=point.tag,
                                                        load_optimizer_states=True,
                                                        load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {out_dir}")
    # the routers' correction biases: from the model file, or a pipeline's layer files
    load_buffers_(gpt_named_buffers(engine.module),
                  checkpoint_buffers(point.path, out_dir, m.n_layers))
    dist.barrier()  # every rank has read its slices
    if dist.get_rank() == 0:
        shutil.rmtree(point.universal_dir, ignore_errors=True)
    return client_state
