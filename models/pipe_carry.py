"""What a pipeline block hands on beside x: Gemma 4's shared K/V and per-layer inputs,
DeepSeek-V4's token ids.

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
    ids        the tokens' ids (B, T/cp) int64 in the CP layout, while a hash-routed MoE
               layer after i reads them (model.moe.hash_layers: its experts are
               tid2eid[id])

Only what a later block reads crosses a boundary: a producer's K/V stop after its last
consumer, z shrinks by one layer per block, the ids stop after the last hash-routed
layer. K/V and z are floating point, so DeepSpeed's pipeline engine sends their
gradients back with x's: a consumer's gradient reaches its producer's k/v projections on
the earlier stage, each block's z gradient the first stage's per-layer embedding
(docs/parallelism.md, "Pipeline x Gemma 4"); the ids, integers as the positions, travel
forward only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ctxpar.config import ModelConfig, layer_attention
from ctxpar.config.layers import kv_sources
from ctxpar.config.moe import hash_layers


@dataclass(frozen=True)
class Carried:
    """The carried tensors after one block: producers' K/V pairs, then z (per_layer_from:
    the first block whose per-layer input is in it, or None), then the token ids (ids)."""
    producers: Tuple[int, ...]
    per_layer_from: Optional[int]
    ids: bool = False

    @property
    def size(self) -> int:
        return 2 * len(self.producers) + (self.per_layer_from is not None) + self.ids

    def unpack(self, tensors) -> Tuple[Dict[int, tuple], Optional[torch.Tensor],
                                       Optional[torch.Tensor]]:
        """tensors (size of them) -> ({producer: (k, v)}, z or None, ids or None)."""
        kv = {j: (tensors[2 * a], tensors[2 * a + 1]) for a, j in enumerate(self.producers)}
        z = tensors[2 * len(self.producers)] if self.per_layer_from is not None else None
        return kv, z, (tensors[-1] if self.ids else None)

    def pack(self, kv: Dict[int, tuple], z: Optional[torch.Tensor],
             ids: Optional[torch.Tensor] = None) -> tuple:
        out = tuple(t for j in self.producers for t in kv[j])
        return out + ((z,) if self.per_layer_from is not None else ()) + \
            ((ids,) if self.ids else ())


def carried_after(cfg: ModelConfig, i: int) -> Carried:
    """What crosses the boundary after block i (-1: after the embedding)."""
    producers = sorted({j for c, j in kv_sources(cfg).items() if j <= i < c})
    later = cfg.per_layer_input_dim and i + 1 < cfg.n_layers
    return Carried(tuple(producers), i + 1 if later else None,
                   any(j > i for j in hash_layers(cfg.moe)))


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

    def __init__(self, cfg: ModelConfig, i: int, mixer, mlp=None):
        """mlp: the block's channel mixer; a hash-routed MoE (models/moe.py) reads the ids."""
        self.inbound, self.outbound = carried_after(cfg, i - 1), carried_after(cfg, i)
        self.index, self.mixer = i, mixer
        self.hashed = mlp if getattr(mlp, "hash_routed", False) else None
        self.source = layer_attention(cfg)[i].kv_source  # the producer it reads, or None
        self.produces = i in kv_sources(cfg).values()
        self.reader: Optional[CarriedKV] = None
        if self.source is not None:  # attends with the K/V that arrived (never its own)
            self.reader = CarriedKV()
            mixer.kv_producer = (self.reader,)  # a tuple: not registered as a submodule
        if self.produces:
            mixer.keeps_shared_kv = True

    def split(self, rest: list) -> Tuple[list, Dict[int, tuple], Optional[torch.Tensor],
                                         Optional[torch.Tensor]]:
        """rest (everything after positions, routers' statistics removed) ->
        (the documents part, {producer: (k, v)}, z, ids)."""
        cut = len(rest) - self.inbound.size
        return (rest[:cut], *self.inbound.unpack(rest[cut:]))

    def block_args(self, kv: Dict[int, tuple], z: Optional[torch.Tensor],
                   ids: Optional[torch.Tensor] = None) -> tuple:
        """(this block's z (B, T/cp, p) or None, k, v of its producer or None, None, the
        token ids for a hash-routed MoE or None)."""
        return (None if z is None else z[0],
                *(kv[self.source] if self.reader else (None,) * 2),
                ids if self.hashed is not None else None)

    def run(self, block, x, cos, sin, z_i=None, k=None, v=None, ids=None):
        """block(x, cos, sin) with this layer's per-layer input, producer's K/V and token
        ids; a producer returns (x, k, v), its own K/V as its core took them."""
        if self.reader is not None:
            self.reader.shared_kv = (k, v)
        if self.hashed is not None:  # (B T/cp,) in the rows' order, as GPT sets them
            self.hashed.token_ids = ids.reshape(-1)
        out = block(x, cos, sin, per_layer_input=z_i)
        if self.reader is not None:
            self.reader.shared_kv = None
        if self.hashed is not None:
            self.hashed.token_ids = None
        if not self.produces:
            return out
        kv, self.mixer.shared_kv = self.mixer.shared_kv, None
        return (out, *kv)

    def pack(self, kv: Dict[int, tuple], z: Optional[torch.Tensor],
             ids: Optional[torch.Tensor], produced: tuple) -> tuple:
        """The carried tensors after this block."""
        if produced:
            kv = {**kv, self.index: produced}
        z = None if z is None or self.outbound.per_layer_from is None else z[1:]
        return self.outbound.pack(kv, z, ids)


def first_carried(cfg: ModelConfig, z: Optional[torch.Tensor], tokens: torch.Tensor) -> tuple:
    """The embedding's carried tensors: z (B, T/cp, L, p) layer-major as (L, B, T/cp, p),
    the token ids (B, T/cp)."""
    z = None if z is None else z.permute(2, 0, 1, 3).contiguous()
    return carried_after(cfg, -1).pack({}, z, tokens)


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
    """Point to point to the next stage (pipeline_logits): the floating tensors' shapes
    (each is 4-D), then each; not the ids (every stage has its micro-batch's tokens)."""
    tensors = [t for t in tensors if t.is_floating_point()]
    if not tensors:
        return
    dist.send(torch.tensor([list(t.shape) for t in tensors], dtype=torch.int64,
                           device=tensors[0].device), dst=dst)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)


def recv_carried(carried: Carried, like: torch.Tensor, src: int,
                 tokens: torch.Tensor) -> List[torch.Tensor]:
    """send_carried's tensors, in like's dtype and device, then this stage's own token ids
    (B, T/cp) if carried has them."""
    n, ids = carried.size - carried.ids, [tokens] if carried.ids else []
    if not n:
        return ids
    shapes = torch.empty(n, 4, dtype=torch.int64, device=like.device)
    dist.recv(shapes, src=src)
    out = [torch.empty(*s.tolist(), dtype=like.dtype, device=like.device) for s in shapes]
    for t in out:
        dist.recv(t, src=src)
    return out + ids
