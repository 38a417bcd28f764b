"""A train.py run for generation: its config, a complete checkpoint, its weights at any tp, cp.

    ckpt = find_checkpoint("runs/tiny_cpu", "auto")    # run dir + latest COMPLETE tag
    cfg = load_run_config(ckpt, ["parallel.cp=2"], world_size=2)
    tokenizer = run_tokenizer(ckpt, cfg)               # the run's data.tokenizer (or bytes)
    files = inspect_checkpoint(ckpt.path)              # which DeepSpeed format, which tp
    load_weights_(model, files, state.tp_group)        # any tp; cp never matters

What a tag directory holds depends on how train.py ran (DeepSpeed 0.19.8):

    format    written by                 model files
    module    ZeRO 0, 1, 2 (pp = 1)      mp_rank_XX_model_states.pt ['module'], XX = TP rank
    zero3     ZeRO 3 (pp = 1)            zero_pp_rank_D_mp_rank_XX_{model,optim}_states.pt:
                                         the weights are only in the fp32 partitions of the
                                         optimizer files, put together by DeepSpeed's own
                                         zero_to_fp32 (per TP rank)
    pipeline  pp > 1 (ZeRO 0, 1)         layer_LL-model_XX-model_states.pt: layer LL of
                                         GPTPipe (0 embedding, 1..L blocks, L+1 final norm,
                                         L+2 untied head, L+3 model.mtp's depths; a tied
                                         head is the embedding)
    experts   ep > 1 (ZeRO 0, 1, 2)      the module files hold EP rank 0's experts only:
                                         every expert comes from the ZeRO shards (ZeRO-0:
                                         the EP ranks' files, expert_states.py) through
                                         the universal conversion (rank 0 writes it beside
                                         the tag, <save_dir>/universal/<tag>, as a resume
                                         on another layout does: expert_universal.py)

Parameters do not depend on cp (or dp, pp, ep): a checkpoint loads at any cp, and a model
at ep > 1 keeps its EP rank's experts of each expert tensor. With the checkpoint's tp,
each rank reads its own TP shard only. Another tp is resharded from full
tensors: every rank puts each parameter back together from the checkpoint's shards (the
split dim is where shard and full shape differ) and keeps its slice
(``load_full_state_dict_``); this materialises the whole model on every rank (mmap'd reads
keep the files themselves out of memory). Errors are ``CheckpointError``: one line naming
the path.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..config import Config, load_config
from ..checkpoint.resume import MARKER, is_tag, latest_complete, read_manifest
from ..data.tokenizer import load_tokenizer, short_identity, tokenizer_identity
from ..tensor_parallel import full_shape, load_full_state_dict_
from ..tensor_parallel.utils import expert_shard
from ..tensor_parallel.mappings import tp_rank_of, tp_size_of

_MODULE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


class CheckpointError(ValueError):
    """A run or checkpoint generate.py cannot use; the message names the path."""


@dataclass(frozen=True)
class RunCheckpoint:
    run_dir: str
    """The train.py run directory (its config.yaml, metrics.jsonl)."""
    path: str
    """The complete tag directory, e.g. <run_dir>/checkpoints/step_00000400."""

    @property
    def tag(self) -> str:
        return os.path.basename(self.path)


@dataclass(frozen=True)
class CheckpointFiles:
    path: str
    kind: str  # 'module', 'zero3', 'pipeline' or 'experts' (module docstring)
    tp: int    # the TP degree it was saved with


def find_checkpoint(run: str, checkpoint: str = "auto") -> RunCheckpoint:
    """The run directory and a complete tag; `run` may also be a tag directory itself."""
    run = os.path.normpath(run)
    if not os.path.isdir(run):
        raise CheckpointError(f"--run-dir {run}: no such directory")
    if is_tag(os.path.basename(run)) and not os.path.isfile(os.path.join(run, "config.yaml")):
        run_dir, save_dir, tag = os.path.dirname(os.path.dirname(run)), os.path.dirname(run), \
            os.path.basename(run)
        if checkpoint not in ("auto", tag):
            raise CheckpointError(f"--run-dir {run} is a checkpoint already; --checkpoint "
                                  f"{checkpoint} names another")
    else:
        run_dir, save_dir, tag = run, None, None
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise CheckpointError(f"--run-dir {run}: no config.yaml in {run_dir} (not a train.py run "
                              f"directory)")
    if save_dir is None:
        cfg = load_config(os.path.join(run_dir, "config.yaml"), check_paths=False)
        save_dir = cfg.checkpoint.save_dir or os.path.join(run_dir, "checkpoints")
        if checkpoint == "auto":
            tag = latest_complete(save_dir)
            if tag is None:
                raise CheckpointError(f"--run-dir {run}: no complete checkpoint in {save_dir} "
                                      f"(train.py saves at checkpoint.save_interval and at "
                                      f"the end; a tag without {MARKER} did not finish)")
        elif not is_tag(checkpoint):
            raise CheckpointError(f"--checkpoint={checkpoint!r} must be 'auto' or a tag like "
                                  f"step_00000100")
        else:
            tag = checkpoint
    path = os.path.join(save_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: no such directory")
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker: its save "
                              f"did not finish); use another tag or --checkpoint auto")
    return RunCheckpoint(run_dir, path)


def load_run_config(ckpt: RunCheckpoint, overrides: Sequence[str] = (),
                    world_size: Optional[int] = None) -> Config:
    """The run's saved config with overrides (ConfigError names the file and key), checked
    for generation: training's seq_len-per-layout rule does not apply."""
    return load_config(os.path.join(ckpt.run_dir, "config.yaml"), overrides,
                       world_size=world_size, check_paths=False, training=False)


def run_tokenizer(ckpt: RunCheckpoint, cfg: Config, path: Optional[str] = None,
                  eos_token: Optional[str] = None):
    """The tokenizer of the run's text: `path` (--tokenizer) when given, else the run's
    data.tokenizer as the checkpoint's manifest recorded it (unset: the byte-level one).

    Refused in one line (ValueError): a run's tokenizer that is not there any more, a
    tokenizer with ids past model.vocab_size, a given one whose vocabulary size is not
    that of the run's data.tokenizer (ids the model learnt for other text), and one whose
    identity (tokenizer_identity: the tokenizer.json's digest) is not the one the run
    trained with (trained_identity), as train.py refuses a token file of another tokenizer.
    """
    config = read_manifest(ckpt.path).get("config") or {}  # a pre-manifest tag: config.yaml
    recorded = (config.get("data") or {}).get("tokenizer", cfg.data.tokenizer) \
        if config else cfg.data.tokenizer
    if path is None:
        if recorded is not None and not os.path.isfile(recorded):
            raise ValueError(f"the run's data.tokenizer={recorded!r} (in {ckpt.path}/"
                             f"{MARKER}) is not a file here; give --tokenizer")
        tok, which = load_tokenizer(recorded, eos_token), \
            f"the run's data.tokenizer={recorded!r}" if recorded else "the byte-level tokenizer"
    else:
        tok, which = load_tokenizer(path, eos_token), f"--tokenizer {path}"
        if recorded is not None and os.path.isfile(recorded):
            trained = load_tokenizer(recorded, eos_token).vocab_size
            if tok.vocab_size != trained:
                raise ValueError(f"{which} has a vocabulary of {tok.vocab_size} ids, the run's "
                                 f"data.tokenizer={recorded!r} {trained}: not the tokenizer "
                                 f"the model was trained with (leave --tokenizer out)")
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"{which} has a vocabulary of {tok.vocab_size} ids, the model "
                         f"{cfg.model.vocab_size} (model.vocab_size): not the tokenizer the "
                         f"model was trained with")
    trained = trained_identity(cfg, recorded)
    used = tokenizer_identity(path if path is not None else recorded)
    if trained is not None and used != trained[0]:
        raise ValueError(f"{which} is the {short_identity(used)} tokenizer, but the run "
                         f"trained with the {short_identity(trained[0])} one ({trained[1]}): "
                         f"give that tokenizer.json as --tokenizer"
                         + (" or leave --tokenizer out" if path is not None else ""))
    return tok


def trained_identity(cfg: Config, recorded: Optional[str]):
    """(identity, where it was read) of the tokenizer the run trained with, or None where
    nothing says: the record in the run's token file (data.path's .idx, what train.py
    checked), else the run's data.tokenizer file as it is now (recorded: the manifest's);
    a run on generated passkey text with no data.tokenizer says nothing (a model imported
    from a folder keeps its own vocabulary)."""
    from ..data.indexed import DataError, IndexedDataset

    if cfg.data.kind == "tokens" and cfg.data.path:
        try:
            made = IndexedDataset(cfg.data.path).tokenizer
        except (DataError, OSError):
            made = None
        if made is not None:
            return made, f"its token file {cfg.data.path}.idx records it"
    if recorded is not None and os.path.isfile(recorded):
        return tokenizer_identity(recorded), f"its data.tokenizer={recorded!r}"
    return None


def _ranks(matches: List[re.Match], group: int, path: str, what: str) -> int:
    ranks = sorted({int(m.group(group)) for m in matches})
    if ranks != list(range(len(ranks))):
        raise CheckpointError(f"checkpoint {path}: {what} files for TP ranks {ranks}, "
                              f"expected 0..{len(ranks) - 1}")
    return len(ranks)


def inspect_checkpoint(path: str) -> CheckpointFiles:
    """Which of the formats in the module docstring `path` holds, and its TP degree."""
    marked = os.path.isfile(os.path.join(path, MARKER))
    layout = (read_manifest(path).get("layout") or {}) if marked else {}
    if layout.get("ep", 1) > 1:
        return CheckpointFiles(path, "experts", layout["tp"])
    names = os.listdir(path)
    for kind, pattern, group in (("pipeline", _LAYER, 2), ("zero3", _ZERO3, 2),
                                 ("module", _MODULE, 1)):
        found = [m for m in map(pattern.match, names) if m]
        if found:
            return CheckpointFiles(path, kind, _ranks(found, group, path, kind))
    raise CheckpointError(f"checkpoint {path}: no DeepSpeed model states "
                          f"(mp_rank_*_model_states.pt or layer_*-model_*-model_states.pt)")


def _zero3_shard(files: CheckpointFiles, tp_rank: int) -> Dict[str, torch.Tensor]:
    """TP rank tp_rank's fp32 parameters of a ZeRO-3 checkpoint, by DeepSpeed's zero_to_fp32.

    zero_to_fp32 reads one model-parallel rank (mp_rank_00, every *_optim_states.pt in
    the directory): with tp > 1 it is given a directory of links to one TP rank's files.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with tempfile.TemporaryDirectory(prefix="ctxpar-zero3-") as tmp, quiet[0], quiet[1]:
        if files.tp == 1:
            return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(files.path),
                                                            tag=os.path.basename(files.path))
        os.mkdir(os.path.join(tmp, "tag"))
        suffix = f"_mp_rank_{tp_rank:02d}_"
        for name in os.listdir(files.path):
            if suffix in name:
                os.symlink(os.path.join(os.path.abspath(files.path), name),
                           os.path.join(tmp, "tag", name.replace(suffix, "_mp_rank_00_")))
        return get_fp32_state_dict_from_zero_checkpoint(tmp, tag="tag")


def read_shard(files: CheckpointFiles, tp_rank: int, n_layers: int) -> Dict[str, torch.Tensor]:
    """TP rank tp_rank's parameters under GPT's names (``layers.3.attn.q_proj.weight``)."""
    def load(name):
        return torch.load(os.path.join(files.path, name), map_location="cpu", mmap=True,
                          weights_only=True)

    if files.kind == "module":
        return dict(load(f"mp_rank_{tp_rank:02d}_model_states.pt")["module"])
    if files.kind == "zero3":
        return _zero3_shard(files, tp_rank)
    out = {}
    for name in sorted(os.listdir(files.path)):
        m = _LAYER.match(name)
        if m and int(m.group(2)) == tp_rank:
            idx = int(m.group(1))  # GPTPipe's layer list (models/gpt_pipe.py)
            prefix = f"layers.{idx - 1}." if 1 <= idx <= n_layers else ""
            out.update({prefix + k: v for k, v in load(name).items()})
    return out


def merge_tp_shards(shards: List[Dict[str, torch.Tensor]], model, path: str
                    ) -> Dict[str, torch.Tensor]:
    """Full-size tensors from a checkpoint's TP shards, for every parameter of `model`.

    A parameter whose shard already has the full shape was replicated; otherwise the
    shards are concatenated along the one dim where shard and full shape differ.
    """
    tp_size, n = tp_size_of(model.tp_group), len(shards)
    full = {}
    for name, p in model.named_parameters():
        want = tuple(full_shape(p, tp_size))
        got = tuple(shards[0][name].shape)
        dims = [d for d, (g, w) in enumerate(zip(got, want)) if g != w]
        if got == want:
            full[name] = shards[0][name]
        elif len(got) == len(want) and len(dims) == 1 and got[dims[0]] * n == want[dims[0]]:
            full[name] = torch.cat([s[name] for s in shards], dim=dims[0])
        else:
            raise CheckpointError(f"checkpoint {path}: {name} has shards of {got} at tp={n}, "
                                  f"which do not make the model's {want}")
    return full


@torch.no_grad()
def load_weights_(model, files: CheckpointFiles, tp_group) -> None:
    """Copy the checkpoint's weights into `model` (a ctxpar.interfaces.CausalLM at any tp and
    cp), and the buffers it saved (replicated: a MoE router's e_score_correction_bias)."""
    if files.kind == "experts":
        return _load_through_universal_(model, files, tp_group)
    n_layers, tp_size = model.cfg.n_layers, tp_size_of(tp_group)
    names = {n for n, _ in model.named_parameters()}
    ranks = [tp_rank_of(tp_group)] if files.tp == tp_size else range(files.tp)
    shards = [read_shard(files, r, n_layers) for r in ranks]
    buffers = dict(model.named_buffers())
    for name in buffers.keys() & shards[0].keys():
        buffers[name].copy_(shards[0][name])
    missing = sorted(names - set(shards[0]))
    unexpected = sorted(set(shards[0]) - names - buffers.keys())
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {files.path} does not match the run's model: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if files.tp == tp_size:
        for name, p in model.named_parameters():
            ep_rank, ep = expert_shard(p)  # a model at ep > 1 keeps its EP rank's experts
            mine = shards[0][name].chunk(ep, dim=0)[ep_rank] if ep > 1 else shards[0][name]
            if tuple(mine.shape) != tuple(p.shape):
                raise CheckpointError(f"checkpoint {files.path}: {name} is "
                                      f"{tuple(shards[0][name].shape)}, the model's "
                                      f"{tuple(full_shape(p, tp_size))}")
            p.copy_(mine)
        return
    load_full_state_dict_(model, merge_tp_shards(shards, model, files.path), tp_group)


def _load_through_universal_(model, files: CheckpointFiles, tp_group) -> None:
    """An ep > 1 checkpoint: rank 0 converts it to the universal format, every expert
    whole (collective over the world); each rank keeps its slices, and the saved buffers."""
    from ..checkpoint.resume import run_on_rank0
    from ..checkpoint.universal import (full_weights, load_buffers_, naming, saved_buffers,
                                        to_universal)

    m = model.cfg
    out = os.path.join(os.path.dirname(files.path), "universal", os.path.basename(files.path))
    layout = read_manifest(files.path)["layout"]
    run_on_rank0(lambda: to_universal(files.path, out, layout, m.n_layers,
                                      naming(False, m.n_layers, True), m.moe.num_experts))
    names = [n for n, _ in model.named_parameters()]
    load_full_state_dict_(model, full_weights(out, names), tp_group)
    load_buffers_(model.named_buffers(), saved_buffers(out))
