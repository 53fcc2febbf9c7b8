"""Ranks on one host share parameters, gradients and optimizer state in memory instead of copying them.

Two Gloo ranks on one machine move every parameter and gradient through loopback TCP each step
(Gloo's threads copy them on the same cores the model needs), which is why upstream nanochat's two
ranks on one CPU are slower than one process. When every rank of the run was started by one
launcher (LOCAL_WORLD_SIZE == WORLD_SIZE, so one host), the optimizer can instead keep:

- one copy of the parameters and of the optimizer state, mapped by every rank, which any rank
  may update in place (the optimizer hands the work out under `SharedArena.lock`);
- every rank's gradient buffer in one (world, ...) tensor, from which whoever updates a part sums
  that part of every rank's gradients: no "reduce-scatter" and no "all-gather", one barrier.

The tensors are files in /dev/shm that rank 0 creates and unlinks as soon as every rank has mapped
them, so nothing is left behind when a run stops, even by SIGKILL (except during the few
milliseconds between creation and unlink at start).
"""

from __future__ import annotations

import fcntl
import math
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")


def plan(mode: str, world_size: int, local_world_size: int, device: torch.device, nbytes: int,
         shm_dir: Path = SHM_DIR) -> tuple[bool, str]:
    """Whether this rank could share the optimizer's buffers in memory, and why (for the banner).

    `mode` is --local-comm: auto, shm or gloo. `make_arena` turns the answers of all ranks into
    one decision (shm where it cannot work is an error there, not a silent fallback).
    """
    if world_size == 1:
        return False, "one rank"
    if mode == "gloo":
        return False, "asked for"
    if device.type != "cpu":
        return False, f"device {device.type}: NCCL already uses shared memory within a host"
    if local_world_size != world_size:
        return False, f"the ranks span hosts ({local_world_size} of {world_size} on this one)"
    if not shm_dir.is_dir():
        return False, f"{shm_dir} does not exist"
    free = shutil.disk_usage(shm_dir).free
    if free < nbytes + (64 << 20):
        return False, (f"{shm_dir} has {free / 2**20:.0f} MiB free, the buffers need {nbytes / 2**20:.0f} MiB "
                       f"(in a container, raise it with podman/docker --shm-size)")
    return True, (f"all {world_size} ranks on this host share parameters, gradients and optimizer state in {shm_dir} "
                  f"({nbytes / 2**20:.0f} MiB), no copies through Gloo")


def make_arena(mode: str, rank: int, world_size: int, device: torch.device, model: torch.nn.Module,
               group: dist.ProcessGroup | None = None) -> tuple[SharedArena | None, str]:
    """The shared-memory arena for the optimizer (or None) and the banner's reason; collective over
    `group` (the ranks that would share it: the world, or one node's ranks; `rank` and `world_size`
    are within it)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ok, why = plan(mode, world_size, local, device, buffer_bytes(model, world_size))
    if world_size > 1 and mode != "gloo" and device.type == "cpu":
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # one rank short of /dev/shm: nobody shares
        if ok and not flag.item():
            ok, why = False, "another rank of this host cannot share memory"
    if not ok and mode == "shm":
        raise ValueError(f"--local-comm shm is not possible: {why}. Fix: --local-comm auto or gloo")
    if not ok:
        return None, f"{mode}: through the process group ({why})"
    return SharedArena(rank, group), f"{mode}: {why}"


class SharedArena:
    """Allocates tensors every rank of this host maps; must be called in the same order on all."""

    def __init__(self, rank: int, group: dist.ProcessGroup | None = None, shm_dir: Path = SHM_DIR):
        self.rank, self.group, self.shm_dir = rank, group, shm_dir  # rank within the group
        name = [f"nanochat-{os.getpid()}-{secrets.token_hex(4)}" if rank == 0 else None]
        dist.broadcast_object_list(name, group=group, group_src=0)
        self.prefix = name[0]

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed shared tensor; its file is gone again when this returns on any rank."""
        path = str(self.shm_dir / f"{self.prefix}-{name}")
        numel = math.prod(shape)
        if self.rank == 0:
            t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
            t.zero_()  # touch every page now: a full /dev/shm fails here, not mid-run with SIGBUS
        dist.barrier(group=self.group)
        if self.rank != 0:
            t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        dist.barrier(group=self.group)
        if self.rank == 0:
            os.unlink(path)
        return t.view(shape)

    def lock(self, name: str) -> HostLock:
        """A lock every rank of this host shares (flock on one open file): what one rank writes
        to shared memory holding it, the next rank to hold it reads. Kernel locks order memory on
        every architecture, which plain flag writes would not on ARM."""
        path = str(self.shm_dir / f"{self.prefix}-{name}")
        if self.rank == 0:
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        dist.barrier(group=self.group)
        fd = os.open(path, os.O_RDWR)  # stays open for the run: the lock lives on the inode
        dist.barrier(group=self.group)
        if self.rank == 0:
            os.unlink(path)
        return HostLock(fd)


class HostLock:
    """`with lock:` holds an exclusive flock on a file every rank of the host has open."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def buffer_bytes(model: torch.nn.Module, world_size: int) -> int:
    """/dev/shm needed: one copy of the parameters, every rank's gradients and the optimizer state
    (Muon's momentum, or AdamW's two moments: at most two copies more). Padding, the tables' row
    flags and the work queue aside: plan() keeps a 64 MiB margin."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (3 + world_size)
