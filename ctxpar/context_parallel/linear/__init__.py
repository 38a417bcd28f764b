"""Linear-attention and state-space mixers over a CP group: Gated DeltaNet and Mamba2.

    gated_delta.py    the chunked gated delta rule in torch (initial state, final state,
                      seq_idx resets): the kernel interface, fp32
    ssd.py            Mamba2's chunked SSD in torch, likewise
    conv.py           the short causal conv1d with its halo of K - 1 tokens, document resets
"""
from .conv import causal_conv1d
from .gated_delta import chunk_gated_delta_rule
from .ssd import ssd_chunk_scan

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "ssd_chunk_scan"]
