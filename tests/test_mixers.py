"""The mixers' registry (models/mixers.py): every kind a layer type names is registered,
each builds under its Hugging Face name and offers the token mixer's interface, the model
never branches on a kind, and a new kind is a module and a registry line."""
import ast
import os

import pytest
import torch

from ctxpar.config import LayerAttention, ModelConfig
from ctxpar.config.layer_mixers import ATTENTION_MIXERS, LAYER_MIXERS
from ctxpar.config.parameters import TOKEN_MIXER_PARAMETERS
from ctxpar.context_parallel import ContextParallel
from ctxpar.testing.linear import HYBRID_CONFIGS
from models.block import Block
from models.gpt import GPT
from models.mixers import CHANNEL_MIXERS, TOKEN_MIXERS
from models.moe import MoE
from models.options import LayerArgs
from models.token_mixer import TokenMixer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.quick
def test_every_mixer_a_layer_type_names_is_registered():
    tokens = {token for token, _ in LAYER_MIXERS.values()} - {None}
    channels = {channel for _, channel in LAYER_MIXERS.values()} - {None}
    assert set(TOKEN_MIXERS) == tokens | set(ATTENTION_MIXERS)  # MLA in attention's place
    assert set(CHANNEL_MIXERS) == channels | {"moe", "moe_beside_mlp"}  # model.moe's two
    # the planner's description of their parameters, under the same names
    assert {k: v[0] for k, v in TOKEN_MIXER_PARAMETERS.items()} == {
        k: kind.attribute for k, kind in TOKEN_MIXERS.items()}


@pytest.mark.quick
def test_each_token_mixer_stands_under_its_hugging_face_name():
    for cfg in HYBRID_CONFIGS.values():
        model = GPT(cfg, device="meta")
        for block, a in zip(model.layers, model.layer_attention):
            if a.token_mixer is None:
                assert block.mixer is None and block.attn_norm is None
                continue
            name = TOKEN_MIXERS[a.token_mixer].attribute
            assert block.mixer is getattr(block, name) and isinstance(block.mixer, TokenMixer)
            assert any(n.startswith(f"{name}.") for n, _ in block.named_parameters())
            assert (block.mlp is None) == (a.channel_mixer is None)


@pytest.mark.quick
def test_a_moe_layer_gets_the_moe_channel_mixer():
    from ctxpar.config.moe import MoEConfig
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=4,
                      moe=MoEConfig(num_experts=4, top_k=2, layers=[1]))
    model = GPT(cfg, device="meta")
    assert [isinstance(b.mlp, MoE) for b in model.layers] == [False, True]


@pytest.mark.quick
def test_the_model_names_no_mixer_kind():
    # The Block, the GPT and its pipeline form ask the registry; none compares a layer's
    # kind with a name (an if/elif per kind is what the registry replaces).
    kinds = set(TOKEN_MIXERS) | set(CHANNEL_MIXERS)
    found = []
    for name in ("block.py", "gpt.py", "gpt_pipe.py"):
        path = os.path.join(ROOT, "models", name)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        found += [f"models/{name}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Compare) and any(
                      isinstance(c, ast.Constant) and c.value in kinds
                      for c in [node.left, *node.comparators])]
    assert not found, found


class Doubling(TokenMixer):
    """A toy kind: y = 2 w x per channel (a token mixer only in name)."""

    @classmethod
    def from_layer(cls, args):
        return cls(args.cfg.d_model)

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((d,), 2.0))

    def forward(self, x, cu_seqlens=None, cache=None):
        return x * self.weight


@pytest.mark.quick
def test_a_new_kind_is_a_module_and_a_registry_line(monkeypatch):
    from models.mixers import TokenMixerKind
    monkeypatch.setitem(LAYER_MIXERS, "doubling", ("doubling", None))
    monkeypatch.setitem(TOKEN_MIXERS, "doubling", TokenMixerKind("doubler", Doubling.from_layer))
    cfg = ModelConfig(vocab_size=64, seq_len=8, n_layers=1, d_model=8, n_heads=2)
    layer = LayerAttention("doubling", None, None, 10000.0, None)
    block = Block(LayerArgs(cfg, layer, ContextParallel()))
    torch.nn.init.ones_(block.attn_norm.weight)
    assert [n for n, _ in block.named_parameters()] == ["attn_norm.weight", "doubler.weight"]
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))
    want = x + 2 * torch.nn.functional.rms_norm(x, (8,), eps=cfg.norm_eps)
    torch.testing.assert_close(block(x, None, None), want)
