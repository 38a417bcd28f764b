"""Rotary position embedding (RoPE, Su et al.) on global positions: the frequencies and
their scaling rules (linear, Llama 3.1's, YaRN), cos/sin per layer, and the rotation.

    rotary = layer_rotary(positions, rotary_dim(cfg), layer_attention(cfg))  # per layer
    q = apply_rotary(q, *rotary[i])    # (B, T/cp, h, hd), the first rotary_dim channels

Positions are each token's place in the whole sequence (ctxpar.sequence_positions, or
documents.document_positions to restart at each document), so any CP layout rotates as
one process does. Written as transformers' modeling_rope_utils computes it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None,
                  device=None) -> torch.Tensor:
    """RoPE's frequencies theta^(-2i/hd), i < hd/2, fp32, after an optional scaling rule.

    linear: all divided by factor (positions interpolated). proportional (Gemma 4): the
    first partial_rotary_factor x hd/2 frequencies over the whole head_dim, the others 0
    (their channel pairs unturned), all divided by factor. llama3 (Llama 3.1): wavelengths
    2*pi/f above original_max_position_embeddings/low_freq_factor are divided by factor,
    below .../high_freq_factor kept, in between blended linearly in
    original_max_position_embeddings/wavelength. yarn: ``yarn_inv_freq``. Same rules as
    Hugging Face's modeling_rope_utils (tests/test_hf.py checks the frequencies against it).
    """
    kind = (scaling or {}).get("rope_type")
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling, device)
    # 1 / theta^(2i/hd) in fp32, transformers' ops in its order: the same bits as its
    # frequencies (theta^(-2i/hd) is one ulp off some, which positions multiply)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device,
                                            dtype=torch.float32) / head_dim)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "proportional":  # the first prf x hd/2 frequencies, the rest 0 (unturned)
        turned = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turned:] = 0.0
        return inv_freq / scaling.get("factor", 1.0)
    if kind == "llama3":
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        # 0 at the low end, 1 at the high end; high == low (Llama 4): no band between, the
        # division's inf/nan never chosen (as modeling_rope_utils computes it)
        smooth = (old / wavelen - low) / (high - low)
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


def query_temperature(positions: torch.Tensor, floor_scale: int,
                      attn_scale: float) -> torch.Tensor:
    """Llama 4's NoPE-layer query scale at global positions (..., T/cp) -> (..., T/cp)
    fp32: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)) (model.attn_temperature_
    tuning; transformers' Llama4TextAttention)."""
    p = positions.to(torch.float32)
    return torch.log1p(torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


def layer_inputs(positions: torch.Tensor, head_dim: int, a):
    """One attention layer's position inputs (LayerAttention a): (cos, sin) of its RoPE;
    a NoPE layer under temperature tuning (query_temperature's scale, None)."""
    if not a.rope and a.temperature is not None:
        return query_temperature(positions, *a.temperature), None
    return rotary_cos_sin(positions, head_dim, a.rope_theta, a.rope_scaling)


def layer_rotary(positions: torch.Tensor, head_dim: int, layers):
    """Each layer's (cos, sin) (layer_inputs), computed once per distinct RoPE
    (rope_theta, rope_scaling) among `layers` (LayerAttention: Gemma 3's local and global
    layers rotate by different bases) or temperature; layers that share one share the
    tensors. head_dim: the rotary channels of a head, a layer's own head_dim in its place
    (Gemma 4's full layers: model.global_head_dim, whole heads turned)."""
    made, out = {}, []
    for a in layers:
        dim = a.head_dim or head_dim
        key = (a.rope_theta, repr(a.rope_scaling), dim) if a.rope or a.temperature is None \
            else ("temperature", a.temperature)
        if key not in made:
            made[key] = layer_inputs(positions, dim, a)
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
