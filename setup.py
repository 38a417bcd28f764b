"""ctxpar: context-parallel (ring attention) training for long-context GPT pretraining."""
from setuptools import find_packages, setup

setup(
    name="ctxpar",
    version="0.1.0",
    description="Ring-attention context parallelism composed with TP, PP and DP on DeepSpeed",
    python_requires=">=3.10",
    packages=find_packages(include=["ctxpar", "ctxpar.*", "models", "models.*"]),
    py_modules=["train", "generate", "verify"],
    install_requires=[
        # torch is pinned by the Makefile *before* this install (a CPU wheel); a newer
        # torch from PyPI would pull several GB of CUDA packages onto CPU machines.
        "torch>=2.4",
        "deepspeed>=0.16",
        "pyyaml>=6",
        "wandb>=0.17",
        "tqdm",
        "numpy",
        "zstandard",  # .zst corpora in tools/preprocess_data.py
        "safetensors",  # Hugging Face Llama export/import (ctxpar/checkpoint/hf.py)
        "matplotlib",  # the planner's --plot and tools/plot_runs.py
    ],
    extras_require={
        # transformers: tests compare ctxpar's Llama import/export with it (no downloads);
        # it brings tokenizers, for the tokenizer test files. No torch of its own.
        "dev": ["pytest>=8", "transformers>=4.45"],
        # Dao's flash-attention kernels (CUDA only, builds from source against your torch).
        # The linear mixers' kernels (ctxpar/context_parallel/linear/gpu_kernels.py):
        # flash-linear-attention's ops (fla-core: Triton, pure Python) for Gated DeltaNet,
        # mamba-ssm's SSD and causal-conv1d for Mamba2 and the short conv (both compile CUDA
        # against your torch, or take a matching prebuilt wheel). Each is optional: without
        # it ctxpar runs its torch kernels and logs why once.
        # NVIDIA apex (fused norms) is optional too but is NOT on PyPI: build it from
        # https://github.com/NVIDIA/apex; the PyPI package called "apex" is unrelated.
        "gpu": ["flash-attn>=2.5", "fla-core>=0.5,<0.7", "mamba-ssm>=2.2.6",
                "causal-conv1d>=1.4"],
    },
)
