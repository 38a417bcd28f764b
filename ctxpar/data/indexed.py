"""The token file pair: <prefix>.bin (flat tokens) + <prefix>.idx (header + document offsets).

.idx, little-endian:
    magic     8 bytes  b"CTXPIDX1"
    version   u32      2 (1: the same without the tokenizer field, still read)
    itemsize  u32      2 (tokens are uint16) or 4 (uint32)
    vocab     u32      tokenizer vocab size (every token id < vocab)
    eos_id    u32      id that ends every document
    n_docs    u64
    n_tokens  u64
    tokenizer 80 bytes which tokenizer made the ids, ASCII, NUL-padded: "byte-level" or
                       "sha256:<hex digest of its tokenizer.json>" (tokenizer.tokenizer_identity)
    offsets   i64[n_docs + 1]   document d is tokens[offsets[d]:offsets[d+1]], EOS last
.bin: n_tokens tokens of that dtype, documents back to back, each ending with eos_id. The
file is therefore already the packed stream (Megatron's --append-eod): the loader cuts
windows straight out of the memory map.

Writes are atomic: both files are written under temporary names and renamed only when
complete (.bin first, then .idx), so an error leaves neither a half file nor a stale pair.
Every read problem raises DataError with one line naming the file and what is wrong.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import List, Sequence

import numpy as np

from .tokenizer import BYTE_LEVEL

MAGIC = b"CTXPIDX1"
VERSION = 2
HEADER_V1 = struct.Struct("<8sIIIIQQ")  # magic, version, itemsize, vocab, eos_id, n_docs, n_tokens
HEADER = struct.Struct("<8sIIIIQQ80s")  # version 2: + the tokenizer's identity
DTYPES = {2: np.uint16, 4: np.uint32}


class DataError(ValueError):
    """A dataset problem, in one line naming the file and what is wrong."""


def dtype_for(vocab_size: int):
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.uint16 if vocab_size <= 2 ** 16 else np.uint32


def encode_document(ids: Sequence[int], vocab_size: int, eos_id: int) -> np.ndarray:
    """One document as it is stored: ids + [eos_id] in dtype_for(vocab_size), range-checked."""
    arr = np.asarray(list(ids) + [eos_id], dtype=np.int64)
    if arr.min() < 0 or arr.max() >= vocab_size:
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    return arr.astype(dtype_for(vocab_size))


class IndexedDatasetWriter:
    """Stream documents into <prefix>.bin/.idx; use as a context manager.

        with IndexedDatasetWriter("data/corpus", vocab_size=256, eos_id=0) as w:
            w.add_document([72, 105])      # stored as [72, 105, 0]

    tokenizer: the identity of the tokenizer that made the ids (tokenizer_identity):
    "byte-level" (ByteTokenizer's ids, the default) or "sha256:..." of a tokenizer.json.
    """

    def __init__(self, prefix: str, vocab_size: int, eos_id: int, tokenizer: str = BYTE_LEVEL):
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the vocabulary (size {vocab_size})")
        if not tokenizer or len(tokenizer.encode("ascii")) > HEADER.size - HEADER_V1.size:
            raise ValueError(f"tokenizer={tokenizer!r}: want 'byte-level' or 'sha256:<hex>'")
        self.prefix, self.vocab_size, self.eos_id = prefix, vocab_size, eos_id
        self.tokenizer = tokenizer
        self.dtype = dtype_for(vocab_size)
        self.offsets: List[int] = [0]
        suffix = f".tmp-{os.getpid()}"
        self._tmp = {ext: prefix + ext + suffix for ext in (".bin", ".idx")}
        self._bin = None

    def __enter__(self):
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin = open(self._tmp[".bin"], "wb")
        return self

    def add_document(self, ids: Sequence[int]) -> None:
        arr = encode_document(ids, self.vocab_size, self.eos_id)
        arr.tofile(self._bin)
        self.offsets.append(self.offsets[-1] + len(arr))

    def add_encoded(self, bin_path: str, lengths: Sequence[int]) -> None:
        """Append a file of documents already made by encode_document (same vocab and EOS),
        back to back, of the given lengths: how parallel workers' parts are merged."""
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 22)
        ends = self.offsets[-1] + np.cumsum(np.asarray(lengths, dtype=np.int64))
        self.offsets.extend(ends.tolist())

    def __exit__(self, exc_type, exc, tb):
        self._bin.close()
        try:
            if exc_type is None:
                if len(self.offsets) == 1:
                    raise ValueError(f"{self.prefix}: no documents to write (all inputs empty?)")
                with open(self._tmp[".idx"], "wb") as f:
                    f.write(HEADER.pack(MAGIC, VERSION, np.dtype(self.dtype).itemsize,
                                        self.vocab_size, self.eos_id, len(self.offsets) - 1,
                                        self.offsets[-1], self.tokenizer.encode("ascii")))
                    np.asarray(self.offsets, dtype="<i8").tofile(f)
                os.replace(self._tmp[".bin"], self.prefix + ".bin")
                os.replace(self._tmp[".idx"], self.prefix + ".idx")
        finally:
            for path in self._tmp.values():  # left over only on error
                if os.path.exists(path):
                    os.remove(path)
        return False


class IndexedDataset:
    """Read-only view of <prefix>.bin/.idx; ``tokens`` is an np.memmap of all n_tokens;
    ``tokenizer`` the identity of the tokenizer that made it (None: a version-1 file,
    written before the index recorded it)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        for path in (idx, bin_):
            if not os.path.exists(path):
                raise DataError(f"{path}: does not exist (data.path={prefix!r} must be the "
                                f"prefix written by tools/preprocess_data.py)")
            if not os.path.isfile(path):
                raise DataError(f"{path}: is not a regular file")
        raw = _read(idx)
        if len(raw) < HEADER_V1.size:
            raise DataError(f"{idx}: truncated index ({len(raw)} bytes, the header alone "
                            f"is {HEADER_V1.size})")
        magic, version, itemsize, vocab, eos, n_docs, n_tokens = HEADER_V1.unpack_from(raw)
        if magic != MAGIC:
            raise DataError(f"{idx}: not a ctxpar token index (magic {magic!r}, want "
                            f"{MAGIC!r}); make it with tools/preprocess_data.py")
        if version not in (1, VERSION):
            raise DataError(f"{idx}: index version {version}, this reader knows 1 and "
                            f"{VERSION}")
        header = HEADER_V1 if version == 1 else HEADER
        self.tokenizer = None
        if version == VERSION:
            if len(raw) < HEADER.size:
                raise DataError(f"{idx}: truncated index ({len(raw)} bytes, the header alone "
                                f"is {HEADER.size})")
            self.tokenizer = HEADER.unpack_from(raw)[-1].rstrip(b"\0").decode("ascii",
                                                                              "replace")
        if itemsize not in DTYPES:
            raise DataError(f"{idx}: token size {itemsize} bytes, want 2 or 4")
        if n_docs == 0:
            raise DataError(f"{idx}: holds no documents")
        want = header.size + 8 * (n_docs + 1)
        if len(raw) != want:
            raise DataError(f"{idx}: corrupt index ({len(raw)} bytes, its header says "
                            f"{want} for {n_docs} documents)")
        offsets = np.frombuffer(raw, dtype="<i8", offset=header.size).astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 1):
            raise DataError(f"{idx}: corrupt index (document offsets are not increasing "
                            f"from 0 to n_tokens={n_tokens})")
        size = _size(bin_)
        if size != n_tokens * itemsize:
            raise DataError(f"{bin_}: {size} bytes, but {idx} describes {n_tokens} tokens x "
                            f"{itemsize} bytes = {n_tokens * itemsize} (truncated or from "
                            f"another run?)")
        self.dtype = DTYPES[itemsize]
        self.vocab_size, self.eos_id = int(vocab), int(eos)
        self.doc_offsets = offsets  # (n_docs + 1,)
        # n_tokens >= 1 here (every document holds at least its EOS), so the map is valid.
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r", shape=(int(n_tokens),))

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.doc_offsets) - 1

    def __getitem__(self, d: int) -> np.ndarray:
        """Document d's tokens, EOS included."""
        return self.tokens[self.doc_offsets[d]:self.doc_offsets[d + 1]]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def _size(path: str) -> int:
    try:
        with open(path, "rb") as f:  # opening proves it is readable, not just present
            return os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
