"""DeepSeek-V3 (``deepseek_v3``, DeepseekV3ForCausalLM: DeepSeek-V3, V3.1, R1, Kimi K2) and
DeepSeek-V2 (``deepseek_v2``: V2, V2-Lite): multi-head latent attention (model.mla) and a
mixture of experts after the first dense layers.

    config.json                            ctxpar model.*
    q_lora_rank (null: q_proj)             mla.q_lora_rank
    kv_lora_rank, qk_nope_head_dim,        mla.kv_lora_rank, qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim           qk_rope_head_dim, v_head_dim
    rope_interleave (V3; V2 always)        mla.rope_interleave
    rope_parameters (YaRN's mscale,        rope_theta, rope_scaling (the softmax scale
      mscale_all_dim)                        takes YaRN's mscale squared: config.softmax_scale)
    intermediate_size                      ffn_hidden: the first_k_dense_replace dense layers'
    first_k_dense_replace                  moe.layers: every layer from it on
    n_routed_experts                       moe.num_experts
    num_experts_per_tok                    moe.top_k
    moe_intermediate_size                  moe.expert_hidden (SwiGLU experts)
    n_shared_experts                       moe.shared_expert_hidden = n_shared_experts x
                                           moe_intermediate_size (one MLP, ungated)
    routed_scaling_factor, norm_topk_prob  moe.routed_scaling_factor, norm_topk
    n_group, topk_group (V3)               moe.n_group, topk_group
    (V3, fixed)                            moe.score sigmoid with score_correction_bias (the
                                           router's e_score_correction_bias buffer)
    topk_method greedy (V2)                moe.score softmax over every expert

num_key_value_heads must equal num_attention_heads (MLA expands every head's keys from the
one latent); head_dim is transformers' qk_rope_head_dim, written by its class, read by
nothing here. Neither ForCausalLM adds a router loss (output_router_logits only returns the
logits): aux_loss_coef 0. Tensors: transformers' names (self_attn.q_a_proj,
kv_a_proj_with_mqa, kv_b_proj, ...); the experts per expert as Qwen-MoE's; the shared
expert ``mlp.shared_experts.*``.

The multi-token prediction layers (num_nextn_predict_layers of them; DeepSeek-V3's layer
61) are model.mtp with moe (each an MLA + MoE decoder layer: transformers' get_mtp_config
sets first_k_dense_replace 0 for them), a projection and norms per depth, [embedding;
hidden] into eh_proj, numbered after the main layers (L = num_hidden_layers):

    folder                                  ctxpar (names.to_hf's generic form)
    model.layers.{L+k}.enorm / hnorm        mtp.layers.{k}.enorm / hnorm
    model.layers.{L+k}.eh_proj              mtp.layers.{k}.eh_proj
    model.layers.{L+k}.<a decoder layer>    mtp.layers.{k}.block.<a block>
    model.layers.{L+k}.shared_head.norm     mtp.layers.{k}.norm
    model.layers.{L+k}.embed_tokens,        the model's embedding and head (shared, §2.2):
      shared_head.head                        checked equal on import, written on export

With model.mtp set they are imported, trained and exported under these names; with
model.mtp null they are left out, as transformers' causal LMs drop them, and the start-up
line says so; the export then writes num_nextn_predict_layers 0. GLM-4.5 stores its MTP
layers the same way (glm4_moe.py).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...config.mla import MLAConfig
from ...config.moe import MoEConfig, moe_layer_indices
from ...config.mtp import MTPConfig
from .base import ARCH_DEFAULTS, Family, Refuse
from .experts import experts_and_top_k, integer_field, per_expert_tensors

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
            "norm_topk_prob", "first_k_dense_replace", "n_group", "topk_group")
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")
SHARED = (".mlp.shared_expert.", ".mlp.shared_experts.")  # ctxpar's, the folder's
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")  # names.to_hf's model.mtp names


def numbered_mtp_key(key: str, n_layers: int) -> str:
    """model.mtp's generic name -> DeepSeek-V3's: depth k is model.layers.{n_layers + k},
    its output norm shared_head.norm (module docstring)."""
    found = _MTP.match(key)
    if found is None:
        return key
    k, rest = found.groups()
    if rest.startswith("norm."):
        rest = "shared_head." + rest
    return f"model.layers.{n_layers + int(k)}.{rest}"


def numbered_mtp_copies(m) -> Dict[str, str]:
    """Each MTP layer's copies of the embedding and head (module docstring)."""
    head = "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"
    out = {}
    for k in range(m.mtp.depth if m.mtp is not None else 0):
        out[f"model.layers.{m.n_layers + k}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"model.layers.{m.n_layers + k}.shared_head.head.weight"] = head
    return out


def numbered_mtp(fam, hf: Dict[str, Any], refuse: Refuse, moe) -> Optional[MTPConfig]:
    """model.mtp of num_nextn_predict_layers (transformers' attribute_map: num_mtp_layers):
    MoE blocks (moe: the folder's model.moe, None: it has none, refused)."""
    key = next((k for k in MTP_KEYS if k in hf), MTP_KEYS[0])
    depth = integer_field(hf, key, 0, refuse, low=0)
    if depth and moe is None:
        refuse(key, depth, f"{fam.label}'s MTP layers hold experts (transformers' "
                           f"get_mtp_config) and this folder's layers have none, so no "
                           f"model.moe to shape them")
    return MTPConfig(depth=depth, moe=True) if depth else None


class NumberedMTP:
    """The hooks of a family whose MTP layers are numbered after its layers (DeepSeek-V3,
    GLM-4.5); ``mtp_moe_of(hf, refuse)``: the folder's model.moe, None when it has none."""

    def mtp(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[MTPConfig]:
        return numbered_mtp(self, hf, refuse, self.mtp_moe_of(hf, refuse))

    def export_mtp(self, cfg: Dict[str, Any], m, refuse_export) -> None:
        export_numbered_mtp(self, cfg, m, refuse_export)

    def mtp_key(self, key: str, n_layers: int) -> str:
        return numbered_mtp_key(key, n_layers)

    def mtp_copies(self, m) -> Dict[str, str]:
        return numbered_mtp_copies(m)


def export_numbered_mtp(fam, cfg: Dict[str, Any], m, refuse_export) -> None:
    """num_nextn_predict_layers of m.mtp (0 without), refusing what the folder cannot hold."""
    mtp = m.mtp
    if mtp is not None and (mtp.shared_projection or mtp.hidden_first or not mtp.moe or
                            mtp.layer_type != "full_attention"):
        refuse_export(f"model.mtp={mtp} ({fam.label}'s MTP layers have a projection per "
                      f"depth, take [embedding; hidden], hold experts and attend as the "
                      f"main layers: shared_projection=false, hidden_first=false, moe=true, "
                      f"layer_type=full_attention)")
    cfg["num_nextn_predict_layers"] = 0 if mtp is None else mtp.depth


class DeepSeek(NumberedMTP, Family):
    """What both generations share; V3's sigmoid router with its correction bias, V2's
    softmax (``sigmoid``); ``defaults``: the config class's."""
    defaults: Dict[str, Any] = {}
    sigmoid: bool = True

    def check_keys(self, hf: Dict[str, Any], refuse: Refuse) -> None:
        super().check_keys(hf, refuse)
        heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads") not in (None, heads):
            refuse("num_key_value_heads", hf["num_key_value_heads"], f"MLA expands every "
                   f"head's keys and values from one latent: num_attention_heads={heads}")

    def prepare(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        """head_dim is transformers' RoPE width, its class's qk_rope_head_dim: any other
        would turn another number of channels."""
        rope = hf.get("qk_rope_head_dim", self.defaults["qk_rope_head_dim"])
        if hf.get("head_dim") not in (None, rope):
            refuse("head_dim", hf["head_dim"], f"transformers' RoPE width for MLA, "
                                               f"qk_rope_head_dim={rope}")
        return {k: v for k, v in hf.items() if k != "head_dim"}

    def fields(self, hf: Dict[str, Any], refuse: Refuse) -> Dict[str, Any]:
        d = self.defaults
        mla = {k: hf.get(k, d[k]) for k in MLA_KEYS}
        for key, value in mla.items():
            if value is None and key == "q_lora_rank":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                refuse(key, value, "config.json must give it as an integer >= 1")
        derived = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        if hf.get("qk_head_dim", derived) != derived:  # its class derives it; read by none
            refuse("qk_head_dim", hf["qk_head_dim"], f"qk_nope_head_dim + qk_rope_head_dim = "
                                                     f"{derived}")
        interleave = hf.get("rope_interleave", True)
        if not isinstance(interleave, bool):
            refuse("rope_interleave", interleave, "config.json must give it as a boolean")
        return {**self.fixed, "mla": MLAConfig(**mla, rope_interleave=interleave),
                "moe": self._moe(hf, refuse)}

    def _moe(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[MoEConfig]:
        d, n = self.defaults, hf["num_hidden_layers"]
        first = integer_field(hf, "first_k_dense_replace", d["first_k_dense_replace"],
                              refuse, low=0)
        if first >= n:  # every layer dense: the MoE keys compute nothing
            return None
        e, k = experts_and_top_k(hf, d, refuse, ("n_routed_experts", "num_local_experts"))
        f = integer_field(hf, "moe_intermediate_size", d["moe_intermediate_size"], refuse)
        shared = integer_field(hf, "n_shared_experts", d["n_shared_experts"], refuse, low=0)
        scale = hf.get("routed_scaling_factor", d["routed_scaling_factor"])
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
            refuse("routed_scaling_factor", scale, "config.json must give it as a number > 0")
        # DeepseekV2TopkRouter never normalises the top-k, whatever norm_topk_prob says
        norm = hf.get("norm_topk_prob", d["norm_topk_prob"]) if self.sigmoid else False
        if not isinstance(norm, bool):
            refuse("norm_topk_prob", norm, "config.json must give it as a boolean")
        groups = {key: hf.get(key, d.get(key)) or 1 for key in ("n_group", "topk_group")}
        if self.sigmoid:
            if e % groups["n_group"] or e // groups["n_group"] < 2:
                refuse("n_group", groups["n_group"], f"must divide n_routed_experts={e} into "
                                                     f"groups of >= 2")
            if groups["topk_group"] > groups["n_group"]:
                refuse("topk_group", groups["topk_group"],
                       f"must be <= n_group={groups['n_group']}")
        elif hf.get("topk_method", "greedy") != "greedy" and groups != dict(n_group=1,
                                                                             topk_group=1):
            refuse("topk_method", hf["topk_method"], "DeepSeek-V2's group-limited softmax "
                   "routing is not implemented by ctxpar (greedy is)")
        return MoEConfig(num_experts=e, top_k=k, expert_hidden=f, norm_topk=norm,
                         layers=None if first == 0 else list(range(first, n)),
                         shared_expert_hidden=shared * f, shared_expert_gate=False,
                         routed_scaling_factor=float(scale),
                         score="sigmoid" if self.sigmoid else "softmax",
                         score_correction_bias=self.sigmoid,
                         **(groups if self.sigmoid else {}))

    def export_layer_types(self, m, refuse_export) -> List[str]:
        if m.mla is None:
            refuse_export(f"model.mla=None ({self.label}'s attention is multi-head latent "
                          f"attention)")
        return super().export_layer_types(m, refuse_export)

    def check_windows(self, m, types: List[str], refuse_export) -> None:
        if "sliding_attention" in types:
            refuse_export(f"model.sliding_window={m.sliding_window} ({self.label} has no "
                          f"window)")

    def config(self, cfg: Dict[str, Any], m, types: List[str],
               source: Optional[Dict[str, Any]], refuse_export) -> None:
        mla, moe = m.mla, m.moe
        cfg.pop("head_dim")  # transformers' class sets it (qk_rope_head_dim)
        cfg.update({k: getattr(mla, k) for k in MLA_KEYS}, attention_bias=False,
                   num_key_value_heads=m.n_heads)
        if self.sigmoid:
            cfg["rope_interleave"] = mla.rope_interleave
        elif not mla.rope_interleave:
            refuse_export("model.mla.rope_interleave=false (DeepSeek-V2's RoPE is "
                          "interleaved)")
        if moe is None:
            cfg.update(first_k_dense_replace=m.n_layers)
            return
        sparse = moe_layer_indices(moe, m.n_layers)
        first = sparse[0] if sparse else m.n_layers
        f = moe.expert_hidden or m.ffn_hidden
        if sparse != list(range(first, m.n_layers)) or moe.shared_expert_gate or \
                moe.shared_expert_hidden % f or moe.capacity_factor is not None:
            refuse_export(f"model.moe={moe} ({self.label}'s experts are on every layer from "
                          f"first_k_dense_replace on, its shared experts ungated, "
                          f"n_shared_experts x the experts' width, dropless)")
        if self.sigmoid and not moe.score_correction_bias:
            refuse_export(f"model.moe.score_correction_bias=false ({self.label}'s router "
                          f"chooses on scores + its correction bias)")
        cfg.update(first_k_dense_replace=first, n_routed_experts=moe.num_experts,
                   num_experts_per_tok=moe.top_k, moe_intermediate_size=f,
                   n_shared_experts=moe.shared_expert_hidden // f,
                   routed_scaling_factor=moe.routed_scaling_factor,
                   norm_topk_prob=moe.norm_topk, output_router_logits=False)
        if self.sigmoid:
            cfg.update(n_group=moe.n_group, topk_group=moe.topk_group)
        else:
            cfg.update(topk_method="greedy", n_group=None, topk_group=None)

    def left_out(self, key: str, hf: Dict[str, Any]) -> bool:
        """The multi-token prediction layers: blocks past num_hidden_layers."""
        layer = _LAYER.match(key)
        return layer is not None and int(layer.group(1)) >= hf.get("num_hidden_layers", 0)

    def mtp_moe_of(self, hf: Dict[str, Any], refuse: Refuse) -> Optional[MoEConfig]:
        return self._moe(hf, refuse)

    def folder_key(self, key: str) -> str:
        return key.replace(*SHARED) if SHARED[0] in key else key

    def to_folder(self, key: str, t: torch.Tensor, m) -> List[Tuple[str, torch.Tensor]]:
        return per_expert_tensors(self.folder_key(key), t, self.expert_naming)


class DeepSeekV3(DeepSeek):
    defaults = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3,
                    n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    n_group=8, topk_group=4)  # DeepseekV3Config's


class DeepSeekV2(DeepSeek):
    sigmoid = False
    defaults = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=0,
                    n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407,
                    n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
                    n_group=None, topk_group=None)  # DeepseekV2Config's


_FIXED = {k: v for k, v in ARCH_DEFAULTS.items() if k != "mla"}  # model.mla read here
_NEUTRAL = {"attention_bias": (False, "biases on MLA's projections are not built by ctxpar")}
_INERT = ("pretraining_tp",  # a slicing of the matmuls, the same product
          "output_router_logits",  # returns the logits, adds no loss
          *MTP_KEYS)  # read by the mtp hook where model.mtp asks (module docstring)
V3 = DeepSeekV3(
    "deepseek_v3", "DeepseekV3ForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    neutral=dict(_NEUTRAL), own=(*MLA_KEYS, "qk_head_dim", "rope_interleave", *MOE_KEYS), inert=_INERT,
    moe_fixed={"score": "sigmoid", "score_correction_bias": True, "shared_expert_gate": False,
               "aux_loss_coef": 0.0},
    moe_optional=True, expert_naming="qwen")
V2 = DeepSeekV2(
    "deepseek_v2", "DeepseekV2ForCausalLM", dict(_FIXED), ("hidden_act", "silu"),
    neutral={**_NEUTRAL, "mlp_bias": (False, "DeepSeek-V2's MLP biases are not built by "
                                             "ctxpar")},
    own=(*MLA_KEYS, "qk_head_dim", *MOE_KEYS, "topk_method"), inert=_INERT,
    moe_fixed={"score": "softmax", "score_correction_bias": False, "norm_topk": False,
               "shared_expert_gate": False, "aux_loss_coef": 0.0},
    moe_optional=True, expert_naming="qwen")
