"""What train.py needs from the data side: per-rank device batches of train and eval data.

    data = build_data(cfg)                  # file checks only, no collectives (DataError)
    stream = data.train_stream(state)       # this DP rank's samples, this CP rank's tokens
    mb = stream.next_microbatch(device)     # tokens, labels (B, T/cp); positions (T/cp,)
    client_state["data"] = stream.state_dict(); ... stream.load_state_dict(client["data"])
    if data.has_eval:                       # passkey: always; tokens: a held-out split
        eval_mb = data.eval_stream(state).next_microbatch(device)  # components/evaluation.py
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .indexed import DataError
from .loader import SampleStream, build_source, shard_batch
from .tokenizer import short_identity, tokenizer_identity


class ShardedStream:
    """A SampleStream whose batches are already cut to this CP rank's layout shard
    (ulysses: the Ulysses degree of hybrid CP's two-level layout, 1 otherwise;
    reset_positions: RoPE positions restart at each document)."""

    def __init__(self, stream: SampleStream, cp_group, layout: str, ulysses: int = 1,
                 reset_positions: bool = False, document_mask: bool = False,
                 mtp_depth: int = 0):
        self.stream, self.cp_group, self.layout, self.ulysses = stream, cp_group, layout, ulysses
        self.reset_positions, self.document_mask = reset_positions, document_mask
        self.mtp_depth = mtp_depth  # model.mtp's D: the shifted ids and targets (data/mtp.py)

    def next_microbatch(self, device=None) -> Dict[str, torch.Tensor]:
        """tokens, labels (B, T/cp), positions (T/cp,) or (B, T/cp) on device; with
        documents "cu_seqlens" (B int32 tensors) stay on the host, where the attention's
        document plan is made (no device round trip)."""
        local = shard_batch(self.stream.next_batch(), self.cp_group, self.layout, self.ulysses,
                            self.reset_positions, self.mtp_depth)
        if not self.document_mask:  # boundaries only for the positions: attention unmasked
            local.pop("cu_seqlens", None)
        return {k: v if k == "cu_seqlens" else v.to(device, non_blocking=True).contiguous()
                for k, v in local.items()}

    def state_dict(self) -> Dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.stream.load_state_dict(state)


class Data:
    """The train and eval sources of a Config; sample streams per rank on demand.

    ``warnings``: lines for the entrypoint to print once (a token file too old to say
    which tokenizer made it)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.warnings: List[str] = []
        seq_len, seed = cfg.model.seq_len, cfg.train.seed
        self.train_source = build_source(cfg.data, seq_len, seed, "train")
        self.eval_source = build_source(cfg.data, seq_len, seed, "eval")  # None: no held-out
        self._check_tokenizer()
        # Passkey is byte-level and config refuses vocab_size < 256: only token files can
        # hold ids the model has no row for.
        for source, key in ((self.train_source, "path"), (self.eval_source, "eval_path")):
            if source is not None and source.vocab_size > cfg.model.vocab_size:
                raise DataError(f"{getattr(cfg.data, key) or cfg.data.path}.idx: token ids go "
                                f"up to {source.vocab_size - 1} but model.vocab_size="
                                f"{cfg.model.vocab_size}")
            docs = getattr(getattr(source, "data", None), "doc_offsets", None)
            if cfg.data.document_mask and docs is not None and len(docs) < 3:
                prefix = getattr(cfg.data, key) or cfg.data.path
                raise DataError(f"data.document_mask=true but {prefix}.idx records "
                                f"{len(docs) - 1} document: no document ends to mask at "
                                f"(pack documents with their EOS)")
        d = cfg.data
        self.documents = d.document_mask or d.reset_positions  # samples carry cu_seqlens

    def _check_tokenizer(self) -> None:
        """Each token file was made by data.tokenizer (its .idx records which tokenizer);
        a file from before the record is trusted with a warning (its vocabulary size is
        still checked against model.vocab_size)."""
        data = self.cfg.data
        files = {s.data.prefix: s.data for s in (self.train_source, self.eval_source)
                 if getattr(s, "data", None) is not None}  # token files, each once
        if not files:
            return
        try:
            want = tokenizer_identity(data.tokenizer)
        except FileNotFoundError as e:
            raise DataError(f"data.tokenizer: {e}") from None
        named = f"data.tokenizer={data.tokenizer!r} ({short_identity(want)})" \
            if data.tokenizer else "the byte-level one (data.tokenizer unset)"
        for prefix, ds in files.items():
            if ds.tokenizer is None:
                self.warnings.append(
                    f"{prefix}.idx does not say which tokenizer made it (a file from before "
                    f"the record): trusting that it was {named}; remake it with "
                    f"tools/preprocess_data.py to have it checked")
            elif ds.tokenizer != want:
                raise DataError(
                    f"{prefix}.idx was made with the {short_identity(ds.tokenizer)} "
                    f"tokenizer, not {named}: set data.tokenizer to the tokenizer.json "
                    f"tools/preprocess_data.py used, or remake the file with this one")

    @property
    def has_eval(self) -> bool:
        return self.eval_source is not None

    def source(self, split: str):
        """The 'train' or 'eval' source; DataError when there is no held-out eval data."""
        source = {"train": self.train_source, "eval": self.eval_source}[split]
        if source is None:
            raise DataError("data: no held-out eval data (data.eval_fraction=0 and no "
                            "data.eval_path)")
        return source

    def samples(self, split: str, dp_rank: int = 0, dp_size: int = 1) -> SampleStream:
        """Unsharded (B, T) micro-batches of one DP rank."""
        return SampleStream(self.source(split), self.cfg.train.micro_batch_size, dp_rank,
                            dp_size, self.documents, self.cfg.data.eod_mask_loss)

    def _stream(self, split, state, mtp_depth: int = 0) -> ShardedStream:
        return ShardedStream(self.samples(split, state.dp_rank, state.dp_size), state.cp_group,
                             self.cfg.parallel.layout, state.ulysses_size,
                             self.cfg.data.reset_positions, self.cfg.data.document_mask,
                             mtp_depth)

    def train_stream(self, state) -> ShardedStream:
        """With model.mtp each micro-batch carries its shifted ids and targets too."""
        mtp = self.cfg.model.mtp
        return self._stream("train", state, mtp.depth if mtp is not None else 0)

    def eval_stream(self, state) -> ShardedStream:
        """Always the same eval samples, from the start of the eval split."""
        return self._stream("eval", state)


def build_data(cfg) -> Data:
    """Data for a validated Config; raises DataError (one line) on a bad token file."""
    return Data(cfg)


def build_sample_stream(cfg, dp_rank: int = 0, dp_size: int = 1,
                        split: str = "train") -> SampleStream:
    """One DP rank's unsharded stream for a Config (file reads only, no collectives)."""
    return build_data(cfg).samples(split, dp_rank, dp_size)
