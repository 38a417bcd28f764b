"""Tiny Hugging Face folders with multi-token prediction layers, as the released ones hold
them (transformers' save_pretrained writes none): a random causal LM of the family saved
by transformers, and transformers' generic MtpModel around it (its MtpLayer over the
family's own decoder layer, from config.get_mtp_config: an MoE layer for DeepSeek-V3 and
GLM-4.5) written under the family's names, its experts per expert as save_pretrained
writes a layer's.

    DeepSeek-V3, GLM-4.5   model.layers.{L + k}.{enorm, hnorm, eh_proj, <decoder layer>,
                           shared_head.norm, shared_head.head, embed_tokens}
    Qwen3.5, Qwen3-Next    mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm},
                           mtp.layers.0.<decoder layer> (Qwen3-Next's with its experts)
"""
import json

import torch

# The families' sizes: DeepSeek-V3's MLA (q through a rank-24 bottleneck, a latent of 16
# + a RoPE key of 8, value heads of 12), a dense first layer then 8 sigmoid-routed
# experts in 2 groups (1 taken) times 2.5 with a shared expert; GLM-4.5's q/k/v biases,
# q/k norms and half-RoPE before DeepSeek-V3's router (top 3 from its best group)
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
             first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=32,
             n_group=2, topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, num_experts_per_tok=2, n_shared_experts=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    "glm4_moe": ("Glm4MoeConfig", dict(
        num_key_value_heads=2, head_dim=24, num_experts_per_tok=3, n_shared_experts=2,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "partial_rotary_factor": 0.5})),
}


QWEN3_5 = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24,
               max_position_embeddings=128, rms_norm_eps=1e-5,
               layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6)
QWEN = {  # family -> (config class, decoder layer's module and class prefix, its own fields)
    "qwen3_5_text": ("Qwen3_5TextConfig", "qwen3_5", "Qwen3_5", {}),
    # 8 experts, top 2, a gated shared expert, on every layer (the MTP block's too)
    "qwen3_next": ("Qwen3NextConfig", "qwen3_next", "Qwen3Next", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=40)),
}
QWEN_NAMES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
              "post_norm": "norm"}


def _drawn(module, g, std):
    """Every weight of a module built outside a PreTrainedModel drawn (post_init leaves
    some experts' unset)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" not in name and not name.endswith("bias"):
                p.normal_(0.0, std, generator=g)


def qwen_mtp_folder(path, family="qwen3_5_text", **overrides):
    """A random Qwen3.5 or Qwen3-Next saved by transformers, plus the mtp.* tensors of a
    released folder: transformers' generic MtpLayer around the family's full-attention
    decoder layer, under Qwen's names. Returns (the causal LM, the MtpLayer)."""
    import importlib

    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpLayer

    from ctxpar.checkpoint.families.experts import per_expert_tensors

    config_class, module, prefix, own = QWEN[family]
    classes = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config_class = getattr(transformers, config_class)
    torch.manual_seed(0)
    fields = {**QWEN3_5, **own, **overrides}
    cfg = config_class(**fields, tie_word_embeddings=False)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    mtp_cfg = config_class(**{**fields, "num_hidden_layers": 1,
                              "layer_types": ["full_attention"]})
    mtp_cfg._attn_implementation = "sdpa"  # causal when given no mask, as the main model's
    layer = MtpLayer(mtp_cfg, getattr(classes, f"{prefix}DecoderLayer"),
                     getattr(classes, f"{prefix}RMSNorm"), 0).float().eval()
    g = torch.Generator().manual_seed(3)
    _drawn(layer, g, cfg.initializer_range)
    _moved(ref, g)
    _moved(layer, g)
    ref.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name, t in layer.state_dict().items():
        head, _, rest = name.partition(".")
        key = f"mtp.layers.0.{rest}" if head == "mtp_block" else \
            f"mtp.{QWEN_NAMES[head]}.{rest}"
        for k, part in per_expert_tensors(key, t, "qwen"):
            tensors[k] = part.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    return ref, layer


def _moved(model, g):
    """Norm weights, biases and the routers' correction biases away from their init, so
    that a dropped one changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.3 * torch.randn(b.shape, generator=g))


def add_numbered_mtp_layer(path, ref):
    """transformers' MtpModel around the causal LM `ref` saved in path, its MTP layer
    written into the folder at model.layers.{L}.* (the module docstring) and
    num_nextn_predict_layers 1; returns the MtpModel."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    from ctxpar.checkpoint.families.experts import per_expert_tensors

    ref.config._attn_implementation = "sdpa"  # causal without a mask, in the MtpModel too
    mtp = MtpModel(ref, 1).float().eval()
    g = torch.Generator().manual_seed(4)
    _drawn(mtp.layers, g, ref.config.initializer_range)
    _moved(mtp.layers, g)
    tensors, n = load_file(path / "model.safetensors"), ref.config.num_hidden_layers
    layer = f"model.layers.{n}."
    for name, t in mtp.layers[0].state_dict().items():
        head, _, rest = name.partition(".")
        key = layer + ({"mtp_block": rest, "post_norm": f"shared_head.norm.{rest}"}.get(
            head) or name)
        for k, part in per_expert_tensors(key, t, "qwen"):
            tensors[k] = part.contiguous()
    tensors[layer + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[layer + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return mtp


def numbered_mtp_folder(path, family, **overrides):
    """A DeepSeek-V3 or GLM-4.5 folder with its MTP layer at model.layers.{L}.* (the
    module docstring); returns (the causal LM, transformers' MtpModel)."""
    import transformers

    torch.manual_seed(0)
    config_class, own = FAMILIES[family]
    cfg = getattr(transformers, config_class)(**{**SMALL, **own, **overrides},
                                             tie_word_embeddings=False)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    _moved(ref, torch.Generator().manual_seed(3))
    ref.save_pretrained(path)
    return ref, add_numbered_mtp_layer(path, ref)


def mtp_depth1_loss(ref, mtp, x, y):
    """Depth 1's token-mean CE on a batch (x, y = next tokens, -100 ignored) by
    transformers' causal LM and MtpModel: position i's logits for t_{i+2} (ctxpar's
    targets, ctxpar/data/mtp.py, without documents)."""
    from ctxpar.data.mtp import mtp_inputs
    ids, targets = mtp_inputs(x, y, 1)
    pos = torch.arange(1, x.shape[1] + 1)[None]
    with torch.no_grad():
        h = ref.model(x).last_hidden_state
        logits = mtp._project_to_logits(mtp.forward_layer(0, h, pos, None, input_ids=ids[:, 0]))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 0].flatten())
