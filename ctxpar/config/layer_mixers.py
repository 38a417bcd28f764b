"""Which mixers each layer type has (LAYER_MIXERS) and each layer's type (layer_types):
the table the config's sections (model.moe's blocks), the layers (layers.py), the
parameters and the planner all read, standing below them all (it imports nothing of the
config: `m` is a ModelConfig, read by its fields). layers.py says what each type means.
"""
from __future__ import annotations

from typing import List

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LAYER_MIXERS = {  # layer type -> (token mixer, channel mixer); None: the block has none
    "full_attention": ("attention", "mlp"),
    "sliding_attention": ("attention", "mlp"),
    "chunked_attention": ("attention", "mlp"),
    "linear_attention": ("gated_delta", "mlp"),
    "kimi_delta_attention": ("kda", "mlp"),
    "mamba": ("mamba2", None),
    "attention": ("attention", None),
    "mlp": (None, "mlp"),
    # DeepSeek-V4's compressed layers: their attention is model.compressed_attention's
    "compressed_sparse_attention": ("attention", "mlp"),
    "heavily_compressed_attention": ("attention", "mlp"),
}
LAYER_TYPES = tuple(LAYER_MIXERS)
COMPRESSED_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
WINDOWED_TYPES = ("sliding_attention", *COMPRESSED_TYPES)  # model.sliding_window's layers
# What an attention layer runs: its type's 'attention', or a model-wide kind in its place
# (model.mla: multi-head latent attention; model.dsa: MLA over the indexer's top-k;
# model.compressed_attention: DeepSeek-V4's; token_mixer_of)
ATTENTION_MIXERS = ("attention", "mla", "dsa", "compressed")
LATENT_MIXERS = ("mla", "dsa")  # the ones whose keys and values come from MLA's latent
LINEAR_MIXERS = ("gated_delta", "kda", "mamba2")  # the token mixers passing a state over CP


def token_mixer_of(m, kind: str):
    """The token mixer of a layer of this type in model m: LAYER_MIXERS', multi-head latent
    attention in attention's place under model.mla, DeepSeek sparse attention under
    model.dsa as well."""
    token = LAYER_MIXERS[kind][0]
    return attention_mixer(m) if token == "attention" else token


def attention_mixer(m) -> str:
    """What m's attention layers run: 'compressed' (model.compressed_attention), 'dsa'
    (model.dsa), 'mla' (model.mla), 'attention'."""
    if getattr(m, "compressed_attention", None) is not None:
        return "compressed"
    if getattr(m, "mla", None) is None:
        return "attention"
    return "dsa" if getattr(m, "dsa", None) is not None else "mla"


def token_mixers(m) -> set:
    """The token mixers the model's layers use."""
    return {token_mixer_of(m, t) for t in layer_types(m) if t in LAYER_MIXERS}


def has_linear_layers(m) -> bool:
    """Whether a layer is 'linear_attention', 'kimi_delta_attention' or 'mamba'
    (state-passing mixers)."""
    return bool(token_mixers(m) & set(LINEAR_MIXERS))


def layer_types(m) -> List[str]:
    """One of LAYER_TYPES per layer (model.layer_types, or the one kind the model's
    window or chunk fields imply)."""
    if m.layer_types is not None:
        return list(m.layer_types)
    return [uniform_layer_type(m)] * m.n_layers


def uniform_layer_type(m) -> str:
    """Every layer's type when model.layer_types is unset: the one its window or chunk
    fields imply."""
    return ("sliding_attention" if m.sliding_window is not None else
            "chunked_attention" if m.attention_chunk_size is not None else "full_attention")


def first_layer_type(m) -> str:
    """layer_types(m)[0] without building the list (the planner asks per candidate)."""
    return m.layer_types[0] if m.layer_types is not None else uniform_layer_type(m)


def channel_output_kept(m, kind: str) -> bool:
    """Whether a block of layer type ``kind`` keeps its channel mixer's output for backward
    after the mixer (models/block.py): a post-MLP norm saves its input (model.post_norms,
    or the type in model.reordered_norms), so do Gemma 4's per-layer input gate and layer
    scalar. Where none does, a recompute of the block needs nothing of that output: a
    tiled MoE skips its experts there (models/moe.py SkipTiles; the planner's time)."""
    return bool(m.post_norms or kind in (m.reordered_norms or ()) or m.per_layer_input_dim
                or m.layer_scalar)
