"""mHC's parameters in a bf16 model: kept in fp32 (transformers' _keep_in_fp32_modules_strict
for attn_hc, ffn_hc, hc_head) against the model's dtype (what DeepSpeed's bf16 engine trains).

    python -m tools.benchmarks.bench_mhc_dtype

A tiny GPT with model.hyper_connections (N = 4 streams, 20 Sinkhorn steps), its mHC maps
moved off their init (fn larger, base and scale random, as trained maps), one fp32
forward as the reference; then the model cast to bf16 twice, once with every parameter
bf16 and once with the mHC maps' parameters put back in fp32 (the maps compute in fp32
from casts of both either way, models/hyper_connections.py). Reports each forward's
relative error of the logits (||diff|| / ||ref||) against the fp32 one.
"""
from __future__ import annotations

import argparse
import copy

import torch

from ctxpar.config import ModelConfig
from ctxpar.config.hyper_connections import HyperConnectionsConfig
from models.gpt import GPT
from models.options import ModelOptions


def is_mhc(name: str) -> bool:
    return "_hc." in name or name.startswith("hc_head.")


def logits_error(ref: GPT, tokens: torch.Tensor, mhc_fp32: bool) -> float:
    """||logits(bf16 model) - logits(ref)|| / ||logits(ref)||."""
    positions = torch.arange(tokens.shape[1])
    model = copy.deepcopy(ref).to(torch.bfloat16)
    if mhc_fp32:
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if is_mhc(name):
                p.data = q.data.clone()
    with torch.no_grad():
        want = ref(tokens, positions).float()
        got = model(tokens, positions).float()
    return ((got - want).norm() / want.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2,
                      n_layers=args.layers, seq_len=args.seq_len, init_std=0.05,
                      hyper_connections=HyperConnectionsConfig(streams=4, sinkhorn_iters=20))
    torch.manual_seed(0)
    ref = GPT(cfg, options=ModelOptions(seed=3))
    with torch.no_grad():  # maps off their init: larger fn, random base and scale
        for name, p in ref.named_parameters():
            if is_mhc(name):
                p.add_(torch.randn_like(p) * (0.5 if name.endswith(".fn") else 1.0))
    tokens = torch.randint(0, cfg.vocab_size, (4, args.seq_len))
    for keep in (False, True):
        print(f"bf16 model, mHC parameters {'fp32' if keep else 'bf16'}: logits relative "
              f"error against fp32 {logits_error(ref, tokens, keep):.3e}")


if __name__ == "__main__":
    main()
