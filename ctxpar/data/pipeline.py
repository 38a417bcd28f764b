"""What train.py needs from the data side: per-rank device batches and the passkey eval.

    data = build_data(cfg)                  # file checks only, no collectives (DataError)
    stream = data.train_stream(state)       # this DP rank's samples, this CP rank's tokens
    mb = stream.next_microbatch(device)     # tokens, labels (B, T/cp); positions (T/cp,)
    client_state["data"] = stream.state_dict(); ... stream.load_state_dict(client["data"])
    if data.has_eval:                       # passkey: always; tokens: a held-out split
        evaluate(model, data, state, device)  # {"eval_loss", "eval_samples", "eval_accuracy"
                                              #  (passkey) or "eval_ppl" (tokens)}
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .indexed import DataError
from .loader import SampleStream, build_source, shard_batch
from .passkey import IGNORE_INDEX, passkey_correct


class ShardedStream:
    """A SampleStream whose batches are already cut to this CP rank's layout shard
    (ulysses: the Ulysses degree of hybrid CP's two-level layout, 1 otherwise;
    reset_positions: RoPE positions restart at each document)."""

    def __init__(self, stream: SampleStream, cp_group, layout: str, ulysses: int = 1,
                 reset_positions: bool = False, document_mask: bool = False):
        self.stream, self.cp_group, self.layout, self.ulysses = stream, cp_group, layout, ulysses
        self.reset_positions, self.document_mask = reset_positions, document_mask

    def next_microbatch(self, device=None) -> Dict[str, torch.Tensor]:
        """tokens, labels (B, T/cp), positions (T/cp,) or (B, T/cp) on device; with
        documents "cu_seqlens" (B int32 tensors) stay on the host, where the attention's
        document plan is made (no device round trip)."""
        local = shard_batch(self.stream.next_batch(), self.cp_group, self.layout, self.ulysses,
                            self.reset_positions)
        if not self.document_mask:  # boundaries only for the positions: attention unmasked
            local.pop("cu_seqlens", None)
        return {k: v if k == "cu_seqlens" else v.to(device, non_blocking=True).contiguous()
                for k, v in local.items()}

    def state_dict(self) -> Dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: Dict) -> None:
        self.stream.load_state_dict(state)


class Data:
    """The train and eval sources of a Config; sample streams per rank on demand."""

    def __init__(self, cfg):
        self.cfg = cfg
        seq_len, seed = cfg.model.seq_len, cfg.train.seed
        self.train_source = build_source(cfg.data, seq_len, seed, "train")
        self.eval_source = build_source(cfg.data, seq_len, seed, "eval")  # None: no held-out
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

    def _stream(self, split, state) -> ShardedStream:
        return ShardedStream(self.samples(split, state.dp_rank, state.dp_size), state.cp_group,
                             self.cfg.parallel.layout, state.ulysses_size,
                             self.cfg.data.reset_positions, self.cfg.data.document_mask)

    def train_stream(self, state) -> ShardedStream:
        return self._stream("train", state)

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


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """argmax over a vocabulary split by TP: (..., V/tp) -> (...) global ids, first max wins."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits.argmax(dim=-1)
    local_max, local_idx = logits.float().max(dim=-1)
    ids = local_idx + dist.get_rank(tp_group) * logits.shape[-1]  # rank r holds [r*V/tp, ...)
    best = local_max.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=tp_group)
    ids = torch.where(local_max == best, ids, torch.full_like(ids, torch.iinfo(ids.dtype).max))
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=tp_group)  # lowest id among the maxima
    return ids


@torch.no_grad()
def evaluate(model, data: Data, state, device=None,
             forward: Optional[Callable] = None) -> Dict[str, float]:
    """Loss over train.eval_samples held-out samples, and the passkey accuracy on passkey data.

    Returns eval_loss (mean over every labelled token: the answer digits for passkey, all
    tokens for text), eval_samples, and eval_accuracy (passkey: exact match of the key) or
    eval_ppl (tokens: exp(eval_loss)). model(tokens, positions) must return vocab-parallel
    logits (B, T/cp, V/tp) (models.gpt does), or ``forward(mb)`` returns them for a
    micro-batch dict, and None on pipeline stages without the head
    (models.gpt_pipe.pipeline_logits). Collective over the whole grid: every rank must call
    it. The sample count is rounded up to whole micro-batches of all DP ranks.
    """
    from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    cfg = data.cfg
    per_step = cfg.train.micro_batch_size * state.dp_size
    n_micro = max(1, math.ceil(cfg.train.eval_samples / per_step))
    stream = data.eval_stream(state)  # DataError without held-out data, before any change
    was_training = model.training
    model.eval()
    # [correct samples (passkey), loss sum, labelled tokens] on this rank, summed below
    passkey = cfg.data.kind == "passkey"
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for _ in range(n_micro):
        mb = stream.next_microbatch(device)
        # (B, T/cp, V/tp), or None on a pipeline stage before the last (that one counts)
        docs = {"cu_seqlens": mb["cu_seqlens"]} if "cu_seqlens" in mb else {}
        logits = forward(mb) if forward else model(mb["tokens"], mb["positions"], **docs)
        if logits is None:
            continue
        if passkey:
            preds = vocab_parallel_argmax(logits, state.tp_group)           # (B, T/cp)
            correct = passkey_correct(preds, mb["labels"], state.cp_group)  # (B,), same on CP
            totals[0] += correct.sum()
        losses = vocab_parallel_cross_entropy(logits, mb["labels"], state.tp_group)
        totals[1] += losses.sum()  # 0 at ignored positions
        totals[2] += (mb["labels"] != IGNORE_INDEX).sum()
    model.train(was_training)
    # Correct counts are per sample, identical over CP: sum them over DP only. Losses and
    # token counts are per position: sum over DP x CP.
    # The groups are per pipeline stage: the last stage's sums go to every stage after.
    correct, loss_tok = totals[:1].clone(), totals[1:].clone()
    if state.dp_size > 1:
        dist.all_reduce(correct, group=state.dp_group)
    if state.dp_cp_size > 1:
        dist.all_reduce(loss_tok, group=state.dp_cp_group)
    if state.pp_size > 1:
        for t in (correct, loss_tok):
            dist.broadcast(t, src=state.ranks("pp")[-1], group=state.pp_group)
    n = n_micro * per_step
    loss = loss_tok[0].item() / max(loss_tok[1].item(), 1.0)
    if passkey:
        return {"eval_loss": loss, "eval_accuracy": correct.item() / n, "eval_samples": n}
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_samples": n}
