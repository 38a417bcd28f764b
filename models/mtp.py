"""Multi-token prediction layers (model.mtp): D chained depths after the main model, each
predicting one token further ahead with the shared embedding and head (DeepSeek-V3 §2.2;
transformers' MtpLayer / MtpModel; Qwen3.5's and Qwen3-Next's mtp.*).

    h0 = final_norm(blocks(emb(t)))                                  # (B, T/cp, d)
    for k in 1..D:                                                   # positions i of this rank
        u  = eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])        # (B, T/cp, d)
        h^k = norm(Block_k(u))        Block_k's RoPE at position i+k, CP attention, documents
        CE_k over head(h^k) against t_{i+k+1}

Everything but Block_k's token mixer is token-local, so a CP rank needs only, for its own
positions, the ids t_{i+k} and the targets t_{i+k+1}: the data pipeline cuts them from the
whole sequence it holds (ctxpar/data/mtp.py), masked where i+k+1 leaves the sample or
position i's document; masked positions sit at the end of a document (or of the sample),
so under causal attention no counted position attends to one. Block_k runs the model's CP
pattern and layout exactly as a main block does.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from ctxpar.config import ModelConfig
from ctxpar.config.layers import mtp_layer_attention

from .block import Block
from .norms import make_norm
from .options import LayerArgs
from .rope import layer_rotary


class MTPLayer(nn.Module):
    """Depth k: its input norms and projection, its Block, its output norm; under
    model.mtp.shared_projection depths k > 0 borrow depth 0's (own=False)."""

    def __init__(self, args: LayerArgs, own: bool):
        super().__init__()
        cfg, kw = args.cfg, dict(device=args.device, dtype=args.dtype)
        norm = dict(cfg=cfg, **kw)
        self.enorm = make_norm(**norm) if own else None
        self.hnorm = make_norm(**norm) if own else None
        # replicated over TP: its input (the norms of h and of the embedding) is whole on
        # every TP rank, and so is its gradient (the Block's f ops all-reduce it)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False, **kw) if own else None
        self.block = Block(args)
        self.norm = make_norm(**norm) if own else None


class MTP(nn.Module):
    """The D depths of model.mtp under ``mtp.layers.{k}``."""

    def __init__(self, cfg: ModelConfig, args: LayerArgs):
        super().__init__()
        self.cfg, self.mtp = cfg, cfg.mtp
        self.layer_attention = mtp_layer_attention(cfg)
        self.layers = nn.ModuleList(
            MTPLayer(args, own=k == 0 or not cfg.mtp.shared_projection)
            for k in range(cfg.mtp.depth))

    def _own(self, k: int) -> MTPLayer:
        """The layer holding depth k's norms and projection."""
        return self.layers[0 if self.mtp.shared_projection else k]

    def depth_hidden(self, k: int, h: torch.Tensor, e: torch.Tensor, positions: torch.Tensor,
                     rotary_dim: int, cu_seqlens=None) -> torch.Tensor:
        """Depth k+1 (0-based k): h^k (B, T/cp, d) from h^{k-1} and the embedding of
        t_{i+k+1}, e (B, T/cp, d)."""
        own = self._own(k)
        parts = [own.enorm(e), own.hnorm(h)]
        u = own.eh_proj(torch.cat(parts[::-1] if self.mtp.hidden_first else parts, dim=-1))
        # RoPE at the position of the embedded token, i+k+1 (transformers' MtpModel)
        cos, sin = layer_rotary(positions + (k + 1), rotary_dim, [self.layer_attention])[0]
        return own.norm(self.layers[k].block(u, cos, sin, cu_seqlens=cu_seqlens))

    def hidden_states(self, h: torch.Tensor, embeds: List[torch.Tensor],
                      positions: torch.Tensor, rotary_dim: int,
                      cu_seqlens=None) -> List[torch.Tensor]:
        """Every depth's h^k (B, T/cp, d), chained from h^0 = h; embeds[k] the embedding of
        the ids D steps ahead, (B, T/cp, d)."""
        out: List[torch.Tensor] = []
        for k in range(self.mtp.depth):
            h = self.depth_hidden(k, h, embeds[k], positions, rotary_dim, cu_seqlens)
            out.append(h)
        return out

    def loss_sums(self, h: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                  rotary_dim: int, cu_seqlens, mtp_labels: torch.Tensor,
                  head_sum) -> torch.Tensor:
        """(D,) fp32: each depth's sum of token losses S_k against mtp_labels[:, k]
        (B, D, T/cp), from h^0 = h and the embeddings of the ids ahead, embeds
        (B, D, T/cp, d); head_sum(h^k, targets) is the head and its loss (the model's:
        GPT.loss_sum, or the pipeline's last stage, models/mtp_pipe.py)."""
        hidden = self.hidden_states(h, embeds.unbind(1), positions, rotary_dim, cu_seqlens)
        return torch.stack([head_sum(hk, mtp_labels[:, k]) for k, hk in enumerate(hidden)])


def mtp_loss_weights(depth: int, loss_weight: float, n_tokens: torch.Tensor,
                     mtp_tokens: torch.Tensor) -> torch.Tensor:
    """(D,) fp32: what each depth's loss sum is multiplied by so that dividing the whole
    sum by the LM's token count N gives LM + lambda/D * sum_k S_k / N_k (models/loss.py):
    lambda/D * N / N_k. n_tokens: N, mtp_tokens (D,): the N_k, over the step's global
    batch (the same on every rank)."""
    return (loss_weight / depth) * n_tokens.float() / mtp_tokens.float().clamp(min=1.0)
