"""What a pipeline block hands on beside x: Gemma 4's shared K/V and per-layer inputs.

Between the layers of models/gpt_pipe.py (and so between stages, point to point) the tuple is

    (x, positions[, documents], *carried[, the routers' statistics])

where ``carried`` after block i (i = -1: after the embedding) is, in this order:

    k_j, v_j   for each producer j <= i whose K/V a block after i reads
               (model.num_kv_shared_layers; config.layers.kv_sources): (B, T/cp, nkv/tp, hd)
               and (B, T/cp, nkv/tp, vd), the CP-local shards exactly as j's attention core
               took them (after the k norm, value norm and RoPE), so a consumer on a later
               stage attends with them and never recomputes them
    z          the per-layer inputs of blocks i+1 .. L-1 (model.per_layer_input_dim):
               (L-1-i, B, T/cp, p), layer-major so each block takes z[0] and hands on the
               contiguous z[1:]

Only what a later block reads crosses a boundary: a producer's K/V stop after its last
consumer, z shrinks by one layer per block. Every carried tensor is floating point, so
DeepSpeed's pipeline engine sends its gradient back with x's: a consumer's gradient
reaches its producer's k/v projections on the earlier stage, each block's z gradient the
first stage's per-layer embedding (docs/parallelism.md, "Pipeline x Gemma 4").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ctxpar.config import ModelConfig, layer_attention
from ctxpar.config.layers import kv_sources


@dataclass(frozen=True)
class Carried:
    """The carried tensors after one block: producers' K/V pairs, then z (per_layer_from:
    the first block whose per-layer input is in it, or None)."""
    producers: Tuple[int, ...]
    per_layer_from: Optional[int]

    @property
    def size(self) -> int:
        return 2 * len(self.producers) + (self.per_layer_from is not None)

    def unpack(self, tensors) -> Tuple[Dict[int, tuple], Optional[torch.Tensor]]:
        """tensors (size of them) -> ({producer: (k, v)}, z or None)."""
        kv = {j: (tensors[2 * a], tensors[2 * a + 1]) for a, j in enumerate(self.producers)}
        return kv, (tensors[-1] if self.per_layer_from is not None else None)

    def pack(self, kv: Dict[int, tuple], z: Optional[torch.Tensor]) -> tuple:
        out = tuple(t for j in self.producers for t in kv[j])
        return out + ((z,) if self.per_layer_from is not None else ())


def carried_after(cfg: ModelConfig, i: int) -> Carried:
    """What crosses the boundary after block i (-1: after the embedding)."""
    producers = sorted({j for c, j in kv_sources(cfg).items() if j <= i < c})
    later = cfg.per_layer_input_dim and i + 1 < cfg.n_layers
    return Carried(tuple(producers), i + 1 if later else None)


class CarriedKV:
    """A consumer attention's producer as seen on a pipeline stage (Attention.kv_producer
    reads ``shared_kv``): the (k, v) that arrived in the tuple, set for one forward. Never
    exchanged for it (``held_kv``, Ulysses' and the all-gather's saving at pp 1) nor sent as
    k_proj x alone (``sequence_rotary``: the pipeline's stages send K and V): the consumer's
    core sends the carried K/V itself, so their gradients flow back through the tuple."""
    shared_kv: Optional[tuple] = None
    held_kv: Optional[tuple] = None
    sequence_rotary: Optional[tuple] = None


class LayerCarry:
    """Block i's part: take its inputs out of the tuple, run the block with them as explicit
    arguments (so a recomputed block replays with its own micro-batch's, not the latest),
    and put back what later blocks read."""

    def __init__(self, cfg: ModelConfig, i: int, mixer):
        self.inbound, self.outbound = carried_after(cfg, i - 1), carried_after(cfg, i)
        self.index, self.mixer = i, mixer
        self.source = layer_attention(cfg)[i].kv_source  # the producer it reads, or None
        self.produces = i in kv_sources(cfg).values()
        self.reader: Optional[CarriedKV] = None
        if self.source is not None:  # attends with the K/V that arrived (never its own)
            self.reader = CarriedKV()
            mixer.kv_producer = (self.reader,)  # a tuple: not registered as a submodule
        if self.produces:
            mixer.keeps_shared_kv = True

    def split(self, rest: list) -> Tuple[list, Dict[int, tuple], Optional[torch.Tensor]]:
        """rest (everything after positions, routers' statistics removed) ->
        (the documents part, {producer: (k, v)}, z)."""
        cut = len(rest) - self.inbound.size
        return (rest[:cut], *self.inbound.unpack(rest[cut:]))

    def block_args(self, kv: Dict[int, tuple], z: Optional[torch.Tensor]) -> tuple:
        """(this block's z (B, T/cp, p) or None, k, v of its producer or None, None)."""
        return (None if z is None else z[0], *(kv[self.source] if self.reader else (None,) * 2))

    def run(self, block, x, cos, sin, z_i=None, k=None, v=None):
        """block(x, cos, sin) with this layer's per-layer input and producer's K/V; a
        producer returns (x, k, v), its own K/V as its core took them."""
        if self.reader is not None:
            self.reader.shared_kv = (k, v)
        out = block(x, cos, sin, per_layer_input=z_i)
        if self.reader is not None:
            self.reader.shared_kv = None
        if not self.produces:
            return out
        kv, self.mixer.shared_kv = self.mixer.shared_kv, None
        return (out, *kv)

    def pack(self, kv: Dict[int, tuple], z: Optional[torch.Tensor], produced: tuple) -> tuple:
        """The carried tensors after this block."""
        if produced:
            kv = {**kv, self.index: produced}
        z = None if z is None or self.outbound.per_layer_from is None else z[1:]
        return self.outbound.pack(kv, z)


def first_carried(cfg: ModelConfig, z: Optional[torch.Tensor]) -> tuple:
    """The embedding's carried tensors: z (B, T/cp, L, p) layer-major as (L, B, T/cp, p)."""
    if z is None:
        return ()
    return carried_after(cfg, -1).pack({}, z.permute(2, 0, 1, 3).contiguous())


def output_carried(cfg: ModelConfig, last_block: int, out, dsa_tail: int = 0
                   ) -> List[torch.Tensor]:
    """The carried tensors in a stage's output tuple whose last block is last_block (under
    model.moe the routers' statistics follow them, then dsa_tail tensors of model.dsa's:
    models/dsa_pipe.py)."""
    n = carried_after(cfg, last_block).size
    if not n:
        return []
    end = len(out) - (cfg.moe is not None) - dsa_tail
    return list(out[end - n:end])


def send_carried(tensors: List[torch.Tensor], dst: int) -> None:
    """Point to point to the next stage (pipeline_logits): their shapes (every carried
    tensor is 4-D), then each."""
    if not tensors:
        return
    dist.send(torch.tensor([list(t.shape) for t in tensors], dtype=torch.int64,
                           device=tensors[0].device), dst=dst)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)


def recv_carried(n: int, like: torch.Tensor, src: int) -> List[torch.Tensor]:
    """send_carried's n tensors, in like's dtype and device."""
    if not n:
        return []
    shapes = torch.empty(n, 4, dtype=torch.int64, device=like.device)
    dist.recv(shapes, src=src)
    out = [torch.empty(*s.tolist(), dtype=like.dtype, device=like.device) for s in shapes]
    for t in out:
        dist.recv(t, src=src)
    return out
