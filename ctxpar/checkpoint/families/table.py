"""The families of config/hf_families.py loaded: ``FAMILIES`` (model_type -> Family), the multimodal
folders around a family's language model (``WRAPPERS``), and which family holds a
ModelConfig (``family_of``)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .base import Family
from ...config.hf_families import REGISTRY


def _load() -> Dict[str, Family]:
    families = {}
    for model_type, module, name in REGISTRY:
        fam = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        assert fam.model_type == model_type, f"config/hf_families.py: {module}.{name} is " \
                                             f"{fam.model_type!r}, not {model_type!r}"
        families[model_type] = fam
    return families


FAMILIES: Dict[str, Family] = _load()


@dataclass(frozen=True)
class Wrapper:
    """A multimodal folder around a family's language model: its text_config is the
    family's config.json, its tensors under ``prefix`` are the family's ``model.*``, those
    under ``left_out`` are not imported (said in the start-up line)."""
    text_family: str
    prefix: str
    left_out: Tuple[str, ...]
    what: str                          # what is left out, in words
    top_keys: Tuple[str, ...]          # the top-level keys it may have besides text_config


_VISION = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
           "vision_end_token_id")
# model_type of a released multimodal folder -> how its language model is read
WRAPPERS: Dict[str, Wrapper] = {
    "qwen3_5": Wrapper("qwen3_5_text", "model.language_model.", ("model.visual.",),
                       "the vision tower (vision_config, model.visual.*)", _VISION),
    "qwen3_5_moe": Wrapper("qwen3_5_moe_text", "model.language_model.", ("model.visual.",),
                           "the vision tower (vision_config, model.visual.*)", _VISION),
}


def folder_family(model_type) -> Family:
    """The family whose hooks read a folder of this model_type (a wrapper's text family;
    Llama's, which change nothing, for one ctxpar does not import)."""
    wrapper = WRAPPERS.get(model_type)
    return FAMILIES.get(wrapper.text_family if wrapper else model_type, FAMILIES["llama"])


def family_of(m) -> str:
    """model.family, or the first family whose fixed fields m has (llama for a plain GPT);
    KeyError when none holds m."""
    if m.family is not None:
        return m.family
    for name, fam in FAMILIES.items():
        if all(getattr(m, k) == v for k, v in fam.fixed.items()) and moe_held(m, fam):
            return name
    raise KeyError("no Hugging Face family")


# model.moe's values every MoE family has unless its moe_fixed says otherwise: Llama 4's
# alone scales inputs, Gemma 4's alone has its experts beside the MLP and its router scales
MOE_DEFAULTS = {"scale_expert_input": False, "beside_mlp": False, "scaled_router": False}


def moe_fixed_of(fam: Family) -> Dict[str, Any]:
    """model.moe's values a MoE family holds (its moe_fixed over MOE_DEFAULTS)."""
    return {**MOE_DEFAULTS, **fam.moe_fixed}


def moe_held(m, fam: Family) -> bool:
    """A dense family for a dense model; a MoE family for model.moe with its fixed values."""
    if fam.moe_fixed is None or m.moe is None:
        return m.moe is None and (fam.moe_fixed is None or fam.moe_optional)
    return all(getattr(m.moe, k) == v for k, v in moe_fixed_of(fam).items())
