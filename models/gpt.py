"""A GPT decoder for TP x CP x DP, assembled: embedding, blocks (models/block.py) whose token
and channel mixers models/mixers.py picks per layer, final norm, vocab-parallel head; RoPE
on global positions; the layout-independent init; activation checkpointing per block.

Shapes per rank: B micro-batch, T full sequence, cp/tp degrees, nh/nkv query/kv heads,
hd head dim, V vocabulary. Each CP rank holds T/cp tokens in the CP layout's order
(zigzag, striped, contiguous) with their global positions (``ctxpar.sequence_positions``);
each TP rank holds nh/tp query heads, max(nkv/tp, 1) kv heads, ffn/tp MLP columns and V/tp
vocabulary rows (docs/parallelism.md). Everything but the token mixers is token-local, so
only they talk over CP (attention: ring, all-gather, Ulysses or hybrid, ``cp_comm``; the
linear mixers: their states or heads, ``linear_cp``) and only the f/g ops talk over TP.

    model = GPT.from_config(cfg, state)   # or GPT(cfg.model, ModelGroups(...), ModelOptions(...))
    logits = model(tokens, positions)             # (B, T/cp, V/tp), vocab-parallel
    loss_sum = model(tokens, positions, labels)   # fp32 sum of this rank's token losses
"""
from __future__ import annotations

import math
import zlib
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ctxpar.config import CHECKPOINT_MODES, Config, MemoryConfig, ModelConfig, rotary_dim
from ctxpar.config.layers import layer_attention, mtp_layer_attention
from ctxpar.config.moe import hash_layers, moe_layer_indices
from ctxpar.config.parameters import check_parameters
from ctxpar.context_parallel import ContextParallel
from ctxpar.memory.offload import ActivationOffload, run_layer
from ctxpar.memory.tiled_loss import tiled_vocab_parallel_cross_entropy
from ctxpar.moe import RouterStats
from ctxpar.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding, full_shape,
                                    parallel_lm_logits, shard_full_tensor,
                                    vocab_parallel_cross_entropy)
from ctxpar.tensor_parallel.cross_entropy import IGNORE_INDEX
from ctxpar.tensor_parallel.mappings import tp_size_of

from .attention import link_shared_kv, set_sequence_rotary
from .block import Block
from .hyper_connections import HyperHead, expand_streams
from .dsa import (freeze_all_but_indexers, indexer_losses_of, indexer_recalls_of,
                  link_shared_layers)
from .mixers import INIT_RULES
from .moe import ROUTER_ONES, MoE
from .mtp import MTP
from .norms import make_norm
from .options import LayerArgs, ModelGroups, ModelOptions
from .per_layer_input import PerLayerInput
from .rope import layer_rotary


def check_checkpoint_mode(mode: str) -> None:
    """For models built without a Config (which checks it at load)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} must be one of {CHECKPOINT_MODES}")


def context_parallel_of(cp_comm: str, cp_group, ulysses_group, ring_group,
                        layout: str, ring_grad_dtype: str = "fp32") -> ContextParallel:
    """The model's CP attention; refuses groups left at None in a distributed run, where the
    functional API would read them as the whole world: a model's CP group is never the
    world when DP, TP or PP ranks share it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        need = ("ulysses_group", "ring_group") if cp_comm == "hybrid" else ("cp_group",)
        given = dict(cp_group=cp_group, ulysses_group=ulysses_group, ring_group=ring_group)
        missing = [n for n in need if given[n] is None]
        if missing:
            raise ValueError(f"GPT: pass {' and '.join(missing)} (e.g. a ParallelState's) for "
                             f"cp_comm={cp_comm!r} when torch.distributed is initialised")
    return ContextParallel(cp_comm, cp_group, ulysses_group, ring_group, layout,
                           ring_grad_dtype)


def embed_tokens(embed: nn.Module, tokens: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The input embedding (B, T/cp) -> (B, T/cp, d), times sqrt(d_model) under
    model.scale_embeddings (Gemma: the scale in fp32, then rounded to the activations'
    dtype, as transformers does)."""
    x = embed(tokens)
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.d_model ** 0.5).to(device=x.device, dtype=x.dtype)
    return x


def cap_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """cap * tanh(logits / cap) under model.final_logit_softcapping (elementwise: each TP
    rank caps its vocabulary shard), else the logits."""
    cap = cfg.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def block_recomputed(mode: str, i: int, every_n_layers: int) -> bool:
    """Whether block i is checkpointed whole (replayed in backward) under a checkpointing mode."""
    return mode == "full" or (mode == "every_n_layers" and i % every_n_layers == 0)


@torch.no_grad()
def init_parameters_(named_parameters, cfg: ModelConfig, seed: int, tp_group) -> None:
    """Draw each full-size parameter from its own generator (seed, crc32 of its name),
    then keep this rank's TP slice: the same model for every tp, cp, pp, dp and layout.

    Names are GPT's (``layers.3.attn.q_proj.weight``); the pipelined model passes its
    parameters under those names too. Normal(0, init_std) for weights, scaled by
    1/sqrt(2*n_layers) on the projections into the residual stream (GPT-2); norm weights
    such that the norm scales by 1 (ones, or zeros under model.norm_offset=1); zeros for
    biases.
    """
    tp = tp_size_of(tp_group)
    for name, p in named_parameters:
        shape = full_shape(p, tp)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        for rule in (*INIT_RULES, init_default):  # the mixers' own first (models/mixers.py)
            full = rule(name, shape, cfg, g)
            if full is not None:
                break
        p.copy_(shard_full_tensor(full, p, tp_group))


@torch.no_grad()
def init_hash_tables_(named_buffers, cfg: ModelConfig, seed: int) -> None:
    """model.moe.hash_layers' tables gate.tid2eid (V, k): k distinct experts per token id,
    drawn from (seed, crc32 of the GPT name), so every tp, cp, pp, ep draws the same."""
    for name, table in named_buffers:
        if name.endswith("tid2eid"):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            draw = torch.rand(table.shape[0], cfg.moe.num_experts, generator=g)
            table.copy_(draw.topk(table.shape[1], dim=-1).indices)


def init_default(name: str, shape, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Every parameter the mixers' own rules leave: norm weights, biases, matrices."""
    if name.endswith("norm.weight"):
        return torch.full(shape, 1.0 - cfg.norm_offset)
    if name.endswith(ROUTER_ONES):  # Gemma 4's router scales
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    scale = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(
        ("o_proj.weight", "down_proj.weight", "out_proj.weight", "experts.down_proj")) \
        else cfg.init_std
    return torch.empty(shape).normal_(0.0, scale, generator=g)


class GPT(nn.Module):
    """Embedding -> n_layers blocks -> norm -> vocab-parallel head (tied to the embedding or not)."""

    def __init__(self, cfg: ModelConfig, groups: Optional[ModelGroups] = None,
                 options: Optional[ModelOptions] = None, *, device=None, dtype=None):
        """cfg: the architecture; groups: its process groups (None: one process);
        options: the run's settings (models/options.py; None: the defaults)."""
        super().__init__()
        g, o = groups or ModelGroups(), options or ModelOptions()
        check_checkpoint_mode(o.activation_checkpointing)
        self.memory = o.memory or MemoryConfig()  # tiled loss / MLP, activation offload
        self.cp = context_parallel_of(o.cp_comm, g.cp_group, g.ulysses_group, g.ring_group,
                                      o.layout, o.ring_grad_dtype)
        tp_group = g.tp_group
        self.cfg, self.tp_group, self.cp_group = cfg, tp_group, g.cp_group
        self.activation_checkpointing = o.activation_checkpointing
        self.every_n_layers = o.every_n_layers
        selective = o.activation_checkpointing == "selective"
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group=tp_group,
                                            device=device, dtype=dtype)
        # model.per_layer_input_dim: Gemma 4's per-layer input embeddings
        self.per_layer_input = PerLayerInput(cfg, tp_group, device, dtype) \
            if cfg.per_layer_input_dim else None
        self.layer_attention = layer_attention(cfg)  # each layer's kind, window, RoPE
        moe_layers = set(moe_layer_indices(cfg.moe, cfg.n_layers))
        hashed = set(hash_layers(cfg.moe))
        self.ep_group, self.dp_cp_group = g.ep_group, g.dp_cp_group  # experts; router losses
        self.layers = nn.ModuleList(
            Block(LayerArgs(cfg, a, self.cp, tp_group, g.ep_group, i in moe_layers,
                            o.attention_backend, o.linear_cp, self.memory, selective, device,
                            dtype, hash_routed=i in hashed))
            for i, a in enumerate(self.layer_attention))
        link_shared_kv(self.layers, self.layer_attention)  # model.num_kv_shared_layers
        link_shared_layers(self.layers)  # model.dsa's 'shared' layers: the top-k before
        self.router_losses = None  # the last training forward's (models/moe.py), or None
        # dynamic CP sets the step's router rows: each forward then keeps its pack's share
        # and statistics in router_pack, with no collective (ctxpar/moe/aux.py pack_share)
        self.router_step_rows: Optional[float] = None
        self.router_pack = None
        # memory.offload_activations: what checkpointing keeps per layer in host memory
        self.offload = ActivationOffload() if self.memory.offload_activations else None
        # model.hyper_connections: the N residual streams' collapse before the final norm
        self.hc_head = HyperHead(cfg, device, dtype) if cfg.hyper_connections else None
        self.final_norm = make_norm(cfg, device, dtype)
        self.lm_head = None if cfg.tie_embeddings else ColumnParallelLinear(
            cfg.d_model, cfg.vocab_size, tp_group=tp_group, bias=False, device=device, dtype=dtype)
        # model.mtp: D multi-token prediction depths after the head (models/mtp.py)
        # (under model.mtp.moe each depth's MLP is one more MoE layer: _moe_layers)
        self.mtp = None if cfg.mtp is None else MTP(cfg, LayerArgs(
            cfg, mtp_layer_attention(cfg), self.cp, tp_group, g.ep_group, cfg.mtp.moe,
            o.attention_backend, o.linear_cp, self.memory, selective, device, dtype))
        self.mtp_loss_sums = None  # the last training forward's (D,) MTP loss sums, detached
        # the last training forward's DSA (KL sum, recall sum, recall queries), detached
        self.indexer_sums = None
        # The planner counts from the same description: a change here must change it too.
        check_parameters(self.named_parameters(), cfg, tp_size_of(tp_group),
                         1 if g.ep_group is None else dist.get_world_size(g.ep_group))
        if self.embed.weight.device.type != "meta":  # meta: shapes only, nothing to fill
            self.init_weights(o.seed)
        if cfg.dsa is not None and cfg.dsa.stage == "dense_warmup":
            freeze_all_but_indexers(self)  # the report's warm-up: only the indexers learn

    @classmethod
    def from_config(cls, cfg: Config, state, device=None, dtype=None) -> "GPT":
        """The model for this rank of a ParallelState, from the whole run config."""
        return cls(cfg.model, ModelGroups.from_state(state), ModelOptions.from_config(cfg),
                   device=device, dtype=dtype)

    def use_cp_group(self, cp_group, ulysses_group=None, ring_group=None) -> None:
        """Run the next sequences over another CP group, same pattern and layout: dynamic
        CP gives each pack its rank group (ctxpar/dynamic_cp/groups.py,
        DynamicCPGroups.tile_groups); under hybrid also the Ulysses and ring groups in it."""
        self.cp = replace(self.cp, cp_group=cp_group, ulysses_group=ulysses_group,
                          ring_group=ring_group)
        self.cp_group = cp_group
        for layer in self.layers:
            layer.use_cp(self.cp)
        for layer in self.mtp.layers if self.mtp is not None else ():
            layer.block.use_cp(self.cp)

    def init_weights(self, seed: int) -> None:
        """The layout-independent init of every parameter (``init_parameters_``) and of
        model.moe.hash_layers' tables: k distinct experts per token id, from (seed, name)."""
        init_parameters_(self.named_parameters(), self.cfg, seed, self.tp_group)
        init_hash_tables_(self.named_buffers(), self.cfg, seed)

    def _checkpointed(self, i: int) -> bool:
        return block_recomputed(self.activation_checkpointing, i, self.every_n_layers)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                labels: Optional[torch.Tensor] = None, cu_seqlens=None,
                mtp_tokens: Optional[torch.Tensor] = None,
                mtp_labels: Optional[torch.Tensor] = None,
                mtp_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens (B, T/cp) ids; positions (T/cp,) or (B, T/cp) their global positions (or,
        to restart RoPE at each document, documents.document_positions);
        labels (B, T/cp) next-token ids, -100 = ignored; cu_seqlens: packed documents'
        boundaries in the full sequence (one int32 tensor per sample, or one for all),
        attention then stays inside each document (every CP pattern and backend).

        Returns the vocab-parallel logits (B, T/cp, V/tp), or with labels the fp32 sum of
        this rank's token losses (identical on the ranks of a TP group); normalise it with
        models.loss (loss_for_backward / global_mean_loss). With labels and
        memory.tiled_loss the logits are made one tile of tokens at a time and never whole
        (ctxpar/memory/tiled_loss.py); the sum is the same.

        model.mtp, training: mtp_tokens (B, D, T/cp), the ids D steps ahead of each
        position, and mtp_labels (B, D, T/cp), the targets one further (-100: masked;
        ctxpar/data/mtp.py); the sum then adds sum_k mtp_weights[k] * S_k, S_k depth k's
        loss sum, mtp_weights (D,) models/mtp.py's mtp_loss_weights (None: lambda/D each).
        """
        stats = self._router_stats(labels is not None)
        packed = stats is not None and self.router_step_rows is not None
        if packed:  # a dynamic-CP pack: its padding's rows are not the step's
            stats.valid = (labels != IGNORE_INDEX).reshape(-1)
        x = self.hidden_states(tokens, positions, cu_seqlens=cu_seqlens)  # (B, T/cp, d)
        if labels is None:
            return self.lm_logits(x)
        loss = self.loss_sum(x, labels)
        index = indexer_losses_of(self.layers)  # model.dsa's KL sum (dense_warmup, sparse)
        recall = indexer_recalls_of(self.layers)  # 'dense_warmup' only
        self.indexer_sums = None if index is None else torch.cat((
            index.detach().reshape(1), torch.zeros(2, device=index.device) if recall is None
            else recall.to(index.device)))
        if index is not None:  # a token mean over the step's labels, as the LM loss
            loss = loss + self.cfg.dsa.loss_weight * index
        if mtp_tokens is not None:
            loss = loss + self._mtp_loss(x, positions, cu_seqlens, mtp_tokens, mtp_labels,
                                         mtp_weights)
        if packed:  # a dynamic-CP pack: its share of the step's router losses, no collective
            self.router_pack = stats.pack_share(self.cfg.moe.z_loss_coef, self.router_step_rows)
        elif stats is not None:  # after the MTP blocks' experts: one all-reduce of the
            moe = self.cfg.moe  # routers' counts over DP x CP
            self.router_losses = stats.losses(moe.aux_loss_coef, moe.z_loss_coef,
                                              self.dp_cp_group, moe.seq_aux_loss_coef,
                                              self.cp_group)
        return loss

    def _mtp_loss(self, x, positions, cu_seqlens, mtp_tokens, mtp_labels, mtp_weights):
        """sum_k mtp_weights[k] * S_k over model.mtp's depths on the final-normed x."""
        if self.mtp is None or mtp_labels is None:
            raise ValueError("GPT: mtp_tokens given without model.mtp or without mtp_labels")
        # one embedding lookup for every depth's ids: (B, D, T/cp) -> (B, D, T/cp, d)
        embeds = embed_tokens(self.embed, mtp_tokens, self.cfg)
        sums = self.mtp.loss_sums(x, embeds, positions, rotary_dim(self.cfg), cu_seqlens,
                                  mtp_labels, self.loss_sum)
        self.mtp_loss_sums = sums.detach()
        if mtp_weights is None:  # lambda/D each: N_k taken as N
            mtp_weights = torch.full_like(sums, self.cfg.mtp.loss_weight / self.cfg.mtp.depth)
        return (mtp_weights.to(sums.device) * sums).sum()

    def loss_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The fp32 sum of the head's token losses on hidden states x (B, T/cp, d)."""
        if self.memory.tiled_loss:  # head + loss per tile of tokens: no (B, T/cp, V/tp) logits
            # The weight is read here, in GPT's forward, as the tied path has always read
            # the embedding's: under ZeRO-3 DeepSpeed registers it as GPT's external
            # parameter and keeps it gathered for GPT's forward and backward.
            return tiled_vocab_parallel_cross_entropy(
                x, self.head_weight(), labels, self.tp_group, self.memory.loss_tile_tokens,
                reduction="sum")
        return vocab_parallel_cross_entropy(self.lm_logits(x), labels, self.tp_group).sum()

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor,
                      kv_cache=None, cu_seqlens=None) -> torch.Tensor:
        """The final-normed hidden states (B, T/cp, d) before the head.

        kv_cache (ctxpar.inference.KVCache): inference; every layer reads and fills its
        share of the cache (prefill of a prompt, or one decode step).
        """
        rotary = layer_rotary(positions, rotary_dim(self.cfg),
                              self.layer_attention)  # each layer's (cos, sin), fp32
        if self.cfg.attention_k_eq_v:  # k_proj x alone on the wire (training under CP)
            set_sequence_rotary(self.layers, self.layer_attention,
                                positions if kv_cache is None else None, self.cp,
                                rotary_dim(self.cfg))
        x = embed_tokens(self.embed, tokens, self.cfg)  # (B, T/cp, d)
        for mlp in self._moe_layers():  # model.moe.hash_layers choose by the ids
            if mlp.hash_routed:
                mlp.token_ids = tokens.reshape(-1)  # (B T/cp,) in the rows' order
        # (B, T/cp, L, p) under model.per_layer_input_dim, layer i's [:, :, i]
        z = None if self.per_layer_input is None else self.per_layer_input(tokens, x)
        if self.hc_head is not None:  # model.hyper_connections: (B, T/cp, N, d) streams
            x = expand_streams(x, self.cfg)
        off = self.offload  # None, or the hooks moving what each layer keeps to the host
        if off is not None:
            for cos, sin in dict.fromkeys(rotary):
                off.keep(cos, sin)  # every layer's, on the device once
        for i, layer in enumerate(self.layers):
            cos, sin = rotary[i]
            zi = None if z is None else z[:, :, i]
            if kv_cache is not None:
                x = layer(x, cos, sin, kv_cache.layer(i), per_layer_input=zi)
            elif self._checkpointed(i):  # keep only x; replay the block (and its CP attention) in backward
                x = run_layer(off, checkpoint, layer, x, cos, sin, None, cu_seqlens, zi,
                              use_reentrant=False, context_fn=layer.recompute_context)
            else:  # selective keeps x and the core's q, k, v, out, lse (offloaded); none, all
                x = run_layer(off, layer, x, cos, sin, cu_seqlens=cu_seqlens,
                              per_layer_input=zi, to_host=layer.selective)
        return self.final_norm(x if self.hc_head is None else self.hc_head(x))

    def _router_stats(self, training: bool) -> Optional[RouterStats]:
        """A fresh RouterStats handed to every MoE layer for a training forward (their
        auxiliary losses, ctxpar/moe/aux.py), None otherwise."""
        if self.cfg.moe is None:
            return None
        moe = self.cfg.moe
        stats = RouterStats(moe.num_experts, moe.score, moe.seq_aux_loss_coef > 0) \
            if training else None
        for mlp in self._moe_layers():
            mlp.stats = stats
        self.router_losses = None
        return stats

    def _moe_layers(self):
        """Every MoE layer in order: the blocks', then the MTP depths' (model.mtp.moe). As
        Megatron-Core's MTP and DeepSeek-V3 (its MTP module's MoE routed as any layer's),
        an MTP block's experts are one more MoE layer: its router statistics join the
        forward's (the load-balancing, z and sequence-level losses over every MoE layer,
        ctxpar/moe/aux.py), its correction bias moves by its own load. Its rows are every
        position's, those whose MTP target is masked too, as Megatron-Core's: the router
        sees the same tokens on every layout."""
        blocks = [layer.mlp for layer in self.layers]
        blocks += [layer.block.mlp for layer in self.mtp.layers] if self.mtp is not None else []
        return [mlp for mlp in blocks if isinstance(mlp, MoE)]

    def update_router_biases(self, layer_counts: torch.Tensor) -> None:
        """After an optimizer step: each MoE layer's aux-free balance update
        (model.moe.bias_update_rate) from its assignments per expert over the step's whole
        batch, layer_counts (L_moe, E) in layer order, the MTP depths' last
        (RouterLosses.layer_counts summed over the micro-batches; the same on every rank)."""
        # model.moe.hash_layers add no counts (as transformers') and have no bias
        moe = [mlp for mlp in self._moe_layers() if not mlp.hash_routed]
        if not moe or not self.cfg.moe.bias_update_rate:
            return
        for mlp, counts in zip(moe, layer_counts, strict=True):
            mlp.update_correction_bias(counts)

    def head_weight(self) -> torch.Tensor:
        """The head's (V/tp, d) weight: lm_head's, or the embedding's when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, T, d) -> vocab-parallel logits (B, T, V/tp)."""
        if self.lm_head is not None:
            return cap_logits(self.lm_head(x), self.cfg)
        return cap_logits(parallel_lm_logits(x, self.embed.weight, self.tp_group), self.cfg)
