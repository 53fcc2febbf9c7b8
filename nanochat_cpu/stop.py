"""A graceful stop: SIGTERM (systemctl stop, stop.yml, train.yml's restart) ends the run at a step
every rank agrees on, with a checkpoint at that step, so the resumed run loses none.

The signal only raises a flag. After each step every rank adds its flag to one small all-reduce
(MAX) on a process group of its own, started after step k and read after step k + 1: it runs
while a whole step computes, so it costs no waiting (with local steps it is the only traffic
between nodes in an inner phase: four bytes a step), and every rank reads the same value after the
same step, whichever rank the signal reached. All of them stop together, even when only one was
signalled; the stop comes one step after the signal at the latest, and a signal during set-up
stops the run before its first step (that all-reduce is waited for).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from .dist import DistEnv, Watchdog


class GracefulStop:
    def __init__(self, env: DistEnv):
        self.requested = False  # this rank got SIGTERM
        self.env = env
        # gloo whatever the backend: a CPU flag, and never queued behind the model's collectives
        self.group = dist.new_group(backend="gloo") if env.distributed else None
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.pending: dist.Work | None = None
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.requested = True

    def agreed(self, step: int, watchdog: Watchdog) -> bool:
        """Called by every rank before the first step and after each: whether all of them stop now.
        The first call waits for its all-reduce: a stop during set-up ends the run before step one."""
        if self.group is None:
            return self.requested
        if self.pending is None:
            self._send()
        with watchdog.phase("all_reduce stop flag", step):
            self.pending.wait()
        stop = bool(self.flag.item())
        self._send()
        return stop

    def _send(self) -> None:
        self.flag.fill_(int(self.requested))
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def close(self, step: int, watchdog: Watchdog) -> None:
        """Wait for the last flag every rank sent, before the process group goes."""
        if self.pending is not None:
            with watchdog.phase("all_reduce stop flag", step):
                self.pending.wait()
            self.pending = None
