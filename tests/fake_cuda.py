"""A process where this CPU-only torch has a CUDA device (that runs nothing), for the dry run.

    python tests/fake_cuda.py [pytest args]      # tests/cuda_dry_cases.py and
                                                 # cuda_dry_linear_cases.py, e.g. -k ring

``fake_cuda.cpp`` gives the CPU build a CUDA device guard and CUDA hooks, so indexing,
``.contiguous()`` and autograd's engine accept fake cuda tensors (tests/cuda_dry.py).
torch reads its CUDA hooks once, when it starts, so the cases run in a child process
that loads the library before ``import torch``; tests/test_cuda_dry.py starts it. The
library is built with g++ once per source, torch and compiler, and cached (~3 s).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fake_cuda.cpp")
CASES = [os.path.join(HERE, name) for name in ("cuda_dry_cases.py",
                                                 "cuda_dry_linear_cases.py")]
CHILD_ENV = "CTXPAR_FAKE_CUDA_LIBRARY"  # set in the child: the library it loaded



def private_api_problem() -> str:
    """'' when the private torch APIs the dry run builds on are where it expects them, else
    which one moved (the dry run then skips with this reason)."""
    try:
        from torch._subclasses.fake_tensor import (FakeTensor, FakeTensorMode,  # noqa: F401
                                                   unset_fake_temporarily)
        from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
        from torch.utils._pytree import tree_leaves  # noqa: F401
        from torch.utils.weak import WeakIdKeyDictionary  # noqa: F401
    except ImportError as e:
        return f"torch moved a private API the CUDA dry run needs ({e})"
    return ""


def guard_library() -> str:
    """Path of fake_cuda.cpp built as a shared library (built once per source, torch and
    compiler; cached under TORCH_EXTENSIONS_DIR like torch's own JIT extensions). Builds
    with g++ directly: torch.utils.cpp_extension.load would also load it into this
    process, which must keep its real (absent) CUDA."""
    import torch
    from torch.utils import cpp_extension
    cxx = os.environ.get("CXX", "c++")
    flags = ["-shared", "-fPIC", "-O1", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-isystem{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    flags += [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10",
                                                                            "-ltorch_cpu"]
    key = hashlib.sha256("\n".join([open(SOURCE).read(), torch.__version__, cxx, *flags])
                         .encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    out = os.path.join(root, "ctxpar_fake_cuda", key, "fake_cuda.so")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = f"{out}.{os.getpid()}.tmp"
        subprocess.run([cxx, SOURCE, "-o", tmp, *flags], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, out)  # atomic: concurrent builders never see half a file
    return out


def preload(library: str) -> None:
    """Load torch's core libraries and the fake CUDA library, before `import torch`."""
    if "torch" in sys.modules:
        raise RuntimeError("the fake CUDA library must be loaded before torch is imported")
    lib = os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib")
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    os.environ[CHILD_ENV] = library


def child_command(library: str, pytest_args=()) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), "--library", library, "--",
            *CASES, "-q", "-p", "no:cacheprovider", *pytest_args]


def child_env() -> dict:
    """The caller's environment with the repository first on the path (the child runs
    this file, so Python would otherwise start it from tests/)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE),
                                                    env.get("PYTHONPATH")) if p)
    return env


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--library"]:  # the child: load, then run the cases under pytest
        library, rest = argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:]
        preload(library)
        import pytest
        return pytest.main(rest)
    # A developer's direct run: build in a throwaway process (it imports torch), then run.
    lib = subprocess.run([sys.executable, "-c", "import fake_cuda; print(fake_cuda."
                          "guard_library())"], cwd=HERE, check=True, capture_output=True,
                         text=True).stdout.strip()
    return subprocess.call(child_command(lib, argv), env=child_env())


if __name__ == "__main__":
    sys.exit(main())
