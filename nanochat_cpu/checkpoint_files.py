"""A checkpoint on one disk: its files, written so that a crash never leaves half of one.

Layout under `<out_dir>/checkpoints/step_000100/`, on every node's disk:
- `model.pt`                the model
- `rank{r}.pt`              every rank's optimizer state, loader position, RNG state and run state
                            (run_state.py), for each rank r of the world that wrote it (all of
                            them, on every disk)
- `COMPLETE`                written last, once every disk's write succeeded: the checkpoint is valid
                            only when this marker exists and lists the files present; it names the
                            run that wrote it (run_identity.py) and the world (world size, every
                            rank's host and launcher), the sha256 of every file (taken as it was
                            written, checked on resume: torch's zip reader checks no CRC), and the
                            model's shape and tokenizer, so that `model.pt` and it alone are enough
                            to sample from the model anywhere (sample.py)

Every file is written to a temporary name and renamed, and the directories are fsynced, so an
interrupted write (disk full, SIGKILL, power loss) leaves either the old file or the new one,
never half of one. A step without its COMPLETE marker is ignored on resume and cleaned up later.
Old checkpoints are deleted only after a newer one is complete, and never one newer than it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

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
    unexpected pos', and the reason would be lost. The bytes are hashed on their way (torch.save
    writes its zip front to back): the marker's sha256 costs no second read."""

    def __init__(self, f, progress: Callable[[], None]):
        self.f, self.progress, self.error, self.unsynced = f, progress, None, 0
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")  # torch.save hands a tensor's whole storage in one call
        try:
            done = 0
            while done < len(view):
                piece = view[done: done + SYNC_BYTES - self.unsynced]
                self.f.write(piece)
                self.sha.update(piece)
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


def atomic_torch_save(obj, path: str, progress: Callable[[], None] = no_progress) -> str:
    """`obj` saved to `path` atomically; returns the file's sha256."""
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
        return out.sha.hexdigest()
    except BaseException:
        # disk full: give the space of the partial file back (a SIGKILL leaves it; prune removes it)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes | bytearray, progress: Callable[[], None] = no_progress) -> str:
    """`data` written to `path` atomically; returns its sha256."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            out = _ToDisk(f, progress)
            out.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return out.sha.hexdigest()
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
                     progress: Callable[[], None] = no_progress) -> dict[str, str]:
    """Phase 1, once per disk: the model and every rank's state (its torch.save bytes, as it sent
    them: written as they are, each dropped once on disk), so this disk alone can resume the run
    at any layout. Returns each file's sha256. The caller learns whether every disk's write
    succeeded, then seals."""
    d = step_dir(out_dir, step)
    if os.path.isdir(d):  # an unsealed wreck of an earlier attempt at this step (another run's were set aside)
        shutil.rmtree(d)
    os.makedirs(d)
    digests = {"model.pt": atomic_torch_save(model_state, os.path.join(d, "model.pt"), progress)}
    for r in range(len(rank_files)):
        digests[f"rank{r}.pt"] = atomic_write_bytes(os.path.join(d, f"rank{r}.pt"), rank_files[r], progress)
        rank_files[r] = b""
        progress()
    return digests


def mark_complete(out_dir: str, step: int, layout: dict, digests: dict[str, str], keep: int) -> None:
    """Phase 2, after every disk's write succeeded: seal the checkpoint with its files' sha256
    (`digests`: write_step_files'), make it durable, prune."""
    d = step_dir(out_dir, step)
    files = ["model.pt"] + [f"rank{r}.pt" for r in range(layout["world_size"])]
    missing = [f for f in files if not os.path.exists(os.path.join(d, f))]
    if missing:
        raise RuntimeError(f"checkpoint {d} is missing {missing} after the barrier")
    atomic_write_text(os.path.join(d, "COMPLETE"), json.dumps({"step": step, "files": files, **layout,
                                                               "sha256": digests}))
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


def missing_files(out_dir: str, step: int) -> list[str] | None:
    """What a sealed step lacks on this disk: [] when it is whole, the names its COMPLETE marker
    lists that are gone (or the marker itself, unreadable), None when it was never sealed (a write
    cut short: not a checkpoint)."""
    d = step_dir(out_dir, step)
    marker = os.path.join(d, "COMPLETE")
    if not os.path.lexists(marker):
        return None
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
        return [name for name in files if not os.path.exists(os.path.join(d, name))]
    except (OSError, ValueError, KeyError, TypeError):
        return ["COMPLETE (unreadable)"]


def marker_run_id(out_dir: str, step: int) -> object:
    """The run id a sealed step's marker holds, as it is (run_identity.run_of judges it); None for
    one sealed before runs had ids, or unreadable."""
    try:
        with open(os.path.join(step_dir(out_dir, step), "COMPLETE")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


READ_BYTES = 8 << 20  # a checked file is read in pieces this size: each one is progress


def sha256_of(path: str, progress: Callable[[], None] = no_progress) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
            progress()
    return digest.hexdigest()


def bad_files(out_dir: str, step: int, marker: dict, progress: Callable[[], None] = no_progress) -> list[str]:
    """The files of a sealed step whose bytes differ from the sha256 its marker recorded (a flipped
    bit, a file cut short or replaced since), or that cannot be read (EIO); [] for a marker sealed
    before they were recorded."""
    d, recorded, bad = step_dir(out_dir, step), marker.get("sha256") or {}, []
    for name, digest in recorded.items():
        try:
            same = sha256_of(os.path.join(d, name), progress) == digest
        except OSError:
            same = False
        if not same:
            bad.append(name)
    return bad


OTHER_RUNS = "other-runs"  # under checkpoints/: another run's checkpoints, set aside where no run looks


def set_aside(out_dir: str, step: int, run_id: str) -> str:
    """Move another run's step out of this run's way, to checkpoints/other-runs/<its id>/ (never
    over something there already); returns where it went."""
    root = os.path.join(checkpoint_root(out_dir), OTHER_RUNS, run_id)
    os.makedirs(root, exist_ok=True)
    name, n = os.path.basename(step_dir(out_dir, step)), 1
    dest = os.path.join(root, name)
    while os.path.lexists(dest):
        n += 1
        dest = os.path.join(root, f"{name}.{n}")
    os.rename(step_dir(out_dir, step), dest)
    fsync_dir(root)
    fsync_dir(checkpoint_root(out_dir))
    return dest


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
