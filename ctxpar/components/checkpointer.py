"""The component that owns when train.py saves: every checkpoint.save_interval steps, at
the last step, and when a preemption signal stops the run (ctxpar/checkpoint/preemption.py).

    checkpointer = Checkpointer(engine, save_dir, cfg.checkpoint.save_interval, meta, stream)
    checkpointer.save(step, last_step=step == cfg.train.steps, force=stopped)
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from .. import checkpoint as ckpt


class Checkpointer:
    def __init__(self, engine, save_dir: str, interval: int, meta: Dict[str, Any], stream):
        self.engine, self.save_dir, self.interval = engine, save_dir, interval
        self.meta = meta      # the manifest's layout and config (checkpoint.checkpoint_meta)
        self.stream = stream  # the train stream: its position goes into the client state

    def should_save(self, step: int, last_step: bool = False) -> bool:
        return last_step or bool(self.interval and step % self.interval == 0)

    def save(self, step: int, last_step: bool = False, force: bool = False) -> Optional[str]:
        """Collective when it saves: the checkpoint's directory, or None when not due."""
        if not (force or self.should_save(step, last_step)):
            return None
        tag = ckpt.save(self.engine, self.save_dir, step,
                        {"step": step, "data": self.stream.state_dict()}, self.meta)
        return os.path.join(self.save_dir, tag)

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint's tag (the one a resume would load)."""
        return ckpt.latest_complete(self.save_dir)
