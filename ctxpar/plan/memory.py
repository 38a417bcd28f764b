"""Memory per GPU of a layout: model state per ZeRO stage, activations, attention buffers.

Model state, per parameter of this rank's shard (Psi), with D = dp x cp the ZeRO group
(ctxpar/zero.py), as DeepSpeed 0.19.8 holds it after its first step (measured on CPU by
tests/test_plan.py for fp32; bf16 from the same code paths, BF16_Optimizer for stage 0):

    stage   params        grads                 fp32 master   Adam (m, v)
    fp32 0  4             4                     -             8
    fp32 1,2 4            4/D                   4/D           8/D
    fp32 3  4/D           4/D                   4/D           8/D
    bf16 0  2             4 (fp32 accumulator)  4/D           8/D
    bf16 1,2 2            2/D                   4/D           8/D
    bf16 3  2/D           2/D                   4/D           8/D

plus, for stage 3, DeepSpeed's reduce bucket (reduce_bucket_size elements, 5e8 by
default) and the largest layer gathered whole while it runs.

Activations: counts.activation_bytes for the micro-batches a stage holds at once (1F1B:
the first of pp stages holds min(pp, micro-batches) in flight). The peak is named: the
step (model state + gradients + Adam) or the backward (activations + the attention's
working buffers at its peak, e.g. the ring's fp32 dK,dV accumulators and receive buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from ..config import Config
from . import counts
from .layout import Layout

DEFAULT_REDUCE_BUCKET = int(5e8)  # DeepSpeed's reduce_bucket_size default (elements)


@dataclass
class Memory:
    params: float
    grads: float
    master: float
    optimizer: float
    buckets: float
    activations: float
    attention: float   # the attention's working buffers at their peak (not saved)
    logits: float      # the loss's fp32 logits + softmax of one micro-batch

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.master + self.optimizer + self.buckets

    @property
    def peak(self) -> float:
        return max(self.model_state + self.activations + self.attention + self.logits,
                   self.model_state)

    @property
    def peak_phase(self) -> str:
        return "backward (activations + attention buffers)" if self.activations \
            else "optimizer step"

    def as_dict(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in ("params", "grads", "master", "optimizer",
                                              "buckets", "activations", "attention",
                                              "logits")}


def model_state(psi: int, zero: int, D: int, bf16: bool, reduce_bucket: int,
                largest_layer: int = 0) -> Dict[str, float]:
    """Bytes of params, grads, fp32 master, Adam state and ZeRO-3 buffers on one rank
    holding a shard of psi parameters (see the module docstring)."""
    e = 2 if bf16 else 4
    params = psi * e / D if zero == 3 else psi * e
    if zero == 0:
        grads = psi * 4
        master = psi * 4 / D if bf16 else 0.0
        adam = psi * 8 / D if bf16 else psi * 8
    else:
        grads, master, adam = psi * e / D, psi * 4 / D, psi * 8 / D
    buckets = (reduce_bucket + largest_layer) * e if zero == 3 else 0.0
    return dict(params=params, grads=grads, master=master, optimizer=adam, buckets=buckets)


def attention_buffers(cfg: Config, lay: Layout, e: int) -> float:
    """The attention's transient buffers in one layer's backward (the larger pass):
    ring: fp32 dq and dK,dV accumulators, two K,V receive buffers, the dK,dV in flight;
    all-gather: the gathered K,V of every rank and their fp32 gradients; Ulysses: the
    all-to-all send/receive buffers of q, k, v and their gradients."""
    s = counts.rank_shapes(cfg.model, lay)
    q = s.N * s.h * s.hd
    kv = s.N * s.hk * s.hd
    if lay.cp == 1:
        return 4 * q + 2 * 4 * kv
    if lay.cp_comm == "ring":
        g = 2 if lay.ring_grad_dtype == "bf16" else 4
        return 4 * q + 2 * 4 * kv + 2 * 2 * kv * e + 2 * 2 * kv * g
    if lay.cp_comm == "allgather":
        return 4 * q + lay.cp * 2 * kv * (e + 4)
    hk = counts.ulysses_kv_heads(s.hk, lay.ulysses)
    a2a = 2 * s.N * (s.h + 2 * hk) * s.hd * e  # send + receive of q, k, v (or grads)
    ring = lay.ring if lay.cp_comm == "hybrid" else 1
    return a2a + 4 * q + (2 * 4 * s.N * hk * s.hd if ring > 1 else 0)


def memory(cfg: Config, lay: Layout, bf16: bool, grad_accum: int) -> Memory:
    """Memory of the most loaded rank (pipeline stage 0, or the last with a big head)."""
    m, e = cfg.model, 2 if bf16 else 4
    D = lay.dp * lay.cp
    bucket = int((cfg.deepspeed.get("zero_optimization") or {}).get(
        "reduce_bucket_size", DEFAULT_REDUCE_BUCKET))
    best = None
    for stage in sorted({0, lay.pp - 1}):
        psi = counts.stage_params(m, lay.tp, lay.pp, stage)
        largest = max(counts.layer_params(m, lay.tp), m.vocab_size // lay.tp * m.d_model)
        state = model_state(psi, lay.zero, D, bf16, min(bucket, psi), largest)
        layers = m.n_layers // lay.pp + (1 if stage < m.n_layers % lay.pp else 0)
        in_flight = min(lay.pp - stage, grad_accum) if lay.pp > 1 else 1
        act = in_flight * counts.activation_bytes(
            m, lay, e, layers, first=stage == 0, last=stage == lay.pp - 1,
            reset_positions=cfg.data.reset_positions)
        s = counts.rank_shapes(m, lay)
        logits = 2 * 4 * s.N * s.V if stage == lay.pp - 1 else 0.0
        mem = Memory(**state, activations=act, attention=attention_buffers(cfg, lay, e),
                     logits=logits)
        if best is None or mem.peak > best.peak:
            best = mem
    return best
