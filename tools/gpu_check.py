"""Run this first on a new GPU node: one command checks the CUDA path and writes a report.

Versions, the GPU tests, every CUDA kernel against fp32, the CP patterns' decomposition
efficiency, attention memory against the planner, and training steps of the 1.2B config
at 32K on one GPU; one markdown report plus JSON.

    python tools/gpu_check.py                       # a GPU node: under 20 min on one H100/H200
    python tools/gpu_check.py --dry-run             # any machine, CPU included: the same
                                                    # plumbing at tiny sizes (CI runs it)
    python tools/gpu_check.py --parts env kernels --budget kernels=600 --out runs/check

Installs nothing. Each part runs in its own process under a time limit (default budgets
below, --budget to change one); a part that fails, crashes or runs out of time is
reported as such and the others still run. Writes <out>/report.md and <out>/report.json.

  env            device, driver, torch, CUDA, cuDNN, flash-attn / FlashAttention-4 /
                 DeepSpeed / triton versions, the allocator setting, which kernel 'auto'
                 picks and why the others were passed over
  pytest         python -m pytest -m gpu tests (tests/test_gpu.py on a dry run)
  linear         the linear mixers' GPU kernels (fla, mamba_ssm, causal_conv1d) against
                 ctxpar's torch path on the same bf16 inputs, one process and a simulated
                 rank of 4, with and without documents: output, final state and gradients
                 (relative error, limit 3e-2) and the time of each; skipped with the reason
                 when a library does not import
  kernels        every usable CUDA kernel (sdpa, flash_attn, flash_attn4) forward and
                 backward against the fp32 math reference computed in row blocks: bf16,
                 causal or not, GQA 8/2, head_dim 64 and 128, blocks of 1K-32K tokens; the
                 relative error of out, lse, dq, dk, dv (limit 3e-2) and the time
  cp_efficiency  tools/benchmarks/bench_ring_attention.py --simulate-ranks 8 at n = 32K and 128K,
                 H 32, Hkv 8, D 128, bf16, causal, zigzag (hybrid: Ulysses 2 x ring 4):
                 (fused attention over n / P) / (slowest rank's time)
  memory         peak CUDA memory of one attention fwd+bwd per simulated rank (ranks 0
                 and P-1, the same shapes) against the planner's (ctxpar/plan) count
  train          train.py on one GPU: configs/gpt1b_32k_3d.yaml at tp1 cp1 dp1, passkey
                 data, until --train-steps steps are logged (then stopped, nothing saved):
                 tokens/s, TFLOP/s, MFU, peak memory (medians after the first 2 steps)

Sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set, as train.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

# The script's own folder is on sys.path (python tools/gpu_check.py); imports nothing heavy.
from gpu_check_parts import TOLERANCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("env", "pytest", "kernels", "linear", "cp_efficiency", "memory", "train")
BUDGET_S = {"env": 30, "pytest": 210, "kernels": 210, "linear": 120, "cp_efficiency": 210,
            "memory": 90, "train": 240}  # 1110 s: 18.5 min at most, under 20 with the
#                                          processes' starts


# ------------------------------------------------------------------ the driver


def run_part(name: str, a) -> dict:
    """One part in its own process (its own session: on timeout the whole group goes)."""
    path = os.path.join(a.out, f"part_{name}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--run-part", name, "--out", a.out,
           "--train-steps", str(a.train_steps)] + (["--dry-run"] if a.dry_run else [])
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=a.budget[name])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's process group: ours, nothing else
        output, _ = proc.communicate()
        res = dict(status="timeout", summary=f"stopped after its {a.budget[name]:g} s budget")
    else:
        if proc.returncode == 0 and os.path.exists(path):
            res = json.load(open(path))
        else:
            res = dict(status="failed", summary=f"exited {proc.returncode}: "
                       f"{(output.strip().splitlines() or ['no output'])[-1][:300]}")
    res["seconds"] = round(time.time() - t0, 1)
    res.setdefault("data", {})
    if res["status"] != "ok":
        res["output_tail"] = output[-3000:]
    return res


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def _table(rows, cols) -> str:
    out = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(k), *spec) for _, (k, *spec) in cols) + " |")
    return "\n".join(out)


def report_md(results: dict, meta: dict) -> str:
    env = results.get("env", {}).get("data", {})
    lines = [f"# GPU check: {env.get('device', '?')} ({meta['date']})", "",
             f"`{meta['command']}`{' (dry run: tiny sizes)' if meta['dry_run'] else ''}", "",
             "| part | status | seconds | summary |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {r['summary']} |")
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    data = lambda n: results.get(n, {}).get("data", {})  # noqa: E731
    if data("kernels").get("rows"):
        lines += ["", f"## Kernels against the fp32 reference (relative error, limit "
                  f"{TOLERANCE:g})", "", _table(data("kernels")["rows"], [
                      ("kernel", ("kernel",)), ("D", ("head_dim",)), ("causal", ("causal",)),
                      ("L=S", ("L",)), ("out", ("out", ".1e")), ("lse", ("lse", ".1e")),
                      ("dq", ("dq", ".1e")), ("dk", ("dk", ".1e")), ("dv", ("dv", ".1e")),
                      ("fwd ms", ("fwd_ms", ".2f")), ("bwd ms", ("bwd_ms", ".2f")),
                      ("fwd TFLOP/s", ("fwd_tflops", ".0f")),
                      ("bwd TFLOP/s", ("bwd_tflops", ".0f")), ("ok", ("ok",))])]
    if data("linear").get("rows"):
        lines += ["", f"## Linear mixers' GPU kernels against ctxpar's torch path (relative "
                  f"error, limit {data('linear')['tolerance']:g})", "", _table(
                      data("linear")["rows"], [
                          ("op", ("op",)), ("kernel", ("kernel",)), ("where", ("where",)),
                          ("documents", ("documents",)), ("max error", ("max_err", ".1e")),
                          ("worst", ("worst",)), ("kernel ms", ("gpu_ms", ".2f")),
                          ("torch ms", ("torch_ms", ".2f")), ("speedup", ("speedup", ".1f")),
                          ("ok", ("ok",)), ("error", ("error",))])]
    if data("cp_efficiency").get("rows"):
        lines += ["", "## CP decomposition efficiency (simulated ranks)", "",
                  f"`{data('cp_efficiency')['command']}`", "", _table(
                      data("cp_efficiency")["rows"], [
                          ("comm", ("comm",)), ("u", ("ulysses",)), ("n", ("n",)), ("P", ("P",)),
                          ("kernel", ("backend",)), ("slowest rank ms", ("time_ms_max", ".1f")),
                          ("fastest rank ms", ("time_ms_min", ".1f")),
                          ("fused over n ms", ("fused_full_ms", ".1f")),
                          ("efficiency", ("decomposition_efficiency", ".3f"))])]
    if data("memory").get("rows"):
        lines += ["", "## Attention memory per simulated rank against the planner", "",
                  "measured: peak CUDA memory of one fwd+bwd over what was allocated before "
                  "it; planner: saved + buffers + dout and dq, dk, dv", "", _table(
                      data("memory")["rows"], [
                          ("comm", ("comm",)), ("u", ("ulysses",)), ("n", ("n",)),
                          ("P", ("P",)), ("rank", ("rank",)),
                          ("measured MiB", ("measured_mib", ".1f")),
                          ("planner MiB", ("planner_mib", ".1f")),
                          ("saved", ("planner_saved_mib", ".1f")),
                          ("buffers", ("planner_buffers_mib", ".1f")),
                          ("measured/planner", ("ratio", ".2f"))])]
    if data("train").get("tokens_per_s") is not None:
        t = data("train")
        lines += ["", "## Training on one GPU", "", f"`{t['command']}`", "", _table([t], [
            ("steps", ("steps",)), ("tokens/s", ("tokens_per_s", ",.0f")),
            ("step s", ("step_time_s", ".2f")), ("TFLOP/s", ("tflops_per_device", ".1f")),
            ("MFU", ("mfu", ".1%")), ("peak GiB", ("peak_mem_gib", ".1f"))])]
    for name, r in results.items():
        tail = (r.get("output_tail") or r["data"].get("tail") or "").strip()
        if r["status"] not in ("ok", "skipped") and tail:
            lines += ["", f"## {name}: {r['status']}", "", "```", tail[-2000:], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on whatever device there is (CPU included): the plumbing")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--skip", nargs="+", choices=PARTS, default=[])
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help=f"a part's time limit (defaults: {BUDGET_S})")
    p.add_argument("--train-steps", type=int, default=None,
                   help="logged training steps to wait for (default 8; 3 on a dry run)")
    p.add_argument("--out", default=None,
                   help="report directory (default runs/gpu_check/<date-time>)")
    p.add_argument("--run-part", choices=PARTS, help=argparse.SUPPRESS)  # a part's process
    a = p.parse_args(argv)
    a.out = os.path.abspath(a.out or os.path.join(ROOT, "runs", "gpu_check",
                                                  time.strftime("%Y%m%d-%H%M%S")))
    a.train_steps = a.train_steps or (3 if a.dry_run else 8)
    budget = dict(BUDGET_S)
    for item in a.budget:
        name, _, secs = item.partition("=")
        if name not in PARTS or not secs.replace(".", "", 1).isdigit():
            p.error(f"--budget {item!r}: expected PART=SECONDS with PART one of {PARTS}")
        budget[name] = float(secs)
    a.budget = budget
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.run_part:  # inside a part's own process
        from ctxpar.distributed.parallel_state import cuda_allocator_defaults
        cuda_allocator_defaults()  # before this process touches CUDA; train.py, pytest and
        #                            the benchmark it starts inherit it
        import gpu_check_linear
        import gpu_check_parts
        part = f"part_{a.run_part}"
        fn = getattr(gpu_check_parts, part, None) or getattr(gpu_check_linear, part)
        res = fn(a)
        with open(os.path.join(a.out, f"part_{a.run_part}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0
    if not a.dry_run:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; --dry-run runs the same plumbing at tiny "
                  "sizes on the CPU", file=sys.stderr)
            return 2
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), dry_run=a.dry_run,
                command="python tools/gpu_check.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]))
    results = {}
    for name in [n for n in a.parts if n not in a.skip]:
        print(f"gpu_check: {name} (budget {a.budget[name]:g} s) ...", flush=True)
        results[name] = run_part(name, a)
        r = results[name]
        print(f"gpu_check: {name}: {r['status']} in {r['seconds']} s: {r['summary']}",
              flush=True)
    for name in a.skip:
        results[name] = dict(status="skipped", seconds=0, summary="--skip", data={})
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(dict(meta=meta, parts=results), f, indent=1, default=str)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(report_md(results, meta))
    print(f"gpu_check: wrote {os.path.join(a.out, 'report.md')} and report.json")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
