"""A run's start, up to the model: what every rank must agree on before anything can block.

Order of events, chosen so that bad input never leaves a rank blocked:
1. parse and validate flags (batch arithmetic, paths) and load this host's tokenizer, before the
   rendezvous: a single process fails there and then;
2. resolve the dtype and compile mode from the *requested* device;
3. join the process group (finite timeout), gather every rank's problems and CPU facts, print
   each rank's banner: a bad input anywhere stops every rank, each naming the host;
4. exchange the run fingerprint (data, tokenizer, config, versions): any difference stops all,
   and every rank checks the dataset it now knows is everyone's.

`join_ranks` runs these in order and hands the trainer a `Ranks`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import __version__, fingerprint
from .compile_choice import resolve_compile
from .config import ConfigError, TrainConfig, config_hash, host_problems, validate, world_size_from_env
from .data import check_dataset
from .dist import (
    EXIT_CONFIG,
    EXIT_MISMATCH,
    NODES_ENV,
    WATCHDOG_GRACE_S,
    DistEnv,
    Liveness,
    Watchdog,
    fail,
    init_distributed,
    log,
)
from .perf import cpu_has_native_bf16, reuse_freed_memory
from .precision import compute_dtype, muon_dtype_for
from .stop import GracefulStop
from .tokenizer import Tokenizer


@dataclass
class Ranks:
    """The joined ranks and what they agreed on: the process group and its guards, the inputs,
    and the arithmetic every rank computes in."""

    env: DistEnv
    watchdog: Watchdog
    stop: GracefulStop
    liveness: Liveness | None  # an elastic launch's watch on silent peers (None: one process, or torchrun static)
    tokenizer: Tokenizer
    tokenizer_sha: str  # what checkpoints record
    token_bytes: torch.Tensor  # each token's length in bytes: val bpb's denominator
    ctx_dtype: torch.dtype
    muon_dtype: torch.dtype
    compile_mode: str
    compile_why: str


def join_ranks(cfg: TrainConfig) -> Ranks:
    # ---- flags and this host's inputs, checked before the rendezvous -----------------------------
    allocator = reuse_freed_memory()
    world_size = world_size_from_env()
    try:
        validate(cfg, world_size, elastic=bool(os.environ.get(NODES_ENV)))
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
    liveness = Liveness(env, cfg.peer_timeout) if env.distributed and os.environ.get(NODES_ENV) else None
    problems, lacking_bf16, unmeasured = gather_host_facts(env, watchdog, problems, cpu_has_native_bf16(),
                                                           compile_mode)
    if compile_mode == "auto" and unmeasured:  # the measurement is a collective: every rank or none
        compile_mode, compile_why = "off", (f"auto: eager, as {', '.join(unmeasured[:3])} will not time "
                                            f"compiled steps, and auto's ranks decide together")
    ctx_dtype, dtype_why = compute_dtype(cfg.dtype, cfg.device, lacking_bf16)
    banner(env, dtype_why, muon_why, compile_why, ctx_dtype, muon_dtype, compile_mode, allocator)
    if problems:
        fail(env, EXIT_CONFIG, "bad inputs, no rank starts: " + " | ".join(problems))

    # ---- the ranks agree on their inputs: before anything that could block on uneven work --------
    tokenizer_sha = agree_on_inputs(cfg, env, watchdog)
    token_bytes = load_token_bytes(cfg, env, tokenizer)
    return Ranks(env, watchdog, stop, liveness, tokenizer, tokenizer_sha, token_bytes, ctx_dtype, muon_dtype,
                 compile_mode, compile_why)


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
    disks = [p.problem for p in prints if p.problem]
    if disks:  # every rank has every fingerprint: all of them stop here, none waits for another
        fail(env, EXIT_CONFIG, "a disk failed before step 0: " + " | ".join(disks))
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



def banner(env: DistEnv, dtype_why: str, muon_why: str, compile_why: str,
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
