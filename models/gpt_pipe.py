"""The GPT as a DeepSpeed PipelineModule: TP x CP x PP x DP through DeepSpeed's pipeline engine.

The same pieces as models/gpt.py, cut into a flat list of layers DeepSpeed partitions into
stages (by parameter count or uniformly):

    embedding | block 0 | ... | block L-1 | final norm | head (tied: the embedding again)

Between layers (and between stages, point to point) flows the tuple
``(x (B, T/cp, d), positions (T/cp,) or (B, T/cp) int64)`` (under model.hyper_connections
x is the N residual streams (B, T/cp, N, d): the embedding expands them, the final norm's
layer collapses them first with hc_head), plus, with document masking,
the samples' document boundaries packed as one (B, T + 1) int32 tensor
(documents.pack_cu_seqlens), then Gemma 4's shared K/V and per-layer inputs and
DeepSeek-V4's token ids (model.moe.hash_layers) still read by
later blocks (models/pipe_carry.py): every block rebuilds its RoPE angles from the positions
(T/cp x hd/2, negligible next to the block's matmuls), and DeepSpeed sends no gradient for
the integer tensors. A mixture of experts (model.moe) adds, last, its routers' statistics
so far (RouterStats.packed, (2E + 3,) fp32): the last stage's loss adds the routers'
losses of every stage's layers, and their gradients travel back with the activations'
(under parallel.ep each stage's MoE layers split their experts over the stage's EP group,
and after the step each stage moves its own layers' correction biases: docs/parallelism.md,
"Pipeline x EP"). DeepSeek sparse attention (model.dsa) adds after them a GLM-5 shared
layer's selection and the indexer's loss sums (models/dsa_pipe.py). The first stage gets
``(tokens, positions[, documents])`` and the last stage ``labels`` from the data iterator
(``pipeline_batches``); the head
returns vocab-parallel logits (B, T/cp, V/tp) and ``TokenMeanLoss`` turns them into the
loss to back-propagate. With memory.tiled_loss the head returns its input and weight
instead, and ``TokenMeanLoss`` makes the logits one tile of tokens at a time
(ctxpar/memory/tiled_loss.py): the last stage never holds them whole. Tied embeddings
are one ``TiedLayerSpec`` on the first and last stage (DeepSpeed all-reduces the tied
gradient between them). model.mtp adds its depths after the head, on the last stage, and
the loss runs them (models/mtp_pipe.py).

    model = GPTPipe.from_config(cfg, state, gas)     # this rank's stage only
    engine, *_ = deepspeed.initialize(model=model, optimizer=..., config=...)  # no mpu=
    loss = train_step(engine, micro, n_tokens, state)  # the global token-mean loss

Parameters are initialised under GPT's names (``layers.3.attn.q_proj.weight``) with GPT's
per-name generators, so the pipelined model starts from exactly the non-pipelined weights.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch.utils.checkpoint import checkpoint

from ctxpar.config import Config, MemoryConfig, ModelConfig, layer_attention
from ctxpar.config.moe import hash_layers, moe_layer_indices
from ctxpar.config.layers import mtp_layer_attention
from ctxpar.config.pipeline_stages import keep_on_last_stage, pipeline_stage_layers
from ctxpar.context_parallel import ContextParallel
from ctxpar.context_parallel.documents import pack_cu_seqlens, unpack_cu_seqlens
from ctxpar.distributed.deepspeed_comm import init_deepspeed_comm
from ctxpar.memory.tiled_eval import HeadInputs
from ctxpar.memory.tiled_loss import tiled_vocab_parallel_cross_entropy
from ctxpar.memory.offload import ActivationOffload, run_layer
from ctxpar.moe import RouterStats
from ctxpar.distributed.pipeline_parallel import pipeline_topology
from ctxpar.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                    gather_full_state_dict, parallel_lm_logits,
                                    vocab_parallel_cross_entropy)
from models.block import Block
from models.dsa import freeze_all_but_indexers
from models.dsa_pipe import (CarriedSelection, DSATail, indexer_loss_of, recv_tail,
                             run_with_selection, send_selection, warmup_stage)
from models.gpt import (block_recomputed, cap_logits, check_checkpoint_mode, embed_tokens,
                        init_hash_tables_, init_parameters_)
from models.hyper_connections import HyperHead, expand_streams, residual_shape
from models.loss import global_mean_loss, loss_for_backward
from models.moe import MoE
from models.mtp_pipe import MTPLoss, MTPPipe, mtp_tail, stage_labels
from models.norms import make_norm
from models.options import LayerArgs, ModelOptions
from models.per_layer_input import PerLayerInput
from models.pipe_backward import one_backward
from models.pipe_carry import (LayerCarry, carried_after, first_carried, output_carried,
                               recv_carried, send_carried)
from models.rope import layer_inputs


class EmbeddingPipe(nn.Module):
    """(tokens (B, T/cp), positions[, documents]) -> (x (B, T/cp, d), positions[, documents],
    the per-layer inputs of every block under model.per_layer_input_dim, the token ids under
    model.moe.hash_layers (models/pipe_carry.py)); under model.hyper_connections x is the
    N equal streams (B, T/cp, N, d)."""

    gpt_prefix = ""  # parameters 'embed.weight', 'per_layer_input.*', as in GPT

    def __init__(self, cfg: ModelConfig, tp_group, device=None, dtype=None,
                 per_layer_input: bool = True):
        """per_layer_input: False for the tied head's copy (the head reads embed only)."""
        super().__init__()
        self.cfg = cfg  # model.scale_embeddings
        self.dsa_tail = DSATail(cfg)  # model.dsa's indexer sums (models/dsa_pipe.py)
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_group=tp_group,
                                            device=device, dtype=dtype)
        self.per_layer_input = PerLayerInput(cfg, tp_group, device, dtype) \
            if cfg.per_layer_input_dim and per_layer_input else None

    def forward(self, inputs):
        tokens, *rest = inputs  # rest: positions[, packed document boundaries]
        x = embed_tokens(self.embed, tokens, self.cfg)
        z = None if self.per_layer_input is None else self.per_layer_input(tokens, x)
        if self.cfg.hyper_connections:  # the residual as N streams (models/hyper_connections.py)
            x = expand_streams(x, self.cfg)
        return (x, *rest, *first_carried(self.cfg, z, tokens), *router_start(self.cfg, x.device),
                *self.dsa_tail.start(x.device))


def router_start(cfg: ModelConfig, device) -> tuple:
    """The routers' statistics the first stage hands on: zeros requiring grad (DeepSpeed
    back-propagates every floating tensor of a stage's outputs), or nothing without
    model.moe."""
    if cfg.moe is None:
        return ()
    return (torch.zeros(2 * cfg.moe.num_experts + 3, device=device, requires_grad=True),)


def split_router(x):
    """A head's input: (x, routers' statistics, indexer sums) under model.moe / model.dsa's
    loss (either may be absent), else x -> (x, tail tuple)."""
    return (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, ())


def tied_lm_head(module: EmbeddingPipe, x):
    """The tied head on the last stage: x (B, T/cp, d) -> logits (B, T/cp, V/tp) = f(x) E_iᵀ
    (under model.moe, (logits, the routers' statistics))."""
    x, router = split_router(x)
    logits = cap_logits(parallel_lm_logits(x, module.embed.weight, module.embed.tp_group),
                        module.cfg)
    return (logits, *router) if router else logits


def tied_head_input(module: EmbeddingPipe, x) -> tuple:
    """The tied head under memory.tiled_loss: (x (B, T/cp, d), E_i (V/tp, d)), for
    TokenMeanLoss to make the logits tile by tile (the weight's gradient still reaches the
    tied copy, which DeepSpeed all-reduces with the first stage's)."""
    x, router = split_router(x)
    return (x, module.embed.weight, *router)


class BlockPipe(Block):
    """models.gpt.Block on (x, positions); whole-block checkpointing decided per layer index."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, cp: ContextParallel,
                 backend: str, activation_checkpointing: str, every_n_layers: int,
                 device=None, dtype=None, memory: Optional[MemoryConfig] = None,
                 offload: Optional[ActivationOffload] = None, linear_cp: str = "state",
                 ep_group=None, router_groups: tuple = (None, 1)):
        """router_groups: (the CP group, dp), what the sequence-level loss's share needs
        (its counts summed over a row's CP ranks; the rows of all dp x cp ranks, B dp)."""
        layer = layer_attention(cfg)[layer_number]  # its kind, window, chunks, RoPE
        moe = layer_number in moe_layer_indices(cfg.moe, cfg.n_layers)
        super().__init__(LayerArgs(cfg, layer, cp, tp_group, ep_group, moe, backend,
                                   linear_cp, memory or MemoryConfig(),
                                   activation_checkpointing == "selective", device, dtype,
                                   hash_routed=layer_number in hash_layers(cfg.moe)))
        self.carries_router = cfg.moe is not None  # the routers' statistics in the tuple
        # model.dsa: the top-k into a shared layer and the indexer's sums (models/dsa_pipe.py)
        self.layer_number, self.dsa_tail = layer_number, DSATail(cfg)
        self.carried = CarriedSelection() if self.dsa_tail.takes_selection(layer_number) \
            else None
        if self.carried is not None:
            self.mixer.follow(self.carried)
        self.cp_group, self.dp_size = router_groups
        # the aux-free balance: this layer's assignments per expert over the step's
        # training forwards on this rank (GPTPipe.update_router_biases sums them over dp x cp)
        self.step_counts: Optional[torch.Tensor] = None
        self.offload = offload  # the stage's, shared by its blocks (memory.offload_activations)
        self.gpt_prefix = f"layers.{layer_number}."
        self.layer = layer  # its RoPE, or NoPE's temperature (models/rope.layer_inputs)
        # Gemma 4's shared K/V and per-layer inputs, the token ids in the tuple
        # (models/pipe_carry.py)
        self.carry = LayerCarry(cfg, layer_number, self.mixer, self.mlp)
        # The global index, so 'every_n_layers' picks the same blocks as GPT on any stage.
        self.recompute = block_recomputed(activation_checkpointing, layer_number, every_n_layers)

    def forward(self, inputs):
        inputs, selection, sums = self.dsa_tail.split(inputs, self.layer_number)
        x, positions, *docs = inputs  # (B, T/cp[, N], d), (T/cp,) or (B, T/cp)[, (B, T+1)],
        router = (docs.pop(),) if self.carries_router else ()  # *carried[, router]
        docs, kv, z, ids = self.carry.split(docs)
        # a hash-routed MoE adds nothing to the routers' statistics (models/moe.py)
        moe = self.mlp.moe if isinstance(self.mlp, MoE) and not self.mlp.hash_routed else None
        if moe is not None:  # this forward's routers (the last stage's loss adds them)
            self.mlp.stats = RouterStats(moe.num_experts, moe.score, moe.seq_aux_loss_coef > 0)
        cos = sin = None  # RoPE for the mixers that take it (attention), none for the rest
        if self.mixer is not None and self.mixer.rotary_dim is not None:
            cos, sin = layer_inputs(positions, self.mixer.rotary_dim,
                                    self.layer)  # (..., T/cp, rotary_dim/2)
        cu = unpack_cu_seqlens(docs[0]) if docs else None
        block = run_with_selection(
            partial(self.carry.run, partial(Block.forward, self, cu_seqlens=cu)),
            self.carried, selection)
        args = (x, cos, sin, *self.carry.block_args(kv, z, ids))
        if self.recompute:  # keep only x (and cos, sin); replay the block in backward
            x = run_layer(self.offload, checkpoint, block, *args, use_reentrant=False,
                          context_fn=self.recompute_context)
        else:  # with offload, selective's saved tensors go to the host; none's stay
            x = run_layer(self.offload, block, *args, to_host=self.selective)
        x, *produced = x if isinstance(x, tuple) else (x,)  # a producer's (x, k, v)
        if router and moe is not None:
            router = (self.mlp.stats.packed(router[0], self._after_moe(x.shape[0])),)
        return (x, positions, *docs, *self.carry.pack(kv, z, ids, tuple(produced)), *router,
                *self.dsa_tail.after(self.layer_number, self.mixer, sums))

    def _after_moe(self, batch: int) -> Optional[torch.Tensor]:
        """After a training forward's MoE: its counts added to the step's, and its share of
        the sequence-level loss over the B dp rows of the micro-batch (collective over CP,
        as at pp 1: ctxpar/moe/seq_aux.py), or None (no such loss, or pipeline_logits'
        evaluation, whose routers' statistics nothing reads)."""
        stats = self.mlp.stats
        if not torch.is_grad_enabled():
            return None
        counts = stats.layer_counts[0]
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        if stats.seq is None:
            return None
        return stats.seq.share(counts.new_tensor(float(batch * self.dp_size)), self.cp_group)


class FinalNormPipe(nn.Module):
    """(x, positions[, documents]) -> norm(x) (B, T/cp, d); the positions end here (under
    model.moe / model.dsa's loss: (norm(x), the routers' statistics, the indexer's sums)).
    Under model.hyper_connections the N streams (B, T/cp, N, d) collapse first (hc_head)."""

    gpt_prefix = ""  # parameters 'final_norm.weight', 'hc_head.*', as in GPT

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.hc_head = HyperHead(cfg, device, dtype) if cfg.hyper_connections else None
        self.final_norm = make_norm(cfg, device, dtype)
        self.tail = int(cfg.moe is not None) + int(DSATail(cfg).sums)

    def forward(self, inputs):
        x = inputs[0] if self.hc_head is None else self.hc_head(inputs[0])
        x = self.final_norm(x)
        return (x, *inputs[len(inputs) - self.tail:]) if self.tail else x


class LMHeadPipe(nn.Module):
    """Untied head: x (B, T/cp, d) -> logits (B, T/cp, V/tp), column-parallel; with
    ``tiled_loss`` (or model.mtp), (x, weight (V/tp, d)) for TokenMeanLoss to make the
    logits tile by tile (or every depth's, models/mtp_pipe.py)."""

    gpt_prefix = ""  # parameter 'lm_head.weight', as in GPT

    def __init__(self, cfg: ModelConfig, tp_group, tiled_loss: bool = False, device=None,
                 dtype=None):
        super().__init__()
        self.tiled_loss, self.cfg = tiled_loss, cfg
        self.lm_head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp_group=tp_group,
                                            bias=False, device=device, dtype=dtype)

    def forward(self, x):
        x, router = split_router(x)
        out = ((x, self.lm_head.weight) if self.tiled_loss else
               (cap_logits(self.lm_head(x), self.cfg),)) + router
        return out if len(out) > 1 else out[0]


class TokenMeanLoss:
    """The last stage's loss_fn: per micro-batch, L = S * dp*cp * gas / N.

    S is the sum of this rank's token losses (fp32, complete over TP), N the non-ignored
    tokens of the whole optimizer step over dp x cp (``begin_step``, before train_batch).
    Under model.moe the head's outputs end with the routers' statistics of every stage's
    layers: their losses' share on this rank (ctxpar/moe/aux.py, collective over dp x cp)
    is added times dp*cp, as models/moe_steps.py adds it without a pipeline, and the
    step's values are kept for the metrics (``router``). Under model.dsa's loss they end
    with the indexer's sums: S adds loss_weight x the KL sum, as GPT.forward's does
    (``indexer``: models/dsa_pipe.py's IndexerLoss).
    It takes the head's logits, or under memory.tiled_loss the head's (input, weight) and
    runs head and loss together one tile of tokens at a time (same S). Under model.mtp
    (``mtp``, models/mtp_pipe.py) it takes the head's (input, weight) and labels with the
    depths' inputs, and S adds the depths' weighted sums (their routers' statistics, under
    model.mtp.moe, join the carried ones before the routers' losses are taken).
    DeepSpeed's pipeline engine divides by gas in backward and averages gradients over
    its 'data' group, dp x cp (docs/parallelism.md, "Pipeline (4D)"), so the applied
    gradient is sum dS / N, the gradient of the global token mean. S is also summed here
    so the logged loss is computed exactly as without a pipeline.
    """

    def __init__(self, tp_group, reduce_size: int, grad_accum_steps: int,
                 memory: Optional[MemoryConfig] = None, moe=None, dp_cp_group=None,
                 indexer=None, mtp: Optional[MTPLoss] = None):
        self.tp_group, self.reduce_size, self.gas = tp_group, reduce_size, grad_accum_steps
        self.memory = memory or MemoryConfig()
        self.moe, self.dp_cp_group = moe, dp_cp_group  # model.moe's routers' losses
        self.indexer = indexer  # model.dsa's indexer loss (an IndexerLoss), or None
        self.mtp = mtp  # model.mtp: the depths' losses beside the LM's (models/mtp_pipe.py)
        self.n_tokens: Optional[torch.Tensor] = None
        self.loss_sum = torch.zeros(())
        self.router: Optional[dict] = None

    def begin_step(self, n_tokens: torch.Tensor, micro=None) -> None:
        """N of the step; micro: its micro-batches (model.mtp reads the depths' weights)."""
        self.n_tokens = n_tokens
        self.loss_sum = torch.zeros((), device=n_tokens.device)
        self.router = None
        if self.indexer is not None:
            self.indexer.begin_step()
        if self.mtp is not None:
            self.mtp.begin_step(micro, n_tokens.device)

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        assert self.n_tokens is not None, "begin_step(n_tokens) before train_batch"
        outputs, router, index = self._split(outputs)
        loss = self._loss(outputs, labels, index)
        if router is None:
            return loss
        if self.mtp is not None:  # model.mtp.moe: the depths' routers after the blocks'
            router = self.mtp.add_router_stats(router, labels[0].shape[0])
        return loss + self._router_share(router)

    def _split(self, outputs):
        """The head's outputs -> (logits or (x, weight), routers' statistics or None,
        indexer sums or None): the tail's tensors are last."""
        n = int(self.moe is not None) + int(self.indexer is not None)
        if not n:
            return outputs, None, None
        head, tail = list(outputs[:-n]), list(outputs[-n:])
        index = tail.pop() if self.indexer is not None else None
        router = tail.pop() if self.moe is not None else None
        return (head[0] if len(head) == 1 else tuple(head)), router, index

    def _router_share(self, packed: torch.Tensor) -> torch.Tensor:
        """The routers' losses' share of this rank, times dp*cp; the step's values kept."""
        m = self.moe
        r = RouterStats.unpack(packed, m.num_experts).losses(m.aux_loss_coef, m.z_loss_coef,
                                                             self.dp_cp_group,
                                                             m.seq_aux_loss_coef)
        values = torch.stack([r.aux_loss, r.z_loss, r.seq_aux_loss]) / self.gas
        if self.router is None:
            self.router = dict(values=values, counts=r.tokens_per_expert)
        else:
            self.router["values"] += values
            self.router["counts"] += r.tokens_per_expert
        return r.share * self.reduce_size

    def _loss(self, outputs, labels, index=None) -> torch.Tensor:
        if self.mtp is not None:  # the head's (x, weight); labels: mtp_pipe.stage_labels'
            s = self.mtp.loss_sum(outputs, labels, self._token_sum)
        else:
            s = self._token_sum(outputs, labels)
        if index is not None:  # + loss_weight x the indexer's KL sum (models/dsa_pipe.py)
            s = self.indexer.add(s, index)
        self.loss_sum += s.detach()
        return loss_for_backward(s, self.n_tokens, self.reduce_size, self.gas)

    def _token_sum(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """S: the fp32 sum of the token losses of the head's output."""
        if self.memory.tiled_loss:
            x, weight = outputs  # (B, T/cp, d), (V/tp, d): the head's input and weight
            s = tiled_vocab_parallel_cross_entropy(x, weight, labels, self.tp_group,
                                                   self.memory.loss_tile_tokens, reduction="sum")
        else:  # outputs: the logits (B, T/cp, V/tp)
            s = vocab_parallel_cross_entropy(outputs, labels, self.tp_group).sum()  # fp32
        return s


class GPTPipe(PipelineModule):
    """This rank's pipeline stage of the GPT (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, state, options: Optional[ModelOptions] = None, *,
                 grad_accum_steps: int = 1, partition_method: str = "parameters", device=None,
                 dtype=None):
        """state: the ParallelState (its groups and the pipeline's topology); options: the
        run's settings (models/options.py; None: the defaults)."""
        o = options or ModelOptions()
        layout, cp_comm, ring_grad_dtype = o.layout, o.cp_comm, o.ring_grad_dtype
        attention_backend, memory = o.attention_backend, o.memory
        activation_checkpointing, every_n_layers = o.activation_checkpointing, o.every_n_layers
        check_checkpoint_mode(activation_checkpointing)
        init_deepspeed_comm()  # PipelineModule builds groups with deepspeed.comm
        tp, cp = state.tp_group, ContextParallel.from_state(state, cp_comm, layout,
                                                                ring_grad_dtype)
        kw = dict(device=device, dtype=dtype)
        tiled_loss = memory is not None and memory.tiled_loss
        hands_on = tiled_loss or cfg.mtp is not None  # the head hands on (x, weight)
        tied = dict(tied_weight_attr=["embed.weight"])
        if cfg.tie_embeddings:
            head = tied_head_input if hands_on else tied_lm_head
            last = TiedLayerSpec("embed", EmbeddingPipe, cfg, tp, forward_fn=head, **tied, **kw,
                                 per_layer_input=False)
        else:
            last = LayerSpec(LMHeadPipe, cfg, tp, hands_on, **kw)
        offload = ActivationOffload() if memory and memory.offload_activations else None
        # under EP a stage's experts are split over its EP group (folded into dp x cp)
        ep_group = state.ep_group if state.ep_size > 1 else None
        # model.mtp: its depths after the head, and under an untied head the embedding's
        # copy they read, all on the last stage (models/mtp_pipe.py)
        tail = mtp_tail(cfg, LayerArgs(
            cfg, mtp_layer_attention(cfg), cp, tp, ep_group, cfg.mtp.moe, attention_backend,
            o.linear_cp, memory or MemoryConfig(), activation_checkpointing == "selective",
            device, dtype), EmbeddingPipe, tp, per_layer_input=False, **kw) \
            if cfg.mtp is not None else []
        first = TiedLayerSpec("embed", EmbeddingPipe, cfg, tp, **tied, **kw) \
            if cfg.tie_embeddings or tail else LayerSpec(EmbeddingPipe, cfg, tp, **kw)
        blocks = [LayerSpec(BlockPipe, cfg, i, tp, cp, attention_backend,
                            activation_checkpointing, every_n_layers, memory=memory,
                            offload=offload, linear_cp=o.linear_cp, ep_group=ep_group,
                            router_groups=(state.cp_group, state.dp_size), **kw)
                  for i in range(cfg.n_layers)]
        loss_fn = TokenMeanLoss(tp, state.dp_cp_size, grad_accum_steps, memory, cfg.moe,
                                state.dp_cp_group, indexer_loss_of(cfg),
                                MTPLoss(cfg, tp, tiled_loss, (state.cp_group, state.dp_size))
                                if tail else None)
        # no_grad: DeepSpeed broadcasts the tied weights in place while building; with grad
        # mode on, autograd records that broadcast on the parameter and warns in backward.
        with torch.no_grad():
            super().__init__(layers=[first, *blocks, LayerSpec(FinalNormPipe, cfg, **kw), last,
                                     *tail],
                             topology=pipeline_topology(state.order, state.sizes),
                             loss_fn=loss_fn, partition_method=partition_method,
                             activation_checkpoint_interval=0)  # checkpointing is per block
        if state.ep_size > 1:  # config checked that every stage holds a MoE layer by this
            stages = pipeline_stage_layers(cfg, state.pp_size, state.tp_size, state.ep_size,
                                           partition_method)
            built = range(max(self.parts[state.pp_rank] - 1, 0),
                          min(self.parts[state.pp_rank + 1] - 1, cfg.n_layers))
            if stages[state.pp_rank] != built:
                raise RuntimeError(f"pipeline stage {state.pp_rank} holds blocks {list(built)}, "
                                   f"config's check (ctxpar/config/moe.py) predicted "
                                   f"{list(stages[state.pp_rank])}")
        self.cfg, self.tp_group, self.dp_cp_group = cfg, tp, state.dp_cp_group
        self.memory = memory or MemoryConfig()  # tiled loss / MLP, activation offload
        self.offload = offload  # shared by this stage's blocks
        self.init_weights(o.seed)
        if tail and state.is_pp_last_stage:  # the loss runs the depths on this stage
            depths = next(m for m in self.forward_funcs if isinstance(m, MTPPipe))
            loss_fn.mtp.bind(depths.mtp, self.tied_modules["embed"])
        self.warmup = DSATail(cfg).warmup  # model.dsa's dense warm-up
        if self.warmup:
            freeze_all_but_indexers(self)  # the report's warm-up, as GPT: only indexers learn

    def forward(self, forward_input):
        """This stage's layers; under model.dsa's dense warm-up in training, on frozen
        hidden states (models/dsa_pipe.py warmup_stage). What a stage before the last hands
        on takes one backward however many tensors it carries (models/pipe_backward.py)."""
        last = self.stage_id == self.num_stages - 1
        if not (self.warmup and torch.is_grad_enabled()):
            out = super().forward(forward_input)
        else:
            out = warmup_stage(super().forward, forward_input, last)
        return out if last else one_backward(out)

    def _partition_layers(self, method: str = "uniform") -> None:
        """DeepSpeed's partition; under model.mtp the head and the layers after it moved to
        the last stage (keep_on_last_stage: the config's checks and the planner read the
        same)."""
        super()._partition_layers(method)
        specs = self._layer_specs
        if any(getattr(s, "typename", None) is MTPPipe for s in specs):
            head = next(i for i, s in enumerate(specs) if getattr(s, "typename", None)
                        is MTPPipe) - 1
            self.parts = keep_on_last_stage(self.parts, head)
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    @classmethod
    def from_config(cls, cfg: Config, state, grad_accum_steps: int, device=None,
                    dtype=None) -> "GPTPipe":
        """This rank's stage for a ParallelState, from the whole run config."""
        return cls(cfg.model, state, ModelOptions.from_config(cfg),
                   grad_accum_steps=grad_accum_steps,
                   partition_method=cfg.parallel.pp_partition, device=device, dtype=dtype)

    def update_router_biases(self) -> None:
        """After an optimizer step: the aux-free balance update (model.moe.bias_update_rate)
        of this stage's MoE layers, each from its own assignments per expert over the step
        (every micro-batch's forward here, summed over dp x cp: the whole batch's, as
        GPT.update_router_biases gets them). A layer's bias and its counts live on the same
        stage, so nothing crosses the pipeline. Collective over dp x cp."""
        blocks = [m for m in self.forward_funcs  # hash-routed layers have no bias
                  if isinstance(m, BlockPipe) and isinstance(m.mlp, MoE) and
                  not m.mlp.hash_routed]
        mtp = self.loss_fn.mtp if self.loss_fn.mtp is not None and \
            self.loss_fn.mtp.moe_layers else None  # model.mtp.moe, the last stage: its depths
        mlps = [b.mlp for b in blocks] + (mtp.moe_layers if mtp is not None else [])
        if mlps and self.cfg.moe.bias_update_rate:
            counts = torch.cat(([torch.stack([b.step_counts for b in blocks])] if blocks
                                else []) + ([mtp.step_counts] if mtp else []))  # (L, E)
            if dist.get_world_size(self.dp_cp_group) > 1:
                dist.all_reduce(counts, group=self.dp_cp_group)
            for mlp, c in zip(mlps, counts, strict=True):
                mlp.update_correction_bias(c)
        for block in blocks:  # the next step counts afresh
            block.step_counts = None
        if mtp is not None:
            mtp.step_counts = None

    def gpt_named_parameters(self, buffers: bool = False) -> Iterator:
        """(GPT's name, parameter) for every parameter of this stage, tied ones once (or,
        buffers, every buffer)."""
        layers = [m for name, m in self.named_children() if name.isdigit()]
        for module in layers + list(self.tied_modules.values()):
            named = module.named_buffers() if buffers else module.named_parameters()
            for name, p in named:
                yield module.gpt_prefix + name, p

    def full_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """This stage's parameters (or gradients) at tp=1 shapes under GPT's names.

        Collective over the TP group; the union over stages is GPT's full state dict.
        """
        named = SimpleNamespace(named_parameters=self.gpt_named_parameters)
        return gather_full_state_dict(named, self.tp_group, grads=grads)

    def init_weights(self, seed: int) -> None:
        """GPT's init under GPT's names: the same weights (and model.moe.hash_layers'
        tables) as the non-pipelined model."""
        init_parameters_(self.gpt_named_parameters(), self.cfg, seed, self.tp_group)
        init_hash_tables_(self.gpt_named_parameters(buffers=True), self.cfg, seed)


def stage_inputs(mb: Dict[str, torch.Tensor]) -> tuple:
    """The first stage's inputs: (tokens, positions), and the packed document boundaries
    when the micro-batch has them (data.document_mask)."""
    if "cu_seqlens" not in mb:
        return mb["tokens"], mb["positions"]
    seq_len = int(mb["cu_seqlens"][0][-1])  # every sample's boundaries end at T
    docs = pack_cu_seqlens(mb["cu_seqlens"], seq_len)
    return mb["tokens"], mb["positions"], docs.to(mb["tokens"].device)


def pipeline_batches(micro: List[Dict[str, torch.Tensor]]) -> Iterator:
    """What train_batch pulls: ((tokens, positions[, documents]), labels) per micro-batch.

    Only the first stage reads the inputs and only the last stage the labels (under
    model.mtp with the depths' inputs: mtp_pipe.stage_labels); every rank passes the same
    micro-batches (they all read the same samples of their DP rank).
    """
    out = []
    for mb in micro:
        inputs = stage_inputs(mb)  # (tokens, positions[, documents])
        out.append((inputs, stage_labels(mb, inputs[2:]) if "mtp_tokens" in mb
                    else mb["labels"]))
    return iter(out)


def train_step(engine, micro: List[Dict[str, torch.Tensor]], n_tokens: torch.Tensor,
               state) -> torch.Tensor:
    """One optimizer step through the pipeline; returns the global token-mean loss on every
    rank (collective). n_tokens: N of the step over dp x cp (models.loss.global_token_count)."""
    loss_fn = engine.module.loss_fn
    loss_fn.begin_step(n_tokens, micro)
    engine.train_batch(pipeline_batches(micro))
    return pipeline_mean_loss(loss_fn.loss_sum, n_tokens, state)


@torch.no_grad()
def pipeline_mean_loss(loss_sum: torch.Tensor, n_tokens: torch.Tensor, state) -> torch.Tensor:
    """sum S / N over dp x cp of the last stage, broadcast to every stage (0-dim fp32)."""
    mean = global_mean_loss(loss_sum, n_tokens, state.dp_cp_group)  # real on the last stage
    if state.pp_size > 1:
        dist.broadcast(mean, src=state.ranks("pp")[-1], group=state.pp_group)
    return mean


@torch.no_grad()
def pipeline_logits(model: GPTPipe, state, mb: Dict[str, torch.Tensor],
                    head_inputs: bool = False):
    """Forward one micro-batch stage by stage: logits (B, T/cp, V/tp) on the last stage,
    None on the others. Collective over the pipeline (every stage calls it with its mb).
    Under memory.tiled_loss the head hands on (x, weight): with ``head_inputs`` they are
    returned as HeadInputs (the evaluation makes the logits a tile at a time), else the
    logits are made here, whole (no_grad keeps no softmax for a backward).

    Each stage runs its layers and sends x (B, T/cp, d) to the same (tp, cp, dp) rank of
    the next stage; every rank has the positions. Not DeepSpeed's eval_batch: in 0.19.8,
    eval_batch(compute_loss=False) adds the logits to the training loss accumulator left
    by train_batch and fails.
    """
    pp, stage, cfg = state.ranks("pp"), state.pp_rank, model.cfg
    first = stage_inputs(mb)  # (tokens, positions[, documents])
    dsa = DSATail(cfg)  # model.dsa: a shared layer's selection crosses too (dsa_pipe.py)
    if state.is_pp_first_stage:
        inputs = first
    else:
        p = next(model.parameters())
        x = torch.empty(*mb["tokens"].shape, *residual_shape(cfg), dtype=p.dtype,
                        device=p.device)
        dist.recv(x, src=pp[stage - 1])
        # Blocks and the final norm take (x, positions[, documents][, carried]); a head-only
        # stage, x. Layer j of the list is block j - 1: the carried tensors after the block
        # before this stage's first (models/pipe_carry.py), then the DSA tail (dsa_pipe.py).
        layer = model.partitions()[stage] - 1  # the stage's first block (n_layers: the norm)
        carried = recv_carried(carried_after(cfg, layer - 1), x, pp[stage - 1], first[0])
        inputs = x if layer == cfg.n_layers + 1 else (
            x, *first[1:], *carried, *router_start(cfg, x.device),
            *recv_tail(dsa, layer, x, getattr(cfg.dsa, "index_topk", 0),
                       x.shape[1] * state.cp_size, pp[stage - 1]))
    out = model(inputs)
    if not state.is_pp_last_stage:  # x, then what the next stage's blocks read beside it
        following = model.partitions()[stage + 1] - 1
        dist.send((out[0] if isinstance(out, tuple) else out).contiguous(), dst=pp[stage + 1])
        send_carried(output_carried(cfg, following - 1, out, dsa.size(following)),
                     pp[stage + 1])
        send_selection(dsa, following, out, pp[stage + 1])
        return None
    tail = int(cfg.moe is not None) + int(dsa.sums)  # routers' statistics, indexer sums: unused
    if tail and isinstance(out, tuple):
        out = out[:-tail] if len(out) > tail + 1 else out[0]
    if isinstance(out, tuple):  # (x, weight): the tiled loss's or model.mtp's head
        return HeadInputs(*out) if head_inputs else \
            cap_logits(parallel_lm_logits(*out, model.tp_group), cfg)
    return out
