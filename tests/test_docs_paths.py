"""Every repository path the README and docs/*.md name exists, every module they run with
`python -m` is there, and every package of ctxpar/ has its row in the README's map: a
file moved or renamed without its docs fails here."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
PATH = re.compile(r"(?<![\w./-])((?:ctxpar|models|tools|tests|configs|docs)/[\w./*-]*\w/?)")
MODULE = re.compile(r"python -m ((?:tools|ctxpar)[\w.]*)")
PLACEHOLDERS = {"configs/X.yaml"}  # the README's "deepspeed train.py --config configs/X.yaml"


def _text(doc):
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


@pytest.mark.quick
def test_named_paths_and_modules_exist():
    missing = []
    for doc in DOCS:
        text = _text(doc)
        for path in set(PATH.findall(text)) - PLACEHOLDERS:
            full = os.path.join(ROOT, path)
            if not (glob.glob(full) if "*" in path else os.path.exists(full)):
                missing.append(f"{doc}: {path}")
        for module in set(MODULE.findall(text)):
            base = os.path.join(ROOT, *module.split("."))
            if not (os.path.isfile(base + ".py") or os.path.isdir(base)):
                missing.append(f"{doc}: python -m {module}")
    assert not missing, "\n".join(sorted(missing))


@pytest.mark.quick
def test_every_package_is_on_the_readme_map():
    text = _text("README.md")
    packages = sorted(d for d in os.listdir(os.path.join(ROOT, "ctxpar"))
                      if os.path.isfile(os.path.join(ROOT, "ctxpar", d, "__init__.py")))
    assert packages and not [p for p in packages if f"`ctxpar/{p}/`" not in text], packages


@pytest.mark.quick
def test_the_families_table_has_one_row_per_registered_family():
    """docs/checkpoints.md's families table names each family of
    ctxpar/config/hf_families.py once, with its architecture: a family added
    without its row (or a row left for one removed) fails here."""
    from ctxpar.checkpoint.families import FAMILIES
    rows = re.findall(r"^\| `(\w+)` \| `(\w+ForCausalLM)` \|", _text("docs/checkpoints.md"),
                      re.MULTILINE)
    assert sorted(rows) == sorted((name, fam.architecture) for name, fam in FAMILIES.items())
