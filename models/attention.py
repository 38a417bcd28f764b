"""Causal self-attention over CP, the token mixer of attention layers: MHA and GQA (fewer kv
heads than query heads, replicated over TP when fewer than its ranks), per-head or
whole-projection q/k norms, RoPE (partial, or none), Qwen3.5's output gate, gpt-oss'
sinks; full causal, a sliding window or chunks by the layer's kind.

Shapes per rank: x (B, T/cp, d); q (B, T/cp, nh/tp, hd); k (B, T/cp, max(nkv/tp, 1), hd),
v the same with vd = model.v_head_dim channels (hd unless set).
Only the core talks over CP (ctxpar.context_parallel: the pattern of parallel.cp_comm),
only the projections over TP (column-parallel q/k/v, row-parallel out).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

import torch.nn.functional as F

from ctxpar.config import ModelConfig, rotary_dim, softmax_scale
from ctxpar.config.attention_heads import sinks_on
from ctxpar.config.layers import LayerAttention, layer_attention
from ctxpar.config.parameters import (kv_heads_per_rank, layer_head_dim, layer_kv_heads,
                                      layer_v_head_dim)
from ctxpar.context_parallel import AttentionMask, ContextParallel
from ctxpar.context_parallel.expansion import FunctionExpansion
from ctxpar.tensor_parallel import (ColumnParallelLinear, ReplicatedHeadLinear,
                                    RowParallelLinear, copy_to_tensor_model_parallel_region)
from ctxpar.tensor_parallel.layers import set_tensor_model_parallel_attributes
from ctxpar.tensor_parallel.mappings import tp_size_of

from .norms import RMSNorm, l2_norm, rms_norm
from .options import LayerArgs
from .qk_norm import AllHeadsRMSNorm
from .rope import apply_rotary, layer_rotary
from .token_mixer import TokenMixer


class Attention(TokenMixer):
    """Causal GQA self-attention: column-parallel q/k/v (with biases under model.bias or
    model.attention_bias), per-head q/k RMSNorm (model.qk_norm), RoPE, CP attention,
    row-parallel out. The q/k norms act within a head, so TP's split by heads keeps them
    exact; their (hd,) weights are replicated.

    `layer` is this layer's kind (ctxpar.config.layers): full causal, a sliding window or
    chunks; with model.attention_sinks a learned logit per query head (``sinks``, split
    over TP with the heads) joins every softmax. The layer's K/V heads and sinks are its
    type's (model.layer_kv_heads, attention_sinks: config.attention_heads); the values
    are v_head_dim wide, times model.attention_value_scale.

    As a token mixer (models/token_mixer.py): project_in is qkv, mix the CP attention
    (core, or generation's KV cache around it), project_out the gate and o_proj (out);
    under 'selective' the Block recomputes the first and the last, never the core.

    Gemma 4 (config/kv_layers.py): a layer's own head dim and kv heads; under k_eq_v no
    v_proj, V = value_norm(k_proj x), and under CP k_proj x alone on the wire (K and V made
    where it arrives: expanded_core); under model.num_kv_shared_layers a consumer layer has
    q_proj, q_norm and o_proj only and attends (mix) with the K/V its producer's mix kept:
    never recomputed, and under CP the tensors its producer's ranks hold (under Ulysses
    regrouped by heads, under the all-gather gathered, once: the consumer sends no K/V)."""

    selective_recompute = True

    def __init__(self, cfg: ModelConfig, tp_group, cp: ContextParallel, backend: str,
                 device=None, dtype=None, layer: Optional[LayerAttention] = None):
        super().__init__()
        tp = tp_size_of(tp_group)
        self.tp_group, self.cp, self.backend = tp_group, cp, backend
        self.layer = a = layer or layer_attention(cfg)[0]
        # its type's K/V heads: model.layer_kv_heads (MiMo), global_n_kv_heads (Gemma 4)
        n_kv = layer_kv_heads(cfg, a)
        self.sinks = None
        if sinks_on(cfg, a.kind):  # (nh/tp,): this rank's heads' sink logits (its type's)
            self.sinks = nn.Parameter(torch.empty(cfg.n_heads // tp, device=device,
                                                  dtype=dtype))
            set_tensor_model_parallel_attributes(self.sinks, True, dim=0)
        self.head_dim = layer_head_dim(cfg, a)  # model.global_head_dim likewise
        self.scale = softmax_scale(cfg)
        self.n_heads = cfg.n_heads // tp  # query heads on this rank
        self.n_kv_heads = kv_heads_per_rank(cfg, tp, n_kv)
        self.v_head_dim = layer_v_head_dim(cfg, a)  # model.v_head_dim, else hd
        self.value_scale = cfg.attention_value_scale
        # model.num_kv_shared_layers: a consumer attends with its producer's K/V (set by the
        # GPT: kv_producer a 1-tuple, not a submodule); a producer keeps its last in shared_kv
        self.kv_producer, self.keeps_shared_kv, self.shared_kv = None, False, None
        self.held_kv = None  # under Ulysses / all-gather: its K/V as exchanged, kept too
        # k_eq_v under CP (set_sequence_rotary): the whole sequence's (cos, sin), and the
        # expansion of k_proj x on the wire its mix makes (consumers use the producer's)
        self.sequence_rotary, self.expansion = None, None
        self.k_eq_v = a.k_eq_v  # values from k_proj (model.attention_k_eq_v)
        self.v_eps = cfg.norm_eps if cfg.value_norm else None
        lin = dict(tp_group=tp_group, bias=cfg.bias or cfg.attention_bias, device=device,
                   dtype=dtype)
        d, hd, vd = cfg.d_model, self.head_dim, self.v_head_dim
        self.gated = cfg.attention_output_gate  # q_proj's rows per head: [q | gate]
        self.rope = self.layer.rope  # model.rope, not a model.nope_layers one
        self.l2_eps = cfg.norm_eps if cfg.qk_l2_norm and self.rope else None
        self.rotary_dim = a.head_dim or rotary_dim(cfg)
        self.q_proj = ColumnParallelLinear(d, cfg.n_heads * hd * (2 if self.gated else 1),
                                           copy_input=False, **lin)
        own_kv = a.kv_source is None
        # fewer kv heads than TP ranks: each rank uses the kv head of its query heads
        kv = (lambda w: ColumnParallelLinear(d, n_kv * w, copy_input=False, **lin)) \
            if n_kv % tp == 0 else (lambda w: ReplicatedHeadLinear(d, n_kv * w, n_kv, **lin))
        self.k_proj = kv(hd) if own_kv else None
        self.v_proj = kv(vd) if own_kv and not self.k_eq_v else None
        self.o_proj = RowParallelLinear(cfg.n_heads * vd, d, **{**lin, "bias": cfg.bias})
        self.q_norm, self.k_norm = qk_norms(cfg, hd, n_kv, tp_group, device, dtype)
        if not own_kv:
            self.k_norm = None

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "Attention":
        return cls(args.cfg, args.tp_group, args.cp, args.backend, args.device, args.dtype,
                   args.layer)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v, gate): gate (B, T/cp, nh/tp * hd) under model.attention_output_gate,
        else None."""
        B, T = x.shape[:2]  # T here is T/cp
        x = copy_to_tensor_model_parallel_region(x, self.tp_group)  # f once for q, k, v
        q, gate = self.q_proj(x), None
        if self.gated:  # (B, T/cp, nh/tp, 2 hd): each head's query, then its gate
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.n_heads * self.head_dim)
        q = q.reshape(B, T, self.n_heads, self.head_dim)  # (B, T/cp, nh/tp, hd)
        q = self.queries(q, cos, sin)
        if self.kv_producer is not None:  # K/V are the producer's (mix reads them)
            return q, None, None, gate
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T/cp, nkv/tp, hd)
        if self.sequence_rotary is not None:  # k_eq_v: k_proj x alone on the wire (mix)
            return q, k, None, gate
        v = k if self.k_eq_v else self.v_proj(x).view(B, T, self.n_kv_heads, self.v_head_dim)
        return (q, *self.keys_values(k, v, cos, sin), gate)

    def queries(self, q: torch.Tensor, cos, sin) -> torch.Tensor:
        """q (B, T/cp, nh/tp, hd) normed and turned as the keys are (keys_values)."""
        if isinstance(self.q_norm, AllHeadsRMSNorm):  # over the whole projection
            q = self.q_norm(q.flatten(2)).view_as(q)
        elif self.q_norm is not None:  # over each head's hd channels
            q = self.q_norm(q)
        if not self.rope:  # NoPE: the order is the mask's alone
            if self.layer.temperature is not None:  # cos is the query scale (..., T/cp)
                q = (q * cos[..., None, None]).to(q.dtype)
            return q
        q = apply_rotary(q, cos, sin)
        return q if self.l2_eps is None else l2_norm(q, self.l2_eps)

    def keys_values(self, k, v, cos, sin, k_norm_weight=None):
        """(K, V) from the projections k (B, L, h, hd), v (B, L, h, vd) and the rows' RoPE
        (cos, sin): where they are made, or where k_proj x arrives under k_eq_v (then with
        k_norm's weight already through TP's f, expand_keys_values)."""
        if self.v_eps is not None:  # Gemma 4's weightless value norm
            v = l2_norm(v, self.v_eps)
        if self.value_scale != 1.0:  # MiMo-V2-Flash's attention_value_scale
            v = v * self.value_scale
        if isinstance(self.k_norm, AllHeadsRMSNorm):  # over the whole projection
            k = self.k_norm(k.flatten(2)).view_as(k)
        elif k_norm_weight is not None:
            k = rms_norm(k, k_norm_weight, self.k_norm.eps, self.k_norm.offset)
        elif self.k_norm is not None:  # over each head's hd channels
            k = self.k_norm(k)
        if not self.rope:
            return k, v
        k = apply_rotary(k, cos, sin)
        return (k if self.l2_eps is None else l2_norm(k, self.l2_eps)), v

    def expand_keys_values(self, raw, index, *k_norm_weight):
        """The k_eq_v expansion (ctxpar's expansion.FunctionExpansion): raw k_proj rows
        (B, L, h, hd) at sequence places index (L,) -> (K, V), RoPE'd at the whole
        sequence's positions (sequence_rotary, set by the GPT for the forward)."""
        cos = sin = None
        if self.rope:
            cos, sin = (t.index_select(-2, index) for t in self.sequence_rotary)
        return self.keys_values(raw, raw, cos, sin, *k_norm_weight)

    def out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """o (B, T/cp, nh/tp, vd) -> o_proj(o * sigmoid(gate)) (B, T/cp, d)."""
        o = o.flatten(2)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def project_in(self, x: torch.Tensor, cos, sin) -> Tuple[tuple, tuple]:
        q, k, v, gate = self.qkv(x, cos, sin)
        return (q, k, v), (gate,)

    def mix(self, inputs: tuple, cu_seqlens=None, cache=None) -> torch.Tensor:
        if cache is None and (self.kv_producer or (self,))[0].sequence_rotary is not None:
            return self.expanded_core(inputs[0], inputs[1], cu_seqlens)
        held = None
        if self.kv_producer is not None:  # the producer's K/V of this forward, never recomputed
            inputs = (inputs[0], *self.kv_producer[0].shared_kv)
            held = self.kv_producer[0].held_kv  # Ulysses, all-gather: never re-sent either
        elif self.keeps_shared_kv:
            self.shared_kv = inputs[1:]  # (k, v), held until the next forward
            # exchanged once (Ulysses: by heads; all-gather: gathered), for itself and its
            # consumers (same widths only: a narrower V travels padded, core)
            self.held_kv = held = self.cp.held_kv(*inputs[1:], self.mask(cu_seqlens)) \
                if cache is None and inputs[1].shape[-1] == inputs[2].shape[-1] else None
        if cache is not None:  # generation: the cache keeps k, v and runs the core or decodes
            return cache(*inputs, self.core, self.mask())
        return self.core(*inputs, cu_seqlens, held)  # (B, T/cp, nh/tp, hd)

    def project_out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        return self.out(o, gate)

    def expanded_core(self, q, raw, cu_seqlens=None) -> torch.Tensor:
        """k_eq_v under CP: k_proj x (B, T/cp, nkv/tp, hd) travels alone, K and V made where
        it arrives (cp.expanded_attention); a consumer attends with its producer's raw
        rows and expansion (under Ulysses those already regrouped by heads)."""
        if self.kv_producer is not None:
            producer = self.kv_producer[0]
            raw, held = producer.shared_kv[0], producer.held_kv
        else:
            weight = () if self.k_norm is None else \
                (copy_to_tensor_model_parallel_region(self.k_norm.weight, self.tp_group),)
            self.expansion = FunctionExpansion(self.expand_keys_values, weight, self.head_dim)
            held = None
            if self.keeps_shared_kv:  # held for the consumers until the next forward
                self.shared_kv, self.held_kv = (raw,), self.cp.held_latent(raw)
                held = self.held_kv
        expansion = (self.kv_producer or (self,))[0].expansion
        return self.cp.expanded_attention(q, raw, expansion, backend=self.backend,
                                          softmax_scale=self.scale,
                                          mask=self.mask(cu_seqlens), held_latent=held)

    def mask(self, cu_seqlens=None) -> AttentionMask:
        """What this layer's queries see: causal by the layout's global positions, inside
        the layer's window or chunk, inside each document of cu_seqlens (per-sample
        boundaries of the full sequence), with the sinks' extra logit."""
        return AttentionMask(causal=True, sliding_window=self.layer.sliding_window,
                             chunk_size=self.layer.chunk_size, cu_seqlens=cu_seqlens,
                             sinks=self.sinks)

    def core(self, q, k, v, cu_seqlens=None, held_kv=None) -> torch.Tensor:
        # Exact attention over the whole sequence through cp.comm's pattern. Values
        # narrower than the keys travel zero-padded to hd (the patterns move K and V as
        # one block): the padding's output columns are zeros, dropped here. held_kv:
        # K,V already exchanged (Ulysses' by heads, all-gather's slots: a shared K/V's, mix).
        vd = v.shape[-1]
        if vd != q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - vd))
        o = self.cp.attention(q, k, v, backend=self.backend, softmax_scale=self.scale,
                              mask=self.mask(cu_seqlens),
                              held_kv=held_kv)  # (B, T/cp, nh/tp, hd)
        return o[..., :vd]  # (B, T/cp, nh/tp, vd)


def set_sequence_rotary(layers, attention: list, positions, cp, head_dim: int) -> None:
    """Before a training forward under CP: each k_eq_v layer making its own K/V (and so its
    consumers) sends k_proj x alone, and makes K where it arrives with the RoPE of the
    sender's tokens: the whole sequence's (cos, sin) from its positions (gathered once, 8
    bytes a token; documents' restarted positions alike), one pair per distinct RoPE that
    the layers share (layer_rotary: T x the rotary channels, fp32, held until the next
    forward). None when cp is one rank, for generation (the KV cache keeps K and V) and for
    whole-projection k norms (TP's all-reduce inside)."""
    expanding = []
    for block, a in zip(layers, attention):
        mixer = getattr(block, "mixer", None)
        if not isinstance(mixer, Attention):
            continue
        mixer.sequence_rotary = None
        if positions is None or not a.k_eq_v or a.kv_source is not None \
                or isinstance(mixer.k_norm, AllHeadsRMSNorm) or cp.size == 1:
            continue
        mixer.sequence_rotary = (None, None)  # a NoPE layer's
        if a.rope:
            expanding.append((mixer, a))
    if expanding:
        full = cp.gather_positions(positions)  # (T,) or (B, T)
        rotary = layer_rotary(full, head_dim, [a for _, a in expanding])
        for (mixer, _), cos_sin in zip(expanding, rotary):
            mixer.sequence_rotary = cos_sin


def link_shared_kv(layers, attention: list) -> None:
    """model.num_kv_shared_layers: hand each consumer block's attention its producer's
    (LayerAttention.kv_source), which then keeps its K/V for it."""
    for block, a in zip(layers, attention):
        if a.kv_source is not None:
            producer = layers[a.kv_source].mixer
            producer.keeps_shared_kv = True
            block.mixer.kv_producer = (producer,)  # a tuple: not registered as a submodule


def qk_norms(cfg: ModelConfig, hd: int, n_kv: int, tp_group, device, dtype):
    """(q_norm, k_norm) under model.qk_norm: per head, (hd,) weights replicated over TP;
    or over the whole projections (model.qk_norm_scope='all_heads', models/qk_norm.py)."""
    if not cfg.qk_norm:
        return None, None
    if cfg.qk_norm_scope == "all_heads":
        kw = dict(eps=cfg.norm_eps, tp_group=tp_group, device=device, dtype=dtype)
        return (AllHeadsRMSNorm(cfg.n_heads * hd, **kw), AllHeadsRMSNorm(n_kv * hd, **kw))
    kw = dict(eps=cfg.norm_eps, offset=cfg.norm_offset, tp_group=tp_group, device=device,
              dtype=dtype)
    return RMSNorm(hd, **kw), RMSNorm(hd, **kw)
