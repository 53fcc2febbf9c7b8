"""Ranks on one host share parameters, gradients and optimizer state in memory instead of copying them.

Two Gloo ranks on one machine move every parameter and gradient through loopback TCP each step
(Gloo's threads copy them on the same cores the model needs), which is why upstream nanochat's two
ranks on one CPU are slower than one process. When every rank of the run was started by one
launcher (LOCAL_WORLD_SIZE == WORLD_SIZE, so one host), the optimizer can instead keep:

- one copy of the parameters and of the optimizer state, mapped by every rank, which any rank
  may update in place (the optimizer hands the work out under `SharedArena.lock`);
- every rank's gradient buffer in one (world, ...) tensor, from which whoever updates a part sums
  that part of every rank's gradients: no "reduce-scatter" and no "all-gather", one barrier.

The tensors are files in a private directory: `$RUNTIME_DIRECTORY` when systemd set it (the
trainer unit's `RuntimeDirectory=`, mode 0700, which systemd removes when the unit stops), else
/dev/shm. For each tensor rank 0 makes a fresh 0700 directory there and one file in it (both
exclusive: never something another user put there first), every rank opens the file, and rank 0
removes file and directory again before the call returns: the memory is held only by the
ranks' mappings, so nothing is left behind when a run stops, even by SIGKILL (except during the
few milliseconds between creation and unlink at start).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
# a file of ours and nothing else: O_EXCL fails on anything already there, O_NOFOLLOW on a symlink
CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW
SHM_FIX = "in a container, raise it with podman/docker --shm-size"
MARGIN = 64 << 20  # beyond buffer_bytes(): padding, the tables' row flags, the work queue


def arena_base(nbytes: int = 0) -> tuple[Path | None, str]:
    """The directory the arena's `nbytes` go in, or None and why not; the second item also says
    why /dev/shm was taken over a RUNTIME_DIRECTORY (for the banner)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "")
    if not runtime:
        return SHM_DIR, ""
    path = Path(runtime.split(":")[0])  # systemd lists one path per RuntimeDirectory= entry; ours has one
    problem = private_dir_problem(path)
    if problem:
        return None, (f"RUNTIME_DIRECTORY={path} {problem}; fix: RuntimeDirectory= with RuntimeDirectoryMode=0700 "
                      f"in the unit, or unset RUNTIME_DIRECTORY to use {SHM_DIR}")
    free = shutil.disk_usage(path).free
    if free < nbytes + MARGIN:
        # /run is a tmpfs sized to a fraction of RAM; /dev/shm is as private here (a fresh 0700
        # directory per file, unlinked once mapped), so a small /run never costs the shared path.
        return SHM_DIR, f"{path} has {free / 2**20:.0f} MiB free, so {SHM_DIR}"
    return path, ""


def private_dir_problem(path: Path) -> str:
    """Why `path` is not a directory only this user can enter ("" when it is)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: others than its owner may enter it, it must be 0700"
    return ""


def plan(mode: str, world_size: int, local_world_size: int, device: torch.device, nbytes: int,
         shm_dir: Path | None = None) -> tuple[bool, str]:
    """Whether this rank could share the optimizer's buffers in memory, and why (for the banner).

    `mode` is --local-comm: auto, shm or gloo. `make_arena` turns the answers of all ranks into
    one decision (shm where it cannot work is an error there, not a silent fallback). `shm_dir`:
    where the files would go, arena_base(nbytes) unless given.
    """
    if world_size == 1:
        return False, "one rank"
    if mode == "gloo":
        return False, "asked for"
    if device.type != "cpu":
        return False, f"device {device.type}: NCCL already uses shared memory within a host"
    if local_world_size != world_size:
        return False, f"the ranks span hosts ({local_world_size} of {world_size} on this one)"
    note = ""
    if shm_dir is None:
        shm_dir, note = arena_base(nbytes)
        if shm_dir is None:
            return False, note
    if not shm_dir.is_dir():
        return False, f"{shm_dir} does not exist"
    free = shutil.disk_usage(shm_dir).free
    if free < nbytes + MARGIN:
        return False, (f"{shm_dir} has {free / 2**20:.0f} MiB free, the buffers need {nbytes / 2**20:.0f} MiB "
                       f"({SHM_FIX})")
    return True, (f"all {world_size} ranks on this host share parameters, gradients and optimizer state in {shm_dir} "
                  f"({nbytes / 2**20:.0f} MiB{', ' + note if note else ''}), no copies through Gloo")


def make_arena(mode: str, rank: int, world_size: int, device: torch.device, model: torch.nn.Module,
               group: dist.ProcessGroup | None = None) -> tuple[SharedArena | None, str]:
    """The shared-memory arena for the optimizer (or None) and the banner's reason; collective over
    `group` (the ranks that would share it: the world, or one node's ranks; `rank` and `world_size`
    are within it)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nbytes = buffer_bytes(model, world_size)
    ok, why = plan(mode, world_size, local, device, nbytes)
    if world_size > 1 and mode != "gloo" and device.type == "cpu":
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # one rank short of /dev/shm: nobody shares
        if ok and not flag.item():
            ok, why = False, "another rank of this host cannot share memory"
    if not ok and mode == "shm":
        raise ValueError(f"--local-comm shm is not possible: {why}. Fix: --local-comm auto or gloo")
    if not ok:
        return None, f"{mode}: through the process group ({why})"
    return SharedArena(rank, group, arena_base(nbytes)[0]), f"{mode}: {why}"


class SharedArena:
    """Allocates tensors every rank of this host maps; must be called in the same order on all."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None = None, shm_dir: Path | None = None):
        self.rank, self.group = rank, group  # rank within the group
        stem = [None]
        if rank == 0:
            base = shm_dir or arena_base()[0]
            if base is None:
                raise ValueError(arena_base()[1])
            stem = [str(base / f"nanochat-{os.getpid()}-{secrets.token_hex(8)}")]
        dist.broadcast_object_list(stem, group=group, group_src=0)
        self.stem, self.files = stem[0], 0
        # how a rank waits for its peers' lock, `waiting(what, step)`: a peer frozen while holding
        # it (SIGSTOP, a debugger) blocks the others with no socket to time out, so the trainer
        # hands in its watchdog's phase here, which bounds the wait like a collective's
        self.waiting: Callable[[str, int], contextlib.AbstractContextManager] = \
            lambda what, step: contextlib.nullcontext()

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed shared tensor; its file is gone again when this returns on any rank."""
        numel = math.prod(shape)
        fd = self._open_on_every_rank(name, numel * dtype.itemsize)
        try:  # the file is unlinked already: mapped through this process's descriptor of it
            t = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        finally:
            os.close(fd)
        return t.view(shape)

    def lock(self, name: str, what: str, step: Callable[[], int]) -> HostLock:
        """A lock every rank of this host shares (flock on one open file): what one rank writes
        to shared memory holding it, the next rank to hold it reads. Kernel locks order memory on
        every architecture, which plain flag writes would not on ARM. A wait for it is `waiting`'s
        phase `what` at step `step()`."""
        fd = self._open_on_every_rank(name, 0)  # stays open for the run: the lock lives on the inode
        return HostLock(fd, lambda: self.waiting(what, step()))

    def _open_on_every_rank(self, name: str, nbytes: int) -> int:
        """A descriptor of one file of `nbytes` zeros that every rank of the group holds, and that
        no directory holds any more: rank 0 creates a private directory and the file in it, the
        others open it, rank 0 removes both."""
        self.files += 1
        folder = f"{self.stem}-{self.files}"
        path = os.path.join(folder, name)
        if self.rank == 0:
            os.mkdir(folder, 0o700)  # fails on anything already there
            try:
                fd = os.open(path, CREATE_FLAGS, 0o600)
                if nbytes:  # allocated now: a full tmpfs fails here with ENOSPC, not mid-run with SIGBUS
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                remove(path, folder)
                raise OSError(exc.errno, f"cannot make {nbytes / 2**20:.0f} MiB of shared memory in {folder}: "
                                         f"{exc.strerror}") from exc
        dist.barrier(group=self.group)
        if self.rank != 0:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        dist.barrier(group=self.group)
        if self.rank == 0:
            remove(path, folder)
        return fd


def remove(path: str, folder: str) -> None:
    """Rank 0's cleanup of one arena file and its directory, whichever of them exists."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(folder)


class HostLock:
    """`with lock:` holds an exclusive flock on a file every rank of the host has open. Taken at
    once if free; else the wait runs inside `waiting()` (the watchdog's phase), also where no
    other phase is open: in the backward's gradient hooks."""

    def __init__(self, fd: int, waiting: Callable[[], contextlib.AbstractContextManager]):
        self.fd, self.waiting = fd, waiting

    def __enter__(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with self.waiting():
                fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def buffer_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Shared memory needed: one copy of the parameters, every rank's gradients and the optimizer state
    (Muon's momentum, or AdamW's two moments: at most two copies more). Padding, the tables' row
    flags and the work queue aside: plan() keeps MARGIN."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (3 + world_size)
