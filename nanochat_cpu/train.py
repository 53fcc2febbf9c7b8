"""Base training: `python -m nanochat_cpu.train [flags]`, alone or under torchrun.

Order of events, chosen so that bad input never leaves a rank blocked:
1. parse and validate flags (batch arithmetic, paths) before rendezvous;
2. resolve device, dtype, attention and backend from the *requested* device;
3. join the process group (finite timeout), print each rank's banner;
4. exchange the run fingerprint (data, tokenizer, config, versions): any difference stops all;
5. build the model and optimizer, resume from the newest checkpoint every rank has;
6. share each step's rows out over the ranks (measured when --rank-batch-sizes auto);
7. train; evaluate val bpb, sample, checkpoint and cross-check parameters on schedule.

`run()` follows these steps under `# ----` banners. Beside it: `fingerprint.py` (what the ranks
compare), `checkpoint.py` (saving and resuming), `work_split.py` (rows per rank, the timings
behind them), `dataloader.py` (token batches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import __version__, checkpoint, fingerprint
from .checkpoint_background import BackgroundCheckpoints
from .compile_choice import CompileChoice, resolve_compile
from .config import (
    NEVER,
    ConfigError,
    TrainConfig,
    config_hash,
    grad_accum_steps,
    host_problems,
    parse_config,
    sync_every_steps,
    sync_warmup_steps,
    validate,
    world_size_from_env,
)
from .data import check_dataset
from .dataloader import TokenLoader
from .dist import (
    EXIT_CONFIG,
    EXIT_MISMATCH,
    EXIT_STOPPED,
    WATCHDOG_GRACE_S,
    DistEnv,
    Watchdog,
    check_parameters_agree,
    fail,
    init_distributed,
    log,
)
from .model import GPT, flops_per_token, model_config_from, parameter_breakdown
from .optim import MuonAdamW, build_optimizer
from .perf import cpu_has_native_bf16, measure_matmul_peak, peak_rss_mib, reuse_freed_memory, sync
from .precision import autocast_for, compute_dtype, muon_dtype_for
from .progress import Progress, StepClock
from .run_state import AutoChoice, RunState, SavedSchedule, stepping_in_marker
from .shm import make_arena
from .stop import GracefulStop, StopBudget, shutdown_budget_s
from .sync_diloco import (
    AUTO_FIRST_PHASE,
    AUTO_TIMED_STEPS,
    DiLoCo,
    Nodes,
    OuterSchedule,
    OuterStats,
    choose_overlap,
    choose_sync_every,
    find_nodes,
    first_outer_phase,
    keep_synchronous,
    landing_steps,
    node_token_share,
    open_background,
    warm_up_end,
)
from .sync_strategy import WIRE_DTYPES
from .tokenizer import Tokenizer
from .tracking import Tracker
from .work_split import check_split, choose_split, log_rank_timings

# ---- schedule ------------------------------------------------------------------------------------

def lr_multiplier(cfg: TrainConfig, step: int) -> float:
    warmup = round(cfg.warmup_ratio * cfg.num_iterations)
    warmdown = round(cfg.warmdown_ratio * cfg.num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step < cfg.num_iterations - warmdown:
        return 1.0
    progress = (cfg.num_iterations - step) / max(1, warmdown)
    return progress + (1 - progress) * cfg.final_lr_frac


def muon_momentum(step: int) -> float:
    # nanochat's warmup of Muon momentum from 0.85 to 0.95 over the first 300 steps
    frac = min(step / 300, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


PACKING_SAID = {"bestfit": "best fit, each row from a document's start", "stream": "back to back, none cropped"}


# ---- evaluation ----------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_bpb(model: GPT, cfg: TrainConfig, env: DistEnv, tokenizer: Tokenizer, token_bytes: torch.Tensor,
                 ctx, watchdog: Watchdog, step: int) -> float:
    """Validation bits per byte: tokenizer-independent, so runs with other vocabularies compare."""
    model.eval()
    loader = TokenLoader(cfg.data_dir, tokenizer, "val", cfg.device_batch_size, cfg.max_seq_len,
                         env.rank, env.world_size, packing=cfg.packing)
    per_batch = cfg.device_batch_size * cfg.max_seq_len * env.world_size
    batches = max(1, cfg.eval_tokens // per_batch)
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # nats, bytes
    for _, (x, y) in zip(range(batches), loader, strict=False):
        x, y = x.to(env.device), y.to(env.device)
        with ctx:
            nats = model(x, y, reduction="none").view(-1)
        nbytes = token_bytes[y.view(-1)]
        counted = nbytes > 0  # special tokens carry no bytes and are not scored
        totals[0] += nats[counted].double().sum()
        totals[1] += nbytes[counted].double().sum()
    if env.distributed:
        with watchdog.phase("all_reduce val bpb", step):
            dist.all_reduce(totals)
            sync(env.device)  # NCCL returns once queued: wait for it inside the watched phase
    model.train()
    return float(totals[0] / (math.log(2) * totals[1].clamp(min=1)))


# ---- inputs: each host's, then the ranks' agreement ----------------------------------------------

def host_inputs(cfg: TrainConfig) -> tuple[list[str], Tokenizer | None]:
    """What is wrong with this host's inputs (paths, the tokenizer), found before the rendezvous."""
    problems = host_problems(cfg)
    tokenizer = None
    if not problems:
        try:
            tokenizer = Tokenizer.load(cfg.tokenizer_dir)
        except Exception as exc:  # noqa: BLE001 - any load failure is a config error for the user
            problems.append(f"--tokenizer-dir={cfg.tokenizer_dir}: cannot load tokenizer.json: {exc}")
    return problems, tokenizer


def gather_host_facts(env: DistEnv, watchdog: Watchdog, problems: list[str], native_bf16: bool, compile_mode: str,
                      ) -> tuple[list[str], list[str], list[str]]:
    """Every rank's input problems, the ranks whose CPU lacks native bf16, and the ranks whose
    --compile is not measured (on, off, or auto without a C++ compiler), each naming its host:
    every rank stops if any host lacks its inputs."""
    lacking_bf16 = [] if native_bf16 else [f"rank 0@{env.host}"]
    if not env.distributed:
        return problems, lacking_bf16, []
    everyone: list[tuple[list[str], bool, str] | None] = [None] * env.world_size
    with watchdog.phase("all_gather input check", 0):
        dist.all_gather_object(everyone, (problems, native_bf16, compile_mode))
    problems = [f"rank {r}@{env.hosts[r]}: {p}" for r, (ps, _, _) in enumerate(everyone) for p in ps]
    lacking_bf16 = [f"rank {r}@{env.hosts[r]}" for r, (_, native, _) in enumerate(everyone) if not native]
    unmeasured = [f"rank {r}@{env.hosts[r]} ({mode})" for r, (_, _, mode) in enumerate(everyone) if mode != "auto"]
    return problems, lacking_bf16, unmeasured


def agree_on_inputs(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> str:
    """The ranks compare the run fingerprint, then each checks the dataset; any difference or bad
    shard stops every rank. Returns the tokenizer's sha256, which checkpoints record."""
    mine = fingerprint.compute(env.host, cfg.data_dir, cfg.tokenizer_dir, config_hash(cfg),
                               os.path.join(cfg.out_dir, ".hash-cache.json") if env.local_rank == 0 else None)
    prints = [mine]
    if env.distributed:
        gathered: list[fingerprint.Fingerprint | None] = [None] * env.world_size
        with watchdog.phase("all_gather fingerprint", 0):
            dist.all_gather_object(gathered, mine)
        prints = [p for p in gathered if p is not None]
    problem = fingerprint.mismatch_report(prints)
    if problem:
        fail(env, EXIT_MISMATCH, problem)
    missing = [name for name, digest in mine.files.items() if digest == "missing"]
    if missing:
        fail(env, EXIT_CONFIG, f"missing input files {missing} (fix: re-run site.yml to push the dataset)")
    log(env, f"fingerprint agreed across {env.world_size} rank(s): {len(mine.files)} files, "
             f"config {mine.config[:12]}")
    # The ranks now hold identical files, so each reaches the same verdict on them without a
    # collective: a bad shard stops every rank here, not one rank mid-run with the others waiting.
    digests = {name.removeprefix("data/"): d for name, d in mine.files.items() if name.startswith("data/")}
    problems = check_dataset(cfg.data_dir, env.world_size, digests)
    if problems:
        fail(env, EXIT_CONFIG, f"--data-dir={cfg.data_dir}: " + " | ".join(problems))
    return mine.files["tokenizer/tokenizer.json"]


def load_token_bytes(cfg: TrainConfig, env: DistEnv, tokenizer: Tokenizer) -> torch.Tensor:
    try:
        return tokenizer.token_bytes().to(env.device)
    except ValueError as exc:
        fail(env, EXIT_CONFIG, f"--tokenizer-dir={cfg.tokenizer_dir}: {exc} (fix: train one with "
                               f"`python -m nanochat_cpu.tokenizer train` and re-run site.yml)")


# ---- model and optimizer -------------------------------------------------------------------------

def build_model(cfg: TrainConfig, env: DistEnv, vocab_size: int) -> GPT:
    model = GPT(model_config_from(cfg.depth, cfg.aspect_ratio, cfg.head_dim, vocab_size, cfg.max_seq_len,
                                  cfg.window_pattern))
    model.init_weights(cfg.seed)
    return model.to(env.device)


def setup_optimizer(cfg: TrainConfig, env: DistEnv, model: GPT, muon_dtype: torch.dtype,
                    watchdog: Watchdog, nodes: Nodes | None) -> MuonAdamW:
    """The optimizer over every rank, or with local steps over this node's ranks only."""
    rank, world, group = (nodes.rank_in_node, nodes.size, nodes.group) if nodes else (env.rank, env.world_size, None)
    # collective: the ranks agree whether to share memory, map the buffers, then a barrier
    with watchdog.phase("optimizer setup", 0):
        try:
            arena, local_why = make_arena(cfg.local_comm, rank, world, env.device, model, group)
        except ValueError as exc:
            fail(env, EXIT_CONFIG, str(exc))
        if world > 1:
            log(env, f"local comm: {local_why}")
        return build_optimizer(model, cfg, rank, world, muon_dtype, arena, group)


# ---- local steps: which ranks form a node, when the nodes meet -------------------------------------

def find_local_step_nodes(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> Nodes | None:
    """The nodes, when --sync-every asks for local steps and there is more than one node."""
    if sync_every_steps(cfg) == 1 or not env.distributed:
        return None
    nodes = find_nodes(env, watchdog)
    if nodes.count == 1:
        log(env, f"--sync-every {cfg.sync_every}: every rank is on one node, there is nothing to sync between "
                 f"nodes: every step is synchronous")
        return None
    if cfg.outer_overlap == "on" or (cfg.outer_overlap == "auto" and env.device.type != "cuda"):
        nodes.background = open_background(env, nodes, watchdog, cfg.collective_timeout)
    return nodes


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


def overlap_asked(cfg: TrainConfig, nodes: Nodes, saved: SavedSchedule | None = None) -> bool | None:
    """Whether the outer syncs cross in the background: None where --outer-overlap auto decides at
    the next outer sync (`choose_overlap`). Resumed (`saved`: the checkpoint's sync_schedule), auto
    keeps what it chose before; a run told on or off before chooses anew."""
    if nodes.background is None:  # off, or CUDA
        return False
    if cfg.outer_overlap == "on":
        return True
    return saved.overlap if saved else None


def setup_local_steps(cfg: TrainConfig, env: DistEnv, model: GPT, opt: MuonAdamW, nodes: Nodes | None,
                      sizes: list[int], saved: RunState, start: int) -> tuple[DiLoCo | None, OuterSchedule]:
    """The outer optimizer (None: every step synchronous) and its boundaries from step `start` on,
    resumed from the `saved` run state."""
    if nodes is None:
        return None, OuterSchedule(1, 1, cfg.num_iterations)
    share = node_token_share(nodes, sizes)
    diloco = DiLoCo(model, nodes, share, cfg.outer_lr, cfg.outer_momentum, WIRE_DTYPES[cfg.grad_comm_dtype],
                    WIRE_DTYPES[cfg.param_comm_dtype], shared_params=opt.arena is not None)
    if saved.outer is not None:
        try:
            diloco.load_state_dict(saved.outer)
        except ValueError as exc:
            fail(env, EXIT_CONFIG, str(exc))
    every = sync_every_steps(cfg)
    chosen = saved.sync_schedule
    if every is None and chosen:  # auto, resumed: the H it chose
        schedule = OuterSchedule(chosen.first, chosen.every, cfg.num_iterations, start)
    elif every is None:  # auto: H from the first outer sync's timing, after a phase the warm-up's wire chose
        first = saved.auto_choice.first_phase if saved.auto_choice else None
        first = AUTO_FIRST_PHASE if first is None else first
        schedule = OuterSchedule(start + first, None, cfg.num_iterations, start)
    else:
        schedule = OuterSchedule(start + every, every, cfg.num_iterations, start)
    diloco.overlaps = overlap_asked(cfg, nodes, chosen)
    if diloco.overlaps and chosen:  # resumed: the landing its first sync timed (None: not timed yet)
        schedule.land_after = chosen.land_after
    average = " (a plain average)" if (cfg.outer_lr, cfg.outer_momentum) == (1, 0) else ""
    log(env, f"local steps: node {nodes.index} of {nodes.count} (ranks {nodes.ranks[nodes.index]}), "
             f"{share:.1%} of each inner step's tokens; outer sync every "
             f"{schedule.every or f'auto (first after {schedule.first - start})'} steps from step {start}, outer lr "
             f"{cfg.outer_lr} Nesterov momentum {cfg.outer_momentum}{average}, "
             f"{diloco.sent_bytes / 2**20:.1f} MiB sent per outer step by the node's first rank"
             + overlap_line(cfg, diloco.overlaps))
    return diloco, schedule


def choose_after_timed_steps(cfg: TrainConfig, env: DistEnv, nodes: Nodes, warm: PhaseTimes, step: int,
                             warm_until: int, watchdog: Watchdog, before_resplit: bool) -> AutoChoice | None:
    """auto, after timing the synchronous warm-up's first steps: whether every step stays
    synchronous, and where local steps follow, the step the warm-up ends at, the end
    --sync-warmup-ratio asked for, and the inner steps before the first outer sync (AutoChoice's
    fields). Every rank decides alike: from
    the smallest wire share and wire wait any rank saw (the last rank to arrive: the wire's own) and
    the largest step but its waits (the slowest rank's work).

    `before_resplit`: some timed steps ran at a split the check has since replaced. The wire's
    wait is the same bytes at any split, and the new split's slowest rank works less, so a share
    that asks for local steps there asks for them at the new split too: the choice stands (its
    warm-up end and first phase then err long and short). One that keeps every step synchronous
    might not: None, and the steps are timed again at the new split."""
    timed = warm.steps > 0
    _, wait_s, wall_s = warm.per_step()
    # MAX of the negated share and wait is the smallest any rank saw; an untimed rank's +1 makes the
    # whole choice untimed (warm.steps is alike on every rank: all are timed, or none)
    seen = torch.tensor([-(wait_s / wall_s) if timed else 1.0, -wait_s if timed else 1.0,
                         wall_s - wait_s if timed else 0.0], dtype=torch.float64, device=env.device)
    with watchdog.phase("all_reduce the warm-up's wire share", step):
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    share, wire_s, work_s = -float(seen[0]), -float(seen[1]), float(seen[2])
    keep, why = keep_synchronous(share if share >= 0 else None)
    if keep and before_resplit:
        log(env, f"sync-every auto: timed before the work split changed ({why}); timing the new split")
        return None
    log(env, f"sync-every auto: {why}")
    choice = AutoChoice(keep, why)
    if not keep and share >= 0:
        choice.warm_until, cap_why = warm_up_end(wire_s, work_s, cfg.num_iterations, warm_until, step)
        choice.asked_until = sync_warmup_steps(cfg)  # a restart that asks for fewer gets fewer
        log(env, f"sync-every auto: {cap_why}")
        choice.first_phase, first_why = first_outer_phase(wire_s, work_s, max(map(len, nodes.ranks)),
                                                             overlap=overlap_asked(cfg, nodes))
        log(env, f"sync-every auto: {first_why}")
    return choice


def auto_on_resume(cfg: TrainConfig, env: DistEnv, found: tuple[int | None, list[dict[int, dict]]],
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
        if choice.asked_until is not None and warm_until < choice.asked_until:  # the restart asks for a shorter warm-up
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


def start_local_steps(cfg: TrainConfig, env: DistEnv, model: GPT, muon_dtype: torch.dtype, nodes: Nodes,
                      disks: checkpoint.Disks, step: int, sizes: list[int], tokenizer_sha: str, vocab_size: int,
                      watchdog: Watchdog) -> tuple[MuonAdamW, DiLoCo, OuterSchedule]:
    """The end of the synchronous warm-up, at step `step`, just checkpointed: each node's own
    optimizer continues the whole synchronous state from that checkpoint (every disk holds every
    rank's part of it, so nothing crosses the wire), and the inner phases begin."""
    opt = setup_optimizer(cfg, env, model, muon_dtype, watchdog, nodes)
    everyone = checkpoint.survey(cfg, env, disks, watchdog)
    _, saved, _ = checkpoint.load_checkpoint(cfg, env, disks, model, opt, step, everyone, tokenizer_sha,
                                             vocab_size, watchdog, local_steps=True)
    log(env, f"synchronous warm-up done at step {step} (--sync-warmup-ratio {cfg.sync_warmup_ratio}): every node "
             f"continues the optimizer state of checkpoint {checkpoint.step_dir(cfg.out_dir, step)}")
    diloco, schedule = setup_local_steps(cfg, env, model, opt, nodes, sizes, saved, step)
    return opt, diloco, schedule


def stepping_loss_scale(env: DistEnv, nodes: Nodes | None, sizes: list[int], accum: int) -> float:
    """Gradients are summed across the ranks that step together (all, or with local steps the
    node's): weight each rank's mean loss by its share of their tokens, so an uneven split
    optimises exactly what an even one does."""
    stepping = nodes.ranks[nodes.index] if nodes else range(env.world_size)
    return sizes[env.rank] / (sum(sizes[r] for r in stepping) * accum)


def outer_sync(env: DistEnv, tracker: Tracker, diloco: DiLoCo, schedule: OuterSchedule, step: int,
               last_step_s: float, compute_rate: float, watchdog: Watchdog, whole: bool) -> OuterStats:
    """The nodes meet: the outer step, its line and metrics; with auto, the first one chooses H, and
    with --outer-overlap auto whether the next ones overlap. Overlapped, it leaves in the background,
    to land `schedule.land_after` steps later, unless the nodes must be `whole` after it (at
    theta_global) or it is the first, which is timed. `compute_rate`: the CPU seconds per second this
    process got in the forward and backward passes of the phase that ended here."""
    overlap = bool(diloco.overlaps) and not whole and schedule.every is not None and schedule.land_after is not None
    land_at = None
    if overlap and step + schedule.land_after < min(step + schedule.every, schedule.last):
        land_at = step + schedule.land_after  # else at the next boundary
    with watchdog.phase(diloco.phase, step):
        outer = diloco.outer_step(last_step_s, step, overlap, land_at)
    if schedule.every is None or diloco.overlaps is None or (diloco.overlaps and schedule.land_after is None):
        # every rank must choose alike, from the same figures: the shortest sync any rank saw, the
        # last node's to arrive (the others' also holds their wait for it, which is the inner
        # phases' imbalance, not the wire's), the slowest step, and the most any rank's sync cost
        # it overlapped (`overlap_work_s`)
        seen = torch.tensor([-outer.sync_s, outer.slowest_step_s,
                             overlap_work_s(outer, compute_rate)],
                            dtype=torch.float64, device=env.device)
        with watchdog.phase("all_reduce outer sync seconds", step):
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        sync_s, step_s, work_s = -float(seen[0]), float(seen[1]), float(seen[2])
        if diloco.overlaps is None:
            diloco.overlaps, why = choose_overlap(sync_s, step_s, work_s, schedule.every)
            log(env, f"outer-overlap auto: {why}")
        if schedule.every is None:
            schedule.every, why = choose_sync_every(sync_s, step_s, work_s if diloco.overlaps else None)
            log(env, f"sync-every auto: H={schedule.every} ({why})")
        if diloco.overlaps:
            schedule.land_after, why = landing_steps(sync_s, step_s, schedule.every)
            log(env, f"outer-overlap: each outer sync lands {schedule.land_after} inner steps after it leaves ({why})")
    if outer.overlapped:
        lands = f"lands at step {land_at:05d}" if land_at else "lands at the next boundary"
        how = f"overlapped: it crosses in the background and {lands}"
        if outer.background_s:
            how += (f"; the one before landed here after {outer.background_s:.2f}s in the background, "
                    f"pseudo_grad_norm={outer.pseudo_grad_norm:.4f}")
    else:
        how = f"pseudo_grad_norm={outer.pseudo_grad_norm:.4f}"
        if outer.landed is not None:  # the overlapped one before it landed first: what it agreed on
            how += (f"; outer step {diloco.outer_steps - 1} landed first, after {outer.landed.took_s:.2f}s in the "
                    f"background, pseudo_grad_norm={math.sqrt(outer.landed.norm_sq):.4f}")
    log(env, f"outer step {diloco.outer_steps} at step {step:05d}: sync_s={outer.sync_s:.2f} "
             f"wait_s={outer.wait_s:.2f} sent_mb={outer.sent_bytes / 1e6:.1f} H={schedule.every} {how}")
    metrics = {"outer_step": diloco.outer_steps, "outer_sync_s": outer.sync_s, "outer_wait_s": outer.wait_s,
               "outer_sent_mb": outer.sent_bytes / 1e6}
    if math.isfinite(outer.pseudo_grad_norm):
        metrics["pseudo_grad_norm"] = outer.pseudo_grad_norm
    if outer.background_s or outer.landed is not None:
        metrics["outer_background_s"] = outer.landed.took_s if outer.landed is not None else outer.background_s
    tracker.log_metrics(metrics, step)
    return outer


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


def land_outer_sync(env: DistEnv, tracker: Tracker, diloco: DiLoCo, step: int, watchdog: Watchdog) -> float:
    """--outer-overlap: the sync that left at the last boundary lands now, mid-phase; its line and
    metrics. Returns this rank's wait for it."""
    with watchdog.phase(f"{diloco.phase}: landing outer step {diloco.outer_steps}", step):
        landed, wait_s = diloco.land()
    if landed is not None and env.master:
        norm = math.sqrt(landed.norm_sq)
        log(env, f"outer step {diloco.outer_steps} landed at step {step:05d}: after {landed.took_s:.2f}s in the "
                 f"background, waited {wait_s:.2f}s, pseudo_grad_norm={norm:.4f}")
        tracker.log_metrics({"outer_background_s": landed.took_s, "outer_wait_s": wait_s,
                             "pseudo_grad_norm": norm}, step)
    return wait_s


def whole_after(cfg: TrainConfig, schedule: OuterSchedule, step: int, stopping: bool) -> bool:
    """Whether every node must be at theta_global once boundary `step`'s outer sync is done, so that
    it cannot overlap the next phase: the last step, a stop, and an evaluation, a sample or a
    checkpoint due in the phase that ended (they read or save the model; a checkpoint then needs
    nothing in flight to resume from)."""
    due = any(period != NEVER and schedule.due(period, step)
              for period in (cfg.eval_every, cfg.sample_every, cfg.checkpoint_every))
    return step == cfg.num_iterations or stopping or due


def log_parameters(env: DistEnv, cfg: TrainConfig, model: GPT, fpt: int) -> None:
    parts = parameter_breakdown(model)
    dense = parts["total"] - parts["embedding"] - parts["value_embedding"]
    log(env, "parameters: " + ", ".join(f"{k}={v:,}" for k, v in parts.items())
        + f" | FLOPs/token (for MFU) = {fpt:,} = 6 x {dense:,}"
        f" non-embedding params + attention | model_dim={model.cfg.n_embd} heads={model.cfg.n_head} "
        f"windows={model.windows} | tokens/step={cfg.total_batch_size:,}")


# ---- one step ------------------------------------------------------------------------------------

def accumulate_gradients(cfg: TrainConfig, env: DistEnv, train_model, loader: TokenLoader, opt: MuonAdamW, ctx,
                         accum: int, loss_scale: float, step: int) -> torch.Tensor:
    """Forward and backward over the step's micro-batches; the sum of their losses, still on the device."""
    loss_sum = torch.zeros((), device=env.device)  # read once a step: .item() would sync each micro-step
    for micro in range(accum):
        try:
            x, y = next(loader)
        except Exception as exc:  # noqa: BLE001 - a shard unreadable mid-run: name it, not a traceback
            fail(env, EXIT_CONFIG, f"reading --data-dir={cfg.data_dir} failed at step {step + 1} "
                                   f"(loader position {loader.position()}): {type(exc).__name__}: {exc}. "
                                   f"Fix: `python -m nanochat_cpu.data verify --data-dir {cfg.data_dir}`, "
                                   f"then re-run site.yml")
        x, y = x.to(env.device), y.to(env.device)
        with ctx:
            loss = train_model(x, y)
        # the last backward starts each group's gradient reduce as soon as that group is done
        opt.sync_in_backward = micro == accum - 1
        (loss * loss_scale).backward()
        loss_sum += loss.detach().float()
    return loss_sum


def compile_trial(compiled, cfg: TrainConfig, env: DistEnv, ctx, rows: int, vocab: int) -> None:
    """One forward and backward of the compiled model on random tokens of the step's shape: the
    compile, before a real step depends on it (the caller drops the gradients)."""
    x, y = (torch.randint(0, vocab, (rows, cfg.max_seq_len), device=env.device) for _ in range(2))
    with ctx:
        loss = compiled(x, y)
    loss.backward()


def log_step(cfg: TrainConfig, env: DistEnv, tracker: Tracker, progress: Progress, train_loss: float, mult: float,
             dt: float, t_compute: float, comm_wait: float, fpt: int, peak: float) -> None:
    tok_per_s = cfg.total_batch_size / dt
    mfu = 100 * fpt * tok_per_s / (peak * env.world_size)
    timing = (f"dt_ms={dt * 1000:.0f} tok_per_s={tok_per_s:.0f} mfu={mfu:.1f} "
              f"compute_ms={t_compute * 1000:.0f} optim_ms={(dt - t_compute) * 1000:.0f} "
              f"comm_wait_ms={comm_wait * 1000:.0f} {progress.line_tail()}")
    if env.master:
        log(env, f"{progress.line_head()} loss={train_loss:.4f} lrm={mult:.3f} {timing}")
    else:  # every node's journal shows its own ranks' progress; rank_loss: this rank's batch only
        log(env, f"{progress.line_head()} rank_loss={train_loss:.4f} {timing}")
    tracker.log_metrics({"train_loss": train_loss, "tok_per_s": tok_per_s, "mfu": mfu, "lr_mult": mult,
                         "step_ms": dt * 1000, "compute_ms": t_compute * 1000,
                         "comm_wait_ms": comm_wait * 1000, "elapsed_s": progress.elapsed_s,
                         "eta_s": progress.eta_s}, progress.step)


def log_sample(env: DistEnv, model: GPT, tokenizer: Tokenizer, step: int) -> None:
    model.eval()
    prompt = "The"
    out = model.generate([tokenizer.bos_id] + tokenizer.encode(prompt), max_tokens=24)
    model.train()
    log(env, f"sample step {step:05d}: {prompt + tokenizer.decode(out)!r}")  # quoted: one journal line


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


# ---- the run -------------------------------------------------------------------------------------

def banner(env: DistEnv, cfg: TrainConfig, dtype_why: str, muon_why: str, compile_why: str,
           ctx_dtype: torch.dtype, muon_dtype: torch.dtype, compile_mode: str, allocator: str) -> None:
    attention = "SDPA (torch.nn.functional.scaled_dot_product_attention), sliding windows as boolean masks"
    log(env, f"nanochat_cpu {__version__} torch {torch.__version__} | device={env.device} "
             f"backend={env.backend or 'none (single process)'} dtype={ctx_dtype} ({dtype_why}) | "
             f"attention={attention} | muon_dtype={muon_dtype} ({muon_why}) | "
             f"compile={compile_mode} ({compile_why}) | threads={torch.get_num_threads()} "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
             f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', 'unset')} | "
             f"cuda_available={torch.cuda.is_available()} (ignored unless --device cuda) | "
             f"malloc: {allocator}")


def run(cfg: TrainConfig) -> int:
    # ---- set-up: flags and this host's inputs, checked before the rendezvous ---------------------
    allocator = reuse_freed_memory()
    world_size = world_size_from_env()
    try:
        validate(cfg, world_size)
    except ConfigError as exc:
        fail(None, EXIT_CONFIG, str(exc))
    muon_dtype, muon_why = muon_dtype_for(cfg.muon_dtype, cfg.device, cpu_has_native_bf16())
    compile_mode, compile_why = resolve_compile(cfg.compile, cfg.device)
    torch.manual_seed(cfg.seed)
    problems, tokenizer = host_inputs(cfg)
    if problems and world_size == 1:
        fail(None, EXIT_CONFIG, " | ".join(problems))

    # ---- the process group, every rank's facts, the banner ---------------------------------------
    try:
        env = init_distributed(cfg.device, cfg.collective_timeout)
    except RuntimeError as exc:
        fail(None, EXIT_CONFIG, str(exc))
    watchdog = Watchdog(env, cfg.collective_timeout + WATCHDOG_GRACE_S)
    stop = GracefulStop(env)
    stop_budget = StopBudget(shutdown_budget_s())
    waited: tuple[int, float] | None = None  # the last checkpoint every rank waited for: its step, seconds
    problems, lacking_bf16, unmeasured = gather_host_facts(env, watchdog, problems, cpu_has_native_bf16(),
                                                           compile_mode)
    if compile_mode == "auto" and unmeasured:  # the measurement is a collective: every rank or none
        compile_mode, compile_why = "off", (f"auto: eager, as {', '.join(unmeasured[:3])} will not time "
                                            f"compiled steps, and auto's ranks decide together")
    ctx_dtype, dtype_why = compute_dtype(cfg.dtype, cfg.device, lacking_bf16)
    banner(env, cfg, dtype_why, muon_why, compile_why, ctx_dtype, muon_dtype, compile_mode, allocator)
    if problems:
        fail(env, EXIT_CONFIG, "bad inputs, no rank starts: " + " | ".join(problems))

    # ---- the ranks agree on their inputs: before anything that could block on uneven work --------
    tokenizer_sha = agree_on_inputs(cfg, env, watchdog)
    token_bytes = load_token_bytes(cfg, env, tokenizer)

    # ---- model and optimizer, resumed from the newest checkpoint any node holds --------------------
    model = build_model(cfg, env, tokenizer.vocab_size)
    disks = checkpoint.find_disks(cfg, env, watchdog)
    nodes = find_local_step_nodes(cfg, env, watchdog)
    # with local steps the wire is idle between outer syncs: checkpoints cross it then
    background = BackgroundCheckpoints(cfg, env, disks, watchdog) if nodes else None
    warm_until = sync_warmup_steps(cfg) if nodes else 0  # the synchronous steps before local ones
    found = checkpoint.find_resume_step(cfg, env, disks, watchdog)
    auto_choice = None  # auto's choice once it timed the warm-up: {"synchronous": ..., "why": ...[, "warm_until"]}
    if nodes and sync_every_steps(cfg) is None:
        auto_choice, warm_until = auto_on_resume(cfg, env, found, warm_until)
        if auto_choice and auto_choice.synchronous:
            nodes, warm_until = None, 0
    local_now = nodes is not None and (found[0] or 0) >= warm_until
    opt = setup_optimizer(cfg, env, model, muon_dtype, watchdog, nodes if local_now else None)
    fpt = flops_per_token(model)
    if env.master:
        log_parameters(env, cfg, model, fpt)
    start_step, loader_state, saved = checkpoint.resume(cfg, env, disks, model, opt, found, tokenizer_sha,
                                                        tokenizer.vocab_size, watchdog, local_steps=local_now)

    # ---- work split, data, tracking --------------------------------------------------------------
    ctx = autocast_for(env.device, ctx_dtype)
    sizes, fixed_rows = choose_split(cfg, env, model, ctx, watchdog, saved.rank_batch_sizes, saved.split_fixed_rows)
    # a split the run already checked against its steps stays when it resumes: the redone steps then
    # repeat their losses (a new split sums the rows another way, and the curve drifts from there)
    split_settled = sizes == saved.rank_batch_sizes and saved.split_settled
    accum = grad_accum_steps(cfg, sizes)
    if env.master:
        log(env, f"batch: {cfg.total_batch_size:,} tokens/step = {accum} micro-steps x rows {sizes} x "
                 f"{cfg.max_seq_len} tokens, documents packed {PACKING_SAID[cfg.packing]} (--packing {cfg.packing})")
    # the ranks that step together at the start agree on its timings: every rank when the run starts
    # synchronous (also where the decision comes in the inner steps after), a node's when it starts
    # with local steps (a one-rank node has no group: falling through to every rank's would mismatch
    # the nodes' collectives)
    compiling = CompileChoice(model, compile_mode, compile_why, cfg.num_iterations, opt.group, opt.world_size > 1,
                              ranks_on_host=env.hosts.count(env.host) if env.hosts else 1)
    resumed_choice = compiling.resume(saved.compile)
    if resumed_choice and env.master:
        log(env, resumed_choice)
    loader = TokenLoader(cfg.data_dir, tokenizer, "train", sizes[env.rank], cfg.max_seq_len, env.rank,
                         env.world_size, state=loader_state, packing=cfg.packing)
    peak = measure_matmul_peak(env.device, ctx_dtype)
    tracker = Tracker(cfg, env, saved.mlflow_run_id)
    tracker.log_params({**dataclasses.asdict(cfg), "world_size": env.world_size, "flops_per_token": fpt,
                        **{f"params_{k}": v for k, v in parameter_breakdown(model).items()}})
    if env.master:
        log(env, f"matmul peak {peak / 1e9:.0f} GFLOP/s per rank ({ctx_dtype}); MFU is measured against it")
    loss_scale = stepping_loss_scale(env, nodes if local_now else None, sizes, accum)
    diloco, schedule = setup_local_steps(cfg, env, model, opt, nodes if local_now else None, sizes, saved, start_step)
    if nodes is not None and not local_now:
        planned = "as auto chose" if auto_choice else f"--sync-warmup-ratio {cfg.sync_warmup_ratio}"
        log(env, f"local steps after a synchronous warm-up: steps {start_step + 1}-{warm_until} synchronous "
                 f"({planned}), then --sync-every {cfg.sync_every}")

    # ---- the loop --------------------------------------------------------------------------------
    step = start_step
    said_speed = False  # whether the cluster-vs-one-node line was logged
    phase = PhaseTimes()  # since the last timing line (with local steps: whole phases; synchronous: a step)
    local_run = PhaseTimes()  # every local step this process ran, at the split they run at: the run's verdict
    compute_cpu = [0.0, 0.0]  # the CPU time and the wall time of the forward and backward passes since the last sync
    warm = PhaseTimes()  # the synchronous warm-up's steps but this process's first (auto times its wire)
    warm_before_resplit = False  # whether some of them ran at a split the check has since replaced
    # this process's steps but its first, until the measured work split is checked against them
    split_times = PhaseTimes() if cfg.rank_batch_sizes == "auto" and env.distributed and not split_settled else None
    split_from = start_step + 2  # the first step they time: the one before allocates
    if start_step == 0 and env.distributed:
        check_parameters_agree(env, model, 0, watchdog)
    stopping = stop.agreed(step, watchdog)  # SIGTERM while the run was being set up
    clock = StepClock(cfg.num_iterations, time.perf_counter())  # this process's steps only, also when resumed
    while step < cfg.num_iterations and not stopping:
        if compiling.wants_trial:  # between two steps, untimed: nothing of it is trained, nothing is sent
            with watchdog.phase("--compile auto: compiling, then the ranks' agreement", step):
                line = compiling.trial(step, functools.partial(compile_trial, cfg=cfg, env=env, ctx=ctx,
                                                               rows=sizes[env.rank], vocab=tokenizer.vocab_size))
            opt.zero_grad()
            if env.master:
                log(env, line)
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss_sum = accumulate_gradients(cfg, env, compiling.model_for_step(), loader, opt, ctx, accum, loss_scale,
                                        step)
        sync(env.device)  # CUDA queues work: time what ran, not what was queued
        t_compute = time.perf_counter() - t0
        compute_cpu[0] += time.process_time() - cpu0
        compute_cpu[1] += t_compute
        mult = lr_multiplier(cfg, step)
        for g in opt.groups:
            g.lr_multiplier = mult
            if g.kind == "muon":
                g.momentum = muon_momentum(step)
        with watchdog.phase(opt.step_phase, step + 1):  # the step being computed
            opt.step()
        opt.zero_grad()
        step += 1
        if diloco is not None:
            diloco.count(sizes, accum)
        sync(env.device)
        comm_wait = opt.last_comm_wait
        # the whole step but its waits on other ranks: a compiled model's dense gradients change the
        # optimizer's work too
        with watchdog.phase("--compile auto: the ranks' step times", step):
            decision = compiling.record(step, time.perf_counter() - t0 - comm_wait)
        if decision and env.master:
            log(env, decision)
        stopping = stop.agreed(step, watchdog)
        if stopping:  # SIGTERM: with local steps the nodes meet now, so the checkpoint holds theta_global
            schedule.last = step
        # the nodes meet at an outer boundary; only there is every node at theta_global, so
        # checksums, evaluations and checkpoints wait for one (every step is one when synchronous)
        boundary = schedule.boundary(step)
        outer_wait, overlapped = 0.0, False
        if diloco is not None and not boundary and diloco.lands_at == step:
            outer_wait = land_outer_sync(env, tracker, diloco, step, watchdog)
            comm_wait += outer_wait
        if diloco is not None and boundary:
            rate = compute_cpu[0] / compute_cpu[1] if compute_cpu[1] > 0 else 0.0
            outer = outer_sync(env, tracker, diloco, schedule, step, time.perf_counter() - t0, rate, watchdog,
                               whole_after(cfg, schedule, step, stopping))
            compute_cpu = [0.0, 0.0]
            outer_wait, overlapped = outer.wait_s, outer.overlapped
            comm_wait += outer_wait
        dt = time.perf_counter() - t0
        phase.add(t_compute, comm_wait, dt, outer_wait)
        if diloco is not None:
            local_run.add(t_compute, comm_wait, dt, outer_wait)
        if diloco is None and nodes is not None and step > start_step + 1:
            warm.add(t_compute, comm_wait, dt)
        if split_times is not None and step >= split_from:
            split_times.add(t_compute, comm_wait, dt)
        train_loss = loss_sum.item() / accum
        progress = clock.lap(step, time.perf_counter(), schedule.every or 1)
        log_step(cfg, env, tracker, progress, train_loss, mult, dt, t_compute, comm_wait, fpt, peak)
        if not math.isfinite(train_loss):
            fail(env, EXIT_MISMATCH, f"loss is {train_loss} at step {step}: training diverged "
                                     f"(lower --matrix-lr/--embedding-lr or resume from an earlier checkpoint)")
        timed = (sizes, accum)  # the split the phase's timings were measured at
        resplit = False  # here, at a boundary: its timings are logged at the old split, or dropped
        # once, and again when local steps begin, then after two inner steps: mid-phase if need be
        # (auto's first phase may be long), each node's delta weighed by the rows it really did
        if split_times is not None and split_times.steps >= 2:
            # a compiled model is specialised to its shapes: a new split would recompile inside a step
            new_sizes = None if compiling.compiling else check_split(cfg, env, sizes, accum, fixed_rows,
                                                                     split_times.per_step()[0], watchdog, step)
            split_times, split_settled = None, True
            if new_sizes:
                sizes, accum = new_sizes, grad_accum_steps(cfg, new_sizes)
                loader.batch_size = sizes[env.rank]  # it reads on from the same token: only the rows per call change
                loss_scale = stepping_loss_scale(env, nodes if diloco is not None else None, sizes, accum)
                if not boundary:  # the phase's timings so far were of the old split
                    phase = phase.restarted()
                local_run = local_run.restarted()
                resplit = boundary
                compiling.restart_timing()
                warm_before_resplit = auto_choice is None and warm.steps > 0  # auto's timings so far: the old split's
                if env.master:
                    log(env, f"batch: {cfg.total_batch_size:,} tokens/step = {accum} micro-steps x rows {sizes} x "
                             f"{cfg.max_seq_len} tokens")
        if not boundary:
            continue
        # on schedule, and always after the last step: timings, checksums, eval, sample, checkpoint
        last = step == cfg.num_iterations
        auto_pending = diloco is None and nodes is not None and auto_choice is None and sync_every_steps(cfg) is None
        if auto_pending and (warm.steps >= AUTO_TIMED_STEPS or step == warm_until) and not last:
            # before the timing line: it says what follows
            auto_choice = choose_after_timed_steps(cfg, env, nodes, warm, step, warm_until, watchdog,
                                                   warm_before_resplit)
            if auto_choice is None:  # timed anew at the new split
                warm, warm_before_resplit = PhaseTimes(), False
                warm_until = max(warm_until, min(step + AUTO_TIMED_STEPS, cfg.num_iterations))
            elif auto_choice.synchronous:
                nodes, warm_until = None, 0
            elif auto_choice.warm_until is not None:
                warm_until = auto_choice.warm_until
        warmed_up = diloco is None and nodes is not None and step == warm_until and not last
        if warmed_up and cfg.rank_batch_sizes == "auto":
            # the inner steps check the split again (and so does a resume from the warm-up's
            # checkpoint): each node now runs its optimizer on the whole model and none waits on the
            # wire, so ranks that share a host's cores compute at other speeds than they did. The
            # first inner step allocates the nodes' optimizers: both time from the second, so a
            # resume re-splits at the step the uninterrupted run did
            split_times, split_settled, split_from = PhaseTimes(), False, step + 2
        if env.distributed and (schedule.due(10, step) or last):
            # the run's verdict: every local step's means, its first (timed) and last (blocking) syncs
            # in them; the last phase's alone may be a few steps and a sync
            times = local_run.per_step() if last and local_run.steps else phase.per_step()
            said_speed = log_rank_timings(cfg, env, tracker, step, *timed, *times, watchdog,
                                          said_speed, local_steps=diloco is not None, last=last,
                                          warm_up_until=warm_until if diloco is None else 0)
            phase = PhaseTimes()
        elif diloco is None or resplit:
            phase = PhaseTimes()  # synchronous: one step's; with local steps, since the last timing line
        # (overlapped, each node trains on from its own weights: the sync's thread compares theta_global)
        if env.distributed and not overlapped and (step == schedule.first or diloco is not None
                                                   or schedule.due(cfg.checksum_every, step) or last):
            check_parameters_agree(env, model, step, watchdog)
        if cfg.eval_every != NEVER and (schedule.due(cfg.eval_every, step) or last):
            bpb = evaluate_bpb(model, cfg, env, tokenizer, token_bytes, ctx, watchdog, step)
            if env.master:
                log(env, f"eval step {step:05d} val_bpb={bpb:.4f}")
            tracker.log_metrics({"val_bpb": bpb}, step)
        if env.master and cfg.sample_every != NEVER and (schedule.due(cfg.sample_every, step) or last):
            log_sample(env, model, tokenizer, step)
        if schedule.due(cfg.checkpoint_every, step) or last or stopping or warmed_up:
            state = RunState(tokenizer_sha256=tokenizer_sha, vocab_size=tokenizer.vocab_size,
                             mlflow_run_id=tracker.run_id, rank_batch_sizes=sizes, split_settled=split_settled,
                             split_fixed_rows=fixed_rows, compile=compiling.state_dict(), auto_choice=auto_choice)
            if diloco is not None:  # at a boundary: the model is theta_global; the outer momentum, the chosen H
                state.outer = diloco.state_dict()
                # what auto chose (a run told on or off chooses anew under auto)
                state.sync_schedule = SavedSchedule(schedule.first, schedule.every, schedule.land_after,
                                                    diloco.overlaps if cfg.outer_overlap == "auto" else None)
            if background is not None:  # one at a time: the last one's bytes go before this one is taken
                background.wait(step)
            if background is not None and diloco is not None and not (last or stopping):
                background.start(checkpoint.take_snapshot(env, disks, model, opt, loader, step, state,
                                                          copy_weights=True))
            else:
                waited = step, checkpoint.save_checkpoint(cfg, env, disks, model, opt, loader, step, watchdog, state)
            tracker.flush()
        if not (last or stopping):
            # the stop is agreed one step after the signal: a step, then one that ends with the outer sync
            # (overlapped: the sync in flight lands, then the stop's own blocks)
            stop_s = 2 * dt - outer_wait + (diloco.stop_s() if diloco is not None else 0.0)
            warning = stop_budget.check(step, stop_s, [waited, background.took if background else None],
                                        crossing=background is not None and diloco is not None)
            if warning and env.master:
                log(env, warning)
        if stopping:
            break
        if warmed_up:
            opt = None  # the synchronous optimizer's memory goes before the nodes' own is built
            opt, diloco, schedule = start_local_steps(cfg, env, model, muon_dtype, nodes, disks, step, sizes,
                                                      tokenizer_sha, tokenizer.vocab_size, watchdog)
            loss_scale = stepping_loss_scale(env, nodes, sizes, accum)

    # ---- the end ---------------------------------------------------------------------------------
    stop.close(step, watchdog)
    if step < cfg.num_iterations:
        kept = "with its checkpoint" if step > start_step else "before its first step, nothing new to save"
        log(env, f"stopped by SIGTERM after step {step} of {cfg.num_iterations}, {kept}: the run resumes there "
                 f"when it is started again (train.yml), losing no step; peak RSS {peak_rss_mib():.0f} MiB")
        tracker.finish("KILLED")
        code = EXIT_STOPPED
    else:
        log(env, f"done: {step} steps, peak RSS {peak_rss_mib():.0f} MiB")
        tracker.finish()
        code = 0
    if env.distributed:
        with watchdog.phase("final barrier", step):
            dist.barrier()
        dist.destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    code = run(cfg)
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
