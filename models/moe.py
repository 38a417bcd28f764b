"""A mixture-of-experts MLP (model.moe): router, routed experts over EP, a shared expert.

Parameter for parameter as transformers' Qwen3-MoE / Qwen3-Next sparse blocks:

    gate.weight (E, d) [gate.bias (E,)]      the router (model.moe.router_bias: gpt-oss)
    experts.gate_up_proj (E, 2f, d)          each expert's [gate | up] rows (up only for
    experts.down_proj (E, d, f)              model.mlp 'gelu' / 'relu2')
    experts.gate_up_proj_bias (E, 2f)        model.moe.expert_bias (gpt-oss)
    experts.down_proj_bias (E, d)
    shared_expert.{gate,up,down}_proj        model.moe.shared_expert_hidden > 0
    shared_expert_gate.weight (1, d)         model.moe.shared_expert_gate

    gate.e_score_correction_bias (E,)        a buffer: model.moe.score_correction_bias
    gate.tid2eid (V, k) int64                a buffer: model.moe.hash_layers' expert table

y = sum over the token's top-k experts of w_j expert_j(x) (+ the shared expert's output,
times sigmoid(shared_expert_gate x)); the choice and w as ctxpar/moe/router.py's route;
with model.moe.capacity_factor the assignments past an expert's capacity over this rank's
tokens are dropped (ctxpar/moe/capacity.py: layout-dependent). Routing is dropless (ctxpar/moe/dispatch.py). Under
EP each rank holds E/ep consecutive experts (the tensors' first dim split over the EP group,
a sub-group of DP x CP: ``expert_shard`` on the parameters) and all-to-alls the rows;
under TP every expert's f is split like a dense MLP's (column then row), each routed row
all-reduced over TP before the router's weight multiplies it. Each layer adds its router logits to the forward's RouterStats
(ctxpar/moe/aux.py) for the auxiliary losses.

Under memory.tiled_mlp the experts run over tiles of the rank's N tokens
(memory.mlp_tile_tokens; ALST's TiledMLP, Bekman et al. 2025, applied to the routed
experts): the router scores all N tokens at once (its (N, E) logits and (N, k) weights are
d/E and d/k times smaller than x, and the router's statistics and losses are then the
untiled ones by construction), and each tile is dispatched, computed and combined on its
own inside a non-reentrant activation checkpoint, which keeps only the tile's input rows
and router weights: the (t k, d) dispatch buffers, the received rows and the experts'
(rows, 2f/tp) intermediates exist for one tile at a time, in forward and in backward
(which replays the tile, its all-to-alls included: one more expert forward). Every rank
of an EP group holds the same N tokens (B T/cp), so they run the same tiles and their
all-to-alls pair up. The shared expert is a dense MLP over all N tokens.

Under activation checkpointing the block's recompute replays this layer too, and there
the tiles' experts are skipped (``SkipTiles``, entered by Block.recompute_context where
nothing after the layer keeps its output): the recompute exists to remake what the
block's forward saved for backward, and of the tiled experts that is each tile's inputs
alone (its checkpoint's), which a tile's stand-in checkpoint saves the same way, while
each tile's own replay in backward still runs the real experts from those inputs. So a
recomputed layer costs forward + replay + backward, as the untiled one does (forward +
recompute + backward), instead of one more expert forward. Every rank of an EP group
recomputes the same blocks, so all skip the same tiles' all-to-alls.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxpar.config import GATED_MLPS, ModelConfig, resolved_ffn_hidden
from ctxpar.memory.tiled_mlp import gated_product, mlp_tile_tokens, tile_spans, up_activation
from ctxpar.moe import (RouterStats, balance_bias_update, dispatch_combine,
                        drop_over_capacity, route)
from ctxpar.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                    reduce_from_tensor_model_parallel_region)
from ctxpar.tensor_parallel.layers import set_tensor_model_parallel_attributes
from ctxpar.tensor_parallel.mappings import tp_size_of

from .mlp import MLP
from .norms import l2_norm
from .options import LayerArgs


def expert_hidden(cfg: ModelConfig) -> int:
    return cfg.moe.expert_hidden or resolved_ffn_hidden(cfg)


def mark_experts(p: nn.Parameter, ep_rank: int, ep: int, tp_dim: Optional[int],
                 sections=None) -> None:
    """Experts' tensors: dim 0 is this EP rank's slice of the E experts
    (``expert_shard`` = (rank, size)); dim tp_dim split over TP (Megatron's attributes, as
    the TP layers set them; ``partition_sections``: [gate | up] split part by part)."""
    p.expert_shard = (ep_rank, ep)
    set_tensor_model_parallel_attributes(p, tp_dim is not None, -1 if tp_dim is None else tp_dim,
                                         sections=sections)


class Experts(nn.Module):
    """This rank's E/ep experts, f/tp of each: run over rows grouped by expert."""

    def __init__(self, cfg: ModelConfig, ep_rank: int, ep: int, tp: int, device=None,
                 dtype=None):
        super().__init__()
        f = expert_hidden(cfg)
        self.kind, self.gated = cfg.mlp, cfg.mlp in GATED_MLPS
        local, width = cfg.moe.num_experts // ep, f // tp
        rows = 2 * width if self.gated else width   # [gate | up] of this rank's f/tp
        self.gate_up_proj = nn.Parameter(torch.empty(local, rows, cfg.d_model, device=device,
                                                     dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(local, cfg.d_model, width, device=device,
                                                  dtype=dtype))
        split = tp > 1
        mark_experts(self.gate_up_proj, ep_rank, ep, 1 if split else None,
                     (f, f) if self.gated else None)
        mark_experts(self.down_proj, ep_rank, ep, 2 if split else None, (f,))  # one part:
        # the universal checkpoint's rule for a split past dim 1 (checkpoint/universal.py)
        self.limit, self.alpha = cfg.moe.swiglu_limit, cfg.moe.swiglu_alpha
        self.clamp = cfg.swiglu_limit  # DeepSeek-V4's clamp (gated_product)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if cfg.moe.expert_bias:  # [gate | up]'s split as its rows; down's whole on each TP
            # rank, added once after the TP reduction (MoE._experts)
            self.gate_up_proj_bias = nn.Parameter(torch.empty(local, rows, device=device,
                                                              dtype=dtype))
            self.down_proj_bias = nn.Parameter(torch.empty(local, cfg.d_model, device=device,
                                                           dtype=dtype))
            mark_experts(self.gate_up_proj_bias, ep_rank, ep, 1 if split else None,
                         (f, f) if self.gated else None)
            mark_experts(self.down_proj_bias, ep_rank, ep, None)
            for bias in (self.gate_up_proj_bias, self.down_proj_bias):
                bias.stacked_bias = True  # one bias per expert: no weight decay

    def forward(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """rows (M, d) grouped by local expert, counts[i] for expert i -> (M, d), this TP
        rank's partial sums."""
        outs = []
        # unbind: one backward node a weight, whose gradient is the stack of the experts'
        # (indexing each expert's slice would make a zero (E/ep, ...) gradient per expert
        # and sum them: E/ep times the weight's bytes per call, and a tiled layer calls
        # once a tile)
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias.unbind(0)
        for i, piece in enumerate(rows.split(counts)):
            h = F.linear(piece, gate_up[i], None if bias is None else bias[i])
            if self.gated and self.limit is not None:  # gpt-oss's clamped SwiGLU
                gate, up = h.chunk(2, dim=-1)                     # (n, f/tp) each
                gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
                h = (up + 1) * gate * torch.sigmoid(self.alpha * gate)
            elif self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = gated_product(gate, up, self.kind, self.clamp)
            else:
                h = up_activation(h, self.kind)
            outs.append(F.linear(h, down[i]))                     # (n, d)
        return torch.cat(outs)


def _unread_tile(rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                 ) -> torch.Tensor:
    """A tile's stand-in under SkipTiles: zeros of its output's shape (n, d), read by
    nothing (its checkpoint saves the tile's inputs as the real tile's does)."""
    return torch.zeros_like(rows)


class Router(nn.Linear):
    """The router's logits (transformers' ``gate``) and, with correction_bias, DeepSeek-V3's
    e_score_correction_bias: a buffer (no gradient, saved with the model) kept in fp32
    through casts of the model (DeepSpeed's bf16 engine casts every buffer), where its
    updates of +-bias_update_rate would round away. With scaled (model.moe.scaled_router,
    Gemma 4's router) the logits are of rmsnorm(x) * scale / sqrt(d), and ``per_expert_scale``
    (E,) multiplies the chosen experts' weights (MoE.forward)."""

    def __init__(self, d_model: int, num_experts: int, bias: bool, correction_bias: bool,
                 device=None, dtype=None, scaled: bool = False, eps: float = 1e-6,
                 hash_table=None):
        super().__init__(d_model, num_experts, bias=bias, device=device, dtype=dtype)
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(
                num_experts, device=device, dtype=torch.float32))
        if hash_table is not None:  # (vocab, k): model.moe.hash_layers (transformers' name)
            self.register_buffer("tid2eid", torch.zeros(hash_table, device=device,
                                                        dtype=torch.int64))
        self.scale = self.per_expert_scale = None
        self.eps = eps
        if scaled:  # replicated over TP and EP: every rank routes with all E experts
            self.scale = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
            self.per_expert_scale = nn.Parameter(torch.ones(num_experts, device=device,
                                                            dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:  # Gemma 4: a weightless RMSNorm, the learned scale, 1/sqrt(d)
            x = l2_norm(x, self.eps) * self.scale * self.in_features ** -0.5
        return super().forward(x)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        b = self._buffers.get("e_score_correction_bias")
        if b is not None and b.dtype != torch.float32:
            self._buffers["e_score_correction_bias"] = b.float()
        return self


# The router's parameters whose init is ones (models/gpt.py init_default): Gemma 4's scales
ROUTER_ONES = ("gate.scale", "gate.per_expert_scale")


class SkipTiles:
    """A recompute of the block a tiled MoE layer is in, which reads nothing of the
    layer's output (module docstring): each tile's checkpoint keeps its inputs as in the
    forward, around a stand-in that runs no expert and no all-to-all. Re-enterable: a
    checkpoint's recompute runs once per backward pass that reaches it (a pipeline stage
    can run two)."""

    def __init__(self, moe: "MoE"):
        self.moe = moe

    def __enter__(self):
        self.moe.tiles_skipped = True

    def __exit__(self, *exc):
        self.moe.tiles_skipped = False


class MoE(nn.Module):
    """The MoE MLP of one layer (module docstring). ep_group: the experts' EP group (None:
    all here); tp_group: each expert's f split; stats: the forward's RouterStats, set by
    the model before each forward (None: no auxiliary losses kept); tile: memory.mlp_tile_tokens
    under memory.tiled_mlp (None: untiled)."""

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "MoE":
        return cls(args.cfg, args.tp_group, args.ep_group, args.device, args.dtype,
                   args.mlp_tile, args.hash_routed)

    def __init__(self, cfg: ModelConfig, tp_group=None, ep_group=None, device=None,
                 dtype=None, tile=None, hash_routed: bool = False):
        super().__init__()
        moe = cfg.moe
        self.moe, self.tp_group, self.ep_group, self.tile = moe, tp_group, ep_group, tile
        self.expert_width = expert_hidden(cfg) // tp_size_of(tp_group)  # f/tp (auto tiles)
        ep, ep_rank = (1, 0) if ep_group is None else (dist.get_world_size(ep_group),
                                                       dist.get_rank(ep_group))
        # model.moe.hash_layers: the choice from the token ids (set by the model before
        # each forward, (N,) in x's row order), no correction bias
        self.hash_routed, self.token_ids = hash_routed, None
        self.gate = Router(cfg.d_model, moe.num_experts, moe.router_bias,
                           moe.score_correction_bias and not hash_routed, device, dtype,
                           moe.scaled_router, cfg.norm_eps,
                           (cfg.vocab_size, moe.top_k) if hash_routed else None)
        self.experts = Experts(cfg, ep_rank, ep, tp_size_of(tp_group), device, dtype)
        self.shared_expert = MLP(replace(cfg, ffn_hidden=moe.shared_expert_hidden), tp_group,
                                 device, dtype) if moe.shared_expert_hidden else None
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False, device=device,
                                            dtype=dtype) if moe.shared_expert_gate else None
        self.stats: Optional[RouterStats] = None
        self.tiles_skipped = False  # inside SkipTiles: a block's recompute

    def output_unread_context(self):
        """Block.recompute_context's hook: a SkipTiles when the experts are tiled (untiled,
        the recompute must remake the experts' own saved intermediates), else None."""
        return None if self.tile is None else SkipTiles(self)

    def correction_bias(self) -> Optional[torch.Tensor]:
        """DeepSeek-V3's e_score_correction_bias (E,), or None."""
        return getattr(self.gate, "e_score_correction_bias", None)

    def update_correction_bias(self, counts: torch.Tensor) -> None:
        """The aux-free balance step from this layer's assignments per expert (E,) over
        the whole step (every rank's, every micro-batch): the same bias on every rank."""
        balance_bias_update(self.gate.e_score_correction_bias, counts,
                            self.moe.bias_update_rate)

    def _hashed_experts(self) -> Optional[torch.Tensor]:
        """model.moe.hash_layers: each token's experts tid2eid[id] (N, k); else None."""
        if not self.hash_routed:
            return None
        if self.token_ids is None:
            raise ValueError("MoE: a hash-routed layer (model.moe.hash_layers) needs the "
                             "token ids: the GPT sets token_ids before its forward")
        return self.gate.tid2eid[self.token_ids]

    def _experts(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        # every expert's f/tp partial sums completed over TP before the router weights them
        out = reduce_from_tensor_model_parallel_region(self.experts(rows, counts),
                                                       self.tp_group)
        bias = self.experts.down_proj_bias                        # (E/ep, d)
        if bias is not None:  # each row's expert's, once (after the sum over TP)
            out = out + bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0,
                                               output_size=out.shape[0])
        return out

    def _routed(self, rows: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
                ) -> torch.Tensor:
        """rows (N, d), weights (N, k), chosen (N, k) -> the routed experts' sum (N, d):
        whole, or one tile of tokens at a time (module docstring)."""
        def routed(r, w, c):
            return dispatch_combine(r, w, c, self.moe.num_experts, self._experts, self.ep_group,
                                    self.moe.scale_expert_input)
        if self.tile is None:
            return routed(rows, weights, chosen)
        N, d = rows.shape
        tile = mlp_tile_tokens(N, d, self.expert_width, self.tile)
        if self.tiles_skipped:
            routed = _unread_tile
        return torch.cat([checkpoint(routed, rows[s:s + n], weights[s:s + n], chosen[s:s + n],
                                     use_reentrant=False)
                          for s, n in tile_spans(N, tile)])      # (N, d)

    def forward(self, x: torch.Tensor, router_input: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """x (B, T/cp, d) normed -> (B, T/cp, d), complete (and identical) over TP;
        router_input (B, T/cp, d): what the router reads (None: x; Gemma 4's experts beside
        the MLP: the block's x before its norm, models/moe_beside_mlp.py).

        The router and the shared expert's gate see x itself (their outputs are the same on
        every TP rank, so are their gradients); the experts see f(x), whose backward sums
        their partial input gradients over TP."""
        shape, x = x.shape, x.reshape(-1, x.shape[-1])            # (N, d)
        logits = self.gate(x if router_input is None else
                           router_input.reshape(x.shape))         # (N, E)
        m = self.moe
        weights, chosen = route(logits, m.top_k, m.score, m.norm_topk, self.correction_bias(),
                                m.n_group, m.topk_group, m.routed_scaling_factor,
                                self._hashed_experts())
        if self.gate.per_expert_scale is not None:  # Gemma 4: after norm_topk
            weights = weights * self.gate.per_expert_scale[chosen]   # (N, k)
        if self.stats is not None and not self.hash_routed:  # as transformers: no losses
            self.stats.add(logits, chosen, batch=shape[0])
        if m.capacity_factor is not None:  # this rank's tokens: layout-dependent
            chosen = drop_over_capacity(chosen, m.num_experts, m.capacity_factor)
        rows = copy_to_tensor_model_parallel_region(x, self.tp_group)
        if m.scale_expert_input:  # w_j scales the experts' f/tp-wide inputs: its gradient
            # is each TP rank's partial sum, completed by f's backward all-reduce
            weights = copy_to_tensor_model_parallel_region(weights, self.tp_group)
        y = self._routed(rows, weights, chosen)                   # (N, d)
        if self.shared_expert is not None:
            s = self.shared_expert(x)                             # f and g inside
            if self.shared_expert_gate is not None:
                s = s * torch.sigmoid(self.shared_expert_gate(x))
            y = y + s
        return y.view(shape)
