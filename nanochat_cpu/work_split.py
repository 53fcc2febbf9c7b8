"""How a step's rows are shared out over the ranks, and the timings that show whether it works.

A global batch is total_batch_size tokens whatever the split. By default every rank takes
device_batch_size rows per micro-step; `--rank-batch-sizes 6,2` gives each rank's rows; `auto`
times a few forward+backward passes on every rank before step 0 (at two row counts: a pass has a
fixed cost) and gives the faster ranks more rows, then checks that split once against the run's
own first steps (`check_split`). A resumed run reuses the split saved in its checkpoint, and checks
it only if the run had not yet (a split that changes under redone steps changes their losses); a
run resumed on other nodes calibrates and checks anew. Every tenth step the ranks' compute and wait
times are gathered, and rank 0 says once whether the cluster beats its fastest node alone
(`throughput.py` holds that estimate; docs/FAILURES.md row 16).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import throughput
from .config import TrainConfig, explicit_rank_batch_sizes, micro_step_rows
from .dist import DistEnv, Watchdog, log
from .grad_target import clear_gradients
from .model import GPT
from .perf import sync
from .progress import PhaseTimes
from .tracking import Tracker


def min_max_split(row_seconds: list[float], rows: int, fixed_rows: float = 0.0) -> list[int]:
    """`rows` rows over the ranks, at least one each, so that the slowest rank finishes first: give
    each next row to the rank that would still be done soonest (optimal for min-max). A rank's
    micro-batch of n rows takes (n + fixed_rows) x its seconds per row (`calibrate_split`)."""
    sizes = [1] * len(row_seconds)
    for _ in range(rows - len(sizes)):
        r = min(range(len(sizes)), key=lambda k: ((sizes[k] + 1 + fixed_rows) * row_seconds[k], k))
        sizes[r] += 1
    return sizes


def slowest_rank_s(sizes: list[int], row_seconds: list[float], fixed_rows: float) -> float:
    """A micro-step's time on its slowest rank: n rows cost (n + fixed_rows) x the rank's seconds per row."""
    return max((n + fixed_rows) * t for n, t in zip(sizes, row_seconds, strict=True))


def balanced_split(row_seconds: list[float], step_rows: int, configured: int, fixed_rows: float = 0.0) -> list[int]:
    """Each rank's rows per micro-step, from each rank's measured seconds per row.

    Rows are whole, so with 6 rows and speeds 1 : 0.5 : 1 the best is 3,1,2 (the slowest rank
    takes 3 row-times of 6: 0.5 per row) where 5,2,5 of 12 rows takes 0.42. So every micro-step
    size from the configured one (device_batch_size x world_size) to twice it (the cap bounds a
    rank's activation memory) that divides the step's rows is tried; the split whose slowest rank
    spends the least time per global row wins, or the fewest rows within 3% of it (the configured
    size where it is).
    A micro-batch's fixed cost (`fixed_rows` rows' time on every rank) favours fewer, larger ones.
    Smaller micro-steps (more passes than the even split; the configured size always divides the
    step, config.validate sees to it) are never tried: a pass of one or two rows costs 10-20% more
    a row than one of four or more, and a fixed cost timed on a busy host can come out as none.
    """
    options = []
    for rows in range(configured, 2 * configured + 1):
        if step_rows % rows == 0:
            sizes = min_max_split(row_seconds, rows, fixed_rows)
            options.append((slowest_rank_s(sizes, row_seconds, fixed_rows) / rows, rows, sizes))
    best = min(cost for cost, _, _ in options)
    return min((o for o in options if o[0] <= best * 1.03), key=lambda o: o[1])[2]  # from the configured size up


CALIBRATION_SECONDS = 1.5


def fixed_cost_rows(seconds: dict[int, float], most: int) -> float:
    """A micro-batch's cost that does not grow with its rows, in rows' time: the line through
    a pass's seconds at two row counts, where it meets zero rows. A 1-row pass of the 4-layer test
    model costs 10-50% more per row than a 4-row one on an AVX2 EPYC (smaller GEMMs, a step's fixed
    work), so splits that leave a rank one row judged by seconds per row alone look better than they
    are. Clamped to 0..`most` rows: timings this short are noisy."""
    (small, t_small), (big, t_big) = sorted(seconds.items())
    if t_big <= t_small:
        return float(most)
    per_row = (t_big - t_small) / (big - small)
    return min(max(t_small / per_row - small, 0.0), float(most))


def calibrate_split(model: GPT, cfg: TrainConfig, env: DistEnv, ctx, watchdog: Watchdog) -> tuple[list[int], float]:
    """Time forward+backward passes on every rank; faster ranks take more of each micro-step.
    Returns the split and a micro-batch's fixed cost in rows (`fixed_cost_rows`).

    The global batch (total_batch_size) is unchanged and every rank's loss is weighted by its
    tokens, so the optimisation is the same as with an even split; only the rows per micro-step
    and the number of micro-steps may change (balanced_split).
    """
    full = cfg.device_batch_size
    other = 1 if full > 1 else 2  # a second row count, for the fixed cost: one row, where it weighs most
    gen = torch.Generator().manual_seed(cfg.seed)  # not the global RNG: training stays reproducible
    rows = torch.randint(0, model.cfg.vocab_size, (max(full, other), cfg.max_seq_len + 1), generator=gen)
    batches = {n: (rows[:n, :-1].to(env.device), rows[:n, 1:].to(env.device)) for n in (full, other)}
    times: dict[int, list[float]] = {full: [], other: []}
    # each shape's first pass warms up allocators and kernels. Then time at least CALIBRATION_SECONDS:
    # a CPU quota (a container, a cgroup) lets a process run at full speed for the first part of each
    # 100-ms scheduler period, so passes shorter than a few periods measure the core, not the quota.
    # The two shapes alternate, so a host that gets busier or idler mid-way skews both alike
    while min(map(len, times.values())) < 3 or sum(sum(t[1:]) for t in times.values()) < CALIBRATION_SECONDS:
        for n, seen in times.items():
            x, y = batches[n]
            t0 = time.perf_counter()
            with ctx:
                model(x, y).backward()
            sync(env.device)  # on CUDA the pass has only been queued
            seen.append(time.perf_counter() - t0)
    clear_gradients(model.parameters())  # as the optimizer's zero_grad leaves them
    # collectives take tensors on the run's device (NCCL has no CPU tensors)
    mine = torch.tensor([sum(times[n][1:]) / (len(times[n]) - 1) for n in (full, other)], dtype=torch.float64,
                        device=env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    with watchdog.phase("all_gather calibration", 0):
        dist.all_gather(everyone, mine)
        sync(env.device)
    seconds = [float(t[0]) for t in everyone]
    # the fixed cost is the model's and the CPU's, not the load's: the ranks' median
    fixed_rows = statistics.median(fixed_cost_rows({full: float(t[0]), other: float(t[1])}, full) for t in everyone)
    step_rows = cfg.total_batch_size // cfg.max_seq_len
    sizes = balanced_split([t / (full + fixed_rows) for t in seconds], step_rows,
                           micro_step_rows(cfg, step_rows, env.world_size), fixed_rows)
    if env.master:
        log(env, "calibrated work split: " + ", ".join(
            f"rank {r}@{env.hosts[r]} {seconds[r] * 1000:.0f} ms/micro-batch -> {sizes[r]} rows"
            for r in range(env.world_size)) + f" (a micro-batch's fixed cost: {fixed_rows:.2f} rows)")
    return sizes, fixed_rows


RESPLIT_GAIN = 0.9  # check_split re-splits when the slowest rank would need at most this share of its time


def check_split(cfg: TrainConfig, env: DistEnv, sizes: list[int], accum: int, fixed_rows: float, compute_s: float,
                watchdog: Watchdog, step: int) -> list[int] | None:
    """The split chosen at start, checked against the run's own steps (collective): each rank's
    seconds per row from its mean compute over the steps timed so far (a micro-batch of n rows
    costing n + fixed_rows rows' time), and the balanced split of those speeds when it makes the
    step's slowest rank at least 10% faster; None keeps the split.
    Calibration times a few passes at start, while a host can still be busy with something else
    (the controller's ansible on the same cores, a container's start-up), which evens out the
    speeds it sees; the steps are what the run goes on doing."""
    mine = torch.tensor([compute_s / ((sizes[env.rank] + fixed_rows) * accum)], dtype=torch.float64,
                        device=env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    with watchdog.phase("all_gather the steps' seconds per row", step):
        dist.all_gather(everyone, mine)
        sync(env.device)
    row_s = [float(t) for t in everyone]
    step_rows = cfg.total_batch_size // cfg.max_seq_len
    new = balanced_split(row_s, step_rows, micro_step_rows(cfg, step_rows, env.world_size), fixed_rows)

    def slowest_s(split: list[int]) -> float:  # the step's compute on its slowest rank
        return slowest_rank_s(split, row_s, fixed_rows) * (step_rows // sum(split))

    now, balanced = slowest_s(sizes), slowest_s(new)
    keep = new == sizes or balanced > RESPLIT_GAIN * now
    if env.master:
        speeds = ", ".join(f"rank {r}@{env.hosts[r]} {row_s[r] * 1000:.0f} ms/row" for r in range(env.world_size))
        verdict = (f"rows {sizes} kept (the slowest rank's compute {now:.2f} s a step, {balanced:.2f} s balanced)"
                   if keep else
                   f"rows {new} instead of {sizes}: the slowest rank's compute {now:.2f} s -> {balanced:.2f} s a step")
        log(env, f"work split checked against steps to {step}: {speeds} -> {verdict}")
    return None if keep else new


@dataclass
class SplitCheck:
    """A measured split, checked against the run's own steps: the calibration times a few
    micro-batches before the run, and a host busy then (a controller's ansible on a node), or ranks
    that share cores once the steps run, gives another split than the steps would. It times this
    process's steps but its first (which allocates), and after two of them `check_split` decides;
    again when local steps begin (`again`)."""

    settled: bool  # checked against the run's steps: a checkpoint keeps this, so a resume keeps the split
    times: PhaseTimes | None = None  # the steps timed so far (None: nothing to check)
    from_step: int = 0  # the first step they time

    @classmethod
    def start(cls, measured: bool, settled: bool, start_step: int) -> SplitCheck:
        """`measured`: the split is calibrated (--rank-batch-sizes auto, more than one rank)."""
        return cls(settled, PhaseTimes() if measured and not settled else None, start_step + 2)

    def add(self, step: int, compute_s: float, wait_s: float, wall_s: float) -> None:
        if self.times is not None and step >= self.from_step:
            self.times.add(compute_s, wait_s, wall_s)

    @property
    def due(self) -> bool:
        return self.times is not None and self.times.steps >= 2

    def done(self) -> None:
        self.times, self.settled = None, True

    def again(self, step: int) -> None:
        """Check it again, from the second step after `step`."""
        self.times, self.settled, self.from_step = PhaseTimes(), False, step + 2


def choose_split(cfg: TrainConfig, env: DistEnv, model: GPT, ctx, watchdog: Watchdog, saved: list[int] | None,
                 saved_fixed_rows: float) -> tuple[list[int], float]:
    """Each rank's rows per micro-step: as given, even, as the checkpoint `saved` them (with its
    fixed cost), or calibrated; and a micro-batch's fixed cost in rows, which the check of a
    calibrated split uses."""
    explicit = explicit_rank_batch_sizes(cfg, env.world_size)
    if explicit is not None:
        return explicit, 0.0
    if cfg.rank_batch_sizes != "auto" or not env.distributed:
        rows = micro_step_rows(cfg, cfg.total_batch_size // cfg.max_seq_len, env.world_size)
        if rows != cfg.device_batch_size * env.world_size and env.master:
            log(env, f"{env.world_size} rank(s) where the run was planned for others: {rows // env.world_size} rows a "
                     f"rank per micro-step instead of --device-batch-size {cfg.device_batch_size}, so that a step is "
                     f"still {cfg.total_batch_size:,} tokens")
        return [rows // env.world_size] * env.world_size, 0.0
    if saved is not None and len(saved) == env.world_size:
        if env.master:
            log(env, f"work split from the checkpoint: {saved}")
        return saved, saved_fixed_rows
    return calibrate_split(model, cfg, env, ctx, watchdog)


def log_rank_timings(cfg: TrainConfig, env: DistEnv, tracker: Tracker, step: int, sizes: list[int],
                     accum: int, compute_s: float, wait_s: float, step_s: float, watchdog: Watchdog,
                     said_speed: bool, local_steps: bool = False, last: bool = False, warm_up_until: int = 0,
                     ) -> tuple[bool, str | None]:
    """Who computed how long and who waited: the numbers behind the work split. And whether the
    cluster is any faster than its fastest node would be alone: said at the first timing step
    (returns True once said, and the verdict said here, if any), loudly if it is not, and again at
    the last step (`at the end:`), from the warmed-up timings the run's summary reports. The times
    are one step's (with local steps: the means over the whole phases since the last timing line,
    their outer syncs and landings included, and at the last step over every local step the
    process ran: a short last phase of a few steps and a long sync is not taken for the run). Up
    to step `warm_up_until` (the synchronous warm-up of a run with local steps) the speed is said
    as that phase's only: the run's verdict waits for the local steps it is set to run."""
    mine = torch.tensor([compute_s, wait_s, step_s], dtype=torch.float64, device=env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    with watchdog.phase("all_gather timings", step):
        dist.all_gather(everyone, mine)
        sync(env.device)
    if not env.master:
        return True, None
    log(env, f"timing step {step:05d}: " + " | ".join(
        f"rank {r}@{env.hosts[r]} compute_ms={float(t[0]) * 1000:.0f} comm_wait_ms={float(t[1]) * 1000:.0f}"
        for r, t in enumerate(everyone)))
    timings = [throughput.RankTiming(env.hosts[r], sizes[r] * accum * cfg.max_seq_len, *map(float, t))
               for r, t in enumerate(everyone)]
    est = throughput.estimate(timings, cfg.total_batch_size, local_steps)
    halvable = "float32" in (cfg.grad_comm_dtype, cfg.param_comm_dtype)
    slower, line = throughput.verdict(est, timings, cfg.total_batch_size, sum(sizes) * cfg.max_seq_len, local_steps,
                                      halvable)
    tracker.log_metrics({**{f"ranks/{k}_ms_rank{r}": float(t[i]) * 1000 for r, t in enumerate(everyone)
                            for i, k in enumerate(("compute", "comm_wait"))},
                         "speed/vs_fastest_node_est": est.vs_fastest, "speed/slower_than_one_node": float(slower)},
                        step)
    if step <= warm_up_until:
        log(env, f"synchronous warm-up to step {warm_up_until}: cluster {est.cluster_tok_per_s:,.0f} tok/s = "
                 f"{est.vs_fastest:.2f}x what its fastest node would do alone (est.); the speed verdict follows "
                 f"the local steps from step {warm_up_until}")
        return said_speed, None
    if last:  # the run's verdict, also where it is the first said (local steps with a long H)
        line = f"at the end: {line}"
    elif said_speed:
        return True, None
    log(env, line)
    return True, line

