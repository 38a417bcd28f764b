"""model.moe: a mixture of experts in place of the MLP of some or all layers.

    model:
      moe:
        num_experts: 8            # routed experts per MoE layer
        top_k: 2                  # experts per token
        expert_hidden: 256        # each expert's MLP width (transformers' moe_intermediate_size)
        score: softmax            # router score: softmax over all experts, sigmoid or sqrtsoftplus
        norm_topk: true           # the k weights renormalised to sum to 1
        shared_expert_hidden: 0   # an always-on shared expert's width (0: none)
        aux_loss_coef: 0.01       # load-balancing loss (transformers' router_aux_loss_coef)
        # DeepSeek-V3: score: sigmoid, score_correction_bias: true, bias_update_rate: 0.001,
        # n_group: 8, topk_group: 4, routed_scaling_factor: 2.5, seq_aux_loss_coef: 0.0001
        # Gemma 4 (26B-A4B): beside_mlp: true, scaled_router: true

Routing is dropless by default: every token reaches its top-k experts whatever the batch
and layout (no capacity, nothing dropped), so a layout change is never a model change;
capacity_factor, only where set, drops assignments per rank and so depends on the layout. The experts'
MLP is model.mlp's kind (swiglu, geglu, gelu, relu2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .layer_mixers import LAYER_MIXERS, layer_types

MOE_SCORES = ("softmax", "sigmoid", "sqrtsoftplus")  # ctxpar/moe/router.py computes them


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
    gpt-oss's softmax over the top-k logits is this with norm_topk), 'sigmoid' per
    expert (DeepSeek-V3) or 'sqrtsoftplus', sqrt(softplus(logit)) per expert (DeepSeek-V4's
    scoring_func)."""
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
    expert_bias: bool = False
    """Biases on each expert's gate_up_proj and down_proj (gpt-oss)."""
    swiglu_limit: Optional[float] = None
    """gpt-oss's clamped SwiGLU in the experts (model.mlp swiglu): gate clamped above at the
    limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    (None: model.mlp's own activation)."""
    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's sigmoid slope (gpt-oss's swiglu_alpha)."""
    seq_aux_loss_coef: float = 0.0
    """Weight of DeepSeek's sequence-level balance loss (DeepSeek-V3 eqs. 17-20: per sample
    row, E/(k T) sum_e c_e P_e over its T tokens, P_e the mean of the normalised scores;
    the mean over the micro-batch's rows, summed over the MoE layers), exact when a row is
    split over CP ranks. A row of packed documents is one sequence."""
    score_correction_bias: bool = False
    """A per-expert bias added to the scores to choose the top-k only, the weights taken
    from the scores without it (DeepSeek-V3's e_score_correction_bias): a buffer, no
    gradient, saved with the model; bias_update_rate moves it."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balance: after each optimizer step every layer's
    bias_e += rate * sign(mean load - load_e), the loads counted over the step's whole batch
    (every DP x CP rank, every micro-batch), so the same on every rank and layout
    (0: the bias stays as loaded). Needs score_correction_bias."""
    routed_scaling_factor: float = 1.0
    """The k routed weights times this (after norm_topk; DeepSeek-V3: 2.5)."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3: 8): the experts in n_group groups of consecutive
    experts, a token's k chosen among its topk_group best groups (each scored by the sum of
    its two best biased scores). 1: no groups."""
    topk_group: int = 1
    """Groups each token may use under n_group > 1 (DeepSeek-V3: 4)."""
    scale_expert_input: bool = False
    """The router's weight multiplies each chosen expert's input, not its output (Llama 4:
    y = sum_j expert_j(w_j x)); with model.mlp's gated experts the two differ."""
    hash_layers: Optional[List[int]] = None
    """MoE layers (indices among model.moe.layers) whose experts are chosen by a frozen
    token-id table, not the router (DeepSeek-V4's 'hash_moe' mlp_layer_types; its
    HashRouter): the table gate.tid2eid (vocab_size, top_k) is a buffer saved with the
    model, the weights the router's scores of the chosen experts as for the others; no
    balance loss, statistics or correction bias (ctxpar/config/hash_routing.py). None: none."""
    beside_mlp: bool = False
    """The experts run beside the layer's dense MLP (model.ffn_hidden wide), not in its
    place (Gemma 4's enable_moe_block): the block's channel mixer is
    post_mlp_norm(norm_1(mlp(mlp_norm x)) + norm_2(experts(norm_in_2 x))), three more
    norms of d, the router reading the block's x itself (models/moe_beside_mlp.py)."""
    scaled_router: bool = False
    """Gemma 4's router (transformers' Gemma4TextRouter): the logits of
    rmsnorm(x) * scale / sqrt(d_model) (a weightless norm, scale a learned (d,) vector), and
    each of the k weights times a learned scale of its expert (per_expert_scale, (E,)),
    after norm_topk."""
    capacity_factor: Optional[float] = None
    """None: dropless (the default). A number: each expert takes at most
    ceil(capacity_factor * N * top_k / num_experts) of the assignments of the N tokens one
    rank routes, the rest dropped in token order (GShard, Switch). N is a rank's share of
    the batch, so the tokens dropped depend on micro_batch_size, dp and cp: a layout change
    is then a model change (ctxpar/moe/capacity.py)."""


def moe_layer_indices(moe: Optional[MoEConfig], n_layers: int) -> List[int]:
    """The layers whose MLP is the MoE (none without model.moe)."""
    if moe is None:
        return []
    return list(range(n_layers)) if moe.layers is None else sorted(moe.layers)


def hash_layers(moe: Optional[MoEConfig]) -> List[int]:
    """The MoE layers routed by the token-id table (model.moe.hash_layers; none without)."""
    return [] if moe is None else sorted(moe.hash_layers or ())


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
    half = next((k for k in ("bf16", "fp16") if (cfg.deepspeed.get(k) or {}).get("enabled")), None)
    unbuilt = [
        (p.ep > 1 and stage == 3 and p.tp > 1,
         f"parallel.ep={p.ep}, parallel.tp={p.tp} and deepspeed.zero_optimization.stage=3: "
         f"DeepSpeed's stage-3 gradient norm leaves out the TP sum for expert parameters "
         f"(runtime/zero/stage3.py _grad_norm_counts_every_rank: its AutoEP's EP group spans "
         f"TP, ctxpar's does not; use tp 1, or stage 1 or 2)"),
        (p.ep > 1 and stage == 0 and half is not None,
         f"parallel.ep={p.ep}, deepspeed.zero_optimization.stage=0 and deepspeed.{half}"
         f".enabled=true: DeepSpeed's 16-bit ZeRO-0 optimizer (runtime/fp16/unfused_optimizer"
         f".py FP16_UnfusedOptimizer.step) clips by a gradient norm that leaves the experts "
         f"out (use fp32 at stage 0, or stage 1 or 2)"),
        # dynamic CP: each rank backpropagates its packs one at a time, so a router loss
        # is exact only if it needs nothing of the step's other packs before backward
        (cfg.data.dynamic_cp and moe.aux_loss_coef > 0,
         f"data.dynamic_cp=true and model.moe.aux_loss_coef={moe.aux_loss_coef}: the "
         f"load-balancing loss's expert counts span every pack of the step, which each rank "
         f"backpropagates before the next (use bias_update_rate, DeepSeek-V3's aux-free "
         f"balance, and z_loss_coef)"),
        (cfg.data.dynamic_cp and moe.seq_aux_loss_coef > 0,
         f"data.dynamic_cp=true and model.moe.seq_aux_loss_coef={moe.seq_aux_loss_coef}: its "
         f"sequences are static CP's sample rows, which dynamic CP's packs are not"),
        (cfg.data.dynamic_cp and moe.capacity_factor is not None,
         f"data.dynamic_cp=true and model.moe.capacity_factor={moe.capacity_factor}: it "
         f"drops assignments per rank's tokens, which the schedule's packs decide"),
        (cfg.data.dynamic_cp and p.ep > 1 and cfg.memory.tiled_mlp,
         f"data.dynamic_cp=true, parallel.ep={p.ep} and memory.tiled_mlp=true: the ranks of "
         f"an EP group hold packs of different lengths, so their tiles' all-to-alls would "
         f"not pair up"),
    ]
    for refused, why in unbuilt:
        if refused:
            err(f"model.moe is set; not built with {why}")
    # pp x ep: every stage holds a MoE layer (pipeline_stages.check_stages_hold_experts,
    # called beside this by validation: it counts parameters, a floor above this file)


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
    if moe.swiglu_limit is not None and (m.mlp != "swiglu" or not moe.swiglu_limit > 0):
        err(f"model.moe.swiglu_limit={moe.swiglu_limit} needs model.mlp='swiglu' and a limit "
            f"> 0 (model.mlp={m.mlp!r})")
    for key in ("beside_mlp", "scaled_router"):
        if not isinstance(getattr(moe, key), bool):
            err(f"model.moe.{key}={getattr(moe, key)!r} must be true or false")
    if moe.shared_expert_gate and not moe.shared_expert_hidden:
        err("model.moe.shared_expert_gate=true needs model.moe.shared_expert_hidden > 0")
    for key in ("aux_loss_coef", "z_loss_coef", "seq_aux_loss_coef"):
        if getattr(moe, key) < 0:
            err(f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    if moe.aux_loss_coef and moe.score != "softmax":
        err(f"model.moe.aux_loss_coef={moe.aux_loss_coef} with model.moe.score="
            f"{moe.score!r}: the load-balancing loss is the softmax routers' (transformers' "
            f"load_balancing_loss_func)")
    _check_routing(moe, err)
    if moe.layers is not None and (len(set(moe.layers)) != len(moe.layers) or any(
            not 0 <= i < m.n_layers for i in moe.layers)):
        err(f"model.moe.layers={moe.layers} must be distinct layer indices in "
            f"[0, model.n_layers={m.n_layers})")
    _check_moe_blocks(m, moe, err)


def _check_moe_blocks(m, moe: MoEConfig, err) -> None:
    """model.moe.layers name blocks with an MLP to replace (Nemotron-H's single-op 'mamba'
    and 'attention' blocks have none; None: every block that has one)."""
    types = layer_types(m)
    bare = [i for i in moe.layers or () if LAYER_MIXERS.get(types[i], ("", ""))[1] is None]
    if bare:
        err(f"model.moe.layers={moe.layers}: layer {bare[0]} is a {types[bare[0]]!r} block, "
            f"which has no MLP for the experts to replace")


def _check_routing(moe: MoEConfig, err) -> None:
    """The router's options: DeepSeek-V3's correction bias, its update, scaling, groups;
    the capacity factor."""
    if moe.bias_update_rate < 0 or (moe.bias_update_rate and not moe.score_correction_bias):
        err(f"model.moe.bias_update_rate={moe.bias_update_rate} must be >= 0 and needs "
            f"model.moe.score_correction_bias=true (got {moe.score_correction_bias})")
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        err(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (null: dropless)")
    if moe.routed_scaling_factor <= 0:
        err(f"model.moe.routed_scaling_factor={moe.routed_scaling_factor} must be > 0")
    E, G = moe.num_experts, moe.n_group
    if G < 1 or E % G or (G > 1 and E // G < 2):
        err(f"model.moe.n_group={G} must be >= 1 and divide model.moe.num_experts={E} into "
            f"groups of >= 2 experts")
    elif not 1 <= moe.topk_group <= G or moe.top_k > moe.topk_group * (E // G):
        err(f"model.moe.topk_group={moe.topk_group} must be in [1, model.moe.n_group={G}] "
            f"with room for model.moe.top_k={moe.top_k} in {moe.topk_group} groups of {E // G}")
