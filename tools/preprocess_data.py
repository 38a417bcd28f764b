#!/usr/bin/env python3
"""Text -> token file pair for data.kind=tokens.

    python tools/preprocess_data.py --input corpus/ extra.jsonl.zst --output-prefix data/corpus \
        [--glob '*.md' '*.py'] [--format auto|text|jsonl] [--jsonl-key text] [--workers 8] \
        [--tokenizer tokenizer.json [--eos-token '<|endoftext|>']]

writes data/corpus.bin + data/corpus.idx (format: ctxpar/data/indexed.py).
Inputs: files, and directories walked recursively (hidden entries skipped; --glob keeps the
files whose path under the directory matches one of the patterns). Any UTF-8 text file is
read by content (ctxpar/data/corpus.py): gzip / zstd / bzip2 / xz are decompressed whatever
the name, a file of JSON lines gives one document per line (its text under --jsonl-key),
any other text file is one document; --format text|jsonl overrides the guess.
Every document gets EOS appended (and a --tokenizer's BOS first when it adds one, as
Llama's, Mistral's and Gemma's do); empty documents are skipped. Without --tokenizer the
built-in byte-level tokenizer is used (vocab 256, EOS = 0): set model.vocab_size >= the
vocab printed at the end. The .idx records which tokenizer made the ids ("byte-level" or
the sha256 of the tokenizer.json): train.py refuses a data.tokenizer that is not that one.

--workers N tokenizes N files at a time in separate processes; the output is byte-identical
for any N (documents are stored in input order). A progress bar (on a terminal) counts input
bytes; the last line gives documents, tokens and bytes, and their rates per second.
The pair appears only when complete: on any error nothing is left behind and the exit
status is 2 with one line on stderr naming the file (and line) that is wrong.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

from tqdm import tqdm

from ctxpar.data.corpus import (FORMATS, CorpusError, detect_format,
                                find_inputs, read_documents)
from ctxpar.data.indexed import IndexedDatasetWriter, encode_document
from ctxpar.data.tokenizer import load_tokenizer

EXIT_BAD_INPUT = 2

# Loaded once per worker process (and once in the main one), not once per file.
cached_tokenizer = functools.lru_cache(maxsize=None)(load_tokenizer)


def tokenize_file(path: str, fmt: str, jsonl_key: str, tokenizer, part: str) -> Dict:
    """One input file -> ``part`` (its documents, encoded and back to back); their lengths.

    Runs in a worker process: tokenizer is (path, eos_token) for cached_tokenizer.
    """
    tok = cached_tokenizer(*tokenizer)
    fmt = detect_format(path) if fmt == "auto" else fmt
    lengths, n_bytes = [], 0
    with open(part, "wb") as out:
        for where, text in read_documents(path, fmt, jsonl_key):
            n_bytes += len(text.encode("utf-8"))
            if not text.strip():
                continue  # an empty document would be a lone EOS
            try:
                arr = encode_document(tok.bos_ids + tok.encode(text), tok.vocab_size,
                                      tok.eos_id)
            except (UnicodeError, ValueError) as e:
                raise CorpusError(f"{where}: cannot tokenize ({e})") from None
            arr.tofile(out)
            lengths.append(len(arr))
    return {"part": part, "lengths": lengths, "bytes": n_bytes, "format": fmt}


def _task(args):
    i, kwargs = args
    return i, tokenize_file(**kwargs)


def preprocess(inputs, output_prefix: str, tokenizer_path=None, eos_token=None,
               jsonl_key: str = "text", fmt: str = "auto", globs=None, workers: int = 1,
               progress: Optional[bool] = None) -> dict:
    """Tokenize every document of every input into <output_prefix>.bin/.idx; a summary."""
    start = time.perf_counter()
    files = find_inputs(inputs, globs)  # all checked before anything is written
    tok = cached_tokenizer(tokenizer_path, eos_token)
    sizes = [os.path.getsize(f) for f in files]
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    made_dir = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    parts = tempfile.mkdtemp(prefix=os.path.basename(output_prefix) + ".parts-", dir=out_dir)
    tasks = [(i, {"path": f, "fmt": fmt, "jsonl_key": jsonl_key, "part": os.path.join(parts, f"{i}.bin"),
                  "tokenizer": (tokenizer_path, eos_token)}) for i, f in enumerate(files)]
    formats: Dict[str, int] = {}
    n_bytes = n_merged = 0
    pool = None
    try:
        if workers > 1 and len(files) > 1:
            # fork where there is one: the workers inherit the imports instead of redoing them
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
            pool = ctx.Pool(min(workers, len(files)))  # before tqdm starts its thread
            results = pool.imap_unordered(_task, tasks)
        else:
            results = map(_task, tasks)
        done: Dict[int, Dict] = {}  # finished, waiting for the files before them
        with IndexedDatasetWriter(output_prefix, tok.vocab_size, tok.eos_id,
                                  tok.identity) as writer, \
                tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="preprocess",
                     disable=None if progress is None else not progress) as bar:
            for i, result in results:  # in completion order; appended in input order
                bar.update(sizes[i])
                done[i] = result
                while n_merged in done:
                    r = done.pop(n_merged)
                    writer.add_encoded(r["part"], r["lengths"])
                    os.remove(r["part"])
                    formats[r["format"]] = formats.get(r["format"], 0) + 1
                    n_bytes += r["bytes"]
                    n_merged += 1
    finally:
        if pool is not None:
            pool.terminate()  # on an error, the other files' workers stop here
            pool.join()
        shutil.rmtree(parts, ignore_errors=True)
        if made_dir and not os.listdir(out_dir):  # an error: leave no trace
            os.rmdir(out_dir)
    seconds = time.perf_counter() - start
    return {"prefix": output_prefix, "files": len(files), "formats": formats,
            "documents": len(writer.offsets) - 1, "tokens": writer.offsets[-1],
            "bytes": n_bytes, "seconds": seconds,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.name,
            "dtype": writer.dtype.__name__}


def summary_line(info: dict) -> str:
    s = max(info["seconds"], 1e-9)
    formats = ", ".join(f"{n} {k}" for k, n in sorted(info["formats"].items()))
    return (f"wrote {info['prefix']}.bin/.idx: {info['documents']:,} documents, "
            f"{info['tokens']:,} tokens ({info['dtype']}) from {info['files']} files "
            f"({formats}), {info['bytes']:,} bytes of text in {info['seconds']:.1f} s: "
            f"{info['documents'] / s:,.0f} documents/s, {info['tokens'] / s:,.0f} tokens/s, "
            f"{info['bytes'] / s / 1e6:,.2f} MB/s; tokenizer {info['tokenizer']} "
            f"vocab {info['vocab_size']} eos {info['eos_id']}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="text files (plain or gzip/zstd/bzip2/xz) and directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--glob", nargs="+", metavar="PATTERN",
                   help="in directories, only files whose relative path matches "
                        "(e.g. '*.md' '*.py'; default: every file)")
    p.add_argument("--format", default="auto", choices=FORMATS,
                   help="text: a file is one document; jsonl: one JSON object per line; "
                        "auto (default): jsonl for .jsonl/.ndjson or a first line that is "
                        "a JSON object, else text")
    p.add_argument("--jsonl-key", default="text", help="field holding the text (default: text)")
    p.add_argument("--workers", type=int, default=1,
                   help="files tokenized in parallel processes (default 1)")
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizers JSON (default: bytes)")
    p.add_argument("--eos-token", help="EOS token's name in --tokenizer (default: the "
                                        "eos_token of the tokenizer_config.json beside it, "
                                        "else guessed)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    try:
        info = preprocess(args.input, args.output_prefix, args.tokenizer, args.eos_token,
                          args.jsonl_key, args.format, args.glob, args.workers)
    except (OSError, ValueError, ImportError) as e:
        msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else e
        print(f"preprocess_data: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(summary_line(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
