"""The parts of tools/gpu_check.py, each run in its own process (``--run-part NAME``).

Each ``part_<name>(args)`` returns {"status": "ok"|"failed", "summary": one line, "data":
what the report shows}; args has dry_run, out (the report directory) and train_steps.
The shapes are the issue's on a GPU and tiny ones on a dry run (``sizes``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 3e-2  # relative (Frobenius) error of a bf16 kernel against fp32; a wrong mask
#                   or block is O(1), bf16 rounding ~4e-3 per value


def sizes(dry: bool) -> dict:
    """The shapes of each part: the issue's on a GPU, tiny ones for the dry run."""
    if dry:
        return dict(device="cpu", kernel_lengths=[64, 128], kernel_dims=[16, 24], heads=(4, 2),
                    cp_seq=[256], cp_ranks=2, cp_heads=(4, 2, 16), cp_dtype="fp32", ulysses=2,
                    train_set=["model.seq_len=256", "model.n_layers=2", "model.d_model=64",
                               "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
                               "model.vocab_size=256", "deepspeed.bf16.enabled=false"])
    return dict(device="cuda", kernel_lengths=[1024, 4096, 16384, 32768], kernel_dims=[64, 128],
                heads=(8, 2), cp_seq=[32768, 131072], cp_ranks=8, cp_heads=(32, 8, 128),
                cp_dtype="bf16", ulysses=2, train_set=[])


def _run(cmd, timeout=None, **kw):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


# ------------------------------------------------------------------ parts (own processes)


def part_env(a) -> dict:
    import platform
    from importlib import metadata

    import torch
    from ctxpar.context_parallel import kernels
    info = dict(host=platform.node(), python=platform.python_version(), torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    for pkg in ("flash-attn", "flash-attn-4", "deepspeed", "triton", "nvidia-cutlass-dsl",
                "fla-core", "mamba-ssm", "causal-conv1d", "tilelang"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    device = torch.device(sizes(a.dry_run)["device"])
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                    sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    devices=torch.cuda.device_count())
        smi = shutil.which("nvidia-smi")
        smi = smi and _run([smi, "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi and smi.returncode == 0 \
            else None
    else:
        info.update(device="cpu (no CUDA)", driver=None)
    q = torch.empty(1, 1, 8, 128, device=device, dtype=torch.bfloat16)
    backend, reason = kernels.choose_auto(q)
    info["auto_bf16"] = f"{backend.name} ({reason})"
    info["kernels"] = {n: (b.why_not(q) if hasattr(b, "why_not") else "") or "usable"
                       for n, b in kernels.BACKENDS.items()}
    from ctxpar.context_parallel.linear import kernels as linear_kernels
    info["linear_kernels"] = {  # Qwen3-Next's head dims (state passing widens v to 256)
        op: linear_kernels.KERNELS[op][linear_kernels.gpu_kernel_name(op)].why_not(
            q, key_dim=128, value_dim=256, channels=8192, width=4) or "usable"
        for op in linear_kernels.KERNELS}
    return dict(status="ok", summary=f"{info['device']}, torch {info['torch']}, CUDA "
                f"{info['cuda']}, driver {info['driver']}, flash-attn {info['flash-attn']}, "
                f"flash-attn-4 {info['flash-attn-4']}", data=info)


def part_pytest(a) -> dict:
    target = "tests/test_gpu.py" if a.dry_run else "tests"
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                 "-rfE", target])
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    last = lines[-1].strip("= ") if lines else "no output"
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return dict(status="ok" if proc.returncode == 0 else "failed", summary=last,
                data=dict(returncode=proc.returncode, failed=failed,
                          tail=(proc.stdout + proc.stderr)[-4000:]))


def _timed(fn, device, repeats: int = 3):
    """(fn's result, its best time of `repeats` calls in seconds; CUDA synchronised)."""
    import torch
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        res = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return res, best


def part_kernels(a) -> dict:
    import torch
    from ctxpar.context_parallel import kernels
    from ctxpar.context_parallel.stats import attention_flops, square_pairs
    from ctxpar.testing.attention import reference_attention_in_rows
    sz = sizes(a.dry_run)
    device, (H, Hkv) = torch.device(sz["device"]), sz["heads"]
    usable, skipped = [], {}
    for name in ("sdpa", "flash_attn", "flash_attn4"):
        b = kernels.BACKENDS[name]
        probes = [torch.empty(1, 1, H, D, device=device, dtype=torch.bfloat16)
                  for D in sz["kernel_dims"]]
        why = sorted({b.why_not(x) if hasattr(b, "why_not") else
                      "" if b.available(x) else "cannot run it" for x in probes} - {""})
        if why:
            skipped[name] = "; ".join(why)
        else:
            usable.append(name)
    rows = []
    for D in sz["kernel_dims"]:
        for causal in (True, False):
            for L in sz["kernel_lengths"]:
                g = torch.Generator(device=device).manual_seed(L + D)
                q, dout = (torch.randn(1, L, H, D, device=device, generator=g)
                           .to(torch.bfloat16) for _ in "qo")
                k, v = (torch.randn(1, L, Hkv, D, device=device, generator=g)
                        .to(torch.bfloat16) for _ in "kv")
                scale = D ** -0.5
                ref = reference_attention_in_rows(q, k, v, dout, causal, scale)
                flops = attention_flops(1, H, D, square_pairs(L, causal), "fwd")
                for name in usable:
                    b = kernels.BACKENDS[name]
                    out, lse = b.forward(q, k, v, causal, scale)  # warm-up: FlashAttention-4
                    b.backward(dout, q, k, v, out, lse, causal, scale)  # compiles per shape
                    (out, lse), t_f = _timed(lambda: b.forward(q, k, v, causal, scale), device)
                    grads, t_b = _timed(lambda: b.backward(dout, q, k, v, out, lse, causal,
                                                           scale), device)
                    errs = {n: float((x.float() - r).norm() / r.norm().clamp_min(1e-30))
                            for n, x, r in zip(("out", "lse", "dq", "dk", "dv"),
                                               (out, lse, *grads), ref)}
                    rows.append(dict(kernel=name, head_dim=D, causal=causal, L=L, H=H, Hkv=Hkv,
                                     **errs, fwd_ms=1e3 * t_f, bwd_ms=1e3 * t_b,
                                     fwd_tflops=flops / t_f / 1e12,
                                     bwd_tflops=2.5 * flops / t_b / 1e12,
                                     ok=max(errs.values()) < TOLERANCE))
                del ref
    bad = [r for r in rows if not r["ok"]]
    status = "failed" if bad or not rows else "ok"
    return dict(status=status, summary=f"{len(rows) - len(bad)}/{len(rows)} within "
                f"{TOLERANCE:g} ({', '.join(usable) or 'no kernel'}; not usable: "
                f"{skipped or 'none'})", data=dict(rows=rows, skipped=skipped))


def part_cp_efficiency(a) -> dict:
    sz = sizes(a.dry_run)
    H, Hkv, D = sz["cp_heads"]
    out = os.path.join(a.out, "bench_ring_attention.json")
    cmd = [sys.executable, "-m", "tools.benchmarks.bench_ring_attention", "--simulate-ranks",
           str(sz["cp_ranks"]), "--seq-len", *map(str, sz["cp_seq"]), "--heads", str(H),
           "--kv-heads", str(Hkv), "--head-dim", str(D), "--dtype", sz["cp_dtype"],
           "--device", sz["device"], "--layout", "zigzag", "--causal", "--ulysses",
           str(sz["ulysses"]), "--json", out]
    cmd += ["--iters", "1", "--warmup", "1", "--threads", "1"] if a.dry_run else \
        ["--iters", "3", "--warmup", "1"]
    proc = _run(cmd)
    if proc.returncode != 0:
        return dict(status="failed", summary=f"bench_ring_attention.py exited "
                    f"{proc.returncode}", data=dict(tail=(proc.stdout + proc.stderr)[-4000:]))
    rows = json.load(open(out))["rows"]
    keep = ("comm", "ulysses", "n", "P", "backend", "time_ms_max", "time_ms_min",
            "fused_full_ms", "decomposition_efficiency")
    rows = [{k: r.get(k) for k in keep} for r in rows]
    eff = ", ".join(f"{r['comm']}@{r['n']}: {r['decomposition_efficiency']:.2f}" for r in rows)
    return dict(status="ok", summary=eff, data=dict(rows=rows, command=" ".join(cmd[1:])))


def planner_attention_bytes(comm: str, n: int, P: int, u: int, H: int, Hkv: int, D: int,
                            e: int) -> dict:
    """The planner's bytes for one attention layer on one CP rank: what it saves for
    backward (q, k, v, out, lse; ctxpar.plan.counts.attention_saved) and its working
    buffers at the backward's peak beside dout, dq, dk, dv (ctxpar.plan.transients.
    attention_backward, which counts the kernel's dq, dk, dv itself: they are taken off
    here). The one place this tool calls the planner (its API may move; adapt here)."""
    from ctxpar.config import Config, ModelConfig
    from ctxpar.plan import counts, transients
    from ctxpar.plan.candidate import Candidate
    cfg = Config(model=ModelConfig(vocab_size=256, seq_len=n, n_layers=1, d_model=H * D,
                                   n_heads=H, n_kv_heads=Hkv))
    cand = Candidate(tp=1, cp=P, pp=1, dp=1, cp_comm=comm, ulysses=u, token_layout="zigzag")
    s = counts.rank_shapes(cfg.model, cand)
    grads = s.N * (s.h + 2 * s.hk) * s.hd * e
    return dict(saved=counts.attention_saved(s, e, cand),
                buffers=transients.attention_backward(s, cand, e) - grads)


def part_memory(a) -> dict:
    import torch
    from ctxpar.context_parallel import NoComm, context_parallel_attention
    sz = sizes(a.dry_run)
    device, P, (H, Hkv, D) = torch.device(sz["device"]), sz["cp_ranks"], sz["cp_heads"]
    dtype = torch.bfloat16 if sz["cp_dtype"] == "bf16" else torch.float32
    e = torch.finfo(dtype).bits // 8
    rows = []
    for n in sz["cp_seq"]:
        for comm in ("ring", "allgather", "ulysses", "hybrid"):
            u = P if comm == "ulysses" else sz["ulysses"] if comm == "hybrid" else 1
            plan = planner_attention_bytes(comm, n, P, u, H, Hkv, D, e)
            s = n // P  # tokens per rank
            predicted = plan["saved"] + plan["buffers"] + s * (2 * H + 2 * Hkv) * D * e
            #                                       dout and dq (H), dk and dv (Hkv)
            for rank in sorted({0, P - 1}):
                measured = None
                if device.type == "cuda":
                    groups = dict(ulysses_group=NoComm(rank % u, u),
                                  ring_group=NoComm(rank // u, P // u)) if comm == "hybrid" \
                        else dict(cp_group=NoComm(rank, P))

                    def step():
                        q, k, v = (torch.randn(1, s, h, D, device=device, dtype=dtype)
                                   .requires_grad_() for h in (H, Hkv, Hkv))
                        out = context_parallel_attention(q, k, v, comm=comm, causal=True,
                                                         layout="zigzag", **groups)
                        out.backward(torch.randn_like(out))
                    step()  # warm-up: kernels chosen, the fused merge compiled
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    measured = torch.cuda.max_memory_allocated() - base
                rows.append(dict(comm=comm, ulysses=u, n=n, P=P, rank=rank,
                                 measured_mib=None if measured is None else measured / 2**20,
                                 planner_mib=predicted / 2**20,
                                 planner_saved_mib=plan["saved"] / 2**20,
                                 planner_buffers_mib=plan["buffers"] / 2**20,
                                 ratio=None if measured is None else measured / predicted))
    measured = [r["ratio"] for r in rows if r["ratio"] is not None]
    summary = (f"measured/planner {min(measured):.2f}-{max(measured):.2f}" if measured else
               "planner only (no CUDA memory statistics on this device)")
    return dict(status="ok", summary=summary, data=dict(rows=rows))


def _logged_steps(path: str) -> list:
    """The training lines of a metrics.jsonl being written (a partial last line is skipped)."""
    steps = []
    for ln in open(path) if os.path.exists(path) else []:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if "tokens_per_s" in rec:
            steps.append(rec)
    return steps


def part_train(a) -> dict:
    import statistics
    sz = sizes(a.dry_run)
    run_dir = os.path.join(a.out, "train")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    sets = ["parallel.tp=1", "parallel.cp=1", "parallel.dp=1", "train.global_batch_size=1",
            "train.micro_batch_size=1", "train.steps=100000", "train.eval_interval=0",
            "data.kind=passkey", "logging.log_interval=1", "logging.wandb.mode=disabled",
            f"logging.run_dir={run_dir}", "checkpoint.save_interval=0", *sz["train_set"]]
    cmd = [sys.executable, "train.py", "--config", "configs/gpt1b_32k_3d.yaml", "--set", *sets]
    log = open(os.path.join(a.out, "train.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    steps = []
    while proc.poll() is None and len(steps) < a.train_steps:
        time.sleep(1)
        steps = _logged_steps(metrics)
    steps = steps if len(steps) >= a.train_steps else _logged_steps(metrics)
    if proc.poll() is None:
        proc.kill()  # enough steps: stop before the end-of-run eval and checkpoint
    proc.wait()
    log.close()
    if len(steps) < a.train_steps:
        tail = open(os.path.join(a.out, "train.log")).read()[-4000:]
        return dict(status="failed", summary=f"train.py stopped after {len(steps)} steps "
                    f"(exit {proc.returncode}); see train.log", data=dict(tail=tail))
    later = steps[2:] or steps

    def med(key):
        vals = [s[key] for s in later if s.get(key) is not None]
        return statistics.median(vals) if vals else None
    data = dict(command=" ".join(cmd[1:]), steps=len(steps), tokens_per_s=med("tokens_per_s"),
                step_time_s=med("step_time_s"), tflops_per_device=med("tflops_per_device"),
                mfu=med("mfu"), peak_mem_gib=max(s["peak_mem_bytes"] for s in steps) / 2**30,
                loss=[s["loss"] for s in steps])
    mfu = f", MFU {data['mfu']:.1%}" if data["mfu"] is not None else ""
    return dict(status="ok", summary=f"{data['tokens_per_s']:,.0f} tokens/s, "
                f"{data['tflops_per_device']:.1f} TFLOP/s{mfu}, peak "
                f"{data['peak_mem_gib']:.1f} GiB", data=data)
