"""ctxpar's generation entrypoint: a train.py checkpoint, prompts in, text out, on TP x CP ranks.

    python generate.py --run-dir runs/tiny_cpu --passkey 64
    torchrun --nproc_per_node 2 generate.py --run-dir runs/tiny_cpu --passkey 64 --set parallel.cp=2
    python generate.py --run-dir runs/tiny_cpu --prompt "The sky is blue. " --max-new-tokens 40
    deepspeed --num_gpus 8 generate.py --run-dir runs/gpt7b --prompt-file p.jsonl --set parallel.tp=2

Top to bottom: the run's checkpoint and config -> prompts -> distributed -> ParallelState
(tp x cp; dp = pp = 1) -> GPT with the checkpoint's weights -> generate in batches -> rank 0
prints. The layout is the command line's, not the training run's: cp defaults to the world
size / tp, tp to 1; the parameters do not depend on cp, and another tp than the
checkpoint's is resharded from full tensors (ctxpar/inference/checkpoint.py). Prompts are
prefilled with the training ring (parallel.layout, any of them) into a KV cache sharded
over CP; every decode step merges the ranks' partial attention with the LSE rule
(docs/parallelism.md, "Inference"). --draft mtp decodes greedily with the model's MTP
layers as the draft (models/mtp_drafts.py) and prints the accepted drafts per step. Bad
input (run, checkpoint, config, prompts, options) exits 2 with one line on every rank,
before any collective.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

from ctxpar.components.cli import add_launcher_args, fail
from ctxpar.components.known_warnings import filter_known_warnings
from ctxpar.config import ConfigError
from ctxpar.data import ByteTokenizer, DataError, build_source
from ctxpar.distributed.parallel_state import launcher_env, shutdown_distributed
from ctxpar.inference import SamplingParams, check_prompts, generate
from ctxpar.inference.checkpoint import (CheckpointError, find_checkpoint, inspect_checkpoint,
                                         load_run_config, run_tokenizer)
from models.inference import DTYPES, layout_overrides, start_model
from models.mtp_drafts import generate_with_mtp_drafts
from ctxpar.inference.recompute import needs_recompute

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Not --run: torchrun's parser prefix-matches its script's flags against its own and
    # rejects --run as ambiguous (--run-path, --run_path).
    p.add_argument("--run-dir", required=True,
                   help="a train.py run directory (its config.yaml and checkpoints), or a "
                        "checkpoint tag directory inside one")
    p.add_argument("--checkpoint", default="auto",
                   help="'auto' (the latest complete checkpoint) or a tag like step_00000100")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides of the run's config, e.g. parallel.cp=4 parallel.tp=2 "
                        "parallel.layout=striped")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    what.add_argument("--prompt-file", help="one prompt per line, or .jsonl lines "
                                            "{\"prompt\": ...}")
    what.add_argument("--passkey", type=int, metavar="N",
                      help="answer N held-out passkey samples of the run's task (the eval "
                           "split train.py evaluates on) and print the exact-match accuracy")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 64 (passkey: the key's digits)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same on every rank)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer.json; default: the run's data.tokenizer "
                        "(as its checkpoint recorded it), else the byte-level tokenizer")
    p.add_argument("--eos-token", default=None, help="the HF tokenizer's EOS token name")
    p.add_argument("--output-format", choices=("text", "jsonl"), default="text")
    p.add_argument("--output", default=None, help="write to this file instead of stdout")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--draft", choices=("none", "mtp"), default="none",
                   help="mtp: the model's MTP layers draft model.mtp.depth tokens a step, "
                        "verified in one CP forward (greedy, one prompt at a time; "
                        "models/mtp_drafts.py); the accepted drafts per step are printed")
    add_launcher_args(p)
    return p.parse_args(argv)


def read_prompts(args):
    """Prompt strings from --prompt or --prompt-file (ValueError: one line)."""
    if args.prompt is not None:
        return list(args.prompt)
    path = args.prompt_file
    if not os.path.isfile(path):
        raise ValueError(f"--prompt-file {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--prompt-file {path}:{n}: not JSON ({e.msg})") from None
                if isinstance(obj, dict):
                    obj = obj.get("prompt")
                if not isinstance(obj, str):
                    raise ValueError(f"--prompt-file {path}:{n}: expected a string or "
                                     f"{{\"prompt\": string}}")
                line = obj
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompt-file {path}: no prompts in it")
    return prompts


def passkey_samples(cfg, n: int):
    """(prompt ids, key ids) of eval samples 0..n-1, the samples train.py's evaluate reads."""
    if cfg.data.kind != "passkey":
        raise ValueError(f"--passkey: the run trained on data.kind={cfg.data.kind!r}, "
                         f"not the passkey task")
    if n < 1:
        raise ValueError(f"--passkey={n} must be >= 1")
    task, d = build_source(cfg.data, cfg.model.seq_len, cfg.train.seed, "eval"), \
        cfg.data.passkey_digits
    out = []
    for i in range(n):
        inputs, labels = task[i]  # (T,): the text but its last byte; labels hold the key
        out.append((inputs[:len(inputs) - d + 1].tolist(), labels[-d:].tolist()))
    return out


def train_eval_accuracy(run_dir: str, step: int):
    """train.py's eval_accuracy at `step` from metrics.jsonl (None if not logged)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    acc = [r["eval_accuracy"] for r in rows if r.get("step") == step and "eval_accuracy" in r]
    return acc[-1] if acc else None


def main(argv=None) -> int:
    args = parse_args(argv)
    launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK from torchrun/deepspeed or srun
    filter_known_warnings()  # as train.py: DeepSpeed's deprecated torch calls
    world = int(os.environ["WORLD_SIZE"])

    # 1. Checkpoint, config, prompts: pure checks, the same verdict on every rank.
    try:
        ckpt = find_checkpoint(args.run_dir, args.checkpoint)
        cfg = load_run_config(ckpt, layout_overrides(args.set, world), world_size=world)
        files = inspect_checkpoint(ckpt.path)
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        sampling.check()
        if args.batch_size < 1:
            raise ValueError(f"--batch-size={args.batch_size} must be >= 1")
        if args.draft == "mtp" and cfg.model.mtp is None:
            raise ValueError("--draft mtp: the run's model has no MTP layers (model.mtp)")
        if args.draft == "mtp" and not sampling.greedy:
            raise ValueError("--draft mtp decodes greedily: leave --temperature at 0")
        if args.passkey is not None and (args.tokenizer or args.eos_token):
            raise ValueError(f"{'--tokenizer' if args.tokenizer else '--eos-token'} does not "
                             f"apply to --passkey (the task is byte-level)")
        tokenizer = ByteTokenizer() if args.passkey is not None else \
            run_tokenizer(ckpt, cfg, args.tokenizer, args.eos_token)
        new = args.max_new_tokens
        if args.passkey is not None:
            samples = passkey_samples(cfg, args.passkey)
            prompts, keys = [s[0] for s in samples], [s[1] for s in samples]
            new = cfg.data.passkey_digits if new is None else new
        else:
            texts = read_prompts(args)
            prompts = [tokenizer.bos_ids + tokenizer.encode(t) for t in texts]  # BOS: as HF
            new = 64 if new is None else new
        check_prompts(prompts, new, cfg.model.seq_len, cfg.model.vocab_size)
    except (CheckpointError, ConfigError, DataError, ValueError, FileNotFoundError,
            ImportError) as e:
        fail(str(e))

    # 2. Distributed, the grid, the model with the checkpoint's weights.
    model, state = start_model(cfg, files, args.dtype)
    rank0 = dist.get_rank() == 0
    if rank0 and needs_recompute(model):
        print("generation: DeepSeek-V4's compressed attention has no decode cache yet: each "
              "new token reruns the sequence through the CP forward (exact, one forward a "
              "token; ctxpar/inference/recompute.py)", flush=True)

    # 3. Generate in batches; rank 0 writes.
    results, t0, n_new, accepted, used = [], time.perf_counter(), 0, [], []
    for i in range(0, len(prompts), args.batch_size):
        if args.draft == "mtp":  # one prompt at a time, MTP drafts verified per step
            for prompt in prompts[i:i + args.batch_size]:
                drafted = generate_with_mtp_drafts(
                    model, prompt, new, layout=cfg.parallel.layout, cp_group=state.cp_group,
                    tp_group=state.tp_group, eos_id=tokenizer.eos_id,
                    max_positions=cfg.model.seq_len)
                results.append(drafted.tokens)
                accepted += drafted.accepted
                used += drafted.used
                n_new += len(drafted.tokens)
            continue
        out = generate(model, prompts[i:i + args.batch_size], new, layout=cfg.parallel.layout,
                       cp_group=state.cp_group, tp_group=state.tp_group, sampling=sampling,
                       eos_id=tokenizer.eos_id, max_positions=cfg.model.seq_len)
        results += out.tokens
        n_new += sum(len(t) for t in out.tokens)
    dt = time.perf_counter() - t0
    if rank0:
        lines = []
        if args.passkey is not None:
            correct = [r == k for r, k in zip(results, keys)]
            for j, (r, k, c) in enumerate(zip(results, keys, correct)):
                if args.output_format == "jsonl":
                    lines.append(json.dumps({"index": j, "key": tokenizer.decode(k),
                                             "generated": tokenizer.decode(r), "tokens": r,
                                             "correct": c}))
            acc = sum(correct) / len(correct)
            ref = train_eval_accuracy(ckpt.run_dir, int(ckpt.tag.split("_")[1]))
            summary = (f"passkey accuracy {acc:.3f} ({sum(correct)}/{len(correct)} held-out "
                       f"samples, {'greedy' if sampling.greedy else 'sampled'}) from "
                       f"{ckpt.path}" + (f"; train.py's eval there: {ref:.3f}"
                                         if ref is not None else ""))
        else:
            for text, r in zip(texts, results):
                done = "eos" if len(r) < new else "length"
                if args.output_format == "jsonl":
                    lines.append(json.dumps({"prompt": text, "completion": tokenizer.decode(r),
                                             "new_tokens": len(r), "stop": done}))
                else:
                    lines.append(text + tokenizer.decode(r) + "\n")
            summary = None
        if args.output:
            with open(args.output + ".tmp", "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))
            os.replace(args.output + ".tmp", args.output)
        else:
            for line in lines:
                print(line, flush=True)
        if summary:
            print(summary, flush=True)
        if args.draft == "mtp":  # the drafts' acceptance, over every step of every prompt
            steps = max(len(accepted), 1)
            print(f"mtp drafts: {sum(accepted) / steps:.3f} accepted of {cfg.model.mtp.depth} "
                  f"per step ({sum(used) / steps:.3f} used within --max-new-tokens), "
                  f"{n_new / steps:.3f} new tokens per forward ({len(accepted)} steps)",
                  file=sys.stderr, flush=True)
        print(f"{len(prompts)} prompts, {n_new} new tokens in {dt:.2f} s on tp={state.tp_size} "
              f"x cp={state.cp_size} ({cfg.parallel.layout})", file=sys.stderr, flush=True)
    shutdown_distributed()  # every group freed before exit: no gloo thread outlives main
    return 0


if __name__ == "__main__":
    sys.exit(main())
