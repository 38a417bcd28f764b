"""Verify: does this config's layout compute what a layout without CP computes, here?

    torchrun --nproc_per_node 4 verify.py --config configs/tiny_cpu.yaml
    deepspeed --num_gpus 8 verify.py --config configs/gpt1b_32k_3d.yaml --layers 2 --seq-len 8192
    srun python verify.py --config X.yaml --reference-cp 2          (rank/world from SLURM_*)

Top to bottom, in the processes the launcher gave:
  1. the config (the same checks and exit 2 as train.py), --layers / --seq-len applied to
     both runs, one small global batch both layouts can split;
  2. the config's layout: its model, DeepSpeed engine and data stream as train.py builds
     them, --steps optimizer steps; per step the loss, every parameter's gradient before
     the optimizer step (the engine's, gathered over ZeRO and TP to its full tensor) and
     every attention core's output (a hook, gathered over CP and TP to (T, heads, hd) per
     sample) and every linear mixer's (Gated DeltaNet, Mamba2: (T, d), complete over TP,
     gathered over CP) go to rank 0;
  3. the reference layout in the same processes: pp = 1, ep = 1, cp = --reference-cp
     (default 1, the ring when above 1), the same tp, dp taking the ranks that frees; same
     init, same samples, same DeepSpeed section; the same tensors, compared on rank 0 as
     they come;
  4. only where some gradient is over its flat budget and every loss and output is within
     theirs: the reference again from weights moved by a few roundings, each gradient's
     own movement the measure of its rounding noise, 20 times it the floor it is held to
     (ill-conditioned sums: a Gated DeltaNet's A_log, dt_bias);
  5. a table (the worst tensor of each kind; every tensor with --verbose) and one line;
     exit 0 when every tensor is within its budget or floor, 1 naming the worst and
     whether it is over a measured floor (ctxpar/components/parity.py;
     docs/parallelism.md, "Verify").
model.init_from is dropped (said so on rank 0): both runs start from the same random init.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ctxpar.components.cli import add_launcher_args, fail, show_ctxpar_logs, warn
from ctxpar.components.known_warnings import filter_known_warnings
from ctxpar.components.parity import (PERTURBATION, PERTURBED_RUNS, ROUNDING, Row, compare,
                                      format_table, parity_budget, precision_of, relative_l2,
                                      ring_size, rounding_noise, verdict, with_floors)
from ctxpar.config import ConfigError, deepspeed_config, load_config, ulysses_degree
from ctxpar.context_parallel.layouts import gather_sequence
from ctxpar.data import DataError, build_data
from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
from ctxpar.distributed.parallel_state import (default_backend, init_distributed, launcher_env,
                                               local_device, resolve_sizes,
                                               shutdown_distributed)
from ctxpar.tensor_parallel.mappings import gather_along
from ctxpar.tensor_parallel.utils import gather_full_tensor
from models.steps import training_steps
from models.training import build_model, initialize_engine, parallel_state


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides, as train.py's (e.g. train.micro_batch_size=1)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps compared (default 2)")
    p.add_argument("--layers", type=int, default=None,
                   help="model.n_layers for both runs (a reference that fits)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="model.seq_len for both runs (a reference that fits)")
    p.add_argument("--reference-cp", type=int, default=1,
                   help="the reference layout's cp (default 1; more when one rank cannot "
                        "hold the sequence)")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every tolerance budget (default 1)")
    p.add_argument("--verbose", action="store_true",
                   help="a row per compared tensor and step (default: the worst of each kind)")
    add_launcher_args(p)
    return p.parse_args(argv)


def check_inputs(args, world: int):
    """Both configs, validated at load (exit 2 with one line, before any collective).

    The global batch is micro x lcm(dp, reference dp) samples: the fewest that both
    layouts split into whole micro-batches. model.init_from is dropped: both runs start
    from the layout-independent init (models/gpt.py: init_parameters_). Returns (cfg, ref,
    data, the dropped init_from or None)."""
    if args.steps < 1 or args.reference_cp < 1 or not args.budget_scale > 0:
        fail(f"--steps={args.steps}, --reference-cp={args.reference_cp} and --budget-scale="
             f"{args.budget_scale} must be positive")
    sets = list(args.set)
    sets += [f"model.n_layers={args.layers}"] if args.layers is not None else []
    sets += [f"model.seq_len={args.seq_len}"] if args.seq_len is not None else []
    try:
        dropped = load_config(args.config, sets, world_size=world,
                              check_paths=False).model.init_from
        sets.append("model.init_from=null")
        cfg = load_config(args.config, sets, world_size=world)
        tp, micro = cfg.parallel.tp, cfg.train.micro_batch_size
        if world % (tp * args.reference_cp):
            fail(f"--reference-cp={args.reference_cp}: parallel.tp={tp} x "
                 f"{args.reference_cp} does not divide the world size {world}")
        ref_dp = world // (tp * args.reference_cp)
        dp = dp_size(cfg, world)
        micro, ref_micro, batch = batch_sizes(cfg, micro, dp, ref_dp)
        sets.append(f"train.global_batch_size={batch}")
        cfg = load_config(args.config, sets + [f"train.micro_batch_size={micro}"],
                          world_size=world)
        ref = load_config(args.config, sets + [f"train.micro_batch_size={ref_micro}",
            f"parallel.cp={args.reference_cp}", "parallel.pp=1", f"parallel.dp={ref_dp}",
            "parallel.ep=1",  # every expert on every rank: the full (E, ...) tensors
            "parallel.cp_comm=ring", "parallel.ulysses=null", "parallel.ring_grad_dtype=fp32"],
            world_size=world)
        if cfg.data.dynamic_cp:
            fail("data.dynamic_cp=true: verify.py compares fixed layouts; dynamic CP's parity "
                 "with one process is tests/test_train_dynamic_cp.py's (--set "
                 "data.dynamic_cp=false verifies this layout)")
        data = build_data(cfg)  # both runs read its samples
    except (ConfigError, DataError) as e:
        fail(str(e))
    for line in data.warnings:
        warn(line)
    return cfg, ref, data, dropped


def batch_sizes(cfg, micro: int, dp: int, ref_dp: int):
    """(micro-batch, the reference's micro-batch, global batch): micro x lcm(dp, ref dp)
    samples, each layout at the config's micro-batch size; but where the routers'
    load-balancing loss is on (model.moe.aux_loss_coef), a product of two means over a
    micro-batch's tokens on every DP x CP rank and so not additive over micro-batches,
    both layouts take the same micro-batches: lcm(micro x dp, ref dp) samples, one
    micro-batch a step in each (models/moe_steps.py)."""
    moe = cfg.model.moe
    if moe is None or not moe.aux_loss_coef:
        return micro, micro, micro * math.lcm(dp, ref_dp)
    batch = math.lcm(micro * dp, ref_dp)
    return batch // dp, batch // ref_dp, batch


def dp_size(cfg, world: int) -> int:
    """parallel.dp, 'auto' resolved for this world size."""
    p = cfg.parallel
    return resolve_sizes(world, p.tp, p.cp, p.pp, p.dp)["dp"]


def attention_cores(module):
    """(name, Attention or MLA) of every block on this rank: the GPT's ``layers.i.attn``, or
    a pipeline stage's blocks under the same names."""
    from models.attention import Attention
    from models.mla import MLA

    prefixes = {id(m.attn): m.gpt_prefix for m in module.modules() if hasattr(m, "gpt_prefix")
                and hasattr(m, "attn")}
    for name, m in module.named_modules():
        if isinstance(m, (Attention, MLA)):  # MLA's core: (B, T/cp, nh/tp, v_head_dim)
            yield (prefixes[id(m)] + "attn" if id(m) in prefixes else name), m


def linear_mixers(module):
    """(name, module) of every Gated DeltaNet and Mamba2 mixer on this rank: the GPT's
    ``layers.i.linear_attn`` / ``layers.i.mamba``, or a pipeline stage's under the same."""
    from models.gated_delta import GatedDeltaNet
    from models.mamba2 import Mamba2

    prefixes = {id(mixer): m.gpt_prefix + attr for m in module.modules()
                if hasattr(m, "gpt_prefix") for attr in ("linear_attn", "mamba")
                for mixer in [getattr(m, attr, None)] if mixer is not None}
    for name, m in module.named_modules():
        if isinstance(m, (GatedDeltaNet, Mamba2)):
            yield prefixes.get(id(m), name), m


def _keep(record, name: str, out: torch.Tensor) -> None:
    # -1: no backward pass is running (torch.utils.checkpoint reads it the same way): once
    # per forward, not again when activation checkpointing replays it in backward
    if torch._C._current_graph_task_id() == -1:
        record.setdefault(name, []).append(out.detach().clone())


def hook_attention(module, record: Dict[str, List[torch.Tensor]]) -> None:
    """Keep each attention core's output (B, T/cp, nh/tp, hd) and each linear mixer's
    (B, T/cp, d), in record[name], once per forward."""
    for name, attn in attention_cores(module):
        def core(*args, _core=attn.core, _name=name, **kwargs):
            out = _core(*args, **kwargs)
            _keep(record, _name, out)
            return out
        attn.core = core
    for name, mixer in linear_mixers(module):
        mixer.register_forward_hook(lambda _m, _args, out, _name=name: _keep(record, _name, out))


def hook_gradients(engine, on_step: Callable[[], None]) -> None:
    """Call on_step() just before each optimizer step, after the gradients are reduced and
    before they are clipped (DeepSpeed's _take_model_step: every engine, pipeline too)."""
    take = getattr(engine, "_take_model_step", None)
    if take is None:  # DeepSpeed's engine and pipeline engine both step through it
        raise RuntimeError(f"this DeepSpeed's {type(engine).__name__} has no _take_model_step "
                           f"for verify to read the gradients before the optimizer step")

    def take_model_step(*args, **kwargs):
        on_step()
        return take(*args, **kwargs)
    engine._take_model_step = take_model_step


def named_parameters(module):
    """(GPT's name, parameter) for this rank's parameters (a pipeline stage's too)."""
    if hasattr(module, "gpt_named_parameters"):
        return list(module.gpt_named_parameters())
    return list(module.named_parameters())


def full_gradients(module, state, keep: bool) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient as a full fp32 CPU tensor (ZeRO's partitions gathered,
    then TP's shards, then an expert tensor's E/ep experts over the EP group, in EP rank
    order: the (E, ...) tensor); collective over dp x cp, TP and EP. Returned only where
    keep."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in named_parameters(module):
        g = safe_get_full_grad(p)
        g = torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), device=p.device) \
            if g is None else g
        full = gather_full_tensor(g, p, state.tp_group, state.ep_group)
        if keep:
            out[name] = full.float().cpu()
    return out


def full_attention(record, sample_ids, state, layout: str, keep: bool):
    """{(layer, sample id): (T, nh, hd) or a linear mixer's (T, d), fp32 CPU} from each
    layer's kept outputs, gathered over CP (back to token order) and TP (an attention
    core's heads; a mixer's output is complete on every TP rank); collective over CP and TP."""
    out = {}
    for name in sorted(record):
        for ids, local in zip(sample_ids, record[name]):
            x = gather_sequence(local, 1, state.cp_group, layout, state.ulysses_size)
            if x.dim() == 4:
                x = gather_along(x, state.tp_group, dim=2)  # (B, T, nh, hd)
            if keep:
                out.update({(name, i): x[b].float().cpu() for b, i in enumerate(ids)})
    return out


def to_rank0(grads: dict, attn: dict) -> Optional[dict]:
    """The union of every rank's grads and attention outputs on rank 0 (None elsewhere);
    collective over the world."""
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((grads, attn), parts, dst=0)
    if parts is None:
        return None
    return {"grads": {k: v for g, _ in parts for k, v in g.items()},
            "attn": {k: v for _, a in parts for k, v in a.items()}}


def perturb_weights_(model, relative: float, seed: int = 0) -> None:
    """Every floating parameter times (1 + relative x s), s = +-1 drawn per element from a
    seed fixed by the parameter's place (the same on every rank, so DP replicas stay
    equal): rounding-sized moves of the weights, whose effect on a gradient measures how
    far rounding alone moves it (parity.py, "the rounding floor")."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.is_floating_point():
                gen = torch.Generator().manual_seed(1000 * seed + i)
                sign = torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1
                p.mul_(1 + relative * sign.to(p.device, p.dtype))


def run_layout(cfg, data, device, n_steps: int,
               on_step: Callable[[int, dict], None], perturb: float = 0.0,
               seed: int = 0) -> None:
    """--steps optimizer steps of cfg's layout as train.py takes them (its weights moved
    by perturb_weights_(perturb, seed) when perturb > 0); after each, rank 0 gets
    on_step(step, {"loss": float, "grads": {name: full}, "attn": {(layer, id): full}})."""
    data = copy.copy(data)  # the same sources, read at this layout's micro-batch size
    data.cfg = cfg          # (batch_sizes: the two may differ)
    state = parallel_state(cfg)
    ds_config = deepspeed_config(cfg, state.dp_size)
    gas = ds_config["gradient_accumulation_steps"]
    model = build_model(cfg, state, gas, device)
    if perturb:
        perturb_weights_(model, perturb, seed)  # before ZeRO-3 partitions it (initialize_engine)
    engine, _ = initialize_engine(model, cfg, state, ds_config, device)
    steps = training_steps(cfg, engine, state, data, ds_config, device)  # train.py's kind
    # One owner per tensor sends it: TP and CP rank 0 of each DP rank's samples (attention),
    # and of DP rank 0 (gradients, the same on every DP rank), on each pipeline stage.
    samples_owner = state.tp_rank == 0 and state.cp_rank == 0
    owner = samples_owner and state.dp_rank == 0
    record, grads = {}, {}
    hook_attention(engine.module, record)
    hook_gradients(engine, lambda: grads.update(full_gradients(engine.module, state, owner)))
    B, dp = cfg.train.micro_batch_size, state.dp_size
    for step in range(1, n_steps + 1):
        # micro-batch k of the step holds samples c + k dp B + [r B, (r + 1) B) on DP rank r
        c = steps.stream.stream.samples_consumed
        ids = [range(c + (k * dp + state.dp_rank) * B, c + (k * dp + state.dp_rank + 1) * B)
               for k in range(gas)]
        record.clear()
        grads.clear()
        loss = steps.run(steps.next_step()).loss
        gathered = to_rank0(grads, full_attention(record, ids, state, cfg.parallel.layout,
                                                  samples_owner))
        if gathered is not None:
            on_step(step, {"loss": loss, **gathered})
    engine.destroy()
    del engine, model, steps
    gc.collect()  # the engine's reference cycles: free this layout before the next
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare_step(step: int, got: dict, want: dict, budget: Dict[str, float]) -> List[Row]:
    """Rows of one step: the loss, each parameter's gradient, each layer's attention output
    (over all its samples)."""
    rows = [compare(step, "loss", "loss", got["loss"], want["loss"], budget)]
    for name in sorted(set(got["grads"]) | set(want["grads"])):
        a, b = got["grads"].get(name), want["grads"].get(name)
        rows.append(Row(step, name, "grad", math.inf, budget["grad"]) if a is None or b is None
                    else compare(step, name, "grad", a, b, budget))
    for layer in sorted({k[0] for k in got["attn"]} | {k[0] for k in want["attn"]}):
        keys = sorted(k for k in set(got["attn"]) | set(want["attn"]) if k[0] == layer)
        if any(k not in got["attn"] or k not in want["attn"] for k in keys):
            rows.append(Row(step, layer, "attn", math.inf, budget["attn"]))
            continue
        rows.append(compare(step, layer, "attn", torch.stack([got["attn"][k] for k in keys]),
                            torch.stack([want["attn"][k] for k in keys]), budget))
    return rows


def rounding_floors(rows: List[Row], reference: dict, ref, data, device, n_steps: int,
                    precision: str) -> List[Row]:
    """rows, with each gradient's rounding floor measured where it decides the verdict:
    some gradient over its flat budget, every loss and output within theirs (otherwise
    the rows go back as they are: the verdict does not depend on it). Then the reference
    layout runs again from weights moved by PERTURBATION roundings (PERTURBED_RUNS times,
    other signs each), and each gradient's relative movement from the reference's own is
    its noise (parity.rounding_noise, parity.with_floors).
    Collective over the world: rank 0 decides, every rank runs."""
    need = [dist.get_rank() == 0 and any(not r.ok for r in rows if r.kind == "grad")
            and all(r.ok for r in rows if r.kind != "grad")]
    dist.broadcast_object_list(need, src=0)
    if not need[0]:
        return rows
    if dist.get_rank() == 0:
        over = sum(not r.ok for r in rows)
        print(f"verify: {over} gradients over the flat budget, every output within it: "
              f"measuring their rounding floor (the reference again, every weight moved by "
              f"{PERTURBATION:g} roundings, {PERTURBED_RUNS} times)", flush=True)
    movements = []
    for seed in range(PERTURBED_RUNS):
        moved = {}
        run_layout(ref, data, device, n_steps, lambda step, got: moved.update({
            (step, name): relative_l2(g, reference[step][name])
            for name, g in got["grads"].items()}),
            perturb=PERTURBATION * ROUNDING[precision], seed=seed)
        movements.append(moved)
    return with_floors(rows, rounding_noise(movements))


def describe(cfg, world: int) -> str:
    """'tp2 cp4 pp1 dp1, hybrid (ulysses 2), layout zigzag' (' ep2' after dp when ep > 1)."""
    p = cfg.parallel
    pattern = p.cp_comm + (f" (ulysses {ulysses_degree(p)})" if p.cp_comm == "hybrid" else "")
    ep = f" ep{p.ep}" if p.ep > 1 else ""
    return (f"tp{p.tp} cp{p.cp} pp{p.pp} dp{dp_size(cfg, world)}{ep}, {pattern}, "
            f"layout {p.layout}")


def verify(args, world: int):
    """Both runs and the comparison; returns (rows, line, exit code) on every rank."""
    cfg, ref, data, dropped = check_inputs(args, world)
    device = local_device()
    init_distributed(default_backend(device))
    init_deepspeed_comm()
    rank0 = dist.get_rank() == 0
    show_ctxpar_logs(rank0)
    precision = precision_of(cfg.deepspeed)
    p = cfg.parallel
    n = max(ring_size(p.cp, p.cp_comm, ulysses_degree(p)), ring_size(ref.parallel.cp, "ring"))
    budget = parity_budget(precision, n, args.budget_scale)
    if rank0:
        print(f"verify: {describe(cfg, world)} against {describe(ref, world)}; {precision}, "
              f"ring size {n}; {cfg.model.n_layers} layers, seq_len {cfg.model.seq_len}, "
              f"{cfg.train.global_batch_size} samples per step, steps 1-{args.steps}", flush=True)
        if dropped:
            print(f"verify: model.init_from={dropped} is not loaded: both runs start from the "
                  f"same random init (the comparison does not depend on the weights)",
                  flush=True)
    if (p.cp, p.pp, p.ep) == (ref.parallel.cp, 1, 1) and (p.cp == 1 or p.cp_comm == "ring"):
        warn(f"parallel.cp={p.cp} with pp=1 is the reference layout itself: every tensor will "
             f"agree; launch the ranks of the layout to check")
    configured, reference, rows = {}, {}, []

    def against_reference(step, want):
        reference[step] = want["grads"]
        rows.extend(compare_step(step, configured.pop(step), want, budget))
    run_layout(cfg, data, device, args.steps, configured.__setitem__)
    run_layout(ref, data, device, args.steps, against_reference)
    rows = rounding_floors(rows, reference, ref, data, device, args.steps, precision)
    out = [None]
    if rank0:
        line, code = verdict(rows)
        print(format_table(rows, every_row=args.verbose), flush=True)
        print(line, flush=True)
        out = [(rows, line, code)]
    dist.broadcast_object_list(out, src=0)  # every rank exits with rank 0's verdict
    return out[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    filter_known_warnings()  # DeepSpeed's deprecated torch calls, not the user's business
    launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK from torchrun/deepspeed or srun
    _, _, code = verify(args, int(os.environ["WORLD_SIZE"]))
    shutdown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
