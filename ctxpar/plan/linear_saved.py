"""What a Gated DeltaNet, KDA or Mamba2 layer saves for backward, in bytes, per rank.

Read from the code autograd records (models/gated_delta.py, models/kda.py,
models/mamba2.py, and the torch kernels under ctxpar/context_parallel/linear/: conv.py,
gated_delta.py, kda.py, ssd.py, state_passing.py, heads.py) and held to autograd's saved tensors (tests/test_plan.py).
Shapes per rank (LinearShapes): B samples of T tokens, the layer's heads on this rank,
the kernel's chunk C (nc = ceil(T / C) chunks, Tp = nc C tokens padded), the conv's K
taps over its Cc channels; e the activations' element size. The chunked kernels run in
fp32 whatever e: most of what they save is 4 bytes an element.

    conv       the K shifted taps and the silu's input, fp32: (K + 1) B T Cc 4; its
               halo (K - 1 tokens a neighbour under CP) is exchanged, not saved
    kernel     the lean torch kernel's (context_parallel/linear/lean.py): its inputs as
               given and the fp32 state entering each segment of SEGMENT_CHUNKS chunks
               but the first; its backward recomputes one segment's chunked
               intermediates at a time ((B, H, nc, C, C) decays and scores, per-token
               fp32 copies and solves, the state entering every chunk: *_kernel_saved,
               what the autograd kernel keeps for the whole sequence)
    around it  the gates (beta, g; dt), the gated RMSNorm and out_proj's input
"""
from __future__ import annotations

from dataclasses import dataclass

from ..context_parallel.linear.lean import segment_tokens


@dataclass(frozen=True)
class GatedDeltaShapes:
    """One GDN layer's sizes on one rank (heads after TP; linear_layers.gdn_shapes)."""
    Hk: int   # key heads
    Hv: int   # value heads
    Dk: int
    Dv: int
    K: int    # conv taps
    C: int    # the kernel's chunk

    @property
    def conv_channels(self) -> int:
        return 2 * self.Hk * self.Dk + self.Hv * self.Dv


@dataclass(frozen=True)
class MambaShapes:
    """One Mamba2 layer's sizes on one rank (heads and groups after TP)."""
    H: int    # heads
    P: int    # head dim
    N: int    # state size
    G: int    # B/C groups
    K: int
    C: int

    @property
    def conv_channels(self) -> int:
        return self.H * self.P + 2 * self.G * self.N

    @property
    def in_proj_rows(self) -> int:
        return 2 * self.H * self.P + 2 * self.G * self.N + self.H   # z | xBC | dt


def _chunks(T: int, C: int):
    nc = -(-T // C)
    return nc, nc * C


def gdn_kernel_saved(B: int, T: int, Hv: int, Dk: int, Dv: int, C: int) -> int:
    """What the lean kernel recomputes per segment and keeps while its backward runs
    there (its working set; before lean.py, what the layer kept): gated_delta_fp32 on
    (B, T) tokens of Hv heads (q, k already at Hv heads): the padded q, k, v, beta; k_beta, two contiguous k^T for the two (C, C) products, the two
    solves' results, the scan's per-chunk copies of the reads and k^T (2 nc - 1 of
    (B, H, C, Dk)); its written values u (B, H, C, Dv) and entering state S (B, H, Dk, Dv)
    per chunk; five (B, H, nc, C, C) (the decays, two products, the system, intra); five
    (B, H, nc, C) (decays, gamma0, the padded beta); the bool masks (B, nc, C, C), (B, nc, C)."""
    nc, Tp = _chunks(T, C)
    dk = 10 * B * Tp * Hv * Dk - B * Hv * C * Dk
    return 4 * (dk + 3 * B * Tp * Hv * Dv + B * nc * Hv * Dk * Dv + 5 * B * Tp * Hv * C
                + 5 * B * Tp * Hv) + B * Tp * C + B * Tp


def lean_states(B: int, T: int, C: int, state: int) -> int:
    """The fp32 states lean.ChunkedScan saves: one of `state` elements per row entering each
    segment of SEGMENT_CHUNKS chunks but the first."""
    segments = max(1, -(-T // segment_tokens(C)))
    return 4 * (segments - 1) * B * state


def conv_saved_torch(B: int, T: int, channels: int, K: int, e: int) -> int:
    """The torch conv's K shifted taps and the silu's input (fp32); in 16-bit the
    weight's fp32 copy."""
    return 4 * (K + 1) * B * T * channels + (4 * K * channels if e != 4 else 0)


def gdn_kernel_inputs(B: int, T: int, g: GatedDeltaShapes, e: int, key_heads: int = 0,
                      gate_width: int = 1) -> int:
    """The lean kernel's per-token inputs as it saves them (and as its backward returns
    their gradients): q, k, v views of the conv's output (its storage, e) and g (fp32,
    gate_width a head: 1 for GDN, Dk for KDA's per-channel decay); under heads (key_heads
    > 0) the all-to-all's copies of q, k (at key_heads), v, beta (e) and g."""
    gate = 4 * g.Hv * gate_width
    if key_heads:
        return B * T * ((2 * key_heads * g.Dk + g.Hv * g.Dv + g.Hv) * e + gate)
    return B * T * (g.conv_channels * e + gate)


def gdn_saved(B: int, T: int, g: GatedDeltaShapes, e: int, key_heads: int = 0) -> int:
    """One GDN layer on one process (cp 1), beyond its normed input (the norm's count):
    the conv (its taps and the silu's input, fp32; in 16-bit the weight's fp32 copy), the
    lean kernel's inputs (q, k, v: views of the conv's output, in e; g fp32; beta the
    sigmoid's output it saves already) and its states between segments, the gates (beta
    in e; softplus's input and output fp32; -exp(A_log)), the gated RMSNorm
    (models/gated_delta.py's LeanGatedNorm: its x and z in e) and out_proj's input (e).
    key_heads > 0: the heads strategy,
    whose all-to-all hands the kernel copies (q, k at key_heads, v, g and beta), the conv's
    output then saved by nobody."""
    return delta_rule_saved(B, T, g, e, key_heads, 1) + gdn_gates_norm(B, T, g, e)


def delta_rule_saved(B: int, T: int, g: GatedDeltaShapes, e: int, key_heads: int,
                     gate_width: int) -> int:
    """What GDN and KDA save the same way: the conv (conv_saved_torch), the lean kernel's
    inputs (gdn_kernel_inputs, g gate_width a head: 1 for GDN, Dk for KDA) and its fp32
    states between segments."""
    return conv_saved_torch(B, T, g.conv_channels, g.K, e) \
        + gdn_kernel_inputs(B, T, g, e, key_heads, gate_width) \
        + lean_states(B, T, g.C, g.Hv * g.Dk * g.Dv)


def gdn_gates_norm(B: int, T: int, g: GatedDeltaShapes, e: int) -> int:
    """What a GDN layer saves around its conv and kernel, whichever they are: the gates
    and the gated RMSNorm (gdn_saved's docstring)."""
    gates = B * T * g.Hv * (e + 2 * 4) + 8 * g.Hv
    norm = 3 * e * B * T * g.Hv * g.Dv  # LeanGatedNorm's x and z, out_proj's input
    return gates + norm


def kda_kernel_saved(B: int, T: int, Hv: int, Dk: int, Dv: int, C: int) -> int:
    """What the lean KDA kernel recomputes per segment (its backward's working set):
    gdn_kernel_saved's chunked tensors, plus kda.decayed_products' per-channel decays:
    inside each sub-chunk of s tokens, offset by offset, the decay and the two stacked
    products (3 Dk (s + 1) / 2 fp32 a token), and between its m = C / s sub-chunks the
    decays to each reference point (2 (m - 1) Dk a token). Within 7% of what autograd
    keeps (tests/test_plan.py)."""
    from ..context_parallel.linear.kda import sub_chunk_size
    s = sub_chunk_size(C)
    nc, Tp = _chunks(T, C)
    per_token = 3 * Dk * (s + 1) // 2 + 2 * (C // s - 1) * Dk
    return gdn_kernel_saved(B, T, Hv, Dk, Dv, C) + 4 * B * Tp * Hv * per_token


def kda_saved(B: int, T: int, g: GatedDeltaShapes, e: int, key_heads: int = 0) -> int:
    """One KDA layer on one process (cp 1), beyond its normed input: gdn_saved's conv,
    kernel inputs (g per key channel: (B, T, Hv, Dk) fp32) and states between segments,
    then kda_gates_norm's gates and norm (models/kda.py). key_heads > 0: the heads
    strategy, whose all-to-all hands the kernel copies of q, k (key_heads), v, g, beta."""
    return delta_rule_saved(B, T, g, e, key_heads, g.Dk) + kda_gates_norm(B, T, g, e)


def kda_gates_norm(B: int, T: int, g: GatedDeltaShapes, e: int) -> int:
    """What a KDA layer saves around its conv and kernel (models/kda.py): f_a_proj's output
    (Dk, e) and softplus's input and output (Hv Dk, fp32) with exp(A_log) and the decay
    (Hv each), beta (e), g_a_proj's output (Dv, e); KimiGatedNorm in fp32: x, its rsqrt
    (one a head), the normed x, w times it and the gate's sigmoid (the weight's fp32 copy
    in 16-bit); o_proj's input (e)."""
    gates = B * T * (g.Dk * e + 8 * g.Hv * g.Dk + g.Hv * e + g.Dv * e) + 8 * g.Hv
    norm = B * T * g.Hv * (16 * g.Dv + 4 + e * g.Dv) + (4 * g.Dv if e != 4 else 0)
    return gates + norm


def ssd_kernel_saved(B: int, T: int, H: int, P: int, N: int, C: int) -> int:
    """What the lean SSD recomputes per segment (its backward's working set), and what
    state passing's SSD in two halves keeps: ssd_fp32 on (B, T) tokens of H heads (B, C already at H heads): five (B, T, H, N)
    (the padded B and C's permuted copies for the two einsums, B times the decay, the
    scan's per-chunk copies of C but the first's), three (B, T, H, P) (x dt's two permuted
    copies, the scan's per-chunk products), three (B, H, nc, C, C) (the decay, C B^T,
    the scores), four (B, H, nc, C) (the decays, to_end's and from_start's products) and
    the state entering every chunk (B, H, P, N) fp32; the bool masks."""
    nc, Tp = _chunks(T, C)
    return 4 * (5 * B * Tp * H * N - B * H * C * N + 3 * B * Tp * H * P
                + 3 * B * Tp * H * C + 4 * B * Tp * H + B * nc * H * P * N) \
        + B * Tp * C + B * Tp


def mamba_saved(B: int, T: int, s: MambaShapes, e: int, groups: int = 0) -> int:
    """One Mamba2 layer on one process (cp 1), beyond its normed input: the conv (in
    16-bit with the weight's fp32 copy); the lean kernel's inputs (x, B, C views of the
    conv's output in e, dt fp32, A) and its states between segments; dt's softplus input
    and clamp input (fp32) and exp(A_log); the grouped gated RMSNorm (models/mamba2.py's
    LeanGroupedGatedNorm: y and z, whose storage is in_proj's whole output) and out_proj's
    input, in e. groups > 0: the heads strategy, whose
    all-to-all hands the kernel copies (x, dt, B and C at `groups` groups)."""
    conv = conv_saved_torch(B, T, s.conv_channels, s.K, e)
    kernel = mamba_kernel_inputs(B, T, s, e, groups) + 4 * s.H \
        + lean_states(B, T, s.C, s.H * s.P * s.N)
    return conv + kernel + mamba_dt_norm(B, T, s, e)


def mamba_kernel_inputs(B: int, T: int, s: MambaShapes, e: int, groups: int = 0) -> int:
    """The lean SSD's per-token inputs as it saves them (and as its backward returns their
    gradients): x, B, C views of the conv's output (its storage, e), dt fp32; under heads
    (groups > 0) the all-to-all's copies (B, C at `groups` groups)."""
    xbc = (s.H * s.P + 2 * groups * s.N) if groups else s.conv_channels
    return B * T * (xbc * e + 4 * s.H)


def mamba_dt_norm(B: int, T: int, s: MambaShapes, e: int) -> int:
    """What a Mamba2 layer saves around its conv and kernel, whichever they are: dt's
    softplus and clamp inputs, exp(A_log), the grouped gated norm (mamba_saved's
    docstring)."""
    HP = s.H * s.P
    dt = 2 * 4 * B * T * s.H + 4 * s.H
    # LeanGroupedGatedNorm's y and z (a view of in_proj's output: all its rows), out_proj's
    # input
    norm = e * B * T * (2 * HP + s.in_proj_rows)
    return dt + norm


def mamba_saved_autograd(B: int, T: int, s: MambaShapes, e: int) -> int:
    """One Mamba2 layer whose SSD runs under autograd (state passing's torch SSD in two
    halves, api._ssd_state), beyond its normed input: the conv; the x the kernel
    multiplies by dt and D (at fp32 the conv's output it is a view of, else an fp32 copy);
    dt (softplus's input, clamp's input and output, fp32); -exp(A_log); the kernel; the
    lean grouped gated norm and out_proj's input (mamba_dt_norm's)."""
    Cc, HP = s.conv_channels, s.H * s.P
    conv = 4 * (s.K + 1) * B * T * Cc
    if e == 4:
        views = 4 * B * T * Cc
    else:  # an fp32 copy of x; the conv weight and D cast to fp32
        views = 4 * B * T * HP + 4 * (Cc + s.H)
    dt = 3 * 4 * B * T * s.H + 8 * s.H
    return conv + views + dt + ssd_kernel_saved(B, T, s.H, s.P, s.N, s.C) \
        + e * B * T * (2 * HP + s.in_proj_rows)


# --- on GPU: the libraries' kernels (kernels.get_kernel's 'auto' on CUDA in 16-bit) -------
# Read from their sources: fla-core 0.6.0 (fla/ops/gated_delta_rule/chunk.py,
# chunk_fwd.py, fla/ops/common/chunk_delta_h.py, chunk_o.py, wy_fast.py), mamba_ssm
# v2.3.2.post1 (mamba_ssm/ops/triton/ssd_combined.py), causal-conv1d v1.6.1
# (causal_conv1d/causal_conv1d_interface.py). Not measured here (no GPU in CI): the
# counts follow the allocations those files make. With rows longer than one recompute
# segment the libraries run per segment (gpu_kernels.py through lean.ChunkedScan): the
# layer then saves the kernel's inputs and states as the torch kernel does
# (gdn_kernel_inputs, mamba_kernel_inputs, lean_states) and these counts apply to one
# segment (linear_layers.mixer_working_set).

def conv_saved_gpu(B: int, T: int, channels: int, e: int) -> int:
    """causal_conv1d_fn saves its input x (channel-last: in_proj's rows, or their copy when
    a split's strides do not suit it) and the weight; silu is fused, its output not saved."""
    return B * T * channels * e


def fla_gdn_saved(B: int, T: int, g: GatedDeltaShapes, e: int, value_width: int = 0,
                  key_heads: int = 0) -> int:
    """ChunkGatedDeltaRuleFunction.forward's save_for_backward, per rank: q and k after its
    l2norm (new, e) with their fp32 rstd, v (input_guard's contiguous copy of the conv's
    split, e), g after chunk_local_cumsum (fp32), beta (the sigmoid's output, saved there
    already), A (B, T, Hv, C) in k's dtype (the inverted chunk systems). value_width: the
    values' width (state passing's Dk + Dv), key_heads: the key heads it gets."""
    hk, dv = key_heads or g.Hk, value_width or g.Dv
    return B * T * (2 * hk * g.Dk * e + 8 * hk + g.Hv * dv * e + 4 * g.Hv + g.Hv * g.C * e)


def fla_gdn_backward(B: int, T: int, g: GatedDeltaShapes, e: int, value_width: int = 0) -> int:
    """chunk_gated_delta_rule_bwd's tensors alive at its last step (prepare_wy_repr_bwd;
    every local is held until it returns), over the rank's whole sequence: w, u (recomputed),
    h and dh (a (Dk, Dv) state per chunk, e), v_new, dv (its second), dq, dk at Hv heads,
    dw, dk2, dv of the WY backward (e), dg and dg2 (fp32)."""
    dv = value_width or g.Dv
    per_head = 5 * g.Dk * e + 3 * dv * e + 2 * g.Dk * dv * e / g.C + 3 * 4
    return int(B * T * g.Hv * per_head)


def fla_kda_saved(B: int, T: int, g: GatedDeltaShapes, e: int, value_width: int = 0) -> int:
    """ChunkKDAFunction.forward's save_for_backward (fla-core 0.6.0 fla/ops/kda/chunk.py):
    q and k after its l2norm (new, e, at the value heads: its q, k and g share a shape)
    with their fp32 rstd, v (e), g after chunk_local_cumsum (fp32, per key channel),
    beta (saved there already), Aqk and Akk (B, T, Hv, C) fp32. value_width: state
    passing's Dk + Dv."""
    dv = value_width or g.Dv
    return B * T * g.Hv * (2 * g.Dk * e + 8 + dv * e + 4 * g.Dk + 8 * g.C)


def fla_kda_backward(B: int, T: int, g: GatedDeltaShapes, e: int, value_width: int = 0) -> int:
    """chunk_kda_bwd's tensors alive at its end, over the rank's whole sequence (read from
    its source as fla_gdn_backward): w, u, qg, kg (recomputed, e), h and dh per chunk, v_new
    and dv (e), dq, dk, dg, dg2 (fp32, per key channel), dw, dk2 and dv of the WY backward
    (e), dAqk and dAkk (C a token, fp32)."""
    dv = value_width or g.Dv
    per_head = 5 * g.Dk * e + 3 * dv * e + 2 * g.Dk * dv * e / g.C + 4 * 4 * g.Dk + 8 * g.C
    return int(B * T * g.Hv * per_head)


def mamba_ssm_saved(B: int, T: int, s: MambaShapes, e: int) -> int:
    """MambaChunkScanCombinedFn.forward's save_for_backward: out (e), x, B, C (views of the
    conv's output, stride(-1) == 1: kept as given; under heads the all-to-all's copies, the
    same bytes but for replicated groups), dt (fp32, as given), dA_cumsum (B, H, nc, C)
    fp32, A, D."""
    xbc = s.conv_channels * e
    return B * T * (xbc + s.H * s.P * e + 8 * s.H)


def mamba_ssm_backward(B: int, T: int, s: MambaShapes, e: int) -> int:
    """_mamba_chunk_scan_combined_bwd's tensors alive at its end, over the rank's whole
    sequence: dt's clone, dA_cumsum and dt again, ddt and the ddA sums (fp32 per head),
    CB and dCB (B, nc, G, C, C) fp32, the chunk states (fp32, then in e) and their gradient
    (e), dx (e), dB and dC with their residuals (e)."""
    states = s.H * s.P * s.N / s.C
    return int(B * T * (8 * s.G * s.C + states * (4 + 2 * e) + s.H * s.P * e
                        + 4 * s.G * s.N * e + 6 * 4 * s.H))
