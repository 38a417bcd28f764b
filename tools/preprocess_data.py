#!/usr/bin/env python3
"""Text -> token file pair for data.kind=tokens.

    python tools/preprocess_data.py --input a.txt b.jsonl --output-prefix data/corpus \
        [--tokenizer tokenizer.json [--eos-token '<|endoftext|>']] [--jsonl-key text]

writes data/corpus.bin + data/corpus.idx (format: ctxpar/data/indexed.py). A .txt file is
one document; a .jsonl file is one document per line, its text under --jsonl-key. Every
document gets EOS appended. Without --tokenizer the built-in byte-level tokenizer is used
(vocab 256, EOS = 0): set model.vocab_size >= the vocab printed at the end.
The pair appears only when complete: on any error nothing is left behind and the exit
status is 1 with one line on stderr naming the file (and line) that is wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ctxpar.data.indexed import IndexedDatasetWriter  # noqa: E402
from ctxpar.data.tokenizer import load_tokenizer  # noqa: E402


def documents(path: str, jsonl_key: str) -> Iterator[Tuple[str, str]]:
    """(where, text) per document of one input file."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            yield path, f.read()
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(jsonl_key), str):
                    raise ValueError(f"{path}:{n}: no string field {jsonl_key!r} "
                                     f"(choose it with --jsonl-key)")
                yield f"{path}:{n}", record[jsonl_key]
    else:
        raise ValueError(f"{path}: unknown input type (want .txt or .jsonl)")


def preprocess(inputs, output_prefix: str, tokenizer_path=None, eos_token=None,
               jsonl_key: str = "text") -> dict:
    """Tokenize every document of every input into <output_prefix>.bin/.idx; a summary."""
    for path in inputs:  # all checked before anything is written
        if not os.path.isfile(path):
            raise ValueError(f"{path}: input file does not exist")
    tok = load_tokenizer(tokenizer_path, eos_token)
    with IndexedDatasetWriter(output_prefix, tok.vocab_size, tok.eos_id) as writer:
        for path in inputs:
            for where, text in documents(path, jsonl_key):
                if not text.strip():
                    continue  # an empty document would be a lone EOS
                try:
                    ids = tok.encode(text)
                except UnicodeError as e:
                    raise ValueError(f"{where}: cannot tokenize ({e})") from None
                writer.add_document(ids)
    # offsets: 0, then each document's end (its tokens + EOS), as the .idx stores them
    return {"prefix": output_prefix, "documents": len(writer.offsets) - 1,
            "tokens": writer.offsets[-1],
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.name,
            "dtype": writer.dtype.__name__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".txt or .jsonl files")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizers JSON (default: bytes)")
    p.add_argument("--eos-token", help="EOS token's name in --tokenizer (default: guessed)")
    p.add_argument("--jsonl-key", default="text", help="field holding the text (default: text)")
    args = p.parse_args(argv)
    try:
        info = preprocess(args.input, args.output_prefix, args.tokenizer, args.eos_token,
                          args.jsonl_key)
    except (OSError, ValueError, ImportError) as e:
        msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else e
        print(f"preprocess_data: error: {msg}", file=sys.stderr)
        return 1
    print(f"wrote {info['prefix']}.bin/.idx: {info['documents']} documents, "
          f"{info['tokens']} tokens ({info['dtype']}), tokenizer {info['tokenizer']} "
          f"vocab {info['vocab_size']} eos {info['eos_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
