"""Bytes of activations a one-process GPT saves for backward under an activation-
checkpointing mode (the test twin of tools/benchmarks/bench_activation_memory.py's)."""
from ctxpar.config import ModelConfig
from ctxpar.testing.memory import forward_saved_bytes
from models.gpt import GPT
from models.options import ModelOptions


def measure(cfg: ModelConfig, mode: str, batch: int, every_n_layers: int = 2,
            seed: int = 0) -> int:
    """Saved bytes of one forward + loss of a tp=cp=1 GPT in ``mode``."""
    model = GPT(cfg,
                options=ModelOptions(activation_checkpointing=mode, every_n_layers=every_n_layers,
                                     seed=seed))
    return forward_saved_bytes(model, cfg.vocab_size, batch, cfg.seq_len, seed)
