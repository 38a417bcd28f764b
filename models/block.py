"""One layer of the GPT: a token mixer and a channel mixer, each looked up by the layer's
kind in models/mixers.py, with their norms and residuals; one path for every kind.

    x = x + post_attn_norm(mixer(attn_norm(x)))    # the token mixer, over CP
    x = x + post_mlp_norm(mlp(mlp_norm(x)))        # the channel mixer, token-local

Shapes per rank: x (B, T/cp, d) in the CP layout's order; under model.hyper_connections
x is N streams (B, T/cp, N, d), each sublayer reads their collapse and its residual add is
the streams' mix (models/hyper_connections.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ctxpar.config.layer_mixers import channel_output_kept
from ctxpar.context_parallel import ContextParallel

from .hyper_connections import hyper_connection, mix_streams
from .mixers import channel_mixer_builder, token_mixer_kind
from .norms import make_norm
from .options import LayerArgs
from .per_layer_input import PerLayerGate
from .token_mixer import TokenMixer


class Together:
    """Re-enterable contexts entered as one (a checkpoint's recompute context)."""

    def __init__(self, contexts):
        self.contexts = contexts

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class Block(nn.Module):
    """One layer, its two mixers chosen once from its type (config.layer_mixers.LAYER_MIXERS,
    models/mixers.py): x + mixer(norm(x)), then x + mlp(norm(x)); with model.post_norms
    x + norm(mixer(norm(x))), then x + norm(mlp(norm(x))) (Gemma 2/3); in a layer type of
    model.reordered_norms x + norm(mixer(x)), then x + norm(mlp(x)) (OLMo 2). The token
    mixer stands under its kind's name, Hugging Face's (``attn``, ``linear_attn``,
    ``mamba``), after ``attn_norm``; the channel mixer (an MLP or a mixture of experts) is
    ``mlp``. Nemotron-H's single-op blocks have no MLP ('mamba', 'attention') or no token
    mixer ('mlp').

    ``selective`` (a mixer with selective_recompute: attention) checkpoints the two pieces
    around the mixer's core (norm + project_in; project_out + residual + norm + MLP) and
    keeps what the core saves (q, k, v, the attention output and its LSE, saved by the CP
    attention itself), so backward recomputes projections but never replays the CP
    communication; other blocks keep their activations under it.

    ``recompute_context`` is the context_fn of every checkpoint whose recompute covers the
    channel mixer (the whole block's in models/gpt.py and gpt_pipe.py, selective's here).
    """

    def __init__(self, args: LayerArgs):
        super().__init__()
        cfg, token, channel = args.cfg, token_mixer_kind(args.layer), channel_mixer_builder(args)
        norm = dict(cfg=cfg, device=args.device, dtype=args.dtype)
        # model.reordered_norms (OLMo 2): the mixers' outputs normed, not their inputs
        reordered = args.layer.kind in (cfg.reordered_norms or ())
        post = cfg.post_norms or reordered
        self.mixer_name = token.attribute if token else None  # the submodule it stands under
        self.attn_norm = make_norm(**norm) if token and not reordered else None
        if token:
            setattr(self, token.attribute, token.build(args))
        self.post_attn_norm = make_norm(**norm) if post and token else None
        self.mlp_norm = make_norm(**norm) if channel and not reordered else None
        self.mlp = channel(args) if channel else None
        # a channel mixer that reads the block's x beside its normed x (Gemma 4's experts
        # beside the MLP, models/moe_beside_mlp.py)
        self.mlp_sees_residual = getattr(self.mlp, "sees_residual", False)
        self.post_mlp_norm = make_norm(**norm) if post and channel else None
        self.mlp_output_kept = channel_output_kept(cfg, args.layer.kind)
        self.selective = args.selective and bool(token) and self.mixer.selective_recompute
        # Gemma 4: the per-layer input's gate (models/per_layer_input.py), then the block's
        # output times its layer scalar (a buffer: read from the folder, not trained)
        self.per_layer_input = PerLayerGate(cfg, args.device, args.dtype) \
            if cfg.per_layer_input_dim else None
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1, device=args.device,
                                                            dtype=args.dtype))
        else:
            self.layer_scalar = None
        # model.hyper_connections (mHC): each sublayer's collapse, expand and mix maps
        self.attn_hc = hyper_connection(cfg, bool(token), args.device, args.dtype)
        self.mlp_hc = hyper_connection(cfg, bool(channel), args.device, args.dtype)

    @property
    def mixer(self) -> Optional[TokenMixer]:
        """The token mixer's module (attn, linear_attn, mamba); None in an MLP-only block."""
        return getattr(self, self.mixer_name) if self.mixer_name else None

    def recompute_context(self):
        """torch.utils.checkpoint's context_fn: the forward as it is; in the recompute, the
        channel mixer's ``output_unread_context`` (a tiled MoE skips its experts there:
        models/moe.py) when nothing after the mixer keeps its output for backward
        (config.layer_mixers.channel_output_kept), and a hash-routed MoE's
        ``token_ids_context`` (the forward's token ids). Decided by the config alone, so
        every rank of a group decides alike."""
        unread = getattr(self.mlp, "output_unread_context", None)
        ids = getattr(self.mlp, "token_ids_context", None)
        contexts = [c for c in (None if unread is None or self.mlp_output_kept else unread(),
                                None if ids is None else ids()) if c is not None]
        return nullcontext(), (Together(contexts) if contexts else nullcontext())

    def use_cp(self, cp: ContextParallel) -> None:
        """Run the token mixer over another CP group (GPT.use_cp_group)."""
        if self.mixer is not None:
            self.mixer.cp = cp

    def _in_norm(self, norm, x):
        return x if norm is None else norm(x)  # None: model.reordered_norms' block

    @staticmethod
    def _collapse(hc, x):
        """The sublayer's input (B, T/cp, d) and its mHC (post, comb), or x and None."""
        return (x, None) if hc is None else hc(x)

    def _mixer_in(self, x, cos, sin):
        h, mix = self._collapse(self.attn_hc, x)
        return (*self.mixer.project_in(self._in_norm(self.attn_norm, h), cos, sin), mix)

    def _mixer_out_mlp(self, x, o, mix, *carry):
        a = self.mixer.project_out(o, *carry)  # (B, T/cp, d)
        a = a if self.post_attn_norm is None else self.post_attn_norm(a)
        return self._mlp(mix_streams(x, a, mix))

    def _mlp(self, x):
        if self.mlp is None:
            return x
        h, mix = self._collapse(self.mlp_hc, x)
        normed = self._in_norm(self.mlp_norm, h)
        h = self.mlp(normed, h) if self.mlp_sees_residual else self.mlp(normed)
        return mix_streams(x, h if self.post_mlp_norm is None else self.post_mlp_norm(h), mix)

    def _finish(self, x: torch.Tensor, per_layer_input) -> torch.Tensor:
        if self.per_layer_input is not None:
            x = self.per_layer_input(x, per_layer_input)
        return x if self.layer_scalar is None else x * self.layer_scalar

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache=None, cu_seqlens=None, per_layer_input=None) -> torch.Tensor:
        """kv_cache: this layer's view of generation's cache (ctxpar.inference), inference
        only: attention's keeps k, v and computes attention from the cache, given the
        training core to use; a linear layer's is its LinearLayerCache, state and conv
        window. cu_seqlens: document boundaries (context_parallel/documents.py), training
        only. per_layer_input: this layer's (B, T/cp, p) of model.per_layer_input_dim."""
        return self._finish(self._mixers(x, cos, sin, kv_cache, cu_seqlens), per_layer_input)

    def _mixers(self, x, cos, sin, kv_cache, cu_seqlens) -> torch.Tensor:
        if self.mixer is None:
            return self._mlp(x)
        if self.selective and kv_cache is None:  # recompute around the core; it keeps its own
            inputs, carry, mix = checkpoint(self._mixer_in, x, cos, sin, use_reentrant=False)
            o = self.mixer.mix(inputs, cu_seqlens)
            return checkpoint(self._mixer_out_mlp, x, o, mix, *carry, use_reentrant=False,
                              context_fn=self.recompute_context)
        inputs, carry, mix = self._mixer_in(x, cos, sin)
        return self._mixer_out_mlp(x, self.mixer.mix(inputs, cu_seqlens, kv_cache), mix,
                                   *carry)
