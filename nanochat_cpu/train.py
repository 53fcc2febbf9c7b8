"""Base training: `python -m nanochat_cpu.train [flags]`, alone or under torchrun.

The run, in order:
1. the ranks join and agree on their inputs (startup.py: flags, dtype, the process group, the
   banner, the fingerprint; bad input never leaves a rank blocked);
2. the model and optimizer, resumed from the newest checkpoint any node holds (checkpoint.py), the
   stepping regime (local_steps.py: every step synchronous, or nodes that meet every H);
3. each step's rows shared out over the ranks (work_split.py; measured when --rank-batch-sizes
   auto), the token batches (dataloader.py), tracking (tracking.py);
4. the loop: a step, the nodes meeting where due, the step's line; at a boundary, on schedule:
   timings, parameter checksums, val bpb, a sample, a checkpoint.

`run()` follows these under `# ----` banners; the loop's phases share one `Training`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint
from .checkpoint_background import BackgroundCheckpoints
from .checkpoint_files import step_dir
from .checkpoint_transfer import Disks, find_disks
from .compile_choice import CompileChoice
from .config import NEVER, TrainConfig, grad_accum_steps, parse_config
from .core_types import choose_threads
from .data import manifest_hash
from .dataloader import TokenLoader
from .dist import EXIT_CONFIG, EXIT_MISMATCH, EXIT_STOPPED, DistEnv, Watchdog, check_parameters_agree, fail, log
from .local_steps import SteppingPlan
from .model import GPT, flops_per_token, model_config_from, parameter_breakdown
from .optim import MuonAdamW, build_optimizer
from .perf import measure_matmul_peak, peak_rss_mib, sync, unused_gpu
from .precision import autocast_for
from .progress import PhaseTimes, Progress, StepClock, human_duration
from .run_state import RunState
from .run_status import RunStatus
from .shm import make_arena
from .startup import Ranks, join_ranks
from .stop import StopBudget, shutdown_budget_s
from .sync_diloco import Nodes
from .tokenizer import Tokenizer
from .tracking import Tracker
from .work_split import SplitCheck, check_split, choose_split, log_rank_timings

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


def data_reads(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog):
    """The loaders' reads of the shards, bounded by the watchdog like a checkpoint's writes."""
    fix = (f"Fix: look at the disk under {cfg.data_dir} on {env.host} (`dmesg`, its mount); the unit restarts and "
           f"resumes from the newest checkpoint")
    return lambda what: watchdog.disk(what, -1, fix)


# ---- evaluation ----------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_bpb(model: GPT, cfg: TrainConfig, env: DistEnv, tokenizer: Tokenizer, token_bytes: torch.Tensor,
                 ctx, watchdog: Watchdog, step: int) -> float:
    """Validation bits per byte: tokenizer-independent, so runs with other vocabularies compare."""
    model.eval()
    loader = TokenLoader(cfg.data_dir, tokenizer, "val", cfg.device_batch_size, cfg.max_seq_len,
                         env.rank, env.world_size, packing=cfg.packing, reading=data_reads(cfg, env, watchdog))
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
        if arena is not None:
            arena.waiting = watchdog.phase  # a peer frozen holding the host's lock: bounded like a collective
        if world > 1:
            log(env, f"local comm: {local_why}")
        return build_optimizer(model, cfg, rank, world, muon_dtype, arena, group)


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


def log_step(cfg: TrainConfig, env: DistEnv, tracker: Tracker, status: RunStatus, progress: Progress,
             train_loss: float, mult: float, dt: float, t_compute: float, comm_wait: float, fpt: int,
             peak: float) -> None:
    tok_per_s = cfg.total_batch_size / dt
    mfu = 100 * fpt * tok_per_s / (peak * env.world_size)
    timing = (f"dt_ms={dt * 1000:.0f} tok_per_s={tok_per_s:.0f} mfu={mfu:.1f} "
              f"compute_ms={t_compute * 1000:.0f} optim_ms={(dt - t_compute) * 1000:.0f} "
              f"comm_wait_ms={comm_wait * 1000:.0f} {progress.line_tail()}")
    if env.master:
        log(env, f"{progress.line_head()} loss={train_loss:.4f} lrm={mult:.3f} {timing}")
    else:  # every node's journal shows its own ranks' progress; rank_loss: this rank's batch only
        log(env, f"{progress.line_head()} rank_loss={train_loss:.4f} {timing}")
    tracker.log_metrics({"loss/train_loss": train_loss, "speed/tok_per_s": tok_per_s, "speed/mfu": mfu,
                         "optimizer/lr_mult": mult, "speed/step_ms": dt * 1000, "speed/compute_ms": t_compute * 1000,
                         "speed/comm_wait_ms": comm_wait * 1000, "time/elapsed_s": progress.elapsed_s,
                         "time/eta_s": progress.eta_s}, progress.step)
    status.update(state="training", step=progress.step, loss=train_loss, tok_per_s=tok_per_s, mfu=mfu,
                  step_s=round(dt, 3), elapsed_s=progress.elapsed_s, eta_s=progress.eta_s,
                  elapsed=human_duration(progress.elapsed_s), eta=human_duration(progress.eta_s),
                  **charts_field(tracker))


def unused_gpu_note(env: DistEnv, cpu_peak: float, cpu_dtype: torch.dtype) -> str | None:
    """What a user whose CPU run leaves this host's GPU idle should know, with both measured peaks;
    the run keeps the device it was given. A GPU that cannot even be measured is said as such."""
    try:
        found = unused_gpu(env.device)
    except Exception as exc:  # noqa: BLE001 - a broken driver must not stop a CPU run
        return (f"this host ({env.host}) has a CUDA GPU that torch sees but could not measure "
                f"({type(exc).__name__}: {str(exc)[:200]}); the run trains on CPU")
    if found is None:
        return None
    name, gpu_peak = found
    return (f"this host ({env.host}) has a CUDA GPU, {name}, that this run leaves idle: it trains on CPU "
            f"(--device cpu). Measured matmul peaks: GPU {gpu_peak / 1e9:,.0f} GFLOP/s (bfloat16), CPU "
            f"{cpu_peak / 1e9:,.0f} GFLOP/s per rank ({str(cpu_dtype).removeprefix('torch.')}). To train on "
            f"it: train_device: cuda with a CUDA torch_variant for this host in the inventory, then site.yml "
            f"and train.yml (docs/INVENTORY.md)")


def charts_field(tracker: Tracker) -> dict[str, str]:
    """The status file's link to the run's charts, once the store started the run (else nothing, so
    a resumed run's link stays)."""
    charts = tracker.charts  # set once by the tracker's thread: read once here
    return {"mlflow_charts": charts} if charts else {}


def log_sample(env: DistEnv, model: GPT, tokenizer: Tokenizer, step: int) -> str:
    model.eval()
    prompt = "The"
    out = model.generate([tokenizer.bos_id] + tokenizer.encode(prompt), max_tokens=24)
    model.train()
    sample = repr(prompt + tokenizer.decode(out))  # quoted: one journal line
    log(env, f"sample step {step:05d}: {sample}")
    return sample


# ---- the run's parts, and the loop's state -------------------------------------------------------

@dataclass
class Training:
    """What the loop's phases share: the run's parts, and the state that changes between steps."""

    cfg: TrainConfig
    ranks: Ranks
    model: GPT
    opt: MuonAdamW
    loader: TokenLoader
    tracker: Tracker
    plan: SteppingPlan
    disks: Disks
    background: BackgroundCheckpoints | None  # with local steps: checkpoints cross while the inner steps go on
    compiling: CompileChoice
    status: RunStatus  # where the run stands, for status.yml
    ctx: Any  # the forward passes' autocast
    fpt: int  # FLOPs per token
    peak: float  # the matmul peak MFU is measured against
    start_step: int
    run_id: str  # the run's identity, kept in every checkpoint (run_identity.py)
    data_sha: str  # the data manifest's sha256, kept in every checkpoint
    sizes: list[int]  # each rank's rows per micro-step
    accum: int  # micro-steps per step
    fixed_rows: float  # a micro-batch's fixed cost in rows
    split: SplitCheck
    stop_budget: StopBudget
    loss_scale: float = 1.0
    phase: PhaseTimes = field(default_factory=PhaseTimes)  # since the last timing line
    said_speed: bool = False  # whether the cluster-vs-one-node line was logged
    waited: tuple[int, float] | None = None  # the last checkpoint every rank waited for: its step, seconds


def resume_terms(cfg: TrainConfig, ranks: Ranks) -> checkpoint.ResumeTerms:
    return checkpoint.ResumeTerms(cfg.tokenizer_dir, ranks.tokenizer_sha, ranks.tokenizer.vocab_size, cfg.depth,
                                  cfg.packing, cfg.data_dir, manifest_hash(cfg.data_dir), cfg.data_changed)


def build(cfg: TrainConfig, ranks: Ranks) -> Training:
    env, watchdog, tokenizer = ranks.env, ranks.watchdog, ranks.tokenizer
    # ---- model and optimizer, resumed from the newest checkpoint any node holds --------------------
    model = build_model(cfg, env, tokenizer.vocab_size)
    disks = find_disks(cfg.out_dir, cfg.keep_checkpoints, cfg.collective_timeout, env, watchdog)
    plan = SteppingPlan.open(cfg, env, watchdog)
    # with local steps the wire is idle between outer syncs: checkpoints cross it then
    background = BackgroundCheckpoints(env, disks, watchdog, cfg.collective_timeout) if plan.nodes else None
    found, run_id = checkpoint.find_resume_step(cfg.resume, cfg.run_id, env, disks, watchdog)
    local_now = plan.resume(found)
    opt = setup_optimizer(cfg, env, model, ranks.muon_dtype, watchdog, plan.nodes if local_now else None)
    fpt = flops_per_token(model)
    if env.master:
        log_parameters(env, cfg, model, fpt)
    terms = resume_terms(cfg, ranks)
    start_step, loader_state, saved = checkpoint.resume(env, disks, model, opt, found, terms, watchdog,
                                                        local_steps=local_now)
    if env.master:
        log(env, f"run {cfg.run_name}, id {run_id} ({'resumed' if start_step else 'new'}; every checkpoint keeps it: "
                 f"a resume takes only this run's)")
    if env.master and cfg.checkpoint_every == 0:
        log(env, "WARNING: --checkpoint-every 0: no checkpoint before the run's end (a stop still writes one): a "
                 "crash, a power cut or a lost node restarts the run from step 1")

    # ---- work split, data, tracking --------------------------------------------------------------
    ctx = autocast_for(env.device, ranks.ctx_dtype)
    if cfg.hybrid_threads == "auto" and env.device.type == "cpu":  # before the split: it times the rank's speed
        placed = choose_threads(model, cfg.device_batch_size, cfg.max_seq_len, cfg.seed, ctx, env.local_rank,
                                env.hosts.count(env.host) if env.hosts else 1)
        if placed:
            log(env, placed)
    sizes, fixed_rows = choose_split(cfg, env, model, ctx, watchdog, saved.rank_batch_sizes, saved.split_fixed_rows)
    # a split the run already checked against its steps stays when it resumes: the redone steps then
    # repeat their losses (a new split sums the rows another way, and the curve drifts from there)
    split = SplitCheck.start(cfg.rank_batch_sizes == "auto" and env.distributed,
                             sizes == saved.rank_batch_sizes and saved.split_settled, start_step)
    accum = grad_accum_steps(cfg, sizes)
    if env.master:
        log(env, f"batch: {cfg.total_batch_size:,} tokens/step = {accum} micro-steps x rows {sizes} x "
                 f"{cfg.max_seq_len} tokens, documents packed {PACKING_SAID[cfg.packing]} (--packing {cfg.packing})")
    # the ranks that step together at the start agree on its timings: every rank when the run starts
    # synchronous (also where the decision comes in the inner steps after), a node's when it starts
    # with local steps (a one-rank node has no group: falling through to every rank's would mismatch
    # the nodes' collectives)
    compiling = CompileChoice(model, ranks.compile_mode, ranks.compile_why, cfg.num_iterations, opt.group,
                              opt.world_size > 1, ranks_on_host=env.hosts.count(env.host) if env.hosts else 1)
    resumed_choice = compiling.resume(saved.compile)
    if resumed_choice and env.master:
        log(env, resumed_choice)
    loader = TokenLoader(cfg.data_dir, tokenizer, "train", sizes[env.rank], cfg.max_seq_len, env.rank,
                         env.world_size, state=loader_state, packing=cfg.packing,
                         reading=data_reads(cfg, env, watchdog))
    peak = measure_matmul_peak(env.device, ranks.ctx_dtype)
    tracker = Tracker(cfg, env, saved.mlflow_run_id)
    tracker.log_params({**dataclasses.asdict(cfg), "run_id": run_id, "world_size": env.world_size,
                        "flops_per_token": fpt, **{f"params_{k}": v for k, v in parameter_breakdown(model).items()}})
    if env.master:
        log(env, f"matmul peak {peak / 1e9:.0f} GFLOP/s per rank ({ranks.ctx_dtype}); MFU is measured against it")
    plan.begin(model, opt, sizes, saved, start_step, local_now)
    status = RunStatus(cfg.out_dir, cfg.run_name, env, cfg.num_iterations, writes=disks.writer(env.rank),
                       resumed=start_step > 0)
    # one rank per node (its status file's writer) says so when the node's GPU sits idle
    gpu_note = unused_gpu_note(env, peak, ranks.ctx_dtype) if disks.writer(env.rank) else None
    if gpu_note:
        log(env, f"NOTE: {gpu_note}")
    status.update(state="starting", gpu_note=gpu_note)
    return Training(cfg, ranks, model, opt, loader, tracker, plan, disks, background, compiling, status, ctx, fpt,
                    peak, start_step, run_id, terms.data_sha, sizes, accum, fixed_rows, split,
                    StopBudget(shutdown_budget_s()),
                    loss_scale=plan.loss_scale(sizes, accum))


# ---- the loop's phases ---------------------------------------------------------------------------

def compile_if_wanted(t: Training, step: int) -> None:
    """--compile auto's trial, when it is due: between two steps, untimed; nothing of it is trained,
    nothing is sent."""
    cfg, env = t.cfg, t.ranks.env
    if not t.compiling.wants_trial:
        return
    with t.ranks.watchdog.phase("--compile auto: compiling, then the ranks' agreement", step):
        line = t.compiling.trial(step, functools.partial(compile_trial, cfg=cfg, env=env, ctx=t.ctx,
                                                         rows=t.sizes[env.rank], vocab=t.ranks.tokenizer.vocab_size))
    t.opt.zero_grad()
    if env.master:
        log(env, line)


def train_step(t: Training, step: int) -> tuple[torch.Tensor, float, float, float]:
    """Step `step` + 1: its gradients and the optimizer's step. Returns the sum of the
    micro-batches' losses (on the device), the compute's seconds, the optimizer's wait on other
    ranks, and the learning rate multiplier."""
    cfg, env, watchdog, opt = t.cfg, t.ranks.env, t.ranks.watchdog, t.opt
    t0, cpu0 = time.perf_counter(), time.process_time()
    loss_sum = accumulate_gradients(cfg, env, t.compiling.model_for_step(), t.loader, opt, t.ctx, t.accum,
                                    t.loss_scale, step)
    sync(env.device)  # CUDA queues work: time what ran, not what was queued
    t_compute = time.perf_counter() - t0
    t.plan.computed(time.process_time() - cpu0, t_compute)
    mult = lr_multiplier(cfg, step)
    for g in opt.groups:
        g.lr_multiplier = mult
        if g.kind == "muon":
            g.momentum = muon_momentum(step)
    with watchdog.phase(opt.step_phase, step + 1):  # the step being computed
        opt.step()
    opt.zero_grad()
    t.plan.stepped(t.sizes, t.accum)
    sync(env.device)
    # the whole step but its waits on other ranks: a compiled model's dense gradients change the
    # optimizer's work too
    with watchdog.phase("--compile auto: the ranks' step times", step + 1):
        decision = t.compiling.record(step + 1, time.perf_counter() - t0 - opt.last_comm_wait)
    if decision and env.master:
        log(env, decision)
    return loss_sum, t_compute, opt.last_comm_wait, mult


def recheck_split(t: Training, step: int, boundary: bool) -> bool:
    """Once, and again when local steps begin, then after two timed steps: mid-phase if need be
    (auto's first phase may be long), each node's delta weighed by the rows it really did. Returns
    whether the split changed here at a boundary (its phase's timings are then the old split's)."""
    cfg, env = t.cfg, t.ranks.env
    if not t.split.due:
        return False
    # a compiled model is specialised to its shapes: a new split would recompile inside a step
    new_sizes = None if t.compiling.compiling else check_split(cfg, env, t.sizes, t.accum, t.fixed_rows,
                                                               t.split.times.per_step()[0], t.ranks.watchdog, step)
    t.split.done()
    if not new_sizes:
        return False
    t.sizes, t.accum = new_sizes, grad_accum_steps(cfg, new_sizes)
    t.loader.batch_size = t.sizes[env.rank]  # it reads on from the same token: only the rows per call change
    t.loss_scale = t.plan.loss_scale(t.sizes, t.accum)
    if not boundary:  # the phase's timings so far were of the old split
        t.phase = t.phase.restarted()
    t.plan.resplit()
    t.compiling.restart_timing()
    if env.master:
        log(env, f"batch: {cfg.total_batch_size:,} tokens/step = {t.accum} micro-steps x rows {t.sizes} x "
                 f"{cfg.max_seq_len} tokens")
    return boundary


def at_boundary(t: Training, step: int, stopping: bool, timed: tuple[list[int], int], resplit: bool,
                overlapped: bool) -> bool:
    """On schedule, and always after the last step: timings, checksums, eval, sample, checkpoint.
    `timed`: the split the phase's timings were measured at. Returns whether the synchronous
    warm-up ended here (the local steps begin after its checkpoint)."""
    cfg, env, watchdog, plan, schedule = t.cfg, t.ranks.env, t.ranks.watchdog, t.plan, t.plan.schedule
    last = step == cfg.num_iterations
    plan.choose(step, last)  # before the timing line: it says what follows
    warmed_up = plan.warm_up_ends(step, last)
    if warmed_up and cfg.rank_batch_sizes == "auto":
        # the inner steps check the split again (and so does a resume from the warm-up's
        # checkpoint): each node now runs its optimizer on the whole model and none waits on the
        # wire, so ranks that share a host's cores compute at other speeds than they did. The
        # first inner step allocates the nodes' optimizers: both time from the second, so a
        # resume re-splits at the step the uninterrupted run did
        t.split.again(step)
    if env.distributed and (schedule.due(10, step) or last):
        # the run's verdict: every local step's means, its first (timed) and last (blocking) syncs
        # in them; the last phase's alone may be a few steps and a sync
        times = plan.local_run.per_step() if last and plan.local_run.steps else t.phase.per_step()
        t.said_speed, verdict = log_rank_timings(cfg, env, t.tracker, step, *timed, *times, watchdog, t.said_speed,
                                                 local_steps=plan.local, last=last, warm_up_until=plan.warm_up_until)
        if verdict:
            t.status.update(verdict=verdict)
        t.phase = PhaseTimes()
    elif not plan.local or resplit:
        t.phase = PhaseTimes()  # synchronous: one step's; with local steps, since the last timing line
    # (overlapped, each node trains on from its own weights: the sync's thread compares theta_global)
    if env.distributed and not overlapped and (step == schedule.first or plan.local
                                               or schedule.due(cfg.checksum_every, step) or last):
        check_parameters_agree(env, t.model, step, watchdog)
    if cfg.eval_every != NEVER and (schedule.due(cfg.eval_every, step) or last):
        bpb = evaluate_bpb(t.model, cfg, env, t.ranks.tokenizer, t.ranks.token_bytes, t.ctx, watchdog, step)
        if env.master:
            log(env, f"eval step {step:05d} val_bpb={bpb:.4f}")
        t.tracker.log_metrics({"loss/val_bpb": bpb}, step)
        t.status.update(val_bpb=bpb, val_step=step)
    if env.master and cfg.sample_every != NEVER and (schedule.due(cfg.sample_every, step) or last):
        t.status.update(sample=log_sample(env, t.model, t.ranks.tokenizer, step))
    if schedule.due(cfg.checkpoint_every, step) or last or stopping or warmed_up:
        save(t, step, final=last or stopping)
    return warmed_up


def save(t: Training, step: int, final: bool) -> None:
    """A checkpoint at boundary `step`: in the background of the inner steps with local steps,
    unless it is the run's `final` one (the last step's, a stop's), which every rank waits for."""
    env = t.ranks.env
    state = RunState(run_id=t.run_id, tokenizer_sha256=t.ranks.tokenizer_sha,
                     vocab_size=t.ranks.tokenizer.vocab_size, data_sha256=t.data_sha, mlflow_run_id=t.tracker.run_id,
                     rank_batch_sizes=t.sizes, split_settled=t.split.settled, split_fixed_rows=t.fixed_rows,
                     compile=t.compiling.state_dict())
    t.plan.save_into(state)
    if t.background is not None:  # one at a time: the last one's bytes go before this one is taken
        t.background.wait(step)
    if t.background is not None and t.plan.local and not final:
        t.background.start(checkpoint.take_snapshot(env, t.disks, t.model, t.opt, t.loader, step, state,
                                                    t.cfg.tokenizer_dir, copy_weights=True))
    else:
        t.waited = step, checkpoint.save_checkpoint(env, t.disks, t.model, t.opt, t.loader, step, t.ranks.watchdog,
                                                    state, t.cfg.tokenizer_dir)
    t.tracker.flush()


def warn_stop_budget(t: Training, step: int, dt: float, outer_wait: float) -> None:
    """Whether a stop now would still fit systemd's stop timeout."""
    # the stop is agreed one step after the signal: a step, then one that ends with the outer sync
    # (overlapped: the sync in flight lands, then the stop's own blocks)
    stop_s = 2 * dt - outer_wait + t.plan.stop_s()
    warning = t.stop_budget.check(step, stop_s, [t.waited, t.background.took if t.background else None],
                                  crossing=t.background is not None and t.plan.local)
    if warning and t.ranks.env.master:
        log(t.ranks.env, warning)


def start_local_steps(t: Training, step: int) -> None:
    """The end of the synchronous warm-up, at step `step`, just checkpointed: each node's own
    optimizer continues the whole synchronous state from that checkpoint (every disk holds every
    rank's part of it, so nothing crosses the wire), and the inner phases begin."""
    cfg, env, watchdog = t.cfg, t.ranks.env, t.ranks.watchdog
    t.opt = None  # the synchronous optimizer's memory goes before the nodes' own is built
    t.opt = setup_optimizer(cfg, env, t.model, t.ranks.muon_dtype, watchdog, t.plan.nodes)
    everyone = checkpoint.survey(env, t.disks, watchdog)[0]
    _, saved, _ = checkpoint.load_checkpoint(env, t.disks, t.model, t.opt, step, everyone, resume_terms(cfg, t.ranks),
                                             watchdog, local_steps=True)
    log(env, f"synchronous warm-up done at step {step} (--sync-warmup-ratio {cfg.sync_warmup_ratio}): every node "
             f"continues the optimizer state of checkpoint {step_dir(cfg.out_dir, step)}")
    t.plan.start_local(t.model, t.opt, t.sizes, saved, step)
    t.loss_scale = t.plan.loss_scale(t.sizes, t.accum)


# ---- the run -------------------------------------------------------------------------------------

def run(cfg: TrainConfig) -> int:
    ranks = join_ranks(cfg)
    env, watchdog, stop = ranks.env, ranks.watchdog, ranks.stop
    t = build(cfg, ranks)

    # ---- the loop --------------------------------------------------------------------------------
    step = t.start_step
    if step == 0 and env.distributed:
        check_parameters_agree(env, t.model, 0, watchdog)
    stopping = stop.agreed(step, watchdog)  # SIGTERM while the run was being set up
    clock = StepClock(cfg.num_iterations, time.perf_counter())  # this process's steps only, also when resumed
    while step < cfg.num_iterations and not stopping:
        compile_if_wanted(t, step)
        t0 = time.perf_counter()
        loss_sum, t_compute, comm_wait, mult = train_step(t, step)
        step += 1
        stopping = stop.agreed(step, watchdog)
        # the nodes meet at an outer boundary; only there is every node at theta_global, so
        # checksums, evaluations and checkpoints wait for one (every step is one when synchronous)
        boundary, outer_wait, overlapped = t.plan.meet(t.tracker, step, stopping, time.perf_counter() - t0)
        comm_wait += outer_wait
        dt = time.perf_counter() - t0
        t.phase.add(t_compute, comm_wait, dt, outer_wait)
        t.plan.timed(step, t.start_step, t_compute, comm_wait, dt, outer_wait)
        t.split.add(step, t_compute, comm_wait, dt)
        train_loss = loss_sum.item() / t.accum
        progress = clock.lap(step, time.perf_counter(), t.plan.schedule.every or 1)
        log_step(cfg, env, t.tracker, t.status, progress, train_loss, mult, dt, t_compute, comm_wait, t.fpt, t.peak)
        if not math.isfinite(train_loss):
            fail(env, EXIT_MISMATCH, f"loss is {train_loss} at step {step}: training diverged "
                                     f"(lower --matrix-lr/--embedding-lr or resume from an earlier checkpoint)")
        timed = (t.sizes, t.accum)  # the split the phase's timings were measured at
        resplit = recheck_split(t, step, boundary)
        if not boundary:
            continue
        last = step == cfg.num_iterations
        warmed_up = at_boundary(t, step, stopping, timed, resplit, overlapped)
        if not (last or stopping):
            warn_stop_budget(t, step, dt, outer_wait)
        if stopping:
            break
        if warmed_up:
            start_local_steps(t, step)

    # ---- the end ---------------------------------------------------------------------------------
    stop.close(step, watchdog)
    if step < cfg.num_iterations:
        kept = "with its checkpoint" if step > t.start_step else "before its first step, nothing new to save"
        log(env, f"stopped by SIGTERM after step {step} of {cfg.num_iterations}, {kept}: the run resumes there "
                 f"when it is started again (train.yml), losing no step; peak RSS {peak_rss_mib():.0f} MiB")
        t.tracker.finish("KILLED")
        t.status.update(state="stopped", **charts_field(t.tracker))
        t.status.flush()
        code = EXIT_STOPPED
    else:
        log(env, f"done: {step} steps, peak RSS {peak_rss_mib():.0f} MiB")
        t.tracker.finish()
        t.status.update(state="done", **charts_field(t.tracker))  # a short run may end before its store started it
        t.status.flush()
        code = 0
    if env.distributed:
        # past the barrier the ranks leave one by one, and none of them is lost: every rank ends its
        # judging of the others before it (the barrier's own watch is the watchdog's)
        if ranks.liveness is not None:
            ranks.liveness.close()
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
