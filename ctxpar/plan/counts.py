"""Exact per-rank counts of a GPT under a layout: parameters, saved activations, bytes moved.

Shapes per rank (models/gpt.py): N = micro_batch * T/cp tokens, h = H/tp query heads,
hk = Hkv/tp kv heads (1, replicated, when Hkv < tp; a layer type's own under
model.layer_kv_heads), vd = the value heads' width (hd unless model.v_head_dim: V crosses
the CP core zero-padded to hd), f = ffn/tp MLP columns, V/tp vocab
rows; e = the activations' element size (2 bf16, 4 fp32). Parameters are counted from the
model's one description (ctxpar/config/parameters.py), which models/gpt.py checks itself
against when it is built; activations are checked against autograd's saved tensors
(tools/benchmarks/bench_activation_memory.py); the bytes on the wire are comm_bytes.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..config import ModelConfig, resolved_ffn_hidden, resolved_head_dim, rotary_dim
from ..config.layer_mixers import LAYER_MIXERS, LINEAR_MIXERS, first_layer_type, layer_types
from ..config.attention_heads import kv_heads_of
from ..config.layers import DELTA_TYPES, gated_delta_dims, layer_attention, mamba_dims
from ..config.parameters import (block_fields, block_specs, embedding_spec, head_specs,
                                 layer_head_dim, layer_kv_heads, mtp_specs,
                                 per_layer_embedding_specs)
from ..context_parallel.ulysses import ulysses_kv_heads
from .candidate import Candidate
from . import compressed_layers, dsa_layers, mla_layers
from .kv_layers import carried_bytes, layer_rank_shapes, per_layer_shapes
from .mlp_widths import saved_width
from .streams import head_streams_saved, streams_saved
from .moe_layers import (block_model, clamp_saved, expert_params, mixed_mlps,
                         moe_indices, router_losses_saved, routed_saved, stage_expert_params)


@dataclass(frozen=True)
class RankShapes:
    """The per-rank dimensions of a model under a layout (see the module docstring)."""

    N: int        # tokens per micro-batch on this rank (B * T/cp)
    B: int
    T: int        # full sequence length
    d: int
    h: int        # query heads on this rank
    hk: int       # kv heads on this rank
    hd: int
    f: int
    V: int        # vocabulary rows on this rank
    L: int        # layers of the whole model
    tp: int
    vd: int = 0   # value head width (model.v_head_dim; hd unless set)
    kv_tensors: int = 2  # K and V per kv head in the core; 1: k_proj x alone (wire_tensors)


def rank_shapes(m: ModelConfig, cand: Candidate, kind: Optional[str] = None) -> RankShapes:
    """The shapes of a layer of type kind: its type's K/V heads and head dim as its
    LayerAttention carries them (model.layer_kv_heads, Gemma 4's global_n_kv_heads and
    global_head_dim); None, or a type no layer is: the model's."""
    a = next((a for a in layer_attention(m) if a.kind == kind), None) if kind else None
    n_kv = kv_heads_of(m) if a is None else layer_kv_heads(m, a)
    hk = n_kv // cand.tp if n_kv % cand.tp == 0 else 1
    return RankShapes(N=cand.micro_batch * m.seq_len // cand.cp, B=cand.micro_batch,
                      T=m.seq_len, d=m.d_model, h=m.n_heads // cand.tp, hk=hk,
                      hd=resolved_head_dim(m) if a is None else layer_head_dim(m, a),
                      f=resolved_ffn_hidden(m) // cand.tp,
                      V=m.vocab_size // cand.tp, L=m.n_layers, tp=cand.tp,
                      vd=(m.v_head_dim or 0) if m.mla is None else 0)  # 0: hd


def widest_kind(m: ModelConfig, kinds) -> Optional[str]:
    """Of the layer types kinds, the one with the most K/V heads (the largest attention
    buffers: a phase's peak); None when the heads do not differ by type."""
    if m.layer_kv_heads is None:
        return None
    return max(kinds, key=lambda kind: kv_heads_of(m, kind), default=None)


# ------------------------------------------------------------------ parameters


def _numel(specs, tp: int) -> int:
    return sum(spec.numel(tp) for spec in specs)


def _block(m: ModelConfig, tp: int, *parts: str, kind: Optional[str] = None,
           moe: Optional[bool] = None):
    """The ParamSpecs (ctxpar/config/parameters.py) of a block of layer type `kind`
    (default: block 0's), with a MoE MLP or a dense one where moe says (None: the first
    block of the kind), whose name inside the block starts with one of parts (all of
    them without parts)."""
    kind = kind or first_layer_type(m)
    key = (block_fields(m), kind, tp, moe)
    if key not in _BLOCK_SPECS:  # once per model, layer type, MLP and TP degree
        i = _first_block(m, kind, moe)
        _BLOCK_SPECS[key] = [(s.name.split(".", 2)[2], s) for s in block_specs(m, i, tp)]
    return [s for name, s in _BLOCK_SPECS[key] if not parts or name.startswith(parts)]


def _first_block(m: ModelConfig, kind: str, moe: Optional[bool]) -> int:
    """The first block of layer type kind (with a MoE MLP or not, unless moe is None)."""
    if moe is None:
        return 0 if kind == first_layer_type(m) else layer_types(m).index(kind)
    experts = set(moe_indices(m))
    return next(i for i, t in enumerate(layer_types(m)) if t == kind and (i in experts) == moe)


def _block_numel(m: ModelConfig, tp: int, *parts: str, kind: Optional[str] = None,
                 moe: Optional[bool] = None) -> int:
    """_numel of _block(m, tp, *parts, kind=kind, moe=moe), once per model, kind, MLP, TP
    and parts."""
    key = (block_fields(m), kind or first_layer_type(m), tp, parts, moe)
    if key not in _BLOCK_NUMEL:
        _BLOCK_NUMEL[key] = _numel(_block(m, tp, *parts, kind=kind, moe=moe), tp)
    return _BLOCK_NUMEL[key]


def blocks(m: ModelConfig, start: int = 0, count: Optional[int] = None) -> List[tuple]:
    """(layer type, MoE MLP or not) of blocks [start, start + count) (default: all)."""
    end = m.n_layers if count is None else start + count
    experts = set(moe_indices(m))
    return [(t, i in experts) for i, t in enumerate(layer_types(m)[start:end], start)]


def variants(m: ModelConfig) -> tuple:
    """The distinct (layer type, MoE MLP or not) of the blocks, in first-use order; a model
    of one layer type without mixed MLPs: (kind, None) alone, block 0's."""
    if not mixed_mlps(m):
        return tuple((k, None) for k in kinds(m))
    return tuple(dict.fromkeys(blocks(m)))


_BLOCK_SPECS: dict = {}  # _block's: (block_fields, kind, tp) -> [(name in block, spec)]
_BLOCK_NUMEL: dict = {}  # _block_numel's: (block_fields, kind, tp, parts) -> parameters


def kinds(m: ModelConfig) -> tuple:
    """The layer types the model's blocks use, in first-use order."""
    return tuple(dict.fromkeys(layer_types(m))) if m.layer_types is not None \
        else (first_layer_type(m),)


def block_params(m: ModelConfig, tp: int, kind: Optional[str] = None,
                 moe: Optional[bool] = None) -> int:
    """Parameters of one block of layer type `kind` (default block 0's; with a MoE MLP or
    a dense one where moe says) on one TP rank: norms (replicated), q/o split by heads,
    k/v split (or the full kv heads replicated when Hkv < tp), MLP split by columns, the
    linear mixers as block_specs splits them, every expert."""
    return _block_numel(m, tp, kind=kind, moe=moe)


def _experts_off(m: ModelConfig, tp: int, ep: int, moe: Optional[bool]) -> int:
    """The routed experts a block of that MLP does not hold under ep (E - E/ep of them)."""
    if m.moe is None or ep == 1 or moe is False:
        return 0
    return expert_params(m, tp, 1) - expert_params(m, tp, ep)


def layer_params(m: ModelConfig, tp: int, ep: int = 1) -> int:
    """The largest block's parameters on one TP rank (the one every block has in a model
    of one layer type; a MoE block's E/ep experts)."""
    return max(block_params(m, tp, k, moe) - _experts_off(m, tp, ep, moe)
               for k, moe in variants(m))


def qkv_params(m: ModelConfig, tp: int) -> int:
    """q, k, v projections and the attention's norm on a TP rank (a block's last grads);
    a model without attention blocks: its token mixer's input projections and norm."""
    attn = ("attn_norm.", "attn.q_proj.", "attn.k_proj.", "attn.v_proj.")
    linear = ("attn_norm.", "linear_attn.in_proj", "mamba.in_proj")
    return max(_block_numel(m, tp, *(attn if k in ATTENTION_BLOCKS else linear), kind=k,
                            moe=moe) for k, moe in variants(m))


ATTENTION_BLOCKS = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def down_proj_params(m: ModelConfig, tp: int) -> int:
    """The MLP's down projection on a TP rank (its gradient is a block's first)."""
    return max(_block_numel(m, tp, "mlp.down_proj.", kind=k, moe=moe)
               for k, moe in variants(m))


def stage_kinds(m: ModelConfig, pp: int, stage: int) -> List[str]:
    """The layer type of each block on pipeline stage `stage`."""
    start = sum(stage_layers(m, pp, i) for i in range(stage))
    return layer_types(m)[start:start + stage_layers(m, pp, stage)]


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters on one rank of pipeline stage `stage` (layers split evenly; the first
    stage has the embedding, the last the final norm and the head, tied or not; each MoE
    layer's routed experts E/ep of them: stage_experts)."""
    n = _stage_params(m, tp, pp, stage)
    return n - stage_experts(m, tp, pp, stage, 1) + stage_experts(m, tp, pp, stage, ep) \
        if m.moe is not None and ep > 1 else n


def stage_experts(m: ModelConfig, tp: int, pp: int, stage: int, ep: int) -> int:
    """The routed experts' parameters among stage_params (0 without model.moe)."""
    if m.moe is None:
        return 0
    start = sum(stage_layers(m, pp, i) for i in range(stage))
    return stage_expert_params(m, tp, ep, start, stage_layers(m, pp, stage))


def _stage_params(m: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """stage_params with every expert on the rank."""
    n = stage_block_params(m, tp, pp, stage)
    embed = embedding_spec(m).numel(tp)
    if stage == 0:  # the embedding, and Gemma 4's per-layer input embedding beside it
        n += embed + _numel(per_layer_embedding_specs(m), tp)
    if stage == pp - 1:
        n += _numel(head_specs(m), tp)  # the final norm, and an untied head
        n += _numel(mtp_specs(m, tp), tp)  # model.mtp's depths, beside the head
        if (m.tie_embeddings or m.mtp is not None) and pp > 1:  # the tied copy lives on
            n += embed  # both ends (model.mtp: the depths read it, models/mtp_pipe.py)
    return n


def stage_block_params(m: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """The blocks' parameters on one rank of pipeline stage `stage`, every expert
    counted: each block's own (its layer type, its MLP dense or MoE)."""
    start = sum(stage_layers(m, pp, i) for i in range(stage))
    if m.num_kv_shared_layers:  # Gemma 4's blocks sharing K/V have no k/v: each its own
        return sum(_numel(block_specs(m, i, tp), tp)
                   for i in range(start, start + stage_layers(m, pp, stage)))
    if m.layer_types is None and not mixed_mlps(m):  # one kind: every block the same
        return stage_layers(m, pp, stage) * block_params(m, tp)
    return sum(block_params(m, tp, k, moe if mixed_mlps(m) else None)
               for k, moe in blocks(m, start, stage_layers(m, pp, stage)))


def stage_vector_params(m: ModelConfig, tp: int, pp: int, stage: int) -> int:
    """The 1-D parameters (norm weights, biases) among stage_params: train.py's group
    without weight decay; the rest are the matrices' group."""
    def vectors(kind, moe=None):
        return _numel([s for s in _block(m, tp, kind=kind, moe=moe) if len(s.shape) == 1], tp)
    start = sum(stage_layers(m, pp, i) for i in range(stage))
    if m.num_kv_shared_layers:  # blocks sharing K/V have no k_norm: each its own
        per = sum(_numel([s for s in block_specs(m, i, tp) if len(s.shape) == 1], tp)
                  for i in range(start, start + stage_layers(m, pp, stage)))
    elif mixed_mlps(m):
        per = sum(vectors(k, moe) for k, moe in blocks(m, start, stage_layers(m, pp, stage)))
    elif m.layer_types is not None:
        per = sum(vectors(k) for k in stage_kinds(m, pp, stage))
    else:
        per = stage_layers(m, pp, stage) * vectors(None)
    final = _numel([s for s in head_specs(m) + mtp_specs(m, tp) if len(s.shape) == 1], tp)
    first = _numel([s for s in per_layer_embedding_specs(m) if len(s.shape) == 1], tp)
    return per + (final if stage == pp - 1 else 0) + (first if stage == 0 else 0)


def largest_tensor(m: ModelConfig, tp: int, ep: int = 1) -> int:
    """Elements of the largest single parameter on a TP rank (embedding / head or a
    block's largest matrix; the experts' E/ep of theirs)."""
    specs = [s for k, moe in variants(m) for s in _block(m, tp, kind=k, moe=moe)]
    return max(spec.numel(tp, ep) for spec in [embedding_spec(m), *specs, *head_specs(m)])


def total_params(m: ModelConfig) -> int:
    return stage_params(m, 1, 1, 0)


# ------------------------------------------------------------------ activations


def attention_saved(s: RankShapes, e: int, cand: Candidate,
                    m: Optional[ModelConfig] = None) -> int:
    """Bytes the CP attention keeps for backward per layer: q, k, v, out (e) and lse
    (fp32); k_proj x in place of k, v where it alone is on the wire (s.kv_tensors 1).
    Ulysses/hybrid keep the gathered layout (k, v at lcm(hk, u) heads when u does not
    divide hk) and the o-projection keeps the local out as well. MLA (m.mla): the latent
    instead of k, v (mla_layers.core_saved); DSA (m.dsa) adds the indexer's
    (dsa_layers.indexer_saved)."""
    if m is not None and m.mla is not None:
        dsa = dsa_layers.indexer_saved(s, e, m) if m.dsa is not None else 0
        return mla_layers.core_saved(s, e, cand, m) + dsa
    hk = s.hk
    extra_out = 0
    if cand.cp_comm in ("ulysses", "hybrid") and cand.ulysses > 1:
        hk = ulysses_kv_heads(s.hk, cand.ulysses)
        extra_out = s.N * s.h * s.hd * e
    return s.N * ((2 * s.h + s.kv_tensors * hk) * s.hd * e + 4 * s.h) + extra_out


def value_width_saved(s: RankShapes, e: int, cand: Candidate) -> int:
    """What mode 'none' keeps beyond attention_saved when the value heads are narrower
    than hd (model.v_head_dim): the core's out is hd wide (V zero-padded) and o_proj keeps
    a copy of its vd columns, in place of Ulysses' local out (attention_saved's; under
    'selective' the recomputed o_proj keeps nothing and the core's out, or Ulysses' local
    one, is the checkpoint's input whole)."""
    vd = s.vd or s.hd
    if vd == s.hd:
        return 0
    ulysses = cand.cp_comm in ("ulysses", "hybrid") and cand.ulysses > 1
    return s.N * s.h * (vd - (s.hd if ulysses else 0)) * e


def norm_saved(s: RankShapes, e: int, norm: str = "rmsnorm", device: str = "cpu") -> int:
    """Saved bytes of one norm with its output (which the next linear saves): RMSNorm on
    CPU is composite (pow, mean, rsqrt, mul: input, normed, output and the fp32 rstd,
    3 N d e + 4 N, measured); on CUDA torch's fused kernel (autograd's
    FusedRmsNormBackward0 saves input, weight and rstd) and LayerNorm everywhere
    (native_layer_norm: input, mean, rstd) keep the input and fp32 statistics."""
    if norm == "rmsnorm" and device == "cpu":
        return 3 * s.N * s.d * e + 4 * s.N
    return 2 * s.N * s.d * e + (4 if norm == "rmsnorm" else 8) * s.N


def family_norms_saved(s: RankShapes, e: int, m: Optional[ModelConfig],
                       device: str = "cpu", kind: Optional[str] = None) -> int:
    """What a block in mode 'none' saves beyond a Llama block for the Hugging Face
    families' norms: per-head q/k RMSNorms (model.qk_norm, attention blocks: their input
    and normed copy, (h + hk) fp32 rstd per token, two under qk_norm_scope 'all_heads';
    the fused CUDA kernel keeps one copy fewer), norms after the token mixer and the MLP
    (model.post_norms: input, normed and rstd each; their outputs go to the residual add,
    which saves nothing; model.reordered_norms moves a block's two norms there, the same
    bytes as before the mixers), under model.norm_offset each norm's fp32 (offset + w)
    vector, and MLA's bottleneck norms (mla_layers.bottleneck_saved). kind: the block's
    layer type (its mixers, config.layers.LAYER_MIXERS); None: an attention and MLP
    block."""
    if m is None:
        return 0
    token, channel = LAYER_MIXERS[kind] if kind else ("attention", "mlp")
    norms = (token is not None) + (channel is not None)
    copies = 2 if device == "cpu" else 1
    out = offset = 0
    if m.mla is not None and token == "attention":
        out += mla_layers.bottleneck_saved(s, e, m, device)
    if m.qk_norm and token == "attention":  # fp32 rstd per token: per head, or per
        stats = 2 if m.qk_norm_scope == "all_heads" else s.h + s.hk  # projection (OLMo)
        out += s.N * (copies * (s.h + s.hk) * s.hd * e + 4 * stats)
        offset += 2 * s.hd
    if m.post_norms:
        out += norms * s.N * (copies * s.d * e + 4)
        offset += norms * s.d
    return out + (4 * (offset + norms * s.d) if m.norm_offset else 0)


def layer_activations(s: RankShapes, e: int, cand: Candidate, mode: str,
                      tiled_mlp: bool = False, norm: str = "rmsnorm",
                      device: str = "cpu", m: Optional[ModelConfig] = None) -> int:
    """Saved bytes of one block in `mode` ('none', 'selective' or 'full'):

    none       two norms (norm_saved: on CPU input, normed, output, fp32 rstd), the
               attention's q, k, v, out, lse, the MLP's intermediates (channel_saved; a
               tiled MLP saves only its input, the norm's output: nothing more), and the
               families' extra norms (family_norms_saved)
    selective  the block input and what the attention core keeps; projections recomputed
    full       the block input only (the block is replayed in backward)
    """
    if mode == "full":
        return s.N * s.d * e
    core = attention_saved(s, e, cand, m)
    if mode == "selective":
        return s.N * s.d * e + core
    return (2 * norm_saved(s, e, norm, device) + core + family_norms_saved(s, e, m, device)
            + channel_saved(s, e, cand, m, tiled_mlp, device) + value_width_saved(s, e, cand))


def layer_modes(cand: Candidate, layers: int):
    """The checkpointing mode of each of `layers` blocks ('every_n_layers' resolved)."""
    if cand.activation != "every_n_layers":
        return [cand.activation] * layers
    return ["full" if i % cand.every_n_layers == 0 else "none" for i in range(layers)]


def gate_saved(s: RankShapes, e: int, mode: str, m: Optional[ModelConfig]) -> int:
    """Gated attention (model.attention_output_gate): sigmoid(gate) and o * sigmoid(gate),
    o_proj's input, (N, h hd) each in mode 'none'; 'selective' keeps the gate itself (an
    input of the checkpointed out-projection)."""
    if m is None or not m.attention_output_gate or mode == "full":
        return 0
    return (1 if mode == "selective" else 2) * s.N * s.h * s.hd * e


def block_activations(s: RankShapes, e: int, cand: Candidate, mode: str, kind: str,
                      m: ModelConfig, tiled_mlp: bool = False, device: str = "cpu") -> int:
    """Saved bytes of one block of layer type `kind` in `mode` ('none', 'selective' or
    'full'): attention and MLP blocks as layer_activations; Nemotron-H's single-op blocks
    without the piece they lack; a linear block (which 'selective' does not split: it
    keeps everything) its norm, its mixer's (linear_layers.mixer_saved) and its MLP's."""
    token, channel = LAYER_MIXERS[kind]
    if m.compressed_attention is not None and token == "attention":  # DeepSeek-V4's
        attn = compressed_layers.attention_saved(s, e, cand, m, kind, mode, device,
                                                 norm_saved)
        if mode in ("full", "selective"):
            return s.N * s.d * e + attn
        return (2 * norm_saved(s, e, m.norm, device) + attn
                + channel_saved(s, e, cand, m, tiled_mlp, device))
    if mode == "full":
        return s.N * s.d * e
    if token == "attention" and channel and kind != "attention":
        return layer_activations(s, e, cand, mode, tiled_mlp, m.norm, device, m) \
            + gate_saved(s, e, mode, m)
    norm = norm_saved(s, e, m.norm, device)
    if token == "attention":  # no MLP
        core = attention_saved(s, e, cand, m) + gate_saved(s, e, mode, m)
        if mode == "selective":
            return s.N * s.d * e + core
        return norm + core + family_norms_saved(s, e, m, device, kind) + \
            value_width_saved(s, e, cand)
    out = family_norms_saved(s, e, m, device, kind)
    if token is not None:
        from .linear_layers import linear_shapes, mixer_saved
        from .linear_tiles import tiled_saved
        sh = linear_shapes(m, kind, cand.tp)
        out += norm + (tiled_saved(kind, sh, s.B, s.N // s.B, cand.cp, cand.token_layout,
                                   cand.linear_tile, s.d, e) if cand.linear_tile else
                       mixer_saved(kind, sh, s.B, s.N // s.B, e, cand.cp, cand.linear_cp,
                                   cand.token_layout, device))
    if channel:
        out += norm + channel_saved(s, e, cand, m, tiled_mlp, device)
    return out


def channel_saved(s: RankShapes, e: int, cand: Candidate, m: Optional[ModelConfig],
                  tiled_mlp: bool = False, device: str = "cpu") -> int:
    """What a block's MLP saves in mode 'none' beyond its norm: the dense MLP's (N, f)
    intermediates (mlp_widths: 4 gated, 2 not; clamp_saved more; a tiled MLP nothing
    more), or a mixture of experts' (moe_layers.routed_saved, tiled or not; m: the block's
    model, moe_layers.block_model, whose moe is None for a dense MLP beside MoE ones); under model.moe.beside_mlp (Gemma
    4) both, and the three norms around them: each norm_saved but its output (which the
    sum or the experts' gather reads without saving), the experts' norm its input too
    (the block's x, which the block's own norm keeps)."""
    dense = 0 if tiled_mlp else (saved_width(m) + clamp_saved(m)) * s.N * s.f * e
    if m is None or m.moe is None:
        return dense
    routed = routed_saved(s.N, s.d, e, m, cand.tp, cand.ep, tiled=tiled_mlp)
    if not m.moe.beside_mlp:
        return routed
    return routed + dense + 3 * norm_saved(s, e, m.norm, device) - 4 * s.N * s.d * e


@dataclass(frozen=True)
class Activations:
    """Saved bytes of one micro-batch on one rank, by where they are made."""

    layers: tuple     # each block's (in order)
    embed: int        # RoPE's cos/sin; on the first stage the token ids, on a later one
    #                   what it receives beside x (Gemma 4's: kv_layers.carried_bytes)
    head: int         # on the last stage: the final norm, the loss's saved tensors

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head


def activations(m: ModelConfig, cand: Candidate, e: int, layers: int = None, first: bool = True,
                last: bool = True, reset_positions: bool = False, tiled_loss: bool = False,
                tiled_mlp: bool = False, device: str = "cpu", start: int = 0) -> Activations:
    """Saved bytes of one micro-batch's forward on one rank (what backward needs): its
    `layers` blocks from block `start` (default all) under cand.activation, each by its
    layer type (block_activations), RoPE's cos/sin (fp32, (T/cp, hd/2) each; per sample
    with reset_positions), the token ids on the first stage, and on the last the final
    norm, the fp32 softmax of the loss (none when tiled: per-token fp32 loss and
    log-sum-exp instead) and the labels and masks; with linear layers the conv's tap index
    (T/cp, K) int64, one tensor every conv reads.
    Exact: tests/test_plan.py compares it with autograd's saved tensors."""
    s = rank_shapes(m, cand)
    layers = s.L if layers is None else layers
    modes = layer_modes(cand, layers)
    if per_layer_shapes(m):  # Gemma 4: each block its own head dim, kv heads, K/V or none
        per = tuple(block_activations(layer_rank_shapes(s, m, cand.tp, i, cand), e, cand,
                                      mode,
                                      kind, block_model(m, moe), tiled_mlp, device)
                    for i, (mode, (kind, moe)) in enumerate(
                        zip(modes, blocks(m, start, layers)), start))
        conv_taps = 0
    elif m.layer_types is None and not mixed_mlps(m):  # one kind
        one = {mode: layer_activations(s, e, cand, mode, tiled_mlp, m.norm, device, m)
               + gate_saved(s, e, mode, m) for mode in set(modes)}
        per = tuple(one[mode] for mode in modes)
        conv_taps = 0
    else:  # each block by its layer type and MLP (a dense one: the model without moe)
        own = blocks(m, start, layers)
        types = [kind for kind, _ in own]
        per = tuple(block_activations(rank_shapes(m, cand, kind) if m.layer_kv_heads else s,
                                      e, cand, mode, kind, block_model(m, moe), tiled_mlp,
                                      device) for mode, (kind, moe) in zip(modes, own))
        conv = [gated_delta_dims(m).conv_kernel if k in DELTA_TYPES else
                mamba_dims(m).conv_kernel for mode, k in zip(modes, types)
                if mode != "full" and LAYER_MIXERS[k][0] in LINEAR_MIXERS
                and not cand.linear_tile]  # tiles: the taps' index is one tile's, unsaved
        conv_taps = sum(8 * (s.N // s.B) * K for K in set(conv))
    if m.hyper_connections is not None:  # N residual streams and their maps (plan/streams.py)
        per = tuple(p + streams_saved(s.N, s.d, e, m, mode, kind) for p, mode, (kind, _)
                    in zip(per, modes, blocks(m, start, layers)))
    # cos, sin: rope / 2 each, over the rotated channels (model.partial_rotary_factor)
    rope = mla_layers.rope_width(m) if m.mla is not None else rotary_dim(m)
    if per_layer_shapes(m):  # one cos, sin per head dim (Gemma 4's two)
        rope = sum({layer_rank_shapes(s, m, cand.tp, i).hd for i in range(s.L)})
    # one cos/sin pair per distinct RoPE of the layers (model.layer_rope: Gemma 3's, MiMo's)
    ropes = 1 if per_layer_shapes(m) else max(1, len(
        {(a.rope_theta, repr(a.rope_scaling)) for a in layer_attention(m)
         if a.rope and a.token_mixer in ("attention", "mla", "compressed")}))
    embed = (s.B if reset_positions else 1) * (s.N // s.B) * rope * 4 * ropes + conv_taps
    if first:
        embed += 8 * s.N                                   # token ids (int64)
        embed += e if m.scale_embeddings else 0             # the sqrt(d) scalar
    else:  # Gemma 4's shared K/V and per-layer inputs received from the stage before
        embed += carried_bytes(m, cand.tp, s.N, e, start - 1)
    head = 0
    if last:
        head += router_losses_saved(m)                      # the routers' losses (MoE)
        head += norm_saved(s, e, m.norm, device)            # final norm
        head += head_streams_saved(s.N, s.d, e, m)          # its input's mHC collapse
        head += 4 * s.d if m.norm_offset else 0             # its fp32 (offset + w)
        # the fp32 softmax (tiled: loss and lse per token), labels, the ignore masks (and,
        # split over TP, the vocab range's)
        if tiled_loss:  # dx (N, d) and the fp32 dW (V/tp, d), made in forward (tiled_loss.py)
            head += s.N * s.d * e + 4 * s.V * s.d
        else:
            head += 4 * s.N * s.V + 8 * s.N + (3 if s.tp > 1 else 2) * s.N
    return Activations(per, embed, head)


def activation_bytes(m: ModelConfig, cand: Candidate, e: int, layers: int = None,
                     first: bool = True, last: bool = True, reset_positions: bool = False) -> int:
    """The total of ``activations`` (no memory options)."""
    return activations(m, cand, e, layers, first, last, reset_positions).total


# ------------------------------------------------------------------ pieces memory.py charges


def stage_layers(m: ModelConfig, pp: int, stage: int) -> int:
    """Blocks on pipeline stage `stage`: n_layers / pp, one more on the first n_layers % pp."""
    return m.n_layers // pp + (1 if stage < m.n_layers % pp else 0)


def mlp_params(m: ModelConfig, tp: int, ep: int = 1) -> int:
    """The MLP's parameters on a TP rank: its up (and gate) and down projections with
    their biases (the largest block's); a MoE's router, E/ep experts and shared expert."""
    return max(_block_numel(m, tp, "mlp.", kind=k, moe=moe) - _experts_off(m, tp, ep, moe)
               for k, moe in variants(m))


def head_params(m: ModelConfig, tp: int) -> int:
    """The output head (or the tied embedding) on a TP rank: V/tp rows of d."""
    return embedding_spec(m).numel(tp)


def ring_grad_bytes(ring_grad_dtype: str) -> int:
    """Bytes per element of the ring's travelling dK,dV: parallel.ring_grad_dtype's dtype
    as the ring defines it (ctxpar.context_parallel.ring.GRAD_DTYPES)."""
    from ..context_parallel.ring import GRAD_DTYPES
    return GRAD_DTYPES[ring_grad_dtype].itemsize
