"""model.dsa: DeepSeek sparse attention (DSA; DeepSeek-V3.2, GLM-5) in every attention layer,
on top of model.mla.

    model:
      mla: {...}                  # DSA's attention is MLA over the selected tokens
      dsa:
        index_n_heads: 64         # the lightning indexer's heads (GLM-5: 32)
        index_head_dim: 128       # each indexer head's width, and the one indexer key's
        index_topk: 2048          # keys each query attends to (the indexer's top-k)
        rope_interleave: false    # the indexer's RoPE: half-split (V3.2); true: GLM-5's pairs
        indexer_types: null       # per layer 'full' or 'shared' (GLM-5); null: every 'full'
        stage: frozen             # frozen | dense_warmup | sparse: what trains the indexer
        loss_weight: 1.0          # the indexer's KL loss in the training loss

The lightning indexer scores every earlier token t for each query s,
score[s, t] = sum_h w[s, h] ReLU(q_h(s) . k(t)) / sqrt(index_head_dim), with
q = wq_b(q_a_layernorm(q_a_proj(x))) (MLA's query latent), k = k_norm(wk(x)) one key per
token shared by the heads, w = weights_proj(x) / sqrt(index_n_heads); RoPE turns the
first mla.qk_rope_head_dim channels of q and k. Each query keeps its index_topk best
tokens and MLA attends to those only (transformers' DeepseekV32Indexer /
DeepseekV32Attention). A 'shared' layer (GLM-5's cross-layer top-k sharing) has no
indexer and uses the previous layer's selection.

The stages (DeepSeek-V3.2 report, §2.1): 'frozen' computes the indices without gradient
and adds no loss (transformers' forward); 'dense_warmup' attends densely and trains the
indexer by KL(main attention || indexer) over every earlier token; 'sparse' attends over
the selected tokens and trains the indexer by the KL over the selected set, its input
detached. The loss is a token mean over the global batch as the LM loss is
(models/loss.py), times loss_weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from ..context_parallel.sparse_latent import DSA_COMMS, DSA_STAGES
INDEXER_TYPES = ("full", "shared")


@dataclass
class DSAConfig:
    index_n_heads: int = 64
    """The lightning indexer's heads (wq_b's rows / index_head_dim; weights_proj's
    outputs); split over parallel.tp as MLA's heads are."""
    index_head_dim: int = 128
    """Each indexer head's width, and the width of the one indexer key per token (wk)."""
    index_topk: int = 2048
    """The keys each query attends to: the top index_topk indexer scores among the
    earlier tokens of its document (all of them when fewer)."""
    rope_interleave: bool = False
    """The indexer's RoPE on interleaved channel pairs (GLM-5's GlmMoeDsaIndexer); false:
    rotate-half on the first qk_rope_head_dim channels (DeepSeek-V3.2's)."""
    indexer_types: Optional[List[str]] = None
    """Per layer 'full' (its own indexer) or 'shared' (none: the previous layer's top-k,
    GLM-5's indexer_types); None: every layer 'full'."""
    stage: str = "frozen"
    """What trains the indexer: one of DSA_STAGES (the module docstring)."""
    loss_weight: float = 1.0
    """The indexer's KL loss's weight in the training loss (dense_warmup, sparse)."""

    def layer_has_indexer(self, i: int) -> bool:
        """Whether layer i runs its own indexer (else it reuses layer i-1's top-k)."""
        return self.indexer_types is None or self.indexer_types[i] == "full"


TRAINING_FIELDS = ("stage", "loss_weight")  # how a run trains the indexer, not the model


def dsa_architecture(dsa: Optional[DSAConfig]) -> Optional[DSAConfig]:
    """model.dsa with its training fields at their defaults: a folder (whose import says
    'frozen') and a run training its indexer describe one model."""
    return None if dsa is None else replace(dsa, stage="frozen", loss_weight=1.0)


def indexer_loss_travels(dsa: Optional[DSAConfig]) -> bool:
    """Whether the indexer's loss sums cross the pipeline's stages, taking a gradient
    (models/dsa_pipe.py): under every stage but 'frozen'."""
    return dsa is not None and dsa.stage != "frozen"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_dsa(cfg, err) -> None:
    """model.dsa against the model and the run, each rule one ConfigError line (run at
    load, before any collective)."""
    m, tp = cfg.model, cfg.parallel.tp
    dsa = m.dsa
    if dsa is None:
        return
    if m.mla is None:
        err("model.dsa without model.mla: DeepSeek sparse attention is MLA over the "
            "indexer's top-k (set model.mla)")
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        value = getattr(dsa, key)
        if not _positive_int(value):
            err(f"model.dsa.{key}={value!r} must be an integer >= 1")
    if dsa.index_n_heads % tp:
        err(f"model.dsa.index_n_heads={dsa.index_n_heads} must divide over parallel.tp={tp} "
            f"(the indexer's heads are split as MLA's)")
    if m.mla.q_lora_rank is None:
        err("model.dsa with model.mla.q_lora_rank=null: the indexer's queries come from "
            "MLA's query latent (set q_lora_rank)")
    if cfg.parallel.cp_comm not in DSA_COMMS:
        err(f"model.dsa with parallel.cp_comm={cfg.parallel.cp_comm!r}: DSA runs over "
            f"{list(DSA_COMMS)} (a query's top-k spans the whole sequence; splitting heads "
            f"buys nothing)")
    if dsa.stage != "frozen" and cfg.data.dynamic_cp:
        err(f"model.dsa.stage={dsa.stage!r} with data.dynamic_cp=true: the packs' steps do "
            f"not add the indexer's loss yet")
    rope = m.mla.qk_rope_head_dim
    if dsa.index_head_dim <= rope or dsa.index_head_dim % 2:
        err(f"model.dsa.index_head_dim={dsa.index_head_dim} must be even and above "
            f"model.mla.qk_rope_head_dim={rope} (RoPE turns that many of its channels)")
    if not isinstance(dsa.rope_interleave, bool):
        err(f"model.dsa.rope_interleave={dsa.rope_interleave!r} must be true or false")
    if dsa.stage not in DSA_STAGES:
        err(f"model.dsa.stage={dsa.stage!r} must be one of {list(DSA_STAGES)}")
    if not (isinstance(dsa.loss_weight, (int, float)) and dsa.loss_weight >= 0):
        err(f"model.dsa.loss_weight={dsa.loss_weight!r} must be a number >= 0")
    _check_indexer_types(m, err)
    if m.mtp is not None:
        err("model.dsa with model.mtp: the MTP block's sparse attention is not built yet "
            "(leave model.mtp null; folders' MTP layers are left out)")
    kinds = set(m.layer_types or ["full_attention"])
    if kinds != {"full_attention"} or m.sliding_window or m.attention_chunk_size:
        err(f"model.dsa with layer types {sorted(kinds)} (or a window or chunks): DSA is "
            f"built for full-attention layers only")


def _check_indexer_types(m, err) -> None:
    types = m.dsa.indexer_types
    if types is None:
        return
    if not isinstance(types, list) or len(types) != m.n_layers:
        err(f"model.dsa.indexer_types={types!r} must list one entry per layer "
            f"(model.n_layers={m.n_layers})")
    bad = sorted({t for t in types if t not in INDEXER_TYPES}, key=str)
    if bad:
        err(f"model.dsa.indexer_types has {bad}: each must be one of {list(INDEXER_TYPES)}")
    if types[0] != "full":
        err("model.dsa.indexer_types[0]='shared': the first layer has no earlier top-k to "
            "reuse")
