"""Run the trainer as real torchrun jobs on loopback and read what it prints: the helpers the
run-based test modules share (a test module holds tests only, so none imports another)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the scripts the tests launch (a patched trainer, a worker): tests/entry_points/README.md
ENTRY_POINTS = REPO / "tests" / "entry_points"
# the trainer with checkpoint transfers in small rounds (entry_points/slow_checkpoint_train.py): a
# test's few-hundred-KiB checkpoint then crosses in many rounds, as a big model's does
SLOW_CHECKPOINT_TRAIN = str(ENTRY_POINTS / "slow_checkpoint_train.py")
SMALL_ROUNDS = {"CHUNK_BYTES": "8192", "ROUND_S": "0"}


# ---- the trainer's flags, and the losses it prints ---------------------------------------------

STEP_LINE = re.compile(r"step (\d+)/\d+ \([0-9.]+%\) loss=([0-9.]+)")


def tiny_flags(data: Path, tok: Path, out: Path, **over) -> list[str]:
    flags = {"data-dir": data, "tokenizer-dir": tok, "out-dir": out, "run-name": "test", "depth": 2,
             "aspect-ratio": 32, "head-dim": 32, "max-seq-len": 64, "device-batch-size": 2,
             "total-batch-size": 256, "num-iterations": 12, "eval-every": 0, "eval-tokens": 512,
             "sample-every": 0, "checkpoint-every": 4, "keep-checkpoints": 3, "collective-timeout": 20,
             "tracking-uri": "none", "compile": "off",
             # auto would choose from a timing: a loaded machine's may differ between two runs of a test
             "outer-overlap": "off"}
    flags.update({k.replace("_", "-"): v for k, v in over.items()})
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def train_target(*flags: str) -> list[str]:
    return ["-m", "nanochat_cpu.train", *flags]


def losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(output)}


# ---- launching: torchrun on loopback -------------------------------------------------------------

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


def busy_loops(core: int, count: int = 2) -> list[subprocess.Popen]:
    """`count` busy loops pinned to `core`, each in a session of its own: with the kernel's
    autogroup scheduling (on by default) a core is shared out per session first, so loops left in
    pytest's session would take half of the core together, not count/(count+1) of it."""
    return [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(count)]


# ---- a running node: its output as it comes, its end -------------------------------------------

def read_line(proc) -> str:
    """One line of a node's output, read a byte at a time from the pipe itself: a buffered readline
    would also take what follows into the file object's buffer, and `communicate` (which reads the
    pipe's descriptor) would never see it: a line printed right after `pattern` went missing so."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(proc.stdout.fileno(), 1)
        if not byte:
            break
        line += byte
    return line.decode(errors="replace")


def read_until(proc, pattern: str, timeout: float) -> str:
    """Collect a node's output until `pattern` shows up (or fail)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = read_line(proc)
        if not line:
            break
        seen.append(line)
        if pattern in line:
            return "".join(seen)
    raise AssertionError(f"{pattern!r} not seen in {timeout}s:\n" + "".join(seen))


def finish(proc, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, time.monotonic() - t0


# ---- stopping a node whole ----------------------------------------------------------------------

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
