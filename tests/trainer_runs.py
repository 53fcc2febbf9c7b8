"""Run the trainer as real torchrun jobs on loopback and read what it prints: the helpers the
run-based test modules share (a test module holds tests only, so none imports another)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
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


# ---- an elastic launch: nodes that come and go ---------------------------------------------------

# the units' rendezvous settings: a group re-forms 5 s after its last node arrived, and a node that
# stopped answering (killed, frozen) is dropped from the rendezvous after 3 keep-alives 2 s apart
ELASTIC_CONF = "last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=600"


def elastic_cmd(node_rank: int, nodes: str, port: int, target: list[str], run_id: str = "test",
                nproc: int = 1, local_addr: str = "127.0.0.1", max_restarts: int = 5) -> list[str]:
    """One node's launcher as the units start it with elastic rendezvous (`nodes` = "MIN:MAX"):
    node 0, the master, hosts the rendezvous on loopback at `port`. `local_addr` is the address
    the node is known by (the units' NODE_ADDR), any of 127.0.0.0/8."""
    return [sys.executable, "-m", "nanochat_cpu.launch", f"--nnodes={nodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            f"--local-addr={local_addr}", f"--max-restarts={max_restarts}",
            f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'},{ELASTIC_CONF}", *target]


class Watched:
    """A node's launcher, in a session of its own (to stop it whole), and its output as it comes:
    a thread reads every line and notes when it arrived, so a test can wait for one node's line,
    time what happens, while every other node's pipe keeps draining (a full pipe would hold a
    launcher mid-print)."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", cwd=REPO, start_new_session=True)
        self.lines: list[tuple[float, str]] = []  # (time.monotonic() when read, the line)
        self._closed = False
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"read-{self.proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append((time.monotonic(), line))
                self._new.notify_all()
        with self._new:
            self._closed = True
            self._new.notify_all()

    def mark(self) -> int:
        """Where the output is now: wait_for(..., since=mark()) looks only at what comes after."""
        with self._new:
            return len(self.lines)

    def text(self, since: int = 0, until: int | None = None) -> str:
        with self._new:
            return "".join(line for _, line in self.lines[since:until])

    def at(self, index: int) -> tuple[float, str]:
        with self._new:
            return self.lines[index]

    def found(self, pattern: str, since: int = 0) -> list[int]:
        """The indices of the lines so far, from `since` on, that the regex `pattern` matches."""
        regex = re.compile(pattern)
        with self._new:
            return [i for i in range(since, len(self.lines)) if regex.search(self.lines[i][1])]

    def wait_for(self, pattern: str, since: int = 0, timeout: float = 120) -> int:
        """The index of the first line from `since` on that the regex `pattern` matches (or fail,
        with the node's output since then)."""
        regex, deadline, looked = re.compile(pattern), time.monotonic() + timeout, since
        with self._new:
            while True:
                for i in range(looked, len(self.lines)):
                    if regex.search(self.lines[i][1]):
                        return i
                looked = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    why = "before its output ended" if self._closed else f"in {timeout:.0f} s"
                    raise AssertionError(f"{pattern!r} not seen {why} (exit code {self.proc.poll()}):\n"
                                         + self.text(since)[-12000:])
                self._new.wait(left)

    def end(self, timeout: float) -> int:
        """Its exit code, once it and its output have ended."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def signal_tree(self, sig: int) -> None:
        """`sig` to the launcher and every process below it (its workers are in a group of their own)."""
        kill_tree(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the launcher and its workers, unless it has ended (its pid may be another's by now)."""
        if self.proc.poll() is None:
            self.signal_tree(signal.SIGKILL)
            self.proc.wait(timeout=30)
