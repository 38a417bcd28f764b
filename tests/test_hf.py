"""Hugging Face exchange (Llama, Qwen2, Qwen3, Mistral, Gemma 3), checked against
transformers itself (test dependency, CPU).

(1) In process: ctxpar's RoPE frequencies (plain, linear, Llama 3.1, YaRN with its
attention factor) equal transformers'; a tiny random model of each family built here (no
downloads; GQA, head_dim != hidden/heads, norm weights and biases drawn away from their
defaults) imported into ctxpar's GPT gives its logits; GPT -> folder -> transformers gives
GPT's logits; folder -> ctxpar -> folder returns the same tensors bit for bit; what ctxpar
cannot represent (config fields, tensors, shards, dtypes) is refused naming it.
(2) train.py: runs started from a folder (model.init_from) log, at step 1, the loss
transformers computes on the same global batch: a Llama and a Qwen2 folder at tp2·cp2, a
Gemma 3 folder with a sliding layer at cp2·pp2 (ring, zigzag), a Qwen3 folder with a
sliding layer extended to twice its positions with YaRN at cp2 Ulysses (the CPU demo of
an extension: generate.py answers from it as transformers does); each run's checkpoint
exported by tools/convert_checkpoint.py (with the run's tokenizer) is the same model in
transformers, and the Llama one imports back to the same parameters; a folder ctxpar
cannot represent ends train.py with exit 2 and one line.
"""
import json
import re
from dataclasses import asdict, is_dataclass, replace
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")  # the dev extra; not a runtime dependency
from transformers import (AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config,  # noqa: E402
                          DeepseekV3Config, DeepseekV4Config, DeepseekV32Config, GlmMoeDsaConfig,
                          Gemma3TextConfig, Gemma4TextConfig,
                          Glm4MoeConfig, GptOssConfig, KimiLinearConfig,
                          Llama4TextConfig, LlamaConfig, LlamaForCausalLM, MiMoV2FlashConfig,
                          MiniMaxM2Config,
                          MistralConfig, MixtralConfig, NemotronHConfig, OlmoHybridConfig,
                          Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
                          Qwen3NextConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig)

from ctxpar.checkpoint import CheckpointError, export, hf, read_manifest  # noqa: E402
from ctxpar.checkpoint.families import FAMILIES  # noqa: E402
from ctxpar.checkpoint.universal import full_weights, load_buffers_, to_universal  # noqa: E402
from ctxpar.checkpoint.weights import copy_full_weights_, resolve_checkpoint  # noqa: E402
from ctxpar.config import ModelConfig  # noqa: E402
from ctxpar.config.moe import MoEConfig  # noqa: E402
from ctxpar.config.parameters import parameter_specs  # noqa: E402
from ctxpar.data import PasskeyTask  # noqa: E402
from ctxpar.distributed.parallel_state import free_port  # noqa: E402
from models.gpt import GPT  # noqa: E402
from models.rope import rope_inv_freq  # noqa: E402
from helpers.mtp_folders import add_numbered_mtp_layer, mtp_depth1_loss  # noqa: E402
from helpers.train_run import ROOT, metric, run_train  # noqa: E402
from helpers.warm_launch import run_warm  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# fp32 on both sides; the same math in another order (fused SDPA vs eager softmax, RoPE
# frequencies computed separately): logits agree to ~3e-7 relative; 1e-5 leaves margin.
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_llama(path, tied=True, rope_scaling=None, **overrides):
    """A random 2-layer GQA LlamaForCausalLM saved to path (built here, no downloads)."""
    torch.manual_seed(0)
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=5000.0, rms_norm_eps=1e-5)
    cfg = LlamaConfig(**{**fields, **overrides}, rope_scaling=rope_scaling,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return model


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
QWEN3_5_LAYERS = dict(layer_types=["linear_attention", "full_attention"],
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=6)
GEMMA4_TYPES = ["sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention"]
MLA_SMALL = dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                 first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 5000.0})
# The families at the size of the tests: GQA, head_dim 24 (not hidden/heads = 16), and
# each family's own fields (Mistral without a window; Gemma 3 with every layer full
# attention: its sliding layers arrive with model.layer_types).
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24,
             max_position_embeddings=128, rms_norm_eps=1e-5)
FAMILY_CONFIGS = {
    "llama": (LlamaConfig, dict(rope_theta=5000.0)),
    "qwen2": (Qwen2Config, dict(rope_theta=5000.0, rope_scaling=YARN)),
    "qwen3": (Qwen3Config, dict(rope_theta=5000.0)),
    "mistral": (MistralConfig, dict(rope_theta=5000.0, sliding_window=None)),
    "gemma3_text": (Gemma3TextConfig, dict(layer_types=["full_attention"] * 2,
                                           query_pre_attn_scalar=20)),
    # Gated DeltaNet then gated full attention with RoPE on a quarter of each head
    # (transformers' default); value heads twice the key heads, as Qwen3.5's
    "qwen3_5_text": (Qwen3_5TextConfig, dict(QWEN3_5_LAYERS)),
    # Mamba2, NoPE attention and squared-ReLU MLP blocks, one op each; two B/C groups
    "nemotron_h": (NemotronHConfig, dict(layers_block_type=["mamba", "attention", "mlp",
                                                            "mamba"],
                                         mamba_num_heads=4, mamba_head_dim=16,
                                         ssm_state_size=8, n_groups=2, chunk_size=16,
                                         layer_norm_epsilon=1e-5)),
    # Nemotron 3's mixture of experts: Mamba2, MoE, NoPE attention, MLP and MoE blocks;
    # 8 squared-ReLU experts in 2 groups, a token's top 2 from its best group, on sigmoid
    # scores + the correction bias (drawn away from 0), times 2.5; a shared expert
    "nemotron_h_moe": (NemotronHConfig, dict(layers_block_type=["mamba", "moe", "attention",
                                                                "mlp", "moe"],
                                             mamba_num_heads=4, mamba_head_dim=16,
                                             ssm_state_size=8, n_groups=2, chunk_size=16,
                                             n_routed_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=32,
                                             moe_shared_expert_intermediate_size=40,
                                             n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5)),
    # Gated DeltaNet (separate q/k/v projections and convs, beta in [0, 2]) then a post-norm
    # attention layer with q/k norms over all heads; no token ids (its defaults are
    # outside the tiny vocabulary)
    "olmo_hybrid": (OlmoHybridConfig, dict(layer_types=["linear_attention", "full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=8, linear_value_head_dim=6,
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 5000.0},
                                           pad_token_id=None, eos_token_id=None)),
    # Mixtures of experts: 8 experts (more than the runs' ranks), top 2 or 3, dense layers
    # between (Qwen3-MoE's mlp_only_layers) or around (Qwen2-MoE's decoder_sparse_step)
    # the MoE ones, transformers' load-balancing loss on (output_router_logits)
    "qwen3_moe": (Qwen3MoeConfig, dict(num_hidden_layers=3, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       norm_topk_prob=True, mlp_only_layers=[1],
                                       output_router_logits=True, router_aux_loss_coef=0.02)),
    "qwen2_moe": (Qwen2MoeConfig, dict(num_hidden_layers=3, num_experts=8,
                                       num_experts_per_tok=3, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=40,
                                       decoder_sparse_step=2, output_router_logits=True,
                                       router_aux_loss_coef=0.02)),
    "mixtral": (MixtralConfig, dict(num_local_experts=8, num_experts_per_tok=2,
                                    output_router_logits=True, router_aux_loss_coef=0.02)),
    # gpt-oss: a sliding (7) and a full layer, sinks, q/k/v/o biases, YaRN without
    # truncation, router and expert biases, the clamped SwiGLU at a limit the tiny
    # weights reach (0.3)
    "gpt_oss": (GptOssConfig, dict(num_local_experts=8, num_experts_per_tok=3,
                                   intermediate_size=32, swiglu_limit=0.3, sliding_window=7,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={**YARN, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False,
                                                    "rope_theta": 150000.0},
                                   output_router_logits=True, router_aux_loss_coef=0.02)),
    # Qwen3.5's layers with 8 experts and a gated shared expert (Qwen3-Next's Gated
    # DeltaNet projections fused by key head); Qwen3.5-MoE's intermediate_size is
    # written (SMALL's) and read by nothing
    "qwen3_next": (Qwen3NextConfig, dict(**QWEN3_5_LAYERS, num_experts=8,
                                         num_experts_per_tok=3, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=40,
                                         output_router_logits=True,
                                         router_aux_loss_coef=0.02)),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, dict(**QWEN3_5_LAYERS, num_experts=8,
                                                    num_experts_per_tok=2,
                                                    moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=40,
                                                    output_router_logits=True,
                                                    router_aux_loss_coef=0.02)),
    # DeepSeek-V3: multi-head latent attention (q through its rank-24 bottleneck, a latent
    # of 16 + a shared RoPE key of 8, value heads of 12 != the qk heads' 16, interleaved
    # RoPE) and a dense first layer before two of 8 sigmoid-routed experts with the
    # correction bias in 2 groups (1 taken), times 2.5, a shared expert; head_dim is
    # transformers' RoPE width
    "deepseek_v3": (DeepseekV3Config, dict(MLA_SMALL, q_lora_rank=24, n_group=2,
                                           topk_group=1, routed_scaling_factor=2.5,
                                           n_shared_experts=1)),
    # DeepSeek-V2(-Lite): q_proj, the softmax router unnormalised times 2, two shared experts
    "deepseek_v2": (DeepseekV2Config, dict(MLA_SMALL, q_lora_rank=None,
                                           routed_scaling_factor=2.0, n_shared_experts=2)),
    # DeepSeek-V3.2: V3's MLA and experts with the lightning indexer (16 heads of 16, RoPE
    # half-split on their first 8 channels), each query's top 12 of the tests' tokens;
    # 16 heads so that no k-th score is an exact tie (every head's ReLU 0: the passkey
    # rows at 8 heads had one), whose order torch.topk leaves undocumented (ctxpar: the
    # lower position)
    "deepseek_v32": (DeepseekV32Config, dict(MLA_SMALL, q_lora_rank=24, n_group=2,
                                             topk_group=1, index_n_heads=16,
                                             index_head_dim=16, index_topk=12)),
    # GLM-5: the same with the indexer's RoPE on interleaved pairs and layer 1 'shared'
    # (it attends over layer 0's selection), one expert group
    "glm_moe_dsa": (GlmMoeDsaConfig, dict(MLA_SMALL, q_lora_rank=24, n_group=1,
                                          topk_group=1, index_n_heads=16, index_head_dim=16,
                                          index_topk=12,
                                          indexer_types=["full", "shared", "full"])),
    # GLM-4.5: a dense first layer then DeepSeek-V3's router (8 experts in 2 groups, a
    # token's top 3 from its best group, sigmoid scores + the correction bias, times 2.5)
    # with two shared experts' width; q/k/v biases, per-head q/k norms, RoPE on half of
    # each head (its class's default)
    "glm4_moe": (Glm4MoeConfig, dict(num_hidden_layers=3, first_k_dense_replace=1,
                                     n_routed_experts=8, num_experts_per_tok=3,
                                     moe_intermediate_size=32, n_shared_experts=2,
                                     n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                     norm_topk_prob=True, attention_bias=True,
                                     use_qk_norm=True, rope_theta=5000.0)),
    # MiniMax-M2: GQA 8/2 with q/k RMSNorm over all heads' projections, RoPE on half of
    # each head (rotary_dim), 8 experts on every layer, top 2 on sigmoid scores + the
    # correction bias; no token ids (its defaults are outside the tiny vocabulary)
    "minimax_m2": (MiniMaxM2Config, dict(num_attention_heads=8, num_local_experts=8,
                                         num_experts_per_tok=2, rotary_dim=12,
                                         rope_theta=5000.0, bos_token_id=None,
                                         eos_token_id=None)),
    # Llama 4: chunked RoPE layers (chunks of 16) with the weightless q/k norm, NoPE full
    # layers (1, 3) whose queries are scaled from position 8 on (floor_scale 8, attn_scale
    # 0.5: up to x1.97 at the tests' 48 tokens); the MoE on those layers, 8 experts, the
    # top 2 scaling their inputs, beside the shared expert; dense layers 96 wide
    "llama4_text": (Llama4TextConfig, dict(num_hidden_layers=4, intermediate_size=32,
                                           intermediate_size_mlp=96, num_local_experts=8,
                                           num_experts_per_tok=2, interleave_moe_layer_step=2,
                                           no_rope_layer_interval=2, attention_chunk_size=16,
                                           floor_scale=8, attn_scale=0.5, rope_theta=5000.0,
                                           bos_token_id=None, eos_token_id=None)),
    # MiMo-V2-Flash: a full layer then two sliding ones (window 7) with twice its K/V heads
    # (2 against 1) and sinks; q/k heads of 24, value heads of 16 scaled by 0.707; RoPE on
    # a third of each head (int(24 x 0.334) = 8), bases 5000 and 100 by type; q/k/v biases;
    # a dense layer then 8 sigmoid-routed experts in 2 groups (1 taken), top 3, times 2.5
    "mimo_v2_flash": (MiMoV2FlashConfig, dict(
        num_hidden_layers=3, num_key_value_heads=1, v_head_dim=16, sliding_window=7,
        attention_bias=True, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        rope_parameters={kind: {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": 0.334}
                         for kind, theta in (("full_attention", 5000.0),
                                             ("sliding_attention", 100.0))},
        bos_token_id=None, eos_token_id=None)),
    # Kimi Linear: three KDA layers (4 heads of 8, per-channel decay) then NoPE MLA (q_proj,
    # a latent of 16 + an unrotated shared key of 8, value heads of 12) as in its 3 : 1
    # pattern, given by linear_attn_config's 1-based lists as its folders give them; a
    # dense first layer, then 8 sigmoid-routed experts in 2 groups (1 taken), top 2, times
    # 2.5, a shared expert; no token ids (its defaults are outside the tiny vocabulary)
    "kimi_linear": (KimiLinearConfig, dict(
        num_hidden_layers=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=None, num_local_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, n_shared_experts=1,
        linear_attn_config=dict(num_heads=4, head_dim=8, short_conv_kernel_size=4,
                                kda_layers=[1, 2, 3], full_attn_layers=[4]),
        pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    # Gemma 4: full layers (1, 4) of head dim 32 and one kv head whose values are their
    # keys' projection, beside sliding layers (window 6) of head dim 24; layers 3 and 4
    # attend with layers 2's and 1's K/V; per-layer inputs 16 wide; proportional RoPE on a
    # quarter of the full layers' frequencies (transformers' default); logits capped at 2
    "gemma4_text": (Gemma4TextConfig, dict(num_hidden_layers=5, layer_types=GEMMA4_TYPES,
                                           sliding_window=6, global_head_dim=32,
                                           num_global_key_value_heads=1, attention_k_eq_v=True,
                                           num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                                           vocab_size_per_layer_input=96,
                                           final_logit_softcapping=2.0)),
    # DeepSeek-V4: a sliding, a CSA (entries of 4, an indexer of 2 heads of 16 keeping 3)
    # and an HCA layer (entries of 8), window 5, one K = V head; q through a bottleneck of
    # 16, output in 2 groups of 12; RoPE on half of each head, the compressed layers' base
    # apart; a hash-routed layer first, then sqrtsoftplus over 4 experts (2 a token) with
    # the correction bias, SwiGLU clamped at 0.5 (within the activations' reach); mHC of 2
    # streams
    "deepseek_v4": (DeepseekV4Config, dict(
        num_hidden_layers=3, num_key_value_heads=1, sliding_window=5,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        q_lora_rank=16, o_groups=2, o_lora_rank=12, index_n_heads=2, index_head_dim=16,
        index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2, swiglu_limit=0.5,
        rope_parameters={label: {"rope_type": "default", "rope_theta": theta,
                                 "partial_rotary_factor": 0.5}
                         for label, theta in (("main", 5000.0), ("compress", 80000.0))},
        bos_token_id=None, eos_token_id=None)),
}
# Gemma 4 with experts (26B-A4B's form): Gemma 4's layers above, four experts 24 wide
# beside each dense MLP, two per token, Gemma 4's router; the shared-KV layers' (3, 4)
# dense MLPs twice as wide (use_double_wide_mlp)
FAMILY_CONFIGS["gemma4_moe"] = (Gemma4TextConfig, dict(
    FAMILY_CONFIGS["gemma4_text"][1], enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=24, use_double_wide_mlp=True))


def tiny_family(path, family, tied, **overrides):
    """A random 2-layer model of a family saved to path, its norm weights and biases (the
    routers' correction biases too) moved away from their init (ones / zeros) so that a
    dropped one changes the logits."""
    torch.manual_seed(0)
    config_class, own = FAMILY_CONFIGS[family]
    cfg = config_class(**{**SMALL, **own, **overrides}, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "router.scale", "per_expert_scale")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if "indexer.q_b_proj" in name:  # V4's indexer heads in +/- pairs: of each
                heads = p.view(2, -1, p.shape[-1])  # pair one scores > 0, so no top-k ties
                heads[1] = -heads[0]
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "layer_scalar")):
                b.add_(0.3 * torch.randn(b.shape, generator=g))
            if name.endswith("tid2eid"):  # k distinct experts per token id (V4's hash layers)
                experts = cfg.n_routed_experts
                b.copy_(torch.rand(b.shape[0], experts, generator=g).topk(b.shape[1]).indices)
    model.save_pretrained(path)
    return model


def ctxpar_from(path):
    m = ModelConfig(**hf.model_fields(hf.read_config(path), path))
    reader = hf.WeightReader(path, m.tie_embeddings, hf.naming_of(m))
    reader.check(m)
    model = GPT(m).eval()
    copy_full_weights_(model, reader.get, None)
    load_buffers_(model.named_buffers(), reader.buffers(m))  # the routers' correction biases
    assert reader.unused() == []
    return model


def weights_of(model):
    """(GPT name, tensor) of what an export writes: the parameters, the routers' buffers."""
    buffers = set(hf.folder_buffers(model.cfg))
    return [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                         if n in buffers)]


@pytest.mark.quick
@pytest.mark.parametrize("scaling", [
    None, {"rope_type": "linear", "factor": 4.0}, LLAMA3, YARN,
    {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},  # Gemma 4
    {**LLAMA3, "factor": 16.0, "high_freq_factor": 1.0},  # Llama 4's: no blended band
    {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}, {**YARN, "attention_factor": 1.5}])
def test_rope_frequencies_equal_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from models.rope import rope_attention_factor
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5000.0,
                      rope_scaling=scaling, max_position_embeddings=128)
    kind = (scaling or {}).get("rope_type")
    if kind is None:
        want, factor = 1.0 / (5000.0 ** (torch.arange(0, 16, 2).float() / 16)), 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(16, 5000.0, scaling), want, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)


def assert_round_trip(ref, model, out, tokens):
    """model's logits equal ref's; its export reloads in transformers with the same logits
    and the same tensors as ref, bit for bit."""
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens, torch.arange(tokens.shape[1]))
        torch.testing.assert_close(got, want, **TOL)
        export.save_folder(out, weights_of(model), model.cfg)
        back = AutoModelForCausalLM.from_pretrained(out).float().eval()
        assert type(back) is type(ref)
        torch.testing.assert_close(back(tokens).logits, got, **TOL)
    a, b = ref.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tied,scaling", [(True, None), (False, LLAMA3)])
def test_import_export_match_transformers_logits(tmp_path, tied, scaling):
    ref = tiny_llama(tmp_path / "llama", tied, scaling)
    model = ctxpar_from(tmp_path / "llama")
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    assert_round_trip(ref, model, tmp_path / "out", tokens)


def rope(kind, theta=5000.0, **more):
    """rope_parameters of one kind at the tests' positions (48 tokens past 32 original)."""
    scaling = {"linear": {"factor": 4.0}, "yarn": YARN, "llama3": LLAMA3}.get(kind, {})
    return {**scaling, "rope_type": kind, "rope_theta": theta, **more}


# Each family's RoPE away from what FAMILY_CONFIGS gives it (its class's default, or the
# scaled one given there): gpt-oss's class default is YaRN, so rope_type default is the
# case an export in the classic keys turned into another model. Nemotron-H has no RoPE
# (NoPE attention): nothing to vary.
ROPE_VARIANTS = {
    "llama": dict(rope_parameters=rope("linear")),
    "qwen2": dict(rope_scaling=None, rope_parameters=rope("default")),
    "qwen3": dict(rope_parameters=rope("yarn", beta_fast=16.0, beta_slow=2.0)),
    "mistral": dict(rope_parameters=rope("llama3")),
    "gemma3_text": dict(  # RoPE per layer type: scaled full layers, their own sliding base
        layer_types=["sliding_attention", "full_attention"], sliding_window=6,
        rope_parameters={"full_attention": rope("linear", 1e6),
                         "sliding_attention": rope("default", 100.0)}),
    "qwen3_5_text": dict(rope_parameters=rope("yarn", partial_rotary_factor=0.5)),
    "olmo_hybrid": dict(rope_parameters=rope("linear")),
    "qwen3_moe": dict(rope_parameters=rope("yarn")),
    "qwen2_moe": dict(rope_parameters=rope("linear")),
    "mixtral": dict(rope_parameters=rope("llama3", 1e6)),
    "gpt_oss": dict(rope_parameters=rope("default", 150000.0)),
    "qwen3_next": dict(rope_parameters=rope("linear", partial_rotary_factor=0.25)),
    "qwen3_5_moe_text": dict(rope_parameters=rope("llama3", partial_rotary_factor=0.25)),
    # DeepSeek's YaRN: mscale / mscale_all_dim in the softmax scale and cos/sin; V3 also
    # without its q bottleneck and with rotate-half RoPE
    "deepseek_v3": dict(rope_parameters=rope("yarn", mscale=1.0, mscale_all_dim=0.707),
                        q_lora_rank=None, rope_interleave=False),
    "deepseek_v2": dict(rope_parameters=rope("yarn", mscale=0.707, mscale_all_dim=0.707)),
    "deepseek_v32": dict(rope_parameters=rope("yarn", mscale=1.0, mscale_all_dim=0.707),
                         index_topk=5),
    "glm_moe_dsa": dict(rope_parameters=rope("yarn", mscale=1.0, mscale_all_dim=0.707),
                        indexer_types=["full", "full", "shared"], first_k_dense_replace=0),
    "glm4_moe": dict(rope_parameters=rope("yarn", partial_rotary_factor=0.75),
                     use_qk_norm=False, norm_topk_prob=False, first_k_dense_replace=0),
    "minimax_m2": dict(rope_parameters=rope("llama3", 1e6), rotary_dim=24),
    "llama4_text": dict(rope_parameters=rope("llama3", 5e5), use_qk_norm=False,
                        attention_chunk_size=None, moe_layers=[0, 1, 2, 3]),
    # MiMo-V2-Flash: YaRN on the full layers, plain RoPE on the sliding ones, on half of
    # each head; every layer sparse, no value scale (null), the window as
    # sliding_window_size + 1
    "mimo_v2_flash": dict(rope_parameters={
        "full_attention": rope("yarn", partial_rotary_factor=0.5),
        "sliding_attention": rope("default", 300.0, partial_rotary_factor=0.5)},
        mlp_layer_types=["sparse"] * 3, attention_value_scale=None, sliding_window_size=5),
    # Kimi Linear turns nothing: its RoPE keys are inert (given here); instead its other
    # spellings: layer_types and mlp_layer_types given (an MLA layer first, a dense one
    # between sparse ones), q through its bottleneck, its class's 32 kv heads (read by none)
    "kimi_linear": dict(rope_parameters=rope("yarn"), q_lora_rank=24, num_key_value_heads=32,
                        layer_types=["full_attention"] + ["linear_attention"] * 3,
                        mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
    # DeepSeek-V4's flat form (legacy folders): rope_theta, compress_rope_theta and
    # partial_rotary_factor, nested by its class
    "deepseek_v4": dict(rope_parameters=None, rope_theta=300.0, compress_rope_theta=2e4,
                        partial_rotary_factor=0.25),
    "gemma4_text": dict(rope_parameters={  # half the frequencies, interpolated; scaled local
        "full_attention": rope("proportional", 5e5, partial_rotary_factor=0.5, factor=4.0),
        "sliding_attention": rope("linear", 100.0)}),
}
FAMILY_CASES = [("llama", False), ("qwen2", False), ("qwen3", True), ("mistral", False),
                ("gemma3_text", True), ("qwen3_5_text", False), ("nemotron_h", False),
                ("olmo_hybrid", False), ("qwen3_moe", False), ("qwen2_moe", True),
                ("mixtral", False), ("gpt_oss", False), ("nemotron_h_moe", False),
                ("qwen3_next", False), ("qwen3_5_moe_text", True), ("deepseek_v3", False),
                ("deepseek_v2", True), ("deepseek_v32", False), ("glm_moe_dsa", True),
                ("glm4_moe", False), ("minimax_m2", False),
                ("llama4_text", False), ("mimo_v2_flash", False), ("kimi_linear", False),
                ("gemma4_text", True), ("gemma4_moe", False), ("deepseek_v4", False)]


@pytest.mark.parametrize("family,tied,rope_variant", [
    *((f, t, False) for f, t in FAMILY_CASES),
    *((f, t, True) for f, t in FAMILY_CASES if f in ROPE_VARIANTS)])
def test_each_family_imports_and_exports_exactly(tmp_path, family, tied, rope_variant):
    """Each family with its RoPE as FAMILY_CONFIGS gives it and as ROPE_VARIANTS does: the
    export (which reads its config.json back through transformers' class) reloads with
    ctxpar's logits."""
    ref = tiny_family(tmp_path / family, family, tied,
                      **(ROPE_VARIANTS[family] if rope_variant else {}))
    model = ctxpar_from(tmp_path / family)
    model_type = FAMILY_CONFIGS[family][0].model_type
    assert model.cfg.family == model_type
    assert model.cfg.head_dim == (None if model.cfg.mla else 24)  # MLA: no head_dim
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    assert_round_trip(ref, model, tmp_path / "out", tokens)
    assert hf.read_config(tmp_path / "out")["model_type"] == model_type
    # the planner counts from the same description the model is checked against
    assert sum(s.numel() for s in parameter_specs(model.cfg)) == \
        sum(p.numel() for p in ref.parameters())



def _loss_tensor(logits, tokens):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))


def _loss(logits, tokens):
    return _loss_tensor(logits, tokens).item()


# What each 2026 family brought, as ctxpar's fields (model.* or model.moe.*) set back
NEW_FEATURES = {
    "glm4_moe": [{"partial_rotary_factor": 1.0}, {"qk_norm": False},
                 {"moe.routed_scaling_factor": 1.0}, {"moe.n_group": 1, "moe.topk_group": 1},
                 {"moe.shared_expert_hidden": 0}],
    "minimax_m2": [{"partial_rotary_factor": 1.0}, {"moe.score_correction_bias": False}],
    "llama4_text": [{"attn_temperature_tuning": False}, {"qk_l2_norm": False},
                    {"moe.scale_expert_input": False},
                    {"nope_layers": None, "attn_temperature_tuning": False},
                    "local positions"],
    # its unequal head dims and per-type K/V heads cannot be dropped from the same weights:
    # their shapes stop the load (check_parameters)
    "mimo_v2_flash": [{"attention_value_scale": 1.0}, {"attention_sinks": False},
                      {"partial_rotary_factor": 1.0}, {"layer_rope": None},
                      {"moe.n_group": 1, "moe.topk_group": 1}],
    # MLA without RoPE (turned on at base 100, so that the tiny model's 8 rope channels
    # turn within 48 tokens: at 10000 the loss moves 14x the tolerance), the router's
    # scale, groups and correction bias, the shared expert
    "kimi_linear": [{"rope": True, "rope_theta": 100.0}, {"moe.routed_scaling_factor": 1.0},
                    {"moe.n_group": 1, "moe.topk_group": 1},
                    {"moe.score_correction_bias": False}, {"moe.shared_expert_hidden": 0}],
    "gemma4_text": [{"attention_k_eq_v": False}, {"num_kv_shared_layers": 0},
                    {"value_norm": False}, {"per_layer_input_dim": 0}, {"layer_scalar": False},
                    {"rope_scaling": None}, {"query_pre_attn_scalar": 24.0},
                    {"final_logit_softcapping": None}],
    # Gemma 4's router scales (its experts beside the MLP and the double-wide MLPs change
    # the weights' shapes: test_gemma4s_experts_and_wide_mlps_move_transformers_loss)
    "gemma4_moe": [{"moe.scaled_router": False}],
    # the indexer's selection (dense MLA instead), GLM-5's pairs in its RoPE and its
    # shared layer (an indexer of its own)
    "deepseek_v32": [{"dsa": None}, {"dsa.index_topk": 48}],
    "glm_moe_dsa": [{"dsa.rope_interleave": False}, {"dsa.indexer_types": None}],
}


@pytest.mark.parametrize("family", list(NEW_FEATURES))
def test_what_each_new_family_adds_moves_the_loss_past_the_runs_tolerance(
        tmp_path, monkeypatch, family):
    """Each feature the 2026 families brought, dropped from ctxpar's imported model (the
    same weights, drawn at std 0.1 so that the tiny model's logits are not near-uniform),
    moves the loss on the tests' 48 tokens by over 50x the folder runs' 1e-5: those runs
    and the round trips would see it dropped. 'local positions': the NoPE layers'
    temperature from each half's own arange (what a cp2 rank computing from its local
    positions would use) instead of the global ones."""
    import models.rope
    ref = tiny_family(tmp_path / family, family, tied=False, initializer_range=0.1)
    model = ctxpar_from(tmp_path / family)
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    global_temperature = models.rope.query_temperature
    with torch.no_grad():
        want = _loss(ref(tokens).logits, tokens)
        assert abs(_loss(model(tokens, torch.arange(48)), tokens) - want) <= 1e-5 * want
        for change in NEW_FEATURES[family]:
            if change == "local positions":
                monkeypatch.setattr(models.rope, "query_temperature", lambda p, floor, scale:
                                    global_temperature(p % 24, floor, scale))
                changed = model
            else:
                top = {k: v for k, v in change.items() if not k.startswith(("moe.", "dsa."))}
                moe = {k[4:]: v for k, v in change.items() if k.startswith("moe.")}
                dsa = {k[4:]: v for k, v in change.items() if k.startswith("dsa.")}
                cfg = replace(model.cfg, **top, **(
                    {"moe": replace(model.cfg.moe, **moe)} if moe else {}), **(
                    {"dsa": replace(model.cfg.dsa, **dsa)} if dsa else {}))
                changed = GPT(cfg).eval()
                changed.load_state_dict(model.state_dict(), strict=False)
            got = _loss(changed(tokens, torch.arange(48)), tokens)
            assert abs(got - want) > 50 * 1e-5 * want, (change, got, want)


def test_gemma4s_experts_and_wide_mlps_move_transformers_loss(tmp_path):
    """What Gemma 4's MoE folder has that NEW_FEATURES cannot drop from ctxpar's weights
    (their shapes), dropped in transformers' own model instead: the experts' branch, each
    of its three norms, the router's per-expert scale, the shared-KV layers' second half
    of their double-wide MLPs. Each moves the loss by over 50x the folder runs' 1e-5, so
    the import's equality (test_each_family_imports_and_exports_exactly) sees each."""
    ref = tiny_family(tmp_path / "g", "gemma4_moe", tied=False, initializer_range=0.1)
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    half = ref.config.intermediate_size
    changes = {"experts": lambda n, p: p.zero_() if n.endswith("experts.down_proj") else None,
               "wide": lambda n, p: p[half:].zero_() if n.endswith(
                   ("layers.3.mlp.gate_proj.weight", "layers.4.mlp.gate_proj.weight")) else None,
               **{k: (lambda k: lambda n, p: p.fill_(1.0) if n.endswith(k) else None)(k)
                  for k in ("per_expert_scale", "post_feedforward_layernorm_1.weight",
                            "pre_feedforward_layernorm_2.weight",
                            "post_feedforward_layernorm_2.weight")}}
    with torch.no_grad():
        want = _loss(ref(tokens).logits, tokens)
        for what, change in changes.items():
            changed = AutoModelForCausalLM.from_pretrained(tmp_path / "g").float().eval()
            for name, p in changed.named_parameters():
                change(name, p)
            got = _loss(changed(tokens).logits, tokens)
            assert abs(got - want) > 50 * 1e-5 * want, (what, got, want)


def test_gemma4_moe_gradients_equal_transformers(tmp_path):
    """Gemma 4 with experts: every parameter's gradient of the mean loss equals
    transformers' (the router's input, the block's x, carries its gradient into the
    layers below; the experts' packed tensors, the router's scales, the three norms), fp32
    to 1e-5 of each tensor's own scale, the two embeddings but their padding row
    (transformers' padding_idx keeps pad_token_id's row without a gradient; ctxpar trains
    it). 24 tokens: at 48 this tiny model's gradients move by ~4e-5 of their scale for
    one-ulp changes of its inputs (its logits are test_each_family_imports_and_exports_
    exactly's)."""
    from ctxpar.checkpoint.names import to_hf
    ref = tiny_family(tmp_path / "g", "gemma4_moe", tied=False)
    model = ctxpar_from(tmp_path / "g")
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    ref.train(), model.train()
    for logits in (ref(tokens).logits, model(tokens, torch.arange(24))):
        _loss_tensor(logits, tokens).backward()
    theirs, pad = dict(ref.named_parameters()), ref.config.pad_token_id
    for name, p in model.named_parameters():
        got, want = p.grad, theirs[to_hf(name, "gemma4_moe")].grad
        if name.endswith("embed.weight"):  # every row but the padding one
            got, want = (torch.cat([g[:pad], g[pad + 1:]]) for g in (got, want))
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_an_export_transformers_would_read_as_another_model_is_refused_whole(
        tmp_path, monkeypatch):
    """The classic keys again (rope_theta, rope_scaling: null) on a gpt-oss model with
    plain RoPE: transformers' GptOssConfig reads YaRN, so the export stops in one line
    naming the field and both values, and writes nothing (out_dir absent, no partial
    folder beside it). ctxpar's own importer, the reader without transformers, reads the
    correct export as the model too."""
    from ctxpar.checkpoint import export_check
    tiny_family(tmp_path / "f", "gpt_oss", False, **ROPE_VARIANTS["gpt_oss"])
    model = ctxpar_from(tmp_path / "f")
    assert model.cfg.rope_scaling is None
    monkeypatch.setattr(hf, "rope_keys", lambda theta, scaling: {"rope_theta": theta,
                                                                 "rope_scaling": scaling})
    out = tmp_path / "exports" / "out"
    with pytest.raises(export_check.ExportMismatch) as e:
        export.save_folder(str(out), weights_of(model), model.cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{out}/config.json: model.rope_scaling: the "
                                                "export means None, transformers")
    assert "'rope_type': 'yarn', 'factor': 32.0" in line
    assert os.listdir(tmp_path / "exports") == []
    with pytest.raises(CheckpointError, match="model.rope_scaling: the export means None"):
        export_check.check_exportable(model.cfg)  # train.py's start-up form of the check
    monkeypatch.undo()
    export.save_folder(str(out), weights_of(model), model.cfg)
    monkeypatch.setattr(export_check, "transformers_reading", lambda folder: None)
    assert export_check.check_config(str(out), model.cfg) == "ctxpar's importer"


# Each family's attention kinds: windows that divide nothing (48 tokens), mixed layers, and
# Gemma 3's sliding layers with their own RoPE base.
WINDOWED = {
    "mistral": dict(sliding_window=7),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=9,
                  layer_types=["sliding_attention", "full_attention"]),
    "mixtral": dict(sliding_window=7),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=5),
    "gemma3_text": dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "default",
                                                            "rope_theta": 1e6}}),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_families_import_and_export_exactly(tmp_path, family):
    ref = tiny_family(tmp_path / family, family, tied=family != "mistral", **WINDOWED[family])
    model = ctxpar_from(tmp_path / family)
    m = model.cfg
    want = {"mistral": (["sliding_attention"] * 2, 7), "mixtral": (
        ["sliding_attention"] * 2, 7), "qwen3_moe": (["sliding_attention"] * 3, 5), "qwen2": (
        ["full_attention", "sliding_attention"], 5), "qwen3": (
        ["sliding_attention", "full_attention"], 9), "gemma3_text": (
        ["sliding_attention", "full_attention"], 6)}[family]
    assert ([a.kind for a in model.layer_attention], m.sliding_window) == want
    if family == "gemma3_text":
        assert [a.rope_theta for a in model.layer_attention] == [100.0, 1e6]
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    assert_round_trip(ref, model, tmp_path / "out", tokens)


def test_attention_kinds_no_family_holds_are_refused_at_export():
    base = dict(vocab_size=96, d_model=64, n_heads=4, n_layers=2)
    for m, msg in [
        (ModelConfig(**base, attention_sinks=True), "model.attention_sinks=true"),
        (ModelConfig(**base, attention_chunk_size=8), "(chunked attention)"),
        (ModelConfig(**base, sliding_window=8, family="llama"), "Llama has no window"),
        (ModelConfig(**base, sliding_window=8, family="mistral",
                     layer_types=["sliding_attention", "full_attention"]),
         "Mistral's window is on every layer or none"),
        (ModelConfig(**base, sliding_window=8, family="qwen2", attention_bias=True,
                     layer_rope={"sliding_attention": {"rope_theta": 10.0}}),
         "Gemma 3's sliding layers only"),
        (ModelConfig(**base, family="qwen3", qk_norm=True,
                     layer_types=["linear_attention", "full_attention"]),
         "model.layer_types with ['linear_attention'] layers"),
        (ModelConfig(**base, layer_types=["mamba", "mlp"]),
         "model.layer_types with ['mamba', 'mlp'] layers"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            hf.family_config(m)


@pytest.mark.parametrize("family,tensor", [("qwen2", "model.layers.0.self_attn.k_proj.bias"),
                                           ("qwen3", "model.layers.0.self_attn.k_norm.weight")])
def test_a_folder_relabelled_llama_is_refused(tmp_path, family, tensor):
    """The usual workaround (model_type: llama) would drop Qwen's biases or q/k norms: its
    family's own config fields are refused, and without them its tensors are."""
    tiny_family(tmp_path, family, tied=False, head_dim=16)
    config = hf.read_config(tmp_path)
    relabelled = {**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(relabelled))
    with pytest.raises(CheckpointError, match=r"a config field ctxpar does not know for "
                                              r"model_type 'llama'"):
        hf.model_fields(hf.read_config(tmp_path), str(tmp_path))
    for key in ("use_sliding_window", "max_window_layers", "layer_types", "sliding_window",
                "attention_bias"):
        relabelled.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(relabelled))
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    with pytest.raises(CheckpointError, match=rf"tensor '{tensor}' and \d+ more would not be "
                                              rf"used by ctxpar"):
        hf.WeightReader(str(tmp_path), m.tie_embeddings).check(m)


SHARED_GATED = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")  # a gated shared expert


def family_json(family, **fields):
    """config.json of a small model of a family, as ctxpar exports it, fields changed."""
    moe = None if FAMILIES[family].moe_optional else FAMILIES[family].moe_fixed
    m = ModelConfig(vocab_size=96, d_model=64, n_heads=4, family=family,
                    **{k: v for k, v in FAMILIES[family].fixed.items()},
                    **({} if moe is None else {"moe": MoEConfig(num_experts=8, **moe, **(
                        {"shared_expert_hidden": 32} if family in SHARED_GATED else
                        {"swiglu_limit": 7.0} if family == "gpt_oss" else
                        {"expert_hidden": 32, "shared_expert_hidden": 32, "layers": [1]}
                        if family == "glm4_moe" else {}))}),
                    **({"n_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
                       if family in ("qwen3_5_text", "olmo_hybrid", *SHARED_GATED[1:])
                       else {"n_layers": 2} if family == "glm4_moe" else {}),
                    **({"n_layers": 2, "layer_types": ["mamba", "attention"]}
                       if family == "nemotron_h" else {}))
    return {**hf.family_config(m), **fields}


@pytest.mark.parametrize("family,field,value,msg", [
    ("llama", "model_type", "phi3", "model_type='phi3': ctxpar imports llama, qwen2, qwen3, "
                                    "mistral, gemma3_text"),
    ("llama", "attention_bias", True, "attention_bias=True: with mlp_bias=False: ctxpar's "
                                      "model.bias puts biases on every linear layer"),
    ("llama", "hidden_act", "gelu", "hidden_act='gelu': LlamaForCausalLM's MLP in ctxpar "
                                    "uses silu"),
    ("llama", "rope_scaling", {"rope_type": "longrope", "factor": 4.0},
     "rope_scaling.rope_type='longrope' is not implemented by ctxpar"),
    ("llama", "partial_rotary_factor", 0.5, "partial_rotary_factor=0.5: the families ctxpar "
                                            "imports rotate every channel"),
    ("llama", "some_new_field", 1, "some_new_field=1: a config field ctxpar does not know "
                                   "for model_type 'llama'"),
    ("qwen2", "num_experts", 8, "num_experts=8: mixture of experts is not implemented"),
    ("qwen2", "layer_types", ["full_attention", "chunked_attention"], "layer_types=["
     "'full_attention', 'chunked_attention']: one of 'full_attention', 'sliding_attention' "
     "per layer (2)"),
    ("qwen3", "attention_bias", True, "attention_bias=True: ctxpar has q/k/v biases without "
                                      "o_proj's"),
    ("qwen3", "sliding_window", 0, "sliding_window=0: the sliding layers need a window of "
                                   ">= 1 tokens"),
    ("gemma3_text", "sliding_window", None, "sliding_window=None: the sliding layers need a "
                                            "window of >= 1 tokens"),
    ("gemma3_text", "final_logit_softcapping", 30.0, "final_logit_softcapping=30.0: logit "
                                                     "softcapping is not implemented"),
    ("gemma3_text", "architectures", ["Gemma3ForConditionalGeneration"],
     "architectures=['Gemma3ForConditionalGeneration']: ctxpar imports Gemma3ForCausalLM"),
    ("nemotron_h", "layers_block_type", ["mamba", "conv"], "layers_block_type=['mamba', "
     "'conv']: ['conv'] blocks are not implemented by ctxpar"),
    ("nemotron_h", "hybrid_override_pattern", "M*-EX", "['X'] blocks are not implemented"),
    # its MoE blocks ('E' here): what ctxpar's MoE does not have, and their sizes
    ("nemotron_h", "moe_latent_size", 16, "moe_latent_size=16: a latent projection around "
                                          "the experts is not implemented by ctxpar"),
    ("nemotron_h", "n_group", 3, "n_group=3: must divide n_routed_experts=8 into groups"),
    ("nemotron_h", "num_experts_per_tok", 5, "num_experts_per_tok=5: more than "
                                             "n_routed_experts=4"),
    ("nemotron_h", "num_local_experts", 6, "num_local_experts=6: n_routed_experts=4 names "
                                           "the same count"),
    ("nemotron_h", "moe_shared_expert_intermediate_size", 0,
     "moe_shared_expert_intermediate_size=0: config.json must give it as an integer >= 1"),
    ("nemotron_h", "num_nextn_predict_layers", 1, "num_nextn_predict_layers=1: multi-token "
                                                  "prediction layers"),
    ("nemotron_h", "residual_in_fp32", True, "residual_in_fp32=True: ctxpar adds the "
                                             "residual in the activations' dtype"),
    ("nemotron_h", "mlp_hidden_act", "silu", "mlp_hidden_act='silu': NemotronHForCausalLM's "
                                             "MLP in ctxpar uses relu2"),
    ("qwen3_5_text", "layer_types", ["linear_attention", "sliding_attention"],
     "layer_types=['linear_attention', 'sliding_attention']: one of 'linear_attention', "
     "'full_attention' per layer (2)"),
    ("qwen3_5_text", "linear_num_value_heads", 0, "linear_num_value_heads=0: config.json "
                                                  "must give it as an integer >= 1"),
    ("qwen3_5_text", "num_experts", 4, "num_experts=4: mixture of experts is not implemented"),
    # a Qwen3.5 folder relabelled Qwen3: its architecture, and without it its Gated
    # DeltaNet fields (unknown to qwen3)
    ("qwen3_5_text", "model_type", "qwen3", "architectures=['Qwen3_5ForCausalLM']: ctxpar "
                                           "imports Qwen3ForCausalLM"),
    ("qwen3_5_text", "model_type", "qwen3", "linear_conv_kernel_dim=4: a config field ctxpar "
                                           "does not know for model_type 'qwen3'"),
    # an OLMo Hybrid folder relabelled Qwen3.5: its architecture, and without it beta's range
    ("olmo_hybrid", "model_type", "qwen3_5_text", "architectures=['OlmoHybridForCausalLM']: "
                                                  "ctxpar imports Qwen3_5ForCausalLM"),
    ("olmo_hybrid", "model_type", "qwen3_5_text", "linear_allow_neg_eigval=False: a config "
                                                  "field ctxpar does not know for model_type "
                                                  "'qwen3_5_text'"),
    ("olmo_hybrid", "layer_types", ["linear_attention", "linear_attention"], "layer_types=["
     "'linear_attention', 'linear_attention']: one of 'linear_attention', 'full_attention' "
     "per layer (2), each kind at least once"),
    ("olmo_hybrid", "attention_bias", True, "attention_bias=True: ctxpar has q/k/v biases "
                                            "without o_proj's"),
    ("olmo_hybrid", "linear_allow_neg_eigval", 1, "linear_allow_neg_eigval=1: config.json "
                                                  "must give it as true or false"),
    # mixtures of experts: relabelled dense (its architecture; without it, its experts),
    # and what their MoE layers in ctxpar do not have
    ("qwen3_moe", "model_type", "qwen3", "architectures=['Qwen3MoeForCausalLM']: ctxpar "
                                        "imports Qwen3ForCausalLM"),
    ("mixtral", "model_type", "mistral", "num_experts_per_tok=2: mixture of experts is not "
                                         "implemented by ctxpar"),
    ("qwen3_moe", "attention_bias", True, "attention_bias=True: Qwen3-MoE's biases are on "
                                          "o_proj too"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok=9: more than "
                                            "num_experts=8"),
    ("qwen3_moe", "mlp_only_layers", "all", "mlp_only_layers='all': a list of layer indices"),
    ("qwen3_moe", "n_shared_experts", 1, "n_shared_experts=1: a config field ctxpar does not "
                                         "know for model_type 'qwen3_moe'"),
    ("qwen2_moe", "use_sliding_window", True, "use_sliding_window=True: Qwen2-MoE's sliding "
                                              "layers"),
    ("qwen2_moe", "num_local_experts", 4, "num_local_experts=4: num_experts=8 names the same "
                                          "count"),
    ("qwen2_moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0: "
                                                        "config.json must give it as an "
                                                        "integer >= 1"),
    ("mixtral", "router_jitter_noise", 0.1, "router_jitter_noise=0.1: ctxpar's router "
                                            "multiplies no noise"),
    ("mixtral", "quantization_config", {"quant_method": "fp8"}, "quantization_config="
     "{'quant_method': 'fp8'}: quantized weights is not implemented"),
    ("gpt_oss", "attention_bias", False, "attention_bias=False: ctxpar's gpt-oss has biases "
                                         "on q/k/v/o"),
    ("gpt_oss", "swiglu_limit", 0, "swiglu_limit=0: config.json must give it as a number > 0"),
    # Qwen3-Next relabelled Qwen3.5 (its architecture; without it, its experts)
    ("qwen3_next", "model_type", "qwen3_5_text", "architectures=['Qwen3NextForCausalLM']: "
                                                 "ctxpar imports Qwen3_5ForCausalLM"),
    ("qwen3_next", "model_type", "qwen3_5_text", "decoder_sparse_step=1: mixture of experts "
                                                 "is not implemented by ctxpar"),
    ("qwen3_next", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0: "
                                                         "config.json must give it as an "
                                                         "integer >= 1"),
    ("qwen3_next", "use_sliding_window", True, "use_sliding_window=True: a config field "
                                               "ctxpar does not know for model_type "
                                               "'qwen3_next'"),
    ("qwen3_5_moe_text", "num_experts_per_tok", 9, "num_experts_per_tok=9: more than "
                                                   "num_experts=8"),
    ("qwen3_5_moe_text", "attention_bias", True, "attention_bias=True: ctxpar has q/k/v "
                                                 "biases without o_proj's"),
    # GLM-4.5: what its MoE cannot be in ctxpar; a remote-code folder (its own modeling
    # files: auto_map)
    ("glm4_moe", "first_k_dense_replace", 2, "first_k_dense_replace=2: leaves no MoE layer "
                                             "of 2"),
    ("glm4_moe", "n_shared_experts", 0, "n_shared_experts=0: config.json must give it as an "
                                        "integer >= 1"),
    ("glm4_moe", "topk_group", 2, "topk_group=2: must be <= n_group=1"),
    ("glm4_moe", "use_qk_norm", "yes", "use_qk_norm='yes': config.json must give it as a "
                                       "boolean"),
    ("glm4_moe", "rope_parameters", rope("default", partial_rotary_factor=0),
     "partial_rotary_factor=0: a fraction of each head's channels in (0, 1]"),
    ("glm4_moe", "auto_map", {"AutoModelForCausalLM": "modeling_glm.GlmForCausalLM"},
     "auto_map={'AutoModelForCausalLM': 'modeling_glm.GlmForCausalLM'}: a remote-code "
     "folder's own modeling files is not implemented by ctxpar"),
    # MiniMax-M2: its q/k norms always on, transformers' load-balancing loss (top-k
    # without the bias), a rotary_dim the partial factor does not give; its released
    # folders' remote code
    ("minimax_m2", "use_qk_norm", False, "use_qk_norm=False: transformers' MiniMax-M2 always "
                                         "norms q and k over all heads"),
    ("minimax_m2", "output_router_logits", True, "output_router_logits=True: transformers' "
                                                 "load-balancing loss counts the top-k "
                                                 "without the correction bias"),
    ("minimax_m2", "rotary_dim", 7, "rotary_dim=7: an even number of channels in (0, "
                                    "head_dim=16]"),
    ("minimax_m2", "rotary_dim", 8, "rotary_dim=8: partial_rotary_factor=1.0 of head_dim=16 "
                                    "rotates 16 channels"),
    ("minimax_m2", "auto_map", {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config"},
     "a remote-code folder's own modeling files is not implemented by ctxpar"),
    # Llama 4: o_proj's bias, its per-layer lists, layer types it does not have
    ("llama4_text", "attention_bias", True, "attention_bias=True: Llama 4's biases are on "
                                            "o_proj too"),
    ("llama4_text", "no_rope_layers", [1, 0, 1], "no_rope_layers=[1, 0, 1]: one 0 or 1 per "
                                                 "layer"),
    ("llama4_text", "layer_types", ["full_attention", "sliding_attention"],
     "one of 'full_attention', 'chunked_attention' per layer"),
    ("llama4_text", "moe_layers", [7], "moe_layers=[7]: a list of layer indices in [0, "),
    ("llama4_text", "use_qk_norm", "yes", "use_qk_norm='yes': config.json must give it as a "
                                          "boolean"),
    ("mimo_v2_flash", "rope_parameters", {"rope_type": "default", "rope_theta": 5000.0},
     "MiMo-V2-Flash's RoPE is given per layer type"),
    ("mimo_v2_flash", "v_head_dim", 32, "v_head_dim=32: wider than head_dim=16"),
    ("mimo_v2_flash", "mlp_layer_types", ["dense", "dense"], "mlp_layer_types=['dense', "
                                                            "'dense']: no sparse layer"),
    ("mimo_v2_flash", "auto_map", {"AutoModelForCausalLM": "modeling_mimo_v2_flash."
                                                           "MiMoV2FlashForCausalLM"},
     "a remote-code folder's own modeling files is not implemented by ctxpar"),
    # Gemma 4: experts without their count, flags not booleans, the logits' softcap, a
    # per-layer vocabulary of its own, full layers of different shapes
    ("gemma4_text", "enable_moe_block", True, "num_experts=None: config.json must give it"),
    ("gemma4_text", "enable_moe_block", 1, "enable_moe_block=1: config.json must give it as"),
    ("gemma4_text", "use_double_wide_mlp", "yes", "use_double_wide_mlp='yes': config.json"),
    ("gemma4_text", "final_logit_softcapping", "30", "final_logit_softcapping='30': a number"),
    ("gemma4_text", "vocab_size_per_layer_input", 48, "per-layer embedding has the "
                                                      "vocabulary's 96 rows"),
    ("gemma4_text", "per_layer_config", {"0": {"head_dim": 32}}, "per_layer_config={'0': "),
])
def test_unrepresentable_folders_are_refused_naming_the_field(tmp_path, family, field,
                                                              value, msg):
    window = {"qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                            layer_types=None),
              "qwen3": dict(use_sliding_window=True, sliding_window=16,
                            layer_types=["full_attention", "sliding_attention"]),
              "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
              }.get(family, {})
    if field == "hybrid_override_pattern":  # the older form, in place of the list
        window = {"layers_block_type": None}
    if family == "nemotron_h" and field.startswith(("moe_", "n_group", "num_experts",
                                                    "num_local")):
        window = {"layers_block_type": ["mamba", "moe"],  # a MoE block, 4 experts (8 in 2
                  "n_routed_experts": 8 if field == "n_group" else 4}  # groups when grouped
    config = family_json(family, **{**window, field: value})
    if "linear_conv_kernel_dim" in msg or "num_experts_per_tok=2" in msg or \
            "decoder_sparse_step=1" in msg:  # relabelled
        # whole: architectures too
        config["architectures"] = [FAMILIES[value].architecture]
    if "linear_allow_neg_eigval=False" in msg:
        config["architectures"] = ["Qwen3_5ForCausalLM"]
    if family == "gemma3_text" and field == "sliding_window":
        config.update(layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    assert msg in str(e.value) and "config.json" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


KIMI_REFUSED = [  # (field, value, the line's words): what Kimi Linear's reading refuses
    ("n_routed_experts", 8, "n_routed_experts=8: KimiLinearConfig reads the experts' count "
                            "from num_experts"),
    ("num_local_experts", 4, "num_experts=8: num_local_experts=4 names the same field"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "one of 'dense', 'sparse' per "
                                                              "layer (4)"),
    ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"],
     "one of 'linear_attention', 'full_attention' per layer (4)"),
    ("linear_attn_config", {"num_heads": 4, "gate_low_rank_dim": 8}, "a dict of num_heads, "
                                                                      "head_dim"),
    ("attention_bias", True, "attention_bias=True: biases on MLA's projections"),
    ("hidden_act", "gelu", "KimiLinearForCausalLM's MLP in ctxpar uses silu"),
    ("num_experts_per_token", 9, "num_experts_per_tok=9: more than num_experts=8"),
]


def test_kimi_linear_fields_ctxpar_does_not_build_are_refused(tmp_path):
    """A tiny Kimi Linear config.json as its class saves it, one field changed per case:
    one line naming the field (read through the attribute_map's two spellings)."""
    config_class, own = FAMILY_CONFIGS["kimi_linear"]
    config_class(**{**SMALL, **own}).save_pretrained(tmp_path)
    saved = hf.read_config(str(tmp_path))
    hf.model_fields(saved, str(tmp_path))  # as saved: read
    for field, value, msg in KIMI_REFUSED:
        changed = {k: v for k, v in saved.items() if k != "layer_types" or
                   field != "linear_attn_config"}
        changed[field] = value
        with pytest.raises(CheckpointError) as e:
            hf.model_fields(changed, str(tmp_path))
        assert msg in str(e.value) and "\n" not in str(e.value), (field, str(e.value))


@pytest.mark.parametrize("model_type", ["glm5_next", "glm5_next_text"])
def test_glm5_next_folders_are_refused_naming_what_is_missing(tmp_path, model_type):
    """GLM-5.3-Flash (transformers' glm5_next): Kimi Linear's 3 : 1 pattern with a sparse
    MLA layer and hyper-connections; one line naming both, before any tensor is read."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(CheckpointError) as e:
        hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    assert f"model_type='{model_type}': GLM-5.3-Flash's sparse attention (DSA" in str(e.value)
    assert "hyper-connections (mHC)" in str(e.value) and "\n" not in str(e.value)


QWEN3_5_FIXED = dict(qk_norm=True, norm_offset=1.0, attention_output_gate=True)


def test_models_no_family_holds_are_refused_at_export():
    with pytest.raises(CheckpointError, match=r"model.mlp='gelu' cannot be exported as "
                                              r"LlamaForCausalLM"):
        hf.family_config(ModelConfig(mlp="gelu", family="llama"))
    with pytest.raises(CheckpointError, match=r"no Hugging Face family holds this model"):
        hf.family_config(ModelConfig(mlp="gelu"))
    for field, value, said in (("attention_output_gate", True, "True"),
                               ("partial_rotary_factor", 0.5, "0.5")):
        with pytest.raises(CheckpointError, match=f"model.{field}={said} cannot be exported "
                                                  f"as Qwen3ForCausalLM"):
            hf.family_config(ModelConfig(qk_norm=True, family="qwen3", **{field: value}))
    with pytest.raises(CheckpointError, match=r"model.layer_types=\['linear_attention', "
                                              r"'mamba'\] \(Qwen3.5 has"):
        hf.family_config(ModelConfig(n_layers=2, layer_types=["linear_attention", "mamba"],
                                     family="qwen3_5_text", qk_norm=True, norm_offset=1.0,
                                     attention_output_gate=True))
    from ctxpar.config.mla import MLAConfig
    kimi = dict(n_layers=2, family="kimi_linear", rope=False, mla=MLAConfig(kv_lora_rank=16),
                layer_types=["kimi_delta_attention", "full_attention"])
    for fields, msg in [  # Kimi Linear: its KDA's equal key and value heads, its NoPE MLA
            ({"linear_num_value_heads": 8, "linear_num_key_heads": 4},
             r"model.linear_num_value_heads=8 .* \(Kimi Linear's KDA has as many value heads"),
            ({"layer_types": ["linear_attention", "full_attention"]},
             r"model.layer_types=\['linear_attention', 'full_attention'\] with"),
            ({"rope": True}, r"model.rope=True cannot be exported as KimiLinearForCausalLM"),
            ({"mla": None}, r"model.mla=None \(Kimi Linear's attention layers")]:
        with pytest.raises(CheckpointError, match=msg):
            hf.family_config(ModelConfig(**{**kimi, **fields}))
    moe = MoEConfig(num_experts=4, top_k=2)
    gated = replace(moe, shared_expert_hidden=8, shared_expert_gate=True)
    for family, m, msg in [
        ("llama", {}, "model.moe is set: LlamaForCausalLM has no experts"),
        ("qwen2_moe", {"attention_bias": True}, "model.moe.shared_expert_gate=False cannot be "
                                                "exported as Qwen2MoeForCausalLM"),
        ("mixtral", {"moe": replace(moe, layers=[1])}, "model.moe.layers=[1] cannot be "
                                                       "exported as MixtralForCausalLM"),
        ("qwen3_moe", {"qk_norm": True, "moe": replace(moe, score="sigmoid")},
         "model.moe.score='sigmoid' cannot be exported as Qwen3MoeForCausalLM"),
        ("qwen3_moe", {"qk_norm": True, "moe": None}, "model.moe=None cannot be exported"),
        # Nemotron-H's MoE: sigmoid scores with the correction bias, a shared expert, on
        # MLP blocks
        ("nemotron_h", {"mlp": "relu2", "rope": False}, "model.moe.score='softmax' cannot "
                                                       "be exported as NemotronHForCausalLM"),
        ("nemotron_h", {"mlp": "relu2", "rope": False, "layer_types": ["mamba", "mlp"],
                        "moe": replace(moe, score="sigmoid", score_correction_bias=True,
                                       shared_expert_hidden=8, layers=[0])},
         "model.moe.layers=[0] with model.layer_types=['mamba', 'mlp'] (Nemotron-H's MoE "
         "blocks are MLP blocks) cannot be exported as NemotronHForCausalLM"),
        ("nemotron_h", {"mlp": "relu2", "rope": False, "layer_types": ["mlp", "mlp"],
                        "moe": replace(moe, score="sigmoid", score_correction_bias=True)},
         "model.moe.shared_expert_hidden=0 (Nemotron-H's MoE blocks always have a shared "
         "expert) cannot be exported as NemotronHForCausalLM"),
        ("qwen3_5_moe_text", {"moe": replace(gated, layers=[1])}, "model.moe.layers=[1] "
                                                                  "cannot be exported as "
                                                                  "Qwen3_5MoeForCausalLM"),
        ("qwen3_5_moe_text", {**QWEN3_5_FIXED, "ffn_hidden": 96, "moe": replace(
            gated, expert_hidden=32)}, "model.ffn_hidden=96 with model.moe.expert_hidden=32 "
                                       "(Qwen3.5-MoE has no dense MLP"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            hf.family_config(ModelConfig(**{"n_layers": 2, "moe": moe, "family": family, **m}))
    # a mixture of experts with q/k norms is a Qwen3-MoE, with a gated shared expert a
    # Qwen2-MoE, with Qwen3.5's layers and that expert a Qwen3-Next, else a Mixtral
    for m, family in [({"qk_norm": True}, "qwen3_moe"), ({"attention_bias": True, "moe": gated},
                                                        "qwen2_moe"),
                      ({**QWEN3_5_FIXED, "moe": gated}, "qwen3_next"), ({}, "mixtral")]:
        assert hf.family_config(ModelConfig(**{"moe": moe, **m}))["model_type"] == family
    # a plain GPT is a Llama; q/k/v biases make it a Qwen2, q/k norms a Qwen3, gated
    # attention with (1 + w) norms a Qwen3.5
    assert hf.family_config(ModelConfig())["architectures"] == ["LlamaForCausalLM"]
    assert hf.family_config(ModelConfig(attention_bias=True))["model_type"] == "qwen2"
    assert hf.family_config(ModelConfig(qk_norm=True))["model_type"] == "qwen3"
    assert hf.family_config(ModelConfig(qk_norm=True, norm_offset=1.0,
                                        attention_output_gate=True))["model_type"] == \
        "qwen3_5_text"


def rewrite_weights(folder, change):
    """Apply change(dict of tensors) to a single-file folder's model.safetensors."""
    from safetensors.torch import load_file, save_file
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})



def write_fused_experts(folder, fused):
    """A folder's per-expert tensors replaced by the fused ones (E, ...) of `fused`."""
    def change(t):
        for k in [k for k in t if ".experts." in k]:
            del t[k]
        t.update(fused)
    rewrite_weights(folder, change)

def shard(folder):
    """Split model.safetensors into two shards with an index, as save_pretrained does."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}))


WEIGHT_PROBLEMS = {  # name -> (what is done to an untied Llama folder, the message)
    "untied without lm_head": (
        lambda d: rewrite_weights(d, lambda t: t.pop("lm_head.weight")),
        "no tensor 'lm_head.weight' (tie_word_embeddings is false"),
    "a tensor ctxpar would not use": (  # Phi-3's fused projection
        lambda d: rewrite_weights(d, lambda t: t.update(
            {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(112, 64)})),
        "tensor 'model.layers.0.self_attn.qkv_proj.weight' would not be used by ctxpar"),
    "a dtype ctxpar cannot read": (
        lambda d: rewrite_weights(d, lambda t: t.update(
            {"model.norm.weight": t["model.norm.weight"].to(torch.int8)})),
        "model.norm.weight is I8; ctxpar reads F32, BF16, F16"),
    "a shard named in the index but absent": (
        lambda d: (shard(d), os.remove(d / "model-00002-of-00002.safetensors")),
        "model-00002-of-00002.safetensors is named in model.safetensors.index.json but "
        "absent"),
}


@pytest.mark.parametrize("problem", sorted(WEIGHT_PROBLEMS))
def test_weights_ctxpar_cannot_use_are_refused_from_the_headers(tmp_path, problem):
    tiny_family(tmp_path, "llama", tied=False)
    change, msg = WEIGHT_PROBLEMS[problem]
    change(tmp_path)
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    with pytest.raises(CheckpointError) as e:
        hf.WeightReader(str(tmp_path), m.tie_embeddings).check(m)
    assert msg in str(e.value), str(e.value)


@pytest.mark.quick
def test_moe_folders_fused_or_per_expert_and_what_is_refused(tmp_path):
    """transformers 5.x saves the experts per expert (mlp.experts.{j}.gate_proj ...) and
    holds them fused (mlp.experts.gate_up_proj (E, 2f, d)): a folder of either form gives
    the same model; both at once, a missing expert or one of another width is refused."""
    ref = tiny_family(tmp_path, "qwen3_moe", tied=False)
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    fused = {k: v for k, v in ref.state_dict().items() if ".experts." in k}

    write_fused_experts(tmp_path, fused)
    with torch.no_grad():
        torch.testing.assert_close(ctxpar_from(tmp_path)(tokens, torch.arange(32)), want, **TOL)
    ref.save_pretrained(tmp_path)  # per expert again
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    up = "model.layers.2.mlp.experts.7.up_proj.weight"
    for change, msg in [
        (lambda t: t.update(fused), "tensor 'model.layers.0.mlp.experts.0.down_proj.weight' "
                                    "and 47 more would not be used"),
        (lambda t: t.pop(up), "model.layers.2.mlp.experts.gate_up_proj's per-expert tensors "
                              "(model.layers.2.mlp.experts.0.gate_proj.weight ...) differ"),
        (lambda t: t.update({up: t[up][:16]}), "differ in shape or count"),
    ]:
        ref.save_pretrained(tmp_path)
        rewrite_weights(tmp_path, change)
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            hf.WeightReader(str(tmp_path), False).check(m)


def test_nemotron_h_moe_folders_fused_or_per_expert_and_what_is_refused(tmp_path):
    """A Nemotron 3 folder's experts per expert (mixer.experts.{j}.up_proj, as transformers
    saves them) or fused (mixer.experts.up_proj (E, f, d)) give the same model; a missing
    router correction bias, a missing expert and a multi-token-prediction tensor are
    refused by name."""
    ref = tiny_family(tmp_path, "nemotron_h_moe", tied=False)
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens).logits
    fused = {"backbone." + k[len("model."):]: v for k, v in ref.state_dict().items()
             if k.endswith(("experts.up_proj", "experts.down_proj"))}

    write_fused_experts(tmp_path, fused)
    with torch.no_grad():
        torch.testing.assert_close(ctxpar_from(tmp_path)(tokens, torch.arange(32)), want, **TOL)
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    bias = "backbone.layers.4.mixer.gate.e_score_correction_bias"
    for change, msg in [
        (lambda t: t.pop(bias), f"no tensor {bias!r}"),
        (lambda t: t.pop("backbone.layers.1.mixer.experts.7.down_proj.weight"),
         "backbone.layers.1.mixer.experts.down_proj from backbone.layers.1.mixer.experts.0."
         "down_proj.weight and its 6 per-expert siblings has shape (7, 64, 32)"),
        (lambda t: t.update({"mtp.layers.0.norm.weight": torch.ones(48)}),
         "tensor 'mtp.layers.0.norm.weight' would not be used by ctxpar"),
    ]:
        ref.save_pretrained(tmp_path)
        rewrite_weights(tmp_path, change)
        with pytest.raises(CheckpointError, match=re.escape(msg)):
            hf.WeightReader(str(tmp_path), False, "nemotron_h").check(m)


@pytest.mark.quick
def test_qwen3_next_projections_are_read_by_key_head_and_a_relabelled_folder_refused(tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (grouped by key head, 3 value heads a key
    head here) give, through ctxpar's parts, the q, k, v, z, b, a transformers'
    fix_query_key_value_ordering takes out of them, and fuse back bit for bit; a
    Qwen3.5-MoE folder (the same config keys, Qwen3.5's four projections) relabelled
    Qwen3-Next is refused by its first missing fused tensor. The released folders'
    multi-token prediction layers (mtp.*) are left out, as transformers drops them, and
    the start-up line says so."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    from ctxpar.checkpoint.families import qwen3_next
    cfg = Qwen3NextConfig(**{**SMALL, **FAMILY_CONFIGS["qwen3_next"][1],
                             "linear_num_value_heads": 6})
    torch.manual_seed(0)
    gdn = Qwen3NextGatedDeltaNet(cfg, 0)
    dims = (2, 8, 6, 6)  # key heads, their dim, value heads, their dim
    x = torch.randn(1, 5, 64)
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    qkvz, ba = gdn.in_proj_qkvz.weight.detach(), gdn.in_proj_ba.weight.detach()
    parts = {name: qwen3_next.unfuse(f"linear_attn.{fused}.weight", w, i, dims)
             for fused, w, names in (("in_proj_qkvz", qkvz, ("qkv", "z")),
                                     ("in_proj_ba", ba, ("b", "a")))
             for i, name in enumerate(names)}
    got_q, got_k, got_v = (x @ parts["qkv"].T).split((16, 16, 36), dim=-1)
    for got, want in ((got_q, q), (got_k, k), (got_v, v), (x @ parts["z"].T, z),
                      (x @ parts["b"].T, b), (x @ parts["a"].T, a)):
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=0, atol=1e-6)
    assert torch.equal(qwen3_next.fuse("in_proj_qkvz.weight", [parts["qkv"], parts["z"]],
                                       dims), qkvz)
    assert torch.equal(qwen3_next.fuse("in_proj_ba.weight", [parts["b"], parts["a"]], dims), ba)
    ref = tiny_family(tmp_path / "next", "qwen3_next", tied=False)
    rewrite_weights(tmp_path / "next", lambda t: t.update(
        {"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)}))
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # every other tensor used (ctxpar_from), the same model
        torch.testing.assert_close(ctxpar_from(tmp_path / "next")(tokens, torch.arange(16)),
                                   ref(tokens).logits, **TOL)
    assert hf.left_out(str(tmp_path / "next")) == (
        "its causal LM; left out: the multi-token prediction layers (2 tensors mtp.*, which "
        "transformers drops too)")
    tiny_family(tmp_path, "qwen3_5_moe_text", tied=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}))
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.0.linear_attn."
                                              r"in_proj_qkvz.weight'"):
        hf.WeightReader(str(tmp_path), False).check(m)


def quantize_mxfp4(w):
    """An expert tensor (E, C, R) as gpt-oss's MXFP4 folders hold it, by the format's rules
    (OCP microscaling): along C, blocks of 32 e2m1 values (the nearest of FP4_VALUES) with
    one e8m0 exponent (bias 127) each, two codes a byte, the low nibble first."""
    from ctxpar.checkpoint.mxfp4 import FP4_VALUES
    x = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], -1, 32)         # (E, R, G, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1) / 6.0)).clamp(min=-126)  # (E, R, G)
    codes = ((x / torch.exp2(exp)[..., None])[..., None] -
             torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)  # (E, R, G, 32)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)

def test_a_glm4_moe_folder_leaves_its_mtp_layers_out_and_says_so(tmp_path):
    """GLM-4.5's multi-token prediction layer is model.layers.{num_hidden_layers}.*: left
    out (transformers builds none), every other tensor used, the start-up line naming it;
    a tensor of a layer the model has is still used (refused when unknown)."""
    ref = tiny_family(tmp_path, "glm4_moe", tied=False, num_nextn_predict_layers=1)
    mtp = {"model.layers.3.eh_proj.weight": torch.ones(64, 128),
           "model.layers.3.self_attn.q_proj.weight": torch.ones(96, 64)}
    rewrite_weights(tmp_path, lambda t: t.update(mtp))
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ctxpar_from(tmp_path)(tokens, torch.arange(16)),
                                   ref(tokens).logits, **TOL)
    assert hf.left_out(str(tmp_path)) == (
        "its causal LM; left out: the multi-token prediction layers (2 tensors "
        "model.layers.3.*, which transformers drops too)")
    rewrite_weights(tmp_path, lambda t: t.update({"model.layers.2.eh_proj.weight":
                                                  torch.ones(64, 128)}))
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), tmp_path))
    reader = hf.WeightReader(str(tmp_path), False)
    assert reader.left_out() == sorted(mtp) and \
        "model.layers.2.eh_proj.weight" in reader.unused()
    assert m.moe.layers == [1, 2] and m.moe.shared_expert_hidden == 64



def test_an_mxfp4_gpt_oss_folder_imports_transformers_dequantized_weights(tmp_path):
    """A tiny gpt-oss folder with its experts in MXFP4 (quantized here by the format's
    rules): ctxpar imports the bf16 values transformers' integrations/mxfp4.py gives them,
    into its own layout; its logits are transformers' on those values; another
    quantization is refused by name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from ctxpar.checkpoint.families.gpt_oss import gpt_oss_from_hf
    ref = tiny_family(tmp_path, "gpt_oss", tied=False)
    packed = {}

    def quantize(t):
        for k in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(t.pop(k))
            t[k + "_blocks"], t[k + "_scales"] = blocks, scales
            packed[k] = convert_moe_packed_tensors(blocks, scales)     # transformers' bf16
    rewrite_weights(tmp_path, quantize)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "mxfp4"}}))
    model = ctxpar_from(tmp_path)
    params = dict(model.named_parameters())
    for k, want in packed.items():
        got = params[k[len("model."):]]
        assert torch.equal(got, gpt_oss_from_hf(k, want.float())), k
    with torch.no_grad():  # transformers on the dequantized values: ctxpar's logits
        state = {**ref.state_dict(), **{k: v.float() for k, v in packed.items()}}
        ref.load_state_dict(state)
        tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(model(tokens, torch.arange(32)), ref(tokens).logits, **TOL)
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match=r"quantization_config=\{'quant_method': 'fp8'\}: "
                                              r"gpt-oss's MXFP4 experts are read"):
        hf.model_fields(hf.read_config(tmp_path), str(tmp_path))


def test_a_bf16_folder_imports_its_weights_exactly(tmp_path):
    ref = tiny_family(tmp_path / "fp32", "qwen3", tied=False)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = ctxpar_from(tmp_path / "bf16")  # fp32 parameters holding the bf16 values
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(32)), back.eval()(tokens).logits,
                                   **TOL)


def test_a_sharded_folder_imports_like_a_single_file(tmp_path):
    ref = tiny_family(tmp_path, "qwen3", tied=False)
    shard(tmp_path)
    model = ctxpar_from(tmp_path)
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(32)), ref(tokens).logits, **TOL)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_moe", "qwen3_next", "llama4_text",
                                    "deepseek_v4"])
def test_model_config_prints_a_section_that_loads_and_matches(tmp_path, capsys, family):
    import yaml
    from ctxpar.config import config_from_dict
    from tools.convert_checkpoint import main as convert
    tiny_family(tmp_path, family, tied=True, vocab_size=256)
    assert convert([str(tmp_path), "--model-config"]) == 0
    section = yaml.safe_load(capsys.readouterr().out)
    cfg = config_from_dict(section)  # validated like any config
    assert cfg.model.family == family and cfg.model.init_from == str(tmp_path)
    if family == "gemma3_text":
        assert cfg.model.norm_offset == 1.0
    elif family == "llama4_text":  # its NoPE layers, their temperature, the input-scaling MoE
        m = cfg.model
        assert (m.nope_layers, m.attn_temperature_tuning, m.floor_scale, m.qk_l2_norm,
                m.moe.scale_expert_input, m.moe.layers) == ([1, 3], True, 8, True, True, [1, 3])
        assert hf.check_matches(m, hf.model_fields(hf.read_config(tmp_path), str(tmp_path)),
                                str(tmp_path)) == {}
        return
    elif family == "deepseek_v4":  # its attention, mHC, hash layers and limit as sections
        m = cfg.model
        assert (m.compressed_attention.compress_rates["heavily_compressed_attention"],
                m.hyper_connections.streams, m.moe.hash_layers, m.moe.score,
                m.swiglu_limit) == (8, 2, [0], "sqrtsoftplus", 0.5)
        assert hf.check_matches(m, hf.model_fields(hf.read_config(tmp_path), str(tmp_path)),
                                str(tmp_path)) == {}
        return
    else:  # model.moe a section of its own; a router loss weight may differ from the folder's
        assert cfg.model.moe == MoEConfig(8, 3, 32, [1] if family == "qwen2_moe" else None,
                                          shared_expert_hidden=40, shared_expert_gate=True,
                                          norm_topk=family == "qwen3_next",  # its default
                                          aux_loss_coef=0.02)
        cfg.model.moe.aux_loss_coef = 0.001
    fields = hf.model_fields(hf.read_config(tmp_path), str(tmp_path))
    assert hf.check_matches(cfg.model, fields, str(tmp_path)) == (
        {} if family == "gemma3_text" else {"moe.aux_loss_coef": (0.02, 0.001)})


def test_init_from_checks_the_architecture(tmp_path):
    tiny_llama(tmp_path, vocab_size=256)
    fields = hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    same = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_hidden=96, seq_len=1024, rope_theta=5e5)
    # context extension: a longer sequence and another RoPE base may differ
    assert hf.check_matches(same, fields, "x") == {"seq_len": (128, 1024),
                                                   "rope_theta": (5000.0, 5e5)}
    with pytest.raises(CheckpointError, match=r"model.n_layers=4 but model.init_from=x has "
                                              r"n_layers=2: set model.n_layers=2"):
        hf.check_matches(ModelConfig(**{**vars(same), "n_layers": 4}), fields, "x")


def test_init_from_takes_the_sources_family_when_model_family_is_unset(tmp_path):
    """A folder's model_type, or a ctxpar checkpoint's model.family, becomes the run's
    model.family (what its export writes); a family the config sets is kept."""
    from ctxpar.checkpoint import check_init_from
    from ctxpar.checkpoint.resume import write_manifest
    from ctxpar.config import config_from_dict, to_dict
    tiny_family(tmp_path / "mistral", "mistral", tied=False, vocab_size=256, head_dim=16,
                intermediate_size=192)
    model = dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                 tie_embeddings=False, rope_theta=5000.0, norm_eps=1e-5)
    cfg = config_from_dict({"model": {**model, "init_from": str(tmp_path / "mistral")}})
    assert check_init_from(cfg).family == "mistral" and cfg.model.family == "mistral"
    cfg = config_from_dict({"model": {**model, "family": "llama",
                                      "init_from": str(tmp_path / "mistral")}})
    assert check_init_from(cfg).changed == {"family": ("mistral", "llama"),
                                            "seq_len": (128, 1024)}
    assert cfg.model.family == "llama"
    tag = tmp_path / "run" / "step_00000001"  # a run started from the folder, saved
    tag.mkdir(parents=True)
    (tag / "weights").write_bytes(b"x")
    saved = {**to_dict(config_from_dict({"model": model})), "model": {
        **to_dict(config_from_dict({"model": model}))["model"], "family": "mistral"}}
    write_manifest(str(tag), 1, {"config": saved})
    cfg = config_from_dict({"model": {**model, "init_from": str(tag)}})
    check_init_from(cfg)
    assert cfg.model.family == "mistral"


def test_export_keeps_the_folders_token_ids_and_position_limit(tmp_path):
    """Through model.init_from and a ctxpar checkpoint's own init_from back to the folder:
    its bos/eos/pad ids (the run's tokenizer's where that names one) and the larger of its
    max_position_embeddings and every run's seq_len; a folder that is gone is said."""
    from ctxpar.checkpoint.resume import write_manifest
    from ctxpar.checkpoint.weights import InitSource, init_chain
    from ctxpar.config import config_from_dict, to_dict
    folder = tmp_path / "gemma"
    tiny_family(folder, "gemma3_text", tied=True, max_position_embeddings=512)
    m = ModelConfig(**{**hf.model_fields(hf.read_config(folder), str(folder)), "seq_len": 256})

    def saved_run(name, seq_len, init_from):
        tag = tmp_path / name / "step_00000001"
        tag.mkdir(parents=True)
        (tag / "weights").write_bytes(b"x")
        config = to_dict(config_from_dict(
            {"model": {**vars(m), "seq_len": seq_len, "init_from": str(init_from)},
             "data": {"kind": "tokens", "path": str(tmp_path / "corpus")}},  # not byte-level
            check_paths=False))
        write_manifest(str(tag), 1, {"config": config})
        return tag

    source, limit, note = init_chain(str(folder))
    assert (source["bos_token_id"], source["eos_token_id"], source["pad_token_id"],
            limit, note) == (2, 1, 0, 512, None)
    cfg = hf.family_config(m, None, source, limit)  # trained at 256 < 512
    assert [cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                             "max_position_embeddings")] == [2, 1, 0, 512]
    extended = saved_run("extended", 1024, folder)  # a run at 1,024, then one from it at 256
    assert init_chain(str(saved_run("again", 256, extended)))[1:] == (1024, None)
    assert hf.family_config(m, None, *init_chain(str(extended))[:2])[
        "max_position_embeddings"] == 1024
    # the run's tokenizer names EOS, BOS and PAD of its own: those win over the folder's
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 5, "<s>": 6, "<pad>": 7, "a": 8},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                            pad_token="<pad>").save_pretrained(tmp_path / "tok")
    info = export.tokenizer_info(str(tmp_path / "tok" / "tokenizer.json"))
    cfg = hf.family_config(m, info, source, limit)
    assert [cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [6, 5, 7]
    assert init_chain(str(tmp_path / "gone"))[2].startswith(f"model.init_from={tmp_path}/gone")
    # init_std only draws a random init: not a change worth a word when the folder's
    # weights are loaded
    line = InitSource(str(folder), "hf", {"init_std": (0.25, 0.02), "seq_len": (512, 256)},
                      family="gemma3_text").describe()
    assert "seq_len 512 -> 256" in line and "init_std" not in line


def tiny_tokenizer(path):
    """A word-level tokenizers JSON with EOS '</s>' (tokenizers comes with transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("the key is".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def passkey_batch(n_samples=16, seq_len=128):
    """(inputs, targets) of the first global batch of train.py's passkey stream."""
    task = PasskeyTask(seq_len, 2, 1234, "train")
    pairs = [task[i] for i in range(n_samples)]
    return tuple(torch.from_numpy(np.stack([p[i] for p in pairs])) for i in (0, 1))


def passkey_loss(model, n_samples=16, seq_len=128):
    """The token-mean loss over the first global batch of train.py's passkey stream."""
    x, y = passkey_batch(n_samples, seq_len)
    with torch.no_grad():
        if getattr(model.config, "output_router_logits", False):
            # transformers' MoE *ForCausalLM.forward (Qwen3MoeForCausalLM's, Mixtral's):
            # loss = its causal-LM loss + router_aux_loss_coef x load_balancing_loss_func
            # over the router logits of every MoE layer and all 16 x 128 tokens (no mask);
            # shift_labels: y is already the next token
            return model(x, labels=y, shift_labels=y).loss.item()
        logits = model(x).logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                             ignore_index=-100).item()


def test_train_py_from_a_llama_folder_and_back(tmp_path):
    # configs/tiny_cpu.yaml's model (swiglu ffn 192, tied, theta 1e4) as a Llama
    # a folder of 512 positions trained at 128: the export keeps 512 and its BOS and PAD
    ref = tiny_llama(tmp_path / "llama", vocab_size=256, intermediate_size=192,
                     rope_theta=10000.0, max_position_embeddings=512, bos_token_id=3,
                     pad_token_id=4)
    tiny_tokenizer(tmp_path / "tokenizer.json")
    run = tmp_path / "run"
    proc = run_train(str(run), 4, [
        "parallel.tp=2", "parallel.cp=2", "parallel.dp=1", "train.steps=1",
        f"model.init_from={tmp_path / 'llama'}", f"data.tokenizer={tmp_path / 'tokenizer.json'}",
        "logging.wandb.mode=disabled"])
    assert "initialized from" in proc.stdout and "Hugging Face Llama folder" in proc.stdout
    assert_first_loss_is_the_references(run, ref)

    # Export the trained checkpoint (tp2·cp2, ZeRO-1) with the CLI.
    out = tmp_path / "exported"
    exported, back = export_and_reload(run, out)
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert tok.eos_token == "</s>" and config["eos_token_id"] == 1  # the run's tokenizer's
    assert (config["bos_token_id"], config["pad_token_id"]) == (3, 4)  # the folder's
    assert config["max_position_embeddings"] == 512 == exported.config.max_position_embeddings
    assert tok.model_max_length == 512
    # ctxpar -> Llama -> ctxpar: the checkpoint's full fp32 weights, bit for bit.
    tag = resolve_checkpoint(str(run))
    u = str(tmp_path / "universal")
    to_universal(tag, u, read_manifest(tag)["layout"], 2, lambda n: n)
    saved = full_weights(u)
    for name, p in back.named_parameters():
        assert torch.equal(p, saved[name]), name
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(64)), exported(tokens).logits, **TOL)


def test_train_py_from_a_qwen2_folder_and_back(tmp_path):
    # q/k/v biases split over tp2, head_dim 24, YaRN, untied: tiny_cpu.yaml's shapes else
    ref = tiny_family(tmp_path / "qwen2", "qwen2", tied=False, vocab_size=256,
                      intermediate_size=192, rope_theta=10000.0)
    run = tmp_path / "run"
    proc = run_train(str(run), 4, [
        "parallel.tp=2", "parallel.cp=2", "parallel.dp=1", "train.steps=1",
        f"model.init_from={tmp_path / 'qwen2'}", "model.head_dim=24",
        "model.attention_bias=true", "model.tie_embeddings=false", "model.ffn_hidden=192",
        "model.rope_scaling={rope_type: yarn, factor: 4.0, "
        "original_max_position_embeddings: 32}", "logging.wandb.mode=disabled"])
    assert "Hugging Face Qwen2 folder" in proc.stdout
    assert_first_loss_is_the_references(run, ref)
    # The export writes the family the run started from (model.family, taken from the
    # folder), and transformers computes ctxpar's logits from it.
    exported, back = export_and_reload(run, tmp_path / "exported")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(64)), exported(tokens).logits, **TOL)


@pytest.mark.parametrize("problem", ["a config field", "untied without lm_head",
                                     "a shard named in the index but absent",
                                     "a family that cannot hold the model",
                                     "a mixture of experts relabelled dense",
                                     "a Qwen3.5-MoE folder relabelled Qwen3-Next"])
def test_train_py_refuses_an_unrepresentable_init_from_with_exit_2(tmp_path, problem):
    """One line and exit 2 from check_inputs, before any process group or model exists
    (one process: under torchrun the first rank's exit makes the launcher stop the others,
    which reach the same verdict from the same files)."""
    if problem == "a family that cannot hold the model":  # found at start, not at export
        proc = run_train(str(tmp_path / "run"), 1, ["parallel.cp=1", "parallel.dp=1",
                                                    "model.family=qwen3"],
                         check=False, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert "model.qk_norm=False cannot be exported as Qwen3ForCausalLM" in lines[0]
        return
    if problem == "a config field":
        tiny_llama(tmp_path / "llama", vocab_size=256, attention_bias=True)
        msg = "attention_bias=True: with mlp_bias=False: ctxpar's model.bias puts biases"
    elif problem == "a mixture of experts relabelled dense":  # Mixtral as a Mistral
        tiny_family(tmp_path / "llama", "mixtral", tied=False, vocab_size=256,
                    intermediate_size=192, head_dim=16)
        config = json.loads((tmp_path / "llama" / "config.json").read_text())
        (tmp_path / "llama" / "config.json").write_text(json.dumps(
            {**config, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
        msg = "num_experts_per_tok=2: mixture of experts is not implemented by ctxpar"
    elif problem == "a Qwen3.5-MoE folder relabelled Qwen3-Next":  # every config key
        # Qwen3-Next's: its Gated DeltaNet's four projections are not Qwen3-Next's two
        tiny_family(tmp_path / "llama", "qwen3_5_moe_text", tied=False,
                    **HYBRID_MOE["qwen3_5_moe_text"])
        config = json.loads((tmp_path / "llama" / "config.json").read_text())
        (tmp_path / "llama" / "config.json").write_text(json.dumps(
            {**config, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}))
        msg = "no tensor 'model.layers.0.linear_attn.in_proj_qkvz.weight'"
    else:
        tiny_family(tmp_path / "llama", "llama", tied=False, vocab_size=256,
                    intermediate_size=192, head_dim=16)
        change, msg = WEIGHT_PROBLEMS[problem]
        change(tmp_path / "llama")
    proc = run_train(str(tmp_path / "run"), 1, [
        "parallel.cp=1", "parallel.dp=1", f"model.init_from={tmp_path / 'llama'}",
        "model.tie_embeddings=false", "model.ffn_hidden=192",
        *(folder_sets(tmp_path / "llama") if "Qwen3-Next" in problem else [])],
        check=False, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert msg in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def folder_sets(path):
    """--set model.K=V for every architecture field of a folder (what --model-config
    prints), seq_len aside: the run keeps its own."""
    fields = hf.model_fields(hf.read_config(str(path)), str(path))
    return [f"model.{k}={json.dumps(asdict(v) if is_dataclass(v) else v)}"
            for k, v in fields.items()
            if k not in ("seq_len", "init_std", "family")]


def assert_first_loss_is_the_references(run, ref, key="loss", **kw):
    """Step 1's loss is computed before any update: the imported model's loss on the batch,
    which transformers' model `ref` computes too (fp32: the parallel reduction orders
    differ only, hence 1e-5). A mixture of experts with output_router_logits: the token
    loss plus router_aux_loss_coef x the load-balancing loss of the batch (the run's
    moe_aux_loss, unweighted), as transformers' loss has it (passkey_loss). key: the
    metric (lm_loss: the LM's alone under model.mtp)."""
    want = passkey_loss(ref, **kw)
    got = metric(str(run), key)[1]
    if getattr(ref.config, "output_router_logits", False):
        got += ref.config.router_aux_loss_coef * metric(str(run), "moe_aux_loss")[1]
    assert abs(got - want) <= 1e-5 * want, (got, want)


def export_and_reload(run, out):
    """tools/convert_checkpoint.py --to hf on the run; transformers' model from the folder
    and ctxpar's GPT imported from it."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                        str(run), "--to", "hf", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    return AutoModelForCausalLM.from_pretrained(out).float().eval(), ctxpar_from(out)


def test_train_py_from_a_windowed_gemma3_folder_at_cp2_pp2_and_back(tmp_path):
    # A sliding layer (window 6, its own RoPE base 100) and a full one (base 1e6), one per
    # pipeline stage; ring attention over zigzag halves; tied; (1 + w) norms before and
    # after attention and MLP, q/k norms, embeddings scaled by sqrt(d).
    ref = tiny_family(tmp_path / "gemma", "gemma3_text", tied=True, vocab_size=256,
                      intermediate_size=192, **WINDOWED["gemma3_text"])
    run = tmp_path / "run"
    proc = run_train(str(run), 4, [
        "parallel.pp=2", "parallel.cp=2", "parallel.dp=1", "parallel.layout=zigzag",
        "train.steps=1", f"model.init_from={tmp_path / 'gemma'}",
        "logging.wandb.mode=disabled", *folder_sets(tmp_path / "gemma")])
    assert "Hugging Face Gemma3 folder" in proc.stdout
    assert_first_loss_is_the_references(run, ref)
    exported, back = export_and_reload(run, tmp_path / "exported")
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    c = exported.config  # the folder's ids, Gemma's pad among them
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (2, 1, 0)
    assert exported.config.layer_types == ["sliding_attention", "full_attention"]
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(64)), exported(tokens).logits, **TOL)


def save_word_tokenizer(folder):
    """A word-level tokenizer over a 256-id vocabulary saved into folder as transformers
    saves one (tokenizer.json, and tokenizer_config.json naming the EOS '</s>' = 1), a BOS
    'w5' prepended as Llama's; the tokenizers object."""
    vocab = {"<unk>": 0, "</s>": 1, "the": 2, "key": 3, "is": 4,
             **{f"w{i}": i for i in range(5, 256)}}  # every id the model can emit decodes
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="w5 $A",
                                                       special_tokens=[("w5", 5)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="w5",
                            unk_token="<unk>").save_pretrained(folder)
    return tok


def greedy_continuations_agree(rows, exported, tok, max_new):
    """generate.py's jsonl rows against transformers' greedy continuation of the same
    prompts (BOS first) from the exported folder, cut at the EOS (id 1)."""
    for row in rows:
        ids = torch.tensor([tok.encode(row["prompt"]).ids])
        with torch.no_grad():
            new = exported.generate(ids, max_new_tokens=max_new, do_sample=False)[
                0, ids.shape[1]:].tolist()
        new = new[:new.index(1)] if 1 in new else new
        # generate.py decodes as the folder's tokenizer does: its special tokens (the
        # <unk> = 0 among them) skipped
        assert row["completion"] == tok.decode([t for t in new if t != 0]), (row, new)


def test_extend_a_qwen3_folder_at_cp2_ulysses_generate_export_reload(tmp_path):
    """The CPU demo of a context extension: a Qwen3 folder (a sliding layer, window 9, and
    a full one; q/k norms; untied) trained by train.py at twice its
    max_position_embeddings with YaRN (factor 2) over cp2 Ulysses; generate.py answers
    from the run with the folder's tokenizer.json (the run's data.tokenizer, no
    --tokenizer given) as transformers does; the export is the same model in
    transformers."""
    folder = tmp_path / "qwen3"
    tiny_family(folder, "qwen3", tied=False, vocab_size=256, intermediate_size=192,
                **WINDOWED["qwen3"])
    tok = save_word_tokenizer(folder)
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
    run = tmp_path / "run"
    sets = [s for s in folder_sets(folder) if not s.startswith("model.rope_scaling=")]
    proc = run_train(str(run), 2, [
        "parallel.cp=2", "parallel.dp=1", "parallel.cp_comm=ulysses", "train.steps=2",
        f"model.init_from={folder}", f"data.tokenizer={folder / 'tokenizer.json'}",
        "logging.wandb.mode=disabled", *sets, "model.seq_len=256",
        f"model.rope_scaling={json.dumps(yarn)}"])
    assert "Hugging Face Qwen3 folder" in proc.stdout and "seq_len 128 -> 256" in proc.stdout
    # transformers' model from the folder with the run's RoPE: step 1's loss at 256 tokens
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    config.rope_parameters = {**yarn, "rope_theta": 5000.0}
    ref = AutoModelForCausalLM.from_pretrained(folder, config=config).float().eval()
    assert_first_loss_is_the_references(run, ref, seq_len=256)

    exported, back = export_and_reload(run, tmp_path / "exported")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("</s>", "w5")  # the folder's
    assert tokenizer.model_max_length == 256 and exported.config.eos_token_id == 1
    assert exported.config.rope_parameters["rope_type"] == "yarn"
    assert exported.config.layer_types == ["sliding_attention", "full_attention"]
    tokens = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(200)), exported(tokens).logits,
                                   **TOL)
    # generate.py on two CP ranks, greedy, the tokenizer's text in and out: transformers'
    # greedy continuation of the same prompts (BOS first) from the exported folder.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    prompts = [" ".join(["the key is"] * 20), "the key"]  # 61 tokens (past the 9-token
    # window) and 3 (whose continuation changes without the BOS)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(free_port()), os.path.join(ROOT, "generate.py"),
                        "--run-dir", str(run), "--prompt", prompts[0], "--prompt", prompts[1],
                        "--max-new-tokens", "6",  # the run's data.tokenizer: no flag
                        "--output-format", "jsonl"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[:4000] + r.stderr[-1000:]  # the cause, the agent
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [row["prompt"] for row in rows] == prompts
    greedy_continuations_agree(rows, exported, tok, 6)


# The hybrids in orders that do not repeat evenly: Qwen3.5's Gated DeltaNet layers around
# one gated full-attention layer (value heads twice the key heads), Nemotron-H's Mamba2
# blocks around a NoPE attention block and a squared-ReLU MLP block, OLMo Hybrid's Gated
# DeltaNet layers (beta in [0, 2]) around a post-norm NoPE attention layer.
HYBRIDS = {
    "qwen3_5_text": dict(vocab_size=256, intermediate_size=192,
                         layer_types=["linear_attention", "full_attention", "linear_attention",
                                      "linear_attention"], num_hidden_layers=4),
    "nemotron_h": dict(vocab_size=256, intermediate_size=192,
                       layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba"]),
    # NoPE, as the released folders: rope_parameters' rope_theta null
    "olmo_hybrid": dict(vocab_size=256, intermediate_size=192, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention",
                                     "linear_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": None}),
}
HYBRID_LAYOUTS = {
    "cp2-state-zigzag": ["parallel.cp=2", "parallel.layout=zigzag", "parallel.linear_cp=state"],
    "cp2-heads": ["parallel.cp=2", "parallel.linear_cp=heads", "parallel.cp_comm=ulysses"],
    "tp2-cp2": ["parallel.tp=2", "parallel.cp=2"],
    "cp2-pp2": ["parallel.cp=2", "parallel.pp=2"],
    "cp2-zigzag-ep2": ["parallel.cp=2", "parallel.layout=zigzag", "parallel.ep=2"],
    "cp2-allgather": ["parallel.cp=2", "parallel.cp_comm=allgather"],
    "cp2-zigzag": ["parallel.cp=2", "parallel.layout=zigzag"],
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")  # FAMILY_CONFIGS' sizes
# Qwen3.5's layers with experts: Gated DeltaNet around a gated full-attention layer, a
# dense layer between Qwen3-Next's MoE ones (mlp_only_layers; Qwen3.5-MoE's are all MoE)
HYBRID_MOE = {family: dict(vocab_size=256, intermediate_size=192, num_hidden_layers=4,
                           layer_types=HYBRIDS["qwen3_5_text"]["layer_types"],
                           **({"mlp_only_layers": [2]} if family == "qwen3_next" else {}))
              for family in ("qwen3_next", "qwen3_5_moe_text")}
# Kimi Linear: FAMILY_CONFIGS' three KDA layers, NoPE MLA, a dense layer then the experts
HYBRID_MOE["kimi_linear"] = dict(vocab_size=256, intermediate_size=192)
# the hybrids on every layout their linear layers run on; the mixtures of experts at
# cp2 x ep2 (generate.py too) and tp2 x cp2, and cp2 x pp2 for two of them (the same
# MoE layer in every family: Qwen3-MoE's, and gpt-oss's with its biases and sinks)
FOLDER_RUNS = [(f, layout) for f in HYBRIDS for layout in list(HYBRID_LAYOUTS)[:4]] + [
    (f, layout) for f in MOE_FAMILIES for layout in ("cp2-zigzag-ep2", "tp2-cp2")] + [
    (f, "cp2-pp2") for f in ("qwen3_moe", "gpt_oss")] + [
    # Nemotron 3: Mamba2, attention, MLP and MoE blocks (its routers' correction biases
    # loaded into, and exported from, every layout: the pipeline's per-layer files too)
    ("nemotron_h_moe", layout) for layout in ("cp2-state-zigzag", "cp2-zigzag-ep2", "tp2-cp2",
                                              "cp2-pp2")] + [
    # Qwen3-Next on the layouts, Qwen3.5-MoE at cp2 x ep2: the two share every layer's code
    # (models/gated_delta.py, models/moe.py) and differ in their folders' tensors and keys
    # only, which one run exercises
    ("qwen3_next", layout) for layout in ("cp2-zigzag-ep2", "tp2-cp2", "cp2-pp2")] + [
    ("qwen3_5_moe_text", "cp2-zigzag-ep2")] + [
    # DeepSeek-V3: MLA with the latent on the wire and its sigmoid-routed experts (the
    # correction biases loaded and exported) at cp2 x ep2 (generate.py's latent cache too),
    # tp2 x cp2 (the heads split, the latent path replicated) and cp2 x pp2
    ("deepseek_v3", layout) for layout in ("cp2-zigzag-ep2", "tp2-cp2", "cp2-pp2",
                                           "cp2-allgather")] + [
    # DeepSeek-V2-Lite's form (q_proj, the unnormalised softmax router) at cp2 Ulysses
    ("deepseek_v2", "cp2-heads")] + [
    # DeepSeek-V3.2: the indexer's top-k streamed over the ring with the latent, sparse MLA
    # over the selected tokens, at cp2 x ep2 (generate.py's cache of latents and indexer
    # keys, its top-k over CP, too); cp2 all-gather, tp2 x cp2, cp2 x pp2 and GLM-5 run by
    # hand (docs/checkpoints.md)
    ("deepseek_v32", "cp2-zigzag-ep2")] + [
    # GLM-4.5: DeepSeek-V3's router after a dense layer, partial RoPE, q/k norms and
    # biases, its shared experts; cp2 x ep2 (generate.py too)
    ("glm4_moe", "cp2-zigzag-ep2")] + [
    # MiniMax-M2: the sigmoid router with its correction bias on every layer (at the
    # block: block_sparse_moe.e_score_correction_bias); its q/k norms over all heads are
    # OLMo Hybrid's, run at tp2 x cp2 above
    ("minimax_m2", "cp2-zigzag-ep2")] + [
    # Llama 4: the NoPE layers' temperature from each rank's global positions (past the
    # floor on both CP ranks; the pipeline's blocks compute it themselves), chunks across
    # the ranks' boundary, the input-scaling router (its gradient summed over TP). Not at
    # Ulysses: the temperature is token-local, before the all-to-all
    ("llama4_text", layout) for layout in ("cp2-zigzag-ep2", "tp2-cp2", "cp2-pp2")] + [
    # MiMo-V2-Flash: per-type K/V heads, value heads narrower than q/k's (the cache's too),
    # sinks on the sliding layers, the value scale, its experts; cp2 x ep2 (generate.py too)
    ("mimo_v2_flash", "cp2-zigzag-ep2"),
    # Kimi Linear: KDA's state passed over zigzag halves beside the NoPE MLA's latent ring,
    # extended to twice the folder's positions as they are (nothing turns), generate.py at
    # cp2 (KDA's replicated states and the latent cache)
    ("kimi_linear", "cp2-state-zigzag"),
    # Gemma 4: shared K/V, k_eq_v, head dims 24 and 32, per-layer inputs at cp2 zigzag,
    # twice the folder's positions, and generate.py at cp2 (its cache: the producers'
    # slots only); the other layouts are tests/test_gemma4_cp.py's
    ("gemma4_text", "cp2-state-zigzag"),
    # Gemma 4 with experts beside its MLPs (and double-wide shared-KV MLPs) at cp2 x ep2
    # (tests/test_gemma4.py's spawn adds tp2 x cp2 x ep2 against one process; tp2 x cp2
    # and cp2 Ulysses folder runs by hand, docs/checkpoints.md)
    ("gemma4_moe", "cp2-zigzag-ep2"),
    # DeepSeek-V4: sliding, CSA and HCA layers (the compressors' windows across the zigzag
    # halves, the indexer's top-k over every rank's entries), a hash-routed layer, mHC; cp2
    # contiguous, tp2 x cp2 and cp2 x ep2 run by hand (docs/checkpoints.md)
    ("deepseek_v4", "cp2-zigzag")]
# a family's folder for the runs when not the default sizes below
RUN_SIZES = {family: dict(vocab_size=256, vocab_size_per_layer_input=256,
                          intermediate_size=192) for family in ("gemma4_text", "gemma4_moe")}
RUN_SIZES["deepseek_v4"] = dict(vocab_size=256)  # its experts FAMILY_CONFIGS' 32 wide


@pytest.mark.parametrize("family,layout", FOLDER_RUNS)
def test_train_py_from_a_hybrid_or_moe_folder_and_back(tmp_path, family, layout):
    """train.py's step-1 loss from a Qwen3.5 or Nemotron-H folder equals transformers' on
    every layout the linear layers run on; the export (gathered over TP and the
    pipeline's stages) reloads in transformers with ctxpar's logits and the folder's
    weights one step on. At cp2 state passing, the CPU demo of a context extension: twice
    the folder's 128 positions (Qwen3.5's attention layers with YaRN x2, Nemotron-H's
    NoPE unchanged), and generate.py continues as transformers' greedy generate. The
    mixtures of experts likewise at cp2 x ep2 (the export and generate.py take every
    expert from the ZeRO shards: the module file holds EP rank 0's), tp2 x cp2 (the
    experts' widths gathered over TP) and cp2 x pp2 (the routers' statistics across the
    stages), their step-1 loss with transformers' load-balancing loss."""
    sets, folder, run = HYBRID_LAYOUTS[layout], tmp_path / family, tmp_path / "run"
    ref = tiny_family(folder, family, tied=False, **HYBRIDS.get(family, HYBRID_MOE.get(
        family, RUN_SIZES.get(family, dict(vocab_size=256, intermediate_size=192)))))
    mtp = None
    if (family, layout) == ("deepseek_v3", "cp2-zigzag-ep2"):  # with its MTP layer
        # (model.layers.3.*, an MLA + MoE block) as model.mtp, its experts over EP too
        mtp = add_numbered_mtp_layer(folder, ref)
        sets = [*sets, "model.mtp.depth=1", "model.mtp.moe=true"]
    if family in MOE_FAMILIES or family in HYBRID_MOE or family.startswith("deepseek"):  # the
        # whole batch in one
        # micro-batch, as transformers' load-balancing loss sees it (ctxpar's is a micro-batch's over every DP x CP
        # rank, models/moe_steps.py)
        sets = [*sets, "train.micro_batch_size=16"]
    tok = save_word_tokenizer(folder)
    extend = "parallel.linear_cp=state" in sets
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}
    longer = ["model.seq_len=256"] + (
        [f"model.rope_scaling={json.dumps(yarn)}"] if family == "qwen3_5_text" else [])
    nproc = 4 if "parallel.tp=2" in sets or "parallel.pp=2" in sets else 2
    proc = run_train(str(run), nproc, [
        *sets, "parallel.dp=1", "train.steps=1", f"model.init_from={folder}",
        f"data.tokenizer={folder / 'tokenizer.json'}", "logging.wandb.mode=disabled",
        *folder_sets(folder), *(longer if extend else [])])
    assert f"Hugging Face {ref.__class__.__name__[:-len('ForCausalLM')]} folder" in \
        proc.stdout, proc.stdout[-2000:]
    if extend and family == "qwen3_5_text":  # transformers' model with the run's RoPE
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(folder)
        config.rope_parameters = {**config.rope_parameters, **yarn}
        ref = AutoModelForCausalLM.from_pretrained(folder, config=config).float().eval()
    assert_first_loss_is_the_references(run, ref, "lm_loss" if mtp else "loss",
                                        seq_len=256 if extend else 128)
    if mtp is not None:  # step 1's MTP loss: transformers' MtpModel's on the batch
        want = mtp_depth1_loss(ref, mtp, *passkey_batch()).item()
        assert abs(metric(str(run), "mtp_loss_1")[1] - want) <= 1e-5 * want
    if "parallel.cp_comm=ulysses" in sets:
        return  # one export is enough for the layouts that split the model's tensors
    exported, back = export_and_reload(run, tmp_path / "exported")
    assert type(exported) is type(ref)
    if family in HYBRIDS or family in HYBRID_MOE or family == "nemotron_h_moe":
        assert exported.config.layer_types == ref.config.layer_types
    # one warm-up step moves a weight by at most lr_1 = 3e-3 / 20 (Adam's first step is
    # lr x sign): a fused [q | k | v] or [z | ...] gathered in the wrong order over TP or
    # stages would move it by the weights' own scale (~0.02-0.3)
    theirs = exported.state_dict()
    for name, want in ref.state_dict().items():
        assert (theirs[name] - want).abs().max() <= 1e-3, name
    if mtp is not None:  # every MTP tensor exported under its name, one step on
        from safetensors.torch import load_file
        source, back_mtp = (load_file(d / "model.safetensors") for d in (folder,
                                                                          tmp_path / "exported"))
        keys = sorted(k for k in source if k.startswith("model.layers.3."))
        assert sorted(k for k in back_mtp if k.startswith("model.layers.3.")) == keys
        assert max((back_mtp[k] - source[k]).abs().max() for k in keys) <= 1e-3
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, torch.arange(64)), exported(tokens).logits,
                                   **TOL)
    if family == "nemotron_h_moe" and layout == "cp2-pp2":  # the pipeline's checkpoint as
        # another run's init_from at cp2: its step-1 loss is the exported model's (the
        # correction biases from the per-layer files into a model without stages)
        again = tmp_path / "again"
        run_train(str(again), 2, ["parallel.cp=2", "parallel.dp=1", "train.steps=1",
                                  f"model.init_from={run}", "logging.wandb.mode=disabled",
                                  f"data.tokenizer={folder / 'tokenizer.json'}",
                                  *folder_sets(folder)])
        assert_first_loss_is_the_references(again, exported)
    if extend or family == "deepseek_v4" or layout == "cp2-zigzag-ep2" and family not in (
            "qwen3_5_moe_text", "gemma4_moe"):  # generate.py at cp2: transformers' greedy
        # (Qwen3.5-MoE's layers are Qwen3-Next's: one is enough; Gemma 4's cache is
        # gemma4_text's run's, its experts every MoE family's; DeepSeek-V4 by full forwards)
        prompts = [" ".join(["the key is"] * 20), "the key"]  # 61 tokens and 3
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": ROOT}
        r = run_warm("generate.py", ["--run-dir", str(run), "--prompt", prompts[0],
                                     "--prompt", prompts[1], "--max-new-tokens", "6",
                                     "--output-format", "jsonl"], 2, env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert [row["prompt"] for row in rows] == prompts
        greedy_continuations_agree(rows, exported, tok, 6)


@pytest.mark.parametrize("wrapper,family", [("qwen3_5", "qwen3_5_text"),
                                            ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_a_multimodal_qwen3_5_folder_imports_its_language_model(tmp_path, wrapper, family):
    """Qwen3.5's and Qwen3.5-MoE's released folders are *ForConditionalGeneration
    (model_type qwen3_5 / qwen3_5_moe: a text_config, a vision tower; the experts per
    expert under model.language_model.): ctxpar imports the language model, its logits on
    text equal the whole model's, and says what it left out (the released folders'
    multi-token prediction layers too, mtp.* and text_config's mtp_* sizes, which
    transformers builds no layer for); a field it does not know at the top level is refused
    by name."""
    import transformers
    name = "Qwen3_5" if wrapper == "qwen3_5" else "Qwen3_5Moe"
    text = {**SMALL, **FAMILY_CONFIGS[family][1]}
    torch.manual_seed(0)
    ref = getattr(transformers, f"{name}ForConditionalGeneration")(getattr(
        transformers, f"{name}Config")(
        text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                             num_heads=2, out_hidden_size=64))).float().eval()
    ref.save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update(
        {"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"].update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ctxpar_from(tmp_path)  # every language-model tensor used, none left
    assert model.cfg.family == family and model.cfg.partial_rotary_factor == 0.25
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(48)), ref(tokens).logits, **TOL)
    assert hf.left_out(str(tmp_path)) == (
        "its language model; left out: the vision tower (vision_config, model.visual.*) and "
        "the multi-token prediction layers (2 tensors mtp.*, which transformers drops too)")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "audio_config": {}}))
    with pytest.raises(CheckpointError, match=rf"audio_config=\{{\}}: a config field ctxpar "
                                              rf"does not know for model_type '{wrapper}'"):
        hf.read_config(str(tmp_path))


def test_an_olmo_hybrid_folder_in_transformers_loaded_names_imports_the_same(tmp_path):
    """OLMo Hybrid's tensors as transformers saves them (q/k/v_conv1d, attention_layer_norm,
    feedforward_layer_norm) or as its model names them once loaded (one conv1d,
    input_layernorm, post_attention_layernorm): both import to the same parameters."""
    from safetensors.torch import save_file
    ref = tiny_family(tmp_path / "saved", "olmo_hybrid", tied=False)
    loaded = tmp_path / "loaded"
    loaded.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(loaded / "model.safetensors"), metadata={"format": "pt"})
    (loaded / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    saved, other = ctxpar_from(tmp_path / "saved"), ctxpar_from(loaded)
    theirs = dict(other.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.equal(p, theirs[name]), name


@pytest.mark.parametrize("rope,want", [({"rope_parameters": {"rope_type": "default",
                                                            "rope_theta": None}}, False),
                                       ({"rope_parameters": None, "rope_theta": None}, False),
                                       ({"rope_parameters": None}, True),
                                       ({"rope_parameters": {"rope_type": "default"}}, True)])
def test_olmo_hybrid_nope_is_a_null_rope_theta_as_transformers_reads_it(tmp_path, rope, want):
    """transformers 5 builds OLMo Hybrid's rotary embedding unless rope_theta is null (in
    rope_parameters or, transformers 4's form, at the top level); absent, it is 10000."""
    (tmp_path / "config.json").write_text(json.dumps(family_json("olmo_hybrid", **rope)))
    fields = hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
    assert fields["rope"] is want and (not want or fields["rope_theta"] == 10000.0)


@pytest.mark.parametrize("change,msg", [
    (lambda t: t.pop("model.layers.0.linear_attn.k_conv1d.weight"),
     "no tensor 'model.layers.0.linear_attn.k_conv1d.weight'"),
    (lambda t: t.update({"model.layers.0.linear_attn.v_conv1d.weight": torch.zeros(4, 1, 4)}),
     "q_conv1d.weight, model.layers.0.linear_attn.k_conv1d.weight, "
     "model.layers.0.linear_attn.v_conv1d.weight have"),
    (lambda t: t.update({"model.layers.0.linear_attn.k_proj.weight": torch.zeros(24, 64)}),
     "model.layers.0.linear_attn.k_proj.weight has shape (24, 64), config.json makes it "
     "(16, 64)")])
def test_olmo_hybrid_parts_ctxpar_cannot_use_are_refused_by_name(tmp_path, change, msg):
    """The [q | k | v] parts of OLMo Hybrid's Gated DeltaNet: each present, the
    projections by section, the convs' rows summing to the config's (transformers splits
    its conv in three equal chunks, so only their sum is the config's)."""
    tiny_family(tmp_path, "olmo_hybrid", tied=False)
    rewrite_weights(tmp_path, change)
    m = ModelConfig(**hf.model_fields(hf.read_config(tmp_path), str(tmp_path)))
    with pytest.raises(CheckpointError) as e:
        hf.WeightReader(str(tmp_path), m.tie_embeddings, hf.naming_of(m)).check(m)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.quick
def test_a_moe_mismatch_names_the_field_and_both_values(tmp_path):
    """model.moe.top_k=3 against a folder of top_k 2: one line naming model.moe.top_k, the
    folder's value and the config's (not two MoEConfig reprs), and a 'may differ' list
    that holds the router losses, as docs/checkpoints.md says."""
    from ctxpar.config.moe import MoEConfig
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32)
    folder = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         ffn_hidden=96, moe=moe)
    fields = dict(vars(folder))
    mine = ModelConfig(**{**fields, "moe": MoEConfig(num_experts=4, top_k=3, expert_hidden=32,
                                                     aux_loss_coef=0.01)})
    with pytest.raises(CheckpointError) as e:
        hf.check_matches(mine, fields, "x")
    line = str(e.value)
    assert "\n" not in line and "MoEConfig(" not in line, line
    assert line.startswith("model.moe.top_k=3 but model.init_from=x has moe.top_k=2: set "
                           "model.moe.top_k=2 (only seq_len, "), line
    assert line.endswith(", family, moe.aux_loss_coef, moe.z_loss_coef may differ)"), line
    two = ModelConfig(**{**fields, "moe": MoEConfig(num_experts=4, top_k=3, expert_hidden=16)})
    with pytest.raises(CheckpointError, match=r"set model.moe.top_k=2 model.moe.expert_hidden"
                                              r"=32 \(and model.moe.expert_hidden differ\)"):
        hf.check_matches(two, fields, "x")


def test_a_deepseek_v3_folder_with_its_mtp_layer_imports_the_causal_lm_and_says_so(tmp_path):
    """DeepSeek-V3's released folders hold the multi-token prediction layer as one more
    block (model.layers.61.*: eh_proj, enorm, hnorm, a whole decoder layer) that
    DeepseekV3ForCausalLM drops on loading: the import leaves it out and its start-up line
    says so; a refusal of the MLA sizes names the field."""
    ref = tiny_family(tmp_path, "deepseek_v3", False)
    rewrite_weights(tmp_path, lambda t: t.update(
        {"model.layers.3.eh_proj.weight": torch.ones(64, 128),
         "model.layers.3.enorm.weight": torch.ones(64)}))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model = ctxpar_from(tmp_path)  # every other tensor used, none left
    tokens = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(48)), ref(tokens).logits, **TOL)
    assert hf.left_out(str(tmp_path)) == (
        "its causal LM; left out: the multi-token prediction layers (2 tensors "
        "model.layers.3.*, which transformers drops too)")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    with pytest.raises(CheckpointError, match=r"num_key_value_heads=2: MLA expands every "
                                              r"head's keys"):
        hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))
