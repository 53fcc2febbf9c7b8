"""How the run steps: every step synchronous, or local steps with the nodes meeting every H.

The training loop holds one `SteppingPlan` and asks it, once a step, what is due: nothing, an
overlapped sync landing mid-phase, or an outer boundary where the nodes meet. The plan owns what
the regime needs between steps: the nodes, the outer optimizer (sync_diloco.DiLoCo), the
schedule (outer_policy.OuterSchedule), the synchronous warm-up and auto's choices, overlap, and
the weight each rank's loss gets.

Its life in a run:
1. `open`: which ranks form a node (collective), when --sync-every asks for local steps at all;
2. `resume`: what the checkpoint being resumed says auto chose, and so whether the run resumes
   synchronous (in the warm-up) or with local steps;
3. `begin`: the outer optimizer and schedule from the resumed run state;
4. each step, `computed`, `stepped`, `meet` and `timed`; at a boundary, `choose` (auto, once the
   warm-up's steps are timed) and `warm_up_ends`; then `start_local` continues the warm-up's
   checkpoint with local steps;
5. at each checkpoint, `save_into` the run state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .config import NEVER, sync_every_steps, sync_warmup_steps
from .dist import EXIT_CONFIG, DistEnv, Watchdog, fail, log
from .outer_codec import codec_named
from .outer_policy import (
    AUTO_FIRST_PHASE,
    AUTO_TIMED_STEPS,
    OuterSchedule,
    choose_overlap,
    choose_sync_every,
    first_outer_phase,
    keep_synchronous,
    landing_steps,
    warm_up_end,
)
from .progress import PhaseTimes
from .run_state import AutoChoice, RunState, SavedSchedule, stepping_in_marker
from .sync_diloco import DiLoCo, Nodes, OuterStats, find_nodes, node_token_share, open_background
from .sync_strategy import WIRE_DTYPES

if TYPE_CHECKING:
    from .config import TrainConfig
    from .model import GPT
    from .optim import MuonAdamW
    from .tracking import Tracker


class SteppingPlan:
    def __init__(self, cfg: TrainConfig, env: DistEnv, watchdog: Watchdog, nodes: Nodes | None):
        self.cfg, self.env, self.watchdog = cfg, env, watchdog
        self.nodes = nodes  # None: every step synchronous on every rank, for the whole run
        self.every_asked = sync_every_steps(cfg)  # None: auto
        self.warm_until = sync_warmup_steps(cfg) if nodes else 0  # the synchronous steps before local ones
        self.auto_choice: AutoChoice | None = None  # auto's, once it timed the warm-up
        self.diloco: DiLoCo | None = None  # the outer optimizer, once the local steps began
        self.schedule = OuterSchedule(1, 1, cfg.num_iterations)  # synchronous: every step a boundary
        self.warm = PhaseTimes()  # the synchronous warm-up's steps but this process's first (auto times its wire)
        self.warm_before_resplit = False  # whether some of them ran at a split the check has since replaced
        self.local_run = PhaseTimes()  # every local step this process ran, at the split they run at: the verdict
        self.compute_cpu = [0.0, 0.0]  # CPU and wall seconds of the forward and backward passes since the last sync

    @classmethod
    def open(cls, cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> SteppingPlan:
        """Collective when --sync-every asks for local steps: the nodes, where there is more than one."""
        if sync_every_steps(cfg) == 1 or not env.distributed:
            return cls(cfg, env, watchdog, None)
        nodes = find_nodes(env, watchdog)
        if nodes.count == 1:
            log(env, f"--sync-every {cfg.sync_every}: every rank is on one node, there is nothing to sync between "
                     f"nodes: every step is synchronous")
            return cls(cfg, env, watchdog, None)
        if cfg.outer_overlap == "on" or (cfg.outer_overlap == "auto" and env.device.type != "cuda"):
            nodes.background = open_background(env, nodes, watchdog, cfg.collective_timeout)
        return cls(cfg, env, watchdog, nodes)

    @property
    def local(self) -> bool:
        """Whether the local steps have begun (past the synchronous warm-up)."""
        return self.diloco is not None

    @property
    def warm_up_until(self) -> int:
        """The step the synchronous warm-up ends at, while it lasts (0: not in one)."""
        return 0 if self.local else self.warm_until

    # ---- set-up ----------------------------------------------------------------------------------

    def resume(self, found: tuple[int | None, list[dict[int, dict]]]) -> bool:
        """What auto chose before the checkpoint being resumed (`found`: find_resume_step's), and so
        whether the run resumes with local steps: its optimizer is a node's, not every rank's."""
        if self.nodes and self.every_asked is None:
            self.auto_choice, self.warm_until = auto_on_resume(self.cfg, self.env, found, self.warm_until)
            if self.auto_choice and self.auto_choice.synchronous:
                self.nodes, self.warm_until = None, 0
        return self.nodes is not None and (found[0] or 0) >= self.warm_until

    def begin(self, model: GPT, opt: MuonAdamW, sizes: list[int], saved: RunState, start: int,
              local_now: bool) -> None:
        """From step `start`: the outer optimizer and schedule resumed from `saved`, or the
        synchronous warm-up's plan."""
        if local_now:
            self.diloco, self.schedule = self._outer(model, opt, sizes, saved, start)
        elif self.nodes is not None:
            planned = "as auto chose" if self.auto_choice else f"--sync-warmup-ratio {self.cfg.sync_warmup_ratio}"
            log(self.env, f"local steps after a synchronous warm-up: steps {start + 1}-{self.warm_until} "
                          f"synchronous ({planned}), then --sync-every {self.cfg.sync_every}")

    def start_local(self, model: GPT, opt: MuonAdamW, sizes: list[int], saved: RunState, step: int) -> None:
        """The end of the synchronous warm-up, at step `step`: the node's optimizer `opt` already
        holds the warm-up checkpoint's state (`saved`); the inner phases begin."""
        self.diloco, self.schedule = self._outer(model, opt, sizes, saved, step)

    def _outer(self, model: GPT, opt: MuonAdamW, sizes: list[int], saved: RunState, start: int,
               ) -> tuple[DiLoCo, OuterSchedule]:
        """The outer optimizer and its boundaries from step `start` on, resumed from `saved`."""
        cfg, env, nodes = self.cfg, self.env, self.nodes
        share = node_token_share(nodes, sizes)
        diloco = DiLoCo(model, nodes, share, cfg.outer_lr, cfg.outer_momentum, WIRE_DTYPES[cfg.grad_comm_dtype],
                        WIRE_DTYPES[cfg.param_comm_dtype], shared_params=opt.arena is not None,
                        codec=codec_named(cfg.outer_compress))
        if saved.outer is not None:
            try:
                diloco.load_state_dict(saved.outer)
            except ValueError as exc:
                fail(env, EXIT_CONFIG, str(exc))
        chosen = saved.sync_schedule
        if self.every_asked is None and chosen:  # auto, resumed: the H it chose
            schedule = OuterSchedule(chosen.first, chosen.every, cfg.num_iterations, start)
        elif self.every_asked is None:  # auto: H from the first outer sync's timing, after a phase the warm-up chose
            first = saved.auto_choice.first_phase if saved.auto_choice else None
            first = AUTO_FIRST_PHASE if first is None else first
            schedule = OuterSchedule(start + first, None, cfg.num_iterations, start)
        else:
            schedule = OuterSchedule(start + self.every_asked, self.every_asked, cfg.num_iterations, start)
        diloco.overlaps = overlap_asked(cfg, nodes, chosen)
        if diloco.overlaps and chosen:  # resumed: the landing its first sync timed (None: not timed yet)
            schedule.land_after = chosen.land_after
        average = " (a plain average)" if (cfg.outer_lr, cfg.outer_momentum) == (1, 0) else ""
        log(env, f"local steps: node {nodes.index} of {nodes.count} (ranks {nodes.ranks[nodes.index]}), "
                 f"{share:.1%} of each inner step's tokens; outer sync every "
                 f"{schedule.every or f'auto (first after {schedule.first - start})'} steps from step {start}, outer "
                 f"lr {cfg.outer_lr} Nesterov momentum {cfg.outer_momentum}{average}, "
                 f"{diloco.sent_bytes / 2**20:.1f} MiB sent per outer step by the node's first rank"
                 + compress_line(cfg.outer_compress)
                 + overlap_line(cfg, diloco.overlaps))
        return diloco, schedule

    def loss_scale(self, sizes: list[int], accum: int) -> float:
        """Gradients are summed across the ranks that step together (all, or with local steps the
        node's): weight each rank's mean loss by its share of their tokens, so an uneven split
        optimises exactly what an even one does."""
        stepping = self.nodes.ranks[self.nodes.index] if self.local else range(self.env.world_size)
        return sizes[self.env.rank] / (sum(sizes[r] for r in stepping) * accum)

    # ---- each step -------------------------------------------------------------------------------

    def computed(self, cpu_s: float, wall_s: float) -> None:
        """The forward and backward passes' CPU and wall seconds: the rate overlap's cost is judged at."""
        self.compute_cpu[0] += cpu_s
        self.compute_cpu[1] += wall_s

    def stepped(self, sizes: list[int], accum: int) -> None:
        """An inner step done: the rows it took count towards the node's share of the phase."""
        if self.diloco is not None:
            self.diloco.count(sizes, accum)

    def meet(self, tracker: Tracker, step: int, stopping: bool, step_s: float) -> tuple[bool, float, bool]:
        """After step `step` (`step_s` so far): whether it is a boundary, this rank's wait for an
        outer sync (one landing mid-phase, or the boundary's), and whether the boundary's sync left
        overlapped. A stop makes this step the last boundary: the checkpoint holds theta_global."""
        if stopping:
            self.schedule.last = step
        boundary = self.schedule.boundary(step)
        if self.diloco is None:
            return boundary, 0.0, False
        if not boundary:
            if self.diloco.lands_at != step:
                return False, 0.0, False
            return False, self._land(tracker, step), False
        rate = self.compute_cpu[0] / self.compute_cpu[1] if self.compute_cpu[1] > 0 else 0.0
        outer = self._outer_sync(tracker, step, step_s, rate, self._whole_after(step, stopping))
        self.compute_cpu = [0.0, 0.0]
        return True, outer.wait_s, outer.overlapped

    def timed(self, step: int, start_step: int, compute_s: float, wait_s: float, wall_s: float,
              outer_wait_s: float) -> None:
        """A step's seconds: the local steps' verdict, or the warm-up's timing that auto decides from."""
        if self.diloco is not None:
            self.local_run.add(compute_s, wait_s, wall_s, outer_wait_s)
        elif self.nodes is not None and step > start_step + 1:
            self.warm.add(compute_s, wait_s, wall_s)

    def resplit(self) -> None:
        """The work split changed: the timings so far were of the old one."""
        self.local_run = self.local_run.restarted()
        self.warm_before_resplit = self.auto_choice is None and self.warm.steps > 0

    def stop_s(self) -> float:
        """What a stop's outer sync would add to the last steps (none when synchronous)."""
        return self.diloco.stop_s() if self.diloco is not None else 0.0

    # ---- at a boundary ---------------------------------------------------------------------------

    def choose(self, step: int, last: bool) -> None:
        """--sync-every auto, once the warm-up's steps are timed (or it ends): every step
        synchronous, or local steps and when they begin."""
        pending = self.diloco is None and self.nodes is not None and self.auto_choice is None \
            and self.every_asked is None
        if not pending or last or not (self.warm.steps >= AUTO_TIMED_STEPS or step == self.warm_until):
            return
        self.auto_choice = self._choose_after_timed_steps(step)
        if self.auto_choice is None:  # timed anew at the new split
            self.warm, self.warm_before_resplit = PhaseTimes(), False
            self.warm_until = max(self.warm_until, min(step + AUTO_TIMED_STEPS, self.cfg.num_iterations))
        elif self.auto_choice.synchronous:
            self.nodes, self.warm_until = None, 0
        elif self.auto_choice.warm_until is not None:
            self.warm_until = self.auto_choice.warm_until

    def warm_up_ends(self, step: int, last: bool) -> bool:
        """Whether the synchronous warm-up ends at this boundary: checkpoint, then `start_local`."""
        return self.diloco is None and self.nodes is not None and step == self.warm_until and not last

    def save_into(self, state: RunState) -> None:
        """The regime's part of a checkpoint's run state, at a boundary (the model is theta_global)."""
        state.auto_choice = self.auto_choice
        if self.diloco is not None:  # the outer momentum, the chosen H
            state.outer = self.diloco.state_dict()
            # what auto chose (a run told on or off chooses anew under auto)
            state.sync_schedule = SavedSchedule(self.schedule.first, self.schedule.every, self.schedule.land_after,
                                                self.diloco.overlaps if self.cfg.outer_overlap == "auto" else None)

    # ---- the outer syncs -------------------------------------------------------------------------

    def _choose_after_timed_steps(self, step: int) -> AutoChoice | None:
        """auto, after timing the synchronous warm-up's first steps: whether every step stays
        synchronous, and where local steps follow, the step the warm-up ends at, the end
        --sync-warmup-ratio asked for, and the inner steps before the first outer sync (AutoChoice's
        fields). Every rank decides alike: from the smallest wire share and wire wait any rank saw
        (the last rank to arrive: the wire's own) and the largest step but its waits (the slowest
        rank's work).

        Some timed steps may have run at a split the check has since replaced
        (`warm_before_resplit`). The wire's wait is the same bytes at any split, and the new split's
        slowest rank works less, so a share that asks for local steps there asks for them at the new
        split too: the choice stands (its warm-up end and first phase then err long and short). One
        that keeps every step synchronous might not: None, and the steps are timed again at the new
        split."""
        cfg, env = self.cfg, self.env
        timed = self.warm.steps > 0
        _, wait_s, wall_s = self.warm.per_step()
        # MAX of the negated share and wait is the smallest any rank saw; an untimed rank's +1 makes the
        # whole choice untimed (warm.steps is alike on every rank: all are timed, or none)
        seen = torch.tensor([-(wait_s / wall_s) if timed else 1.0, -wait_s if timed else 1.0,
                             wall_s - wait_s if timed else 0.0], dtype=torch.float64, device=env.device)
        with self.watchdog.phase("all_reduce the warm-up's wire share", step):
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        share, wire_s, work_s = -float(seen[0]), -float(seen[1]), float(seen[2])
        keep, why = keep_synchronous(share if share >= 0 else None)
        if keep and self.warm_before_resplit:
            log(env, f"sync-every auto: timed before the work split changed ({why}); timing the new split")
            return None
        log(env, f"sync-every auto: {why}")
        choice = AutoChoice(keep, why)
        if not keep and share >= 0:
            choice.warm_until, cap_why = warm_up_end(wire_s, work_s, cfg.num_iterations, self.warm_until, step)
            choice.asked_until = sync_warmup_steps(cfg)  # a restart that asks for fewer gets fewer
            log(env, f"sync-every auto: {cap_why}")
            choice.first_phase, first_why = first_outer_phase(wire_s, work_s, max(map(len, self.nodes.ranks)),
                                                              overlap=overlap_asked(cfg, self.nodes),
                                                              bytes_ratio=outer_bytes_ratio(cfg))
            log(env, f"sync-every auto: {first_why}")
        return choice

    def _whole_after(self, step: int, stopping: bool) -> bool:
        """Whether every node must be at theta_global once boundary `step`'s outer sync is done, so
        that it cannot overlap the next phase: the last step, a stop, and an evaluation, a sample or
        a checkpoint due in the phase that ended (they read or save the model; a checkpoint then
        needs nothing in flight to resume from)."""
        cfg = self.cfg
        due = any(period != NEVER and self.schedule.due(period, step)
                  for period in (cfg.eval_every, cfg.sample_every, cfg.checkpoint_every))
        return step == cfg.num_iterations or stopping or due

    def _outer_sync(self, tracker: Tracker, step: int, last_step_s: float, compute_rate: float,
                    whole: bool) -> OuterStats:
        """The nodes meet: the outer step, its line and metrics; with auto, the first one chooses H,
        and with --outer-overlap auto whether the next ones overlap. Overlapped, it leaves in the
        background, to land `schedule.land_after` steps later, unless the nodes must be `whole`
        after it (at theta_global) or it is the first, which is timed. `compute_rate`: the CPU
        seconds per second this process got in the forward and backward passes of the phase that
        ended here."""
        env, diloco, schedule = self.env, self.diloco, self.schedule
        overlap = bool(diloco.overlaps) and not whole and schedule.every is not None and schedule.land_after is not None
        land_at = None
        if overlap and step + schedule.land_after < min(step + schedule.every, schedule.last):
            land_at = step + schedule.land_after  # else at the next boundary
        exact = step == self.cfg.num_iterations and diloco.codec is not None  # the model the run ends with
        with self.watchdog.phase(diloco.phase, step):
            outer = diloco.outer_step(last_step_s, step, overlap, land_at, exact)
        if schedule.every is None or diloco.overlaps is None or (diloco.overlaps and schedule.land_after is None):
            self._choose_from_sync(outer, compute_rate, step)
        if outer.overlapped:
            lands = f"lands at step {land_at:05d}" if land_at else "lands at the next boundary"
            how = f"overlapped: it crosses in the background and {lands}"
            if outer.background_s:
                how += (f"; the one before landed here after {outer.background_s:.2f}s in the background, "
                        f"pseudo_grad_norm={outer.pseudo_grad_norm:.4f}")
        else:
            how = f"pseudo_grad_norm={outer.pseudo_grad_norm:.4f}"
            if exact:
                how += (f" (the run's last: --outer-compress {self.cfg.outer_compress} sends it in "
                        f"--grad-comm-dtype and --param-comm-dtype with what its rounding still owed)")
            if outer.landed is not None:  # the overlapped one before it landed first: what it agreed on
                how += (f"; outer step {diloco.outer_steps - 1} landed first, after {outer.landed.took_s:.2f}s in "
                        f"the background, pseudo_grad_norm={math.sqrt(outer.landed.norm_sq):.4f}")
        log(env, f"outer step {diloco.outer_steps} at step {step:05d}: sync_s={outer.sync_s:.2f} "
                 f"wait_s={outer.wait_s:.2f} sent_mb={outer.sent_bytes / 1e6:.1f} H={schedule.every} {how}")
        metrics = {"outer/outer_step": diloco.outer_steps, "outer/outer_sync_s": outer.sync_s,
                   "outer/outer_wait_s": outer.wait_s, "outer/outer_sent_mb": outer.sent_bytes / 1e6}
        if math.isfinite(outer.pseudo_grad_norm):
            metrics["outer/pseudo_grad_norm"] = outer.pseudo_grad_norm
        if outer.background_s or outer.landed is not None:
            metrics["outer/outer_background_s"] = (outer.landed.took_s if outer.landed is not None
                                                   else outer.background_s)
        tracker.log_metrics(metrics, step)
        return outer

    def _choose_from_sync(self, outer: OuterStats, compute_rate: float, step: int) -> None:
        """auto's choices from the first (blocking, timed) outer sync: H, overlap, the landing."""
        env, diloco, schedule = self.env, self.diloco, self.schedule
        # every rank must choose alike, from the same figures: the shortest sync any rank saw, the
        # last node's to arrive (the others' also holds their wait for it, which is the inner
        # phases' imbalance, not the wire's), the slowest step, and the most any rank's sync cost
        # it overlapped (`overlap_work_s`)
        seen = torch.tensor([-outer.sync_s, outer.slowest_step_s, overlap_work_s(outer, compute_rate)],
                            dtype=torch.float64, device=env.device)
        with self.watchdog.phase("all_reduce outer sync seconds", step):
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        sync_s, step_s, work_s = -float(seen[0]), float(seen[1]), float(seen[2])
        if diloco.overlaps is None:
            diloco.overlaps, why = choose_overlap(sync_s, step_s, work_s, schedule.every)
            log(env, f"outer-overlap auto: {why}")
        if schedule.every is None:
            schedule.every, why = choose_sync_every(sync_s, step_s, work_s if diloco.overlaps else None)
            log(env, f"sync-every auto: H={schedule.every} ({why}; each sync sends {diloco.sent_bytes / 2**20:.1f} "
                     f"MiB from each node{compress_line(self.cfg.outer_compress)})")
        if diloco.overlaps:
            schedule.land_after, why = landing_steps(sync_s, step_s, schedule.every)
            log(env, f"outer-overlap: each outer sync lands {schedule.land_after} inner steps after it leaves ({why})")

    def _land(self, tracker: Tracker, step: int) -> float:
        """--outer-overlap: the sync that left at the last boundary lands now, mid-phase; its line
        and metrics. Returns this rank's wait for it."""
        env, diloco = self.env, self.diloco
        with self.watchdog.phase(f"{diloco.phase}: landing outer step {diloco.outer_steps}", step):
            landed, wait_s = diloco.land()
        if landed is not None and env.master:
            norm = math.sqrt(landed.norm_sq)
            log(env, f"outer step {diloco.outer_steps} landed at step {step:05d}: after {landed.took_s:.2f}s in the "
                     f"background, waited {wait_s:.2f}s, pseudo_grad_norm={norm:.4f}")
            tracker.log_metrics({"outer/outer_background_s": landed.took_s, "outer/outer_wait_s": wait_s,
                                 "outer/pseudo_grad_norm": norm}, step)
        return wait_s


# ---- the plan's rules, apart from its state ------------------------------------------------------

def overlap_line(cfg: TrainConfig, overlaps: bool | None) -> str:
    """The set-up line's word on --outer-overlap."""
    chosen = ", as auto chose before the checkpoint" if cfg.outer_overlap == "auto" else ""
    if overlaps:
        return (f"; each crosses in the background of the next inner steps (--outer-overlap {cfg.outer_overlap}"
                f"{chosen}), but before an evaluation, a sample, a checkpoint, a stop or the last step")
    if overlaps is None:
        return ("; --outer-overlap auto: the syncs cross in the background of the next inner steps where a blocking "
                "one would hold the nodes more than 5% of the time, as the next sync's timing says")
    return f"; every sync blocks{chosen}" if chosen and cfg.device != "cuda" else ""


def outer_bytes_ratio(cfg: TrainConfig) -> float:
    """An outer sync's bytes per value over a synchronous step's (both send a delta, or gradient,
    and an update, or parameters)."""
    codec = codec_named(cfg.outer_compress)
    if codec is None:
        return 1.0
    return 2 * codec.bytes_per_value / (WIRE_DTYPES[cfg.grad_comm_dtype].itemsize
                                        + WIRE_DTYPES[cfg.param_comm_dtype].itemsize)


def compress_line(name: str) -> str:
    """The set-up line's word on --outer-compress."""
    codec = codec_named(name)
    if codec is None:
        return ""
    return f" ({name}, a scale per {codec.block} values, with error feedback, --outer-compress {name})"


def overlap_asked(cfg: TrainConfig, nodes: Nodes, saved: SavedSchedule | None = None) -> bool | None:
    """Whether the outer syncs cross in the background: None where --outer-overlap auto decides at
    the next outer sync (`choose_overlap`). Resumed (`saved`: the checkpoint's schedule), auto
    keeps what it chose before; a run told on or off before chooses anew."""
    if nodes.background is None:  # off, or CUDA
        return False
    if cfg.outer_overlap == "on":
        return True
    return saved.overlap if saved else None


def auto_on_resume(cfg: TrainConfig, env: DistEnv | None, found: tuple[int | None, list[dict[int, dict]]],
                   warm_until: int) -> tuple[AutoChoice | None, int]:
    """--sync-every auto: the choice the run made before the checkpoint being resumed (its COMPLETE
    marker holds it: the optimizer is built before the checkpoint's files are read), and the step
    the synchronous steps go to: the end auto chose, or the restart's --sync-warmup-ratio where that
    asks for fewer steps than the run was started with. auto decides from AUTO_TIMED_STEPS timed
    synchronous steps (a process's first step is not timed), so the warm-up is stretched to hold
    them; a synchronous checkpoint past the warm-up that auto never decided on (a run trained with
    --sync-every 1, or by an older version) is timed anew from where it resumes."""
    step, everyone = found
    marker = next(steps[step] for steps in everyone if step in steps) if step is not None else {}
    local_steps, choice = stepping_in_marker(marker)
    if choice is not None:
        log(env, f"sync-every auto: {'every step stays synchronous' if choice.synchronous else 'local steps'}, "
                 f"as chosen before checkpoint {step} ({choice.why})")
        end = warm_until if choice.warm_until is None else choice.warm_until
        if choice.asked_until is not None and warm_until < choice.asked_until:  # the restart asks for a shorter one
            end = min(end, warm_until)
        return choice, end
    if local_steps or warm_until == 0:  # local steps already, or asked for from the first step
        return None, warm_until
    start = step or 0
    timed_until = max(warm_until, min(start + AUTO_TIMED_STEPS + 1, cfg.num_iterations))
    if start >= warm_until:
        log(env, f"sync-every auto: checkpoint {step} has synchronous steps that auto has not timed: "
                 f"steps {start + 1}-{timed_until} synchronous, then auto chooses")
    return None, timed_until


def overlap_work_s(outer: OuterStats, compute_rate: float) -> float:
    """What a (blocking, timed) outer sync would cost this rank's inner steps overlapped: the part it
    did but wait (its weights read and written stay on the loop), or where more, the CPU time the
    sync took (the thread's exchange, Gloo's copies) at the rate the steps' compute gets CPU time
    (`compute_rate`, CPU seconds a second: on a node capped at half a core, 0.5): on a node with
    no core to spare, what the thread takes the steps lose. With a core to spare the CPU would
    cost nothing, and H errs long. (The compute's rate, not the step's: a step also waits, on the
    slower nodes' stop flags, and waiting takes no CPU.)"""
    own = outer.cpu_s / compute_rate if compute_rate > 0 else 0.0
    return max(outer.sync_s - outer.wait_s, own)
