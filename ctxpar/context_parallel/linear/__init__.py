"""Linear-attention and state-space mixers over a CP group: Gated DeltaNet, KDA and Mamba2.

Their state, not the sequence, crosses ranks (or the heads do); one file per idea:

    api.py            gated_delta_rule_cp, kda_cp, ssd_cp, causal_conv1d_cp (causal_conv1d
                      on one process); check_linear_cp (the rules, for a config loader);
                      summary_bytes (state passing's traffic)
    state_passing.py  strategy "state": (M, E) summaries, one fp32 all-gather, composition
                      in sequence order (contiguous, zigzag); documents reset the state
    heads.py          strategy "heads": all-to-all sequence <-> heads around the kernel
                      (every layout), Ulysses' exchange with grouped heads replicated
    conv.py           the short causal conv1d's pieces: the halo of K - 1 tokens (its plan
                      and exchange), the taps with document resets, one decoding step
    gated_delta.py    the chunked gated delta rule in torch (initial state, final state,
                      seq_idx resets): the kernel interface, fp32; gated_delta_step, one
                      token recurrently (decoding)
    kda.py            Kimi Delta Attention's chunked kernel in torch (a decay per key
                      channel; sub-chunks keep every exp <= 1): kernel interface, fp32;
                      kda_step (decoding)
    ssd.py            Mamba2's chunked SSD in torch, likewise; ssd_step
    kernels.py        the local passes' interface: torch (the three files above, conv.py's
                      taps) or a GPU library's; get_kernel("auto") picks and says why
    gpu_kernels.py    the adapters: flash-linear-attention's chunk_gated_delta_rule and
                      chunk_kda, mamba_ssm's mamba_chunk_scan_combined, causal-conv1d's
                      causal_conv1d_fn

The torch kernels run on CPU and GPU alike, checked against transformers' torch
references (tests/test_linear_kernels.py); the GPU adapters against emulations of the
libraries (tests/test_linear_gpu_kernels.py) and on fake CUDA (the dry run).
"""
from .api import (LINEAR_CP_STRATEGIES, STRATEGIES, causal_conv1d, causal_conv1d_cp,
                  check_linear_cp, gated_delta_rule_cp, kda_cp, ssd_cp, summary_bytes)
from .conv import conv_step
from .gated_delta import chunk_gated_delta_rule, gated_delta_step
from .kda import chunk_kda, kda_step
from .ssd import discretize_dt, ssd_chunk_scan, ssd_step

__all__ = [
    "LINEAR_CP_STRATEGIES", "STRATEGIES", "causal_conv1d", "causal_conv1d_cp",
    "check_linear_cp", "chunk_gated_delta_rule", "chunk_kda", "conv_step", "discretize_dt",
    "gated_delta_rule_cp", "gated_delta_step", "kda_cp", "kda_step", "ssd_chunk_scan",
    "ssd_cp", "ssd_step", "summary_bytes",
]
