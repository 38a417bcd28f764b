"""The Hugging Face families ctxpar imports and exports: one line a family, config.json's
model_type -> the file of ctxpar/checkpoint/families/ that describes it and the name it
has there.

The importer, the exporter, ``--model-config``, model.family's choices and the docs'
families table all read this table (ctxpar/checkpoint/families/table.py loads it).
Adding a family is its file there and one line below (docs/development.md). It stands
in config/, which names model.family's choices, below the checkpoint code that loads
the families, and imports nothing.
"""
REGISTRY = (
    ("llama", "llama", "FAMILY"),
    ("qwen2", "qwen", "QWEN2"),
    ("qwen3", "qwen", "QWEN3"),
    ("mistral", "mistral", "FAMILY"),
    ("gemma3_text", "gemma3", "FAMILY"),
    ("qwen3_5_text", "qwen3_5", "FAMILY"),
    ("nemotron_h", "nemotron_h", "FAMILY"),
    ("olmo_hybrid", "olmo_hybrid", "FAMILY"),
    ("qwen3_moe", "qwen_moe", "QWEN3_MOE"),
    ("qwen2_moe", "qwen_moe", "QWEN2_MOE"),
    ("mixtral", "mixtral", "FAMILY"),
    ("gpt_oss", "gpt_oss", "FAMILY"),
    ("qwen3_next", "qwen3_next", "QWEN3_NEXT"),
    ("qwen3_5_moe_text", "qwen3_next", "QWEN3_5_MOE"),
    ("deepseek_v3", "deepseek", "V3"),
    ("deepseek_v2", "deepseek", "V2"),
    ("deepseek_v32", "deepseek_dsa", "V32"),
    ("glm_moe_dsa", "deepseek_dsa", "GLM_MOE_DSA"),
    ("glm4_moe", "glm4_moe", "FAMILY"),
    ("minimax_m2", "minimax_m2", "FAMILY"),
    ("llama4_text", "llama4", "FAMILY"),
    ("mimo_v2_flash", "mimo_v2_flash", "FAMILY"),
    ("kimi_linear", "kimi_linear", "FAMILY"),
    ("gemma4_text", "gemma4", "FAMILY"),
    ("deepseek_v4", "deepseek_v4", "FAMILY"),
)
HF_FAMILIES = tuple(model_type for model_type, _, _ in REGISTRY)
# Families transformers has that ctxpar knows it does not build yet: model_type -> what is
# missing (the importer's one line names it)
_GLM5_NEXT = ("GLM-5.3-Flash's sparse attention (DSA: its k-pool indexer of 16-token pools, "
              "gate-weighted pool keys, the visible tail) and its manifold-constrained "
              "hyper-connections (mHC) are not built by ctxpar yet")
NOT_BUILT = {"glm5_next": _GLM5_NEXT, "glm5_next_text": _GLM5_NEXT}
