"""Raw corpus files for tools/preprocess_data.py: find them, open them, read their documents.

    files = find_inputs(["books/", "extra.jsonl.zst"], globs=["*.md", "*.txt"])
    fmt = detect_format(path)                 # "text" or "jsonl", by content
    for where, text in read_documents(path, fmt, jsonl_key="text"): ...

- Inputs are files or directories; a directory is walked recursively in sorted order
  (hidden entries, names starting with ".", skipped), keeping files whose path relative to
  it matches one of the globs (``*`` crosses "/", so ``*.py`` matches at any depth).
- Compression is recognised by the first bytes, whatever the name: gzip, zstd, bzip2, xz.
- Formats: ``text`` (the whole file is one document) and ``jsonl`` (one JSON object per
  line, the document under ``jsonl_key``). ``auto`` picks jsonl for a .jsonl/.ndjson name or
  a first non-blank line that is a JSON object, text otherwise; a text file that opens with
  a JSON object (a log, say) needs ``--format text``.
- Text is UTF-8 (a leading BOM is dropped); a NUL byte or invalid UTF-8 is refused.

Every problem raises CorpusError: one line naming the file (and line) and what is wrong.
"""
from __future__ import annotations

import bz2
import fnmatch
import gzip
import io
import json
import lzma
import os
import zlib
from typing import BinaryIO, Iterator, List, Optional, Sequence, TextIO, Tuple

FORMATS = ("auto", "text", "jsonl")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2",
         b"\xfd7zXZ\x00": "xz"}
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz")
SNIFF_CHARS = 8192  # how much of a file the binary check and the format guess look at


class CorpusError(ValueError):
    """An input problem, in one line naming the file and what is wrong."""


def find_inputs(paths: Sequence[str], globs: Optional[Sequence[str]] = None) -> List[str]:
    """The files to read, in a deterministic order: paths as given, directories expanded."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            found = _walk(path, globs)
            if not found:
                raise CorpusError(f"{path}: directory has no files"
                                  + (f" matching --glob {' '.join(globs)}" if globs else ""))
            files.extend(found)
        elif os.path.exists(path):
            raise CorpusError(f"{path}: not a regular file or directory")
        else:
            raise CorpusError(f"{path}: input does not exist")
    return files


def _walk(root: str, globs: Optional[Sequence[str]]) -> List[str]:
    """Files under root, sorted by their relative path's components (as `find | sort`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if name.startswith(".") or not os.path.isfile(path):
                continue
            if globs is None or any(fnmatch.fnmatchcase(rel, g) for g in globs):
                found.append((rel.split(os.sep), path))
    return [path for _, path in sorted(found)]


def compression_of(path: str) -> Optional[str]:
    """'gzip' / 'zstd' / 'bzip2' / 'xz' from the file's first bytes, or None (plain)."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((kind for magic, kind in MAGIC.items() if head.startswith(magic)), None)


def open_binary(path: str) -> BinaryIO:
    """The file's bytes, decompressed if its first bytes say it is compressed."""
    kind = compression_of(path)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "bzip2":
        return bz2.open(path, "rb")
    if kind == "xz":
        return lzma.open(path, "rb")
    if kind == "zstd":
        return io.BufferedReader(_ZstdReader(path))
    return open(path, "rb")


def open_text(path: str) -> TextIO:
    """UTF-8 text (universal newlines, BOM dropped); invalid bytes raise on reading."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", errors="strict")


class _ZstdReader(io.RawIOBase):
    """A zstd file of one or more frames as a raw stream; a truncated last frame raises.

    (zstandard's own stream_reader ends quietly at a cut-off frame.)
    """

    def __init__(self, path: str):
        import zstandard  # a dependency (setup.py), imported only when a .zst shows up
        self._file = open(path, "rb")
        self._dctx, self._error = zstandard.ZstdDecompressor(), zstandard.ZstdError
        self._frame = None                 # the frame being decoded (a decompressobj)
        self._out, self._pos = b"", 0      # decoded bytes not yet handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            if self._frame is not None and not self._frame.eof:
                chunk = self._file.read(1 << 20)
                if not chunk:
                    raise EOFError("zstd frame cut off before its end (truncated file?)")
            else:  # between frames: what the last one left over, or the next bytes
                chunk = (self._frame.unused_data if self._frame is not None else b"") \
                    or self._file.read(1 << 20)
                if not chunk:
                    return 0  # every frame ended: a clean end of file
                self._frame = self._dctx.decompressobj()
            try:
                self._out, self._pos = self._frame.decompress(chunk), 0
            except self._error as e:
                raise EOFError(f"corrupt zstd data ({e})") from None
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def _plain_name(path: str) -> str:
    """The name without a compression suffix: data.jsonl.zst -> data.jsonl."""
    for suffix in COMPRESSED_SUFFIXES:
        if path.endswith(suffix):
            return path[:-len(suffix)]
    return path


def detect_format(path: str) -> str:
    """'jsonl' or 'text' (see the module docstring); refuses binary and non-UTF-8 files."""
    with _reading(path):
        with open_text(path) as f:
            head = f.read(SNIFF_CHARS)
            if "\x00" in head:
                raise CorpusError(f"{path}: binary file (NUL bytes), not text")
            if _plain_name(path).endswith(JSONL_SUFFIXES):
                return "jsonl"
            body = head.lstrip()
            if body and "\n" not in body:
                body += f.readline()  # the first line goes on past the sniffed part
    first = body.split("\n", 1)[0]
    if first.startswith("{"):
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except json.JSONDecodeError:
            pass
    return "text"


def read_documents(path: str, fmt: str, jsonl_key: str = "text") -> Iterator[Tuple[str, str]]:
    """(where, text) for every document of one file; fmt is 'text' or 'jsonl'."""
    with _reading(path), open_text(path) as f:
        if fmt == "text":
            text = f.read()
            if "\x00" in text:
                raise CorpusError(f"{path}: binary file (NUL bytes), not text")
            yield path, text
            return
        if fmt != "jsonl":
            raise ValueError(f"format {fmt!r} is not one of {FORMATS[1:]}")
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{n}: not valid JSON ({e.msg}; --format text "
                                  f"reads the file as one document)") from None
            if not isinstance(record, dict) or not isinstance(record.get(jsonl_key), str):
                raise CorpusError(f"{path}:{n}: no string field {jsonl_key!r} "
                                  f"(choose it with --jsonl-key)")
            yield f"{path}:{n}", record[jsonl_key]


class _reading:
    """Turns decoding and decompression failures inside the block into one-line errors."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None or issubclass(exc_type, CorpusError):
            return False
        if issubclass(exc_type, UnicodeDecodeError):
            raise CorpusError(f"{self.path}: not UTF-8 text ({exc.reason}); leave it out "
                              f"(--glob) or convert it to UTF-8") from None
        if issubclass(exc_type, (EOFError, OSError, lzma.LZMAError, zlib.error)):
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise CorpusError(f"{self.path}: cannot read ({what})") from None
        return False
