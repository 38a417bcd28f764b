"""tools/gpu_check.py's `linear` part: the linear mixers' GPU kernels against ctxpar's torch path.

For each library that imports and can run bf16 on this GPU (fla's chunk_gated_delta_rule,
mamba_ssm's mamba_chunk_scan_combined, causal-conv1d's causal_conv1d_fn: ctxpar's adapters
in ctxpar/context_parallel/linear/gpu_kernels.py), the public op (gated_delta_rule_cp,
ssd_cp, causal_conv1d_cp) runs twice on the same bf16 inputs, kernel="torch" and the
library, one process and rank 1 of a simulated 4-rank zigzag group (NoComm: state
passing's widened pass and segment documents, heads' whole sequence), with and without
documents: the relative (Frobenius) error of the output, the final state and every
gradient against the torch path, and the forward+backward time of each. A library that
does not import, or that ctxpar passes over (kernels.get_kernel's reason), is reported
as skipped with the reason. A dry run (CPU) compares the torch path with itself at tiny
sizes: the plumbing.

Tolerance LINEAR_TOLERANCE (relative Frobenius, bf16): both sides read the same bf16
inputs; the torch path computes in fp32 and rounds the output once, the libraries keep
their chunk intermediates (fla's w and u, mamba's CB and states) in bf16 or fp32 with
bf16 matmul inputs, a few 2^-8 relative each; a state missing a segment, a document
leaking or a wrong head grouping is O(1).
"""
from __future__ import annotations

# gpu_check.py loads the parts as top-level modules from tools/ (its own directory)
from gpu_check_parts import _timed

LINEAR_TOLERANCE = 3e-2


def _sizes(dry: bool) -> dict:
    """B, T, (Hk, Hv, Dk, Dv), (H, P, G, N), chunk: Qwen3-Next's and Nemotron-H's heads."""
    if dry:
        return dict(device="cpu", B=1, T=32, gdn=(2, 4, 8, 8), ssd=(4, 8, 2, 8), chunk=8)
    return dict(device="cuda", B=2, T=4096, gdn=(16, 32, 128, 128), ssd=(64, 64, 8, 128),
                chunk=64)


def _inputs(op, sz, device, gen):
    import torch
    B, T = sz["B"], sz["T"]
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    bf = torch.bfloat16
    if op in ("gated_delta", "kda"):  # KDA: a log-decay per key channel
        Hk, Hv, Dk, Dv = sz["gdn"]
        gate = (B, T, Hv) + ((Dk,) if op == "kda" else ())
        return dict(q=r(B, T, Hk, Dk).to(bf), k=r(B, T, Hk, Dk).to(bf), v=r(B, T, Hv, Dv).to(bf),
                    g=-torch.rand(*gate, device=device, generator=gen) * 0.2,
                    beta=torch.rand(B, T, Hv, device=device, generator=gen).to(bf),
                    initial_state=0.1 * r(B, Hv, Dk, Dv), dout=r(B, T, Hv, Dv).to(bf),
                    dfinal=r(B, Hv, Dk, Dv))
    if op == "ssd":
        H, P, G, N = sz["ssd"]
        return dict(x=r(B, T, H, P).to(bf), dt=r(B, T, H) - 2, A=-torch.rand(
            H, device=device, generator=gen) - 0.5, B=r(B, T, G, N).to(bf),
            C=r(B, T, G, N).to(bf), D=r(H), dt_bias=0.5 * r(H),
            initial_states=0.1 * r(B, H, P, N), dout=r(B, T, H, P).to(bf),
            dfinal=r(B, H, P, N))
    Hk, Hv, Dk, Dv = sz["gdn"]
    C = 2 * Hk * Dk + Hv * Dv
    return dict(x=r(B, T, C).to(bf), weight=(0.5 * r(C, 4)).to(bf), bias=(0.1 * r(C)).to(bf),
                dout=r(B, T, C).to(bf))


def _run(op, t, kernel, group, cu, chunk):
    """(outputs, gradients) of the public op with `kernel` on this rank's share of t."""
    from ctxpar.context_parallel.linear import (causal_conv1d_cp, gated_delta_rule_cp, kda_cp,
                                                ssd_cp)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()
              if k not in ("dout", "dfinal")}
    cp = dict(cp_group=group, layout="zigzag", cu_seqlens=cu, kernel=kernel)
    if op in ("gated_delta", "kda"):
        rule = gated_delta_rule_cp if op == "gated_delta" else kda_cp
        out, final = rule(**leaves, output_final_state=True, chunk_size=chunk,
                          use_qk_l2norm_in_kernel=True, **cp)
    elif op == "ssd":
        out, final = ssd_cp(**leaves, chunk_size=chunk, dt_softplus=True,
                            return_final_states=True, **cp)
    else:
        out, final = causal_conv1d_cp(**leaves, activation="silu", **cp), None
    loss = (out.float() * t["dout"].float()).sum()
    if final is not None:
        loss = loss + (final * t["dfinal"]).sum()
    loss.backward()
    res = {"out": out.detach(), **({"final": final.detach()} if final is not None else {})}
    res.update({f"d{k}": v.grad for k, v in leaves.items() if v.grad is not None})
    return res


def part_linear(a) -> dict:
    import torch
    from ctxpar.context_parallel import LOCAL, NoComm
    from ctxpar.context_parallel.linear import kernels
    sz = _sizes(a.dry_run)
    device = torch.device(sz["device"])
    Hk, Hv, Dk, Dv = sz["gdn"]
    dims = {"gated_delta": dict(key_dim=Dk, value_dim=Dk + Dv),
            "kda": dict(key_dim=Dk, value_dim=Dk + Dv), "ssd": {}, "conv": dict(channels=2 * Hk * Dk + Hv * Dv, width=4)}
    rows, skipped = [], {}
    probe = torch.empty(1, device=device, dtype=torch.bfloat16)
    for op in kernels.KERNELS:
        name = kernels.gpu_kernel_name(op)
        why = kernels.KERNELS[op][name].why_not(probe, **dims[op])
        if why and not a.dry_run:
            skipped[op] = f"{name}: {why}"
            continue
        gpu = "torch" if a.dry_run else name  # a dry run: the plumbing, torch against itself
        t = _inputs(op, sz, device, torch.Generator(device=device).manual_seed(len(rows)))
        n = sz["T"]
        for where, group, length in (("cp1", LOCAL, n), ("cp4 rank 1 (simulated)",
                                                         NoComm(1, 4), n * 4)):
            for cu in (None, [torch.tensor([0, length // 3, length // 3 + 1, length],
                                           dtype=torch.int32)] * sz["B"]):
                run = lambda k: _run(op, t, k, group, cu, sz["chunk"])  # noqa: E731
                try:
                    run(gpu)  # warm-up: Triton compiles per shape
                    ref, t_torch = _timed(lambda: run("torch"), device)
                    got, t_gpu = _timed(lambda: run(gpu), device)
                except Exception as e:  # e.g. fla's Hopper backward refusal (fla #640)
                    rows.append(dict(op=op, kernel=gpu, where=where, documents=cu is not None,
                                     error=f"{type(e).__name__}: {e}"[:300], ok=False))
                    continue
                errs = {k: float((got[k].float() - v.float()).norm()
                                 / v.float().norm().clamp_min(1e-30)) for k, v in ref.items()}
                rows.append(dict(op=op, kernel=gpu, where=where, documents=cu is not None,
                                 worst=max(errs, key=errs.get), max_err=max(errs.values()),
                                 errors=errs, gpu_ms=1e3 * t_gpu, torch_ms=1e3 * t_torch,
                                 speedup=t_torch / t_gpu,
                                 ok=max(errs.values()) < LINEAR_TOLERANCE))
    bad = [r for r in rows if not r["ok"]]
    status = "failed" if bad else "ok"
    return dict(status=status, summary=f"{len(rows) - len(bad)}/{len(rows)} within "
                f"{LINEAR_TOLERANCE:g} of the torch path; skipped: {skipped or 'none'}",
                data=dict(rows=rows, skipped=skipped, tolerance=LINEAR_TOLERANCE))
