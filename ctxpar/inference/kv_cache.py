"""The KV cache under context parallelism: every CP rank holds a share of every layer's keys.

A slot is one cached token of one rank. Per layer and rank: k, v (B, Hkv, capacity, D) in
the model's dtype (after RoPE: a key is cached at its global position; head-major, so a
decode step's matmuls read each head's keys as one strided block), and per rank one
``valid`` mask (B, capacity) and the slots' global positions ``pos`` (B, capacity), shared
by the layers. A decode step of a layer with a window or chunks (its AttentionMask) sees
the valid slots its mask leaves by position; sinks join the merged row (sinks.py).

    prefill   slots [0, T/cp) get this rank's layout shard of the right-padded prompts
              (the same tokens training would give it); pad slots are invalid
    decode    the new token's K,V go to one rank only, the one with the fewest filled
              slots (ties: the lowest rank), so the shards stay within one slot of each
              other: every rank knows every rank's fill count, no communication needed

Memory per rank: n_layers * B * capacity * Hkv * (D + Dv) * bytes (Hkv each layer's own:
model.layer_kv_heads; Dv model.v_head_dim, D unless set), with capacity =
T_pad / cp + ceil(decode steps / cp): 1/cp of a single rank's cache (up to one slot).
A hybrid model's Gated DeltaNet and Mamba2 layers keep no keys: each holds its recurrent
state and conv window instead (linear_cache.py), replicated over CP, and an MLP-only
block nothing; n_layers above counts its attention layers. A multi-head latent attention
layer (MLA, model.mla) keeps its latent instead of K and V: latent (B, capacity, R + dr)
per layer and rank, R + dr numbers a token (576 for DeepSeek-V3) where K,V would be
heads x (qk + v) (40,960); a decode step folds the layer's kv_b_proj into its query and
output and attends to the latents themselves (latent_decode.py: never expanded). A DeepSeek sparse
attention layer (model.dsa) keeps the latent and its indexer key, and attends to the
tokens its indexer selects over CP (sparse_decode.py).
Gemma 4: each attention
layer's slots have its own kv heads and head dim (its full layers' global_head_dim), and a
layer sharing an earlier one's K/V (model.num_kv_shared_layers) keeps none: it attends to
its producer's slots, which the producer filled earlier in the same forward.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..config import softmax_scale
from ..config.layers import layer_attention
from ..config.parameters import (head_dim, kv_heads_per_rank, layer_head_dim, layer_kv_heads,
                                 layer_v_head_dim)
from ..tensor_parallel.mappings import tp_size_of
from .cp_ops import AttentionMask, default_scale, finish_sinks, group_rank_and_size
from .decode import DecodeStats, merge_partials, partial_attention
from .latent_decode import absorbed_partial_attention
from .linear_cache import LINEAR_MIXERS, LinearLayerCache
from .sparse_decode import SparseLayerCache


def decode_capacity(prefill_len: int, decode_steps: int, cp: int) -> int:
    """Slots per rank: the prefill shard plus this rank's most appended tokens."""
    return prefill_len // cp + math.ceil(decode_steps / cp)


class KVCache:
    """This CP rank's share of the cache of every layer, for one batch of sequences."""

    def __init__(self, n_layers: int, batch: int, capacity: int,
                 kv_heads: int, head_dim: int,
                 cp_group=None, dtype=torch.float32, device=None, scale=None,
                 mixers: Optional[Sequence[Optional[str]]] = None,
                 latent_dim: Optional[int] = None,
                 shapes: Optional[Sequence[Tuple[int, ...]]] = None,
                 kv_sources: Optional[Dict[int, int]] = None, index_layers: Sequence[int] = (),
                 index_dim: int = 0):
        """n_layers: the model's; mixers: each layer's token mixer (LayerAttention.
        token_mixer; None: all attention): 'attention' layers get K,V slots, 'mla' layers
        latent slots latent_dim wide, 'dsa' layers latent slots and, those in index_layers
        (their own indexer), indexer-key slots index_dim wide (sparse_decode.py),
        'gated_delta' and 'mamba2' a LinearLayerCache each, an MLP-only block (None)
        nothing; shapes: each layer's (kv heads, head dim) or (kv heads, head dim, value
        head dim) (None: kv_heads, head_dim on all; V as wide as K unless given:
        model.v_head_dim); kv_sources: {layer: the layer whose slots it reads}."""
        self.cp_group = cp_group
        self.cp_rank, self.cp_size = group_rank_and_size(cp_group)
        mixers = ["attention"] * n_layers if mixers is None else list(mixers)
        self.linear: Dict[int, LinearLayerCache] = {
            i: LinearLayerCache(cp_group) for i, m in enumerate(mixers)
            if m in LINEAR_MIXERS}
        self.kv_sources = dict(kv_sources or {})
        attention = [i for i, m in enumerate(mixers) if m == "attention"
                     and i not in self.kv_sources]
        self.slot = {i: j for j, i in enumerate(attention)}  # layer -> its K,V index
        shapes = list(shapes or [(kv_heads, head_dim)] * len(mixers))
        self._empty = (0, batch, kv_heads, capacity, head_dim)
        # per attention layer (B, Hkv, capacity, D), its own Hkv and D (V's: Dv)
        self.keys = [torch.zeros(batch, shapes[i][0], capacity, shapes[i][1], dtype=dtype,
                                 device=device) for i in attention]
        self.values = [torch.zeros(batch, shapes[i][0], capacity, shapes[i][-1], dtype=dtype,
                                   device=device) for i in attention]
        latent = [i for i, m in enumerate(mixers) if m in ("mla", "dsa")]
        self.latent_slot = {i: j for j, i in enumerate(latent)}  # layer -> its latent index
        self.latent = torch.zeros(len(latent), batch, capacity, latent_dim or 0,
                                  dtype=dtype, device=device)
        self.sparse = {i for i, m in enumerate(mixers) if m == "dsa"}
        self.index_slot = {i: j for j, i in enumerate(index_layers)}  # layer -> its keys
        self.index_k = torch.zeros(len(index_layers), batch, capacity, index_dim,
                                   dtype=dtype, device=device)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self.query_pos: Optional[torch.Tensor] = None  # (B,) the decoded token's position
        self.filled: List[int] = [0] * self.cp_size  # slots in use on every CP rank
        # training's softmax scale: the model's (softmax_scale), or the ring's default
        self.scale = default_scale(head_dim) if scale is None else scale
        self.stats = DecodeStats()
        self.mode, self.owner = None, None

    @classmethod
    def for_model(cls, model, batch: int, capacity: int, cp_group=None) -> "KVCache":
        """A cache shaped like `model`'s attention (a ctxpar.interfaces.CausalLM: this TP
        rank's kv heads of model.cfg, in its parameters' dtype and device)."""
        m, p = model.cfg, next(model.parameters())
        tp, layers = tp_size_of(model.tp_group), layer_attention(m)
        return cls(m.n_layers, batch, capacity, kv_heads_per_rank(m, tp),
                   head_dim(m), cp_group, dtype=p.dtype, device=p.device,
                   scale=softmax_scale(m),
                   mixers=[a.token_mixer for a in layers],
                   latent_dim=m.mla.latent_dim if m.mla is not None else None,
                   shapes=[(kv_heads_per_rank(m, tp, layer_kv_heads(m, a)),
                            layer_head_dim(m, a), layer_v_head_dim(m, a)) for a in layers],
                   kv_sources={i: a.kv_source for i, a in enumerate(layers)
                               if a.kv_source is not None},
                   index_layers=[i for i, a in enumerate(layers)
                                 if a.token_mixer == "dsa" and a.has_indexer],
                   index_dim=m.dsa.index_head_dim if m.dsa is not None else 0)

    @property
    def k(self) -> torch.Tensor:
        """Every attention layer's keys stacked (L, B, Hkv, capacity, D), when they share
        a shape."""
        return torch.stack(self.keys) if self.keys else torch.zeros(self._empty)

    @property
    def v(self) -> torch.Tensor:
        return torch.stack(self.values) if self.values else torch.zeros(self._empty)

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def nbytes(self) -> int:
        """Bytes of this rank's cache (keys and values of the attention layers, the linear
        layers' states and conv windows)."""
        return sum(x.numel() * x.element_size() for x in (*self.keys, *self.values)) + sum(
            c.nbytes() for c in self.linear.values()) + \
            self.latent.numel() * self.latent.element_size() + \
            self.index_k.numel() * self.index_k.element_size()

    def begin_prefill(self, valid: torch.Tensor, positions: Optional[torch.Tensor] = None,
                      lengths: Optional[torch.Tensor] = None) -> None:
        """The next forward is this rank's shard of the padded prompts; valid (B, T/cp) bool
        says which of its tokens are prompt (position < the row's length), not padding;
        positions (T/cp,) or (B, T/cp) their global positions (for windows and chunks);
        lengths (B,) the prompts' (linear layers: where their states and windows end)."""
        if any(self.filled):
            raise RuntimeError("KVCache: prefill into a cache that already holds tokens")
        if self.linear and (positions is None or positions.dim() != 1 or lengths is None):
            raise ValueError("KVCache: a model with linear layers needs begin_prefill("
                             "valid, positions (T/cp,), lengths)")
        n = valid.shape[1]
        self.valid[:, :n] = valid
        if positions is not None:
            self.pos[:, :n] = positions
        self.filled = [n] * self.cp_size  # every rank holds T_pad / cp tokens
        self.mode = "prefill"
        for c in self.linear.values():
            c.mode, c.valid, c.positions, c.lengths = "prefill", valid, positions, lengths

    def begin_decode(self, positions: Optional[torch.Tensor] = None) -> int:
        """The next forward is one new token per row, at positions (B,) (for windows and
        chunks); returns the CP rank that keeps its K,V."""
        owner = min(range(self.cp_size), key=lambda r: (self.filled[r], r))
        if self.filled[owner] >= self.capacity:
            raise RuntimeError(f"KVCache: rank {owner} is full ({self.capacity} slots)")
        self.query_pos = positions
        if owner == self.cp_rank:
            self.valid[:, self.filled[owner]] = True
            if positions is not None:
                self.pos[:, self.filled[owner]] = positions
        self.filled[owner] += 1
        self.mode, self.owner = "decode", owner
        for c in self.linear.values():
            c.mode = "decode"
        return owner

    def layer(self, i: int) -> Union[Callable, LinearLayerCache]:
        """Layer i's attention with the cache: what a CausalLM's block i calls as
        kv_cache(q, k, v, core) in place of its CP attention (ctxpar.interfaces); for a
        linear layer its LinearLayerCache, which the layer reads and fills itself."""
        if i in self.linear:
            return self.linear[i]
        if i in self.sparse:  # DSA: kv_cache.sparse(mixer, q, latent, index q, k, w)
            return SparseLayerCache(self, self.latent_slot[i], self.index_slot.get(i))
        if i in self.latent_slot:  # MLA: kv_cache(q, latent, (weight, dims), core, mask)
            return lambda q, latent, absorb, core, mask=None: self.latent_attention(
                self.latent_slot[i], q, latent, absorb, core, mask)
        if i in self.kv_sources:  # the producer's slots, read and never written
            return lambda q, k, v, core, mask=None: self.attention(
                self.slot[self.kv_sources[i]], q, k, v, core, mask, store=False)
        return lambda q, k, v, core, mask=None: self.attention(self.slot[i], q, k, v, core,
                                                               mask)

    def visible(self, n: int, mask: Optional[AttentionMask]) -> torch.Tensor:
        """(B, n) bool: the valid slots a decoded query sees under the layer's mask (every
        cached key is before it: causal holds)."""
        if mask is None or (mask.sliding_window is None and mask.chunk_size is None):
            return self.valid[:, :n]
        if self.query_pos is None:
            raise RuntimeError("KVCache: a windowed or chunked layer needs begin_decode("
                               "positions) and begin_prefill(valid, positions)")
        qp, kp = self.query_pos[:, None], self.pos[:, :n]
        vis = self.valid[:, :n].clone()
        if mask.sliding_window is not None:
            vis &= qp - kp < mask.sliding_window
        if mask.chunk_size is not None:
            vis &= qp // mask.chunk_size == kp // mask.chunk_size
        return vis

    def attention(self, i: int, q, k, v, core, mask: Optional[AttentionMask] = None,
                  store: bool = True) -> torch.Tensor:
        """Keep k, v in K,V slot i (self.slot: the model's layer index when it has no
        linear layers) and return the attention output (B, L, H, D) in q's dtype.

        prefill: q, k, v (B, T/cp, *, D) are this rank's tokens; `core` is the model's own
        CP attention (the training ring, any layout). decode: q, k, v (B, 1, *, D), the same
        on every CP rank; the owner appends k, v, every rank attends to its share and the
        partials are merged over CP (decode.py). mask: the layer's (window, chunks, sinks;
        its documents are not used: one prompt per row), read in decode. store False: a
        layer sharing slot i's K/V, which its producer has kept already.
        """
        n = self.filled[self.cp_rank]
        keys, values = self.keys[i], self.values[i]
        if self.mode == "prefill":  # k, v (B, T/cp, Hkv, D) -> slots (B, Hkv, T/cp, D)
            if store:
                keys[:, :, :n] = k.transpose(1, 2)
                values[:, :, :n] = v.transpose(1, 2)
            return core(q, k, v)
        assert self.mode == "decode", "begin_prefill or begin_decode first"
        if self.owner == self.cp_rank and store:
            keys[:, :, n - 1] = k[:, 0]
            values[:, :, n - 1] = v[:, 0]
        out, lse = partial_attention(q, keys[:, :, :n], values[:, :, :n],
                                     self.visible(n, mask), self.scale)
        sinks = None if mask is None else mask.sinks
        out, lse = merge_partials(out, lse, self.cp_group, self.stats, return_lse=True)
        return finish_sinks(out, lse, q.dtype, sinks)[0]  # lse (B, H, 1)

    def latent_attention(self, i: int, q, latent, absorb, core,
                         mask: Optional[AttentionMask] = None) -> torch.Tensor:
        """attention's, for an MLA layer: keep latent (B, L, R + dr) in latent slot i;
        prefill runs the model's CP latent attention (core(q, latent)); decode attends to
        this rank's cached latents with kv_b_proj absorbed into the query and the output
        (absorb: (kv_b_proj.weight of this rank's heads, LatentDims); latent_decode.py),
        the partials merged over CP."""
        n = self.filled[self.cp_rank]
        if self.mode == "prefill":
            self.latent[i, :, :n] = latent
            return core(q, latent)
        assert self.mode == "decode", "begin_prefill or begin_decode first"
        if self.owner == self.cp_rank:
            self.latent[i, :, n - 1] = latent[:, 0]
        weight, dims = absorb
        out, lse = absorbed_partial_attention(q, self.latent[i, :, :n], weight, dims,
                                              self.visible(n, mask), self.scale)
        out = merge_partials(out, lse, self.cp_group, self.stats)
        return out.to(q.dtype)

