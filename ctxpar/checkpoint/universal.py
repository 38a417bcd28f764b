"""A checkpoint of any layout as DeepSpeed's universal checkpoint: one full tensor per parameter.

DeepSpeed's universal format (deepspeed/checkpoint/ds_to_universal.py) stores, for every
parameter, the full unsharded fp32 weight and Adam's exp_avg, exp_avg_sq and step:

    <out>/zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt
    <out>/zero/optimizer_state.pt          param-group hyperparameters, loss scaler, ds_version
    <out>/mp_rank_XX_model_states.pt       copied: LR scheduler, step counters, client state

and a ZeRO optimizer built with ``checkpoint.load_universal`` cuts each tensor back to its
own TP slice and ZeRO partition (``load_hp_checkpoint_state``). Exact: tensors are copied,
never recomputed. What DeepSpeed needs to know about ctxpar's tensor parallelism is what
``universal_checkpoint_info`` declares (DeepSpeed writes it into every mp_rank file):

    TP-replicated      norms, row-parallel biases, and k/v of ReplicatedHeadLinear (GQA with
                       n_kv_heads < tp): one copy is the full tensor (ds_to_universal checks
                       all copies are equal)
    row-parallel       o_proj, down_proj: TP slices concatenate along dim 1
    everything else    column-parallel q/k/v/gate/up and the vocab-parallel embedding and
                       head: along dim 0. ctxpar never pads the vocabulary (config refuses
                       vocab_size % tp), so no vocabulary pattern is needed
    pipeline-replicated  the tied embedding, held by the first and the last stage

What the format cannot represent, and ctxpar therefore does itself (``zero0_to_universal``,
``load_into_torch_optimizer``): a checkpoint of **ZeRO stage 0 with fp32**, where the
optimizer is the torch AdamW itself. ds_to_universal reads only ZeRO optimizer shards
(``*_optim_states.pt`` with ``param_slice_mappings``); a stage-0 checkpoint keeps torch's
``optimizer.state_dict()`` in the mp_rank files, keyed by parameter position, and on load
the engine's universal path calls ``optimizer.update_lp_params()``, which a torch
optimizer does not have. ctxpar writes stage-0 shards into the same universal layout
with ds_to_universal's own ``dump_param_fragment`` / ``merge_tp_slices``, and restores a
stage-0 target from it with the same TP rule the model's init uses (``shard_full_tensor``).
The 16-bit stage-0 optimizers (FP16_Optimizer, BF16_Optimizer) save no ``param_shapes``,
so ds_to_universal cannot read them either; ``reshard.py`` refuses those in one line.

Parameter names: universal folders are keyed by the module's parameter names, which differ
between GPT and the pipeline module (names.py); ``to_universal`` renames them to the
target's.
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shutil
from argparse import Namespace
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..tensor_parallel.utils import is_tensor_parallel, partition_sections, shard_full_tensor
from .names import from_pipe, to_pipe

ZERO_DIR = "zero"
STATES = ("fp32", "exp_avg", "exp_avg_sq", "step")


def _pattern(name: str) -> str:
    """An anchored regex for a parameter name, any layer index: the same rule on every layer."""
    m = re.match(r"^(layers\.)?(\d+)\.(.*)$", name)
    if m:
        return f"{re.escape(m.group(1) or '')}\\d+\\.{re.escape(m.group(3))}$"
    return re.escape(name) + "$"


def universal_checkpoint_info(whole_model, n_layers: int, tied: bool,
                              pipelined: bool = False) -> Dict:
    """DeepSpeed's UNIVERSAL_CHECKPOINT_INFO for this model at this TP degree.

    whole_model: every layer of the model (not one pipeline stage), best on the meta device,
    built with this run's TP group: its named_parameters() carry GPT's names (names.py) and
    the TP layers' attributes (Megatron's ``tensor_model_parallel``, ``partition_dim``),
    from which the rules derive, so they cover every pipeline stage, in the names of the
    module DeepSpeed saves (GPT's, or the pipeline's). Set the result as the trained model's
    ``universal_checkpoint_info`` attribute before ``deepspeed.initialize``.
    """
    from deepspeed.checkpoint import constants as C

    rules = {}  # pattern -> {rule: [keys]}: one rule for every layer, unless they differ
    for name, p in whole_model.named_parameters():
        key = to_pipe(name, n_layers, tied) if pipelined else name
        rule = ("replicated" if not is_tensor_parallel(p) else "fused" if
                partition_sections(p) else "row" if p.partition_dim == 1 else "column")
        rules.setdefault(_pattern(key), {}).setdefault(rule, []).append((key, p))
    replicated, row, fused = set(), set(), {}
    for pattern, by_rule in rules.items():
        for rule, keys in by_rule.items():  # per-type K/V heads: a layer type's k/v
            # replicated (fewer heads than TP ranks) beside another's split, each by name
            named = [(pattern, keys[0][1])] if len(by_rule) == 1 else \
                [(re.escape(k) + "$", p) for k, p in keys]
            for one, p in named:
                if rule == "replicated":
                    replicated.add(one)
                elif rule == "fused":  # fused parts, or the experts' (E, d, f) split on f
                    fused[one] = p
                elif rule == "row":
                    row.add(one)
    info = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            C.TP_REPLICATED_PARAMETER_PATTERNS: sorted(replicated),
            C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(row),
            **sub_params_info(fused)}
    if pipelined and tied:
        info[C.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [r"tied_modules\.embed\."]
    return info


def sub_params_info(fused: Dict[str, torch.Tensor]) -> Dict:
    """DeepSpeed's entries for fused TP parameters (partition_sections: a GDN's
    [q | k | v] rows, Mamba2's [z | x | B | C | dt], an expert's [gate | up]; the experts'
    (E, d, f) down_proj, one part split along f): each part split
    over TP on its own, so merge_tp_slices joins part by part along the split dim (its
    sub-parameter rule, UCP 0.4 widths)."""
    from deepspeed.checkpoint import constants as C

    if not fused:
        return {}
    shapes, widths = [], {}
    for pattern, p in sorted(fused.items()):
        sections, dim = partition_sections(p), p.partition_dim
        tp = sum(sections) // p.shape[dim]
        shape = list(p.shape)
        shape[dim] = tuple(sections)
        shapes.append(dict(patterns=[pattern], shape=tuple(shape), partition_dim=dim))
        widths[pattern] = [[n // tp] * tp for n in sections]
    return {C.PARAMETER_WITH_SUB_PARAMS: shapes, C.SUB_PARAM_SHARD_WIDTHS: widths}


def naming(pipelined: bool, n_layers: int, tied: bool) -> Callable[[str], str]:
    """GPT name -> the name this model form (pipeline or not) gives the parameter."""
    return (lambda n: to_pipe(n, n_layers, tied)) if pipelined else (lambda n: n)


def gpt_naming(pipelined: bool, n_layers: int) -> Callable[[str], str]:
    """This model form's parameter name -> GPT name."""
    return (lambda n: from_pipe(n, n_layers)) if pipelined else (lambda n: n)


@contextlib.contextmanager
def _quiet():
    """ds_to_universal prints progress and tqdm bars; keep them for an error message only."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def zero0_to_universal(tag_dir: str, out_dir: str, n_layers: int, pipelined: bool,
                       ep: int = 1) -> None:
    """A ZeRO stage-0 fp32 checkpoint (torch AdamW state in the mp_rank files) -> universal.

    Every (pp stage, TP rank) file contributes its parameters as dp-rank-0 fragments in
    ds_to_universal's temp layout; its ``merge_tp_slices`` then joins the TP slices under
    the same universal_checkpoint_info rules as for ZeRO checkpoints. At ep > 1 the experts
    are taken whole from the EP ranks' files (expert_states.full_experts).
    """
    from .expert_states import full_experts
    from deepspeed.checkpoint import constants as C
    from deepspeed.checkpoint.ds_to_universal import dump_param_fragment, merge_tp_slices

    tmp = os.path.join(out_dir, "tmp")
    shapes: Dict[str, Dict[int, torch.Size]] = {}
    uc_info, first = None, None
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    for path in files:
        sd = torch.load(path, map_location="cpu", weights_only=False)
        if ep > 1:  # the mp_rank_<MM> file's experts from every EP rank's file of MM
            mp_rank = int(os.path.basename(path)[len("mp_rank_"):].split("_")[0])
            sd = full_experts(tag_dir, sd, ep, mp_rank)
        first = first or sd
        uc_info = uc_info or sd.get(C.UNIVERSAL_CHECKPOINT_INFO)
        tp_rank, opt = sd["tp_rank"], sd["optimizer"]
        ids = [i for g in opt["param_groups"] for i in g["params"]]
        param_names = [n for g in sd["optimizer_param_names"] for n in g]
        for name, idx in zip(param_names, ids):
            whole = sd["module"] or {}  # a pipeline's: its full experts only (ep > 1)
            value = whole[name] if name in whole else _pipe_layer_value(
                tag_dir, name, tp_rank, n_layers)
            state = opt["state"][idx]
            shapes.setdefault(name, {})[tp_rank] = value.shape
            for key, tensor in (("fp32", value), ("exp_avg", state["exp_avg"]),
                                ("exp_avg_sq", state["exp_avg_sq"])):
                flat = tensor.detach().float().flatten()
                dump_param_fragment(tmp, tp_rank, 0, key, flat, name, 0, flat.numel())
            dump_param_fragment(tmp, tp_rank, 0, "step", state["step"], name, 0, 1)
    if first is None:
        raise FileNotFoundError(f"{tag_dir}: no mp_rank_*_model_states.pt")
    tp_degree = first["checkpoint_parallel_dimensions"][C.CHECKPOINT_TP_DEGREE]
    zero = os.path.join(out_dir, ZERO_DIR)
    for name, per_tp in shapes.items():
        merge_tp_slices(uc_info, zero, tmp, tp_degree,
                        (name, [per_tp[r] for r in range(tp_degree)]))
    groups = [dict(g) for g in first["optimizer"]["param_groups"]]
    torch.save({C.PARAM_GROUPS: groups, C.DS_VERSION: first[C.DS_VERSION], C.ZERO_STAGE: 0},
               os.path.join(zero, "optimizer_state.pt"))
    shutil.rmtree(tmp, ignore_errors=True)
    for path in files:
        _link_or_copy(path, os.path.join(out_dir, os.path.basename(path)))


def _pipe_layer_value(tag_dir: str, pipe_name: str, tp_rank: int, n_layers: int
                      ) -> torch.Tensor:
    """A pipeline parameter from DeepSpeed's per-layer file layer_XX-model_YY-model_states.pt."""
    if pipe_name.startswith("tied_modules.embed."):
        index, key = 0, pipe_name[len("tied_modules.embed."):]
    else:
        index, key = pipe_name.split(".", 1)
        index = int(index)
    path = os.path.join(tag_dir, f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)[key]


def num_experts(model_cfg) -> Optional[int]:
    """model.moe's routed experts per layer (None: no experts)."""
    return model_cfg.moe.num_experts if model_cfg.moe is not None else None


def to_universal(tag_dir: str, out_dir: str, layout: Dict, n_layers: int,
                 target: Callable[[str], str], experts: Optional[int] = None) -> List[str]:
    """Convert the checkpoint in tag_dir (saved with ``layout``) into a universal folder.

    ``target`` maps GPT names to the names of the module that will load it (``naming``);
    experts: model.moe's num_experts, whose tensors are converted and tagged for any ep
    (expert_universal.py). Returns the GPT names found. out_dir is replaced.
    """
    from .expert_universal import ep_zero_to_universal, mark_experts

    ep = layout.get("ep", 1)
    if ep > 1 and layout["zero_stage"] == 3:
        # each expert's ZeRO-3 partitions span its EDP group, not the dp x cp group the
        # shards' merge (DeepSpeed's zero_to_fp32, ds_to_universal) assumes
        raise ValueError(f"{tag_dir}: a ZeRO-3 checkpoint at ep={ep} cannot be converted to "
                         f"the universal format (generate.py, model.init_from, the export and "
                         f"a resume on another layout read it so); resume it on its own layout")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    src_pipelined = layout["pp"] > 1
    with _quiet() as log:
        try:
            if ep > 1 and layout["zero_stage"] > 0:  # ZeRO 1/2 (3 refused above), any pp
                ep_zero_to_universal(tag_dir, out_dir, ep)
            elif glob.glob(os.path.join(tag_dir, "*_optim_states.pt")):
                from deepspeed.checkpoint import ds_to_universal
                ds_to_universal.main(Namespace(input_folder=tag_dir, output_folder=out_dir,
                                               num_extract_workers=1, num_merge_workers=1,
                                               keep_temp_folder=False, strict=True,
                                               inject_missing_state=False))
            else:
                zero0_to_universal(tag_dir, out_dir, n_layers, src_pipelined, ep)
            if experts:
                mark_experts(out_dir, experts)
        except Exception as e:
            raise RuntimeError(f"converting {tag_dir} to a universal checkpoint failed: "
                               f"{type(e).__name__}: {e}\n{log.getvalue()[-3000:]}") from e
    zero = os.path.join(out_dir, ZERO_DIR)
    to_gpt = gpt_naming(src_pipelined, n_layers)
    found = []
    for src in sorted(os.listdir(zero)):
        if not os.path.isdir(os.path.join(zero, src)):
            continue
        gpt = to_gpt(src)
        found.append(gpt)
        if target(gpt) != src:
            os.rename(os.path.join(zero, src), os.path.join(zero, target(gpt)))
    return found


def check_complete(out_dir: str, names: Iterable[str]) -> None:
    """Every parameter of the loading module has its weight and Adam states in out_dir."""
    for name in names:
        for state in STATES:
            path = os.path.join(out_dir, ZERO_DIR, name, f"{state}.pt")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: the checkpoint does not hold "
                                        f"parameter {name!r} (another model?)")


def read_state(out_dir: str, name: str, state: str):
    """One state of one parameter: a full tensor (fp32, exp_avg, exp_avg_sq) or the step."""
    sd = torch.load(os.path.join(out_dir, ZERO_DIR, name, f"{state}.pt"), map_location="cpu",
                    weights_only=False)
    if state == "step":
        return sd
    from deepspeed.checkpoint.constants import PARAM
    return sd[PARAM]


@torch.no_grad()
def load_into_torch_optimizer(engine, out_dir: str, tp_group) -> None:
    """Restore a ZeRO stage-0 engine (torch AdamW) from a universal folder: this rank's TP
    slice of every weight and Adam state, the step, and the param-group hyperparameters.

    The engine's LR scheduler and step counters come from the mp_rank file (``load_meta``).
    """
    from deepspeed.checkpoint.constants import PARAM_GROUPS
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    saved = torch.load(os.path.join(out_dir, ZERO_DIR, "optimizer_state.pt"),
                       map_location="cpu", weights_only=False)[PARAM_GROUPS]
    for group, saved_group in zip(opt.param_groups, saved):
        for p in group["params"]:
            name = names[id(p)]
            p.copy_(shard_full_tensor(read_state(out_dir, name, "fp32"), p, tp_group))
            step = read_state(out_dir, name, "step")
            opt.state[p] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": shard_full_tensor(read_state(out_dir, name, "exp_avg"), p,
                                             tp_group).to(p).clone(),
                "exp_avg_sq": shard_full_tensor(read_state(out_dir, name, "exp_avg_sq"), p,
                                                tp_group).to(p).clone()}
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def load_meta(engine, out_dir: str) -> Dict:
    """LR scheduler, step counters and client state from a copied mp_rank file (all ranks'
    copies agree on these); returns the client state, as engine.load_checkpoint would."""
    path = sorted(glob.glob(os.path.join(out_dir, "mp_rank_*_model_states.pt")))[0]
    sd = torch.load(path, map_location="cpu", weights_only=False)
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(sd["lr_scheduler"])
    engine.global_steps = sd["global_steps"]
    engine.global_samples = sd.get("global_samples", engine.global_samples)
    engine.skipped_steps = sd["skipped_steps"]
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
             "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
             "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
             "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
             "universal_checkpoint_info"}
    return {k: v for k, v in sd.items() if k not in known}


def saved_buffers(out_dir: str) -> Dict[str, torch.Tensor]:
    """The persistent buffers in a universal folder's copied model file (DeepSpeed keeps them
    in its module dict; the universal format holds parameters only): the routers'
    correction biases (models/moe.py), the same on every rank. None from a pipeline's."""
    path = sorted(glob.glob(os.path.join(out_dir, "mp_rank_*_model_states.pt")))[0]
    sd = torch.load(path, map_location="cpu", weights_only=False)
    names = set(sd.get("buffer_names") or ())
    return {n: t for n, t in (sd.get("module") or {}).items() if n in names}


@torch.no_grad()
def load_buffers_(named_buffers, buffers: Dict[str, torch.Tensor]) -> None:
    """The (name, buffer) pairs of a model (``module.named_buffers()``, or a pipeline
    stage's by GPT name: weights.gpt_named_buffers) <- the saved ones of the same name
    (saved_buffers)."""
    own = dict(named_buffers)
    for name, t in buffers.items():
        if name in own:
            own[name].copy_(t)


def full_weights(out_dir: str, names: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """{name: full fp32 weight} of a universal folder (every parameter, or ``names``)."""
    zero = os.path.join(out_dir, ZERO_DIR)
    if names is None:
        names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    return {n: read_state(out_dir, n, "fp32") for n in names}
