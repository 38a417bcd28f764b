"""What dynamic CP's benchmarks share: their models, length mixes, configs and one pack's
training step (bench_dynamic_cp, bench_dynamic_cp_train, bench_dynamic_cp_packs)."""
from __future__ import annotations

import numpy as np

# the hybrid: Gated DeltaNet, Mamba2, attention, Gated DeltaNet (state passing over CP)
HYBRID = ["model.n_layers=4",
          "model.layer_types=[linear_attention,mamba,full_attention,linear_attention]",
          "model.linear_num_key_heads=2", "model.linear_key_head_dim=16",
          "model.mamba_head_dim=16", "model.ssm_state_size=16", "model.n_groups=2",
          "model.linear_chunk_size=64"]
# a mixture of experts in every layer, with the router dynamic CP takes
# (ctxpar/config/moe.py refuses the sequence-level losses)
MOE = ["model.moe={num_experts: 8, top_k: 2, expert_hidden: 64, score: sigmoid, "
       "score_correction_bias: true, bias_update_rate: 0.01, z_loss_coef: 0.001, "
       "shared_expert_hidden: 32}"]


def mix_lengths(mix: str, count: int, a) -> np.ndarray:
    """`count` document lengths (tokens) of a mix, seeded by a.seed and clipped to
    [a.min_len, a.max_len]: 'lognormal' (median a.median_len, sigma a.sigma) or 'bimodal'
    (80% uniform in 40..420, 20% log-normal of median 3,000 and sigma 0.5)."""
    rng = np.random.default_rng([a.seed, ["lognormal", "bimodal"].index(mix)])
    if mix == "lognormal":
        n = rng.lognormal(np.log(a.median_len), a.sigma, count)
    else:
        short = rng.random(count) < 0.8
        n = np.where(short, rng.integers(40, 421, count), rng.lognormal(np.log(3000), 0.5, count))
    return np.clip(n, a.min_len, a.max_len).astype(int)


def document(step: int, i: int, n: int, vocab: int) -> np.ndarray:
    """Document i of a step: n inputs and their labels (n + 1 stored tokens)."""
    return np.random.default_rng([step, i]).integers(1, vocab, n + 1)


def train_pack(model, tile, layout, pack, step, lengths):
    """Forward and backward of one pack of a step's documents on its tile's groups."""
    from models.dynamic_cp import pack_inputs

    docs = [document(step, i, lengths[i], model.cfg.vocab_size) for i in pack.docs]
    local = pack_inputs(model, tile, docs, pack.length, layout)
    loss = model(local["tokens"], local["positions"], local["labels"],
                 cu_seqlens=local["cu_seqlens"])
    (loss / sum(lengths)).backward()


def run_config(a, world, *extra):
    """a.config with a.set and `extra` at cp = world (dp, tp, pp 1)."""
    from ctxpar.config import load_config
    return load_config(a.config, overrides=[f"parallel.cp={world}", "parallel.dp=1",
                                            "parallel.tp=1", "parallel.pp=1", *a.set, *extra],
                       world_size=world)
