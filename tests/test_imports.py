"""The house: the library stands on its own (nothing under ctxpar/ imports the application
above it, models/ and the entrypoints, the tools or the tests, at any depth of a function);
no import circle among the house's files (at any depth of a function either); no
entrypoint imports another (what two share lives in an importable module); no
sys.path.insert; no function over 120 lines."""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABOVE = ("models", "tools", "tests", "helpers", "train", "generate", "verify")
SKIP = {".venv", ".git", "build", "runs", "__pycache__"}


def _python_files(*tops):
    for top in tops:
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            yield path
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d not in SKIP and not d.endswith(".egg-info")]
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def _module_name(path):
    return os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")


def _is_entrypoint(path):
    """A program: train.py, generate.py, verify.py, or a tools/ file run as one."""
    with open(path) as f:
        src = f.read()
    return (os.path.dirname(path) == ROOT or os.path.basename(path) == "__main__.py"
            or "if __name__ == \"__main__\"" in src)


def _imports(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def _imported_files(path):
    """The house's files that `path` imports (any depth of a function), an import of a
    package's __init__.py followed to the file that defines each name taken from it (a
    package's face hands names on; the file that defines one is what is imported)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _files_of(alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1 packages
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in parts + [base] if p and p != ".")
            yield from _files_of(base, [a.name for a in node.names])


def _files_of(module, names):
    """The files an import of `names` from `module` reads (none outside the house)."""
    path = os.path.join(ROOT, *module.split("."))
    if os.path.isfile(path + ".py"):
        yield path + ".py"
    elif os.path.isfile(os.path.join(path, "__init__.py")):
        init = os.path.join(path, "__init__.py")
        handed_on = _handed_on(init)
        for name in names or [None]:
            if name is not None and (os.path.isfile(os.path.join(path, name + ".py")) or
                                     os.path.isdir(os.path.join(path, name))):
                yield from _files_of(f"{module}.{name}", ())
            elif name in handed_on:
                yield from _files_of(f"{module}.{handed_on[name]}", [name])
            else:
                yield init


def _handed_on(init):
    """name -> the submodule a package's __init__.py imports it from (`from .x import name`)."""
    with open(init) as f:
        tree = ast.parse(f.read(), init)
    return {a.asname or a.name: node.module for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
            for a in node.names}


def import_circles(tops=("ctxpar", "models", "tools", "train.py", "generate.py", "verify.py")):
    """Every import circle among the files under `tops`: groups of files that import each
    other in a loop (Tarjan's strongly connected components of the import graph)."""
    files = list(_python_files(*tops))
    edges = {f: sorted({g for g in _imported_files(f) if g != f}) for f in files}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan, recursive: the graph is a few hundred files deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for f in files:
        if f not in index:
            visit(f)
    return [[os.path.relpath(f, ROOT) for f in group] for group in circles]


@pytest.mark.quick
def test_no_import_circles():
    # What two files both need moves down a floor (a file of its own) instead.
    circles = import_circles()
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.quick
def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    # Two files that import each other, one of them inside a function, through a package face.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\nfrom .b import B\n")
    (pkg / "a.py").write_text("A = 1\ndef f():\n    from pkg import B\n    return B\n")
    (pkg / "b.py").write_text("from .a import A\nB = A\n")
    (pkg / "c.py").write_text("from pkg import A\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert import_circles(("pkg",)) == [["pkg/a.py", "pkg/b.py"]]


@pytest.mark.quick
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


@pytest.mark.quick
def test_no_entrypoint_imports_another():
    # A script that is also a library breaks when someone edits "just the script", and
    # `python -m` and torchrun see different module names for it.
    entry = [p for p in _python_files("train.py", "generate.py", "verify.py", "tools")
             if _is_entrypoint(p)]
    names = {_module_name(p) for p in entry}
    assert {"train", "generate", "verify", "tools.preprocess_data"} <= names
    found = [f"{os.path.relpath(p, ROOT)}: {mod}" for p in entry for mod in _imports(p)
             if mod in names or any(mod.startswith(n + ".") for n in names)]
    assert not found, "\n".join(found)


@pytest.mark.quick
def test_no_sys_path_insert_and_no_function_over_120_lines():
    found = []
    for path in _python_files("ctxpar", "models", "tools", "tests", "train.py", "generate.py",
                              "verify.py", "setup.py"):
        with open(path) as f:
            src = f.read()
        rel = os.path.relpath(path, ROOT)
        if "sys.path.insert(" in src and not rel.endswith("test_imports.py"):
            found.append(f"{rel}: sys.path.insert")
        for node in ast.walk(ast.parse(src, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 120:
                    found.append(f"{rel}:{node.lineno}: {node.name} is {n} lines")
    assert not found, "\n".join(found)


@pytest.mark.quick
def test_train_main_is_one_screen():
    # train.py decides the kind of step once (models/steps.py): main() at most 80 lines,
    # its loop at most 30 and without a branch on the kind of step.
    with open(os.path.join(ROOT, "train.py")) as f:
        tree = ast.parse(f.read())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 80
    loops = [n for n in ast.walk(main) if isinstance(n, (ast.While, ast.For))]
    assert len(loops) == 1 and loops[0].end_lineno - loops[0].lineno + 1 <= 30
    kinds = {"dynamic", "pipelined", "pp", "dynamic_cp", "moe"}
    names = {n.id for n in ast.walk(loops[0]) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(loops[0]) if isinstance(n, ast.Attribute)}
    assert not names & kinds, names & kinds
