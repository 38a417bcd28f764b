"""model.mtp's depths on the last stage (models/mtp.py): what one micro-batch's forward
saves for backward there, beside the head's (counts.activations).

Per depth k, on a rank's N = B T/cp tokens (counts.RankShapes; e the activations' size):

    enorm(emb(t_{i+k}))      the norm's input, normed and rstd (its output goes into the
                             concatenation, which saves nothing)
    hnorm(h^{k-1})           normed and rstd (its input, the final norm's or the previous
                             depth's output, is counted there)
    eh_proj([.; .])          its input (N, 2d)
    Block_k                  as a main block of the MTP layer type and MLP (MLA, experts:
                             counts.block_activations) in mode 'none', or 'selective' under
                             selective: 'full' and 'every_n_layers' do not recompute it
    norm(Block_k(u))         as the final norm (its output the head's input)
    RoPE at i+k              cos, sin (fp32, rope/2 each per position; per sample with
                             reset_positions)
    head + loss              as the LM's (fp32 softmax and the masks, or the tiled loss's
                             dx and fp32 dW)

and once for every depth the ids and targets D ahead ((B, D, T/cp) int64 each, one
embedding lookup and one labels tensor; the tiled loss keeps no labels) and the depths'
loss weights (D fp32). Under model.norm_offset each of the three norms also keeps its fp32
(offset + w). Exact against autograd's saved tensors at one process wherever the block's
count is (tests/test_mtp_moe.py: dense and DeepSeek-V3's MLA + MoE blocks, every
checkpointing mode; the tiled loss's dx and dW are held by its Function, not saved
through autograd, and counted as the head's are).
"""
from __future__ import annotations

from ..config import ModelConfig
from . import counts, mla_layers
from .candidate import Candidate
from .moe_layers import block_model


def mtp_activations(m: ModelConfig, cand: Candidate, e: int, tiled_loss: bool = False,
                    tiled_mlp: bool = False, device: str = "cpu",
                    reset_positions: bool = False) -> int:
    """Saved bytes of model.mtp's depths for one micro-batch on a last-stage rank (the
    module docstring); 0 without model.mtp."""
    if m.mtp is None:
        return 0
    s, mtp = counts.rank_shapes(m, cand), m.mtp
    N, d, T = s.N, s.d, s.N // s.B
    mode = "selective" if cand.activation == "selective" else "none"
    block = counts.block_activations(s, e, cand, mode, mtp.layer_type,
                                     block_model(m, mtp.moe), tiled_mlp, device)
    norm = counts.norm_saved(s, e, m.norm, device)
    rope = mla_layers.rope_width(m) if m.mla is not None else s.hd
    if tiled_loss:  # dx (N, d) and the fp32 dW (V/tp, d), made in forward (tiled_loss.py)
        loss = N * d * e + 4 * s.V * d
    else:  # the fp32 softmax and the ignore masks (split over TP: the vocab range's too)
        loss = 4 * N * s.V + (3 if s.tp > 1 else 2) * N
    per_depth = ((norm - N * d * e) + (norm - 2 * N * d * e) + 2 * N * d * e + block + norm
                 + (s.B if reset_positions else 1) * T * rope * 4 + loss
                 + (3 * 4 * d if m.norm_offset else 0))
    ids = (1 if tiled_loss else 2) * 8 * N * mtp.depth  # the tiled loss keeps no labels
    return mtp.depth * per_depth + ids + 4 * mtp.depth
