"""The mixers' chains and references the linear CP tests hold every strategy to.

    leaves = gdn_leaves(n, dims, dtype)                    # full-sequence inputs, one seed
    got = run_case("gdn", leaves, dims, group, layout=..., strategy=..., cu_seqlens=cu)
                                                           # "kda": kda_leaves, the same dims
    want = run_case("gdn", leaves, dims, LOCAL)            # one process, the whole sequence
    assert not mismatches(got_per_rank, want, layout, dtype)
    model_cfg = HYBRID_CONFIGS["qwen3.5"]                  # a tiny hybrid GPT's model section

A chain is the mixer's core as a model runs it: the short conv (with its halo) over the
projected channels, the split into the mixer's inputs, the gates, the CP op; Qwen3-Next's
Gated DeltaNet (q|k|v conv without bias, g = -exp(A_log) softplus(a + dt_bias), beta =
sigmoid(b), q and k l2-normalised in the kernel), Kimi Linear's KDA (the same with g =
-exp(A_log) softplus(f + dt_bias) per key channel, f the low-rank f_b(f_a(x)) a token
gives) and Mamba2's SSD (x|B|C conv with bias,
A = -exp(A_log), dt through dt_bias and softplus, D). ``run_case`` returns the output, the
final state and the gradient of every leaf and of every intermediate the mixer takes (q,
k, v, g, beta; x, B, C), for a loss over every rank's tokens plus the final state's term.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.context_parallel.layouts import rank_positions, shard_sequence
from ctxpar.context_parallel.comm import group_rank_and_size
from ctxpar.context_parallel.linear import (causal_conv1d_cp, gated_delta_rule_cp, kda_cp,
                                            ssd_cp)
from ctxpar.context_parallel.linear.lean import SEGMENT_CHUNKS

BATCH, CONV_KERNEL, CHUNK = 2, 4, 8
SEQUENCE = {"mixed", "a", "b", "f", "xBC", "dt", "dout"}  # per-token leaves; others replicated
INTERMEDIATES = {"gdn": ("q", "k", "v", "g", "beta"), "kda": ("q", "k", "v", "g", "beta"),
                 "ssd": ("x", "B", "C")}


# Two tiny hybrid GPTs over 48 tokens (cp4 zigzag: 12 a rank, segments of 6; kernel chunks
# of 4 split every segment): Qwen3.5's three Gated DeltaNet layers per full-attention one,
# and a Nemotron-H pattern of mamba, attention and mlp blocks.
_SMALL = dict(vocab_size=64, seq_len=48, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48,
              tie_embeddings=False, linear_chunk_size=4)
HYBRID_CONFIGS = {
    "qwen3.5": ModelConfig(n_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                           linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=6, **_SMALL),
    "nemotron-h": ModelConfig(n_layers=4, layer_types=["mamba", "attention", "mlp", "mamba"],
                              mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=8,
                              n_groups=2, time_step_min=0.01, **_SMALL),
}
# OLMo Hybrid's options on Gated DeltaNet layers around a full-attention one: post-norm
# attention blocks (reordered_norms), q/k norms over all heads, beta in [0, 2], its gated
# norm's own epsilon. Apart from HYBRID_CONFIGS, whose every entry the planner's,
# generation's and the GPU dry run's tests loop over: test_hybrid_gpt holds these options
# over CP and TP, test_plan their saved bytes on an attention-only model, test_hf the family.
OLMO_HYBRID_CONFIG = ModelConfig(
    n_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                             "linear_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=6, qk_norm=True, qk_norm_scope="all_heads",
    reordered_norms=["full_attention"], linear_allow_neg_eigval=True, linear_norm_eps=1e-5,
    **_SMALL)

# Kimi Linear's pattern, three KDA layers per attention one (Kimi Linear's is MLA without
# RoPE; full attention stands in for it here), four heads of 8 (Kimi's are ungrouped)
# Both linear mixers and both other blocks in four layers (Gated DeltaNet, Mamba2,
# attention, MLP): tests/test_linear_tiles.py's ZeRO-3 case, test_pipeline.py's tiled one.
GDN_MAMBA_CONFIG = ModelConfig(
    n_layers=4, layer_types=["linear_attention", "mamba", "attention", "mlp"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=6, mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=8,
    n_groups=2, time_step_min=0.01, **_SMALL)
KIMI_LINEAR_CONFIG = ModelConfig(
    n_layers=4, layer_types=["kimi_delta_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, **_SMALL)


def documents(n: int):
    """Per-sample cu_seqlens over n = 48 tokens (4 ranks of 12; zigzag chunks of 6):
    sample 0 has a document starting mid-rank, a one-token one, one spanning three ranks
    (contiguous) and the sequence's last token alone; sample 1 starts documents exactly at
    rank boundaries, one of them one token long."""
    assert n == 48, n
    return [torch.tensor([0, 5, 6, 34, 47, 48], dtype=torch.int32),
            torch.tensor([0, 12, 13, 36, 48], dtype=torch.int32)]


def gdn_leaves(n: int, dims, dtype, seed: int = 0):
    """dims = (Hk, Hv, Dk, Dv[, allow_neg_eigval]). Activations and the conv weight in
    dtype, gates' parameters and states fp32 (as Qwen3-Next computes g in fp32)."""
    Hk, Hv, Dk, Dv = dims[:4]
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(mixed=r(BATCH, n, 2 * Hk * Dk + Hv * Dv).to(dtype),
                conv_weight=(0.5 * r(2 * Hk * Dk + Hv * Dv, CONV_KERNEL)).to(dtype),
                a=r(BATCH, n, Hv), b=r(BATCH, n, Hv),
                A_log=torch.rand(Hv, generator=gen).mul(2).add(0.5).log(),
                dt_bias=0.5 * r(Hv), initial_state=0.5 * r(BATCH, Hv, Dk, Dv),
                dout=r(BATCH, n, Hv, Dv).to(dtype), dfinal=r(BATCH, Hv, Dk, Dv))


def kda_leaves(n: int, dims, dtype, seed: int = 0):
    """dims = (Hk, Hv, Dk, Dv), as gdn_leaves; f the gate's per-token input (B, n, Hv*Dk),
    A_log (Hv,), dt_bias (Hv*Dk,) as Kimi Linear's forget gate holds them."""
    Hk, Hv, Dk, Dv = dims[:4]
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(mixed=r(BATCH, n, 2 * Hk * Dk + Hv * Dv).to(dtype),
                conv_weight=(0.5 * r(2 * Hk * Dk + Hv * Dv, CONV_KERNEL)).to(dtype),
                f=r(BATCH, n, Hv * Dk), b=r(BATCH, n, Hv),
                A_log=torch.rand(Hv, generator=gen).mul(2).add(0.5).log(),
                dt_bias=0.5 * r(Hv * Dk), initial_state=0.5 * r(BATCH, Hv, Dk, Dv),
                dout=r(BATCH, n, Hv, Dv).to(dtype), dfinal=r(BATCH, Hv, Dk, Dv))


def ssd_leaves(n: int, dims, dtype, seed: int = 0):
    """dims = (H, P, G, N)."""
    H, P, G, N = dims
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    width = H * P + 2 * G * N
    return dict(xBC=r(BATCH, n, width).to(dtype),
                conv_weight=(0.5 * r(width, CONV_KERNEL)).to(dtype),
                conv_bias=(0.1 * r(width)).to(dtype), dt=r(BATCH, n, H) - 1.0,
                A_log=torch.rand(H, generator=gen).mul(3).add(0.5).log(), dt_bias=0.5 * r(H),
                D=r(H), initial_state=0.5 * r(BATCH, H, P, N),
                dout=r(BATCH, n, H, P).to(dtype), dfinal=r(BATCH, H, P, N))


def _gdn(t, dims, cp, per_channel: bool = False):
    """dims (Hk, Hv, Dk, Dv[, allow_neg_eigval]): beta in [0, 2] when the fifth is true;
    per_channel: KDA (its gate from f, one decay per key channel, kda_cp)."""
    Hk, Hv, Dk, Dv = dims[:4]
    conv = {k: cp[k] for k in ("cp_group", "layout", "cu_seqlens")}
    mixed = causal_conv1d_cp(t["mixed"], t["conv_weight"], activation="silu", **conv)
    q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.unflatten(-1, (Hk, Dk)), k.unflatten(-1, (Hk, Dk)), v.unflatten(-1, (Hv, Dv))
    if per_channel:                                                     # (B, S, Hv, Dk)
        g = -t["A_log"].float().exp()[:, None] * F.softplus(
            t["f"].float() + t["dt_bias"]).unflatten(-1, (Hv, Dk))
    else:                                                               # (B, S, Hv)
        g = -t["A_log"].float().exp() * F.softplus(t["a"].float() + t["dt_bias"])
    beta = t["b"].sigmoid() * (2.0 if dims[4:] and dims[4] else 1.0)
    mid = dict(q=q, k=k, v=v, g=g, beta=beta)
    for x in mid.values():
        x.retain_grad()
    op = kda_cp if per_channel else gated_delta_rule_cp
    o, final = op(q, k, v, g, beta, initial_state=t["initial_state"], output_final_state=True,
                  use_qk_l2norm_in_kernel=True, chunk_size=CHUNK, **cp)
    return o, final, mid


def _ssd(t, dims, cp):
    H, P, G, N = dims
    conv = {k: cp[k] for k in ("cp_group", "layout", "cu_seqlens")}
    xBC = causal_conv1d_cp(t["xBC"], t["conv_weight"], t["conv_bias"], activation="silu",
                           **conv)
    x, B, C = xBC.split([H * P, G * N, G * N], dim=-1)
    x, B, C = x.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
    mid = dict(x=x, B=B, C=C)
    for m in mid.values():
        m.retain_grad()
    y, final = ssd_cp(x, t["dt"], -t["A_log"].exp(), B, C, chunk_size=CHUNK, D=t["D"],
                      dt_bias=t["dt_bias"], dt_softplus=True,
                      initial_states=t["initial_state"], return_final_states=True, **cp)
    return y, final, mid


def run_case(mixer: str, leaves, dims, group, layout: str = "contiguous",
             strategy: str = "state", cu_seqlens=None, recompute_chunks: int = SEGMENT_CHUNKS):
    """{out, final, grad_<leaf>, grad_<intermediate>} of this rank (collective over group):
    the loss is sum(out * dout) over this rank's tokens plus sum(final * dfinal) / P, so the
    sum over ranks is the one-process loss. recompute_chunks: the kernels' recompute
    segments (lean.py)."""
    P = group_rank_and_size(group)[1]
    t = {k: (shard_sequence(x, 1, group, layout) if k in SEQUENCE else x).detach().clone()
         for k, x in leaves.items()}
    for k, x in t.items():
        if k not in ("dout", "dfinal"):
            x.requires_grad_()
    cp = dict(cp_group=group, layout=layout, strategy=strategy, cu_seqlens=cu_seqlens,
              recompute_chunks=recompute_chunks)
    chain = {"gdn": _gdn, "kda": partial(_gdn, per_channel=True), "ssd": _ssd}[mixer]
    out, final, mid = chain(t, dims, cp)
    loss = (out.float() * t["dout"].float()).sum() + (final * t["dfinal"]).sum() / P
    loss.backward()
    res = dict(out=out.detach(), final=final.detach())
    res.update({f"grad_{k}": x.grad for k, x in t.items() if x.grad is not None})
    res.update({f"grad_{k}": x.grad for k, x in mid.items()})
    return res


def linear_tolerance(dtype, expected: torch.Tensor) -> dict:
    """Why these tolerances. fp32: CP computes the same fp32 math as one process in
    another order (the state composed from segment summaries, the output corrected by
    q~ S_in; the heads strategy is the same kernel on fewer heads), differences of a few
    1e-7 of the tensor's scale, so 1e-5 of it catches any real error (a state missing one
    segment or leaking across a document moves results by O(0.1) of it). bf16: both sides
    start from the same bf16 inputs and compute in fp32, but each rounds its result to bf16
    (a step of 2^-8 relative) from slightly different fp32 values, and a gradient of a
    bf16 tensor that both a rank and its halo neighbour feed is two bf16 roundings on CP
    against one; so 2^-7 relative plus 2^-7 of the tensor's largest entry absolute."""
    scale = max(1.0, expected.abs().max().item())
    if dtype == torch.float32:
        return dict(atol=1e-5 * scale, rtol=1e-5)
    return dict(atol=2 ** -7 * scale, rtol=2 ** -7)


def mismatches(per_rank, want, layout: str, dtype) -> list:
    """What differs from one process (empty when nothing does): per-token tensors at each
    rank's positions, the final state on every rank, replicated leaves' gradients summed
    over the ranks (their share each, the CP gradient reduction's sum)."""
    P, found = len(per_rank), []
    n = want["out"].shape[1]
    for key, ref in want.items():
        if key == "final":
            got = [(f"rank {r}", res[key], ref) for r, res in enumerate(per_rank)]
        elif key == "out" or key.removeprefix("grad_") in SEQUENCE | set().union(
                *INTERMEDIATES.values()):
            got = [(f"rank {r}", res[key], ref[:, rank_positions(n, r, P, layout)])
                   for r, res in enumerate(per_rank)]
        else:
            got = [("sum over ranks", sum(res[key].float() for res in per_rank), ref)]
        for where, a, b in got:
            try:
                torch.testing.assert_close(a.float(), b.float(),
                                           **linear_tolerance(dtype, b.float()))
            except AssertionError as e:
                found.append(f"{key} ({where}): {str(e).splitlines()[-3:]}")
    return found
