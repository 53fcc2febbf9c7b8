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

import math
import os
import signal
from dataclasses import dataclass

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


# ---- whether a stop still fits the time it is given -------------------------------------------------

TORCHRUN_SHUTDOWN_S = 30.0  # torchrun's own default, where TORCH_ELASTIC_SHUTDOWN_TIMEOUT is unset


def shutdown_budget_s() -> float | None:
    """Seconds torchrun gives the ranks after SIGTERM before it kills them (the unit sets it from
    trainer_graceful_stop_sec); None for a process torchrun did not start: nothing kills it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_SHUTDOWN_S))


@dataclass
class StopBudget:
    """A stop finishes the step it arrives in and the next (the ranks agree on it one step late; with
    local steps an outer sync ends it), waits for a checkpoint still crossing in the background,
    then writes its own with every rank waiting. On a slow link that can take longer than torchrun
    waits, and past it the ranks are killed mid-way: the run then resumes from its last sealed
    checkpoint and loses the steps since. Said once, when the checkpoints measured so far show it,
    with the setting that would hold it."""

    budget_s: float | None
    said: bool = False

    def check(self, step: int, step_s: float, took: list[tuple[int, float] | None], crossing: bool) -> str | None:
        """The warning to log, or None. step_s: the steps a stop still runs (with local steps an outer
        sync in them; overlapped, also the one in flight); took: the last checkpoints' (step, seconds
        to reach every disk) where known; crossing: checkpoints cross in the background, so a stop
        may meet one on its way."""
        known = [t for t in took if t is not None]
        if self.budget_s is None or self.said or not known:
            return None
        checkpoint_step, checkpoint_s = max(known, key=lambda t: t[1])
        checkpoints = 2 if crossing else 1
        need = step_s + checkpoints * checkpoint_s
        if need <= self.budget_s:
            return None
        self.said = True
        graceful = math.ceil(need * 1.5 / 60) * 60  # room for a slower link tomorrow, in whole minutes
        met = "the checkpoint still crossing, then its own" if crossing else "then its checkpoint"
        return (f"WARNING at step {step}: a stop (systemctl stop, stop.yml, a restart) would take ~{need:.0f} s "
                f"here: the steps to the one it stops at ({step_s:.0f} s), {met} ({checkpoint_s:.0f} s each, as "
                f"checkpoint step {checkpoint_step} took), more than the {self.budget_s:.0f} s torchrun gives the "
                f"ranks after SIGTERM (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Past it they are killed mid-checkpoint and "
                f"the run resumes from its last sealed checkpoint, losing the steps since. Fix: ansible-playbook "
                f"site.yml -e trainer_graceful_stop_sec={graceful} -e trainer_stop_timeout_sec={graceful + 30}")
