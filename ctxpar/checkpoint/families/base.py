"""What every Hugging Face family is: ctxpar's one GPT with some fields fixed, a
config.json read onto model.* and written back, tensors named both ways.

``Family`` holds the description (its columns) and the hooks the shared machinery calls
(hf.py reads and writes config.json, weight_reader.py reads tensors, hf.save_folder
writes them); the hooks' bodies here are Llama's, and a family overrides those it does
differently, in its own file. The shared machinery knows no family by name.

    read   check_keys -> prepare -> fields (fixed + its own) -> layers (kinds, linear
           mixers, windows) -> rope; hf.model_fields adds what every family maps
    write  export_layer_types (what it cannot hold, refused) -> config (its keys into
           hf.family_config's common ones)
    names  naming (names.HF_NAMINGS), folder_key / folder_shape / from_folder (a
           tensor stored under another name or layout), sources (a tensor in parts),
           fused_source (a tensor inside a fused one), to_folder / saved (the export's
           form), left_out (tensors the import leaves out)
    mtp    mtp / export_mtp: the multi-token prediction layers' config.json keys
           (model.mtp), both ways; mtp_key / mtp_copies: their tensors' names (DeepSeek-V3
           numbers them after the main layers and stores the embedding and head again)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from ...config import resolved_head_dim
from ...config.layers import ATTENTION_TYPES, layer_types
from ..resume import CheckpointError
from .experts import Refuse, per_expert_tensors

# model.* fields a family fixes (Llama leaves bias free), so the family of a ModelConfig
# is the first whose fixed values it has.
ARCH_DEFAULTS = {"mlp": "swiglu", "norm": "rmsnorm", "bias": False, "attention_bias": False,
                 "qk_norm": False, "norm_offset": 0.0, "post_norms": False,
                 "scale_embeddings": False, "attention_output_gate": False, "rope": True,
                 "qk_norm_scope": "head", "reordered_norms": None,
                 "linear_allow_neg_eigval": False, "linear_norm_eps": None, "mla": None,
                 "dsa": None, "nope_layers": None, "attn_temperature_tuning": False, "qk_l2_norm": False,
                 # Gemma 4's (config/kv_layers.py)
                 "global_head_dim": None, "global_n_kv_heads": None, "attention_k_eq_v": False,
                 "value_norm": False, "num_kv_shared_layers": 0, "per_layer_input_dim": 0,
                 "layer_scalar": False, "final_logit_softcapping": None,
                 # DeepSeek-V4's attention: no family reads or writes it yet (NOT_BUILT)
                 "compressed_attention": None}

# config.json keys that do not change the computation: bookkeeping, token ids, generation
# defaults, the runtime's switches.
IGNORED_KEYS = frozenset((
    "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "id2label", "label2id",
    "problem_type", "output_attentions", "output_hidden_states", "return_dict",
    "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "model_type",
    "pretraining_tp",  # a slicing of Llama's matmuls, the same product
    "initializer_range", "max_position_embeddings",  # mapped to init_std and seq_len
    "_attn_implementation_autoset", "use_return_dict", "tie_word_embeddings",
    "cache_implementation",  # the KV cache transformers generates with
))
# config.json keys every family maps onto model.* (hf.model_fields)
MAPPED_KEYS = frozenset((
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "rms_norm_eps", "head_dim", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_dropout",
))
# Keys that name something ctxpar does not implement, with what it is (refused unless
# the value is the one that turns the feature off: None, 0, False).
NOT_IMPLEMENTED = {
    "num_experts": "mixture of experts", "num_local_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts", "num_experts_per_tok": "mixture of experts",
    "moe_intermediate_size": "mixture of experts", "decoder_sparse_step": "mixture of experts",
    "final_logit_softcapping": "logit softcapping", "attn_logit_softcapping":
    "attention logit softcapping", "use_bidirectional_attention": "bidirectional attention",
    "use_mrope": "multimodal RoPE", "quantization_config": "quantized weights",
    "use_qk_norm": "a q/k norm over all heads", "attention_chunk_size": "chunked attention",
    "auto_map": "a remote-code folder's own modeling files",
}
NO_BIAS = "ctxpar has q/k/v biases without o_proj's, or biases on every layer (MLP too)"


@dataclass(frozen=True)
class Family:
    model_type: str                    # config.json's model_type
    architecture: str                  # its *ForCausalLM
    fixed: Dict[str, Any]              # model.* values the family always has
    activation: Tuple[str, str]        # (config.json key, value): the MLP's activation
    default_theta: float = 10000.0     # rope_theta when config.json has none
    # config.json keys the family has, with the value ctxpar implements and why
    neutral: Dict[str, Tuple[Any, str]] = field(default_factory=dict)
    # config.json keys the family has whose value ctxpar reads (its own hooks)
    own: Tuple[str, ...] = ()
    # config.json keys the family always writes that compute nothing in the models ctxpar
    # takes (multi-token-prediction settings, MoE keys no code reads)
    inert: Tuple[str, ...] = ()
    # model.moe.* values a mixture-of-experts family always has (None: a dense family,
    # which holds no model.moe)
    moe_fixed: Optional[Dict[str, Any]] = None
    # a family with moe_fixed that also holds dense models (Nemotron-H: MoE blocks or none)
    moe_optional: bool = False
    tied_default: bool = False         # tie_word_embeddings when config.json has none
    # how the folder names a MoE family's experts (experts.PER_EXPERT; None: fused only)
    expert_naming: Optional[str] = None

    # class attributes a family's class sets (not fields): the layer types with a RoPE
    # of their own, whether it writes its own query_pre_attn_scalar (Gemma 3's both)
    layer_rope_types: ClassVar[Tuple[str, ...]] = ()
    own_query_scale: ClassVar[bool] = False
    sinks: ClassVar[bool] = False            # attention sinks (gpt-oss)
    mxfp4: ClassVar[bool] = False            # reads MXFP4 experts (gpt-oss)

    @property
    def label(self) -> str:
        """The architecture without ForCausalLM: 'Llama', 'GptOss'."""
        return self.architecture[:-len("ForCausalLM")]

    # ------------------------------------------------------------------ read config.json

    def known_keys(self) -> frozenset:
        return (IGNORED_KEYS | MAPPED_KEYS | set(NOT_IMPLEMENTED) | set(self.neutral)
                | set(self.own) | set(self.inert) | {self.activation[0]})

    def check_keys(self, hf: Dict[str, Any], refuse: Refuse) -> None:
        """Every config.json key known (mapped, neutral at its value, the family's own,
        inert or ignored), its MLP's activation ctxpar's; refuses the first that is not."""
        known = self.known_keys()
        for key in sorted(hf):
            if key in self.inert:
                continue
            if key in NOT_IMPLEMENTED and key not in self.own and hf[key] not in (
                    None, 0, False, {}):
                refuse(key, hf[key], f"{NOT_IMPLEMENTED[key]} is not implemented by ctxpar")
            if key not in known:
                refuse(key, hf[key], f"a config field ctxpar does not know for model_type "
                                     f"{self.model_type!r}; it may change the computation "
                                     f"(remove it from config.json if it does not)")
        act_key, act = self.activation
        if hf.get(act_key, act) != act:
            refuse(act_key, hf[act_key], f"{self.architecture}'s MLP in ctxpar uses {act}")
        if hf.get("attention_dropout", 0.0) not in (0, 0.0, None):
            refuse("attention_dropout", hf["attention_dropout"], "ctxpar trains without dropout")
        for key, (want, why) in self.neutral.items():
            if hf.get(key, want) != want:
                refuse(key, hf[key], why)

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """config.json with the family's own spellings of the common keys made common
        (Nemotron-H's layer count is its blocks')."""
        return hf

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """model.* the family fixes or reads from its own keys (biases, experts)."""
        return dict(self.fixed)

    def layers(self, hf: Dict[str, Any], file: str,
               refuse: Refuse) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(config.json left for the common reading, model.* of its layers: types,
        windows, the linear mixers' sizes). Llama's: every layer full attention."""
        return hf, {}

    def rope(self, hf: Dict[str, Any], file: str) -> Tuple[float, Optional[Dict[str, Any]]]:
        """(rope_theta, ctxpar rope_scaling) from either form of config.json."""
        from ..rope_config import read_rope
        return read_rope(hf, file, self.default_theta)

    # --------------------------------------------------------------- write config.json

    def export_layer_types(self, m, refuse_export: Callable[[str], None]) -> List[str]:
        """Each layer's type as the family writes it; refuses what it cannot hold. A
        dense-attention family's: no linear layers, chunks, sinks, partial RoPE, RoPE per
        layer type; its windows as check_windows says."""
        types = layer_types(m)
        if m.attention_sinks and not self.sinks:
            refuse_export("model.attention_sinks=true")
        if m.partial_rotary_factor != 1.0:
            refuse_export(f"model.partial_rotary_factor={m.partial_rotary_factor}")
        linear = sorted(set(types) - set(ATTENTION_TYPES))
        if linear:
            refuse_export(f"model.layer_types with {linear} layers (Gated DeltaNet, Mamba2 "
                          f"and single-op blocks: Qwen3.5's layer_types hold Gated DeltaNet)")
        if "chunked_attention" in types:
            refuse_export(f"model.layer_types={types} (chunked attention)")
        self.check_windows(m, types, refuse_export)
        if set(m.layer_rope or {}) - set(self.layer_rope_types):
            refuse_export(f"model.layer_rope={m.layer_rope} (RoPE per layer type: Gemma 3's "
                          f"sliding layers only)")
        return types

    def check_query_scale(self, m, refuse_export: Callable[[str], None]) -> None:
        """The softmax scale: 1/sqrt(head_dim) unless the family writes its own."""
        if not self.own_query_scale and m.query_pre_attn_scalar not in (
                None, resolved_head_dim(m)):
            refuse_export(f"model.query_pre_attn_scalar={m.query_pre_attn_scalar} (its scale "
                          f"is head_dim)")

    def check_windows(self, m, types: List[str], refuse_export: Callable[[str], None]) -> None:
        """The sliding layers the family can write (any, by default)."""

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export: Callable[[str], None]) -> None:
        """The family's own keys into hf.family_config's common ones (cfg, in place)."""

    # ----------------------------------------------------------------- tensors' names

    def naming(self, m) -> str:
        """How the family names GPT's tensors (names.HF_NAMINGS)."""
        return "post_norms" if m.post_norms else "default"

    def folder_key(self, key: str) -> str:
        """names.to_hf's key -> the folder's name for it (gpt-oss's router)."""
        return key

    def folder_shape(self, key: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The folder's shape of a tensor ctxpar holds in `shape`."""
        return shape

    def from_folder(self, key: str, t: torch.Tensor, hf: Dict[str, Any]) -> torch.Tensor:
        """A tensor as the folder stores it -> ctxpar's layout (hf: the folder's
        config.json: Llama 4's q/k rows are permuted by head)."""
        return t

    def sources(self, key: str) -> List[Tuple[str, ...]]:
        """Where a folder may hold the tensor names.to_hf calls `key`: alternatives, each
        a tuple of tensors concatenated on dim 0."""
        return [(key,)]

    def part_rows(self, m, keys: Tuple[str, ...]) -> Optional[List[int]]:
        """Rows of each of a tensor's parts (sources), None: each part's own."""
        return None

    def fused_source(self, key: str) -> Optional[Tuple[str, int]]:
        """(the folder's fused key, which part) holding `key`, None when stored alone."""
        return None

    # unfuse and fused_shape are asked only of a key fused_source named: a family that
    # fuses (Qwen3-Next) overrides all three; reaching these is a broken contract
    def unfuse(self, fused_key: str, t: torch.Tensor, part: int, hf: Dict[str, Any],
               path: str) -> torch.Tensor:
        """ctxpar's part `part` of the folder's fused tensor t."""
        raise NotImplementedError(f"{self.model_type} fuses no tensor")

    def fused_shape(self, fused_key: str, m) -> Tuple[int, ...]:
        """The folder's shape of a fused tensor of ModelConfig m."""
        raise NotImplementedError(f"{self.model_type} fuses no tensor")

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        """A tensor of the folder the import leaves out (said in the start-up line); hf:
        the folder's config.json (DeepSeek's and GLM-4.5's MTP layers are numbered past
        its layers)."""
        return False

    # ------------------------------------------------- multi-token prediction (model.mtp)

    def mtp(self, hf: Dict[str, Any], refuse: Refuse):
        """The folder's MTP layers as model.mtp (ctxpar/config/mtp.py; its loss_weight the
        default: a training choice), None: it has none. A family whose MTP layers ctxpar
        does not build refuses here, naming the key (asked only when model.mtp is set)."""
        return None

    def export_mtp(self, cfg: Dict[str, Any], m, refuse_export: Callable[[str], None]) -> None:
        """config.json's MTP keys of m.mtp (cfg, in place); a family without MTP layers
        refuses model.mtp."""
        if m.mtp is not None:
            refuse_export(f"model.mtp (multi-token prediction layers: {self.label} has none; "
                          f"set model.mtp: null to export without them)")

    def mtp_key(self, key: str, n_layers: int) -> str:
        """A model.mtp tensor's generic name (names.to_hf: mtp.layers.{k}.*) -> the
        folder's, in a model of n_layers main layers; any other key unchanged."""
        return key

    def mtp_copies(self, m) -> Dict[str, str]:
        """{folder key: the key it copies}: tensors the folder stores again in its MTP
        layers (none here; the export writes them, the import checks them equal)."""
        return {}

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) of ctxpar's HF-form tensor as transformers saves the family."""
        return per_expert_tensors(key, t, self.expert_naming)

    def saved(self, tensors: Dict[str, torch.Tensor], m) -> Dict[str, torch.Tensor]:
        """The export's tensors, last changes that take several at once (fusing)."""
        return tensors


def refuse_export_of(fam: Family) -> Callable[[str], None]:
    """refuse_export(what) for fam: '<what> cannot be exported as <architecture>'."""
    def refuse(what: str) -> None:
        raise CheckpointError(f"{what} cannot be exported as {fam.architecture}")
    return refuse


def full_attention_only(fam: Family, m, refuse_export: Callable[[str], None]) -> List[str]:
    """A family whose every layer is causal full attention (GLM-4.5, MiniMax-M2): no
    window, chunks, sinks or linear mixers, one RoPE for every layer."""
    types = layer_types(m)
    if m.attention_sinks:
        refuse_export("model.attention_sinks=true")
    if set(types) != {"full_attention"}:
        refuse_export(f"model.layer_types={types} ({fam.label}'s layers are full attention)")
    if m.layer_rope:
        refuse_export(f"model.layer_rope={m.layer_rope} (one RoPE for every layer)")
    return types


def window_on_every_layer_or_none(fam: Family, m, types: List[str],
                                  refuse_export: Callable[[str], None]) -> None:
    """Mistral's, Mixtral's and Qwen3-MoE's windows: on every layer or none."""
    if len(set(types)) > 1:
        refuse_export(f"model.layer_types={types} ({fam.label}'s window is on every layer "
                      f"or none)")


def attention_layers(hf: Dict[str, Any], types: Optional[List[str]], window: Any,
                     refuse: Refuse) -> Dict[str, Any]:
    """model.sliding_window and layer_types of a family's full and sliding layers
    (types: one per layer, as transformers reads them); {} when none slides."""
    n = hf["num_hidden_layers"]
    if not isinstance(types, list) or len(types) != n or \
            set(types) - {"full_attention", "sliding_attention"}:
        refuse("layer_types", types, f"one of 'full_attention', 'sliding_attention' per "
                                     f"layer ({n})")
    if "sliding_attention" not in types:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse("sliding_window", window, "the sliding layers need a window of >= 1 tokens")
    return {"sliding_window": window,
            "layer_types": None if set(types) == {"sliding_attention"} else types}
