"""Launch real torchrun jobs on loopback for the trainer's tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the trainer with checkpoint transfers in small rounds (tests/slow_checkpoint_train.py): a test's
# few-hundred-KiB checkpoint then crosses in many rounds, as a big model's does
SLOW_CHECKPOINT_TRAIN = str(REPO / "tests" / "slow_checkpoint_train.py")
SMALL_ROUNDS = {"CHUNK_BYTES": "8192", "ROUND_S": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def torchrun_cmd(nproc: int, port: int, target: list[str], nnodes: int = 1, node_rank: int = 0) -> list[str]:
    """The units' launcher (torchrun keeping the workers' exit code) with static rendezvous on
    loopback; `target` is `-m module args` or `script args`."""
    return [sys.executable, "-m", "nanochat_cpu.launch", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", *target]


def run_torchrun(nproc: int, target: list[str], timeout: float = 240, env_extra: dict[str, str] | None = None,
                 ) -> subprocess.CompletedProcess:
    env = {**node_env(), **(env_extra or {})}
    return subprocess.run(torchrun_cmd(nproc, free_port(), target), env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def spawn_node(nnodes: int, node_rank: int, port: int, target: list[str], nproc: int = 1,
               env: dict[str, str] | None = None) -> subprocess.Popen:
    """One 'node' of a multi-node job: its own torchrun, in its own process group (to kill it whole)."""
    return subprocess.Popen(torchrun_cmd(nproc, port, target, nnodes=nnodes, node_rank=node_rank),
                            env=env or node_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in their own process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, sig: int) -> None:
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
