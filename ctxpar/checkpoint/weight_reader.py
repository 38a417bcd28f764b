"""Full tensors of a Hugging Face folder by GPT name: the safetensors files, their index, and
every family's layout of them (hf.py maps config.json; this reads the weights).

A tensor may be stored whole under its transformers name (names.py), in parts
(OLMo Hybrid's [q | k | v]), fused with another (Qwen3-Next's Gated DeltaNet
projections), per expert (the mixtures of experts' ``experts.N.*``, families/experts.py)
or quantized (gpt-oss's MXFP4, dequantized as transformers does): the folder's family
says which through its hooks (families/base.py); this file names no family. ``check``
reads the headers alone and refuses, naming it, a missing, misshapen or unreadable tensor
and one ctxpar would not use.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict, Optional

import torch

from ..config import ModelConfig
from ..config.layers import LAYER_MIXERS, layer_types
from ..config.moe import hash_layers, moe_layer_indices
from ..config.parameters import parameter_specs
from .families import WRAPPERS, folder_family
from .families.experts import assemble, assembled_shape, per_expert_sources
from .mxfp4 import dequantize_mxfp4, mxfp4_shape, mxfp4_sources
from .names import to_hf
from .resume import CheckpointError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DTYPES = ("F32", "BF16", "F16")  # safetensors dtypes ctxpar reads
INDEX_DTYPES = ("I64", "I32")  # those of a hash-routed layer's token-id table (tid2eid)


def folder_buffers(m: ModelConfig) -> Dict[str, tuple]:
    """{GPT name: shape} of the buffers a folder holds beside the parameters: each MoE
    layer's router correction bias (model.moe.score_correction_bias: transformers'
    e_score_correction_bias, models/moe.py), the MTP depths' after the blocks' (model.mtp.
    moe), the hash-routed layers' token-id tables instead (model.moe.hash_layers:
    DeepSeek-V4's tid2eid), and each block's layer scalar (model.layer_scalar: Gemma 4's,
    models/block.py)."""
    out = {}
    hashed = set(hash_layers(m.moe))
    out.update({f"layers.{i}.mlp.gate.tid2eid": (m.vocab_size, m.moe.top_k) for i in hashed})
    if m.moe is not None and m.moe.score_correction_bias:
        types = layer_types(m)
        mtp = m.mtp.depth if m.mtp is not None and m.mtp.moe else 0
        out.update({f"layers.{i}.mlp.gate.e_score_correction_bias": (m.moe.num_experts,)
                    for i in moe_layer_indices(m.moe, m.n_layers)
                    if LAYER_MIXERS[types[i]][1] and i not in hashed})
        out.update({f"mtp.layers.{k}.block.mlp.gate.e_score_correction_bias":
                    (m.moe.num_experts,) for k in range(mtp)})
    if m.layer_scalar:
        out.update({f"layers.{i}.layer_scalar": (1,) for i in range(m.n_layers)})
    return out


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def read_raw_config(path: str) -> Dict[str, Any]:
    file = os.path.join(path, CONFIG)
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable config.json ({e})") from None


class WeightReader:
    """Full tensors of a Hugging Face folder by GPT name, read one at a time (safetensors,
    lazily; opening reads the headers only)."""

    IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved

    def __init__(self, path: str, tied: bool, naming: str = "default"):
        from safetensors import safe_open
        # a multimodal folder: the language model under its prefix, the rest left out
        self.wrapper = WRAPPERS.get(read_raw_config(path).get("model_type")) \
            if is_hf_folder(path) else None
        index = os.path.join(path, WEIGHTS_INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a readable safetensors index "
                                      f"({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
            if absent:
                raise CheckpointError(f"{path}: {absent[0]} is named in {WEIGHTS_INDEX} but "
                                      f"absent (an interrupted download? fetch it again)")
        elif os.path.isfile(os.path.join(path, WEIGHTS)):
            files, weight_map = [WEIGHTS], None
        else:
            raise CheckpointError(f"{path}: neither {WEIGHTS} nor {WEIGHTS_INDEX} (ctxpar "
                                  f"reads safetensors: save the model with transformers' "
                                  f"save_pretrained, which writes them)")
        self.path, self.tied, self.naming, self._where = path, tied, naming, {}
        self._files = []
        for f in files:
            try:
                self._files.append((f, safe_open(os.path.join(path, f), framework="pt")))
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{os.path.join(path, f)}: not a readable safetensors "
                                      f"file ({e})") from None
        for f, handle in self._files:
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key) != f:
                    raise CheckpointError(f"{os.path.join(path, f)} holds {key!r}, which "
                                          f"{WEIGHTS_INDEX} places in {weight_map.get(key)}")
                self._where[key] = handle
        # the folder's family (a multimodal folder's text family): its hooks say how it
        # names and lays out tensors; a MoE family's experts saved per expert: {fused
        # key: parts}; gpt-oss's quantized experts
        self.family = folder_family(read_raw_config(path).get("model_type")
                                    if is_hf_folder(path) else None)
        self._experts = per_expert_sources(self._where, self.family.expert_naming)
        self._mxfp4 = mxfp4_sources(self._where) if self.family.mxfp4 else {}
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(self._where))
            if lost:
                raise CheckpointError(f"{path}: {lost[0]!r} is named in {WEIGHTS_INDEX} but "
                                      f"not in {weight_map[lost[0]]} (a damaged shard)")
        self.used = set()

    def key(self, gpt_name: str) -> str:
        key = self.family.mtp_key(self.family.folder_key(to_hf(gpt_name, self.naming)),
                                  self._config.get("num_hidden_layers", 0))
        if self.wrapper is not None and key.startswith("model."):
            return self.wrapper.prefix + key[len("model."):]
        return key

    def sources(self, gpt_name: str) -> list:
        """Where the folder may hold a parameter: alternatives, each a tuple of tensors
        concatenated on dim 0 (the family's sources: OLMo Hybrid's [q | k | v] parts);
        the first the folder has all of, else the first."""
        key = self.key(gpt_name)
        options = self.family.sources(key)
        return next((o for o in options if all(k in self._where for k in o)), options[0])

    def _kept(self, key: str, m: Optional[ModelConfig] = None) -> bool:
        """Not a buffer, nor a tensor of what a multimodal folder leaves out, nor a
        tensor its family leaves out (multi-token prediction layers, kept when m has
        model.mtp)."""
        return not key.endswith(self.IGNORED) and not (
            self.wrapper is not None and key.startswith(self.wrapper.left_out)) and \
            not (self.family.left_out(key, self._config) and (m is None or m.mtp is None))

    def left_out(self) -> list:
        """The folder's tensors its family leaves out (multi-token prediction layers)."""
        return sorted(k for k in self._where if self.family.left_out(k, self._config))

    def get(self, gpt_name: str) -> torch.Tensor:
        key = self.key(gpt_name)
        if key not in self._where and key in self._experts:
            self.used.update(k for part in self._experts[key] for k in part)
            return assemble(self._experts[key], lambda k: self._where[k].get_tensor(k))
        if key not in self._where and key in self._mxfp4:  # dequantized as transformers does
            blocks, scales = self._mxfp4[key]
            self.used.update((blocks, scales))
            return self.family.from_folder(key, dequantize_mxfp4(
                self._where[blocks].get_tensor(blocks), self._where[scales].get_tensor(scales)),
                self._config)
        split = self.family.fused_source(key)
        if split is not None:  # a part of a fused tensor (Qwen3-Next's projections)
            fused, part = split
            if fused not in self._where:
                raise CheckpointError(f"{self.path}: no tensor {fused!r} (for {gpt_name})")
            self.used.add(fused)
            return self.family.unfuse(fused, self._where[fused].get_tensor(fused), part,
                                      self._config, self.path)
        keys = self.sources(gpt_name)
        for k in keys:
            if k not in self._where:
                raise CheckpointError(f"{self.path}: no tensor {k!r} (for {gpt_name})")
        self.used.update(keys)
        parts = [self._where[k].get_tensor(k) for k in keys]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.family.from_folder(key, t, self._config)

    def buffers(self, m: ModelConfig) -> Dict[str, torch.Tensor]:
        """{GPT name: tensor} of the buffers a folder holds beside the parameters
        (folder_buffers: the routers' correction biases, the layer scalars)."""
        out = {}
        for name in folder_buffers(m):
            key = self.key(name)
            if key not in self._where:
                raise CheckpointError(f"{self.path}: no tensor {key!r} (for {name})")
            self.used.add(key)
            out[name] = self._where[key].get_tensor(key)
        return out

    def check_mtp_copies(self, m: ModelConfig) -> None:
        """The copies a folder stores of the embedding and head in its MTP layers
        (Family.mtp_copies: DeepSeek-V3's, GLM-4.5's) equal what they copy: ctxpar's MTP
        depths share the model's (DeepSeek-V3 §2.2), so a copy that differs is refused,
        never dropped. Reads both tensors of each."""
        for copy, source in self.family.mtp_copies(m).items():
            if copy not in self._where:
                continue
            self.used.add(copy)
            if not torch.equal(self._where[copy].get_tensor(copy),
                               self._where[source].get_tensor(source)):
                raise CheckpointError(f"{self.path}: {copy} differs from {source}: ctxpar's "
                                      f"MTP layers share the model's embedding and head "
                                      f"(a folder whose copies differ is not imported)")

    @functools.cached_property
    def _config(self) -> Dict[str, Any]:
        """The folder's config.json, read once (a fused tensor's sizes come from it)."""
        return read_raw_config(self.path)

    def unused(self) -> list:
        """Tensors of the folder no parameter took (tied lm_head copies and buffers aside)."""
        left = set(self._where) - self.used
        if self.tied:
            left.discard("lm_head.weight")
        return sorted(k for k in left if self._kept(k))

    def _check_tensor(self, key: str, want: tuple) -> None:
        """The folder holds `key` with shape `want` in a dtype ctxpar reads."""
        if key not in self._where:
            why = (" (tie_word_embeddings is false: an untied model needs its head; set "
                   "tie_word_embeddings true in config.json if it is tied)"
                   if key == "lm_head.weight" else "")
            raise CheckpointError(f"{self.path}: no tensor {key!r}{why}")
        sl = self._where[key].get_slice(key)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        if shape != want:
            raise CheckpointError(f"{self.path}: {key} has shape {shape}, config.json "
                                  f"makes it {want}")
        kinds = INDEX_DTYPES if key.endswith("tid2eid") else DTYPES  # V4's expert tables
        if dtype not in kinds:
            raise CheckpointError(f"{self.path}: {key} is {dtype}; ctxpar reads "
                                  f"{', '.join(kinds)} (dequantize or convert it first)")

    def check(self, m: ModelConfig) -> None:
        """Every parameter of m has its tensor in the folder with its full shape and a dtype
        ctxpar reads, and the folder holds no tensor ctxpar would not use; reads headers
        only (before any process group exists)."""
        want, taken = {}, set()  # key: its shape; per-expert and MXFP4 parts of fused ones
        for spec in parameter_specs(m):
            key = self.key(spec.name)
            if key not in self._where and key in self._experts:
                parts = [k for part in self._experts[key] for k in part]
                taken.update(parts)
                self._check_experts(key, parts, spec)
                continue
            if key not in self._where and key in self._mxfp4:
                taken.update(self._mxfp4[key])
                self._check_mxfp4(key, spec)
                continue
            split = self.family.fused_source(key)
            if split is not None:  # the fused tensor's shape
                want[split[0]] = self.family.fused_shape(split[0], m)
                continue
            keys = self.sources(spec.name)
            if len(keys) == 1:
                want[keys[0]] = self.family.folder_shape(key, spec.shape)
                continue
            for key in keys:  # every part present before their sizes are compared
                if key not in self._where:
                    self._check_tensor(key, spec.shape)  # names the missing one
            # the parts' rows as the family sections them, else each part's own (only
            # their sum counts)
            rows = self.family.part_rows(m, keys) or [
                self._where[k].get_slice(k).get_shape()[0] for k in keys]
            for key, n in zip(keys, rows):
                want[key] = (n, *spec.shape[1:])
            if sum(rows) != spec.shape[0]:
                raise CheckpointError(f"{self.path}: {', '.join(keys)} have {sum(rows)} rows "
                                      f"together, config.json makes them {spec.shape[0]}")
        for name, shape in folder_buffers(m).items():  # the buffers a folder holds too
            want[self.key(name)] = shape
        for copy, source in self.family.mtp_copies(m).items():  # checked equal on loading
            if copy in self._where:
                want[copy] = want[source]
        for key, shape in want.items():
            self._check_tensor(key, shape)
        extra = sorted(k for k in set(self._where) - set(want) - taken
                       if self._kept(k, m) and not (self.tied and k == "lm_head.weight"))
        if extra:
            more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
            raise CheckpointError(f"{self.path}: tensor {extra[0]!r}{more} would not be used "
                                  f"by ctxpar's model of this config.json (another "
                                  f"architecture, or weights it does not implement)")

    def _check_mxfp4(self, key, spec) -> None:
        """An MXFP4 tensor's blocks and scales: uint8, shapes that dequantize to spec's."""
        blocks, scales = (self._where[k].get_slice(k) for k in self._mxfp4[key])
        b, s = tuple(blocks.get_shape()), tuple(scales.get_shape())
        if len(b) != 4 or b[:-1] != s or mxfp4_shape(b) != self.family.folder_shape(
                key, spec.shape) \
                or {blocks.get_dtype(), scales.get_dtype()} != {"U8"}:
            raise CheckpointError(f"{self.path}: {key}_blocks {b} {blocks.get_dtype()} and "
                                  f"_scales {s} {scales.get_dtype()} are not MXFP4 of "
                                  f"{self.family.folder_shape(key, spec.shape)} (uint8 (E, R, G, 16) "
                                  f"and (E, R, G))")

    def _check_experts(self, key, parts, spec) -> None:
        """A fused tensor's per-expert parts: one shape each, the fused shape, read dtypes."""
        shape = assembled_shape(self._experts[key],
                                lambda k: self._where[k].get_slice(k).get_shape())
        if shape is None:
            raise CheckpointError(f"{self.path}: {key}'s per-expert tensors ({parts[0]} ...) "
                                  f"differ in shape or count (an expert is missing?)")
        if shape != spec.shape:
            raise CheckpointError(f"{self.path}: {key} from {parts[0]} and its {len(parts) - 1} "
                                  f"per-expert siblings has shape {shape}, config.json makes "
                                  f"it {spec.shape}")
        for k in parts:
            dtype = self._where[k].get_slice(k).get_dtype()
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: {k} is {dtype}; ctxpar reads "
                                      f"{', '.join(DTYPES)} (dequantize or convert it first)")
