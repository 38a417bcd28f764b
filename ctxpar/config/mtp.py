"""model.mtp: multi-token prediction layers (DeepSeek-V3 §2.2; Qwen3.5, Qwen3-Next, GLM-4.5).

    model:
      mtp:
        depth: 1                  # D: MTP layers, depth k predicts token i+k+1 at position i
        loss_weight: 0.1          # lambda: the loss adds lambda/D * sum_k CE_k
        layer_type: full_attention  # the MTP block's kind (a model.layer_types name)
        moe: false                # DeepSeek-V3, GLM-4.5, Qwen3-Next: its MLP is model.moe's experts
        shared_projection: true   # Qwen3.5 / Qwen3-Next: one fc and its norms for every depth

Depth k at position i: u = eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)]), h^k =
norm(Block(u)) with the Block's RoPE at position i+k (transformers' MtpModel shifts the
positions with the ids), the shared head on h^k predicts t_{i+k+1}; h^0 is the main
model's final-normed hidden state. Each CE_k is a token mean over the global batch as the
LM loss is (models/loss.py), over the positions whose t_{i+k+1} exists in the sample and
lies in position i's document (ctxpar/data/mtp.py). Under the pipeline the depths sit on
the last stage (models/mtp_pipe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .layer_mixers import LAYER_MIXERS


@dataclass
class MTPConfig:
    depth: int = 1
    """D: MTP layers, chained; depth k (1..D) predicts the token k+1 after each position
    (transformers' num_mtp_layers, Qwen's mtp_num_hidden_layers)."""
    loss_weight: float = 0.1
    """lambda: the training loss is the LM loss + lambda / D * sum_k CE_k (DeepSeek-V3:
    0.3, then 0.1)."""
    layer_type: str = "full_attention"
    """The MTP block's token mixer: one of MTP_LAYER_TYPES (Qwen3.5, Qwen3-Next, GLM-4.5:
    full attention; under model.mla, DeepSeek-V3's, MLA as the main layers')."""
    moe: bool = False
    """The MTP block's channel mixer is a mixture of experts of model.moe's shape
    (DeepSeek-V3, GLM-4.5, Qwen3-Next: transformers' get_mtp_config makes every MTP layer a
    MoE one), one more MoE layer of the model: its router's losses and balance update are
    taken with the main layers' (models/gpt.py), its experts split over parallel.ep as
    theirs (under the pipeline on the last stage, where parallel.ep > 1 is refused);
    false: the dense MLP (model.mlp, model.ffn_hidden; Qwen3.5)."""
    shared_projection: bool = False
    """One projection (fc) and one pair of input norms and output norm for every depth
    (Qwen3.5, Qwen3-Next: mtp.fc, mtp.pre_fc_norm_*, mtp.norm); false: each depth its own
    (DeepSeek-V3, GLM-4.5: enorm, hnorm, eh_proj, shared_head.norm)."""
    hidden_first: bool = False
    """The projection's input is [hnorm(h); enorm(e)] (transformers' mtp_hidden_states_first);
    false: [enorm(e); hnorm(h)], as DeepSeek-V3 and Qwen write it."""


MTP_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_mtp(cfg, err) -> None:
    """model.mtp against the model and the run, each rule one ConfigError line (before any
    collective)."""
    mtp = cfg.model.mtp
    if mtp is None:
        return
    if not isinstance(mtp.depth, int) or mtp.depth < 1:
        err(f"model.mtp.depth={mtp.depth!r} must be an integer >= 1 (or model.mtp: null)")
    if not mtp.loss_weight >= 0:
        err(f"model.mtp.loss_weight={mtp.loss_weight!r} must be >= 0")
    if mtp.layer_type not in MTP_LAYER_TYPES:
        known = "a linear or single-op block" if mtp.layer_type in LAYER_MIXERS else "unknown"
        err(f"model.mtp.layer_type={mtp.layer_type!r} ({known}) must be one of "
            f"{list(MTP_LAYER_TYPES)}")
    if mtp.moe and cfg.model.moe is None:
        err("model.mtp.moe=true without model.moe: the MTP block's experts take model.moe's "
            "shape; set model.moe or model.mtp.moe=false")
    if cfg.parallel.pp > 1 and cfg.parallel.ep > 1:
        err(f"model.mtp with parallel.pp={cfg.parallel.pp} and parallel.ep={cfg.parallel.ep}: "
            f"the MTP layers on the last stage beside experts split over EP are not built "
            f"yet; use parallel.ep=1 or parallel.pp=1")
    if cfg.data.dynamic_cp:
        err("model.mtp with data.dynamic_cp=true: the packs carry no shifted MTP inputs yet; "
            "use data.dynamic_cp=false")
