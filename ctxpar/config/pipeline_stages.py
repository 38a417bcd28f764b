"""Which blocks each pipeline stage holds, as DeepSpeed's PipelineModule partitions
models/gpt_pipe.py's layers, and what pp x ep asks of the stages. Above the parameters'
description (it counts them) and model.moe's checks (it reads their layers)."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

from .moe import moe_layer_indices
from .parameters import (block_specs, embedding_spec, head_specs, mtp_specs,
                         per_layer_embedding_specs)


def check_stages_hold_experts(cfg, err) -> None:
    """pp x ep: every pipeline stage holds a MoE layer. ZeRO 1/2 compute the gradient norm
    one param group at a time, each summed over the pipeline (DeepSpeed's
    stage_1_and_2.get_grad_norm_direct), so every stage needs the same groups, and a stage
    without experts would have no expert groups (DeepSpeed drops empty ones)."""
    p, moe = cfg.parallel, cfg.model.moe
    if moe is None or p.pp == 1 or p.ep == 1 or moe.num_experts % p.ep:
        return
    stages = pipeline_stage_layers(cfg.model, p.pp, p.tp, p.ep, p.pp_partition)
    moe = set(moe_layer_indices(cfg.model.moe, cfg.model.n_layers))
    bare = next((s for s, blocks in enumerate(stages) if not moe & set(blocks)), None)
    if bare is not None:
        err(f"parallel.pp={p.pp} and parallel.ep={p.ep}: pipeline stage {bare} (blocks "
            f"{list(stages[bare])}, parallel.pp_partition={p.pp_partition!r}) has no MoE "
            f"layer (model.moe.layers={cfg.model.moe.layers}) to hold experts; every stage "
            f"needs one (its expert optimizer groups)")


def check_mtp_stages(cfg, err) -> None:
    """model.mtp under the pipeline: every stage keeps a layer once the head, the MTP
    layers and the embedding's copy sit on the last one (keep_on_last_stage)."""
    p, m = cfg.parallel, cfg.model
    if m.mtp is None or p.pp == 1:
        return
    parts = pipeline_parts(m, p.pp, p.tp, p.ep, p.pp_partition)
    bare = next((s for s in range(p.pp) if parts[s] == parts[s + 1]), None)
    if bare is not None:
        err(f"model.mtp with parallel.pp={p.pp}: pipeline stage {bare} holds no layer once "
            f"the head and the MTP layers sit on the last stage (parallel.pp_partition="
            f"{p.pp_partition!r}, model.n_layers={m.n_layers}); use fewer stages")


def pipeline_stage_layers(m, pp: int, tp: int, ep: int, method: str) -> List[range]:
    """The blocks each of pp stages holds, as DeepSpeed's PipelineModule partitions
    models/gpt_pipe.py's layers [embedding, blocks, final norm, head] ('uniform': by
    count; 'parameters': by each layer's trainable parameters on a rank, E/ep experts a
    MoE block's, with DeepSpeed's own partition_balanced; model.mtp: then the MTP layers
    and, under an untied head, the embedding's copy, kept with the head on the last stage)."""
    parts = pipeline_parts(m, pp, tp, ep, method)
    # layer j of the list is block j - 1
    return [range(max(parts[s] - 1, 0), min(parts[s + 1] - 1, m.n_layers)) for s in range(pp)]


def pipeline_parts(m, pp: int, tp: int, ep: int, method: str) -> List[int]:
    """The first layer of each stage (and the number of layers, last), as GPTPipe's."""
    embed = embedding_spec(m).numel(tp)
    # the first layer holds Gemma 4's per-layer input embedding too (models/gpt_pipe.py)
    ple = sum(s.numel(tp) for s in per_layer_embedding_specs(m))
    # the final norm's layer, with model.hyper_connections' head before it
    norm = sum(s.numel(tp) for s in head_specs(m) if s.name.startswith(("final_norm", "hc_")))
    # the head: the tied embedding again, or lm_head (V, d) split over TP as it is
    weights = [embed + ple, *(sum(s.numel(tp, ep) for s in block_specs(m, i, tp))
                              for i in range(m.n_layers)), norm, embed]
    if m.mtp is not None:  # the MTP layers, and the embedding's copy under an untied head
        weights += [sum(s.numel(tp, ep) for s in mtp_specs(m, tp))] + \
            ([] if m.tie_embeddings else [embed])
    parts = _partition(tuple(weights), pp, method)
    return parts if m.mtp is None else keep_on_last_stage(parts, m.n_layers + 2)


def keep_on_last_stage(parts: List[int], first: int) -> List[int]:
    """DeepSpeed's stage boundaries moved so that layers first.. all sit on the last
    stage (model.mtp: the head, the MTP layers the loss runs beside it, the embedding's
    copy they read; models/mtp_pipe.py). A stage this leaves without a layer is refused
    at load (ctxpar/config/mtp.py)."""
    return [parts[0], *(min(p, first) for p in parts[1:-1]), parts[-1]]


@lru_cache(maxsize=1024)
def _partition(weights: Tuple[int, ...], pp: int, method: str) -> List[int]:
    """DeepSpeed's partition of the layers' weights over pp stages (the planner's search
    asks for the same one for every ZeRO stage, checkpointing mode and micro-batch)."""
    from deepspeed.runtime import utils as ds_utils
    return (ds_utils.partition_uniform(len(weights), pp) if method == "uniform"
            else ds_utils.partition_balanced(list(weights), pp))
