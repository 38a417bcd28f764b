"""Can this run write where its config says? Checked at load, on every rank, before any
collective: a run dir through a file or in a read-only place is a ConfigError (exit 2,
one line), not a traceback from rank 0 after DeepSpeed has started. Nothing is created."""
from __future__ import annotations

import os

from .sections import Config, ConfigError


def _problem(path: str) -> str:
    """Why a directory cannot be made or written at path ('' when it can)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{path} is not a directory"
        return "" if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):  # the nearest existing ancestor is where mkdir starts
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it: {parent} is not writable"
    return ""


def check_run_dir(cfg: Config) -> None:
    """ConfigError naming the key and path when logging.run_dir, or checkpoint.save_dir
    when set, cannot be created or written."""
    dirs = [("logging.run_dir", cfg.logging.run_dir)]
    if cfg.checkpoint.save_dir:
        dirs.append(("checkpoint.save_dir", cfg.checkpoint.save_dir))
    for key, path in dirs:
        problem = _problem(path)
        if problem:
            raise ConfigError(f"{key}={path!r}: {problem}")
