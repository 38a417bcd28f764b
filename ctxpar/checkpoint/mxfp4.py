"""MXFP4 tensors in a safetensors folder (gpt-oss's released experts, quantization_config
quant_method mxfp4), read for a family whose ``mxfp4`` is set: each tensor as
``{name}_blocks`` (E, R, G, 16) uint8, two e2m1 codes a byte (low nibble first), and
``{name}_scales`` (E, R, G) uint8, a shared e8m0 exponent (bias 127) per block of 32 along
the input; dequantized as transformers' integrations/mxfp4.py _convert_moe_packed_tensors
does (its lookup table, ldexp, in bf16), giving the folder's (E, cols, R) tensor.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def mxfp4_sources(keys) -> Dict[str, Tuple[str, str]]:
    """{expert key: (its _blocks key, its _scales key)} of an MXFP4 folder."""
    return {k[:-len("_blocks")]: (k, k[:-len("_blocks")] + "_scales") for k in keys
            if k.endswith(tuple(t + "_blocks" for t in MXFP4_TENSORS))}


def mxfp4_shape(blocks_shape) -> Tuple[int, ...]:
    """The dequantized tensor's shape (E, G * 32, R) of blocks (E, R, G, 16)."""
    e, r, g, b = blocks_shape
    return (e, g * b * 2, r)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E, R, G, 16) uint8 codes and (E, R, G) uint8 exponents -> (E, G * 32, R) bf16."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    blocks, exp = blocks.to(torch.uint8), scales.to(torch.int32) - 127
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.bfloat16)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, exp.unsqueeze(-1), out=out)               # (E, R, G, 32), in bf16
    return out.flatten(2).transpose(1, 2).contiguous()
