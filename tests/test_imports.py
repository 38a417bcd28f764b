"""The library stands on its own: nothing under ctxpar/ imports the application above it
(models/, train.py, generate.py), the tools or the tests, at any depth of a function."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABOVE = ("models", "tools", "tests", "helpers", "train", "generate")


def _imports(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_ctxpar_imports_nothing_above_it():
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "ctxpar")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found += [f"{os.path.relpath(path, ROOT)}: {mod}" for mod in _imports(path)
                          if mod.split(".")[0] in ABOVE]
    assert not found, "\n".join(found)


def test_the_model_offers_what_ctxpar_needs():
    from ctxpar.config import ModelConfig
    from ctxpar.interfaces import CausalLM
    from models.gpt import GPT
    model = GPT(ModelConfig(vocab_size=64, seq_len=16, n_layers=1, d_model=32, n_heads=4),
                device="meta")
    assert isinstance(model, CausalLM)
