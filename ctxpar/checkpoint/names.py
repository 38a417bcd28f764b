"""Parameter names across the three forms of one model: GPT, its pipeline stages, Hugging Face.

GPT (models/gpt.py) is the canonical form; every checkpoint conversion goes through it.

    GPT                          pipeline (models/gpt_pipe.py)     Hugging Face (model.layers.{i}.)
    embed.weight                 tied_modules.embed.embed.weight   model.embed_tokens.weight
                                 (untied: 0.embed.weight)
    layers.{i}.attn_norm.weight  {i+1}.attn_norm.weight            input_layernorm.weight
    layers.{i}.attn.q_proj.*     {i+1}.attn.q_proj.*               self_attn.q_proj.*
      (k_proj, v_proj, o_proj, q_norm, k_norm likewise)
    layers.{i}.mlp_norm.weight   {i+1}.mlp_norm.weight             post_attention_layernorm.weight
    layers.{i}.mlp.gate_proj.*   {i+1}.mlp.gate_proj.*             mlp.gate_proj.*
      (up_proj, down_proj likewise)
    layers.{i}.linear_attn.*     {i+1}.linear_attn.*               linear_attn.* (Qwen3.5's
                                                                   Gated DeltaNet, as named)

Nemotron-H (naming 'nemotron_h') names every block's norm ``norm`` and its one op
``mixer`` (Mamba2, attention or MLP), under ``backbone.layers.{i}.``, the embedding
``backbone.embeddings`` and the final norm ``backbone.norm_f``, as its folders hold them.
OLMo Hybrid (naming 'olmo_hybrid') names its norms by place and its Gated DeltaNet's
tensors its own way (_HF_IN_OLMO_HYBRID_BLOCK). Kimi Linear (naming 'kimi_linear') keeps
its KDA layers' mixer (GPT's ``kda``) under ``self_attn``, as its MLA layers'.

With model.post_norms (Gemma 2/3) Hugging Face names the norms by place instead:

    layers.{i}.post_attn_norm.weight                               post_attention_layernorm.weight
    layers.{i}.mlp_norm.weight                                     pre_feedforward_layernorm.weight
    layers.{i}.post_mlp_norm.weight                                post_feedforward_layernorm.weight

    final_norm.weight            {L+1}.final_norm.weight           model.norm.weight
    lm_head.weight (untied)      {L+2}.lm_head.weight              lm_head.weight
    mtp.layers.{k}.* (model.mtp) {L+3}.mtp.layers.{k}.*            the family's (below)

DeepSpeed's PipelineModule names a layer by its index in the flat layer list
(embedding | L blocks | final norm | head [| model.mtp's depths]), so pipeline names do
not depend on pp or on how layers are partitioned into stages; the tied embedding lives
under ``tied_modules`` (under model.mtp an untied head's too: the depths read a copy of it
on the last stage, models/mtp_pipe.py; pipeline_ties_embedding).
The q/k weights need no permutation for Hugging Face: ctxpar's RoPE rotates the channel
pairs (i, i + hd/2) ("rotate half"), the convention of HF's Llama implementation.
"""
from __future__ import annotations

import re

_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_PIPE_BLOCK = re.compile(r"^(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Inside a block, GPT's -> HF's: whole names, then prefixes.
_HF_IN_BLOCK = (("attn_norm.weight", "input_layernorm.weight"),
                ("mlp_norm.weight", "post_attention_layernorm.weight"),
                ("attn.", "self_attn."), ("mlp.", "mlp."), ("linear_attn.", "linear_attn."))
_HF_IN_POST_NORM_BLOCK = (("attn_norm.weight", "input_layernorm.weight"),
                          ("post_attn_norm.weight", "post_attention_layernorm.weight"),
                          ("mlp_norm.weight", "pre_feedforward_layernorm.weight"),
                          ("post_mlp_norm.weight", "post_feedforward_layernorm.weight"),
                          ("attn.", "self_attn."), ("mlp.", "mlp."))
_HF_TOP = (("embed.weight", "model.embed_tokens.weight"),
           ("final_norm.weight", "model.norm.weight"), ("lm_head.weight", "lm_head.weight"))
# Nemotron-H: one norm and one mixer per block, whatever the block's op; its MoE's
# squared-ReLU experts have up_proj only, its shared expert is shared_experts
_HF_IN_NEMOTRON_BLOCK = (("attn_norm.weight", "norm.weight"), ("mlp_norm.weight", "norm.weight"),
                         ("mlp.experts.gate_up_proj", "mixer.experts.up_proj"),
                         ("mlp.shared_expert.", "mixer.shared_experts."),
                         ("attn.", "mixer."), ("mamba.", "mixer."), ("mlp.", "mixer."))
_HF_NEMOTRON_TOP = (("embed.weight", "backbone.embeddings.weight"),
                    ("final_norm.weight", "backbone.norm_f.weight"),
                    ("lm_head.weight", "lm_head.weight"))
# OLMo Hybrid as transformers saves it (conversion_mapping's olmo_hybrid, reversed): the
# Gated DeltaNet layers' input norms attention_layer_norm and feedforward_layer_norm, the
# attention layers' reordered norms feedforward_layer_norm (after attention: transformers'
# post_attention_layernorm, renamed on saving with the others) and
# post_feedforward_layernorm; its Gated DeltaNet's own names. in_proj_qkv and conv1d have
# no one tensor: they are [q | k | v] sections (checkpoint/families/olmo_hybrid.py's sources).
_HF_IN_OLMO_HYBRID_BLOCK = (
    ("attn_norm.weight", "attention_layer_norm.weight"),
    ("mlp_norm.weight", "feedforward_layer_norm.weight"),
    ("post_attn_norm.weight", "feedforward_layer_norm.weight"),
    ("post_mlp_norm.weight", "post_feedforward_layernorm.weight"),
    ("attn.", "self_attn."), ("mlp.", "mlp."),
    ("linear_attn.in_proj_z.", "linear_attn.g_proj."),
    ("linear_attn.in_proj_a.", "linear_attn.a_proj."),
    ("linear_attn.in_proj_b.", "linear_attn.b_proj."),
    ("linear_attn.out_proj.", "linear_attn.o_proj."),
    ("linear_attn.norm.", "linear_attn.o_norm."), ("linear_attn.", "linear_attn."))
# Kimi Linear: its KDA layers' mixer (ctxpar's kda) under self_attn, as its MLA layers'
_HF_IN_KIMI_LINEAR_BLOCK = (*_HF_IN_BLOCK, ("kda.", "self_attn."))
# Gemma 4: Gemma's post norms, the per-layer input's gate (models/per_layer_input.py) and
# embedding, the layer scalar (a buffer)
_HF_IN_GEMMA4_BLOCK = (("per_layer_input.input_gate.weight", "per_layer_input_gate.weight"),
                       ("per_layer_input.projection.weight", "per_layer_projection.weight"),
                       ("per_layer_input.norm.weight", "post_per_layer_input_norm.weight"),
                       ("layer_scalar", "layer_scalar"), *_HF_IN_POST_NORM_BLOCK)
_HF_GEMMA4_TOP = (("per_layer_input.embed.weight", "model.embed_tokens_per_layer.weight"),
                  ("per_layer_input.model_projection.weight",
                   "model.per_layer_model_projection.weight"),
                  ("per_layer_input.projection_norm.weight",
                   "model.per_layer_projection_norm.weight"), *_HF_TOP)
# Gemma 4 with its experts beside the MLP (models/moe_beside_mlp.py): the dense MLP under
# mlp., the experts, router and their norms at the block
_HF_IN_GEMMA4_MOE_BLOCK = (("mlp.dense.", "mlp."),
                           ("mlp.dense_norm.weight", "post_feedforward_layernorm_1.weight"),
                           ("mlp.experts_norm.weight", "pre_feedforward_layernorm_2.weight"),
                           ("mlp.post_experts_norm.weight", "post_feedforward_layernorm_2.weight"),
                           ("mlp.gate.weight", "router.proj.weight"),
                           ("mlp.gate.scale", "router.scale"),
                           ("mlp.gate.per_expert_scale", "router.per_expert_scale"),
                           ("mlp.experts.", "experts."), *_HF_IN_GEMMA4_BLOCK)
# DeepSeek-V4 as transformers holds it (DeepseekV4ForCausalLM's state dict: its folders'
# own names are the family's folder_key, checkpoint/families/deepseek_v4.py): mHC's mixing
# weights per sublayer and its head, the shared expert plural
_HF_IN_DEEPSEEK_V4_BLOCK = (("mlp.shared_expert.", "mlp.shared_experts."),
                            ("attn_hc.", "attn_hc."), ("mlp_hc.", "ffn_hc."), *_HF_IN_BLOCK)
_HF_DEEPSEEK_V4_TOP = (("hc_head.fn", "model.hc_head.hc_fn"),
                       ("hc_head.base", "model.hc_head.hc_base"),
                       ("hc_head.scale", "model.hc_head.hc_scale"), *_HF_TOP)
# naming -> (blocks' prefix, in block, top level): Llama's (default), Gemma's post norms,
# Gemma 4's, Nemotron-H's (saved under backbone.*, which transformers renames model.* on
# loading), OLMo Hybrid's
HF_NAMINGS = {"default": ("model.layers.", _HF_IN_BLOCK, _HF_TOP),
              "post_norms": ("model.layers.", _HF_IN_POST_NORM_BLOCK, _HF_TOP),
              "nemotron_h": ("backbone.layers.", _HF_IN_NEMOTRON_BLOCK, _HF_NEMOTRON_TOP),
              "olmo_hybrid": ("model.layers.", _HF_IN_OLMO_HYBRID_BLOCK, _HF_TOP),
              "kimi_linear": ("model.layers.", _HF_IN_KIMI_LINEAR_BLOCK, _HF_TOP),
              "gemma4": ("model.layers.", _HF_IN_GEMMA4_BLOCK, _HF_GEMMA4_TOP),
              "gemma4_moe": ("model.layers.", _HF_IN_GEMMA4_MOE_BLOCK, _HF_GEMMA4_TOP),
              "deepseek_v4": ("model.layers.", _HF_IN_DEEPSEEK_V4_BLOCK, _HF_DEEPSEEK_V4_TOP)}
# namings whose Hugging Face names map to GPT's only knowing the block's type (from_hf)
_BY_BLOCK_TYPE = ("nemotron_h", "olmo_hybrid", "kimi_linear")


def _swap(pairs):
    return tuple((b, a) for a, b in pairs)


def _translate(name: str, block: re.Pattern, to_prefix: str, in_block, top) -> str:
    """One direction of the GPT <-> HF mapping: (src, dst) pairs, block-local or top-level."""
    m = block.match(name)
    if m:
        i, rest = m.groups()
        for src, dst in in_block:
            if rest == src or (src.endswith(".") and rest.startswith(src)):
                return f"{to_prefix}{i}.{dst}{rest[len(src):]}"
    for src, dst in top:
        if name == src:
            return dst
    raise KeyError(name)


def pipeline_ties_embedding(m) -> bool:
    """Whether GPTPipe ties the embedding between its first and last stage (``tied`` of
    to_pipe): a tied head, or model.mtp's depths reading it on the last stage."""
    return m.tie_embeddings or m.mtp is not None


def to_pipe(name: str, n_layers: int, tied: bool) -> str:
    """GPT name -> the pipeline module's name for the same parameter (tied:
    pipeline_ties_embedding)."""
    m = _BLOCK.match(name)
    if m:
        return f"{int(m.group(1)) + 1}.{m.group(2)}"
    if name.startswith(("embed.", "per_layer_input.")):  # the first layer's (Gemma 4's PLE)
        return ("tied_modules.embed." if tied else "0.") + name
    if name.startswith(("final_norm.", "hc_head.")):  # mHC's head collapses before the norm
        return f"{n_layers + 1}.{name}"
    if name.startswith("lm_head."):
        return f"{n_layers + 2}.{name}"
    if name.startswith("mtp."):
        return f"{n_layers + 3}.{name}"
    raise KeyError(f"{name!r} is not a GPT parameter name")


def from_pipe(name: str, n_layers: int) -> str:
    """The pipeline module's name -> GPT name (inverse of to_pipe)."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    m = _PIPE_BLOCK.match(name)
    if not m:
        raise KeyError(f"{name!r} is not a pipeline parameter name")
    index, rest = int(m.group(1)), m.group(2)
    if 1 <= index <= n_layers:
        return f"layers.{index - 1}.{rest}"
    if index in (0, n_layers + 1, n_layers + 2, n_layers + 3):
        return rest  # embed.*, final_norm.*, hc_head.*, lm_head.*, mtp.*
    raise KeyError(f"{name!r}: layer {index} is not in a {n_layers}-block pipeline")


_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def _mtp_to_hf(name: str, naming: str) -> str:
    """model.mtp's GPT names (models/mtp.py) -> the generic Hugging Face form a family's
    folder_key / to_folder rename: depth k's block under ``mtp.layers.{k}.`` with a main
    block's names (Qwen3.5's mtp.layers.0.self_attn.*), its norms and projection under
    transformers' MtpLayer names (``mtp.layers.{k}.enorm``, ``hnorm``, ``eh_proj``,
    ``norm``)."""
    k, rest = _MTP.match(name).groups()
    if not rest.startswith("block."):
        return name
    prefix = HF_NAMINGS[naming][0]
    inner = to_hf(f"layers.{k}.{rest[len('block.'):]}", naming)  # {prefix}{k}.<its name>
    return f"mtp.layers.{inner[len(prefix):]}"


def to_hf(name: str, naming: str = "default") -> str:
    """GPT name -> Hugging Face *ForCausalLM state-dict key (naming: HF_NAMINGS, the
    family's; hf.naming_of(m) says which)."""
    prefix, in_block, top = HF_NAMINGS[naming]
    if _MTP.match(name):
        return _mtp_to_hf(name, naming)
    try:
        return _translate(name, _BLOCK, prefix, in_block, top)
    except KeyError:
        raise KeyError(f"{name!r} has no Hugging Face counterpart") from None


def from_hf(name: str, naming: str = "default") -> str:
    """Hugging Face *ForCausalLM key -> GPT name (inverse of to_hf; Nemotron-H's block
    norm and mixer names need the block's type, so its naming has no inverse here)."""
    if naming in _BY_BLOCK_TYPE:
        raise KeyError(f"{name!r}: {naming}'s names map to GPT's by the block's type")
    _, in_block, top = HF_NAMINGS[naming]
    try:
        return _translate(name, _HF_BLOCK, "layers.", _swap(in_block), _swap(top))
    except KeyError:
        raise KeyError(f"{name!r} is not a Hugging Face parameter ctxpar knows") from None
