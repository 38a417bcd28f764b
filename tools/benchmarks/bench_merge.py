"""The LSE merge, eager against torch.compile: which one a device should run.

    python -m tools.benchmarks.bench_merge --shape 1 4096 8 64 --threads 1

Times ``merge_block_eager_`` (the reference: ~7 elementwise kernels, and a full fp32 copy
of a 16-bit block) and its ``torch.compile`` (one fused kernel) on one block of out
(B, L, H, D) for fp32 and bf16 blocks, after the compile, and prints the largest
difference between the two. ctxpar runs the compiled merge on CUDA and the eager one on
CPU, where this measured it faster (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import time

import torch

from ctxpar.context_parallel.merge import merge_block_eager_


def _time(fn, args, iters):
    fn(*[a.clone() for a in args])  # warm (and, compiled, the first-call compile)
    out, lse, bo, bl = (a.clone() for a in args)
    start = time.perf_counter()
    for _ in range(iters):
        fn(out, lse, bo, bl)
    if out.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 4096, 8, 64], metavar="BLHD")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    B, L, H, D = a.shape
    fused = torch.compile(merge_block_eager_, fullgraph=True)
    print(f"merge of a ({B}, {L}, {H}, {D}) block on {a.device}, {a.threads} thread(s)")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        args = [torch.randn(B, L, H, D, generator=g), torch.randn(B, H, L, generator=g),
                torch.randn(B, L, H, D, generator=g).to(dtype), torch.randn(B, H, L, generator=g)]
        args = [x.to(a.device) for x in args]
        want, got = [x.clone() for x in args], [x.clone() for x in args]
        merge_block_eager_(*want)
        fused(*got)
        diff = max((w - g_).abs().max().item() for w, g_ in zip(want[:2], got[:2]))
        te, tc = _time(merge_block_eager_, args, a.iters), _time(fused, args, a.iters)
        print(f"  block {str(dtype).replace('torch.', ''):8} eager {te * 1e3:7.3f} ms   "
              f"compiled {tc * 1e3:7.3f} ms   compiled/eager {tc / te:5.2f}   "
              f"max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
