"""The mixture-of-experts MLP (model.moe) under a layout: its parameters per rank, what it
saves for backward, its active parameters and the all-to-all's bytes.

Per rank (counts.RankShapes): N tokens, d width, e the activations' element size; k of E
experts per token, each expert f = expert_hidden/tp wide (models/moe.py), ep ranks sharing
the E experts (E/ep each: ctxpar/moe/dispatch.py, dropless). The N k routed rows leave for
their experts' ranks and come back; a rank receives M rows for its own experts. M depends on
the router: the planner assumes balanced routing, M = N k (every rank's experts get their
share of every rank's rows), which is the expectation and what the load-balancing loss
aims at; a skewed router makes one rank's M (memory, expert FLOPs) larger than this.

Parameters: each MoE layer's experts, E/ep of them (times 1/tp of their width), are
counted apart from the dense ones (router, norms, shared expert): their gradients and
ZeRO 1/2 partitions are over the expert-data-parallel group of dp x cp / ep ranks
(ctxpar/distributed/expert_parallel.py), the rest over dp x cp (zero_state.py).

Dense and MoE MLPs in one model (model.moe.layers a subset: mixed_mlps): every count is
the block's own, a MoE block's as above, a dense block's as a model without model.moe
(block_model): parameters, saved activations, the MLP's working sets; the all-to-alls
and the idle experts' FLOPs over the MoE layers alone (moe_layers).

Tiled experts (memory.tiled_mlp with model.moe; models/moe.py): the router scores all N
tokens at once, then each tile of t tokens (expert_tile: the MoE layer's own rule) is
dispatched, computed and combined inside an activation checkpoint. What the layer keeps
for backward is then the router's part alone (the tiles' inputs are views of x and of the
router's weights and choices, counted there); the rows' buffers and the experts'
intermediates exist for one tile at a time: in the forward (its no-grad working set at t)
and in the backward, which replays the tile (its saved rows at t beside their gradients).
A recompute of the block (activation checkpointing) skips the tiles' experts where the
block keeps nothing of the layer's output (recompute_skipping_layers): its working set
there is the router's alone, and the tiles' replay in backward is the experts' one more
forward, as the untiled layer's recompute is (timing.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Tuple

from ..config import ModelConfig, resolved_ffn_hidden
from ..config.layer_mixers import LAYER_MIXERS, channel_output_kept, layer_types
from ..config.moe import moe_layer_indices
from ..config.parameters import block_specs
from .mlp_widths import saved_width

EXPERT_SPLITS = ("experts_column", "experts_row")


def moe_indices(m: ModelConfig):
    """The blocks whose MLP is the MoE (model.moe.layers among those with an MLP, as
    parameters.block_specs builds them)."""
    types = layer_types(m)
    return [i for i in moe_layer_indices(m.moe, m.n_layers) if LAYER_MIXERS[types[i]][1]]


def mixed_mlps(m: ModelConfig) -> bool:
    """model.moe.layers leaves some MLPs dense (Qwen3-MoE's mlp_only_layers, DeepSeek's
    first dense layers): the blocks then differ by their MLP, counted block by block."""
    if m.moe is None or m.moe.layers is None:
        return False
    types = layer_types(m)
    return len(moe_indices(m)) != sum(1 for t in types if LAYER_MIXERS[t][1])


def block_model(m: ModelConfig, moe: bool) -> ModelConfig:
    """The model as a block sees it: m for a MoE block, m without model.moe for a dense
    MLP's (what its counts read; once per model)."""
    if moe or m.moe is None:
        return m
    key = id(m)
    if key not in _DENSE or _DENSE[key][0] is not m:
        _DENSE[key] = (m, replace(m, moe=None))
    return _DENSE[key][1]


_DENSE: dict = {}  # block_model's: id(m) -> (m, m without model.moe)


def moe_layers(m: ModelConfig, start: int = 0, count: int = None) -> int:
    """MoE layers among blocks [start, start + count) (default: all)."""
    end = m.n_layers if count is None else start + count
    return sum(1 for i in moe_indices(m) if start <= i < end)


def recompute_skipping_layers(m: ModelConfig, start: int = 0, count: int = None) -> int:
    """MoE layers among blocks [start, start + count) whose block keeps nothing of the
    layer's output (layer_mixers.channel_output_kept): tiled, a recompute of the block
    skips their experts (models/moe.py SkipTiles), so the tiles' replay in backward is
    the only forward they run again."""
    end = m.n_layers if count is None else start + count
    types = layer_types(m)
    return sum(1 for i in moe_indices(m)
               if start <= i < end and not channel_output_kept(m, types[i]))


def expert_params(m: ModelConfig, tp: int, ep: int) -> int:
    """One MoE layer's routed experts on one rank: E/ep experts, f/tp of each."""
    i = moe_indices(m)[0]
    return sum(s.numel(tp, ep) for s in block_specs(m, i, tp) if s.split in EXPERT_SPLITS)


def stage_expert_params(m: ModelConfig, tp: int, ep: int, start: int, count: int) -> int:
    """The routed experts' parameters on one rank of a stage of `count` blocks from
    `start` (0 without model.moe)."""
    n = moe_layers(m, start, count)
    return n * expert_params(m, tp, ep) if n else 0


def expert_tile(N: int, d: int, m: ModelConfig, tp: int, setting) -> int:
    """Tokens per tile of a tiled MoE layer over N tokens: models/moe.py's rule (the dense
    MLP's, memory.mlp_tile_tokens, at an expert's width f/tp)."""
    from ..memory.tiled_mlp import mlp_tile_tokens
    return mlp_tile_tokens(N, d, (m.moe.expert_hidden or resolved_ffn_hidden(m)) // tp, setting)


def clamp_saved(m: ModelConfig) -> int:
    """(N, f)-wide tensors more a gated MLP saves under model.swiglu_limit (DeepSeek-V4's
    clamp): the clamps keep gate's and up's unclamped outputs beside the clamped ones the
    silu and the product keep."""
    return 2 if m is not None and m.swiglu_limit is not None else 0


def expert_clamp_saved(m: ModelConfig) -> int:
    """(M, f)-wide tensors more the experts save under gpt-oss's clamped SwiGLU
    (model.moe.swiglu_limit: (clamp(up) + 1) * g * sigmoid(alpha g), models/moe.py) than
    the plain one's silu(gate): up + 1, the clamped gate g, the sigmoid and the first
    product, four in place of one."""
    return 3 if m.moe is not None and m.moe.swiglu_limit is not None else 0


def routed_rows_saved(N: int, d: int, e: int, m: ModelConfig, tp: int, ep: int,
                      received: int = None) -> int:
    """routed_saved's `rows` and `over EP` terms for N tokens: what the dispatch, the
    experts and the combine save (a tile's, replayed in backward, when tiled); with
    model.moe.expert_bias the down bias's repeat index (M,) int64."""
    moe = m.moe
    f, rows = (moe.expert_hidden or resolved_ffn_hidden(m)) // tp, N * moe.top_k
    M = rows if received is None else received
    per_row = (saved_width(m) + clamp_saved(m) + expert_clamp_saved(m)) \
        * f * e + (8 if moe.expert_bias else 0)
    routed = 2 * rows * 8 + 2 * M * d * e + M * per_row + rows * d * e
    return routed + (M * 8 + rows * d * e if ep > 1 else 0)


def routed_saved(N: int, d: int, e: int, m: ModelConfig, tp: int, ep: int,
                 received: int = None, tiled: bool = False) -> int:
    """Bytes one MoE layer saves in mode 'none' (its norm aside; N tokens on the rank):

    router     the fp32 scores (N, E) (softmax's or sigmoid's output), the top-k indices
               (N, k) int64; with norm_topk the k scores and their (N, 1) sum (fp32, the
               division's inputs); the combine's (N, k) weights in the activations' dtype
    losses     RouterStats.add: softmax(logits) again and logsumexp's fp32 logits (N, E)
               each, its (N,) output
    rows       the gather's and the combine's (N k,) int64 orders; the experts' M input
               rows (M, d), each expert's [gate | up] output, activation and product (4 f
               per row; 2 f without a gate; clamp_saved and expert_clamp_saved more; the
               down bias's (M,) int64 index), their M output rows; the combined rows (N k, d)
    over EP    M = `received` rows arrive for this rank's experts (default N k: balanced
               routing, the module docstring), their regrouping order (M,) int64, and the
               N k results back from the experts' ranks, (N k, d), beside the combined rows
    shared     a dense MLP of shared_expert_hidden/tp (4 f per token, as the MLP's), and
               its gate's sigmoid (N, 1) and the shared output (N, d) it multiplies
    scaled     Gemma 4's router (scaled_router): its weightless norm's output and that
               times the scale (the logits' input), (N, d) each, the norm's fp32 rstd (N,),
               and in 16 bits the norm's fp32 copy of x (N, d); the k weights before the
               per-expert scale (N, k) fp32 and the scales they take (N, k)
    tiled      rows and over EP: nothing (the tiles' checkpoints keep views of x and of
               the router's outputs; the module docstring)
    """
    moe = m.moe
    E, k = moe.num_experts, moe.top_k
    router = N * E * 4 + N * k * 8 + N * k * e + ((N * k + N) * 4 if moe.norm_topk else 0)
    losses = 2 * N * E * 4 + N * 4
    routed = 0 if tiled else routed_rows_saved(N, d, e, m, tp, ep, received)
    shared = 0
    if moe.shared_expert_hidden:
        fs = moe.shared_expert_hidden // tp
        shared = (saved_width(m) + clamp_saved(m)) * N * fs * e
        shared += N * d * e + N * e if moe.shared_expert_gate else 0
    scaled = 0
    if moe.scaled_router:
        scaled = 2 * N * d * e + 4 * N + (4 * N * d if e != 4 else 0) + N * k * (4 + e)
    return router + losses + routed + shared + scaled


def router_losses_saved(m: ModelConfig) -> int:
    """What the routers' losses save once per forward (RouterStats.losses): the (E,)
    assignment shares and the row count, fp32."""
    return 4 * m.moe.num_experts + 4 if m.moe is not None else 0


def all_to_all_bytes(N: int, d: int, e: int, m: ModelConfig, ep: int) -> Tuple[int, int]:
    """(forward, backward) bytes one rank sends in one MoE layer: the N k routed rows out
    and their results back (two all-to-alls of N k d e), the (ep - 1)/ep of them bound for
    other ranks (balanced routing); backward the same by the reverse splits. The counts'
    exchange (E int64) is left out."""
    if ep == 1:
        return 0, 0
    one = 2 * N * m.moe.top_k * d * e * (ep - 1) // ep
    return one, one


def forward_working_set(N: int, d: int, e: int, m: ModelConfig, ep: int, tile: int = 0
                        ) -> int:
    """A MoE layer's forward intermediates without autograd (a checkpointed block's
    forward, evaluation, a tile's checkpointed forward) at its experts, the largest point:
    the M = N k routed rows (balanced), the experts' outputs and their concatenation, (M,
    d) each; over EP the rows received and regrouped, (M, d) each, beside them. tile > 0:
    one tile's (N replaced by the tile's tokens)."""
    rows = (min(tile, N) if tile else N) * m.moe.top_k
    return (3 + (2 if ep > 1 else 0)) * rows * d * e


def backward_working_set(N: int, d: int, e: int, m: ModelConfig, tp: int, ep: int,
                         tile: int = 0) -> int:
    """A MoE layer's backward at its experts: the combined rows' gradient (N k, d), the
    experts' output rows' and input rows' gradients (M, d) each (M = N k, balanced), over
    EP the all-to-all's gradient buffers (N k, d) each way, and one expert's intermediates'
    gradients (its n = M ep / E rows: 2 f each, gate and up, as the dense MLP's). tile > 0:
    one tile's, beside what its replayed forward saved (routed_rows_saved of the tile)."""
    moe = m.moe
    t = min(tile, N) if tile else N
    rows, f = t * moe.top_k, (moe.expert_hidden or resolved_ffn_hidden(m)) // tp
    one_expert = 2 * (rows * ep // moe.num_experts) * f * e
    replayed = routed_rows_saved(t, d, e, m, tp, ep) if tile else 0
    return (3 + (2 if ep > 1 else 0)) * rows * d * e + one_expert + replayed


def idle_expert_params(m: ModelConfig, tp: int, layers: int) -> int:
    """Of the first `layers` blocks' parameters on a TP rank (every expert counted), those
    a token does not run: the routed experts' share (E - k)/E (0 without model.moe)."""
    if m.moe is None:
        return 0
    idle = m.moe.num_experts - m.moe.top_k
    return moe_layers(m, 0, layers) * expert_params(m, tp, 1) * idle // m.moe.num_experts
