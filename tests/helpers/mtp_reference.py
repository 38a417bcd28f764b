"""model.mtp's single-process references, shared by tests/test_mtp.py and
tests/test_mtp_moe.py: a batch with documents, the shifted ids and targets written position
by position, the LM + MTP loss from DeepSeek-V3 §2.2 on a GPT's own modules, and the GPT's
own single-process step (the data pipeline's shifted inputs, the step's loss weights).
"""
import torch
import torch.nn.functional as F

from ctxpar.config import ModelConfig
from ctxpar.config.mla import MLAConfig
from ctxpar.config.moe import MoEConfig
from ctxpar.config.mtp import MTPConfig
from models.gpt import GPT
from models.options import ModelOptions
from models.rope import rotary_cos_sin

T, BATCH, SEED = 32, 2, 11
# DeepSeek-V3's shape at the tests' size: MLA (q through a rank-16 bottleneck, a latent of
# 16 + a shared RoPE key of 8, value heads of 12), a dense first layer then 8 experts
# routed on sigmoid scores + the correction bias in 2 groups (1 taken), top 2 times 2.5,
# a shared expert; the MTP blocks MLA + those experts (model.mtp.moe), two depths; the
# load-balancing and sequence-level losses on, so the MTP routers' share is in the loss.
MOE_MTP = ModelConfig(
    vocab_size=64, seq_len=T, n_layers=2, d_model=32, n_heads=4, n_kv_heads=4,
    tie_embeddings=False, ffn_hidden=48,
    mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=12),
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=16, layers=[1], score="sigmoid",
                  score_correction_bias=True, bias_update_rate=0.01, n_group=2, topk_group=1,
                  routed_scaling_factor=2.5, shared_expert_hidden=16, aux_loss_coef=0.02,
                  seq_aux_loss_coef=0.01),
    mtp=MTPConfig(depth=2, loss_weight=0.3, moe=True))
# Document ends (exclusive) per sample: 8 and 16 end a rank's share at cp4 contiguous
# (its last position 7, 15) and zigzag cp2's first chunk (positions 0..7); 7 and 15 end
# one token before.
DOCS = [torch.tensor([0, 7, 8, 15, 16, 32], dtype=torch.int32),
        torch.tensor([0, 8, 23, 24, 32], dtype=torch.int32)]


def make_batch(cfg):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, T), generator=g)
    labels = torch.cat([tokens[:, 1:], torch.randint(0, cfg.vocab_size, (BATCH, 1),
                                                     generator=g)], 1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return tokens, labels


def shifted_by_hand(tokens, labels, k, docs):
    """Depth k's ids t_{i+k} and targets t_{i+k+1}, position by position."""
    ids, tgt = torch.zeros_like(tokens), torch.full_like(labels, -100)
    for b in range(tokens.shape[0]):
        cu = docs[b].tolist() if docs is not None else [0, T]
        for i in range(T):
            end = next(e for e in cu[1:] if e > i)
            if i + k < T:
                ids[b, i] = tokens[b, i + k]
                if docs is None or i + k + 1 < end:
                    tgt[b, i] = labels[b, i + k]
    return ids, tgt


def reference(cfg, tokens, labels, docs):
    """One process, from the definition: LM mean + lambda/D sum_k mean_k CE(t_{i+k+1});
    under model.moe plus the routers' losses with each MTP block's router as one more MoE
    layer's (its rows in the same statistics, after the blocks'). Returns (loss,
    {name: gradient}, the routers' assignments per MoE layer (L_moe, E) or None)."""
    from ctxpar.config import rotary_dim
    from ctxpar.moe import RouterStats
    from models.moe import MoE

    model = GPT(cfg, options=ModelOptions(seed=SEED))
    moe, stats = cfg.moe, None
    if moe is not None:  # modules() in order: the blocks' MoE layers, then the MTP blocks'
        stats = RouterStats(moe.num_experts, moe.score, moe.seq_aux_loss_coef > 0)
        for mlp in (m for m in model.modules() if isinstance(m, MoE)):
            mlp.stats = stats
    pos = torch.arange(T)
    h = model.hidden_states(tokens, pos, cu_seqlens=docs)  # final-normed h^0
    loss = F.cross_entropy(model.lm_logits(h).flatten(0, 1), labels.flatten())
    mtp_losses = []
    for k in range(1, cfg.mtp.depth + 1):
        ids, tgt = shifted_by_hand(tokens, labels, k, docs)
        own = model.mtp.layers[0 if cfg.mtp.shared_projection else k - 1]
        u = own.eh_proj(torch.cat([own.enorm(model.embed(ids)), own.hnorm(h)], -1))
        cos, sin = rotary_cos_sin(pos + k, rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling)
        h = own.norm(model.mtp.layers[k - 1].block(u, cos, sin, cu_seqlens=docs))
        mtp_losses.append(F.cross_entropy(model.lm_logits(h).flatten(0, 1), tgt.flatten()))
    total = loss + cfg.mtp.loss_weight / cfg.mtp.depth * sum(mtp_losses)
    counts = None
    if stats is not None:
        router = stats.losses(moe.aux_loss_coef, moe.z_loss_coef, None, moe.seq_aux_loss_coef)
        total, counts = total + router.share, router.layer_counts
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts


def single_process(cfg, tokens, labels, docs, tiled=False):
    """The GPT at one process: (the step's loss, {name: gradient}, the model). Under
    model.moe the loss and gradients take the routers' share (models/moe_steps.py)."""
    from ctxpar.config import MemoryConfig
    from ctxpar.data.loader import shard_batch
    from models.loss import loss_for_backward
    from models.step_kinds import attach_mtp_weights, count_step_tokens

    class One:  # a one-rank ParallelState's share count_step_tokens reads
        dp_cp_group = None
    model = GPT(cfg, options=ModelOptions(seed=SEED, memory=MemoryConfig(tiled_loss=tiled,
                                                                          loss_tile_tokens=8)))
    mb = shard_batch({"tokens": tokens, "labels": labels, "cu_seqlens": docs}, None,
                     "contiguous", mtp_depth=cfg.mtp.depth)
    n = attach_mtp_weights([mb], count_step_tokens([mb], One), cfg.mtp)
    local = model(mb["tokens"], mb["positions"], mb["labels"], cu_seqlens=docs,
                  mtp_tokens=mb["mtp_tokens"], mtp_labels=mb["mtp_labels"],
                  mtp_weights=mb["mtp_weights"])
    router = model.router_losses.share if model.router_losses is not None else 0.0
    (loss_for_backward(local, n, 1) + router).backward()
    return (local / n + router).detach(), \
        {n_: p.grad for n_, p in model.named_parameters()}, model
