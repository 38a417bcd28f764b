"""Hugging Face families, one file each (or one per lineage), registered in
ctxpar/config/hf_families.py.

    base.py         Family: the description and the hooks the shared machinery calls
    table.py        FAMILIES, WRAPPERS, family_of: the table loaded
    experts.py      what the mixture-of-experts families share (counts, per-expert names)
    llama.py qwen.py mistral.py gemma3.py qwen3_5.py nemotron_h.py olmo_hybrid.py
    qwen_moe.py mixtral.py gpt_oss.py qwen3_next.py deepseek.py glm4_moe.py minimax_m2.py
    llama4.py       the families
"""
from .table import (FAMILIES, WRAPPERS, Wrapper, family_of, folder_family, moe_fixed_of,
                    moe_held)

__all__ = ["FAMILIES", "WRAPPERS", "Wrapper", "family_of", "folder_family", "moe_fixed_of",
           "moe_held"]
