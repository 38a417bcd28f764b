"""An evaluation's peak memory against a training step's, on the logits-bound layout.

    python -m tools.benchmarks.bench_eval_memory                   # the docs/benchmarks.md table
    python -m tools.benchmarks.bench_eval_memory --tokens 8192 --vocab 128256

One process holds one rank's share of bench_plan_memory's "logits: cp2, vocab 32000, tiled
loss" layout: 4096 tokens, d 256, 2 layers, vocabulary 32000, fp32, memory.tiled_loss on.
Three rows, each the peak of the bytes ops allocate while Python holds them
(ctxpar.testing.memory.LiveBytes; the parameters, made before, are not counted):
  train step          forward + backward of the loss as train.py runs it (tiled loss, sum)
  eval, tiled head    what the evaluation runs: hidden states, then tiled_eval_head's
                      per-token loss and argmax a tile at a time, under no_grad
  eval, whole logits  the evaluation before the tiled head: the (tokens, V) logits, their
                      cross entropy and argmax, under no_grad
"""
from __future__ import annotations

import argparse
import time

import torch

from ctxpar.components.evaluation import head_inputs
from ctxpar.config import MemoryConfig, ModelConfig
from ctxpar.memory.tiled_eval import tiled_eval_head
from ctxpar.tensor_parallel import vocab_parallel_cross_entropy
from ctxpar.tensor_parallel.argmax import vocab_parallel_argmax
from ctxpar.testing.memory import LiveBytes
from models.gpt import GPT
from models.options import ModelOptions

MiB = 2 ** 20


def rows(tokens: int, d: int, layers: int, vocab: int):
    cfg = ModelConfig(vocab_size=vocab, seq_len=tokens, n_layers=layers, d_model=d,
                      n_heads=4, n_kv_heads=2)
    model = GPT(cfg, options=ModelOptions(memory=MemoryConfig(tiled_loss=True), seed=0))
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (1, tokens), generator=g)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    mb = {"tokens": tok, "positions": torch.arange(tokens), "labels": labels}

    def train_step():
        model(tok, mb["positions"], labels).backward()
        model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval_tiled():
        tiled_eval_head(*head_inputs(model, mb), labels)

    @torch.no_grad()
    def eval_whole():
        logits = model(tok, mb["positions"])
        vocab_parallel_cross_entropy(logits, labels)
        vocab_parallel_argmax(logits)

    out = {}
    for name, fn in (("train step", train_step), ("eval, tiled head", eval_tiled),
                     ("eval, whole logits", eval_whole)):
        fn()  # warm-up: lazily made buffers are not the step's
        with LiveBytes() as live:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        out[name] = (live.peak, seconds)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = rows(a.tokens, a.d_model, a.layers, a.vocab)
    train_peak = res["train step"][0]
    print(f"{a.tokens} tokens, d {a.d_model}, {a.layers} layers, vocab {a.vocab}, fp32")
    print("| what | peak live MiB | / train step | seconds |")
    print("|---|---:|---:|---:|")
    for name, (peak, seconds) in res.items():
        print(f"| {name} | {peak / MiB:,.1f} | {peak / train_peak:.2f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
