"""A GPT decoder for TP x CP x DP: pre-norm blocks, RoPE on global positions, GQA attention over CP.

Shapes per rank: B micro-batch, T full sequence, cp/tp degrees, nh/nkv query/kv heads,
hd head dim, V vocabulary. Each CP rank holds T/cp tokens in the CP layout's order
(zigzag, striped, contiguous) with their global positions (``ctxpar.sequence_positions``);
each TP rank holds nh/tp query heads, max(nkv/tp, 1) kv heads, ffn/tp MLP columns and V/tp
vocabulary rows (docs/parallelism.md). Everything but attention is token-local, so only
attention talks over CP (ring, all-gather, Ulysses or hybrid: ``cp_comm``) and only the
f/g ops talk over TP.

    model = GPT.from_config(cfg, state)   # or GPT(cfg.model, ModelGroups(...), ModelOptions(...))
    logits = model(tokens, positions)             # (B, T/cp, V/tp), vocab-parallel
    loss_sum = model(tokens, positions, labels)   # fp32 sum of this rank's token losses
"""
from __future__ import annotations

import math
import zlib
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ctxpar.config import (CHECKPOINT_MODES, Config, MemoryConfig, ModelConfig,
                           resolved_head_dim, rotary_dim, softmax_scale)
from ctxpar.tensor_parallel import (
    ColumnParallelLinear,
    ReplicatedHeadLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    full_shape,
    parallel_lm_logits,
    shard_full_tensor,
    vocab_parallel_cross_entropy,
)
from ctxpar.config.layers import LayerAttention, layer_attention
from ctxpar.config.moe import moe_layer_indices
from ctxpar.moe import RouterStats
from ctxpar.config.parameters import check_parameters, kv_heads_per_rank
from ctxpar.context_parallel import AttentionMask, ContextParallel
from ctxpar.tensor_parallel.layers import set_tensor_model_parallel_attributes
from ctxpar.memory.tiled_loss import tiled_vocab_parallel_cross_entropy
from ctxpar.memory.offload import ActivationOffload, run_layer
from ctxpar.tensor_parallel.mappings import tp_size_of

from .gated_delta import GatedDeltaNet, init_gated_delta
from .mamba2 import Mamba2, init_mamba2
from .mlp import MLP
from .moe import MoE
from .options import ModelGroups, ModelOptions
from .qk_norm import AllHeadsRMSNorm


def check_checkpoint_mode(mode: str) -> None:
    """For models built without a Config (which checks it at load)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} must be one of {CHECKPOINT_MODES}")


def context_parallel_of(cp_comm: str, cp_group, ulysses_group, ring_group,
                        layout: str, ring_grad_dtype: str = "fp32") -> ContextParallel:
    """The model's CP attention; refuses groups left at None in a distributed run, where the
    functional API would read them as the whole world: a model's CP group is never the
    world when DP, TP or PP ranks share it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        need = ("ulysses_group", "ring_group") if cp_comm == "hybrid" else ("cp_group",)
        given = dict(cp_group=cp_group, ulysses_group=ulysses_group, ring_group=ring_group)
        missing = [n for n in need if given[n] is None]
        if missing:
            raise ValueError(f"GPT: pass {' and '.join(missing)} (e.g. a ParallelState's) for "
                             f"cp_comm={cp_comm!r} when torch.distributed is initialised")
    return ContextParallel(cp_comm, cp_group, ulysses_group, ring_group, layout,
                           ring_grad_dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w) over the last dim: offset 0 is torch's RMSNorm, offset 1
    Gemma's (its weights stored as w - 1; computed in fp32 and cast back, as transformers
    does). tp_group: the norm acts on a TP rank's share of heads (model.qk_norm) with the
    weight replicated, so its gradient is summed over TP (f on the weight)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, tp_group=None,
                 device=None, dtype=None):
        super().__init__()
        self.eps, self.offset, self.tp_group = eps, offset, tp_group
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = copy_to_tensor_model_parallel_region(self.weight, self.tp_group)
        if not self.offset:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + w.float())).type_as(x)


def make_norm(cfg: ModelConfig, device=None, dtype=None) -> nn.Module:
    """A norm over d_model: Apex's fused norm when apex is importable (GPU builds), else
    torch's; RMSNorm with model.norm_offset != 0 is ours (RMSNorm)."""
    dim = cfg.d_model
    kw = dict(eps=cfg.norm_eps, device=device, dtype=dtype)
    if cfg.norm == "rmsnorm" and cfg.norm_offset:
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_offset, device=device, dtype=dtype)
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError:
        if cfg.norm == "rmsnorm":
            return nn.RMSNorm(dim, **kw)
        return nn.LayerNorm(dim, bias=cfg.bias, **kw)
    if cfg.norm == "rmsnorm":
        return FusedRMSNorm(dim, eps=cfg.norm_eps).to(device=device, dtype=dtype)
    return FusedLayerNorm(dim, eps=cfg.norm_eps).to(device=device, dtype=dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None,
                  device=None) -> torch.Tensor:
    """RoPE's frequencies theta^(-2i/hd), i < hd/2, fp32, after an optional scaling rule.

    linear: all divided by factor (positions interpolated). llama3 (Llama 3.1): wavelengths
    2*pi/f above original_max_position_embeddings/low_freq_factor are divided by factor,
    below .../high_freq_factor kept, in between blended linearly in
    original_max_position_embeddings/wavelength. yarn: ``yarn_inv_freq``. Same rules as
    Hugging Face's modeling_rope_utils (tests/test_hf.py checks the frequencies against it).
    """
    kind = (scaling or {}).get("rope_type")
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling, device)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device,
                                       dtype=torch.float32) / head_dim)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)  # 0 at the low end, 1 at the high end
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(wavelen > old / low, inv_freq / factor,
                           torch.where(wavelen < old / high, inv_freq, blended))
    assert kind is None, f"rope_scaling {scaling} (config validation lets none other through)"
    return inv_freq


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict, device=None) -> torch.Tensor:
    """YaRN (Peng et al.): frequencies that turn fewer than beta_slow times over
    original_max_position_embeddings are interpolated (divided by factor), those that turn
    more than beta_fast times kept, a linear ramp over the dimensions in between; written
    as modeling_rope_utils' _compute_yarn_parameters computes it, operation for operation."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension that turns `rotations` times over `old`
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # 1: extrapolate (kept), 0: interpolate (divided by factor)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device,
                                       dtype=torch.float32) / head_dim)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's attention factor (given, or
    0.1 ln(factor) + 1, or DeepSeek's ratio of mscale to mscale_all_dim), as
    modeling_rope_utils computes it."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(factor, m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   scaling: Optional[dict] = None):
    """cos, sin of p * f_i (rope_inv_freq), fp32, times rope_attention_factor:
    positions (..., T/cp) -> (..., T/cp, hd/2)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # fp32 even under bf16
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        return angles.cos() * factor, angles.sin() * factor
    return angles.cos(), angles.sin()


def layer_rotary(positions: torch.Tensor, head_dim: int, layers):
    """Each layer's (cos, sin) (rotary_cos_sin), computed once per distinct RoPE
    (rope_theta, rope_scaling) among `layers` (LayerAttention: Gemma 3's local and global
    layers rotate by different bases); layers that share one share the tensors."""
    made, out = {}, []
    for a in layers:
        key = (a.rope_theta, repr(a.rope_scaling))
        if key not in made:
            made[key] = rotary_cos_sin(positions, head_dim, a.rope_theta, a.rope_scaling)
        out.append(made[key])
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + r/2) of the first r = 2 cos.shape[-1] channels of each
    head by the angle (GPT-NeoX/Llama 'rotate half'; r < hd: model.partial_rotary_factor,
    the rest unrotated)."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., :r].float().chunk(2, dim=-1)  # (B, T/cp, h, r/2) each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
    return turned if r == x.shape[-1] else torch.cat([turned, x[..., r:]], dim=-1)


def embed_tokens(embed: nn.Module, tokens: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The input embedding (B, T/cp) -> (B, T/cp, d), times sqrt(d_model) under
    model.scale_embeddings (Gemma: the scale in fp32, then rounded to the activations'
    dtype, as transformers does)."""
    x = embed(tokens)
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.d_model ** 0.5).to(device=x.device, dtype=x.dtype)
    return x


def block_recomputed(mode: str, i: int, every_n_layers: int) -> bool:
    """Whether block i is checkpointed whole (replayed in backward) under a checkpointing mode."""
    return mode == "full" or (mode == "every_n_layers" and i % every_n_layers == 0)


@torch.no_grad()
def init_parameters_(named_parameters, cfg: ModelConfig, seed: int, tp_group) -> None:
    """Draw each full-size parameter from its own generator (seed, crc32 of its name),
    then keep this rank's TP slice: the same model for every tp, cp, pp, dp and layout.

    Names are GPT's (``layers.3.attn.q_proj.weight``); the pipelined model passes its
    parameters under those names too. Normal(0, init_std) for weights, scaled by
    1/sqrt(2*n_layers) on the projections into the residual stream (GPT-2); norm weights
    such that the norm scales by 1 (ones, or zeros under model.norm_offset=1); zeros for
    biases.
    """
    tp = tp_size_of(tp_group)
    for name, p in named_parameters:
        shape = full_shape(p, tp)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        for rule in (init_gated_delta, init_mamba2, init_default):  # the mixers' own first
            full = rule(name, shape, cfg, g)
            if full is not None:
                break
        p.copy_(shard_full_tensor(full, p, tp_group))


def init_default(name: str, shape, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Every parameter the linear mixers' rules leave: norm weights, biases, matrices."""
    if name.endswith("norm.weight"):
        return torch.full(shape, 1.0 - cfg.norm_offset)
    if name.endswith("bias"):
        return torch.zeros(shape)
    scale = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(
        ("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")) \
        else cfg.init_std
    return torch.empty(shape).normal_(0.0, scale, generator=g)


class Attention(nn.Module):
    """Causal GQA self-attention: column-parallel q/k/v (with biases under model.bias or
    model.attention_bias), per-head q/k RMSNorm (model.qk_norm), RoPE, CP attention,
    row-parallel out. The q/k norms act within a head, so TP's split by heads keeps them
    exact; their (hd,) weights are replicated.

    `layer` is this layer's kind (ctxpar.config.layers): full causal, a sliding window or
    chunks; with model.attention_sinks a learned logit per query head (``sinks``, split
    over TP with the heads) joins every softmax."""

    def __init__(self, cfg: ModelConfig, tp_group, cp: ContextParallel, backend: str,
                 device=None, dtype=None, layer: Optional[LayerAttention] = None):
        super().__init__()
        tp = tp_size_of(tp_group)
        n_kv = cfg.n_kv_heads or cfg.n_heads
        self.tp_group, self.cp, self.backend = tp_group, cp, backend
        self.layer = layer or layer_attention(cfg)[0]
        self.sinks = None
        if cfg.attention_sinks:  # (nh/tp,): this rank's heads' sink logits
            self.sinks = nn.Parameter(torch.empty(cfg.n_heads // tp, device=device,
                                                  dtype=dtype))
            set_tensor_model_parallel_attributes(self.sinks, True, dim=0)
        self.head_dim = resolved_head_dim(cfg)
        self.scale = softmax_scale(cfg)
        self.n_heads = cfg.n_heads // tp  # query heads on this rank
        self.n_kv_heads = kv_heads_per_rank(cfg, tp)
        lin = dict(tp_group=tp_group, bias=cfg.bias or cfg.attention_bias, device=device,
                   dtype=dtype)
        d, hd = cfg.d_model, self.head_dim
        self.gated = cfg.attention_output_gate  # q_proj's rows per head: [q | gate]
        self.rope = cfg.rope
        self.rotary_dim = rotary_dim(cfg)
        self.q_proj = ColumnParallelLinear(d, cfg.n_heads * hd * (2 if self.gated else 1),
                                           copy_input=False, **lin)
        if n_kv % tp == 0:
            self.k_proj = ColumnParallelLinear(d, n_kv * hd, copy_input=False, **lin)
            self.v_proj = ColumnParallelLinear(d, n_kv * hd, copy_input=False, **lin)
        else:  # fewer kv heads than TP ranks: each rank uses the kv head of its query heads
            self.k_proj = ReplicatedHeadLinear(d, n_kv * hd, n_kv, **lin)
            self.v_proj = ReplicatedHeadLinear(d, n_kv * hd, n_kv, **lin)
        self.o_proj = RowParallelLinear(cfg.n_heads * hd, d, **{**lin, "bias": cfg.bias})
        self.q_norm, self.k_norm = qk_norms(cfg, hd, n_kv, tp_group, device, dtype)

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
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T/cp, nkv/tp, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if isinstance(self.q_norm, AllHeadsRMSNorm):  # over the whole projection
            q = self.q_norm(q.flatten(2)).view_as(q)
            k = self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:  # over each head's hd channels
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.rope:  # NoPE (model.rope=false): the order is the mask's alone
            return q, k, v, gate
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, gate

    def out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """o (B, T/cp, nh/tp, hd) -> o_proj(o * sigmoid(gate)) (B, T/cp, d)."""
        o = o.flatten(2)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def mask(self, cu_seqlens=None) -> AttentionMask:
        """What this layer's queries see: causal by the layout's global positions, inside
        the layer's window or chunk, inside each document of cu_seqlens (per-sample
        boundaries of the full sequence), with the sinks' extra logit."""
        return AttentionMask(causal=True, sliding_window=self.layer.sliding_window,
                             chunk_size=self.layer.chunk_size, cu_seqlens=cu_seqlens,
                             sinks=self.sinks)

    def core(self, q, k, v, cu_seqlens=None) -> torch.Tensor:
        # Exact attention over the whole sequence through cp.comm's pattern.
        return self.cp.attention(q, k, v, backend=self.backend, softmax_scale=self.scale,
                                 mask=self.mask(cu_seqlens))  # (B, T/cp, nh/tp, hd)


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


# Each token mixer's submodule name (Hugging Face's: layers.N.attn / linear_attn / mamba).
MIXER_MODULES = {"attention": "attn", "gated_delta": "linear_attn", "mamba2": "mamba"}


class Block(nn.Module):
    """One layer, its two mixers chosen once from its type (config.layers.LAYER_MIXERS):
    x + mixer(norm(x)), then x + mlp(norm(x)); with model.post_norms
    x + norm(mixer(norm(x))), then x + norm(mlp(norm(x))) (Gemma 2/3); in a layer type of
    model.reordered_norms x + norm(mixer(x)), then x + norm(mlp(x)) (OLMo 2). The token mixer is
    attention (``attn``), Gated DeltaNet (``linear_attn``, models/gated_delta.py) or Mamba2
    (``mamba``, models/mamba2.py), after ``attn_norm``; Nemotron-H's single-op blocks have
    no MLP ('mamba', 'attention') or no token mixer ('mlp').

    ``selective`` (attention blocks) checkpoints the two pieces around the attention core
    (norm + q/k/v + RoPE; out-proj + residual + norm + MLP) and keeps q, k, v, the
    attention output and its LSE (saved by the CP attention itself), so backward
    recomputes projections but never replays the CP communication; other blocks keep
    their activations under it.
    """

    def __init__(self, cfg: ModelConfig, tp_group, cp: ContextParallel, backend,
                 selective: bool, device=None, dtype=None,
                 memory: Optional[MemoryConfig] = None, layer: Optional[LayerAttention] = None,
                 linear_cp: str = "state", moe: bool = False, ep_group=None):
        super().__init__()
        layer = layer or layer_attention(cfg)[0]
        self.token_mixer, channel = layer.token_mixer, layer.channel_mixer
        self.selective = selective and self.token_mixer == "attention"
        # model.reordered_norms (OLMo 2): the mixers' outputs normed, not their inputs
        reordered = layer.kind in (cfg.reordered_norms or ())
        post = cfg.post_norms or reordered
        self.attn_norm = make_norm(cfg, device, dtype) if self.token_mixer and not \
            reordered else None
        if self.token_mixer == "attention":
            self.attn = Attention(cfg, tp_group, cp, backend, device, dtype, layer)
        elif self.token_mixer == "gated_delta":
            self.linear_attn = GatedDeltaNet(cfg, cp, linear_cp, tp_group, device, dtype)
        elif self.token_mixer == "mamba2":
            self.mamba = Mamba2(cfg, cp, linear_cp, tp_group, device, dtype)
        self.post_attn_norm = (make_norm(cfg, device, dtype)
                               if post and self.token_mixer else None)
        self.mlp_norm = make_norm(cfg, device, dtype) if channel and not reordered else None
        tiled = memory is not None and memory.tiled_mlp
        if channel and moe:  # a mixture of experts in the MLP's place (models/moe.py)
            self.mlp = MoE(cfg, tp_group, ep_group, device, dtype)
        else:
            self.mlp = MLP(cfg, tp_group, device, dtype, tile_tokens=memory.mlp_tile_tokens
                           if tiled else None) if channel else None
        self.post_mlp_norm = make_norm(cfg, device, dtype) if post and channel else None

    @property
    def mixer(self) -> Optional[nn.Module]:
        """The token mixer's module (attn, linear_attn or mamba); None in an MLP-only block."""
        return getattr(self, MIXER_MODULES[self.token_mixer]) if self.token_mixer else None

    def use_cp(self, cp: ContextParallel) -> None:
        """Run the token mixer over another CP group (GPT.use_cp_group)."""
        if self.mixer is not None:
            self.mixer.cp = cp

    def _in_norm(self, norm, x):
        return x if norm is None else norm(x)  # None: model.reordered_norms' block

    def _attn_in(self, x, cos, sin):
        return self.attn.qkv(self._in_norm(self.attn_norm, x), cos, sin)

    def _attn_out_mlp(self, x, o, gate=None):
        a = self.attn.out(o, gate)  # (B, T/cp, d)
        return self._mlp(x + (a if self.post_attn_norm is None else self.post_attn_norm(a)))

    def _mlp(self, x):
        if self.mlp is None:
            return x
        h = self.mlp(self._in_norm(self.mlp_norm, x))
        return x + (h if self.post_mlp_norm is None else self.post_mlp_norm(h))

    def _linear_mixer(self, x, cu_seqlens, cache=None):
        """x + linear_attn / mamba (norm(x)), over CP with its documents; cache: its
        LinearLayerCache in generation (ctxpar.inference)."""
        a = self.mixer(self._in_norm(self.attn_norm, x), cu_seqlens, cache)  # (B, T/cp, d)
        return x + (a if self.post_attn_norm is None else self.post_attn_norm(a))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache=None, cu_seqlens=None) -> torch.Tensor:
        """kv_cache: this layer's view of a KV cache (ctxpar.inference), inference only: it
        keeps k, v and computes attention from the cache, given the training core to use
        (a linear layer's: its LinearLayerCache, state and conv window).
        cu_seqlens: document boundaries (context_parallel/documents.py), training only."""
        if self.token_mixer != "attention":
            if self.token_mixer is not None:
                x = self._linear_mixer(x, cu_seqlens, kv_cache)
            return self._mlp(x)
        if kv_cache is not None:
            q, k, v, gate = self._attn_in(x, cos, sin)
            return self._attn_out_mlp(x, kv_cache(q, k, v, self.attn.core,
                                                  self.attn.mask()), gate)
        if self.selective:  # recompute around the core; the core keeps its own saved tensors
            q, k, v, gate = checkpoint(self._attn_in, x, cos, sin, use_reentrant=False)
            o = self.attn.core(q, k, v, cu_seqlens)
            return checkpoint(self._attn_out_mlp, x, o, gate, use_reentrant=False)
        q, k, v, gate = self._attn_in(x, cos, sin)
        return self._attn_out_mlp(x, self.attn.core(q, k, v, cu_seqlens), gate)


class GPT(nn.Module):
    """Embedding -> n_layers blocks -> norm -> vocab-parallel head (tied to the embedding or not)."""

    def __init__(self, cfg: ModelConfig, groups: Optional[ModelGroups] = None,
                 options: Optional[ModelOptions] = None, *, device=None, dtype=None):
        """cfg: the architecture; groups: its process groups (None: one process);
        options: the run's settings (models/options.py; None: the defaults)."""
        super().__init__()
        g, o = groups or ModelGroups(), options or ModelOptions()
        check_checkpoint_mode(o.activation_checkpointing)
        self.memory = o.memory or MemoryConfig()  # tiled loss / MLP, activation offload
        self.cp = context_parallel_of(o.cp_comm, g.cp_group, g.ulysses_group, g.ring_group,
                                      o.layout, o.ring_grad_dtype)
        tp_group = g.tp_group
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, g.cp_group
        self.activation_checkpointing = o.activation_checkpointing
        self.every_n_layers = o.every_n_layers
        selective = o.activation_checkpointing == "selective"
        attention_backend = o.attention_backend
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group=tp_group,
                                            device=device, dtype=dtype)
        self.layer_attention = layer_attention(cfg)  # each layer's kind, window, RoPE
        moe_layers = set(moe_layer_indices(cfg.moe, cfg.n_layers))
        self.ep_group, self.dp_cp_group = g.ep_group, g.dp_cp_group  # experts; router losses
        self.layers = nn.ModuleList(
            Block(cfg, tp_group, self.cp, attention_backend, selective, device, dtype,
                  self.memory, a, o.linear_cp, i in moe_layers, g.ep_group)
            for i, a in enumerate(self.layer_attention))
        self.router_losses = None  # the last training forward's (models/moe.py), or None
        # memory.offload_activations: what checkpointing keeps per layer in host memory
        self.offload = ActivationOffload() if self.memory.offload_activations else None
        self.final_norm = make_norm(cfg, device, dtype)
        self.lm_head = None if cfg.tie_embeddings else ColumnParallelLinear(
            cfg.d_model, cfg.vocab_size, tp_group=tp_group, bias=False, device=device, dtype=dtype)
        # The planner counts from the same description: a change here must change it too.
        check_parameters(self.named_parameters(), cfg, tp_size_of(tp_group),
                         1 if g.ep_group is None else dist.get_world_size(g.ep_group))
        if self.embed.weight.device.type != "meta":  # meta: shapes only, nothing to fill
            self.init_weights(o.seed)

    @classmethod
    def from_config(cls, cfg: Config, state, device=None, dtype=None) -> "GPT":
        """The model for this rank of a ParallelState, from the whole run config."""
        return cls(cfg.model, ModelGroups.from_state(state), ModelOptions.from_config(cfg),
                   device=device, dtype=dtype)

    def use_cp_group(self, cp_group, ulysses_group=None, ring_group=None) -> None:
        """Run the next sequences over another CP group, same pattern and layout: dynamic
        CP gives each pack its rank group (ctxpar/dynamic_cp/groups.py,
        DynamicCPGroups.tile_groups); under hybrid also the Ulysses and ring groups in it."""
        self.cp = replace(self.cp, cp_group=cp_group, ulysses_group=ulysses_group,
                          ring_group=ring_group)
        self.cp_group = cp_group
        for layer in self.layers:
            layer.use_cp(self.cp)

    def init_weights(self, seed: int) -> None:
        """The layout-independent init of every parameter (``init_parameters_``)."""
        init_parameters_(self.named_parameters(), self.cfg, seed, self.tp_group)

    def _checkpointed(self, i: int) -> bool:
        return block_recomputed(self.activation_checkpointing, i, self.every_n_layers)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                labels: Optional[torch.Tensor] = None, cu_seqlens=None) -> torch.Tensor:
        """tokens (B, T/cp) ids; positions (T/cp,) or (B, T/cp) their global positions (or,
        to restart RoPE at each document, documents.document_positions);
        labels (B, T/cp) next-token ids, -100 = ignored; cu_seqlens: packed documents'
        boundaries in the full sequence (one int32 tensor per sample, or one for all),
        attention then stays inside each document (every CP pattern and backend).

        Returns the vocab-parallel logits (B, T/cp, V/tp), or with labels the fp32 sum of
        this rank's token losses (identical on the ranks of a TP group); normalise it with
        models.loss (loss_for_backward / global_mean_loss). With labels and
        memory.tiled_loss the logits are made one tile of tokens at a time and never whole
        (ctxpar/memory/tiled_loss.py); the sum is the same.
        """
        stats = self._router_stats(labels is not None)
        x = self.hidden_states(tokens, positions, cu_seqlens=cu_seqlens)  # (B, T/cp, d)
        if stats is not None:  # one all-reduce of the routers' counts over DP x CP
            moe = self.cfg.moe
            self.router_losses = stats.losses(moe.aux_loss_coef, moe.z_loss_coef,
                                              self.dp_cp_group, moe.seq_aux_loss_coef,
                                              self.cp_group)
        if labels is None:
            return self.lm_logits(x)
        if self.memory.tiled_loss:  # head + loss per tile of tokens: no (B, T/cp, V/tp) logits
            # The weight is read here, in GPT's forward, as the tied path has always read
            # the embedding's: under ZeRO-3 DeepSpeed registers it as GPT's external
            # parameter and keeps it gathered for GPT's forward and backward.
            return tiled_vocab_parallel_cross_entropy(
                x, self.head_weight(), labels, self.tp_group, self.memory.loss_tile_tokens,
                reduction="sum")
        return vocab_parallel_cross_entropy(self.lm_logits(x), labels, self.tp_group).sum()

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor,
                      kv_cache=None, cu_seqlens=None) -> torch.Tensor:
        """The final-normed hidden states (B, T/cp, d) before the head.

        kv_cache (ctxpar.inference.KVCache): inference; every layer reads and fills its
        share of the cache (prefill of a prompt, or one decode step).
        """
        rotary = layer_rotary(positions, rotary_dim(self.cfg),
                              self.layer_attention)  # each layer's (cos, sin), fp32
        x = embed_tokens(self.embed, tokens, self.cfg)  # (B, T/cp, d)
        off = self.offload  # None, or the hooks moving what each layer keeps to the host
        if off is not None:
            for cos, sin in dict.fromkeys(rotary):
                off.keep(cos, sin)  # every layer's, on the device once
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[i]
            if kv_cache is not None:
                x = layer(x, cos, sin, kv_cache.layer(i))
            elif self._checkpointed(i):  # keep only x; replay the block (and its CP attention) in backward
                x = run_layer(off, checkpoint, layer, x, cos, sin, None, cu_seqlens,
                              use_reentrant=False)
            else:  # selective keeps x and the core's q, k, v, out, lse (offloaded); none, all
                x = run_layer(off, layer, x, cos, sin, cu_seqlens=cu_seqlens,
                              to_host=layer.selective)
        return self.final_norm(x)

    def _router_stats(self, training: bool) -> Optional[RouterStats]:
        """A fresh RouterStats handed to every MoE layer for a training forward (their
        auxiliary losses, ctxpar/moe/aux.py), None otherwise."""
        if self.cfg.moe is None:
            return None
        moe = self.cfg.moe
        stats = RouterStats(moe.num_experts, moe.score, moe.seq_aux_loss_coef > 0) \
            if training else None
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stats = stats
        self.router_losses = None
        return stats

    def update_router_biases(self, layer_counts: torch.Tensor) -> None:
        """After an optimizer step: each MoE layer's aux-free balance update
        (model.moe.bias_update_rate) from its assignments per expert over the step's whole
        batch, layer_counts (L_moe, E) in layer order (RouterLosses.layer_counts summed over
        the micro-batches; the same on every rank)."""
        moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        if not moe or not self.cfg.moe.bias_update_rate:
            return
        for mlp, counts in zip(moe, layer_counts, strict=True):
            mlp.update_correction_bias(counts)

    def head_weight(self) -> torch.Tensor:
        """The head's (V/tp, d) weight: lm_head's, or the embedding's when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, d) -> vocab-parallel logits (B, T, V/tp)."""
        if self.lm_head is not None:
            return self.lm_head(x)
        return parallel_lm_logits(x, self.embed.weight, self.tp_group)
