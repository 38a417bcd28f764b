"""Convert ctxpar checkpoints: to a Hugging Face folder of the model's family (Llama, Qwen2,
Qwen3, Mistral, Gemma 3), or show a Hugging Face folder's model.* section for
model.init_from.

    python tools/convert_checkpoint.py runs/tiny_cpu --to hf out/tiny-llama
    python tools/convert_checkpoint.py runs/x/checkpoints/step_00000400 --to hf out/x \
        --dtype bfloat16
    python tools/convert_checkpoint.py path/to/qwen3 --model-config     # YAML for model.init_from

The checkpoint may be a step_* folder, a save_dir (its newest complete tag) or a run dir,
saved on any layout (tp, cp, pp, dp, ZeRO stage): it goes through DeepSpeed's universal
form in a temp dir (ctxpar/checkpoint/universal.py), on this machine, no processes.
The export writes the family model.family names (the one model.init_from's folder had;
ctxpar/checkpoint/families/): config.json + model.safetensors, and tokenizer.json +
tokenizer_config.json when the run trained with data.tokenizer set. A run started from a
folder keeps its token ids (bos, eos, pad; the run's tokenizer's where it names them)
and its max_position_embeddings when that is more than the trained seq_len
(docs/checkpoints.md).
Exit codes: 0 done, 2 bad input (one line: a damaged checkpoint, a model no family can
hold, a config field or tensor ctxpar cannot represent, a missing path).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, is_dataclass
import os
import sys

import torch
import yaml

from ctxpar.checkpoint import CheckpointError, export_hf
from ctxpar.checkpoint import hf
from ctxpar.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a ctxpar checkpoint (tag, save_dir or run dir), or a Hugging "
                                "Face folder with --model-config")
    p.add_argument("--to", nargs=2, metavar=("FORMAT", "OUT_DIR"),
                   help="'hf' and the folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="dtype of the exported weights (default float32, the master copy)")
    p.add_argument("--model-config", action="store_true",
                   help="print the model: section matching a Hugging Face folder (for "
                        "init_from)")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(args.path):
            raise CheckpointError(f"{args.path} does not exist")
        if args.model_config:
            fields = hf.model_fields(hf.read_config(args.path), args.path)
            m = ModelConfig(**fields)
            hf.WeightReader(args.path, m.tie_embeddings, hf.naming_of(m)).check(m)
            fields = {**{k: asdict(v) if is_dataclass(v) else v  # model.moe: a section
                         for k, v in fields.items() if k != "init_std"},
                      "init_from": args.path}
            print(yaml.safe_dump({"model": fields}, sort_keys=False), end="")
            return 0
        if args.to is None or args.to[0] != "hf":
            p.error("give --to hf OUT_DIR (or --model-config)")
        out = args.to[1]
        notes = []
        tag_dir = export_hf(args.path, out, DTYPES[args.dtype], notes)
    except CheckpointError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"convert_checkpoint: note: {note}", file=sys.stderr)
    arch = hf.read_config(out)["architectures"][0]
    print(f"wrote {out}: {arch} from {tag_dir} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
