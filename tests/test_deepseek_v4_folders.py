"""The deepseek_v4 family's config.json, read and written (ctxpar/checkpoint/families/
deepseek_v4.py): the flat RoPE form of older folders reads as the nested one its class
builds; every field ctxpar does not build as transformers computes it is refused in one
line naming it; a model the family cannot hold is refused at export. The import and export
against transformers' logits and tensors are tests/test_hf.py's family harness; train.py
from a folder is tests/test_hf.py's FOLDER_RUNS."""
import json

import pytest

pytest.importorskip("transformers")  # the dev extra
from transformers import DeepseekV4Config  # noqa: E402

from ctxpar.checkpoint import CheckpointError, hf  # noqa: E402
from ctxpar.config import ModelConfig  # noqa: E402

ROPE = {"rope_type": "default", "partial_rotary_factor": 0.5}
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=1, head_dim=24, sliding_window=5,
             layer_types=["sliding_attention", "compressed_sparse_attention",
                          "heavily_compressed_attention"],
             compress_rates={"compressed_sparse_attention": 4,
                             "heavily_compressed_attention": 8},
             q_lora_rank=16, o_groups=2, o_lora_rank=12, index_n_heads=2, index_head_dim=16,
             index_topk=3, mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2, swiglu_limit=0.5,
             rope_parameters={"main": {**ROPE, "rope_theta": 5000.0},
                              "compress": {**ROPE, "rope_theta": 80000.0}})


def fields_of(tmp_path, **change):
    """ctxpar's model.* of the config.json DeepseekV4Config writes, keys changed (None:
    removed)."""
    DeepseekV4Config(**SMALL).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return hf.model_fields(hf.read_config(str(tmp_path)), str(tmp_path))


@pytest.mark.quick
def test_the_flat_rope_form_reads_as_the_nested_one(tmp_path):
    """rope_theta, compress_rope_theta and partial_rotary_factor without rope_parameters
    (DeepseekV4Config nests them) give the fields of the nested form; the top-level
    partial_rotary_factor and qk_rope_head_dim its class writes beside the nested form
    change nothing (the nested one is read)."""
    nested = fields_of(tmp_path / "a")
    assert nested["partial_rotary_factor"] == 0.5 and nested["rope_theta"] == 5000.0
    assert nested["layer_rope"] == {k: {"rope_theta": 80000.0} for k in SMALL["layer_types"][1:]}
    assert nested["moe"].hash_layers == [0] and nested["hyper_connections"].streams == 2
    flat = fields_of(tmp_path / "b", rope_parameters=None, rope_theta=5000.0,
                     compress_rope_theta=80000.0, partial_rotary_factor=0.5)
    assert flat == nested
    ModelConfig(**nested)  # a model ctxpar builds


@pytest.mark.parametrize("field,value,words", [
    ("scoring_func", "sigmoid", "scoring_func='sigmoid': ctxpar reads DeepSeek-V4's "
                                "sqrtsoftplus router only"),
    ("n_shared_experts", 2, "n_shared_experts=2: transformers' DeepseekV4MLP is one shared "
                            "expert"),
    ("output_router_logits", True, "output_router_logits=True: the load-balancing loss"),
    ("router_jitter_noise", 0.1, "router_jitter_noise=0.1: router noise is not built"),
    ("rope_parameters", {"main": {**ROPE, "rope_theta": 1e4}, "compress": {
        **ROPE, "rope_type": "yarn", "factor": 16.0, "rope_theta": 1.6e5}},
     "rope_parameters.compress="),
    ("rope_parameters", {"main": {**ROPE, "rope_theta": 1e4},
                         "compress": {**ROPE, "partial_rotary_factor": 0.25}},
     "one partial_rotary_factor for main and compress"),
    ("mlp_layer_types", ["hash_moe", "dense", "moe"], "one of 'hash_moe', 'moe' per layer"),
    ("layer_types", ["full_attention"] * 3, "one of ['sliding_attention', "),
    ("compress_rates", {"compressed_sparse_attention": 4}, "one rate for each of"),
    ("hc_mult", 0, "hc_mult=0: config.json must give it as an integer >= 1"),
    ("swiglu_limit", None, None),  # absent: its class's 10.0, read
    ("quantization_config", {"quant_method": "fp8"}, "quantized weights is not implemented"),
    ("num_hash_layers", 3, "num_hash_layers=3: a config field ctxpar does not know"),
    ("intermediate_size", 64, "intermediate_size=64: names moe_intermediate_size=32"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling={'rope_type': "),
])
def test_v4_fields_ctxpar_does_not_build_are_refused_naming_them(tmp_path, field, value,
                                                                words):
    if words is None:
        assert fields_of(tmp_path, **{field: value})["swiglu_limit"] == 10.0
        return
    with pytest.raises(CheckpointError) as e:
        fields_of(tmp_path, **{field: value})
    assert words in str(e.value) and "config.json" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_v4_models_the_family_cannot_hold_are_refused_at_export(tmp_path):
    """Without mHC, with the compressed layers' bases apart, with the experts not on every
    layer; a model without layer_rope exports (its config.json reads back as it)."""
    from dataclasses import replace
    from ctxpar.checkpoint.export_check import check_exportable
    m = ModelConfig(**fields_of(tmp_path))
    assert hf.family_config(m)["mlp_layer_types"] == ["hash_moe", "moe", "moe"]
    # compressed layers at the model's own base: model.layer_rope unset reads back the same
    check_exportable(replace(m, layer_rope=None))
    for change, words in (
            (dict(hyper_connections=None), "model.hyper_connections=None"),
            (dict(layer_rope={"compressed_sparse_attention": {"rope_theta": 1.0},
                              "heavily_compressed_attention": {"rope_theta": 2.0}}),
             "one default RoPE for the sliding layers, one for the compressed ones"),
            (dict(moe=replace(m.moe, layers=[1, 2], hash_layers=[1])),
             "experts on every layer")):
        with pytest.raises(CheckpointError) as e:
            hf.family_config(replace(m, **change))
        assert words in str(e.value) and "DeepseekV4ForCausalLM" in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
