"""DeepSeek-V3.2 (``deepseek_v32``, DeepseekV32ForCausalLM) and GLM-5 (``glm_moe_dsa``,
GlmMoeDsaForCausalLM): DeepSeek-V3's MLA and mixture of experts (families/deepseek.py)
with DeepSeek sparse attention's lightning indexer in every attention layer (model.dsa).

    config.json                            ctxpar model.*
    (deepseek.py's MLA and MoE keys)       mla.*, moe.* (the MLA's RoPE always interleaved:
                                           the classes have no rope_interleave)
    index_n_heads, index_head_dim,         dsa.index_n_heads, index_head_dim, index_topk
      index_topk
    (V3.2: half-split; GLM-5: pairs)       dsa.rope_interleave: the indexer's RoPE
    indexer_types (GLM-5; else from        dsa.indexer_types ('shared' layers reuse the
      index_topk_pattern or                previous layer's top-k; every 'full': null)
      index_topk_freq / _offset)
    layer_types                            every 'indexed_attention' (read, checked)
    mlp_layer_types                        first_k_dense_replace's dense then sparse (checked)

The import's model.dsa.stage is 'frozen': the indices computed without gradient and no
indexer loss, transformers' forward (a training run sets dense_warmup or sparse). The
indexer's tensors: ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`` as transformers
names them. The folders' MTP layers are left out as DeepSeek-V3's are.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...config.dsa import DSAConfig
from .base import ARCH_DEFAULTS, Refuse
from .deepseek import MLA_KEYS, MOE_KEYS, DeepSeekV3, _INERT, _NEUTRAL
from .experts import integer_field

INDEX_KEYS = ("index_n_heads", "index_head_dim", "index_topk")
PATTERN_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")

_V3_SHAPES = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3,
                  n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                  n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  index_head_dim=128, index_topk=2048)


class DeepSeekSparse(DeepSeekV3):
    """What V3.2 and GLM-5 share; ``interleaved_index``: the indexer's RoPE on pairs
    (GLM-5), ``shares``: the family holds 'shared' indexer layers (GLM-5)."""
    interleaved_index: bool = False
    shares: bool = False
    defaults: Dict[str, Any] = dict(_V3_SHAPES, n_group=8, topk_group=4,
                                    index_n_heads=64)  # DeepseekV32Config's

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        out = super().fields(hf, refuse)  # MLA (interleaved: no rope_interleave key), MoE
        index = {k: integer_field(hf, k, self.defaults[k], refuse) for k in INDEX_KEYS}
        out["dsa"] = DSAConfig(**index, rope_interleave=self.interleaved_index,
                               indexer_types=self.indexer_types(hf, refuse))
        return out

    def indexer_types(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[List[str]]:
        """V3.2: every layer its own indexer (None)."""
        return None

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is not None and types != ["indexed_attention"] * n:
            refuse("layer_types", types, f"{self.label}'s layers are 'indexed_attention' "
                                         f"({n})")
        first = min(hf.get("first_k_dense_replace", self.defaults["first_k_dense_replace"]), n)
        mlp = hf.get("mlp_layer_types")
        if mlp is not None and mlp != ["dense"] * first + ["sparse"] * (n - first):
            refuse("mlp_layer_types", mlp, f"ctxpar reads first_k_dense_replace={first} "
                                           f"dense layers, then experts on every layer")
        return {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types")}, {}

    def export_layer_types(self, m, refuse_export) -> List[str]:
        if m.dsa is None:
            refuse_export(f"model.dsa=None ({self.label}'s attention is DeepSeek sparse "
                          f"attention)")
        if m.dsa.rope_interleave != self.interleaved_index:
            refuse_export(f"model.dsa.rope_interleave={m.dsa.rope_interleave} ({self.label}'s "
                          f"indexer RoPE is {'interleaved' if self.interleaved_index else 'half-split'})")
        if m.dsa.indexer_types is not None and not self.shares and \
                "shared" in m.dsa.indexer_types:
            refuse_export(f"model.dsa.indexer_types={m.dsa.indexer_types} ({self.label} has "
                          f"an indexer in every layer)")
        return super().export_layer_types(m, refuse_export)

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        if not m.mla.rope_interleave:
            refuse_export(f"model.mla.rope_interleave=false ({self.label}'s MLA RoPE is "
                          f"interleaved)")
        super().config(cfg, m, types, source, refuse_export)
        cfg.pop("rope_interleave", None)  # not a field of the class: always interleaved
        cfg.update({k: getattr(m.dsa, k) for k in INDEX_KEYS})
        if self.shares:
            cfg["indexer_types"] = list(m.dsa.indexer_types or ["full"] * m.n_layers)


class GLM5(DeepSeekSparse):
    interleaved_index = True
    shares = True
    defaults: Dict[str, Any] = dict(_V3_SHAPES, q_lora_rank=2048, qk_nope_head_dim=192,
                                    v_head_dim=256, n_group=1, topk_group=1,
                                    index_n_heads=32)  # GlmMoeDsaConfig's

    def indexer_types(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[List[str]]:
        """indexer_types, or as GlmMoeDsaConfig derives it: index_topk_pattern ('F' full,
        'S' shared per layer), else layer i full when max(i - offset + 1, 0) % freq == 0
        (index_topk_freq 1, index_skip_topk_offset 2 by default: every layer full)."""
        n = hf["num_hidden_layers"]
        types = hf.get("indexer_types")
        pattern = hf.get("index_topk_pattern")
        if types is None and isinstance(pattern, str):
            if set(pattern) - {"F", "S"}:
                refuse("index_topk_pattern", pattern, "one 'F' or 'S' per layer")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif types is None and pattern is not None:
            types = list(pattern)
        elif types is None:
            freq = max(integer_field(hf, "index_topk_freq", 1, refuse), 1)
            offset = integer_field(hf, "index_skip_topk_offset", 2, refuse, low=0)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                     for i in range(n)]
        if not isinstance(types, list) or len(types) != n or set(types) - {"full", "shared"} \
                or types[0] != "full":
            refuse("indexer_types", types, f"one 'full' or 'shared' per layer ({n}), the "
                                           f"first 'full'")
        return None if set(types) == {"full"} else types


_FIXED = {k: v for k, v in ARCH_DEFAULTS.items() if k not in ("mla", "dsa")}  # read here
_OWN = (*MLA_KEYS, "qk_head_dim", *MOE_KEYS, *INDEX_KEYS, "layer_types", "mlp_layer_types")
_NEUTRAL_DSA = {**_NEUTRAL, "mlp_bias": (False, "biases on the MLPs are not built by ctxpar")}
_MOE_FIXED = {"score": "sigmoid", "score_correction_bias": True, "shared_expert_gate": False,
              "aux_loss_coef": 0.0}

V32 = DeepSeekSparse(
    "deepseek_v32", "DeepseekV32ForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    neutral=dict(_NEUTRAL_DSA), own=_OWN, inert=_INERT, moe_fixed=dict(_MOE_FIXED),
    moe_optional=True, expert_naming="qwen")
GLM_MOE_DSA = GLM5(
    "glm_moe_dsa", "GlmMoeDsaForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    neutral=dict(_NEUTRAL_DSA), own=(*_OWN, "indexer_types", *PATTERN_KEYS), inert=_INERT,
    moe_fixed=dict(_MOE_FIXED), moe_optional=True, expert_naming="qwen")
