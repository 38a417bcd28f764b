"""Held-out evaluation: the collective that measures it, and the component that decides when.

    evaluator = Evaluator(cfg, data, state, device, forward)
    if evaluator.should_evaluate(step):     # train.eval_interval, the last step, eval_at_start
        evaluator.run(model, step, logger)  # metrics.jsonl line + "step N: passkey accuracy"
    evaluator.summary()                     # ", passkey accuracy 0.828 (chance 0.001)"
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..data.passkey import IGNORE_INDEX, passkey_correct
from ..memory.tiled_eval import HeadInputs, tiled_eval_head
from ..tensor_parallel.argmax import vocab_parallel_argmax
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


@torch.no_grad()
def evaluate(model, data, state, device=None,
             forward: Optional[Callable] = None) -> Dict[str, float]:
    """Loss over train.eval_samples held-out samples, and the passkey accuracy on passkey data.

    data: ctxpar.data.Data. Returns eval_loss (mean over every labelled token: the answer
    digits for passkey, all tokens for text), eval_samples, eval_distinct_samples (fewer
    where a token file's held-out split holds fewer windows, which the stream cycles
    over: distinct_eval_samples), and eval_accuracy (passkey: exact match of the key) or
    eval_ppl (tokens: exp(eval_loss)). Collective over the whole grid: every rank must
    call it. The sample count is rounded up to whole micro-batches of all DP ranks.

    What the model hands over, per micro-batch (``head_inputs``): a model with
    ``hidden_states(tokens, positions, cu_seqlens=)`` and ``head_weight()`` (models.GPT)
    gives HeadInputs, and the head runs one tile of tokens at a time (tiled_eval_head,
    memory.loss_tile_tokens): no (B, T/cp, V/tp) logits. Otherwise model(tokens, positions)
    returns vocab-parallel logits (B, T/cp, V/tp). ``forward(mb)`` replaces both for a
    pipeline: HeadInputs or logits on the last stage, None on the others.
    """
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
        out = forward(mb) if forward else head_inputs(model, mb)
        if out is None:
            continue
        if isinstance(out, HeadInputs):
            with gathered(out.weight):
                losses, preds = tiled_eval_head(out.x, out.weight, mb["labels"],
                                                state.tp_group, cfg.memory.loss_tile_tokens)
        else:  # whole logits (B, T/cp, V/tp)
            losses = vocab_parallel_cross_entropy(out, mb["labels"], state.tp_group)
            preds = vocab_parallel_argmax(out, state.tp_group) if passkey else None
        if passkey:
            correct = passkey_correct(preds, mb["labels"], state.cp_group)  # (B,), same on CP
            totals[0] += correct.sum()
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
    counts = {"eval_samples": n, "eval_distinct_samples": distinct_eval_samples(data, n)}
    if passkey:
        return {"eval_loss": loss, "eval_accuracy": correct.item() / n, **counts}
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), **counts}


def distinct_eval_samples(data, n: int) -> int:
    """How many of n held-out samples are distinct: a token file's held-out split holds
    n_windows windows and the eval stream cycles over them; passkey samples never repeat."""
    windows = getattr(data.eval_source, "n_windows", None)
    return n if windows is None else min(n, windows)


def eval_shortfall(cfg, data) -> Optional[str]:
    """A warning line where train.eval_samples asks for more held-out samples than the
    held-out split holds windows (the evaluation then cycles over them), else None."""
    asked = cfg.train.eval_samples
    if not data.has_eval or distinct_eval_samples(data, asked) == asked:
        return None
    d, k = cfg.data, data.eval_source.n_windows
    where = f"data.eval_path={d.eval_path!r}" if d.eval_path else \
        f"data.eval_fraction={d.eval_fraction} of {d.path}"
    return (f"train.eval_samples={asked} but the held-out split ({where}) holds {k} "
            f"window{'s' if k > 1 else ''} of model.seq_len={cfg.model.seq_len} tokens: the "
            f"held-out evaluation cycles over those {k} (logged as eval_distinct_samples); "
            f"raise data.eval_fraction, give a longer data.eval_path, or ask for at most {k}")


def head_inputs(model, mb):
    """HeadInputs of a model that has hidden_states and head_weight; its logits otherwise."""
    documents = {"cu_seqlens": mb["cu_seqlens"]} if "cu_seqlens" in mb else {}
    if hasattr(model, "hidden_states") and hasattr(model, "head_weight"):
        return HeadInputs(model.hidden_states(mb["tokens"], mb["positions"], **documents),
                          model.head_weight())
    return model(mb["tokens"], mb["positions"], **documents)


def gathered(weight: torch.Tensor):
    """Under ZeRO-3 the head weight is a partition outside the engine's forward: DeepSpeed's
    GatheredParameters makes it whole (read only) for the evaluation's head."""
    if not hasattr(weight, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters([weight], modifier_rank=None)


def describe(result: Dict[str, float]) -> str:
    """'passkey accuracy 0.828' or 'eval loss 2.3456 (ppl 10.44)'."""
    if "eval_accuracy" in result:
        return f"passkey accuracy {result['eval_accuracy']:.3f}"
    return f"eval loss {result['eval_loss']:.4f} (ppl {result['eval_ppl']:.2f})"


class Evaluator:
    """Owns when to evaluate (every train.eval_interval steps, the last step, and with
    train.eval_at_start the step a run starts from) and how a result is reported."""

    def __init__(self, cfg, data, state, device=None, forward: Optional[Callable] = None,
                 long_context=None):
        self.cfg, self.data, self.state, self.device = cfg, data, state, device
        self.forward = forward  # pipeline stages: pipeline_logits; None: head_inputs(model, mb)
        self.long_context = long_context  # long_context.LongContextEval, or None
        self.last: Optional[Dict[str, float]] = None

    def should_evaluate(self, step: int, start: bool = False) -> bool:
        """start: before the run's first step (step is 0, or the step resumed from)."""
        t = self.cfg.train
        if not self.data.has_eval:
            return False
        if start:
            return t.eval_at_start
        return bool(t.eval_interval and step % t.eval_interval == 0) or step == t.steps

    def run(self, model, step: int, logger) -> Dict[str, float]:
        """Collective: evaluate, then one metrics.jsonl line and one line above the bar."""
        self.last = evaluate(model, self.data, self.state, self.device, self.forward)
        logger.log({"step": step, **self.last})
        n, k = self.last["eval_samples"], self.last["eval_distinct_samples"]
        logger.write(f"step {step}: {describe(self.last)} ({n} held-out samples"
                     + (f", {k} distinct windows cycled)" if k < n else ")"))
        if self.long_context is not None:  # the long-context tasks, by generation
            self.long_context.run(model, self.state, step, logger)
        return self.last

    def summary(self) -> str:
        """The last result for the closing line ('' before any evaluation)."""
        if self.last is None:
            return ""
        if "eval_accuracy" in self.last:
            chance = 10.0 ** -self.cfg.data.passkey_digits
            return f", passkey accuracy {self.last['eval_accuracy']:.3f} (chance {chance:.3f})"
        return f", eval loss {self.last['eval_loss']:.4f}"
