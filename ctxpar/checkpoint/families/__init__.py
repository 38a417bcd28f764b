"""Hugging Face families, one file each (or one per lineage), registered in registry.py.

    base.py         Family: the description and the hooks the shared machinery calls
    registry.py     model_type -> its file: the one table (imports nothing)
    table.py        FAMILIES, WRAPPERS, family_of: the table loaded
    experts.py      what the mixture-of-experts families share (counts, per-expert names)
    llama.py qwen.py mistral.py gemma3.py qwen3_5.py nemotron_h.py olmo_hybrid.py
    qwen_moe.py mixtral.py gpt_oss.py qwen3_next.py      the families

The names below load table.py on first use, so that config/ can read registry.py alone.
"""
_TABLE = ("FAMILIES", "WRAPPERS", "Wrapper", "family_of", "moe_held", "folder_family")


def __getattr__(name):
    if name in _TABLE:
        from . import table
        return getattr(table, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
