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
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import torch

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
