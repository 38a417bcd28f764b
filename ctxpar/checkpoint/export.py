"""A Hugging Face folder written from ctxpar weights: config.json (hf.family_config), the
tensors as transformers saves the family (its hooks: parts, experts, fused projections),
the run's tokenizer; checked before it counts (export_check.py: its config.json read
back as transformers reads it must mean the model exported), written beside OUT_DIR and
moved in only then, so a failed export leaves OUT_DIR as it was.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from .export_check import check_config
from .families import FAMILIES
from .hf import family_config, naming_of
from .names import to_hf
from .weight_reader import CONFIG, WEIGHTS


def tokenizer_info(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """EOS name and the token ids of the run's tokenizer.json (None: the byte-level
    tokenizer): EOS always; BOS and PAD as the tokenizer_config.json beside it names them,
    BOS else the one token its post-processor puts first (None: it does not say)."""
    if path is None:
        return None
    from ..data.tokenizer import HFTokenizer, declared_token
    tok = HFTokenizer(path)
    bos = tok.token_id(declared_token(path, "bos_token"))
    if bos is None and len(tok.bos_ids) == 1:
        bos = tok.bos_ids[0]
    return {"path": path, "eos_token": tok.eos_token,
            "ids": {"eos_token_id": tok.eos_id, "bos_token_id": bos,
                    "pad_token_id": tok.token_id(declared_token(path, "pad_token"))}}


def save_folder(out_dir: str, weights: Iterator[Tuple[str, torch.Tensor]], m,
                tokenizer: Optional[str] = None, dtype: torch.dtype = torch.float32,
                source: Optional[Dict[str, Any]] = None,
                max_positions: Optional[int] = None) -> None:
    """Write a Hugging Face folder of m's family (family_config, with the source folder's
    token ids and position limit): config.json, model.safetensors, and the tokenizer files
    when the run used a Hugging Face tokenizer. weights: (GPT name, full tensor)."""
    from safetensors.torch import save_file
    tok = tokenizer_info(tokenizer)
    # refuses a model no family holds before anything is written
    cfg = family_config(m, tok, source, max_positions)
    naming = naming_of(m)
    fam, tensors = FAMILIES[cfg["model_type"]], {}
    for n, t in weights:  # as transformers' save_pretrained writes the family (parts,
        key = fam.mtp_key(to_hf(n, naming), m.n_layers)  # experts; its MTP layers' names)
        t = t.to(dtype) if t.is_floating_point() else t  # token-id tables stay integers
        for key, part in fam.to_folder(key, t, m):
            tensors[key] = part.contiguous()
    tensors = fam.saved(tensors, m)  # what takes several tensors at once (fusing)
    for copy, source in fam.mtp_copies(m).items():  # the MTP layers' embedding and head
        tensors[copy] = tensors[source].clone()
    with _written_whole(out_dir) as work:  # checked, then moved into out_dir
        save_file(tensors, os.path.join(work, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(work, CONFIG), "w") as f:
            json.dump({**cfg, "torch_dtype": str(dtype).replace("torch.", "")}, f, indent=2)
        if tok is not None:
            _save_tokenizer(work, tok, cfg)
        # read back as transformers reads it: the same model, or nothing is written
        check_config(work, m, os.path.join(out_dir, CONFIG))


@contextlib.contextmanager
def _written_whole(out_dir: str):
    """A folder beside out_dir to write into; its files replace out_dir's only when the
    block ends without an error (an export that fails leaves out_dir as it was)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-",
                            dir=parent)
    try:
        yield work
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(work):
            os.replace(os.path.join(work, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_tokenizer(folder: str, tok: Dict[str, Any], cfg: Dict[str, Any]) -> None:
    """The run's tokenizer.json, and the tokenizer_config.json beside it when it had one
    (special tokens, chat template), with the run's EOS and length."""
    shutil.copyfile(tok["path"], os.path.join(folder, "tokenizer.json"))
    saved = {"tokenizer_class": "PreTrainedTokenizerFast"}
    beside = os.path.join(os.path.dirname(os.path.abspath(tok["path"])),
                          "tokenizer_config.json")
    if os.path.isfile(beside):
        with open(beside, encoding="utf-8") as f:
            saved = json.load(f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**saved, "eos_token": tok["eos_token"],
                   "model_max_length": cfg["max_position_embeddings"]}, f, indent=2)
