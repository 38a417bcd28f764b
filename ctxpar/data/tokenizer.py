"""Tokenizers: a built-in byte-level one, and an adapter for a local Hugging Face JSON file.

ByteTokenizer: a token is a UTF-8 byte, ids 0..255, vocab_size = 256 (fits the default
model.vocab_size and divides by any tp up to 256). Id 0, the NUL byte, is EOS: text never
needs NUL, so encode() drops NULs and id 0 always means "end of document".

HFTokenizer wraps ``tokenizers.Tokenizer.from_file(tokenizer.json)`` (a local file, never a
download). ``tokenizers`` is not a dependency: it is imported only when one is asked for.
A model folder's tokenizer.json comes as transformers saves it: its EOS is the
``eos_token`` of the tokenizer_config.json beside it (Llama 3's <|end_of_text|>, Qwen's
<|endoftext|> or <|im_end|>, Mistral's </s>, Gemma's <eos>; Megatron's HF tokenizer takes
the same), and its vocab_size counts the ids text and EOS can give, not the special tokens
added past the model's rows (Gemma 3's <image_soft_token>, id 262144 of a 262144-row
embedding).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import List, Optional, Sequence

# Tried in order when --eos-token is not given (GPT-2/Llama-3, Llama/T5, generic).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
BYTE_LEVEL = "byte-level"  # the identity of ByteTokenizer's ids (tokenizer_identity)


class ByteTokenizer:
    """UTF-8 bytes as ids; EOS = 0 (NUL)."""

    vocab_size = 256
    eos_id = 0
    bos_ids: List[int] = []  # none: a document or prompt starts with its text
    name = "byte"
    identity = BYTE_LEVEL

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8").replace(b"\x00", b""))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eos_id).decode("utf-8", "replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizers`` JSON file; EOS found by name (or given)."""

    def __init__(self, path: str, eos_token: Optional[str] = None):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--tokenizer {path}: file does not exist")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"--tokenizer {path} needs the 'tokenizers' package "
                              f"(pip install tokenizers), or leave --tokenizer out for "
                              f"the built-in byte-level tokenizer") from None
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                             ) from None
        declared = None if eos_token else declared_token(path, "eos_token")
        names = (eos_token,) if eos_token else (declared,) if declared else EOS_CANDIDATES
        ids = [self._tok.token_to_id(n) for n in names]
        found = [(n, i) for n, i in zip(names, ids) if i is not None]
        if not found:
            where = (f"the eos_token {declared!r} of the tokenizer_config.json beside it is "
                     f"not in it" if declared else f"no EOS token among {', '.join(names)}")
            raise ValueError(f"--tokenizer {path}: {where}; name it with --eos-token")
        self.eos_token, self.eos_id = found[0]
        # 1 + the largest id encode() or EOS can give: the model's vocabulary and the
        # added tokens that are not special (special ones only come from their own text).
        added = self._tok.get_added_tokens_decoder()
        # What the tokenizer's post-processor puts before a text (Llama's, Mistral's and
        # Gemma's BOS; Qwen's nothing), as transformers encodes a document or a prompt.
        self.bos_ids: List[int] = self._prefix()
        self.vocab_size = 1 + max([self.eos_id, *self._tok.get_vocab(
            with_added_tokens=False).values(), *(i for i, t in added.items() if not t.special)])
        self.name = f"hf:{os.path.basename(path)}"
        self.identity = tokenizer_identity(path)

    def _prefix(self) -> List[int]:
        """The ids encoding with special tokens puts before a text's own."""
        try:
            plain = self._tok.encode("a", add_special_tokens=False).ids
            full = self._tok.encode("a", add_special_tokens=True).ids
        except Exception:  # a vocabulary without "a" nor an unknown token: no text at all
            full = self._tok.encode("", add_special_tokens=True).ids
            return full[:-1] if full and full[-1] == self.eos_id else full
        starts = [i for i in range(len(full) - len(plain) + 1)
                  if full[i:i + len(plain)] == plain]
        return full[:starts[0]] if starts else []

    def token_id(self, token: Optional[str]) -> Optional[int]:
        """The id of a token by its text (None when it is not in the vocabulary)."""
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> List[int]:
        # The text's ids only: pieces (long-context haystacks) join without special tokens;
        # documents and prompts start with bos_ids, and the writer appends EOS.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def declared_token(path: str, key: str) -> Optional[str]:
    """A special token (key: eos_token, bos_token, pad_token) of the tokenizer_config.json
    beside a tokenizer.json (what transformers saves with it), or None when there is none."""
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    try:
        with open(config, encoding="utf-8") as f:
            token = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):  # an AddedToken as older transformers wrote it
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def tokenizer_identity(path: Optional[str]) -> str:
    """Which tokenizer made a token file's ids, as its .idx records it (indexed.py):
    "byte-level" for the built-in one (path None), else "sha256:" + the hex digest of the
    tokenizer.json's bytes (another file, or the same tokenizer saved again differently,
    is another identity)."""
    if path is None:
        return BYTE_LEVEL
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise FileNotFoundError(f"{path}: cannot read ({e.strerror})") from None
    return "sha256:" + digest.hexdigest()


def short_identity(identity: str) -> str:
    """A tokenizer identity for a message: "byte-level" or "sha256:" and 12 hex digits."""
    return identity if identity == BYTE_LEVEL else identity[:19]


def load_tokenizer(path: Optional[str] = None, eos_token: Optional[str] = None):
    """The byte tokenizer when path is None, else the HF tokenizer JSON at path."""
    if path is None:
        if eos_token is not None:
            raise ValueError("--eos-token only applies with --tokenizer (the byte "
                             "tokenizer's EOS is id 0)")
        return ByteTokenizer()
    return HFTokenizer(path, eos_token)
