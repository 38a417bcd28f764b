"""Tiled MLP: the (tokens, ffn/tp) intermediates exist for one tile of tokens at a time.

The MLP is token-local, so it can run over tiles of the rank's N = B * T/cp tokens
(ALST, Bekman et al. 2025, arXiv:2506.13996, DeepSpeed's ``TiledMLP``). ``TiledMLP`` is an
autograd Function that keeps only its input x (N, d) for backward:

    forward    per tile, under no_grad: h_t = act(x_t W_g^T + b_g) * (x_t W_u^T + b_u)
               (t, ffn/tp), then y_t = h_t W_d^T (t, d) written into one (N, d) buffer
    backward   per tile, with grad: recompute h_t and y_t, backpropagate dY_t; dx_t goes
               into one (N, d) buffer, each weight's tile gradient is added to that
               weight's sum as soon as autograd makes it (a post-accumulate-grad hook)

so memory holds one tile's t * ffn/tp intermediates instead of N * ffn/tp (four of them
for SwiGLU: gate, up, silu(gate), product). The price is one more MLP forward in
backward (on top of activation checkpointing's replay, when the block is checkpointed).

Tensor parallelism: the Function is the whole column -> row pair including its f and g
ops (tensor_parallel/mappings.py). Each tile computes this rank's ffn slice's partial
down-projection and the (N, d) buffer is all-reduced ONCE per layer (g); in backward each
tile's partial dx goes into one (N, d) buffer, all-reduced once (f's backward). Per tile
would be the same bytes in n_tiles times as many messages (latency-bound on small tiles)
and would tie the collective count to the tile count; once per layer the ranks of a TP
group cannot disagree (the tile count is a pure function of shapes they share anyway).

ZeRO-3: DeepSpeed gathers a module's parameters in hooks around that module's forward and
backward. The tiles call no module (they use the weights with F.linear / mm), so DeepSpeed
sees one MLP forward and one MLP backward per layer whatever the tile count, and the
number of parameter all-gathers cannot depend on it: the deadlock ALST guards against by
all-reducing its shard count (max over ranks; its tiles called the Linear modules, so
ranks with different sequence lengths ran different numbers of gathers) cannot happen here
by construction. (ctxpar's ranks of a ZeRO group, dp x cp, all hold B * T/cp tokens
anyway; tests/test_tiled_mlp.py gives two ZeRO-3 ranks different tile counts.) The MLP
is also marked a ZeRO-3 leaf (``mark_zero3_leaf``): its three weights are fetched together
on entry instead of one by one as each is first read (DeepSpeed's external-parameter
path). The weights are inputs of the Function: their gradients, summed over tiles here
(in fp32 for 16-bit weights), are returned once per micro-batch, so DeepSpeed's reduce
hooks (the leaf's backward hook under ZeRO-3, accumulate-grad hooks otherwise) see each
gradient exactly once.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ctxpar.tensor_parallel.mappings import tp_size_of

HALF = (torch.float16, torch.bfloat16)
TILE_FLOOR = 512  # fewest tokens an 'auto' tile gets, unless the input is shorter


def mlp_tile_tokens(tokens: int, d_model: int, ffn_per_rank: int,
                    setting: Union[int, str] = "auto") -> int:
    """Tokens per tile for an MLP over ``tokens`` (B * T/cp) tokens; the last tile may be short.

    'auto': ALST's budget, tiles of about d tokens (its ceil(T / d) shards), so one tile's
    (t, ffn/tp) intermediate is about one MLP weight's size whatever the context length;
    but at least TILE_FLOOR tokens, where each of the tile's matmuls still does enough
    work per weight byte it reads (docs/memory.md, "Tile sizes"); the tiles are equal,
    ceil(tokens / max(d, TILE_FLOOR)) of them, and one when the input is that short.
    An integer is used as given (capped at ``tokens``).
    """
    if tokens < 1:
        return 1
    if setting != "auto":
        return max(1, min(int(setting), tokens))
    n_tiles = -(-tokens // max(d_model, TILE_FLOOR))
    return -(-tokens // n_tiles)


def tile_spans(tokens: int, tile: int) -> List[Tuple[int, int]]:
    """(start, length) of each tile of ``tile`` tokens; the last one holds the remainder."""
    return [(s, min(tile, tokens - s)) for s in range(0, tokens, tile)]


def mark_zero3_leaf(module: nn.Module) -> None:
    """Make DeepSpeed ZeRO-3 gather all of ``module``'s parameters when it is entered and hook
    none of its children (deepspeed.utils.set_z3_leaf_module sets this same attribute; it
    must be set before deepspeed.initialize). Without ZeRO-3 nothing reads it."""
    module._z3_leaf = True


def gate_activation(x: torch.Tensor, gated: str) -> torch.Tensor:
    """The gate's activation of a gated MLP: silu (SwiGLU) or tanh-GELU (GeGLU)."""
    return F.silu(x) if gated == "swiglu" else F.gelu(x, approximate="tanh")


def gated_product(gate: torch.Tensor, up: torch.Tensor, gated: str,
                  limit: Optional[float] = None) -> torch.Tensor:
    """act(gate) * up of a gated MLP; with ``limit`` (model.swiglu_limit, DeepSeek-V4's
    clamped SwiGLU) gate clamped above at the limit and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate_activation(gate, gated) * up


def up_activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation of an MLP without a gate: tanh-GELU ('gelu') or squared ReLU
    ('relu2': Nemotron-H, Primer's relu(x)^2)."""
    return torch.square(F.relu(x)) if kind == "relu2" else F.gelu(x, approximate="tanh")


def _partial_out(x, gated, limit, gate_w, gate_b, up_w, up_b, down_w, out=None):
    """This rank's partial down-projection of a tile: x (t, d) -> (t, d), before g."""
    if gate_w is not None:  # SwiGLU or GeGLU (gated: 'swiglu' or 'geglu')
        h = gated_product(F.linear(x, gate_w, gate_b), F.linear(x, up_w, up_b), gated, limit)
    else:  # GELU or squared ReLU (gated: 'gelu' or 'relu2')
        h = up_activation(F.linear(x, up_w, up_b), gated)  # (t, ffn/tp)
    return torch.mm(h, down_w.t(), out=out)  # (t, d)


class TiledMLP(torch.autograd.Function):
    """y = g(sum over tiles of act(x_t W_g^T) * (x_t W_u^T) W_d^T), f on x; see the module docstring.

    Inputs: x (..., d), tile tokens, the TP group, then gate_w (f/tp, d) or None, gate_b,
    up_w (f/tp, d), up_b, down_w (d, f/tp), the gated MLP's kind ('swiglu' or 'geglu') and
    its clamp (model.swiglu_limit or None). The down bias is the caller's (added after g).
    """

    @staticmethod
    def forward(ctx, x, tile, group, gate_w, gate_b, up_w, up_b, down_w, gated="swiglu",
                limit=None):
        d = x.shape[-1]
        x2 = x.reshape(-1, d)  # (N, d), a view of the contiguous block activation
        out = x2.new_empty(x2.shape[0], down_w.shape[0])  # (N, d): every tile's rows
        for s, n in tile_spans(x2.shape[0], tile):
            _partial_out(x2[s:s + n], gated, limit, gate_w, gate_b, up_w, up_b, down_w,
                         out=out[s:s + n])
        if tp_size_of(group) > 1:
            dist.all_reduce(out, group=group)  # g, once per layer
        ctx.save_for_backward(x)
        # The weights are read again in backward rather than saved: under ZeRO-3 their data
        # is swapped out between forward and backward and gathered again by DeepSpeed's
        # hooks before this backward runs (as for activation checkpointing's replay).
        ctx.weights = (gate_w, gate_b, up_w, up_b, down_w)
        ctx.tile, ctx.group, ctx.gated, ctx.limit = tile, group, gated, limit
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        d = x.shape[-1]
        x2, dy = x.reshape(-1, d), grad_out.reshape(-1, grad_out.shape[-1])  # (N, d) each
        need_dx = ctx.needs_input_grad[0]
        # Leaves sharing each weight's data: each tile's graph ends here, so autograd's
        # accumulate-grad (and DeepSpeed's hooks on it) never sees a per-tile gradient.
        leaves = [None if w is None else w.detach().requires_grad_(ctx.needs_input_grad[3 + i])
                  for i, w in enumerate(ctx.weights)]
        wanted = [w for w in leaves if w is not None and w.requires_grad]
        sums: List[Optional[torch.Tensor]] = [None] * len(wanted)  # over tiles

        def add_to_sum(i):
            # Runs as soon as a tile's gradient of weight i is made, before the tile's next
            # weight gradient: one tile product alive at a time, beside the sums. 16-bit
            # weights: the tiles summed in fp32, as one GEMM would.
            def hook(leaf):
                g, leaf.grad = leaf.grad, None
                if sums[i] is None:
                    sums[i] = g.float() if g.dtype in HALF else g
                else:
                    sums[i].add_(g)
            return hook

        hooks = [w.register_post_accumulate_grad_hook(add_to_sum(i)) for i, w in enumerate(wanted)]
        dx = torch.empty_like(x2) if need_dx else None
        for s, n in tile_spans(x2.shape[0], ctx.tile):
            xt = x2[s:s + n].detach().requires_grad_(need_dx)
            with torch.enable_grad():
                yt = _partial_out(xt, ctx.gated, ctx.limit, *leaves)
            torch.autograd.backward(yt, dy[s:s + n], inputs=([xt] if need_dx else []) + wanted)
            del yt
            if need_dx:
                dx[s:s + n].copy_(xt.grad)
        for h in hooks:
            h.remove()
        if need_dx and tp_size_of(ctx.group) > 1:
            dist.all_reduce(dx, group=ctx.group)  # f's backward, once per layer
        summed = iter(sums)
        w_grads = [next(summed).to(w.dtype) if w is not None and w.requires_grad else None
                   for w in leaves]
        ctx.weights = None
        return (dx.view_as(x) if need_dx else None, None, None, *w_grads, None, None)


def tiled_mlp(x: torch.Tensor, gate: Optional[nn.Module], up: nn.Module, down: nn.Module,
              tp_group, setting: Union[int, str] = "auto",
              gated: str = "swiglu", limit: Optional[float] = None) -> torch.Tensor:
    """The MLP down(act(gate x) * up x) over tiles of tokens: x (B, T/cp, d) -> (B, T/cp, d).

    gate, up: ColumnParallelLinear (gate None for GELU and squared ReLU); down:
    RowParallelLinear; gated: model.mlp, whose activation is the gate's ('swiglu': silu,
    'geglu': tanh-GELU) or up's ('gelu', 'relu2': up_activation), limit its clamp
    (gated_product). Same result as the
    untiled layers (f and g included), up to the order of float sums.
    """
    tokens = x.numel() // x.shape[-1]
    tile = mlp_tile_tokens(tokens, x.shape[-1], up.out_per_rank, setting)
    y = TiledMLP.apply(x, tile, tp_group, None if gate is None else gate.weight,
                       None if gate is None else gate.bias, up.weight, up.bias, down.weight,
                       gated, limit)
    return y + down.bias if down.bias is not None else y
