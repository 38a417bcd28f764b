"""Mixture of experts: routing, expert-parallel dispatch and the router's auxiliary losses.

    weights, experts = route(logits, top_k, score="softmax", norm_topk=True)
    balance_bias_update(bias, counts, rate)                         # after a step (aux-free)
    y = dispatch_combine(x, weights, experts, num_experts, run_experts, ep_group)
    stats = RouterStats(num_experts); stats.add(logits, experts)   # per MoE layer
    aux = stats.losses(aux_loss_coef, z_loss_coef, dp_cp_group)     # after the last layer

models/moe.py is the layer built from them.
"""
from .aux import RouterLosses, RouterStats
from .capacity import drop_over_capacity
from .dispatch import dispatch_combine, moe_stats, reset_moe_stats
from .router import balance_bias_update, route

__all__ = ["RouterLosses", "RouterStats", "balance_bias_update", "dispatch_combine",
           "drop_over_capacity", "moe_stats", "reset_moe_stats", "route"]
