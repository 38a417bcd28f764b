"""Stop cleanly when the scheduler says so: SIGTERM / SIGUSR1 -> finish the step, save, exit.

    guard = PreemptionGuard(device)           # installs the handlers (train.py, before the loop)
    ...after every optimizer step:
    if guard.should_stop():                   # collective: every rank gets the same answer
        save; exit 0
    guard.close()                             # the previous handlers back

Slurm sends SIGUSR1 ahead of the time limit when asked (``--signal=USR1@120``,
tools/slurm/train.sbatch) and SIGTERM at the limit or on preemption; torchrun forwards
SIGTERM to its workers. A handler only records the signal: the step in flight (forward,
backward, the collectives of DeepSpeed's step) runs to its end. Ranks may see the signal
at different moments (one before its step's all-reduce, another after), so after every
step ``should_stop`` all-reduces "seen" (MAX) over the world: all ranks stop after the
same step, save the same checkpoint together and leave no rank waiting in a collective.
One scalar all-reduce per step; nothing else changes while no signal arrives.
"""
from __future__ import annotations

import signal
from typing import Optional, Sequence

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionGuard:
    def __init__(self, device=None, signals: Sequence[int] = SIGNALS):
        self.device = device
        self.received: Optional[int] = None  # the first signal this rank saw
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def should_stop(self, group=None) -> bool:
        """Collective: True on every rank once any rank has received a signal."""
        seen = torch.tensor([0 if self.received is None else 1], dtype=torch.int32,
                            device=self.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        return bool(seen.item())

    @property
    def reason(self) -> str:
        return signal.Signals(self.received).name if self.received else "another rank's signal"

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
