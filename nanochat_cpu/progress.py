"""How far the run is and when it ends: the step line's `(12.0%) ... elapsed=5.2m eta=1.3h`.

The estimate is wall time between step lines, so whatever runs between two steps (evaluations,
checkpoints, outer syncs, samples, a slow peer) is counted as the run will pay it again:

    eta = remaining steps x (wall time of the last `span` steps) / span

`span` is at least MIN_WINDOW steps and, with local steps (`--sync-every H`), a whole number of
outer periods: any H x k consecutive steps hold exactly k outer syncs, so the estimate does not
jump at each of them. Until a window's worth of steps has run it uses what there is (whole
periods once one has run). Only this process's steps count: a resumed run starts afresh.

`PhaseTimes` sums what the timing lines report per step (compute, waits, wall, an outer sync's
share) over a window of steps: one step when synchronous, whole inner phases with local steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MIN_WINDOW = 20  # steps: long enough to smooth one slow step, short enough to follow a change of speed


def human_duration(seconds: float) -> str:
    """`45s`, `12.3m`, `5.2h`, `3.1d`: hours up to two days, so a multi-day run reads in days."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def window_steps(period: int) -> int:
    """The steps the estimate averages over: MIN_WINDOW rounded up to whole outer periods."""
    return period * math.ceil(MIN_WINDOW / period)


@dataclass
class Progress:
    step: int
    total: int
    elapsed_s: float
    eta_s: float

    @property
    def percent(self) -> float:
        return 100 * self.step / self.total

    def line_head(self) -> str:
        return f"step {self.step:05d}/{self.total:05d} ({self.percent:.1f}%)"

    def line_tail(self) -> str:
        return f"elapsed={human_duration(self.elapsed_s)} eta={human_duration(self.eta_s)}"


class StepClock:
    """The wall-clock times of this process's step lines, and the ETA they give.

    `started_at` is when the loop began (at step 0, or at the step a run resumed from), and `lap`
    is called once a step, in order; every time is a caller's clock reading (time.perf_counter()
    in the trainer), so a test feeds its own."""

    def __init__(self, total: int, started_at: float) -> None:
        self.total = total
        self.started_at = started_at
        self.times: deque[float] = deque([started_at])  # one a step line, consecutive steps

    def lap(self, step: int, now: float, period: int = 1) -> Progress:
        """Record the line of `step` at `now`; `period`: steps per outer sync (1 when synchronous)."""
        self.times.append(now)
        window = window_steps(period)
        while len(self.times) > window + 1:
            self.times.popleft()
        done = len(self.times) - 1
        span = min(window, done // period * period) or done  # whole periods once there is one
        per_step = (now - self.times[-1 - span]) / span
        return Progress(step, self.total, now - self.started_at, (self.total - step) * per_step)


@dataclass
class PhaseTimes:
    """Seconds summed over the steps of an inner phase: the timing lines' per-step means."""

    compute_s: float = 0.0
    wait_s: float = 0.0  # the steps' own waits, the outer sync's but
    wall_s: float = 0.0  # the same
    sync_s: float = 0.0  # the outer sync's wait: a cost of every step of the phase
    steps: int = 0
    earlier: int = 0  # the phase's steps before a new split, not timed here: the sync spreads over them too

    def add(self, compute_s: float, wait_s: float, wall_s: float, sync_s: float = 0.0) -> None:
        """A step's seconds; `sync_s` of its wait and wall was the outer sync's."""
        self.compute_s += compute_s
        self.wait_s += wait_s - sync_s
        self.wall_s += wall_s - sync_s
        self.sync_s += sync_s
        self.steps += 1

    def per_step(self) -> tuple[float, float, float]:
        n = max(1, self.steps)
        sync = self.sync_s / (n + self.earlier)
        return self.compute_s / n, self.wait_s / n + sync, self.wall_s / n + sync

    def restarted(self) -> PhaseTimes:
        """The same phase timed afresh from here (a new split): its steps so far count as earlier,
        and the outer syncs in them (a timing window spans phases with local steps) spread over all."""
        return PhaseTimes(sync_s=self.sync_s, earlier=self.steps + self.earlier)
