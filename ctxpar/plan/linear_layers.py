"""The linear layers (Gated DeltaNet, KDA, Mamba2) under a layout: their shapes per rank, what
they save for backward under each CP strategy, their FLOPs and their CP bytes.

Shapes per rank come from the parameters' one description (config/parameters.py
block_specs(m, i, tp): A_log's rows are the heads on a rank, in_proj's rows give the key
heads or B/C groups), so however TP splits the mixers the counts follow it. Saved bytes
are linear_saved.py's at the shapes each strategy runs its kernel on:

    cp 1     the kernel on the rank's B x T tokens
    heads    the kernel on all T tokens of H/cp heads (the same elements as the local
             tokens of H heads; q, k, B, C arrive as copies); the gates, conv and norm on
             the local tokens
    state    the kernel on each of the rank's segments (1 contiguous, 2 zigzag) from a
             state: GDN's value width Dk + Dv ([I | 0] -> [M | E]) and its (Dk, Dk + Dv)
             states per chunk; GDN's correction q~ S_in (Mamba2 has none: its torch SSD
             runs in two halves, the E scan's states and decay instead) and PassStates'
             gathered fp32 summaries (cp x segments x B x H x |M, E|)

FLOPs: the chunked forms' matmuls per token (chunk C): GDN C (5 Dk + 3 Dv) + 6 Dk Dv per
value head (the two (C, C) products, the two triangular solves, the scan's four state
products), SSD 2 C (N + P) + 4 P N per head; backward twice that. KDA is GDN's chunked
form with a decay per key channel (the same matmuls; its state [M | E] the same size):
GDN's count plus its per-channel decays, 4 Dk (s + 1) a token (two products, three
operations a channel, over s / 2 partners on average inside sub-chunks of s tokens,
kda.decayed_products) and the decayed q, k and k_out (3 Dk). Its saved bytes are GDN's
form with g per key channel and its own gates and norm (linear_saved.kda_saved). CP bytes: state
passing's summaries (context_parallel.linear.summary_bytes), heads' all-to-alls of the
inputs and the output ((cp - 1)/cp of them, each way), and the conv's halo (K - 1 tokens
of its channels from each neighbouring run: one under contiguous, two under zigzag).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..config import ModelConfig
from ..config.layers import DELTA_TYPES, gated_delta_dims, layer_types, mamba_dims
from ..config.parameters import block_specs
from ..context_parallel.linear import summary_bytes
from ..context_parallel.linear.state_passing import SEGMENTS
from ..context_parallel.ulysses import ulysses_kv_heads
from ..context_parallel.linear.lean import segment_tokens
from .linear_saved import (GatedDeltaShapes, MambaShapes, conv_saved_gpu, fla_gdn_backward,
                           fla_gdn_saved, fla_kda_backward, fla_kda_saved, gdn_gates_norm,
                           gdn_kernel_inputs, gdn_kernel_saved, gdn_saved, kda_gates_norm,
                           kda_kernel_saved, kda_saved, lean_states, mamba_dt_norm,
                           mamba_kernel_inputs,
                           mamba_saved, mamba_saved_autograd, mamba_ssm_backward,
                           mamba_ssm_saved, ssd_kernel_saved)

KINDS = {"linear_attention": "gated_delta", "kimi_delta_attention": "kda",
         "mamba": "mamba2"}  # layer type -> mixer
KDA = "kimi_delta_attention"
# where a delta-rule layer's parameters stand: (its A_log, its q rows or [q | k | v] rows)
_DELTA_NAMES = {"linear_attention": ("linear_attn.A_log", "linear_attn.in_proj_qkv.weight"),
                KDA: ("kda.forget_gate.A_log", "kda.q_proj.weight")}

_SHAPES: dict = {}  # (layer type, the mixer's fields, tp) -> its shapes per rank


def _local(specs, suffix: str, tp: int):
    return next(s for s in specs if s.name.endswith(suffix)).local_shape(tp)


def linear_shapes(m: ModelConfig, kind: str, tp: int):
    """GatedDeltaShapes or MambaShapes of a `kind` layer on one of tp ranks."""
    key = (kind, gated_delta_dims(m) if kind in DELTA_TYPES else mamba_dims(m), tp)
    if key not in _SHAPES:
        i = layer_types(m).index(kind)
        specs = block_specs(m, i, tp)
        if kind in DELTA_TYPES:
            g = gated_delta_dims(m)
            a_log, q_rows = _DELTA_NAMES[kind]
            hv = _local(specs, a_log, tp)[0]
            rows = _local(specs, q_rows, tp)[0]
            hk = rows // g.key_head_dim if kind == KDA else \
                (rows - hv * g.value_head_dim) // (2 * g.key_head_dim)
            _SHAPES[key] = GatedDeltaShapes(hk, hv, g.key_head_dim, g.value_head_dim,
                                            g.conv_kernel, g.chunk_size)
        else:
            d = mamba_dims(m)
            h = _local(specs, "mamba.A_log", tp)[0]
            rows = _local(specs, "mamba.in_proj.weight", tp)[0]
            groups = (rows - 2 * h * d.head_dim - h) // (2 * d.state_size)
            _SHAPES[key] = MambaShapes(h, d.head_dim, d.state_size, groups, d.conv_kernel,
                                       d.chunk_size)
    return _SHAPES[key]


def mixer_saved(kind: str, sh, B: int, T: int, e: int, cp: int, strategy: str,
                layout: str, device: str = "cpu") -> int:
    """Bytes a linear mixer saves on one rank of cp (T: its local tokens), beyond its
    normed input (the norm's count): linear_saved.py's at cp 1, else the module
    docstring's per strategy; on 'cuda' the libraries' kernels' (_gpu_mixer_saved)."""
    gdn = kind in DELTA_TYPES
    delta_saved = kda_saved if kind == KDA else gdn_saved  # KDA: g per key channel
    if device == "cuda" and e != 4:
        return _gpu_mixer_saved(kind, sh, B, T, e, cp, strategy, layout)
    if cp == 1:
        return delta_saved(B, T, sh, e) if gdn else mamba_saved(B, T, sh, e)
    if strategy == "heads":  # the kernel over T cp tokens of H/cp heads: the same elements
        if gdn:  # q, k, v, g, beta arrive as copies, the key heads replicated to lcm
            return delta_saved(B, T, sh, e, key_heads=ulysses_kv_heads(sh.Hk, cp))
        return mamba_saved(B, T, sh, e, groups=ulysses_kv_heads(sh.G, cp))
    slots = SEGMENTS[layout]
    Bs, Ts = B * slots, T // slots
    if gdn:
        # the lean kernel on each segment at value width Dk + Dv: q, k views of the conv's
        # output (saved, as at cp 1), g, beta as at cp 1; v widened [0 | v] in e, the
        # initial [I | 0] and the states between the kernel's segments, fp32
        state = sh.Hv * sh.Dk * (sh.Dk + sh.Dv)
        widened = Bs * Ts * sh.Hv * sh.Dk * e + 4 * Bs * state \
            + lean_states(Bs, Ts, sh.C, state) - lean_states(B, T, sh.C, sh.Hv * sh.Dk * sh.Dv)
        # q~ S_in: the einsum's copy of q~ and S_in; the gathered summaries and S_0
        extra = 4 * (B * T * sh.Hv * sh.Dk + Bs * sh.Hv * sh.Dk * sh.Dv
                     + cp * Bs * state + B * sh.Hv * sh.Dk * sh.Dv)
        return delta_saved(B, T, sh, e) + widened + extra
    outer = mamba_saved_autograd(B, T, sh, e) - ssd_kernel_saved(B, T, sh.H, sh.P, sh.N, sh.C)
    kernel = ssd_kernel_saved(Bs, Ts, sh.H, sh.P, sh.N, sh.C)
    # the torch SSD in two halves (api._ssd_state, under autograd): decay_in (its exp and
    # product), the E scan's state entering each chunk, the gathered summaries and S_0;
    # the outputs' scan from S_in is the kernel's own
    chunks = -(-Ts // sh.C)
    extra = 4 * (2 * B * T * sh.H + chunks * Bs * sh.H * sh.P * sh.N
                 + cp * Bs * sh.H * (sh.P * sh.N + 1) + B * sh.H * sh.P * sh.N)
    return outer + kernel + extra


def kernel_rows(sh, B: int, T: int, cp: int, strategy: str, layout: str):
    """(rows, tokens a row, heads share) the local kernel runs on for T local tokens: cp 1
    B rows of T; heads B rows of all T cp tokens of 1/cp of the heads; state passing B x
    segments rows of T / segments."""
    if cp > 1 and strategy == "heads":
        return B, T * cp, cp
    slots = SEGMENTS[layout] if cp > 1 else 1
    return B * slots, T // slots, 1


def segmented(sh, B: int, T: int, cp: int, strategy: str, layout: str) -> bool:
    """Whether a GPU library runs once per recompute segment (gpu_kernels.py: its rows are
    longer than one segment of lean.SEGMENT_CHUNKS chunks)."""
    return kernel_rows(sh, B, T, cp, strategy, layout)[1] > segment_tokens(sh.C)


def _gpu_mixer_saved(kind: str, sh, B: int, T: int, e: int, cp: int, strategy: str,
                     layout: str) -> int:
    """mixer_saved with causal_conv1d, fla and mamba_ssm (16-bit on CUDA: get_kernel's
    'auto'): the conv's input, the library kernel's saved tensors (linear_saved.py's
    GPU counts) or, segmented (longer rows than a segment), lean.ChunkedScan's (its
    inputs and the fp32 states between segments, as the torch kernel's), and around them
    what the torch code saves (the gates, dt, the gated norms: as on CPU); state passing
    adds the widened values' pass and the correction."""
    state = cp > 1 and strategy == "state"
    slots = SEGMENTS[layout] if state else 1
    rows, tokens, share = kernel_rows(sh, B, T, cp, strategy, layout)
    lean = segmented(sh, B, T, cp, strategy, layout)
    if kind in DELTA_TYPES:
        kda = kind == KDA  # fla's chunk_kda: q, k at the value heads; g per key channel
        around = kda_gates_norm(B, T, sh, e) if kda else gdn_gates_norm(B, T, sh, e)
        key_heads = ulysses_kv_heads(sh.Hk, cp) if cp > 1 and strategy == "heads" else 0
        width = sh.Dk + sh.Dv if state else sh.Dv
        if lean:  # as the torch kernel's count: state passing's widened v, as mixer_saved's
            kernel = gdn_kernel_inputs(B, T, sh, e, key_heads, sh.Dk if kda else 1) \
                + lean_states(rows, tokens, sh.C, sh.Hv // share * sh.Dk * width) \
                + (B * T * sh.Hv * sh.Dk * e if state else 0)
        elif kda:
            kernel = fla_kda_saved(B, T, sh, e, width)
        else:
            kernel = fla_gdn_saved(B, T, sh, e, width, key_heads)
        extra = 0
        if state:  # [I | 0] entering each segment; q~ S_in's copy of q~ and S_in; summaries
            st = sh.Hv * sh.Dk * (sh.Dk + sh.Dv)
            extra = 4 * (B * slots * st + B * T * sh.Hv * sh.Dk
                         + B * slots * sh.Hv * sh.Dk * sh.Dv + cp * B * slots * st
                         + B * sh.Hv * sh.Dk * sh.Dv)
        return around + conv_saved_gpu(B, T, sh.conv_channels, e) + kernel + extra
    around = mamba_dt_norm(B, T, sh, e)
    extra = 0
    if state:  # y_zero + decay_in C_heads S_in: decay_in, C's fp32 copy at H heads, S_in
        extra = 4 * (B * T * (2 * sh.H + sh.H * sh.N) + B * slots * sh.H * sh.P * sh.N
                     + cp * B * slots * sh.H * (sh.P * sh.N + 1) + B * sh.H * sh.P * sh.N)
    if lean:
        groups = ulysses_kv_heads(sh.G, cp) if cp > 1 and strategy == "heads" else 0
        kernel = mamba_kernel_inputs(B, T, sh, e, groups) + 4 * sh.H \
            + lean_states(rows, tokens, sh.C, sh.H // share * sh.P * sh.N)
    else:
        kernel = mamba_ssm_saved(B, T, sh, e)
    return around + conv_saved_gpu(B, T, sh.conv_channels, e) + kernel + extra


def mixer_working_set(kind: str, sh, B: int, T: int, e: int, cp: int, strategy: str,
                      layout: str, device: str = "cpu") -> int:
    """The bytes a linear mixer's kernel holds while its backward runs, beyond what the
    layer saved. Run through lean.ChunkedScan (the torch kernels always; on CUDA in
    16-bit the libraries when their rows are longer than one segment): the gradients of
    its inputs (written segment by segment into one tensor each) and one segment's
    kernel: the torch kernel's chunked intermediates recomputed with autograd and their
    gradients (twice gdn_kernel_saved or ssd_kernel_saved), or the library's forward's
    saved tensors and its backward's (linear_saved.fla_gdn_saved + fla_gdn_backward,
    mamba_ssm_saved + mamba_ssm_backward, at one segment: under heads a segment of
    T cp tokens is one of 1/cp the heads, the elements of segment / cp local tokens);
    the library unsegmented: its backward over the rank's whole sequence. State passing's
    torch SSD keeps its intermediates saved: nothing more. Its forward holds about half
    of it (the intermediates without their gradients)."""
    state = cp > 1 and strategy == "state"
    rows, tokens, share = kernel_rows(sh, B, T, cp, strategy, layout)
    gdn, kda = kind in DELTA_TYPES, kind == KDA
    width = (sh.Dk + sh.Dv) if gdn and state else (sh.Dv if gdn else 0)
    key_heads = ulysses_kv_heads(sh.Hk if gdn else sh.G, cp) \
        if cp > 1 and strategy == "heads" else 0
    seg = min(tokens, segment_tokens(sh.C)) // share  # local-token equivalents
    if gdn:
        grads = gdn_kernel_inputs(B, T, sh, e, key_heads, sh.Dk if kda else 1) \
            + (B * T * sh.Hv * sh.Dk * e if state else 0)
    else:
        grads = mamba_kernel_inputs(B, T, sh, e, key_heads)
    if device == "cuda" and e != 4:
        fla_backward = fla_kda_backward if kda else fla_gdn_backward
        if not segmented(sh, B, T, cp, strategy, layout):
            return fla_backward(rows, T // (rows // B), sh, e, width) if gdn \
                else mamba_ssm_backward(rows, T // (rows // B), sh, e)
        if gdn:
            fla_saved = fla_kda_saved(rows, seg, sh, e, width) if kda \
                else fla_gdn_saved(rows, seg, sh, e, width, key_heads)
            return grads + fla_saved + fla_backward(rows, seg, sh, e, width)
        return grads + mamba_ssm_saved(rows, seg, sh, e) + mamba_ssm_backward(rows, seg, sh, e)
    if not gdn and state:
        return 0
    if gdn:
        kernel = kda_kernel_saved if kda else gdn_kernel_saved
        return grads + 5 * kernel(rows, seg, sh.Hv, sh.Dk, width, sh.C) // 4
    return grads + 5 * ssd_kernel_saved(rows, seg, sh.H, sh.P, sh.N, sh.C) // 4


def mixer_flops(kind: str, sh, tokens: int, strategy: str, cp: int) -> float:
    """Forward FLOPs of a mixer's chunked kernel over `tokens` local tokens (the
    projections are counted with the parameters); state passing at cp > 1 runs GDN at
    value width Dk + Dv and its correction q~ S_in; Mamba2's adds only the E scan's
    state updates (P N per token and chunk: negligible, not counted)."""
    state = strategy == "state" and cp > 1
    if kind in DELTA_TYPES:
        dv = sh.Dv + (sh.Dk if state else 0)
        per = sh.C * (5 * sh.Dk + 3 * dv) + 6 * sh.Dk * dv + (2 * sh.Dk * sh.Dv if state else 0)
        if kind == KDA:  # its per-channel decays (module docstring)
            from ..context_parallel.linear.kda import sub_chunk_size
            per += 4 * sh.Dk * (sub_chunk_size(sh.C) + 1) + 3 * sh.Dk
        return tokens * sh.Hv * per
    per = 2 * sh.C * (sh.N + sh.P) + 4 * sh.P * sh.N
    return tokens * sh.H * per


def conv_halo_bytes(sh, B: int, e: int, layout: str, cp: int) -> int:
    """Bytes a rank receives (= sends) for the conv's halo per direction: K - 1 tokens of
    its channels from the run before each of its runs (contiguous one, zigzag two;
    striped whole shards from min(K - 1, cp - 1) ranks, proportional to n: counted by
    the caller as its tokens)."""
    if cp == 1:
        return 0
    return SEGMENTS.get(layout, 1) * B * (sh.K - 1) * sh.conv_channels * e


def mixer_cp_bytes(kind: str, sh, B: int, T: int, e: int, cp: int, strategy: str,
                   layout: str) -> Tuple[int, int]:
    """(forward, backward) bytes one rank sends for one linear layer over cp ranks (T
    its local tokens): the conv's halo, then state passing's fp32 summaries (the
    all-gather, and its reduce-scatter back) or heads' all-to-alls of the kernel's inputs
    and output (key heads and B/C groups at lcm(heads, cp))."""
    if cp == 1:
        return 0, 0
    halo = conv_halo_bytes(sh, B, e, layout, cp) if layout != "striped" else \
        B * T * min(sh.K - 1, cp - 1) * sh.conv_channels * e
    if strategy == "state":
        if kind in DELTA_TYPES:
            s = summary_bytes(B, sh.Hv, (sh.Dk, sh.Dv), layout, cp, KINDS[kind])
        else:
            s = summary_bytes(B, sh.H, (sh.P, sh.N), layout, cp, "ssd")
        return halo + s, halo + s
    part = lambda n: n * (cp - 1) // cp  # noqa: E731 - an all-to-all's share
    if kind in DELTA_TYPES:
        hk = ulysses_kv_heads(sh.Hk, cp)
        gate = sh.Hv * (sh.Dk if kind == KDA else 1)  # g per key channel under KDA
        ins = B * T * (2 * hk * sh.Dk * e + sh.Hv * sh.Dv * e + (gate + sh.Hv) * 4)  # q k v; g beta fp32
        out = B * T * sh.Hv * sh.Dv * e
    else:
        g = ulysses_kv_heads(sh.G, cp)
        ins = B * T * (sh.H * sh.P * e + sh.H * 4 + 2 * g * sh.N * e)  # x, dt (fp32), B, C
        out = B * T * sh.H * sh.P * e
    return halo + part(ins) + part(out), halo + part(ins) + part(out)


def linear_kind(kind: Optional[str]) -> bool:
    return kind in KINDS
