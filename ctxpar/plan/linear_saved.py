"""What a Gated DeltaNet or Mamba2 layer saves for backward, in bytes, per rank.

Read from the code autograd records (models/gated_delta.py, models/mamba2.py, and the
torch kernels under ctxpar/context_parallel/linear/: conv.py, gated_delta.py, ssd.py,
state_passing.py, heads.py) and held to autograd's saved tensors (tests/test_plan.py).
Shapes per rank (LinearShapes): B samples of T tokens, the layer's heads on this rank,
the kernel's chunk C (nc = ceil(T / C) chunks, Tp = nc C tokens padded), the conv's K
taps over its Cc channels; e the activations' element size. The chunked kernels run in
fp32 whatever e: most of what they save is 4 bytes an element.

    conv       the K shifted taps and the silu's input, fp32: (K + 1) B T Cc 4; its
               halo (K - 1 tokens a neighbour under CP) is exchanged, not saved
    kernel     the chunked forms' intermediates: (B, H, nc, C, C) decays and scores,
               per-token (q, k, v, the triangular solves' results, the padded copies
               matmul makes), the fp32 state entering every chunk (nc B H |state|)
    around it  the gates (beta, g; dt), the gated RMSNorm and out_proj's input
"""
from __future__ import annotations

from dataclasses import dataclass


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
    """gated_delta_fp32 on (B, T) tokens of Hv heads (q, k already at Hv heads): the
    padded q, k, v, beta; k_beta, two contiguous k^T for the two (C, C) products, the two
    solves' results, the scan's per-chunk copies of the reads and k^T (2 nc - 1 of
    (B, H, C, Dk)); its written values u (B, H, C, Dv) and entering state S (B, H, Dk, Dv)
    per chunk; five (B, H, nc, C, C) (the decays, two products, the system, intra); five
    (B, H, nc, C) (decays, gamma0, the padded beta); the bool masks (B, nc, C, C), (B, nc, C)."""
    nc, Tp = _chunks(T, C)
    dk = 10 * B * Tp * Hv * Dk - B * Hv * C * Dk
    return 4 * (dk + 3 * B * Tp * Hv * Dv + B * nc * Hv * Dk * Dv + 5 * B * Tp * Hv * C
                + 5 * B * Tp * Hv) + B * Tp * C + B * Tp


def gdn_saved(B: int, T: int, g: GatedDeltaShapes, e: int, views: bool = True) -> int:
    """One GDN layer on one process (cp 1), beyond its normed input (the norm's count):
    the conv, l2norm's inputs (q and k at Hv heads in fp32, or at fp32 without grouping
    the conv's output they are views of) and rsqrt, the kernel, the gates (beta in e;
    softplus's input and output fp32; -exp(A_log)), the gated RMSNorm (its fp32 input,
    normed and gated products, silu(z)'s fp32 input, in e its weighted and gated outputs and
    out_proj's input) and its fp32 rsqrt. views=False: q, k are copies whatever the
    grouping (the heads strategy's all-to-all makes them)."""
    Cc = g.conv_channels
    conv = 4 * (g.K + 1) * B * T * Cc + (4 * Cc if e != 4 else 0)  # + weight.float() (16-bit)
    shared = views and g.Hk == g.Hv and e == 4
    l2 = 4 * (B * T * Cc if shared else 2 * B * T * g.Hv * g.Dk) + 8 * B * T * g.Hv
    gates = B * T * g.Hv * (e + 2 * 4) + 8 * g.Hv
    norm = B * T * g.Hv * (g.Dv * (3 * 4 + 3 * e) + 4)
    return conv + l2 + gdn_kernel_saved(B, T, g.Hv, g.Dk, g.Dv, g.C) + gates + norm


def ssd_kernel_saved(B: int, T: int, H: int, P: int, N: int, C: int) -> int:
    """ssd_fp32 on (B, T) tokens of H heads (B, C already at H heads): five (B, T, H, N)
    (the padded B and C's permuted copies for the two einsums, B times the decay, the
    scan's per-chunk copies of C but the first's), three (B, T, H, P) (x dt's two permuted
    copies, the scan's per-chunk products), three (B, H, nc, C, C) (the decay, C B^T,
    the scores), four (B, H, nc, C) (the decays, to_end's and from_start's products) and
    the state entering every chunk (B, H, P, N) fp32; the bool masks."""
    nc, Tp = _chunks(T, C)
    return 4 * (5 * B * Tp * H * N - B * H * C * N + 3 * B * Tp * H * P
                + 3 * B * Tp * H * C + 4 * B * Tp * H + B * nc * H * P * N) \
        + B * Tp * C + B * Tp


def mamba_saved(B: int, T: int, s: MambaShapes, e: int) -> int:
    """One Mamba2 layer on one process (cp 1), beyond its normed input: the conv; the x
    the kernel multiplies by dt and D (at fp32 the conv's output it is a view of, else an
    fp32 copy) and z for silu (at fp32 in_proj's output, else an fp32 copy); dt (softplus's
    input, clamp's input and output, fp32); -exp(A_log); the kernel; the grouped gated
    RMSNorm (y, silu(z), the gated and normed products, out_proj's input) and its rsqrt."""
    Cc, HP = s.conv_channels, s.H * s.P
    conv = 4 * (s.K + 1) * B * T * Cc
    if e == 4:
        views = 4 * B * T * (Cc + s.in_proj_rows)
        norm = 5 * 4 * B * T * HP
    else:  # fp32 copies of x and z; the conv weight and D cast to fp32
        views = 8 * B * T * HP + 4 * (Cc + s.H)
        norm = B * T * HP * (3 * 4 + 2 * e)
    dt = 3 * 4 * B * T * s.H + 8 * s.H
    return conv + views + dt + ssd_kernel_saved(B, T, s.H, s.P, s.N, s.C) + norm \
        + 4 * B * T * s.G
