"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5), the token mixer of attention layers
under model.dsa: MLA (models/mla.py) whose queries attend only to the tokens the lightning
indexer selects, as transformers' DeepseekV32Attention / GlmMoeDsaAttention compute it.

    qa        q_a_layernorm(q_a_proj(x))                 MLA's query latent  (B, T/cp, Rq)
    index_q   rope(wq_b(qa))                             (B, T/cp, Hi, Di)
    index_k   rope(k_norm(wk(x)))                        (B, T/cp, Di): one key per token
    index_w   weights_proj(x) / sqrt(Hi)                 (B, T/cp, Hi)
    score     sum_h index_w[s, h] ReLU(index_q[s, h] . index_k[t]) / sqrt(Di)
    o         MLA of q over the index_topk best-scored earlier tokens of each query

RoPE turns the first qk_rope_head_dim channels of index_q and index_k (rotate-half in
V3.2, interleaved pairs in GLM-5: model.dsa.rope_interleave). A 'shared' layer
(model.dsa.indexer_types, GLM-5) has no indexer: it attends over the previous layer's
selection, which that layer's mixer hands it (``follow``).

The indexer's input is x and qa detached: under 'frozen' it computes the indices without
gradient (transformers'), under 'dense_warmup' / 'sparse' its KL loss trains its own
weights only (the DeepSeek-V3.2 report). Over CP the indexer keys travel with the latent
blocks and the top-k is kept running per query (ctxpar.context_parallel's DSA).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ctxpar.config import ModelConfig
from ctxpar.context_parallel.sparse_latent import (indexer_kl, indexer_recall, indexer_topk,
                                                   sparse_latent_attention)
from ctxpar.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region
from ctxpar.tensor_parallel.mappings import tp_size_of

from .mla import MLA, interleaved_to_half
from .options import LayerArgs
from .rope import apply_rotary

# The indexer key's LayerNorm epsilon: transformers' DeepseekV32Indexer builds it with 1e-6
INDEX_NORM_EPS = 1e-6


class LightningIndexer(nn.Module):
    """The indexer's projections (transformers' names: wq_b, wk, k_norm, weights_proj).
    TP splits its heads as MLA's (wq_b, weights_proj by rows; the CP top-k all-reduces the
    partial scores over TP); wk and k_norm are replicated, their key passing f (its
    gradient summed over the TP ranks' heads)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, device=None, dtype=None):
        super().__init__()
        dsa, kw = cfg.dsa, dict(bias=False, device=device, dtype=dtype)
        self.tp_group, self.all_heads = tp_group, dsa.index_n_heads
        self.n_heads = dsa.index_n_heads // tp_size_of(tp_group)  # this rank's
        self.head_dim = dsa.index_head_dim
        self.rope_dim, self.interleave = cfg.mla.qk_rope_head_dim, dsa.rope_interleave
        self.wq_b = ColumnParallelLinear(cfg.mla.q_lora_rank, dsa.index_n_heads * self.head_dim,
                                         tp_group=tp_group, **kw)
        self.wk = nn.Linear(cfg.d_model, self.head_dim, **kw)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS, device=device,
                                   dtype=dtype)
        self.weights_proj = ColumnParallelLinear(cfg.d_model, dsa.index_n_heads,
                                                 tp_group=tp_group, **kw)

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        if self.interleave:  # GLM-5: pairs of the rope part, laid out as rotate-half's
            r = self.rope_dim
            x = torch.cat((interleaved_to_half(x[..., :r]), x[..., r:]), dim=-1)
        return apply_rotary(x, cos, sin)  # the first rope_dim channels turned

    def forward(self, x: torch.Tensor, qa: torch.Tensor, cos, sin):
        """x (B, T/cp, d), qa (B, T/cp, Rq) -> index_q (B, T/cp, Hi/tp, Di), index_k
        (B, T/cp, Di), index_w (B, T/cp, Hi/tp) fp32: the scores' inputs."""
        B, T = x.shape[:2]
        q = self._rope(self.wq_b(qa).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)
        k = copy_to_tensor_model_parallel_region(k, self.tp_group)
        w = self.weights_proj(x).float() * self.all_heads ** -0.5
        return q, k, w


class DSA(MLA):
    """MLA with the lightning indexer (module docstring). project_in adds the indexer's
    inputs to MLA's (q, latent); mix runs the sparse attention over CP."""

    def __init__(self, cfg: ModelConfig, args: LayerArgs, has_indexer: bool):
        super().__init__(cfg, args.tp_group, args.cp, args.backend, args.device, args.dtype,
                         args.layer)
        self.dsa = cfg.dsa
        self.indexer = LightningIndexer(cfg, args.tp_group, args.device, args.dtype) if has_indexer else None
        self._previous: tuple = ()  # a shared layer's: whose selection it uses (a tuple:
        # not a submodule, so its weights stay out of this layer's state dict)
        self.selection = None  # the last forward's top-k (a shared next layer reads it)
        self.indexer_loss = None  # the last training forward's KL loss sum (fp32), or None
        # under 'dense_warmup': the last training forward's recall summed over this rank's
        # queries, and their count (the metrics' indexer_recall), or None
        self.indexer_recall = None

    @classmethod
    def from_layer(cls, args: LayerArgs) -> "DSA":
        return cls(args.cfg, args, args.layer.has_indexer)

    def follow(self, previous) -> None:
        """A 'shared' layer uses previous's selection (GLM-5's cross-layer top-k): the DSA
        layer before, or under the pipeline the selection its tuple brought
        (models/dsa_pipe.py CarriedSelection)."""
        self._previous = (previous,)

    @property
    def previous(self) -> Optional["DSA"]:
        return self._previous[0] if self._previous else None

    def project_in(self, x: torch.Tensor, cos, sin):
        """x (B, T/cp, d) -> (q, latent, index_q, index_k, index_w) (None x3 in a shared
        layer); the indexer reads x and qa detached."""
        q, latent, qa = self.project(x, cos, sin)
        if self.indexer is None:
            return (q, latent, None, None, None), ()
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.dsa.stage != "frozen"):
            index = self.indexer(x.detach(), qa.detach(), cos, sin)
        return (q, latent, *index), ()

    def mix(self, inputs: tuple, cu_seqlens=None, cache=None) -> torch.Tensor:
        """The indexer's top-k over the CP group (or the previous layer's), then MLA over
        the selected tokens (dense under 'dense_warmup'); in training under 'dense_warmup'
        / 'sparse' the indexer's KL loss sum is left in self.indexer_loss."""
        if cache is not None:  # generation: the cache keeps the latent and the index keys
            return cache.sparse(self, *inputs)  # (ctxpar/inference/sparse_decode.py)
        return self.attend(*inputs, cu_seqlens=cu_seqlens)

    def attend(self, q, latent, index_q, index_k, index_w, cu_seqlens=None) -> torch.Tensor:
        """mix's training path (generation's prefill too): (B, T/cp, H/tp, dv)."""
        kw = dict(comm=self.cp.comm, cp_group=self.cp.cp_group, layout=self.cp.layout,
                  cu_seqlens=cu_seqlens)
        W, stage = self.kv_b_proj.weight, self.dsa.stage
        if stage == "dense_warmup":  # attention dense; the indexer learns its distribution
            indices = None
            out, lse = self.cp.latent_attention(q, latent, W, self.dims, backend=self.backend,
                                                softmax_scale=self.scale, return_lse=True,
                                                mask=self.mask(cu_seqlens))
        else:  # over the selection: this layer's top-k or the previous layer's
            indices = self.select(index_q, index_k, index_w, kw)
            out, lse = sparse_latent_attention(q, latent, W, self.dims, indices,
                                               softmax_scale=self.scale, return_lse=True, **kw)
        self.indexer_loss = self.indexer_recall = None
        if stage != "frozen" and self.indexer is not None and torch.is_grad_enabled():
            kl = indexer_kl(stage, q, latent, W, self.dims, lse, index_q, index_k, index_w,
                            indices, tp_group=self.tp(), softmax_scale=self.scale, **kw)
            self.indexer_loss = kl.sum()  # (B, T/cp) -> this rank's sum (models/loss.py)
            if stage == "dense_warmup":  # the main attention is dense: its LSE is at hand
                self.indexer_recall = self.recall(q, latent, lse, index_q, index_k, index_w,
                                                  kw)
        return out

    def recall(self, q, latent, lse, index_q, index_k, index_w, kw) -> torch.Tensor:
        """(sum, count) over this rank's queries of the share of the dense attention's top
        index_topk keys that the indexer selects (sparse_latent.indexer_recall: one more
        pass of the latent, no gradient). Under 'sparse' the main attention is not dense,
        and a dense pass for a metric is not run."""
        with torch.no_grad():
            chosen = indexer_topk(index_q, index_k, index_w, self.dsa.index_topk,
                                  tp_group=self.tp(), **kw)
            r = indexer_recall(q, latent, self.kv_b_proj.weight, self.dims, lse, chosen,
                               self.dsa.index_topk, tp_group=self.tp(),
                               softmax_scale=self.scale, **kw)
        return torch.stack((r.sum(), torch.tensor(float(r.numel()), device=r.device)))

    def tp(self):
        """The TP group the indexer's and the main heads are split over (None: no TP)."""
        return self.tp_group if tp_size_of(self.tp_group) > 1 else None

    def select(self, index_q, index_k, index_w, kw) -> torch.Tensor:
        """(B, T/cp, min(topk, n)) global positions of each query's selected keys (-1:
        none): this layer's indexer over CP, or a shared layer's previous selection."""
        if self.indexer is None:
            self.selection = self.previous.selection
        else:
            self.selection = indexer_topk(index_q, index_k, index_w, self.dsa.index_topk,
                                          tp_group=self.tp(), **kw)
        return self.selection


def link_shared_layers(blocks) -> None:
    """GLM-5's 'shared' layers: each DSA mixer without an indexer follows the one before."""
    for before, block in zip(blocks, blocks[1:]):
        mixer = block.mixer
        if isinstance(mixer, DSA) and mixer.indexer is None:
            mixer.follow(before.mixer)


def indexer_losses_of(blocks) -> Optional[torch.Tensor]:
    """The last training forward's indexer KL, summed over this rank's tokens and the
    layers with an indexer (fp32 scalar); None: no layer has one (model.dsa unset or
    'frozen')."""
    losses = [b.mixer.indexer_loss for b in blocks
              if isinstance(b.mixer, DSA) and b.mixer.indexer_loss is not None]
    return torch.stack(losses).sum() if losses else None


def indexer_recalls_of(blocks) -> Optional[torch.Tensor]:
    """(recall sum, queries) over this rank's queries and the layers with an indexer, of
    the last training forward under 'dense_warmup' (fp32 (2,)); None otherwise."""
    recalls = [b.mixer.indexer_recall for b in blocks
               if isinstance(b.mixer, DSA) and b.mixer.indexer_recall is not None]
    return torch.stack(recalls).sum(0) if recalls else None


def freeze_all_but_indexers(model: nn.Module) -> None:
    """model.dsa.stage 'dense_warmup' (DeepSeek-V3.2 report, §2.1): the main model frozen,
    only the lightning indexers' parameters train (the optimizer takes the parameters
    that require a gradient: models/training.py)."""
    for name, p in model.named_parameters():
        if ".indexer." not in name:
            p.requires_grad_(False)
