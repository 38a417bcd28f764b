"""DeepSeek-V4's attention (model.compressed_attention), the token mixer of its three layer
types, as transformers' DeepseekV4Attention computes it:

    qr     q_a_norm(q_a_proj(x))                           the query bottleneck (B, T/cp, Rq)
    q      rope(rms(q_b_proj(qr)))                         (B, T/cp, H/tp, D), unweighted norm
    kv     rope(kv_norm(kv_proj(x)))                       one K = V head (B, T/cp, D)
    o      softmax over [the window's kv ; the layer's entries ; the head's sink] of q
    out    o_b_proj(o_a_proj(rope^-1(o) by head groups))   V's RoPE undone (K = V)

RoPE turns the last rotary_dim channels of a head in interleaved pairs, at the layer's
base: model.rope_theta on 'sliding_attention' layers (V4's "main"), model.layer_rope's on
the compressed ones (V4's "compress", also the entries' at w x m). The entries: none on
'sliding_attention'; 'heavily_compressed_attention' every complete window of m tokens
(ctxpar.context_parallel.compressed.hca_attention); 'compressed_sparse_attention' the
index_topk of the overlapping windows' entries its lightning indexer picks per query
(compressed_sparse.csa_attention). Over CP the window is the ring's halo, the entries
are made by the ranks ending their windows and all-gathered (compressor.py).

TP splits the query heads (q_b_proj and the sinks by rows, o_a_proj by whole groups of
heads, o_b_proj by columns); the bottleneck, the K = V head, the compressors and the
indexer are replicated: the compressors' inputs and parameters pass f (identity forward,
all-reduce backward) where the split heads read them, so each rank's replicated weights
get the whole gradient; the indexer runs identically on every TP rank, without gradient
(its top-k is discrete, as in transformers).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ctxpar.config import ModelConfig, rotary_dim
from ctxpar.config.sections import resolved_head_dim
from ctxpar.context_parallel import AttentionMask
from ctxpar.context_parallel.compressed import hca_attention
from ctxpar.context_parallel.compressed_sparse import csa_attention
from ctxpar.context_parallel.csa_indexer import IndexerInputs
from ctxpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                    copy_to_tensor_model_parallel_region)
from ctxpar.tensor_parallel.layers import set_tensor_model_parallel_attributes
from ctxpar.tensor_parallel.mappings import tp_size_of

from .norms import RMSNorm
from .options import LayerArgs
from .rope import rotary_cos_sin
from .token_mixer import TokenMixer


def rope_last_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, h, D) with its last r = 2 cos.shape[-1] channels turned in pairs
    (2i, 2i+1) by angle i (V4's interleaved RoPE on the trailing rope slice), fp32;
    cos, sin (..., T, r/2) broadcast over the heads."""
    r = 2 * cos.shape[-1]
    pairs = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    even, odd = pairs.unbind(-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat((x[..., :-r], turned.flatten(-2).to(x.dtype)), dim=-1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over each head, the rms in fp32 and cast back before the product
    (transformers' DeepseekV4UnweightedRMSNorm on the queries)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class GroupedLinear(nn.Module):
    """o_a_proj: each group of heads (B, T, g, n) -> (B, T, g, o_lora_rank) by its own
    block of weight (g x o_lora_rank, n), transformers' DeepseekV4GroupedLinear layout;
    split over TP by rows, i.e. by whole groups."""

    def __init__(self, n_in: int, rank: int, groups: int, tp: int, device=None, dtype=None):
        super().__init__()
        self.groups, self.rank = groups // tp, rank
        self.weight = nn.Parameter(torch.empty(self.groups * rank, n_in, device=device,
                                               dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, True, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, self.rank, -1)
        return torch.einsum("btgn,grn->btgr", x, w)


class Compressor(nn.Module):
    """A compressor's parameters (transformers' DeepseekV4HCACompressor; with overlap the
    two series of DeepseekV4CSACompressor and its indexer's): position_bias, kv_proj,
    gate_proj, kv_norm, replicated over TP. The windows themselves are
    ctxpar.context_parallel.compressor's."""

    def __init__(self, d: int, width: int, rate: int, overlap: bool, eps: float,
                 device=None, dtype=None):
        super().__init__()
        wide = 2 * width if overlap else width
        kw = dict(bias=False, device=device, dtype=dtype)
        self.rate = rate
        self.position_bias = nn.Parameter(torch.empty(rate, wide, device=device, dtype=dtype))
        self.kv_proj = nn.Linear(d, wide, **kw)
        self.gate_proj = nn.Linear(d, wide, **kw)
        self.kv_norm = RMSNorm(width, eps, device=device, dtype=dtype)  # its weight: the
        # core normalises the pooled entries itself (compressor.compress_windows)

    def inputs(self, x: torch.Tensor, tp_group) -> tuple:
        """(kv, gate, position_bias, norm weight) the core compresses, through f."""
        return tuple(copy_to_tensor_model_parallel_region(t, tp_group) for t in
                     (self.kv_proj(x), self.gate_proj(x), self.position_bias,
                      self.kv_norm.weight))


class Indexer(Compressor):
    """The CSA layers' lightning indexer (transformers' DeepseekV4Indexer): its own
    overlapping compressor at index_head_dim, its queries from the query bottleneck, its
    heads' weights (scorer.weights_proj); replicated over TP, no gradient reaches it."""

    def __init__(self, cfg: ModelConfig, d: int, device=None, dtype=None):
        ca = cfg.compressed_attention
        super().__init__(d, ca.index_head_dim, ca.rate("compressed_sparse_attention"), True,
                         cfg.norm_eps, device, dtype)
        kw = dict(bias=False, device=device, dtype=dtype)
        self.n_heads, self.head_dim = ca.index_n_heads, ca.index_head_dim
        self.q_b_proj = nn.Linear(ca.q_lora_rank, self.n_heads * self.head_dim, **kw)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(d, self.n_heads, **kw)

    def indexer_inputs(self, x, qr, cos, sin) -> IndexerInputs:
        B, T = x.shape[:2]
        q = rope_last_pairs(self.q_b_proj(qr).view(B, T, self.n_heads, self.head_dim),
                            cos, sin)
        weights = self.scorer.weights_proj(x).float() * self.n_heads ** -0.5
        return IndexerInputs(q, weights, self.kv_proj(x), self.gate_proj(x),
                             self.position_bias, self.kv_norm.weight)


class CompressedAttention(TokenMixer):
    """DeepSeek-V4's attention of one layer (module docstring); as a token mixer:
    project_in the projections and RoPE, mix the CP core of the layer's type, project_out
    the inverse RoPE and the grouped output projection. Under 'selective' recompute the
    Block replays project_in and project_out, never the core (its collectives)."""

    selective_recompute = True

    def __init__(self, cfg: ModelConfig, args: LayerArgs):
        super().__init__()
        ca, tp_group, layer = cfg.compressed_attention, args.tp_group, args.layer
        tp, d, h = tp_size_of(tp_group), cfg.d_model, cfg.n_heads
        kw = dict(device=args.device, dtype=args.dtype)
        lin = dict(tp_group=tp_group, bias=False, **kw)
        self.cp, self.backend, self.tp_group, self.layer = args.cp, args.backend, tp_group, layer
        self.kind, self.eps = layer.kind, cfg.norm_eps
        self.head_dim = hd = resolved_head_dim(cfg)
        self.n_heads, self.scale = h // tp, hd ** -0.5
        self.rotary_dim = rotary_dim(cfg)
        self.window, self.index_topk = cfg.sliding_window, ca.index_topk
        self.sinks = nn.Parameter(torch.empty(h // tp, **kw))
        set_tensor_model_parallel_attributes(self.sinks, True, dim=0)
        self.q_a_proj = nn.Linear(d, ca.q_lora_rank, bias=False, **kw)
        self.q_a_norm = RMSNorm(ca.q_lora_rank, cfg.norm_eps, **kw)
        self.q_b_proj = ColumnParallelLinear(ca.q_lora_rank, h * hd, **lin)
        self.kv_proj = nn.Linear(d, hd, bias=False, **kw)
        self.kv_norm = RMSNorm(hd, cfg.norm_eps, **kw)
        self.o_a_proj = GroupedLinear(h * hd // ca.o_groups, ca.o_lora_rank, ca.o_groups, tp,
                                      **kw)
        self.o_b_proj = RowParallelLinear(ca.o_groups * ca.o_lora_rank, d, **lin)
        self.compressor: Optional[Compressor] = None
        if self.kind != "sliding_attention":
            csa = self.kind == "compressed_sparse_attention"
            self.compressor = Compressor(d, hd, ca.rate(self.kind), csa, cfg.norm_eps, **kw)
            if csa:
                self.compressor.indexer = Indexer(cfg, d, **kw)

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "CompressedAttention":
        return cls(args.cfg, args)

    def project_in(self, x: torch.Tensor, cos, sin) -> Tuple[tuple, tuple]:
        """x (B, T/cp, d) -> ((q, kv, the compressor's inputs, the indexer's), (cos, sin))."""
        B, T = x.shape[:2]
        qr = self.q_a_norm(self.q_a_proj(x))                          # (B, T/cp, Rq)
        q = self.q_b_proj(qr).view(B, T, self.n_heads, self.head_dim)  # f on qr inside
        q = rope_last_pairs(unweighted_rms(q, self.eps), cos, sin)
        kv = rope_last_pairs(self.kv_norm(self.kv_proj(x)).unsqueeze(2), cos, sin)
        kv = copy_to_tensor_model_parallel_region(kv.squeeze(2), self.tp_group)  # f
        inputs = (q, kv)
        if self.compressor is not None:
            inputs += (self.compressor.inputs(x, self.tp_group),)
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is not None:  # no gradient: the top-k is discrete
                with torch.no_grad():
                    inputs += (indexer.indexer_inputs(x, qr, cos, sin),)
        return inputs, (cos, sin)

    def entry_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The entries' RoPE (B, n, d) at positions (n,) w x m: the layer's base."""
        cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.layer.rope_theta,
                                  self.layer.rope_scaling)
        return rope_last_pairs(x.unsqueeze(2), cos.to(x.dtype), sin.to(x.dtype)).squeeze(2)

    def mix(self, inputs: tuple, cu_seqlens=None, cache=None) -> torch.Tensor:
        """(B, T/cp, H/tp, D): the window (and the entries) with the sinks, over CP; with
        cu_seqlens (packed documents) the window, the entries and the indexer's choice stay
        inside each query's document (docs/parallelism.md's HCA and CSA rule), the entries
        turned at global positions (the layer is handed global ones: data.reset_positions
        is refused at load)."""
        if cache is not None:  # refused at load (config)
            raise ValueError(f"{self.kind}: DeepSeek-V4's attention is built for training "
                             "(no generation cache)")
        q, kv = inputs[:2]
        if self.compressor is None:
            k = kv.unsqueeze(2)                                        # (B, T/cp, 1, D)
            return self.cp.attention(q, k, k, backend=self.backend, softmax_scale=self.scale,
                                     mask=AttentionMask(causal=True,
                                                        sliding_window=self.window,
                                                        cu_seqlens=cu_seqlens,
                                                        sinks=self.sinks))
        kw = dict(sliding_window=self.window, compress_rate=self.compressor.rate,
                  entry_rope=self.entry_rope, cp_group=self.cp.cp_group,
                  layout=self.cp.layout, comm=self.cp.comm, norm_eps=self.eps,
                  softmax_scale=self.scale, backend=self.backend, cu_seqlens=cu_seqlens,
                  reset_positions=False)
        if self.kind == "heavily_compressed_attention":
            return hca_attention(q, kv, *inputs[2], self.sinks, **kw)
        return csa_attention(q, kv, *inputs[2], self.sinks, inputs[3],
                             index_topk=self.index_topk, **kw)

    def project_out(self, o: torch.Tensor, cos, sin) -> torch.Tensor:
        """o (B, T/cp, H/tp, D) -> (B, T/cp, d): V's RoPE undone, then the grouped output
        projection (o_a_proj per group of heads, o_b_proj over the groups)."""
        B, T = o.shape[:2]
        o = rope_last_pairs(o, cos, -sin)
        grouped = self.o_a_proj(o.reshape(B, T, self.o_a_proj.groups, -1))
        return self.o_b_proj(grouped.flatten(2))
