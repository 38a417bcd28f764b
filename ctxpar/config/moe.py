"""model.moe: a mixture of experts in place of the MLP of some or all layers.

    model:
      moe:
        num_experts: 8            # routed experts per MoE layer
        top_k: 2                  # experts per token
        expert_hidden: 256        # each expert's MLP width (transformers' moe_intermediate_size)
        score: softmax            # router score: softmax over all experts, or sigmoid
        norm_topk: true           # the k weights renormalised to sum to 1
        shared_expert_hidden: 0   # an always-on shared expert's width (0: none)
        aux_loss_coef: 0.01       # load-balancing loss (transformers' router_aux_loss_coef)

Routing is dropless: every token reaches its top-k experts whatever the batch and layout
(no capacity, nothing dropped), so a layout change is never a model change. The experts'
MLP is model.mlp's kind (swiglu, geglu, gelu, relu2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

MOE_SCORES = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    num_experts: int = 8
    """Routed experts per MoE layer (split over parallel.ep ranks)."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: Optional[int] = None
    """Each expert's MLP width (None: model.ffn_hidden's)."""
    layers: Optional[List[int]] = None
    """Which layers (indices) have the MoE in place of their MLP (None: every layer with an
    MLP)."""
    score: str = "softmax"
    """Router score: 'softmax' over all experts, top-k taken from it (Mixtral, Qwen-MoE;
    gpt-oss's softmax over the top-k logits is this with norm_topk), or 'sigmoid' per
    expert (DeepSeek-V3)."""
    norm_topk: bool = True
    """Divide the k chosen scores by their sum (transformers' norm_topk_prob)."""
    router_bias: bool = False
    """A bias on the router's logits (gpt-oss)."""
    shared_expert_hidden: int = 0
    """Width of a shared expert every token goes through beside its routed ones (0: none;
    Qwen2-MoE, Qwen3-Next, DeepSeek)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(w . x) (Qwen2-MoE, Qwen3-Next)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (transformers' load_balancing_loss_func, over the
    micro-batch's tokens on every DP x CP rank and all MoE layers)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss: the mean over tokens and layers of logsumexp(logits)^2."""


def moe_layer_indices(moe: Optional[MoEConfig], n_layers: int) -> List[int]:
    """The layers whose MLP is the MoE (none without model.moe)."""
    if moe is None:
        return []
    return list(range(n_layers)) if moe.layers is None else sorted(moe.layers)


def check_moe(cfg, dp: Optional[int], err) -> None:
    """model.moe and parallel.ep against the run, each rule a one-line ConfigError naming
    the key (dp: the resolved data-parallel degree, None when not known yet)."""
    m, p, moe = cfg.model, cfg.parallel, cfg.model.moe
    if p.ep < 1:
        err(f"parallel.ep={p.ep} must be >= 1")
    if moe is None:
        if p.ep > 1:
            err(f"parallel.ep={p.ep} without model.moe: there are no experts to split")
        return
    _check_moe_fields(m, moe, p.tp, err)
    if moe.num_experts % p.ep:
        err(f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={p.ep}")
    if dp is not None and (dp * p.cp) % p.ep:
        err(f"parallel.ep={p.ep} must divide dp x cp = {dp} x {p.cp} (experts are split over "
            f"the DP x CP ranks)")
    stage = int((cfg.deepspeed.get("zero_optimization") or {}).get("stage", 0))
    unbuilt = [
        (p.ep > 1 and stage == 3,
         f"parallel.ep={p.ep} and deepspeed.zero_optimization.stage=3: DeepSpeed 0.19.8 runs "
         f"its MoE machinery, which reduces the experts' gradients over their "
         f"expert-data-parallel group, under ZeRO stage 0-2 only (use stage 1 or 2)"),
        (p.ep > 1 and stage == 0,
         f"parallel.ep={p.ep} and deepspeed.zero_optimization.stage=0: a stage-0 checkpoint "
         f"keeps the weights in one module file, which holds one EP rank's experts (use "
         f"stage 1 or 2, whose per-rank partitions hold every rank's: "
         f"ctxpar/distributed/expert_parallel.py)"),
        (p.pp > 1 and p.ep > 1,
         f"parallel.pp={p.pp} and parallel.ep={p.ep}: DeepSpeed's pipeline engine reduces "
         f"every gradient over its own data axis, not the experts' over their "
         f"expert-data-parallel group (use ep 1 with a pipeline)"),
        (cfg.data.dynamic_cp, "data.dynamic_cp=true: the routers' losses and the experts' "
                              "all-to-all over rank groups that run different packs"),
        (cfg.memory.tiled_mlp, "memory.tiled_mlp=true: the experts are not tiled"),
    ]
    for refused, why in unbuilt:
        if refused:
            err(f"model.moe is set; not built with {why}")


def _check_moe_fields(m, moe: MoEConfig, tp: int, err) -> None:
    """model.moe's own fields against the model."""
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        err(f"model.moe.top_k={moe.top_k} must be in [1, model.moe.num_experts="
            f"{moe.num_experts}]")
    if moe.score not in MOE_SCORES:
        err(f"model.moe.score={moe.score!r} must be one of {', '.join(MOE_SCORES)}")
    for key in ("expert_hidden", "shared_expert_hidden"):
        value = getattr(moe, key)
        if value is not None and (value < 0 or (key == "expert_hidden" and value < 1)):
            err(f"model.moe.{key}={value} must be >= {1 if key == 'expert_hidden' else 0}")
        if value and value % tp:
            err(f"model.moe.{key}={value} is not divisible by parallel.tp={tp}")
    if moe.shared_expert_gate and not moe.shared_expert_hidden:
        err("model.moe.shared_expert_gate=true needs model.moe.shared_expert_hidden > 0")
    for key in ("aux_loss_coef", "z_loss_coef"):
        if getattr(moe, key) < 0:
            err(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.aux_loss_coef and moe.score != "softmax":
        err(f"model.moe.aux_loss_coef={moe.aux_loss_coef} with model.moe.score="
            f"{moe.score!r}: the load-balancing loss is the softmax routers' (transformers' "
            f"load_balancing_loss_func)")
    if moe.layers is not None and (len(set(moe.layers)) != len(moe.layers) or any(
            not 0 <= i < m.n_layers for i in moe.layers)):
        err(f"model.moe.layers={moe.layers} must be distinct layer indices in "
            f"[0, model.n_layers={m.n_layers})")
