"""Bytes of activations saved for backward under each activation-checkpointing mode.

    python -m tools.benchmarks.bench_activation_memory       # the docs/benchmarks.md table
    python -m tools.benchmarks.bench_activation_memory --layers 8 --seq-len 4096 --d-model 512

One forward of models.gpt.GPT (one process: tp=cp=1) under
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward is
counted once per storage (views share it), parameters excluded
(ctxpar.testing.memory says how checkpointed regions count).
"""
from __future__ import annotations

import argparse

import torch

from ctxpar.config import CHECKPOINT_MODES, ModelConfig
from ctxpar.testing.memory import forward_saved_bytes
from models.gpt import GPT
from models.options import ModelOptions


def measure(cfg: ModelConfig, mode: str, batch: int, every_n_layers: int = 2,
            seed: int = 0) -> int:
    """Saved bytes of one forward + loss of a tp=cp=1 GPT in ``mode``."""
    model = GPT(cfg,
                options=ModelOptions(activation_checkpointing=mode, every_n_layers=every_n_layers,
                                     seed=seed))
    return forward_saved_bytes(model, cfg.vocab_size, batch, cfg.seq_len, seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--every-n-layers", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layers=args.layers,
                      d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads)
    print(f"GPT fp32, {args.layers} layers, d_model {args.d_model}, heads {args.heads}/"
          f"{args.kv_heads} kv, vocab {args.vocab}, batch {args.batch} x seq {args.seq_len}, "
          f"swiglu ffn {GPT(cfg, device='meta').layers[0].mlp.up_proj.out_features}, "
          f"every_n_layers={args.every_n_layers}")
    print("| mode | saved bytes | MiB | vs none |\n|---|---:|---:|---:|")
    none = None
    for mode in CHECKPOINT_MODES:
        b = measure(cfg, mode, args.batch, args.every_n_layers)
        none = none or b
        print(f"| {mode} | {b:,} | {b / 2**20:.2f} | {b / none:.2f} |")


if __name__ == "__main__":
    main()
