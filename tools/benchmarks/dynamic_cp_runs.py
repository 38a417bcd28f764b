"""What dynamic CP's benchmarks share: their models, length mixes, configs and one pack's
training step (bench_dynamic_cp, bench_dynamic_cp_train, bench_dynamic_cp_packs)."""
from __future__ import annotations

import argparse

import numpy as np

# the hybrid: Gated DeltaNet, Mamba2, attention, Gated DeltaNet (state passing over CP):
# three linear mixers to one attention layer, the ratio of Qwen3.5's and Kimi Linear's
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


def add_mix_options(ap) -> None:
    """The length mixes' options (mix_lengths), shared by the benchmarks that draw them."""
    ap.add_argument("--median-len", type=float, default=600, help="lognormal: median")
    ap.add_argument("--sigma", type=float, default=1.3, help="lognormal: sigma")
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=12288)
    ap.add_argument("--short-share", type=float, default=0.8,
                    help="bimodal: the share of short documents")
    ap.add_argument("--short-len", type=int, nargs=2, default=[40, 420],
                    help="bimodal: the short documents' range (uniform)")
    ap.add_argument("--long-median", type=float, default=3000,
                    help="bimodal: the long documents' log-normal median (sigma 0.5)")
    ap.add_argument("--seed", type=int, default=0)


# what a mix spec may set (mix_spec): its name's options, and documents per step
SPEC_KEYS = {"median": "median_len", "sigma": "sigma", "min": "min_len", "max": "max_len",
             "short": "short_share", "long": "long_median", "docs": "docs"}


def mix_spec(spec: str, a):
    """'NAME' or 'NAME:key=value,...' (keys SPEC_KEYS, e.g. 'lognormal:median=150,docs=128'):
    the mix's name and a copy of the options a with those set (SystemExit when bad)."""
    name, _, sets = spec.partition(":")
    if name not in ("lognormal", "bimodal"):
        raise SystemExit(f"mix {spec!r}: the name must be lognormal or bimodal")
    out = argparse.Namespace(**vars(a))
    for item in filter(None, sets.split(",")):
        key, _, value = item.partition("=")
        if key not in SPEC_KEYS or not value:
            raise SystemExit(f"mix {spec!r}: {item!r} is not key=value with a key of "
                             f"{sorted(SPEC_KEYS)}")
        dest = SPEC_KEYS[key]
        setattr(out, dest, type(getattr(a, dest))(float(value)))
    return name, out


def mix_lengths(mix: str, count: int, a) -> np.ndarray:
    """`count` document lengths (tokens) of a mix, seeded by a.seed and clipped to
    [a.min_len, a.max_len]: 'lognormal' (median a.median_len, sigma a.sigma) or 'bimodal'
    (a share a.short_share uniform in a.short_len, the rest log-normal of median
    a.long_median and sigma 0.5)."""
    rng = np.random.default_rng([a.seed, ["lognormal", "bimodal"].index(mix)])
    if mix == "lognormal":
        n = rng.lognormal(np.log(a.median_len), a.sigma, count)
    else:
        low, high = a.short_len
        short = rng.random(count) < a.short_share
        n = np.where(short, rng.integers(low, high + 1, count),
                     rng.lognormal(np.log(a.long_median), 0.5, count))
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
