"""Distributed setup: the process group, the collective watchdog, cross-rank guards.

The backend follows the *requested* device (gloo for cpu, nccl for cuda), never what
hardware happens to be present. With WORLD_SIZE > 1 a process group always exists: running N
unsynchronised copies silently is the failure this module exists to prevent.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Exit codes, so systemd and the logs tell failures apart.
EXIT_CONFIG = 2  # bad input: restarting will not help
EXIT_MISMATCH = 3  # ranks disagree on data/tokenizer/config, or parameters diverged
EXIT_COLLECTIVE = 4  # a collective failed or timed out: a peer died or the network dropped
EXIT_STOPPED = 5  # SIGTERM: stopped at a step every rank agreed on, with its checkpoint; resumes when started


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    host: str = field(default_factory=socket.gethostname)
    hosts: list[str] = field(default_factory=list)  # hostname of every rank, by rank
    nodes: list[int] = field(default_factory=list)  # an elastic launch: every rank's NODE_RANK (inventory place)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def master(self) -> bool:
        return self.rank == 0

    def peers(self) -> str:
        return ", ".join(f"rank {r}@{h}" for r, h in enumerate(self.hosts) if r != self.rank)


def log(env: DistEnv | None, msg: str) -> None:
    """One unbuffered line; under systemd it lands in journald as is."""
    prefix = f"[{env.host} rank {env.rank}/{env.world_size}] " if env else f"[{socket.gethostname()}] "
    # one write per line: ranks sharing a pipe (torchrun, journald) never interleave mid-line
    sys.stdout.write(prefix + msg + "\n")
    sys.stdout.flush()


_leaving = threading.Lock()  # one thread of a rank reports its fatal error; any other waits for the exit
_agreed: tuple[int, str] | None = None  # a fatal error every rank has learnt, about to be reported


def agree_to_fail(code: int, msg: str) -> None:
    """The ranks have agreed to stop with `msg` (checkpoint.fail_together). A thread of this rank
    that meets a peer's exit first (the loop's collective, while a checkpoint's thread agreed)
    reports this instead: the cause, and the code that keeps systemd from restarting into it."""
    global _agreed
    _agreed = (code, msg)


def fail(env: DistEnv | None, code: int, msg: str) -> None:
    """Log and leave at once: a rank must never block in teardown after a fatal error."""
    _leaving.acquire()  # never released: the process ends here
    if _agreed is not None and _agreed[1] != msg:
        code, msg = _agreed[0], f"{_agreed[1]} (and then: {msg})"
    try:
        log(env, "FATAL: " + msg)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:  # a closed stdout must not keep the rank alive
        os._exit(code)


WATCHDOG_GRACE_S = 30.0  # the watchdog exits a rank this long after --collective-timeout
NCCL_TIMEOUT_MARGIN_S = 2 * WATCHDOG_GRACE_S  # NCCL's own timeout: after the watchdog, as a backstop


def backend_for(device: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl"}[device]


def init_distributed(device: str, timeout_s: float) -> DistEnv:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but torch sees no CUDA device "
                               f"(torch {torch.__version__}); install the CUDA wheel or use --device cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    env = DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)
    env.hosts = [env.host]
    if world_size == 1:
        return env
    env.backend = backend_for(device)
    kwargs = {"device_id": dev} if device == "cuda" else {}
    if device == "cuda":
        # Gloo raises a timed-out collective in the rank's thread, which names it (Watchdog.phase).
        # NCCL's own watchdog instead aborts the process, unnamed: leave the naming to ours
        # (Watchdog, timeout_s + WATCHDOG_GRACE_S) and NCCL's abort as the backstop after it.
        timeout_s += NCCL_TIMEOUT_MARGIN_S
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get(NODES_ENV):  # an elastic launch: the ranks in the inventory's order
        store = workers_store(timeout_s)
        env.rank, env.nodes = inventory_rank(store, rank, world_size)
        rank = env.rank
        os.environ["RANK"] = str(rank)
        dist.init_process_group(env.backend, store=dist.PrefixStore("ranks", store), rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(env.backend, timeout=timeout, **kwargs)
    hosts: list[str | None] = [None] * world_size
    try:  # the first collective, before a Watchdog exists: name it here if a peer is lost
        dist.all_gather_object(hosts, env.host)
    except Exception as exc:  # noqa: BLE001 - a peer died or dropped right after the rendezvous
        fail(env, EXIT_COLLECTIVE, f"collective 'all_gather host names' right after the rendezvous failed: "
                                   f"{type(exc).__name__}: {exc}. Exiting so the unit restarts.")
    env.hosts = [str(h) for h in hosts]
    return env


# ---- an elastic launch: which rank is which, and who is still there ---------------------------------

NODES_ENV = "NANOCHAT_NODES"  # "MIN:MAX", set by nanochat_cpu.launch for the workers of an elastic launch
GROUP_STORE_ENV = "NANOCHAT_GROUP_STORE"  # host:port of the rendezvous store (the master's launcher)
GROUP_ENV = "NANOCHAT_GROUP"  # this group's name there: one for each group the rendezvous forms


def node_index() -> int:
    """This process's node: NODE_RANK, its place in the inventory (the units set it; torchrun's
    GROUP_RANK numbers an elastic group's launchers in no useful order), else GROUP_RANK (a static
    launch, where the two are the same). Checkpoints record it, and local steps group ranks by it."""
    return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))


def workers_store(timeout_s: float) -> dist.Store:
    """The group's keys, in the master's rendezvous store: its launcher hosts it (the units'
    --rdzv-endpoint, GROUP_STORE_ENV) for the whole run, so the ranks' store never lives with a node
    that may go. torchrun would host a group's store in its rank 0 worker, on whichever node its
    rendezvous numbered first, and a laptop holding it would take every rank's heartbeat with it when
    it froze. GROUP_ENV (nanochat_cpu.launch, fresh for each group) keeps one group's keys from
    another's."""
    host, _, port = os.environ[GROUP_STORE_ENV].rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"nanochat/group/{os.environ[GROUP_ENV]}", store)


def inventory_rank(store: dist.Store, rank: int, world_size: int) -> tuple[int, list[int]]:
    """This process's rank in the inventory's order: by NODE_RANK (the node's place in the
    inventory, from the unit's environment), then LOCAL_RANK. torchrun's elastic rendezvous numbers
    the nodes by their address as text and their launcher's pid, so its rank 0 may be any node; the
    run's rank 0 is the master's (it logs to MLflow, which only the master holds credentials for),
    and a group re-formed with the same nodes keeps its layout. Also every rank's NODE_RANK, by
    the new rank: which of the inventory's nodes are in the group (the status file says)."""
    mine = (node_index(), int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), rank)
    store.set(f"place/{rank}", " ".join(map(str, mine)))
    places = [tuple(int(x) for x in store.get(f"place/{r}").decode().split()) for r in range(world_size)]
    places.sort()
    return places.index(mine), [p[0] for p in places]


HEARTBEAT_S = 1.0  # how often each rank says it is alive, and looks at the others


class Liveness:
    """Notices a peer that went silent (a laptop shut, frozen, asleep, off the WiFi) within
    --peer-timeout seconds, where its collectives would wait the whole --collective-timeout: a
    silent peer closes no socket. Each rank adds one to a counter of its own in the group's keys
    (workers_store: the master's launcher holds them) every second, from a thread, and reads the
    others'; a counter that has not moved for the bound, or a store that has not answered for it,
    ends this rank (exit 4), and the launchers re-form the group with the nodes still there. A
    counter moves while its rank computes, waits or writes a checkpoint, so a slow peer is never
    taken for a lost one. A rank that was itself frozen or asleep that long says so, and leaves too:
    its group went on without it. `close` ends the judging before the ranks leave at the end, one
    after another; the counting goes on until the process ends."""

    def __init__(self, env: DistEnv, bound_s: float):
        self.env, self.bound_s = env, bound_s
        self._closed = threading.Event()
        # a client of its own: the thread never shares a connection with the process group
        self._store = workers_store(bound_s)
        self._where = os.environ[GROUP_STORE_ENV]
        threading.Thread(target=self._run, name="peer-liveness", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        def clock() -> float:  # goes on through a machine's sleep, where time.monotonic() stops
            return time.clock_gettime(time.CLOCK_BOOTTIME)

        others = [r for r in range(self.env.world_size) if r != self.env.rank]
        answered = last = clock()
        seen = {r: (-1, last) for r in others}  # each peer's last count, and since when
        while True:
            time.sleep(HEARTBEAT_S)
            now = clock()
            away, last = now - last, now
            try:
                self._store.add(f"alive/{self.env.rank}", 1)
                counts = {r: self._store.add(f"alive/{r}", 0) for r in others}
                answered = now
            except Exception as exc:  # noqa: BLE001 - the master's launcher is gone, or this node is cut off
                # a closed connection: the master's launcher ended (its unit stopped or restarted), and
                # with it the group. Silence is waited out: the master may be busy, or the WiFi slow.
                closed = "timeout" not in str(exc).lower()
                if (closed or now - answered > self.bound_s) and not self._closed.is_set():
                    fail(self.env, EXIT_COLLECTIVE,
                         f"the group's store at {self._where} (the master's launcher) "
                         f"{'closed its connection' if closed else f'has not answered for {now - answered:.0f} s'}"
                         f" (--peer-timeout {self.bound_s:.0f}): {type(exc).__name__}: {exc}. The master left "
                         f"the run (it pauses until the master is back) or this node lost the network. Exiting "
                         f"so the launcher joins the run's group again.")
                continue
            if self._closed.is_set():
                continue
            if away > self.bound_s:
                fail(self.env, EXIT_COLLECTIVE,
                     f"this node was frozen or asleep for {away:.0f} s (--peer-timeout {self.bound_s:.0f}): the "
                     f"other nodes have gone on without it. Exiting so its launcher joins the group again; a "
                     f"machine that sleeps through systemd stops the run first (nanochat-wake@ starts it again).")
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.bound_s:
                    fail(self.env, EXIT_COLLECTIVE,
                         f"rank {r}@{self.env.hosts[r]} has been silent for {now - seen[r][1]:.0f} s "
                         f"(--peer-timeout {self.bound_s:.0f}): its node froze, went to sleep or dropped off "
                         f"the network. Exiting so the launchers re-form the group without it; the run "
                         f"resumes from its last checkpoint.")


class Watchdog:
    """Names the collective a rank is stuck in, then exits, if the backend's own timeout did not.

    The training loop marks phases (`with watchdog.phase("reduce-scatter grads", step)`); a
    daemon thread checks the current phase once a second. Past the bound it logs which
    collective, which step and which peers, and exits non-zero so systemd can restart the unit.
    A checkpoint's writes to the local disk are marked too (`disk`): a dying disk or a hung
    network mount blocks a write for ever, with no timeout of its own, also in a one-process run.
    """

    def __init__(self, env: DistEnv, bound_s: float):
        self.env, self.bound_s = env, bound_s
        # each thread's current phase: (what, step, since, a disk's fix). Per thread: a checkpoint
        # crossing in the background marks its collectives while the loop marks its own (the
        # loader's reads, every micro-step), and one slot for both let either erase the other's
        self._phases: dict[int, tuple[str, int, float, str | None]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="collective-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def phase(self, what: str, step: int):
        with self._marked(what, step, None):
            try:
                yield
            except Exception as exc:  # noqa: BLE001 - a collective raised: peer died, reset, timeout
                fail(self.env, EXIT_COLLECTIVE,
                     f"collective '{what}' at step {step} failed after "
                     f"{time.monotonic() - self._started():.1f}s: {type(exc).__name__}: {exc}. "
                     f"Peers: {self.env.peers()}. Exiting so the unit restarts and resumes from the last "
                     f"checkpoint.")

    @contextlib.contextmanager
    def disk(self, what: str, step: int, fix: str):
        """Local writes (or reads: `step` -1) that may never return. Yields `progress`, to call
        whenever some bytes reached the disk: the bound is on the time without any (a slow disk
        writing a big checkpoint is not stuck), and past it `what` and `fix` are said and the rank
        exits. The writes' errors are the caller's (a full disk is reported as such, not as a stall)."""
        with self._marked(what, step, fix):
            yield self._progress

    def _progress(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if me in self._phases:
                phase = self._phases[me]
                self._phases[me] = (*phase[:2], time.monotonic(), phase[3])

    @contextlib.contextmanager
    def _marked(self, what: str, step: int, fix: str | None):
        me = threading.get_ident()
        with self._lock:
            outer = self._phases.get(me)
            self._phases[me] = (what, step, time.monotonic(), fix)
        try:
            yield
        finally:
            with self._lock:  # a phase inside another hands the watch back
                if outer is None:
                    self._phases.pop(me, None)
                else:
                    self._phases[me] = outer

    def _started(self) -> float:
        with self._lock:
            phase = self._phases.get(threading.get_ident())
        return phase[2] if phase else time.monotonic()

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                phases = list(self._phases.values())
            # without peers only a disk can stall: a one-process run's phases are not collectives
            now = time.monotonic()
            overdue = [p for p in phases if now - p[2] > self.bound_s and (p[3] is not None or self.env.distributed)]
            if not overdue:
                continue
            what, step, t0, fix = min(overdue, key=lambda p: p[2])  # the longest stuck
            stuck = f"stuck {now - t0:.0f}s (bound {self.bound_s:.0f}s, --collective-timeout)"
            if fix is not None:  # a disk: a checkpoint's write (step >= 0), or a read of the data (step -1)
                at, moved = (f" at step {step}", "reached the disk") if step >= 0 else ("", "came from the disk")
                fail(self.env, EXIT_COLLECTIVE, f"{stuck} {what}{at} on {self.env.host}: no byte {moved} in that "
                                                f"time, it does not answer. {fix}")
            fail(self.env, EXIT_COLLECTIVE,
                 f"{stuck} in collective '{what}' at step {step}; waiting on peers: {self.env.peers()}. "
                 f"A peer died or the network dropped. Exiting so the unit restarts and resumes.")


@torch.no_grad()
def parameter_checksum(model: torch.nn.Module) -> torch.Tensor:
    """Per-parameter (sum, sum of squares) in float64: identical on every rank or a bug."""
    parts = [torch.stack([p.double().sum(), p.double().square().sum()]) for p in model.parameters()]
    return torch.cat(parts).cpu()


def check_parameters_agree(env: DistEnv, model: torch.nn.Module, step: int, watchdog: Watchdog) -> None:
    """Every rank applies the same all-gathered update, so parameters must agree bitwise."""
    if not env.distributed:
        return
    mine = parameter_checksum(model)
    gathered: list[torch.Tensor | None] = [None] * env.world_size
    with watchdog.phase("all_gather parameter checksum", step):
        dist.all_gather_object(gathered, mine)
    names = [n for n, _ in model.named_parameters()]
    diverged = []
    for r, other in enumerate(gathered):
        if r != 0 and not torch.equal(other, gathered[0]):
            idx = int((other != gathered[0]).nonzero()[0]) // 2
            diverged.append(f"rank {r}@{env.hosts[r]} differs from rank 0@{env.hosts[0]} first at '{names[idx]}'")
    if diverged:
        fail(env, EXIT_MISMATCH, f"parameters diverged across ranks at step {step}: " + "; ".join(diverged)
             + ". Ranks are no longer training the same model; stopping every rank.")
