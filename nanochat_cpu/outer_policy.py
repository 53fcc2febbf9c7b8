"""When the nodes meet: the outer schedule, and auto's rules for H, the warm-up and overlap.

Pure policy: figures in, a choice and its reason out, nothing run or sent (local_steps.py gathers
the figures every rank agrees on and acts on the choice; sync_diloco.py is the outer step itself).

`--sync-every auto` runs a first phase (as long as the synchronous warm-up's wire wait says H
should be, `first_outer_phase`; AUTO_FIRST_PHASE steps where no warm-up was timed), times its
outer sync against the slowest node's inner step, and picks the H at which the sync is at most 5
percent of the wall time (`choose_sync_every`). The sync it times is the last node's to arrive:
the others' also holds their wait for that node, which is the inner phases' imbalance, and a
longer H does not make that any smaller a share of the run. Before that, after timing
AUTO_TIMED_STEPS of the synchronous warm-up's steps, auto asks whether local steps are needed at
all (`keep_synchronous`): on a link fast enough that synchronous steps wait at most 5 percent of
their time, every step stays synchronous, which trains best per token. Where local steps follow,
the warm-up's own waits are held to 5 percent of the run too (`warm_up_end`): on a slow link it
ends sooner than --sync-warmup-ratio asks.

Overlapped (--outer-overlap on), auto times its first sync blocking, then needs only an H whose
phase the sync crosses in (`landing_steps`), with the node's own part of a sync (its CPU too: the
thread takes it from the inner steps) held to 5 percent (`choose_sync_every`). --outer-overlap
auto (the default) times the first sync blocking as well and overlaps only where a blocking one
cannot be held to 5 percent at the H it would run (`choose_overlap`): on a fast link blocking H is
cheap, and the thread's CPU is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .progress import human_duration

AUTO_FIRST_PHASE = 2  # inner steps before auto's first, timed, outer sync: the second is a warm step
AUTO_WIRE_SHARE = 0.05  # auto: the outer sync at most this share of the wall time
AUTO_MAX_H = 100  # auto never goes past the published range (H 30-100): quality drops beyond it
AUTO_TIMED_STEPS = 2  # synchronous steps auto times before it chooses them or local steps
AUTO_OVERLAP_SLACK = 1.5  # overlapped: a sync is given this many times its time to cross before it lands


# ---- when the nodes meet -------------------------------------------------------------------------

@dataclass
class OuterSchedule:
    """Outer boundaries at steps first, first + every, first + 2 every, ... and at the last step.

    `every` 1 is the synchronous run: every step is a boundary, and `due` is `step % period == 0`.
    Until auto has chosen H, `every` is None: the first boundary is the only one known. `start` is
    the step the inner phases began at (after a synchronous warm-up), itself a boundary."""

    first: int
    every: int | None
    last: int
    start: int = 0
    land_after: int | None = None  # --outer-overlap: inner steps an overlapped sync crosses in (None: not timed yet)

    def boundary(self, step: int) -> bool:
        if step == self.last or step == self.first:
            return True
        return self.every is not None and step > self.first and (step - self.first) % self.every == 0

    def previous(self, step: int) -> int:
        """The boundary before `step`: `start` up to the first."""
        if step <= self.first or self.every is None:
            return self.start
        return self.first + (step - self.first - 1) // self.every * self.every

    def due(self, period: int, step: int) -> bool:
        """At boundary `step`: whether something done every `period` steps fell in the phase that
        ended here (evaluations, checkpoints and checksums need every node at theta_global)."""
        return period > 0 and step // period > self.previous(step) // period


def blocking_need(sync_s: float, step_s: float) -> float:
    """The H at which a blocking sync of `sync_s` is AUTO_WIRE_SHARE of the wall time."""
    return (1 - AUTO_WIRE_SHARE) / AUTO_WIRE_SHARE * sync_s / max(step_s, 1e-9)  # sync / (H step + sync) <= share


def choose_sync_every(sync_s: float, step_s: float, work_s: float | None = None) -> tuple[int, str]:
    """H such that one sync per H inner steps is at most AUTO_WIRE_SHARE of the wall time, and why.

    Overlapped (`work_s`: what of a sync the node still pays itself: its weights read, rebased and
    handed on, and the CPU the sync's thread takes from the inner steps), the wire's time is no wait
    where the sync has landed before the next one leaves: H no less than the steps it is given to
    cross (`landing_steps`). That work is held to the share instead; a smaller H trains better."""
    if work_s is not None:
        land, _ = landing_steps(sync_s, step_s, AUTO_MAX_H)
        own = blocking_need(work_s, step_s)
        h = min(AUTO_MAX_H, max(AUTO_FIRST_PHASE, land, math.ceil(own)))
        why = (f"outer sync {sync_s:.2f} s, {work_s:.2f} s of it this node's own work, slowest node's inner step "
               f"{step_s:.2f} s: overlapped, it crosses in {land} inner steps, and its own work is at most "
               f"{AUTO_WIRE_SHARE:.0%} at H >= {own:.1f}")
        if h < max(land, own):
            why += f"; capped at {AUTO_MAX_H} (published range), so its own work is more"
        return h, why
    need = blocking_need(sync_s, step_s)
    h = min(AUTO_MAX_H, max(1, math.ceil(need)))
    share = sync_s / (h * step_s + sync_s)
    why = (f"outer sync {sync_s:.2f} s, slowest node's inner step {step_s:.2f} s: at most "
           f"{AUTO_WIRE_SHARE:.0%} on the wire needs H >= {need:.1f}")
    if h < need:
        why += f"; capped at {AUTO_MAX_H} (published range), so {share:.0%} of the wall time is the sync"
    return h, why


def choose_overlap(sync_s: float, step_s: float, work_s: float, every: int | None) -> tuple[bool, str]:
    """--outer-overlap auto, from the first (blocking, timed) outer sync: whether the next ones
    cross in the background, and why. `every`: the H asked for (None: auto's, at most AUTO_MAX_H).

    Only where a blocking sync cannot be held to AUTO_WIRE_SHARE at that H (auto's H capped, or
    the H asked for too short), and only where overlapped the node's own part of a sync (`work_s`)
    is a smaller share than the blocking sync's. Elsewhere blocking already waits at most the
    share, and an overlapped sync costs what a blocking one does not: its thread's CPU on nodes
    that have no core to spare (measured on 0.5-CPU nodes: 7-16% slower inner steps at H = 2),
    and each node's own progress standing in for the nodes' average until it lands."""
    limit = every or AUTO_MAX_H
    need = blocking_need(sync_s, step_s)
    blocking = sync_s / (limit * step_s + sync_s)
    h = every or choose_sync_every(sync_s, step_s, work_s)[0]
    late = max(0.0, sync_s - h * step_s)  # a sync that has not crossed by the next boundary is waited for there
    overlapped = (work_s + late) / (h * step_s + work_s + late)
    at = f"H = {every}" if every else f"H = {AUTO_MAX_H} (auto's cap)"
    if need <= limit:
        return False, (f"a blocking sync of {sync_s:.2f} s against {step_s:.2f}-s inner steps is at most "
                       f"{AUTO_WIRE_SHARE:.0%} of the wall time from H >= {need:.1f}: blocking")
    verdict = (f"a blocking sync of {sync_s:.2f} s against {step_s:.2f}-s inner steps is {blocking:.0%} of the wall "
               f"time at {at}; overlapped, its {work_s:.2f} s of this node's own work"
               + (f" and {late:.2f} s still crossing at the next boundary" if late else "")
               + f" is {overlapped:.0%} at H = {h}")
    if overlapped < blocking:
        return True, f"{verdict}: overlapped"
    return False, f"{verdict}: blocking"


def landing_steps(sync_s: float, step_s: float, every: int) -> tuple[int, str]:
    """--outer-overlap: the inner steps after its boundary at which an overlapped sync lands, and why:
    AUTO_OVERLAP_SLACK times the steps the first (timed, blocking) sync would take (the inner steps
    slow while it crosses, and a link's speed varies), at least 1 and at most H (it lands at the next
    boundary then). The sooner it lands, the less the nodes' own progress stands in for their average."""
    need = AUTO_OVERLAP_SLACK * sync_s / max(step_s, 1e-9)
    steps = min(every, max(1, math.ceil(need)))
    why = (f"outer sync {sync_s:.2f} s, slowest node's inner step {step_s:.2f} s: {AUTO_OVERLAP_SLACK}x its time "
           f"is {need:.1f} steps")
    if steps == every:
        why += f", so it lands at the next boundary (H = {every})"
    return steps, why


def keep_synchronous(wire_share: float | None) -> tuple[bool, str]:
    """auto, once it timed the synchronous warm-up: whether every step stays synchronous, and why.

    `wire_share` is the share of the warm-up's timed steps that the last rank to arrive spent
    waiting in the optimizer's collectives, which is the wire's own time (the others' wait also
    holds their wait for that rank); None when no step was timed (local_steps.auto_on_resume
    stretches the warm-up to AUTO_TIMED_STEPS timed steps; a process's first step is not timed, it
    allocates). Where
    synchronous steps wait at most AUTO_WIRE_SHARE, local steps have nothing to win: they would
    still pay their outer syncs, each node's optimizer on the whole model (ZeRO-2 shares it out),
    and the quality averaging costs."""
    if wire_share is None:
        return False, "no synchronous step was timed, so local steps follow"
    verdict = (f"synchronous steps waited {wire_share:.1%} of their time on the wire in the warm-up "
               f"(the last rank to arrive)")
    if wire_share <= AUTO_WIRE_SHARE:
        return True, f"{verdict}, at most {AUTO_WIRE_SHARE:.0%}: every step stays synchronous"
    return False, f"{verdict}, over {AUTO_WIRE_SHARE:.0%}: local steps follow"


def first_outer_phase(wire_s: float, work_s: float, ranks_per_node: int = 1, overlap: bool | None = False,
                      bytes_ratio: float = 1.0) -> tuple[int, str]:
    """auto, once it chose local steps from the warm-up: the inner steps before the first outer
    sync, and why. A synchronous step of one rank per node sends what an outer sync sends (the
    others' slices of a gradient, then of the parameters); a node of k ranks sends k ranks' slices
    in it and one node's in an outer sync. So its wire wait `wire_s` / k (k: the most ranks on
    a node, erring short) against `work_s`, a step's work but its waits, already gives the H
    choose_sync_every would take from an outer sync. The first outer sync is timed all the same
    and sets H; this only spares a sync after AUTO_FIRST_PHASE steps (on a slow link, a whole
    sync's wait; 10 Mbit/s at depth 8: ~110 s). Overlapped (--outer-overlap on), H need only be
    the steps a sync takes to cross (`landing_steps`), so the first phase is that long: the sooner
    the first (timed, blocking) sync, the sooner the overlapped ones begin. `overlap` None
    (--outer-overlap auto): overlapped where the blocking H would be capped (`choose_overlap`).
    `bytes_ratio`: an outer sync's bytes per value over a synchronous step's (--outer-compress
    sends fewer: the fewer, the shorter the first phase and, once timed, H)."""
    sync_s = wire_s / ranks_per_node * bytes_ratio
    if overlap is None:
        overlap = blocking_need(sync_s, work_s) > AUTO_MAX_H
    h = landing_steps(sync_s, work_s, AUTO_MAX_H)[0] if overlap else choose_sync_every(sync_s, work_s)[0]
    h = max(AUTO_FIRST_PHASE, h)  # the phase's mean step is timed: a first inner step alone allocates
    per = f", {ranks_per_node} ranks a node: an outer sync sends 1/{ranks_per_node} of it" if ranks_per_node > 1 \
        else ", and an outer sync sends as much"
    if bytes_ratio != 1.0:
        per += f" times {bytes_ratio:.2f} (--outer-compress: its bytes per value over a synchronous step's)"
    return h, (f"the first outer sync after {h} inner steps (a synchronous step waited {wire_s:.2f} s on the "
               f"wire against {work_s:.2f} s of work{per}); its own time sets H")


def warm_up_end(wire_s: float, local_step_s: float, num_iterations: int, planned: int, step: int) -> tuple[int, str]:
    """auto, once it chose local steps at step `step` of a warm-up planned to end at `planned`:
    the step the synchronous steps end at, and why.

    Each synchronous step waits `wire_s` on the wire that a local step does not (the last rank to
    arrive: the others' wait also holds their wait for it). The warm-up buys quality early in a
    run (post-local SGD) with that wait, and auto holds it to what AUTO_WIRE_SHARE of the run's
    wall time buys: the run, once local, takes about `num_iterations` steps of `local_step_s`
    (the slowest rank's step but its waits; a node's optimizer on the whole model makes a local
    step a little longer, so the cap errs short). On a fast link that is the planned warm-up
    (--sync-warmup-ratio); on a slow one a synchronous step waits many local steps' time and the
    warm-up ends sooner, at the earliest now."""
    budget_s = AUTO_WIRE_SHARE * num_iterations * local_step_s
    affordable = int(budget_s / wire_s) if wire_s > 0 else planned
    end = max(step, min(planned, affordable))
    run = f"~{human_duration(budget_s / AUTO_WIRE_SHARE)} ({num_iterations} steps of ~{local_step_s:.2f} s once local)"
    cost = (f"each synchronous step waits {wire_s:.2f} s on the wire, and {AUTO_WIRE_SHARE:.0%} of the run's {run} "
            f"buys {affordable}")
    if end == planned:
        return end, f"the synchronous warm-up keeps its {planned} steps ({cost})"
    return end, f"the synchronous warm-up ends at step {end} instead of {planned} ({cost})"
