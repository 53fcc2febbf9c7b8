"""When ranks share their optimizer buffers in /dev/shm, and what they say when they cannot.

The sharing itself is tested on real processes in test_dist_optim (2 and 3 ranks equal 1 rank)
and test_train_runs (a 2-rank run that resumes through it)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanochat_cpu.shm import SHM_DIR, SharedArena, arena_base, make_arena, plan

CPU = torch.device("cpu")


def test_one_launcher_on_one_host_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    ok, why = plan("auto", 2, 2, CPU, 1 << 20)
    assert ok and "all 2 ranks on this host share parameters, gradients and optimizer state in /dev/shm (1 MiB)" in why


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("auto", 1, 1, CPU, 1), "one rank"),
        (("gloo", 2, 2, CPU, 1), "asked for"),
        (("auto", 3, 1, CPU, 1), "the ranks span hosts (1 of 3 on this one)"),
        (("auto", 2, 2, torch.device("cuda"), 1), "NCCL already uses shared memory"),
    ],
)
def test_reasons_not_to_share(args: tuple, reason: str) -> None:
    ok, why = plan(*args)
    assert not ok and reason in why


def test_a_small_shm_is_named_with_the_sizes_and_the_fix(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    ok, why = plan("auto", 2, 2, CPU, free, shm_dir=tmp_path)
    assert not ok
    assert f"{tmp_path} has" in why and f"the buffers need {free / 2**20:.0f} MiB" in why and "--shm-size" in why
    ok, why = plan("auto", 2, 2, CPU, 1, shm_dir=tmp_path / "missing")
    assert not ok and "does not exist" in why


def test_shm_where_impossible_is_an_error_not_a_fallback() -> None:
    with pytest.raises(ValueError, match=r"--local-comm shm is not possible: device cuda.*Fix: --local-comm auto"):
        make_arena("shm", 0, 2, torch.device("cuda"), torch.nn.Linear(4, 4))
    arena, why = make_arena("auto", 0, 1, CPU, torch.nn.Linear(4, 4))
    assert arena is None and why == "auto: through the process group (one rank)"


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What systemd's RuntimeDirectory= with RuntimeDirectoryMode=0700 hands the unit."""
    path = tmp_path / "nanochat"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(path))
    return path


@pytest.fixture
def one_process_group():
    """SharedArena's barriers, in a group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_without_a_runtime_directory_the_arena_is_in_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    assert arena_base() == (SHM_DIR, "")


def test_the_runtime_directory_is_used_and_named(runtime_dir: Path) -> None:
    assert arena_base() == (runtime_dir, "")
    ok, why = plan("auto", 2, 2, CPU, 1 << 20)
    assert ok and f"optimizer state in {runtime_dir} (1 MiB)" in why


def test_a_runtime_directory_too_small_gives_way_to_dev_shm(runtime_dir: Path) -> None:
    base, note = arena_base(shutil.disk_usage(runtime_dir).free)
    assert base == SHM_DIR and note.startswith(f"{runtime_dir} has ") and note.endswith(f"MiB free, so {SHM_DIR}")


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (lambda p: p.chmod(0o750), "has mode 0750: others than its owner may enter it, it must be 0700"),
        (lambda p: p.chmod(0o701), "has mode 0701"),
        (lambda p: (p.rmdir(), p.symlink_to(p.parent)), "is not a directory"),
        (lambda p: (p.rmdir(), p.write_text("")), "is not a directory"),
        (lambda p: p.rmdir(), "does not exist"),
    ],
)
def test_a_runtime_directory_others_may_enter_is_refused(runtime_dir: Path, spoil, problem: str) -> None:
    spoil(runtime_dir)
    ok, why = plan("auto", 2, 2, CPU, 1)
    assert not ok and f"RUNTIME_DIRECTORY={runtime_dir} {problem}" in why and "RuntimeDirectoryMode=0700" in why


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory away takes root")
def test_a_runtime_directory_of_another_user_is_refused(runtime_dir: Path) -> None:
    os.chown(runtime_dir, 4242, -1)
    ok, why = plan("auto", 2, 2, CPU, 1)
    assert not ok and f"is owned by uid 4242, not by this user (uid {os.getuid()})" in why


def test_arena_files_are_private_and_gone_when_mapped(runtime_dir: Path, one_process_group,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, int]] = []
    real_mkdir = os.mkdir

    def mkdir(path: str, mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        made.append((path, os.stat(path).st_mode))

    monkeypatch.setattr(os, "mkdir", mkdir)
    arena = SharedArena(0)
    t = arena.tensor("params", (3, 4), torch.float32)
    with arena.lock("work", "the work queue", lambda: 1):
        t += 1
    assert t.shape == (3, 4) and t.sum().item() == 12
    assert [stat.S_IMODE(mode) for _, mode in made] == [0o700, 0o700]
    assert all(path.startswith(str(runtime_dir / "nanochat-")) for path, _ in made)
    assert list(runtime_dir.iterdir()) == []  # nothing left for a rank that dies later to leak


def test_a_wait_for_the_hosts_lock_is_the_watchdogs_phase(runtime_dir: Path, one_process_group) -> None:
    """A peer frozen holding the lock must not block this rank outside the watchdog's sight, also
    in a gradient hook, where no other phase is open; a free lock costs no phase."""
    arena = SharedArena(0)
    waits: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def waiting(what: str, step: int):
        waits.append((what, step))
        yield

    arena.waiting = waiting
    lock = arena.lock("work", "the work queue", lambda: 7)
    with lock:
        pass
    assert waits == []
    peer = os.open(f"/proc/self/fd/{lock.fd}", os.O_RDONLY)  # another open file: a peer's flock
    try:
        fcntl.flock(peer, fcntl.LOCK_EX)
        threading.Timer(0.2, fcntl.flock, (peer, fcntl.LOCK_UN)).start()
        with lock:
            assert waits == [("the work queue", 7)]
    finally:
        os.close(peer)


def test_arena_never_uses_what_someone_else_put_there(runtime_dir: Path, one_process_group,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secrets, "token_hex", lambda _n: "guessed")
    arena = SharedArena(0)
    Path(f"{arena.stem}-1").mkdir()  # planted where the next file's directory would go
    with pytest.raises(FileExistsError):
        arena.tensor("params", (4,), torch.float32)


def test_a_full_shared_memory_fails_at_allocation_naming_the_directory(runtime_dir: Path, one_process_group,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(_fd: int, _offset: int, _size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    arena = SharedArena(0)
    with pytest.raises(OSError, match=f"cannot make 4 MiB of shared memory in {runtime_dir}/nanochat-.*-1: No space"):
        arena.tensor("params", (1 << 20,), torch.float32)
    assert list(runtime_dir.iterdir()) == []
