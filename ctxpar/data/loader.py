"""A deterministic, resumable stream of micro-batches, and its split over CP ranks.

Global sample numbering: micro-batch k of the run holds global samples
[c, c + B*dp) with c = samples consumed so far; DP rank r takes [c + r*B, c + (r+1)*B).
So DP ranks get disjoint samples, the CP (and TP, PP) ranks of one DP rank get the same
samples, and the only state is c, one integer, the same on every rank. Resuming from c
continues exactly where an uninterrupted run would be, even with a different dp.

    stream = SampleStream(source, micro_batch_size, state.dp_rank, state.dp_size)
    batch = stream.next_batch()                      # tokens, labels: (B, T) int64
    local = shard_batch(batch, state, cfg.parallel.layout)  # (B, T/cp) + positions
    ... client_state["data"] = stream.state_dict()   # in the checkpoint
"""
from __future__ import annotations

from typing import Dict, Optional, Union

import numpy as np
import torch

from .indexed import DataError, IndexedDataset
from .passkey import IGNORE_INDEX, SPLITS, PasskeyTask


class TokenWindows:
    """``windows[i] -> (inputs (T,), labels (T,))`` from a packed .bin, endless.

    The .bin is already documents back to back with EOS after each, so window w is
    tokens[w*T : w*T + T + 1] (consecutive windows share one token, as in Megatron/nanoGPT)
    and the file holds (n_tokens - 1) // T windows. This source uses ``count`` of them from
    ``first`` on (default: all), so a train and a held-out split of one file are disjoint
    stretches of text. Epoch e visits them in the order of a permutation seeded by
    (seed, split, e): every epoch is shuffled differently.
    """

    def __init__(self, data: Union[str, IndexedDataset], seq_len: int, seed: int = 0,
                 split: str = "train", first: int = 0, count: Optional[int] = None):
        self.data = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        prefix = self.data.prefix
        self.seq_len, self.seed, self.split = seq_len, seed, split
        self.vocab_size = self.data.vocab_size
        in_file = (self.data.n_tokens - 1) // seq_len
        if in_file < 1:
            raise DataError(f"{prefix}.bin: {self.data.n_tokens} tokens are fewer than one "
                            f"sample of seq_len+1 = {seq_len + 1}")
        self.first = first
        self.n_windows = in_file - first if count is None else count
        if not (0 <= first and 1 <= self.n_windows and first + self.n_windows <= in_file):
            raise ValueError(f"windows [{first}, {first + self.n_windows}) are not within the "
                             f"{in_file} windows of {prefix}.bin")
        self.fingerprint = {"kind": "tokens", "seq_len": seq_len, "seed": seed, "split": split,
                            "n_tokens": self.data.n_tokens, "windows": [first, self.n_windows]}
        self._perm_epoch, self._perm = -1, None

    def _start(self, index: int) -> int:
        """The token offset of sample index's window in the file."""
        epoch, i = divmod(index, self.n_windows)
        if epoch != self._perm_epoch:  # one epoch's order cached: 8 bytes per window
            rng = np.random.default_rng([self.seed, SPLITS[self.split], epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), epoch
        return (self.first + int(self._perm[i])) * self.seq_len

    def __getitem__(self, index: int):
        start = self._start(index)
        window = np.asarray(self.data.tokens[start:start + self.seq_len + 1], dtype=np.int64)
        return window[:-1], window[1:]  # inputs (T,), labels (T,) = inputs shifted by one

    def documents(self, index: int) -> np.ndarray:
        """Sample index's document boundaries over its inputs, from the .idx offsets:
        cu_seqlens [0, ..., T] int32, where a document ends after its EOS. A window ends
        mid-document in general; its first document is the tail of one cut at the start."""
        start, T = self._start(index), self.seq_len
        offsets = self.data.doc_offsets
        lo = np.searchsorted(offsets, start, side="right")     # first end after the start
        hi = np.searchsorted(offsets, start + T, side="left")  # first end at or past T
        return np.array([0, *(offsets[lo:hi] - start), T], dtype=np.int32)

    def document_starts(self, length: int, n: int) -> np.ndarray:
        """(k <= n, length) int64: the first `length` tokens of the first n documents that
        start in this source's stretch of the file and run at least `length` tokens inside
        it, in file order. A window's position is not a position in a document; these
        samples' are (the loss by position, ctxpar/components/long_context.py)."""
        lo, hi = self.first * self.seq_len, (self.first + self.n_windows) * self.seq_len + 1
        starts, ends = self.data.doc_offsets[:-1], self.data.doc_offsets[1:]
        keep = (starts >= lo) & (starts + length <= np.minimum(ends, hi))
        picked = starts[keep][:n]
        return np.stack([np.asarray(self.data.tokens[s:s + length], dtype=np.int64)
                         for s in picked]) if len(picked) else np.zeros((0, length), np.int64)

    def eod_positions(self, index: int) -> np.ndarray:
        """Input positions holding a document's last token (its EOS): the label there is
        the first token of the next document (Megatron's eod_mask_loss masks it)."""
        start, T = self._start(index), self.seq_len
        offsets = self.data.doc_offsets
        lo = np.searchsorted(offsets, start + 1, side="left")
        hi = np.searchsorted(offsets, start + T, side="right")  # ends in [start+1, start+T]
        return offsets[lo:hi] - start - 1


def held_out_windows(n_windows: int, eval_fraction: float) -> int:
    """Windows at the end of a token file kept for eval: round(n * f), at least 1 if f > 0."""
    return max(1, round(n_windows * eval_fraction)) if eval_fraction > 0 else 0


def _token_source(data_cfg, seq_len: int, seed: int, split: str):
    """The train or eval TokenWindows of a tokens DataConfig, or None (no held-out data).

    With data.eval_path: all of path trains, all of eval_path evaluates. Otherwise eval is
    the last data.eval_fraction of path's windows and train the rest, so train never sees
    eval text. Each file is opened once.
    """
    if data_cfg.eval_path:
        return TokenWindows(data_cfg.eval_path if split == "eval" else data_cfg.path,
                            seq_len, seed, split)
    whole = TokenWindows(data_cfg.path, seq_len, seed, split)
    n_eval = held_out_windows(whole.n_windows, data_cfg.eval_fraction)
    if n_eval >= whole.n_windows:
        raise DataError(f"{data_cfg.path}.bin: data.eval_fraction={data_cfg.eval_fraction} "
                        f"holds out {n_eval} of its {whole.n_windows} samples of "
                        f"seq_len={seq_len}, leaving none to train on")
    if not n_eval:
        return whole if split == "train" else None
    n_train = whole.n_windows - n_eval
    first, count = (n_train, n_eval) if split == "eval" else (0, n_train)
    return TokenWindows(whole.data, seq_len, seed, split, first, count)


def build_source(data_cfg, seq_len: int, seed: int, split: str = "train"):
    """PasskeyTask or TokenWindows for a DataConfig (kind 'passkey' or 'tokens').

    None for split='eval' of a tokens config with no held-out data (eval_fraction 0 and
    no eval_path): there is nothing to evaluate on that the model has not trained on.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {', '.join(SPLITS)}")
    if data_cfg.kind == "passkey":
        return PasskeyTask(seq_len, data_cfg.passkey_digits, seed, split,
                           data_cfg.passkey_docs)
    if data_cfg.kind == "tokens":
        return _token_source(data_cfg, seq_len, seed, split)
    raise ValueError(f"data.kind={data_cfg.kind!r} must be 'passkey' or 'tokens'")


class SampleStream:
    """Micro-batches of one DP rank: ``next_batch() -> {"tokens", "labels"}``, (B, T) int64.

    labels[b, t] is the token after tokens[b, t], or -100 where it is not trained on.
    documents=True adds "cu_seqlens": each sample's document boundaries over the full
    sequence, a list of B int32 tensors (flash-attn's varlen convention, one per sample);
    eod_mask_loss=True sets the label after each document's end to -100.
    """

    def __init__(self, source, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 documents: bool = False, eod_mask_loss: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.source, self.micro_batch_size = source, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.documents, self.eod_mask_loss = documents, eod_mask_loss
        self.samples_consumed = 0  # global, over all DP ranks

    def batch_at(self, first_sample: int) -> Dict[str, torch.Tensor]:
        """This rank's micro-batch of the global batch starting at first_sample (no state)."""
        start = first_sample + self.dp_rank * self.micro_batch_size
        index = range(start, start + self.micro_batch_size)
        pairs = [self.source[i] for i in index]
        batch = {"tokens": torch.from_numpy(np.stack([p[0] for p in pairs])),   # (B, T)
                 "labels": torch.from_numpy(np.stack([p[1] for p in pairs]))}   # (B, T)
        if self.eod_mask_loss:
            for b, i in enumerate(index):
                batch["labels"][b, torch.from_numpy(self.source.eod_positions(i))] = IGNORE_INDEX
        if self.documents:
            batch["cu_seqlens"] = [torch.from_numpy(self.source.documents(i)) for i in index]
        return batch

    def next_batch(self) -> Dict[str, torch.Tensor]:
        batch = self.batch_at(self.samples_consumed)
        self.samples_consumed += self.micro_batch_size * self.dp_size
        return batch

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def state_dict(self) -> Dict:
        return {"samples_consumed": self.samples_consumed,
                "source": dict(self.source.fingerprint)}

    def load_state_dict(self, state: Dict) -> None:
        """Continue after state["samples_consumed"]; refuse a checkpoint of other data."""
        if state.get("kind") == "dynamic_cp":  # ctxpar/dynamic_cp/stream.py's state
            raise DataError(f"the checkpoint's data position is a data.dynamic_cp stream's "
                            f"(step {state.get('step')}): resume it with "
                            f"data.dynamic_cp=true, or start over with --resume none")
        mine, theirs = self.source.fingerprint, state.get("source", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            said = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise DataError(f"the checkpoint's data stream differs from this config ({said})")
        self.samples_consumed = int(state["samples_consumed"])


def shard_batch(batch: Dict[str, torch.Tensor], state_or_group, layout: str,
                ulysses: Optional[int] = None,
                reset_positions: bool = False, mtp_depth: int = 0) -> Dict[str, torch.Tensor]:
    """This CP rank's part of a batch: tokens/labels (B, T) -> (B, T/cp), plus positions.

    ``positions`` (the global index of each kept token, for RoPE) comes from
    ``sequence_positions`` with the same layout, so tokens[:, i] sits at positions[i]:
    (T/cp,), or with reset_positions (B, T/cp), restarting at 0 at each document of the
    batch's "cu_seqlens" (which pass through whole: attention needs the full boundaries).
    state_or_group is a ParallelState (its cp_group, and its Ulysses degree for the
    two-level layout of hybrid CP) or a CP process group (then ulysses, default 1).
    mtp_depth D > 0 (model.mtp) adds "mtp_tokens" and "mtp_labels" (B, D, T/cp): each
    position's ids and targets D steps ahead, cut from the whole sample before sharding
    (ctxpar/data/mtp.py), masked at document ends.
    """
    from ..context_parallel.documents import document_positions
    from ..context_parallel.layouts import sequence_positions, shard_sequence
    from .mtp import mtp_inputs

    group = getattr(state_or_group, "cp_group", state_or_group)
    if ulysses is None:
        ulysses = getattr(state_or_group, "ulysses_size", 1)
    seq_len = batch["tokens"].shape[1]
    out = {k: shard_sequence(batch[k], 1, group, layout, ulysses) for k in ("tokens", "labels")}
    if mtp_depth:
        shifted = mtp_inputs(batch["tokens"], batch["labels"], mtp_depth,
                             batch.get("cu_seqlens"))
        for key, full in zip(("mtp_tokens", "mtp_labels"), shifted):  # (B, D, T) -> (B, D, T/cp)
            out[key] = shard_sequence(full, 2, group, layout, ulysses)
    out["positions"] = sequence_positions(seq_len, group, layout, ulysses=ulysses)
    if reset_positions:
        out["positions"] = document_positions(batch["cu_seqlens"], out["positions"])
    if "cu_seqlens" in batch:
        out["cu_seqlens"] = batch["cu_seqlens"]
    return out
