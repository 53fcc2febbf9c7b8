"""A checkpoint between ranks: which ranks share a disk, and bytes moved in bounded rounds.

Nodes share no filesystem as a rule, so every rank's state crosses to every disk's writer
(`gather_states`), and a disk that lacks a checkpoint gets it file by file (`send_bytes`). The
bytes go in rounds of CHUNK_BYTES, each its own collective that the watchdog times, so a big
checkpoint on a slow link is never taken for a hung peer. `fail_together` lets every rank learn
every rank's problem before any stops, so a full disk on one node stops them all with its reason.
"""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint_files import checkpoint_root
from .dist import EXIT_CONFIG, DistEnv, Watchdog, agree_to_fail, fail, node_index


@dataclass
class Disks:
    """Where the ranks' checkpoints live. Nodes share no filesystem as a rule, but launchers on one
    host (the tests, the quality benchmark) or an NFS mount may share a directory: one writer per
    disk, found by looking, not by host name (cloned machines share one)."""

    out_dir: str  # the run's directory on each disk (checkpoints under out_dir/checkpoints)
    keep: int  # complete checkpoints kept on each disk (--keep-checkpoints)
    disk_of_rank: list[int]  # every rank's disk, named by the lowest rank that writes to it
    node_of_rank: list[int]  # every rank's launcher (dist.node_index: the inventory's NODE_RANK)
    group: dist.ProcessGroup | None  # gloo, for the checkpoint's object collectives (CPU even on CUDA)

    def writer(self, rank: int) -> bool:
        return self.disk_of_rank[rank] == rank

    @property
    def writers(self) -> list[int]:
        return sorted(set(self.disk_of_rank))

    def layout(self, hosts: list[str]) -> dict:
        """What the COMPLETE marker says of the world that wrote it."""
        return {"world_size": len(hosts), "hosts": hosts, "node_of_rank": self.node_of_rank}


def find_disks(out_dir: str, keep: int, collective_timeout: float, env: DistEnv, watchdog: Watchdog) -> Disks:
    """Each rank leaves a file of its own in the checkpoint directory; ranks that see each other's
    files share a disk."""
    node = node_index()
    if not env.distributed:
        return Disks(out_dir, keep, [0], [node], None)
    # each round of a transfer is bounded like any collective (Gloo's own default is 30 min)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=collective_timeout))
    root = checkpoint_root(out_dir)
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
    return Disks(out_dir, keep, [d for d, _ in everyone], [n for _, n in everyone], group)


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
