"""Checkpoints that survive crashes mid-write, need no shared filesystem, and resume at any layout.

Layout under `<out_dir>/checkpoints/step_000100/`, on every node's disk:
- `model.pt`                the model
- `rank{r}.pt`              every rank's optimizer state, loader position and RNG state, for each
                            rank r of the world that wrote it (all of them, on every disk)
- `COMPLETE`                written last, once every disk's write succeeded: the checkpoint is valid
                            only when this marker exists and lists the files present; it names the
                            world that wrote it (world size, every rank's host and launcher), and the
                            model's shape and tokenizer, so that `model.pt` and it alone are enough
                            to sample from the model anywhere (sample.py)

Every file is written to a temporary name and renamed, and the directories are fsynced, so an
interrupted write (disk full, SIGKILL, power loss) leaves either the old file or the new one,
never half of one. A step without its COMPLETE marker is ignored on resume and cleaned up later.
Old checkpoints are deleted only after a newer one is complete, and never one newer than it.

Because every disk holds every rank's state, any one node can resume the whole run: on start the
ranks take the newest step that some disk holds whole, a disk that lacks it (wiped, replaced, a
node just added) gets it from one that has it over the process group, and a world of another
size or shape merges the saved ranks' states and takes its own part (the optimizer re-sharded,
the loader's epoch dealt out anew). A checkpoint that does not fit the run is refused by every
rank, and `--resume never` refuses a directory that holds checkpoints: a run never starts
afresh silently over an old one. The states and files cross between ranks in rounds of
CHUNK_BYTES, each its own collective, so a big checkpoint on a slow link is never taken for a
hung peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .data import row_group_pairs
from .dataloader import carry_over_position, packing_mismatch
from .dist import EXIT_CONFIG, DistEnv, Watchdog, agree_to_fail, fail, log
from .optim import merge_optimizer_states
from .run_state import SAVED_KEY, RunState
from .sync_diloco import merge_outer_states

if TYPE_CHECKING:
    from collections.abc import Callable

    from .config import TrainConfig
    from .dataloader import TokenLoader
    from .model import GPT
    from .optim import MuonAdamW

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def step_dir(out_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(out_dir), f"step_{step:06d}")


SYNC_BYTES = 64 << 20  # a checkpoint's file reaches the disk in pieces this size: each one is progress


def no_progress() -> None:
    """Where nobody watches a write (`Watchdog.disk` hands out the real one)."""


class _ToDisk:
    """A file whose bytes are pushed to the disk every SYNC_BYTES (fdatasync), `progress` called
    after each: the page cache would otherwise take a multi-GB checkpoint at once and leave all of
    its time to one fsync, so a slow disk and one that stopped answering would look alike. Write
    errors are kept: torch.save turns a failed write (ENOSPC, EIO) into 'enforce fail ...
    unexpected pos', and the reason would be lost."""

    def __init__(self, f, progress: Callable[[], None]):
        self.f, self.progress, self.error, self.unsynced = f, progress, None, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")  # torch.save hands a tensor's whole storage in one call
        try:
            done = 0
            while done < len(view):
                piece = view[done: done + SYNC_BYTES - self.unsynced]
                self.f.write(piece)
                done += len(piece)
                self.unsynced += len(piece)
                if self.unsynced == SYNC_BYTES:
                    self.f.flush()
                    os.fdatasync(self.f.fileno())
                    self.unsynced = 0
                    self.progress()
            return done
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def atomic_torch_save(obj, path: str, progress: Callable[[], None] = no_progress) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _ToDisk(f, progress)
            try:
                torch.save(obj, out)
            except RuntimeError as exc:
                if out.error is not None:
                    raise out.error from exc
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # disk full: give the space of the partial file back (a SIGKILL leaves it; prune removes it)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes | bytearray, progress: Callable[[], None] = no_progress) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            _ToDisk(f, progress).write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # as atomic_torch_save: a full disk gets its space back
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(path: str) -> None:
    """Make the renames inside `path` durable: a rename is in the directory, not the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_step_files(out_dir: str, step: int, model_state: dict, rank_files: list[bytes | bytearray],
                     progress: Callable[[], None] = no_progress) -> None:
    """Phase 1, once per disk: the model and every rank's state (its torch.save bytes, as it sent
    them: written as they are, each dropped once on disk), so this disk alone can resume the run
    at any layout. The caller learns whether every disk's write succeeded, then seals."""
    d = step_dir(out_dir, step)
    if os.path.isdir(d):  # an unsealed wreck of an earlier attempt at this step: nothing of it is kept
        shutil.rmtree(d)
    os.makedirs(d)
    atomic_torch_save(model_state, os.path.join(d, "model.pt"), progress)
    for r in range(len(rank_files)):
        atomic_write_bytes(os.path.join(d, f"rank{r}.pt"), rank_files[r], progress)
        rank_files[r] = b""
        progress()


def mark_complete(out_dir: str, step: int, layout: dict, keep: int) -> None:
    """Phase 2, after every disk's write succeeded: seal the checkpoint, make it durable, prune."""
    d = step_dir(out_dir, step)
    files = ["model.pt"] + [f"rank{r}.pt" for r in range(layout["world_size"])]
    missing = [f for f in files if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise RuntimeError(f"checkpoint {d} is missing {missing} after the barrier")
    atomic_write_text(os.path.join(d, "COMPLETE"), json.dumps({"step": step, "files": files, **layout}))
    fsync_dir(d)
    fsync_dir(checkpoint_root(out_dir))
    prune(out_dir, keep, sealed=step)


def read_marker(out_dir: str, step: int, needed: list[str] | None = None) -> dict | None:
    """The COMPLETE marker of a step whose files are all present (or only those `needed`), else
    None. A marker without `world_size` was sealed by an older version, which kept only its own
    node's ranks' files; one without `model` by a version that did not record the model's shape."""
    d = step_dir(out_dir, step)
    try:
        with open(os.path.join(d, "COMPLETE")) as f:
            marker = json.load(f)
        files = marker["files"] if needed is None else needed
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(os.path.exists(os.path.join(d, name)) for name in files):
        return None
    return marker


def list_steps(out_dir: str) -> list[int]:
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_DIR.match(n)))


def complete_steps(out_dir: str) -> list[int]:
    return [s for s in list_steps(out_dir) if read_marker(out_dir, s) is not None]


def prune(out_dir: str, keep: int, sealed: int) -> None:
    """After sealing step `sealed`: keep it and the newest `keep` - 1 complete checkpoints before it;
    drop older ones and stale incomplete ones. Nothing newer than `sealed` is touched: it is not this
    run's to judge (and an incomplete one may be being written right now)."""
    steps = list_steps(out_dir)
    older = [s for s in steps if s < sealed and os.path.exists(os.path.join(step_dir(out_dir, s), "COMPLETE"))]
    keep_set = set(older[max(0, len(older) - (keep - 1)):])  # keep >= 2 (config.py)
    for s in steps:
        if s < sealed and s not in keep_set:
            shutil.rmtree(step_dir(out_dir, s), ignore_errors=True)


def load_model_state(out_dir: str, step: int, device: torch.device) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), "model.pt"), map_location=device, weights_only=True)


def load_rank_state(out_dir: str, step: int, rank: int) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), f"rank{rank}.pt"), map_location="cpu",
                      weights_only=True)


# ---- the ranks together: save, agree on a step, resume -------------------------------------------

@dataclass
class Disks:
    """Where the ranks' checkpoints live. Nodes share no filesystem as a rule, but launchers on one
    host (the tests, the quality benchmark) or an NFS mount may share a directory: one writer per
    disk, found by looking, not by host name (cloned machines share one)."""

    disk_of_rank: list[int]  # every rank's disk, named by the lowest rank that writes to it
    node_of_rank: list[int]  # every rank's launcher (torchrun's GROUP_RANK)
    group: dist.ProcessGroup | None  # gloo, for the checkpoint's object collectives (CPU even on CUDA)

    def writer(self, rank: int) -> bool:
        return self.disk_of_rank[rank] == rank

    @property
    def writers(self) -> list[int]:
        return sorted(set(self.disk_of_rank))

    def layout(self, hosts: list[str]) -> dict:
        """What the COMPLETE marker says of the world that wrote it."""
        return {"world_size": len(hosts), "hosts": hosts, "node_of_rank": self.node_of_rank}


def find_disks(cfg: TrainConfig, env: DistEnv, watchdog: Watchdog) -> Disks:
    """Each rank leaves a file of its own in the checkpoint directory; ranks that see each other's
    files share a disk."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    if not env.distributed:
        return Disks([0], [node], None)
    # each round of a transfer is bounded like any collective (Gloo's own default is 30 min)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.collective_timeout))
    root = checkpoint_root(cfg.out_dir)
    os.makedirs(root, exist_ok=True)
    token = secrets.token_hex(8)
    probe = os.path.join(root, f".disk-probe-{token}")
    Path(probe).touch()
    tokens: list = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint disk probes", 0):
        dist.all_gather_object(tokens, token, group=group)
    mine = (min(r for r, t in enumerate(tokens) if os.path.exists(os.path.join(root, f".disk-probe-{t}"))), node)
    everyone: list = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint disks", 0):
        dist.all_gather_object(everyone, mine, group=group)  # also: every rank has looked, the probes may go
    os.unlink(probe)
    return Disks([d for d, _ in everyone], [n for _, n in everyone], group)


def fail_together(env: DistEnv, disks: Disks, watchdog: Watchdog, what: str, step: int,
                  problem: str | None) -> None:
    """Every rank learns every rank's problem (None: it has none); if any has one, all of them stop
    with exit 2 naming it, rather than the healthy ones timing out in the next collective and being
    restarted by systemd without it, again and again."""
    problems = [problem]
    if env.distributed:
        problems = [None] * env.world_size
        with watchdog.phase(f"all_gather {what} status", step):
            dist.all_gather_object(problems, problem, group=disks.group)
    by_problem: dict[str, list[str]] = {}
    for r, p in enumerate(problems):
        if p:
            by_problem.setdefault(p, []).extend([f"rank {r}@{env.hosts[r]}"] if env.distributed else [])
    if by_problem:
        msg = " | ".join(f"{', '.join(who)}: {p}" if who else p for p, who in by_problem.items())
        if env.distributed:  # no rank leaves before every rank knows why: a peer's exit reads as the cause
            agree_to_fail(EXIT_CONFIG, msg)
            with watchdog.phase(f"barrier before stopping at {what} step {step}", step):
                dist.barrier(group=disks.group)
        fail(env, EXIT_CONFIG, msg)


def on_cpu(obj):
    """A state with its tensors on the CPU: what travels between ranks and lands on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [on_cpu(v) for v in obj]
    return obj


# one collective's share of a checkpoint exchange: at 10 Mbit/s with 3 nodes a round of 16 MiB
# takes about 27 s, far inside --collective-timeout, whatever the whole checkpoint's size
CHUNK_BYTES = 16 * 2**20


def piece_of(data: bytes, lo: int, n: int) -> torch.Tensor:
    """Bytes lo..lo+n of `data` as a uint8 tensor of n, zero-padded past its end (one copy)."""
    piece = torch.zeros(n, dtype=torch.uint8)
    mine = bytearray(memoryview(data)[lo:lo + n])
    if mine:
        piece[:len(mine)] = torch.frombuffer(mine, dtype=torch.uint8)
    return piece


def exchange_chunk(out: list[torch.Tensor] | None, piece: torch.Tensor, dst: int | None,
                   group: dist.ProcessGroup) -> None:
    """One round of a chunked exchange: every rank's `piece` to every rank (dst None) or to dst."""
    if dst is None:
        dist.all_gather(out, piece, group=group)
    else:
        dist.gather(piece, out, dst=dst, group=group)


def exchange_bytes(env: DistEnv, disks: Disks, data: bytes, dst: int | None, watchdog: Watchdog, step: int,
                   what: str) -> tuple[list[bytearray] | None, int]:
    """Every rank's `data`, on every rank (dst None: an all-gather) or on rank dst (a gather), and
    the number of rounds it took. The bytes go in rounds of CHUNK_BYTES, each a collective that
    the watchdog times on its own: one collective for the whole would outlast --collective-timeout
    on a slow link once the model is big enough (10 Mbit/s, depth 8: 461 s already, against the
    watchdog's 630 at the default --collective-timeout), and the
    watchdog would stop every rank at every checkpoint, the run never getting past one."""
    world = env.world_size
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    with watchdog.phase(f"all_gather {what} sizes", step):
        dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=disks.group)
    sizes = [int(n) for n in lengths]
    longest, receiving = max(sizes), dst is None or env.rank == dst
    parts = [bytearray() for _ in range(world)] if receiving else None
    rounds = max(1, -(-longest // CHUNK_BYTES))
    for i in range(rounds):
        lo = i * CHUNK_BYTES
        n = min(CHUNK_BYTES, longest - lo)
        out = [torch.empty(n, dtype=torch.uint8) for _ in range(world)] if receiving else None
        with watchdog.phase(f"{'all_gather' if dst is None else 'gather'} {what}, round {i + 1} of {rounds}", step):
            exchange_chunk(out, piece_of(data, lo, n), dst, disks.group)
        if parts is not None:
            for r in range(world):
                parts[r] += out[r][:max(0, min(n, sizes[r] - lo))].numpy().tobytes()
    return parts, rounds


def gather_states(env: DistEnv, disks: Disks, data: bytes, watchdog: Watchdog, step: int,
                  ) -> tuple[list[bytes | bytearray], str]:
    """Every rank's state (`data`: its torch.save bytes), as bytes, on every disk's writer ([] on
    the other ranks), and what crossed (for the log line). With one rank per disk (a node per host,
    the usual case) that is one all-gather: Gloo's ring moves every node's share over every link at
    once, where a gather per writer loads one writer's link at a time (10 Mbit/s, 3 nodes, local
    steps' whole-model optimizer states: 1,289 s). Ranks that share a disk send to its writer only,
    one gather per writer: the others would hold every rank's state for nothing."""
    if not env.distributed:
        return [data], ""
    every_disk = len(disks.writers) == env.world_size
    got, rounds = None, 0
    for w in [None] if every_disk else disks.writers:
        received, rounds = exchange_bytes(env, disks, data, w, watchdog, step, "checkpoint states")
        got = received if received is not None else got
    del data
    if got is None:  # a rank that writes no disk
        return [], ""
    return got, f"; {sum(len(b) for b in got) / 2**20:.1f} MiB of {len(got)} ranks' states in {rounds} round(s)"


@dataclass
class Snapshot:
    """A checkpoint's contents as of its step: this rank's state as torch.save bytes, and on a
    disk's writer the weights (a copy of its own where the inner steps go on while it is written:
    checkpoint_background.py)."""

    step: int
    rank_state: bytes
    model_state: dict | None  # None on a rank that writes no disk
    model_cfg: dict  # the model's shape, for the marker
    state: RunState


def take_snapshot(env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, loader: TokenLoader, step: int,
                  state: RunState, copy_weights: bool) -> Snapshot:
    buf = io.BytesIO()
    torch.save(on_cpu({"step": step, "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                       "rng": torch.get_rng_state(), SAVED_KEY: state.to_saved()}), buf)
    data = buf.getvalue()
    del buf  # its copy of the bytes: the state is not held twice through the exchange
    weights = None
    if disks.writer(env.rank):
        weights = model.state_dict()
        if copy_weights:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
    return Snapshot(step, data, weights, dataclasses.asdict(model.cfg), state)


def write_checkpoint(cfg: TrainConfig, env: DistEnv, disks: Disks, snap: Snapshot, watchdog: Watchdog,
                     how: str = "") -> float:
    """Every rank's state to every disk, then sealed on every disk once all of them hold it;
    collective. `how` ends the log line (the background's note). Returns the seconds it took."""
    t0, step = time.perf_counter(), snap.step
    # every disk gets every rank's state: a node that is wiped, added or alone can still resume
    rank_files, crossed = gather_states(env, disks, snap.rank_state, watchdog, step)
    snap.rank_state = b""
    error = None
    stalled = (f"Fix: look at the disk under {cfg.out_dir} on {env.host} (`dmesg`, its mount); the unit restarts "
               f"and resumes from the newest sealed checkpoint")
    if disks.writer(env.rank):
        try:
            with watchdog.disk(f"writing checkpoint step {step} to {step_dir(cfg.out_dir, step)}", step,
                               stalled) as progress:
                write_step_files(cfg.out_dir, step, snap.model_state, rank_files, progress)
        except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
            done = complete_steps(cfg.out_dir)
            error = (f"cannot write checkpoint step {step} under {cfg.out_dir}: {type(exc).__name__}: {exc}. "
                     f"Earlier checkpoints are untouched (newest complete: {done[-1] if done else 'none'}). Fix: "
                     f"free space on {env.host} or move --out-dir, then start the run again: it resumes from there")
    del rank_files
    snap.model_state = None
    # instead of a plain barrier: a full disk on one node stops every rank with its reason
    fail_together(env, disks, watchdog, "checkpoint", step, error)
    if disks.writer(env.rank):
        # the model's shape and its tokenizer: what sampling needs besides model.pt, wherever it is copied
        sampling = {"model": snap.model_cfg, "tokenizer_sha256": snap.state.tokenizer_sha256,
                    "tokenizer_dir": os.path.abspath(cfg.tokenizer_dir)}
        with watchdog.disk(f"sealing checkpoint step {step} in {step_dir(cfg.out_dir, step)}", step, stalled):
            mark_complete(cfg.out_dir, step, {**disks.layout(env.hosts or [env.host]), **sampling,
                                               **snap.state.marker_fields()},
                          cfg.keep_checkpoints)
    took = time.perf_counter() - t0
    log(env, f"checkpoint step {step} saved to {step_dir(cfg.out_dir, step)} in {took:.2f}s{crossed}{how}")
    return took


def save_checkpoint(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW,
                    loader: TokenLoader, step: int, watchdog: Watchdog, state: RunState) -> float:
    """A checkpoint written while every rank waits for it; returns the seconds it took."""
    snap = take_snapshot(env, disks, model, opt, loader, step, state, False)
    return write_checkpoint(cfg, env, disks, snap, watchdog)


START_AFRESH = "start afresh with another --run-name or --out-dir"


def tokenizer_refusal(tokenizer_dir: str, where: str, saved: RunState, tokenizer_sha: str,
                      vocab_size: int) -> str | None:
    """Why the checkpoint at `where` (its run state) must not be resumed with this tokenizer."""
    if saved.tokenizer_sha256 in (None, tokenizer_sha):
        return None
    return (f"checkpoint {where} was trained with another tokenizer (sha256 {saved.tokenizer_sha256[:16]}, "
            f"vocab {saved.vocab_size or '?'}) than --tokenizer-dir={tokenizer_dir} "
            f"(sha256 {tokenizer_sha[:16]}, vocab {vocab_size}): its token ids mean other strings. Fix: push the "
            f"run's original tokenizer again (site.yml), or {START_AFRESH}")


def survey(cfg: TrainConfig, env: DistEnv, disks: Disks, watchdog: Watchdog) -> list[dict[int, dict]]:
    """Every rank's complete checkpoints on its disk: {step: its COMPLETE marker}, by rank."""
    markers = {s: read_marker(cfg.out_dir, s) for s in list_steps(cfg.out_dir)}
    mine = {s: marker for s, marker in markers.items() if marker is not None}  # each marker read once
    if not env.distributed:
        return [mine]
    everyone: list = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint steps", 0):
        dist.all_gather_object(everyone, mine, group=disks.group)
    return everyone


def holdings(env: DistEnv, everyone: list[dict[int, dict]]) -> str:
    hosts = env.hosts or [env.host]
    return "; ".join(f"rank {r}@{hosts[r]}: steps {sorted(steps) or 'none'}" for r, steps in enumerate(everyone))


def choose_resume_step(cfg: TrainConfig, env: DistEnv, everyone: list[dict[int, dict]]) -> int | None:
    """The newest step some disk holds whole; None for a fresh run. A checkpoint sealed by an older
    version holds only its node's ranks' files: it counts only where every rank's disk has it."""
    if cfg.resume == "never":
        if any(everyone):
            fail(env, EXIT_CONFIG, f"--resume never, but {cfg.out_dir} already holds this run's checkpoints "
                                   f"({holdings(env, everyone)}): a fresh run would mix with them and prune them. "
                                   f"Fix: another --run-name or --out-dir for a new run, or --resume auto to go on "
                                   f"with this one")
        return None
    usable = set()
    for steps in everyone:
        usable |= {s for s, marker in steps.items() if "world_size" in marker}
    usable |= set.intersection(*(set(steps) for steps in everyone))
    if not usable and any(everyone):  # only an older version's checkpoints, and not on every disk
        fail(env, EXIT_CONFIG, f"{cfg.out_dir} holds checkpoints written by an older version "
                               f"({holdings(env, everyone)}), which kept each node's own ranks' files only: "
                               f"they resume only on the nodes that wrote them. Fix: resume once on those nodes "
                               f"until the next checkpoint (it holds every rank's state), then change the "
                               f"cluster; or {START_AFRESH}")
    return max(usable) if usable else None


def restore_missing(cfg: TrainConfig, env: DistEnv, disks: Disks, step: int, everyone: list[dict[int, dict]],
                    watchdog: Watchdog) -> None:
    """The disks that lack checkpoint `step` (wiped, replaced, or a node just added) get it from the
    lowest rank that has it, file by file over the process group, before anyone loads it."""
    holders = [r for r, steps in enumerate(everyone) if step in steps]
    needy = [r for r in disks.writers if step not in everyone[r]]
    if not needy:
        return
    source, marker, t0 = holders[0], everyone[holders[0]][step], time.perf_counter()
    d, problem, size = step_dir(cfg.out_dir, step), None, 0
    if env.rank in needy:  # nothing unsealed of this step is kept
        shutil.rmtree(d, ignore_errors=True)
    for n in needy:
        if env.rank not in (source, n):
            continue
        for name in marker["files"]:  # one file in memory at a time
            data = Path(d, name).read_bytes() if env.rank == source else b""
            got = send_bytes(env, disks, data, source, n, watchdog, f"checkpoint file {name}")
            if got is not None and problem is None:
                size += len(got)
                problem = write_restored_file(cfg.out_dir, step, name, got, env, watchdog)
    if env.rank in needy and problem is None:
        problem = write_restored_file(cfg.out_dir, step, "COMPLETE", json.dumps(marker).encode(), env, watchdog)
        fsync_dir(checkpoint_root(cfg.out_dir))
        prune(cfg.out_dir, cfg.keep_checkpoints, sealed=step)
        log(env, f"checkpoint step {step} was missing on this disk: restored from rank {source}@"
                 f"{env.hosts[source]} ({size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f}s)")
    fail_together(env, disks, watchdog, "checkpoint restore", 0, problem)


def send_bytes(env: DistEnv, disks: Disks, data: bytes, src: int, dst: int, watchdog: Watchdog,
               what: str) -> bytearray | None:
    """Rank src's `data`, on rank dst (None elsewhere), in rounds of CHUNK_BYTES that the watchdog
    times one by one (exchange_bytes says why)."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    with watchdog.phase(f"send {what}: its size", 0):
        if env.rank == src:
            dist.send(size, dst=dst, group=disks.group)
        else:
            dist.recv(size, src=src, group=disks.group)
    total = int(size[0])
    rounds, got = -(-total // CHUNK_BYTES), bytearray()
    for i in range(rounds):
        lo = i * CHUNK_BYTES
        n = min(CHUNK_BYTES, total - lo)
        with watchdog.phase(f"send {what}, round {i + 1} of {rounds}", 0):
            if env.rank == src:
                dist.send(piece_of(data, lo, n), dst=dst, group=disks.group)
            else:
                piece = torch.empty(n, dtype=torch.uint8)
                dist.recv(piece, src=src, group=disks.group)
                got += piece.numpy().tobytes()
    return got if env.rank == dst else None


def write_restored_file(out_dir: str, step: int, name: str, data: bytes | bytearray, env: DistEnv,
                        watchdog: Watchdog) -> str | None:
    """One file of a restored checkpoint, atomically (COMPLETE, the last, seals it); the problem, if any."""
    d = step_dir(out_dir, step)
    try:
        with watchdog.disk(f"restoring checkpoint step {step}'s {name} to {d}", step,
                           f"Fix: look at the disk under {out_dir} on {env.host} (`dmesg`, its mount)") as progress:
            os.makedirs(d, exist_ok=True)
            atomic_write_bytes(os.path.join(d, name), data, progress)
            if name == "COMPLETE":
                fsync_dir(d)
    except OSError as exc:
        return (f"cannot restore checkpoint step {step} under {out_dir}: {type(exc).__name__}: {exc}. Fix: free "
                f"space on {env.host} (about {len(data) / 2**20:.0f} MiB a file) or move --out-dir, then start "
                f"the run again")
    return None


def sync_refusal(where: str, saved: RunState, local_steps: bool) -> str | None:
    """Why a checkpoint (its run state) must not be resumed by this kind of sync. Local steps go
    on from a synchronous checkpoint (every node continues the whole optimizer state: the end of
    the synchronous warm-up); the reverse would have to pick one node's inner state, so it is refused."""
    if not saved.local_steps or local_steps:
        return None
    return (f"checkpoint {where} was trained with local steps (--sync-every above 1 or auto, past its "
            f"--sync-warmup-ratio), this run asks for every step synchronous (--sync-every 1, or a step still "
            f"inside a longer --sync-warmup-ratio): each node kept its own optimizer state, which one step "
            f"cannot continue. Fix: resume with the run's --sync-every and --sync-warmup-ratio, or {START_AFRESH}")


def ranks_by_node(node_of_rank: list[int]) -> list[list[int]]:
    """The ranks of each launcher, in launcher order (as sync_diloco.find_nodes groups them)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    return [by_node[n] for n in sorted(by_node)]


def load_states(cfg: TrainConfig, env: DistEnv, disks: Disks, step: int, marker: dict, local_steps: bool,
                strategy: str) -> tuple[dict, RunState, dict | None, str]:
    """This rank's optimizer state and RNG, the run state, the loader position from checkpoint `step`, and how it
    was laid out. The same layout, stepped the same way, loads the rank's own file as it was saved
    (the resumed run repeats the uninterrupted one exactly); another merges every saved rank's state
    and takes its part."""
    where = step_dir(cfg.out_dir, step)
    now = disks.layout(env.hosts or [env.host])
    wrote = f"written by {marker.get('world_size', 'this layout of')} ranks on hosts " \
            f"{', '.join(sorted(set(marker.get('hosts', now['hosts']))))}"
    if "world_size" not in marker or (marker["world_size"], marker["node_of_rank"]) == (now["world_size"],
                                                                                     now["node_of_rank"]):
        state = load_rank_state(cfg.out_dir, step, env.rank)
        # the same world may step another way (shared memory now missing, or back; local steps after
        # the synchronous warm-up): then merge
        run_state = RunState.of_rank_file(state)
        same_kind = run_state.local_steps == local_steps
        if "world_size" not in marker or (same_kind and state["optimizer"].get("strategy", strategy) == strategy):
            return state, run_state, state["loader"], f"resumed from checkpoint step {step} ({where}), {wrote}"
    saved = [load_rank_state(cfg.out_dir, step, r) for r in range(marker["world_size"])]
    state = dict(saved[min(env.rank, len(saved) - 1)])
    # the work split is the ranks' own: kept where the same ranks on the same hosts merge only to
    # step another way (local steps after synchronous ones), measured anew for another layout; and
    # checked again against the inner steps, whose speeds differ from synchronous steps'
    same_ranks = all(marker.get(k) == now[k] for k in ("world_size", "node_of_rank", "hosts"))
    run_state = RunState.of_rank_file(saved[0])
    if not same_ranks:
        run_state.rank_batch_sizes = None
    if local_steps and not run_state.local_steps:
        run_state.split_settled = False
    if run_state.local_steps and not local_steps:
        return state, run_state, None, ""  # local steps continued synchronously: resume refuses it, naming both
    # the ranks whose optimizer this rank's continues: all of them (synchronous steps, or the local
    # steps that follow them: every node continues the whole state), or one old node's
    stepped = list(range(len(saved)))
    if run_state.local_steps:  # a new node continues an old one's (its index's, or node 0's)
        old, new = ranks_by_node(marker["node_of_rank"]), ranks_by_node(now["node_of_rank"])
        index = next(i for i, ranks in enumerate(new) if env.rank in ranks)
        stepped = old[index] if index < len(old) else old[0]
        run_state.outer = merge_outer_states([RunState.of_rank_file(saved[ranks[0]]).outer for ranks in old])
    state["optimizer"] = merge_optimizer_states([saved[r]["optimizer"] for r in stepped])
    loader = carry_over_position([s["loader"] for s in saved], env.rank, env.world_size,
                                 len(row_group_pairs(cfg.data_dir, "train")))
    return state, run_state, loader, f"resumed step {step}, {wrote}, re-sharded to {env.world_size} ranks"


def load_into(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, step: int, marker: dict,
              local_steps: bool, tokenizer_sha: str, vocab_size: int,
              ) -> tuple[str | None, dict | None, RunState, str]:
    """Checkpoint `step` into model, opt and the RNG: (why it cannot be, or None; the loader's
    position; the run state; the line that says where it came from)."""
    where = step_dir(cfg.out_dir, step)
    fix = f"resume from an older checkpoint by deleting {where} on every node, or {START_AFRESH}"
    try:
        rank_state, saved, loader_state, said = load_states(cfg, env, disks, step, marker, local_steps,
                                                            opt.sync.name)
        model_state = load_model_state(cfg.out_dir, step, env.device)
    except Exception as exc:  # noqa: BLE001 - unreadable or unfitting files: name them instead of a traceback
        return f"checkpoint {where} cannot be resumed ({type(exc).__name__}: {exc}); {fix}", None, RunState(), ""
    refusal = (tokenizer_refusal(cfg.tokenizer_dir, where, saved, tokenizer_sha, vocab_size)
               or sync_refusal(where, saved, local_steps))
    packing = packing_mismatch(loader_state, cfg.packing) if loader_state is not None else None
    refusal = refusal or (f"checkpoint {where}: {packing}" if packing else None)
    if refusal:
        return refusal, None, RunState(), ""
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        return (f"checkpoint {where} does not fit this model (depth {cfg.depth}, vocab {vocab_size}): "
                f"{str(exc).splitlines()[-1].strip()}; {fix}"), None, RunState(), ""
    try:
        opt.load_state_dict(rank_state["optimizer"])
    except ValueError as exc:
        return f"checkpoint {where}: {exc}", None, RunState(), ""
    torch.set_rng_state(rank_state["rng"])
    return None, loader_state, saved, said


def find_resume_step(cfg: TrainConfig, env: DistEnv, disks: Disks,
                     watchdog: Watchdog) -> tuple[int | None, list[dict[int, dict]]]:
    """The newest step some disk holds whole (None: a fresh run) and every rank's checkpoints; the
    trainer needs the step before it builds the optimizer (synchronous, or local steps past the warm-up)."""
    everyone = survey(cfg, env, disks, watchdog)
    return choose_resume_step(cfg, env, everyone), everyone


def load_checkpoint(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, step: int,
                    everyone: list[dict[int, dict]], tokenizer_sha: str, vocab_size: int, watchdog: Watchdog,
                    local_steps: bool) -> tuple[dict | None, RunState, str]:
    """Checkpoint `step` into model, opt and the RNG, restoring it first to the disks that lack it:
    (the loader's position, the run state, the line that says where it came from). Every rank
    learns whether every rank could load it: one that cannot stops them all."""
    if env.distributed:
        restore_missing(cfg, env, disks, step, everyone, watchdog)
    marker = next(steps[step] for steps in everyone if step in steps)
    problem, loader_state, saved, said = load_into(cfg, env, disks, model, opt, step, marker, local_steps,
                                                   tokenizer_sha, vocab_size)
    fail_together(env, disks, watchdog, "resume", 0, problem)
    return loader_state, saved, said


def resume(cfg: TrainConfig, env: DistEnv, disks: Disks, model: GPT, opt: MuonAdamW, found: tuple[int | None, list],
           tokenizer_sha: str, vocab_size: int, watchdog: Watchdog,
           local_steps: bool = False) -> tuple[int, dict | None, RunState]:
    """Load `found` (find_resume_step's) into model, opt and the RNG, refusing a checkpoint that does
    not fit; returns (the step to start from, the loader's position, the run state: empty for a
    fresh run). With local steps a local checkpoint is from an outer boundary: the model is
    theta_global, and the run state holds the outer momentum and the schedule."""
    resume_step, everyone = found
    if resume_step is None:
        return 0, None, RunState()
    loader_state, saved, said = load_checkpoint(cfg, env, disks, model, opt, resume_step, everyone, tokenizer_sha,
                                                vocab_size, watchdog, local_steps)
    log(env, said)
    return resume_step, loader_state, saved
