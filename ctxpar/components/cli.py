"""What the entrypoints (train.py, generate.py) share: the bad-input exit, the launcher's flag."""
from __future__ import annotations

import argparse
import logging
import os
import sys

EXIT_BAD_INPUT = 2


def add_launcher_args(p: argparse.ArgumentParser) -> None:
    """Flags a launcher passes to the script (the deepspeed launcher's --local_rank)."""
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher (LOCAL_RANK is used instead)")


def fail(msg: str, code: int = EXIT_BAD_INPUT):
    """One line on stderr from every rank, then exit (before any collective)."""
    print(f"[rank {os.environ['RANK']}] error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def warn(msg: str):
    """A warning line on stderr, from rank 0 only (for verdicts every rank reaches alike)."""
    if os.environ["RANK"] == "0":
        print(f"warning: {msg}", file=sys.stderr, flush=True)


class _Stderr(logging.Handler):
    """Writes to whatever sys.stderr is when a record comes (not when the handler was made)."""

    def emit(self, record):
        print(self.format(record), file=sys.stderr, flush=True)


def show_ctxpar_logs(rank0: bool) -> None:
    """ctxpar's own INFO lines (e.g. which attention kernel 'auto' chose) on rank 0's stderr.

    Only the 'ctxpar' logger: third-party INFO chatter stays where it was; stdout stays the
    program's output (generate.py's answers).
    """
    logger = logging.getLogger("ctxpar")
    if rank0 and not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
