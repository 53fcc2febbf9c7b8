"""Base training: `python -m nanochat_cpu.train [flags]`, alone or under torchrun.

Order of events, chosen so that bad input never leaves a rank blocked:
1. parse and validate flags (batch arithmetic, paths) before rendezvous;
2. resolve device, dtype, attention and backend from the *requested* device;
3. join the process group (finite timeout), print each rank's banner;
4. exchange the run fingerprint (data, tokenizer, config, versions): any difference stops all;
5. build the model and optimizer, resume from the newest checkpoint every rank has;
6. train; evaluate val bpb, sample, checkpoint and cross-check parameters on schedule.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from . import __version__, checkpoint, fingerprint, throughput
from .config import (
    ConfigError,
    TrainConfig,
    config_hash,
    explicit_rank_batch_sizes,
    grad_accum_steps,
    host_problems,
    parse_config,
    validate,
    world_size_from_env,
)
from .data import check_dataset
from .dataloader import TokenLoader
from .dist import (
    EXIT_CONFIG,
    EXIT_MISMATCH,
    WATCHDOG_GRACE_S,
    DistEnv,
    Watchdog,
    check_parameters_agree,
    fail,
    init_distributed,
    log,
)
from .grad_target import clear_gradients
from .model import GPT, flops_per_token, model_config_from, parameter_breakdown
from .optim import MuonAdamW, build_optimizer
from .perf import cpu_has_native_bf16, measure_matmul_peak, peak_rss_mib, reuse_freed_memory, sync
from .shm import make_arena
from .tokenizer import Tokenizer
from .tracking import Tracker

# ---- device truth ------------------------------------------------------------------------------

def resolve_dtype(cfg: TrainConfig, lacking_bf16: list[str]) -> tuple[torch.dtype, str]:
    """The compute dtype and the reason, from the requested device and the ranks' CPUs only.

    `lacking_bf16` names the ranks (`rank r@host`) whose CPU has no native bf16. On CPU, auto
    chooses bf16 autocast only when that list is empty: without AVX512-BF16 or AMX, bf16 is
    emulated and slower than fp32, and one rule for every rank keeps the ranks' arithmetic alike.
    A GPU that happens to be present plays no part.
    """
    if cfg.dtype == "float32":
        return torch.float32, "requested --dtype float32"
    if cfg.dtype == "bfloat16":
        return torch.bfloat16, "requested --dtype bfloat16"
    if cfg.device == "cuda":
        return torch.bfloat16, "auto: --device cuda trains in bf16 autocast"
    if lacking_bf16:
        verb = "lacks" if len(lacking_bf16) == 1 else "lack"
        return torch.float32, (f"auto: fp32 because {', '.join(lacking_bf16)} {verb} native bf16 "
                               f"(avx512_bf16/amx_bf16); bf16 is auto only where every rank's CPU has it")
    return torch.bfloat16, ("auto: every rank's CPU has native bf16 (avx512_bf16/amx_bf16): bf16 autocast, "
                            "fp32 weights and optimizer; --dtype float32 to opt out")


def resolve_muon_dtype(cfg: TrainConfig) -> tuple[torch.dtype, str]:
    if cfg.muon_dtype == "float32":
        return torch.float32, "requested"
    if cfg.muon_dtype == "bfloat16":
        return torch.bfloat16, "requested"
    if cfg.device == "cuda":
        return torch.bfloat16, "auto: cuda"
    if cpu_has_native_bf16():
        return torch.bfloat16, "auto: CPU has native bf16 (avx512_bf16/amx), bf16 matmuls ~2x fp32"
    return torch.float32, "auto: CPU lacks native bf16"


def resolve_compile(cfg: TrainConfig) -> tuple[bool, str]:
    if cfg.compile == "on":
        return True, "requested --compile on"
    if cfg.compile == "off":
        return False, "requested --compile off"
    if cfg.device == "cuda":
        return True, "auto: compile pays off on CUDA"
    # Measured on a 2-core Zen 4 (README, bench table): a cold compile costs ~60 s and the eager
    # model is within a few % of the compiled one at these sizes, so eager wins on CPU.
    return False, "auto: eager on CPU (compiled was not faster in bench, and costs ~60 s cold)"


def autocast_for(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# ---- schedule ----------------------------------------------------------------------------------

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


# ---- evaluation --------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_bpb(model: GPT, cfg: TrainConfig, env: DistEnv, tokenizer: Tokenizer, token_bytes: torch.Tensor,
                 ctx, watchdog: Watchdog, step: int) -> float:
    """Validation bits per byte: tokenizer-independent, so runs with other vocabularies compare."""
    model.eval()
    loader = TokenLoader(cfg.data_dir, tokenizer, "val", cfg.device_batch_size, cfg.max_seq_len,
                         env.rank, env.world_size)
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


# ---- work split ------------------------------------------------------------------------------

def min_max_split(row_seconds: list[float], rows: int) -> list[int]:
    """`rows` rows over the ranks, at least one each, so that the slowest rank finishes first:
    give each next row to the rank that would still be done soonest (optimal for min-max)."""
    sizes = [1] * len(row_seconds)
    for _ in range(rows - len(sizes)):
        r = min(range(len(sizes)), key=lambda k: ((sizes[k] + 1) * row_seconds[k], k))
        sizes[r] += 1
    return sizes


def balanced_split(row_seconds: list[float], step_rows: int, configured: int) -> list[int]:
    """Each rank's rows per micro-step, from each rank's measured seconds per row.

    Rows are whole, so with 6 rows and speeds 1 : 0.5 : 1 the best is 3,1,2 (the slowest rank
    takes 3 row-times of 6: 0.5 per row) where 5,2,5 of 12 rows takes 0.42. So every micro-step
    size from world_size to 2 x the configured one (device_batch_size x world_size; the cap bounds
    a rank's activation memory) that divides the step's rows is tried; the split whose slowest rank
    spends the least time per global row wins, the configured size when it is within 3% of it.
    """
    world = len(row_seconds)
    options = []
    for rows in range(world, 2 * configured + 1):
        if step_rows % rows == 0:
            sizes = min_max_split(row_seconds, rows)
            options.append((max(n * t for n, t in zip(sizes, row_seconds, strict=True)) / rows, rows, sizes))
    best = min(cost for cost, _, _ in options)
    return min((o for o in options if o[0] <= best * 1.03), key=lambda o: (abs(o[1] - configured), o[1]))[2]


CALIBRATION_SECONDS = 1.5


def calibrate_split(model: GPT, cfg: TrainConfig, env: DistEnv, ctx, watchdog: Watchdog) -> list[int]:
    """Time forward+backward passes on every rank; faster ranks take more of each micro-step.

    The global batch (total_batch_size) is unchanged and every rank's loss is weighted by its
    tokens, so the optimisation is the same as with an even split; only the rows per micro-step
    and the number of micro-steps may change (balanced_split).
    """
    gen = torch.Generator().manual_seed(cfg.seed)  # not the global RNG: training stays reproducible
    rows = torch.randint(0, model.cfg.vocab_size, (cfg.device_batch_size, cfg.max_seq_len + 1), generator=gen)
    x, y = rows[:, :-1].to(env.device), rows[:, 1:].to(env.device)
    times: list[float] = []
    # the first pass warms up allocators and kernels. Then time at least CALIBRATION_SECONDS: a
    # CPU quota (a container, a cgroup) lets a process run at full speed for the first part of each
    # 100-ms scheduler period, so passes shorter than a few periods measure the core, not the quota
    while len(times) < 3 or sum(times[1:]) < CALIBRATION_SECONDS:
        t0 = time.perf_counter()
        with ctx:
            model(x, y).backward()
        sync(env.device)  # on CUDA the pass has only been queued
        times.append(time.perf_counter() - t0)
    clear_gradients(model.parameters())  # as the optimizer's zero_grad leaves them
    # collectives take tensors on the run's device (NCCL has no CPU tensors)
    mine = torch.tensor([sum(times[1:]) / (len(times) - 1)], dtype=torch.float64, device=env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    with watchdog.phase("all_gather calibration", 0):
        dist.all_gather(everyone, mine)
        sync(env.device)
    seconds = [float(t) for t in everyone]
    sizes = balanced_split([t / cfg.device_batch_size for t in seconds], cfg.total_batch_size // cfg.max_seq_len,
                           cfg.device_batch_size * env.world_size)
    if env.master:
        log(env, "calibrated work split: " + ", ".join(
            f"rank {r}@{env.hosts[r]} {seconds[r] * 1000:.0f} ms/micro-batch -> {sizes[r]} rows"
            for r in range(env.world_size)))
    return sizes


def work_split(cfg: TrainConfig, env: DistEnv, model: GPT, ctx, watchdog: Watchdog, saved: list[int] | None,
               ) -> list[int]:
    explicit = explicit_rank_batch_sizes(cfg, env.world_size)
    if explicit is not None:
        return explicit
    if cfg.rank_batch_sizes != "auto" or not env.distributed:
        return [cfg.device_batch_size] * env.world_size
    if saved is not None and len(saved) == env.world_size:
        if env.master:
            log(env, f"work split from the checkpoint: {saved}")
        return saved
    return calibrate_split(model, cfg, env, ctx, watchdog)


def log_rank_timings(cfg: TrainConfig, env: DistEnv, tracker: Tracker, step: int, sizes: list[int],
                     accum: int, compute_s: float, wait_s: float, step_s: float, watchdog: Watchdog,
                     said_speed: bool) -> bool:
    """Who computed how long and who waited: the numbers behind the work split. And whether the
    cluster is any faster than its fastest node would be alone: said at the first timing step
    (returns True once said), loudly if it is not."""
    mine = torch.tensor([compute_s, wait_s, step_s], dtype=torch.float64, device=env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    with watchdog.phase("all_gather timings", step):
        dist.all_gather(everyone, mine)
        sync(env.device)
    if not env.master:
        return True
    log(env, f"timing step {step:05d}: " + " | ".join(
        f"rank {r}@{env.hosts[r]} compute_ms={float(t[0]) * 1000:.0f} comm_wait_ms={float(t[1]) * 1000:.0f}"
        for r, t in enumerate(everyone)))
    timings = [throughput.RankTiming(env.hosts[r], sizes[r] * accum * cfg.max_seq_len, *map(float, t))
               for r, t in enumerate(everyone)]
    est = throughput.estimate(timings, cfg.total_batch_size)
    slower, line = throughput.verdict(est, timings, cfg.total_batch_size, sum(sizes) * cfg.max_seq_len)
    if not said_speed:
        log(env, line)
    tracker.log_metrics({**{f"{k}_ms_rank{r}": float(t[i]) * 1000 for r, t in enumerate(everyone)
                            for i, k in enumerate(("compute", "comm_wait"))},
                         "vs_fastest_node_est": est.vs_fastest, "slower_than_one_node": float(slower)}, step)
    return True


# ---- checkpoints -------------------------------------------------------------------------------

def ranks_on_this_node(env: DistEnv) -> list[int]:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = env.rank - env.local_rank
    return list(range(first, first + local_world))


def save_checkpoint(cfg: TrainConfig, env: DistEnv, model: GPT, opt: MuonAdamW, loader: TokenLoader,
                    step: int, watchdog: Watchdog, extra: dict) -> None:
    t0 = time.perf_counter()
    rank_state = {"step": step, "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                  "rng": torch.get_rng_state(), "extra": extra}
    model_state = model.state_dict() if env.local_rank == 0 else None
    error = None
    try:
        checkpoint.save_rank_files(cfg.out_dir, step, env.rank, env.local_rank, model_state, rank_state)
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
        done = checkpoint.complete_steps(cfg.out_dir, env.rank)
        error = (f"cannot write checkpoint step {step} under {cfg.out_dir}: {type(exc).__name__}: {exc}. Earlier "
                 f"checkpoints are untouched (newest complete: {done[-1] if done else 'none'}). Fix: free space "
                 f"on {env.host} or move --out-dir, then start the run again: it resumes from there")
    errors = [error]
    if env.distributed:
        # instead of a plain barrier: every rank learns whether every write succeeded, so a full
        # disk on one node stops all ranks with its reason (exit 2, no restart loop) rather than
        # leaving the others to time out in the next collective and restart without it
        errors = [None] * env.world_size
        with watchdog.phase("all_gather checkpoint status", step):
            dist.all_gather_object(errors, error)
    failed = [f"rank {r}@{env.hosts[r]}: {e}" if env.distributed else e for r, e in enumerate(errors) if e]
    if failed:
        fail(env, EXIT_CONFIG, " | ".join(failed))
    if env.local_rank == 0:
        checkpoint.mark_complete(cfg.out_dir, step, ranks_on_this_node(env), cfg.keep_checkpoints)
    log(env, f"checkpoint step {step} saved to {checkpoint.step_dir(cfg.out_dir, step)} "
             f"in {time.perf_counter() - t0:.2f}s")


START_AFRESH = "start afresh with another --run-name / --out-dir (or --resume never)"


def tokenizer_refusal(cfg: TrainConfig, where: str, saved: dict, tokenizer_sha: str, vocab_size: int) -> str | None:
    """Why the checkpoint at `where` (its saved `extra`) must not be resumed with this tokenizer."""
    if saved.get("tokenizer_sha256", tokenizer_sha) == tokenizer_sha:
        return None
    return (f"checkpoint {where} was trained with another tokenizer (sha256 {saved['tokenizer_sha256'][:16]}, "
            f"vocab {saved.get('vocab_size', '?')}) than --tokenizer-dir={cfg.tokenizer_dir} "
            f"(sha256 {tokenizer_sha[:16]}, vocab {vocab_size}): its token ids mean other strings. Fix: push the "
            f"run's original tokenizer again (site.yml), or {START_AFRESH}")


def agree_on_resume_step(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> int | None:
    """The newest step whose checkpoint is complete on *every* rank's node, if any."""
    if cfg.resume == "never":
        return None
    mine = checkpoint.complete_steps(cfg.out_dir, env.rank)
    if not env.distributed:
        return mine[-1] if mine else None
    everyone: list[list[int] | None] = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint steps", 0):
        dist.all_gather_object(everyone, mine)
    common = set(everyone[0] or [])
    for steps in everyone[1:]:
        common &= set(steps or [])
    return max(common) if common else None


# ---- the run -----------------------------------------------------------------------------------

def banner(env: DistEnv, cfg: TrainConfig, dtype_why: str, muon_why: str, compile_why: str,
           ctx_dtype: torch.dtype, muon_dtype: torch.dtype, compiled: bool, allocator: str) -> None:
    attention = "SDPA (torch.nn.functional.scaled_dot_product_attention), sliding windows as boolean masks"
    log(env, f"nanochat_cpu {__version__} torch {torch.__version__} | device={env.device} "
             f"backend={env.backend or 'none (single process)'} dtype={ctx_dtype} ({dtype_why}) | "
             f"attention={attention} | muon_dtype={muon_dtype} ({muon_why}) | "
             f"compile={'on' if compiled else 'off'} ({compile_why}) | threads={torch.get_num_threads()} "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
             f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', 'unset')} | "
             f"cuda_available={torch.cuda.is_available()} (ignored unless --device cuda) | "
             f"malloc: {allocator}")


def run(cfg: TrainConfig) -> None:
    allocator = reuse_freed_memory()
    world_size = world_size_from_env()
    try:
        validate(cfg, world_size)
    except ConfigError as exc:
        fail(None, EXIT_CONFIG, str(exc))
    muon_dtype, muon_why = resolve_muon_dtype(cfg)
    compiled, compile_why = resolve_compile(cfg)
    torch.manual_seed(cfg.seed)

    problems = host_problems(cfg)
    tokenizer = None
    if not problems:
        try:
            tokenizer = Tokenizer.load(cfg.tokenizer_dir)
        except Exception as exc:  # noqa: BLE001 - any load failure is a config error for the user
            problems.append(f"--tokenizer-dir={cfg.tokenizer_dir}: cannot load tokenizer.json: {exc}")
    if problems and world_size == 1:
        fail(None, EXIT_CONFIG, " | ".join(problems))

    try:
        env = init_distributed(cfg.device, cfg.collective_timeout)
    except RuntimeError as exc:
        fail(None, EXIT_CONFIG, str(exc))
    watchdog = Watchdog(env, cfg.collective_timeout + WATCHDOG_GRACE_S)
    native_bf16 = cpu_has_native_bf16()
    lacking_bf16 = [] if native_bf16 else [f"rank 0@{env.host}"]
    if env.distributed:  # every rank stops if any host lacks its inputs, each naming that host
        everyone: list[tuple[list[str], bool] | None] = [None] * env.world_size
        with watchdog.phase("all_gather input check", 0):
            dist.all_gather_object(everyone, (problems, native_bf16))
        problems = [f"rank {r}@{env.hosts[r]}: {p}" for r, (ps, _) in enumerate(everyone) for p in ps]
        lacking_bf16 = [f"rank {r}@{env.hosts[r]}" for r, (_, native) in enumerate(everyone) if not native]
    ctx_dtype, dtype_why = resolve_dtype(cfg, lacking_bf16)
    banner(env, cfg, dtype_why, muon_why, compile_why, ctx_dtype, muon_dtype, compiled, allocator)
    if problems:
        fail(env, EXIT_CONFIG, "bad inputs, no rank starts: " + " | ".join(problems))

    # fingerprint before anything that could block on uneven work
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
    try:
        token_bytes = tokenizer.token_bytes().to(env.device)
    except ValueError as exc:
        fail(env, EXIT_CONFIG, f"--tokenizer-dir={cfg.tokenizer_dir}: {exc} (fix: train one with "
                               f"`python -m nanochat_cpu.tokenizer train` and re-run site.yml)")
    tokenizer_sha = mine.files["tokenizer/tokenizer.json"]

    mcfg = model_config_from(cfg.depth, cfg.aspect_ratio, cfg.head_dim, tokenizer.vocab_size, cfg.max_seq_len,
                             cfg.window_pattern)
    model = GPT(mcfg)
    model.init_weights(cfg.seed)
    model.to(env.device)
    # collective: the ranks agree whether to share memory, map the buffers, then a barrier
    with watchdog.phase("optimizer setup", 0):
        try:
            arena, local_why = make_arena(cfg.local_comm, env.rank, env.world_size, env.device, model)
        except ValueError as exc:
            fail(env, EXIT_CONFIG, str(exc))
        if env.distributed:
            log(env, f"local comm: {local_why}")
        opt = build_optimizer(model, cfg, env.rank, env.world_size, muon_dtype, arena)
    fpt = flops_per_token(model)
    if env.master:
        parts = parameter_breakdown(model)
        dense = parts["total"] - parts["embedding"] - parts["value_embedding"]
        log(env, "parameters: " + ", ".join(f"{k}={v:,}" for k, v in parts.items())
            + f" | FLOPs/token (for MFU) = {fpt:,} = 6 x {dense:,}"
            f" non-embedding params + attention | model_dim={mcfg.n_embd} heads={mcfg.n_head} "
            f"windows={model.windows} | tokens/step={cfg.total_batch_size:,}")

    start_step, loader_state, extra = 0, None, {}
    resume_step = agree_on_resume_step(cfg, env, watchdog)
    if resume_step is not None:
        where = checkpoint.step_dir(cfg.out_dir, resume_step)
        fix = f"resume from an older checkpoint by deleting {where}, or {START_AFRESH}"
        try:
            rank_state = checkpoint.load_rank_state(cfg.out_dir, resume_step, env.rank)
            model_state = checkpoint.load_model_state(cfg.out_dir, resume_step, env.device)
        except Exception as exc:  # noqa: BLE001 - unreadable file: name it instead of a traceback
            fail(env, EXIT_CONFIG, f"checkpoint {where} is unreadable ({type(exc).__name__}: {exc}); {fix}")
        refusal = tokenizer_refusal(cfg, where, rank_state.get("extra", {}), tokenizer_sha, tokenizer.vocab_size)
        if refusal:
            fail(env, EXIT_CONFIG, refusal)
        try:
            model.load_state_dict(model_state)
        except RuntimeError as exc:
            fail(env, EXIT_CONFIG, f"checkpoint {where} does not fit this model (depth {cfg.depth}, vocab "
                                   f"{tokenizer.vocab_size}): {str(exc).splitlines()[-1].strip()}; {fix}")
        try:
            opt.load_state_dict(rank_state["optimizer"])
        except ValueError as exc:
            fail(env, EXIT_CONFIG, str(exc))
        loader_state, extra = rank_state["loader"], rank_state.get("extra", {})
        torch.set_rng_state(rank_state["rng"])
        start_step = resume_step
        log(env, f"resumed from checkpoint step {resume_step} ({checkpoint.step_dir(cfg.out_dir, resume_step)})")

    ctx = autocast_for(env.device, ctx_dtype)
    sizes = work_split(cfg, env, model, ctx, watchdog, extra.get("rank_batch_sizes"))
    accum = grad_accum_steps(cfg, sizes)
    if env.master:
        log(env, f"batch: {cfg.total_batch_size:,} tokens/step = {accum} micro-steps x rows {sizes} x "
                 f"{cfg.max_seq_len} tokens")
    train_model = torch.compile(model, dynamic=False) if compiled else model
    loader = TokenLoader(cfg.data_dir, tokenizer, "train", sizes[env.rank], cfg.max_seq_len, env.rank,
                         env.world_size, state=loader_state)
    batches = iter(loader)
    peak = measure_matmul_peak(env.device, ctx_dtype)
    tracker = Tracker(cfg, env, extra.get("mlflow_run_id"))
    tracker.log_params({**dataclasses.asdict(cfg), "world_size": env.world_size, "flops_per_token": fpt,
                        **{f"params_{k}": v for k, v in parameter_breakdown(model).items()}})
    if env.master:
        log(env, f"matmul peak {peak / 1e9:.0f} GFLOP/s per rank ({ctx_dtype}); MFU is measured against it")

    # gradients are summed across ranks: weight each rank's mean loss by its share of the tokens,
    # so an uneven split optimises exactly what an even one does
    loss_scale = sizes[env.rank] / (sum(sizes) * accum)
    step = start_step
    said_speed = False  # whether the cluster-vs-one-node line was logged
    if start_step == 0 and env.distributed:
        check_parameters_agree(env, model, 0, watchdog)
    while step < cfg.num_iterations:
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=env.device)  # read once a step: .item() would sync each micro-step
        for micro in range(accum):
            try:
                x, y = next(batches)
            except Exception as exc:  # noqa: BLE001 - a shard unreadable mid-run: name it, not a traceback
                fail(env, EXIT_CONFIG, f"reading --data-dir={cfg.data_dir} failed at step {step + 1} "
                                       f"(loader position {loader.state_dict()}): {type(exc).__name__}: {exc}. "
                                       f"Fix: `python -m nanochat_cpu.data verify --data-dir {cfg.data_dir}`, "
                                       f"then re-run site.yml")
            x, y = x.to(env.device), y.to(env.device)
            with ctx:
                loss = train_model(x, y)
            # the last backward starts each group's gradient reduce as soon as that group is done
            opt.sync_in_backward = micro == accum - 1
            (loss * loss_scale).backward()
            loss_sum += loss.detach().float()
        sync(env.device)  # CUDA queues work: time what ran, not what was queued
        t_compute = time.perf_counter() - t0
        mult = lr_multiplier(cfg, step)
        for g in opt.groups:
            g.lr_multiplier = mult
            if g.kind == "muon":
                g.momentum = muon_momentum(step)
        with watchdog.phase(opt.step_phase, step + 1):  # the step being computed
            opt.step()
        opt.zero_grad()
        step += 1
        sync(env.device)
        dt = time.perf_counter() - t0
        train_loss = loss_sum.item() / accum
        tok_per_s = cfg.total_batch_size / dt
        mfu = 100 * fpt * tok_per_s / (peak * env.world_size)
        timing = (f"dt_ms={dt * 1000:.0f} tok_per_s={tok_per_s:.0f} mfu={mfu:.1f} "
                  f"compute_ms={t_compute * 1000:.0f} optim_ms={(dt - t_compute) * 1000:.0f} "
                  f"comm_wait_ms={opt.last_comm_wait * 1000:.0f}")
        if env.master:
            log(env, f"step {step:05d}/{cfg.num_iterations:05d} loss={train_loss:.4f} lrm={mult:.3f} {timing}")
        else:  # every node's journal shows its own ranks' progress; rank_loss: this rank's batch only
            log(env, f"step {step:05d}/{cfg.num_iterations:05d} rank_loss={train_loss:.4f} {timing}")
        tracker.log_metrics({"train_loss": train_loss, "tok_per_s": tok_per_s, "mfu": mfu, "lr_mult": mult,
                             "step_ms": dt * 1000, "compute_ms": t_compute * 1000,
                             "comm_wait_ms": opt.last_comm_wait * 1000}, step)
        if not math.isfinite(train_loss):
            fail(env, EXIT_MISMATCH, f"loss is {train_loss} at step {step}: training diverged "
                                     f"(lower --matrix-lr/--embedding-lr or resume from an earlier checkpoint)")
        last = step == cfg.num_iterations
        if env.distributed and (step % 10 == 0 or last):
            said_speed = log_rank_timings(cfg, env, tracker, step, sizes, accum, t_compute, opt.last_comm_wait,
                                          dt, watchdog, said_speed)
        if env.distributed and (step == 1 or (cfg.checksum_every and step % cfg.checksum_every == 0) or last):
            check_parameters_agree(env, model, step, watchdog)
        if (cfg.eval_every and step % cfg.eval_every == 0) or last:
            bpb = evaluate_bpb(model, cfg, env, tokenizer, token_bytes, ctx, watchdog, step)
            if env.master:
                log(env, f"eval step {step:05d} val_bpb={bpb:.4f}")
            tracker.log_metrics({"val_bpb": bpb}, step)
        if env.master and ((cfg.sample_every and step % cfg.sample_every == 0) or last):
            model.eval()
            prompt = "The"
            out = model.generate([tokenizer.bos_id] + tokenizer.encode(prompt), max_tokens=24)
            model.train()
            log(env, f"sample step {step:05d}: {prompt}{tokenizer.decode(out)!r}")
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or last:
            extra = {"mlflow_run_id": tracker.run_id, "rank_batch_sizes": sizes, "tokenizer_sha256": tokenizer_sha,
                     "vocab_size": tokenizer.vocab_size}
            save_checkpoint(cfg, env, model, opt, loader, step, watchdog, extra)
            tracker.flush()

    log(env, f"done: {step} steps, peak RSS {peak_rss_mib():.0f} MiB")
    tracker.finish()
    if env.distributed:
        with watchdog.phase("final barrier", step):
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    run(cfg)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
