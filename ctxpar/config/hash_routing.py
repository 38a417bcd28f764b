"""model.moe.hash_layers: MoE layers routed by a frozen token-id table (DeepSeek-V4's
hash-routed layers, transformers' DeepseekV4HashRouter; models/moe.py, Router.tid2eid).

Each token's k experts are tid2eid[token id], a (vocab_size, top_k) int64 buffer (drawn
from the run's seed at init: k distinct experts per id; loaded and saved with the model);
the router still scores every expert, and the chosen experts' scores, normalised and
scaled as model.moe says, weigh them. As transformers' model, these layers add nothing to
the balance losses or statistics and have no correction bias. A layer needs each token's
id: the GPT hands every MoE layer the rank's ids (in the CP layout, as its hidden states);
under parallel.pp the pipe tuple carries them to the stages (models/pipe_carry.py).
"""
from __future__ import annotations


def check_hash_layers(cfg, err) -> None:
    """model.moe.hash_layers against the model and the run, one line per rule."""
    m, moe = cfg.model, cfg.model.moe
    hashed = None if moe is None else moe.hash_layers
    if not hashed:
        return
    from .moe import moe_layer_indices
    sparse = moe_layer_indices(moe, m.n_layers)
    if len(set(hashed)) != len(hashed) or not set(hashed) <= set(sparse):
        err(f"model.moe.hash_layers={hashed} must be distinct MoE layers (model.moe.layers: "
            f"{sparse})")
    elif set(hashed) == set(sparse):
        err(f"model.moe.hash_layers={hashed} covers every MoE layer: keep one routed by "
            f"the router (the balance losses and statistics are its)")
    for key, value, refused, why in (
            ("data.dynamic_cp", cfg.data.dynamic_cp, cfg.data.dynamic_cp, "not built with packs"),
            ("model.moe.capacity_factor", moe.capacity_factor,
             moe.capacity_factor is not None, "not built (transformers' layer drops none)"),
            ("model.mtp", m.mtp, m.mtp is not None, "not built"),
            ("model.moe.scaled_router", moe.scaled_router, moe.scaled_router, "not built"),
            ("model.moe.beside_mlp", moe.beside_mlp, moe.beside_mlp, "not built")):
        if refused:
            err(f"model.moe.hash_layers with {key}={value!r}: {why}")
