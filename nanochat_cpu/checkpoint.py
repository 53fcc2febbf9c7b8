"""Checkpoints that survive crashes mid-write and need no shared filesystem.

Layout under `<out_dir>/checkpoints/step_000100/`:
- `model.pt`                written by local rank 0 of every node (each node can resume alone)
- `rank{r}.pt`              each rank's optimizer shard, loader position and RNG state
- `COMPLETE`                written last, after a barrier, by local rank 0: the checkpoint is
                            valid only when this marker exists and lists the files present

Every file is written to a temporary name and renamed, so an interrupted write (disk full,
SIGKILL) leaves either the old file or the new one, never half of one. A step without its
COMPLETE marker is ignored on resume and cleaned up later. Old checkpoints are deleted only
after a newer one is complete.

The second half is the trainer's side: every rank saves its files and learns whether every other
rank's write succeeded (a full disk stops all ranks with its reason); on start, the ranks resume
from the newest step complete on every node, and refuse a checkpoint that does not fit the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .dist import EXIT_CONFIG, DistEnv, Watchdog, fail, log

if TYPE_CHECKING:
    from .config import TrainConfig
    from .dataloader import TokenLoader
    from .model import GPT
    from .optim import MuonAdamW

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def step_dir(out_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(out_dir), f"step_{step:06d}")


class _WriteErrors:
    """A file whose write errors are kept: torch.save turns a failed write (ENOSPC, EIO) into
    'enforce fail ... unexpected pos', and the reason would be lost."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _WriteErrors(f)
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


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rank_files(out_dir: str, step: int, rank: int, local_rank: int, model_state: dict | None,
                    rank_state: dict) -> None:
    """Phase 1, every rank: its own files. The caller then barriers and calls `mark_complete`."""
    d = step_dir(out_dir, step)
    os.makedirs(d, exist_ok=True)
    if local_rank == 0 and model_state is not None:
        atomic_torch_save(model_state, os.path.join(d, "model.pt"))
    atomic_torch_save(rank_state, os.path.join(d, f"rank{rank}.pt"))


def mark_complete(out_dir: str, step: int, ranks_on_node: list[int], keep: int) -> None:
    """Phase 2, local rank 0 after a barrier: seal the checkpoint, then prune older ones."""
    d = step_dir(out_dir, step)
    files = ["model.pt"] + [f"rank{r}.pt" for r in ranks_on_node]
    missing = [f for f in files if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise RuntimeError(f"checkpoint {d} is missing {missing} after the barrier")
    atomic_write_text(os.path.join(d, "COMPLETE"), json.dumps({"step": step, "files": files}))
    prune(out_dir, keep)


def is_complete(out_dir: str, step: int, rank: int) -> bool:
    d = step_dir(out_dir, step)
    marker = os.path.join(d, "COMPLETE")
    if not os.path.exists(marker):
        return False
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return False
    return f"rank{rank}.pt" in files and all(os.path.exists(os.path.join(d, name)) for name in files)


def list_steps(out_dir: str) -> list[int]:
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_DIR.match(n)))


def complete_steps(out_dir: str, rank: int) -> list[int]:
    return [s for s in list_steps(out_dir) if is_complete(out_dir, s, rank)]


def prune(out_dir: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop older ones and stale incomplete ones."""
    steps = list_steps(out_dir)
    complete = [s for s in steps if os.path.exists(os.path.join(step_dir(out_dir, s), "COMPLETE"))]
    keep_set = set(complete[-keep:])
    newest_complete = complete[-1] if complete else -1
    for s in steps:
        # an incomplete dir newer than the newest complete one may be being written right now
        if s not in keep_set and (s in complete or s < newest_complete):
            shutil.rmtree(step_dir(out_dir, s), ignore_errors=True)


def load_model_state(out_dir: str, step: int, device: torch.device) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), "model.pt"), map_location=device, weights_only=True)


def load_rank_state(out_dir: str, step: int, rank: int) -> dict:
    return torch.load(os.path.join(step_dir(out_dir, step), f"rank{rank}.pt"), map_location="cpu",
                      weights_only=False)


# ---- the ranks together: save, agree on a step, resume -------------------------------------------

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
        save_rank_files(cfg.out_dir, step, env.rank, env.local_rank, model_state, rank_state)
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as RuntimeError
        done = complete_steps(cfg.out_dir, env.rank)
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
        mark_complete(cfg.out_dir, step, ranks_on_this_node(env), cfg.keep_checkpoints)
    log(env, f"checkpoint step {step} saved to {step_dir(cfg.out_dir, step)} "
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
    mine = complete_steps(cfg.out_dir, env.rank)
    if not env.distributed:
        return mine[-1] if mine else None
    everyone: list[list[int] | None] = [None] * env.world_size
    with watchdog.phase("all_gather checkpoint steps", 0):
        dist.all_gather_object(everyone, mine)
    common = set(everyone[0] or [])
    for steps in everyone[1:]:
        common &= set(steps or [])
    return max(common) if common else None


def sync_refusal(where: str, saved: dict, local_steps: bool) -> str | None:
    """Why a checkpoint of the other kind of sync (its saved `extra`) must not be resumed: local
    steps keep a whole optimizer state per node, synchronous steps one shard per rank."""
    saved_local = "outer" in saved
    if saved_local == local_steps:
        return None
    kinds = {True: "local steps (--sync-every above 1 or auto)", False: "every step synchronous (--sync-every 1)"}
    return (f"checkpoint {where} was trained with {kinds[saved_local]}, this run asks for {kinds[local_steps]}: "
            f"their optimizer states are laid out differently (a whole one per node, or a shard per rank). Fix: "
            f"resume with the run's --sync-every, or {START_AFRESH}")


def resume(cfg: TrainConfig, env: DistEnv, model: GPT, opt: MuonAdamW, tokenizer_sha: str, vocab_size: int,
           watchdog: Watchdog, local_steps: bool = False) -> tuple[int, dict | None, dict]:
    """Load the newest checkpoint every rank has into model, opt and the RNG, refusing one that
    does not fit; returns (the step to start from, the loader's position, the saved `extra`).
    With local steps the checkpoint is from an outer boundary: the model is theta_global, and
    `extra` holds the outer momentum and the schedule (train.setup_local_steps)."""
    resume_step = agree_on_resume_step(cfg, env, watchdog)
    if resume_step is None:
        return 0, None, {}
    where = step_dir(cfg.out_dir, resume_step)
    fix = f"resume from an older checkpoint by deleting {where}, or {START_AFRESH}"
    try:
        rank_state = load_rank_state(cfg.out_dir, resume_step, env.rank)
        model_state = load_model_state(cfg.out_dir, resume_step, env.device)
    except Exception as exc:  # noqa: BLE001 - unreadable file: name it instead of a traceback
        fail(env, EXIT_CONFIG, f"checkpoint {where} is unreadable ({type(exc).__name__}: {exc}); {fix}")
    extra = rank_state.get("extra", {})
    refusal = tokenizer_refusal(cfg, where, extra, tokenizer_sha, vocab_size) or sync_refusal(where, extra,
                                                                                             local_steps)
    if refusal:
        fail(env, EXIT_CONFIG, refusal)
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        fail(env, EXIT_CONFIG, f"checkpoint {where} does not fit this model (depth {cfg.depth}, vocab "
                               f"{vocab_size}): {str(exc).splitlines()[-1].strip()}; {fix}")
    try:
        opt.load_state_dict(rank_state["optimizer"])
    except ValueError as exc:
        fail(env, EXIT_CONFIG, str(exc))
    torch.set_rng_state(rank_state["rng"])
    log(env, f"resumed from checkpoint step {resume_step} ({where})")
    return resume_step, rank_state["loader"], extra
