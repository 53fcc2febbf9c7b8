"""`python -m nanochat_cpu.launch <torchrun flags> -m nanochat_cpu.train ...`: torchrun, with its
elastic agent taught three things about a cluster whose nodes come and go.

The units run it with torchrun's own elastic rendezvous (`--nnodes=MIN:MAX --rdzv-backend=c10d`,
hosted by the master's launcher): the group forms with the nodes that are there, re-forms when one
leaves, and takes in one that arrives (docs/TRAINER.md, "Nodes that come and go"). The agent is
torch's LocalElasticAgent; `NodeAgent` changes what it does with its workers' exit codes:

* 2 (bad input) and 3 (ranks disagree): a restart cannot fix these, so the agent stops and the
  launcher exits with the code, which the unit lists in RestartPreventExitStatus=.
* 5 (the ranks stopped at a checkpoint, because some node's launcher got SIGTERM: a node leaving,
  a laptop going to sleep): not a failure. The agent re-forms the group at once with whoever is
  still there, and the restart does not count against --max-restarts: a laptop may sleep every day.
* anything else (a peer lost: 4, a crash, a kill): a restart from the last checkpoint, counted.

It also gives the workers as long to stop at a restart as at the end (torchrun's agent allows 30 s
for a restart whatever TORCH_ELASTIC_SHUTDOWN_TIMEOUT says, too short for a big model's checkpoint
on a slow link), says in the journal when it waits for a group and which one it joined, and, off
the master, leaves the run's rendezvous open when it ends (torch's launcher closes it for every
node when its agent ends otherwise than by a signal: one node out of restarts would end the run),
stopping only its keep-alive thread.

Outside the agent: torchrun exits 1 whatever its workers' exit codes were, so the launcher exits
with the code its failed workers exited with (2 or 3 if any rank saw it: `exit_code_of`); a stop
signal exits 128 + the signal number, like a shell. A node that is not the rendezvous host waits
for the host's port before it starts torchrun, saying so once a minute: the run pauses while the
master is away (its launcher holds the group's state), without spending the unit's starts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .dist import EXIT_CONFIG, EXIT_MISMATCH, EXIT_STOPPED, GROUP_ENV, GROUP_STORE_ENV, NODES_ENV

EXIT_LAUNCHER = 1  # mixed worker codes, or torchrun itself failed (rendezvous timeout, bad flags)
WAIT_SAY_S = 60.0  # how often a launcher waiting for the master or for a group says so
PROBE_S = 2.0  # between tries of the master's port
GROUP_KEY = "nanochat/group"  # in a rendezvous round's keys: the name of the group it formed


def say(msg: str) -> None:
    print(f"launcher: {msg}", file=sys.stderr, flush=True)


def exit_code_of(failures) -> int:
    """The workers' exit code for the unit: theirs where they agree; bad input (2) or ranks that
    disagree (3) wherever one rank saw it (the others may have died of its exit, and a restart
    cannot fix it); else EXIT_LAUNCHER."""
    codes = {f.exitcode for f in failures.values()}
    for fatal in (EXIT_CONFIG, EXIT_MISMATCH):
        if fatal in codes:
            return fatal
    if len(codes) == 1:
        code = codes.pop()
        # negative = killed by that signal (torch's convention); report it like a shell does
        return 128 - code if code < 0 else code
    return EXIT_LAUNCHER


class NodeAgent(LocalElasticAgent):
    """torch's local agent (see the module's text): no restart into bad input, free re-forms after
    a node's graceful leave, the graceful stop's time at every restart, and journal lines."""

    hosts_rendezvous = True  # elastic_setup: whether this node's launcher hosts the run's rendezvous

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._nodes = os.environ.get(NODES_ENV, "")
        self._last_state: WorkerState | None = None  # what the last look at the workers found
        if not self.hosts_rendezvous:
            # torch's launch_agent closes the rendezvous for every node when its agent ends otherwise
            # than by a signal (its restarts spent, a join timed out, the run done): one node's end
            # would end the run everywhere. The run's is the master's to close; this node just leaves
            # (its keep-alives stop with the agent: run).
            self.get_worker_group().spec.rdzv_handler.shutdown = lambda: True

    def run(self, *args, **kwargs) -> RunResult:
        try:
            return super().run(*args, **kwargs)
        finally:
            # The rendezvous's keep-alive thread otherwise lives as long as its handler: off the
            # master nothing stops it (see __init__), and a handler kept past the agent's end keeps
            # it calling the master's store, which is gone once the run ends. The interpreter's exit
            # then catches it inside torch's C++ and the launcher dies of SIGABRT ("terminate called
            # without an active exception") after a run that ended well (seen once in CI).
            self.get_worker_group().spec.rdzv_handler._stop_heartbeats()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        self._last_state = result.state
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
            code = exit_code_of(result.failures)
            if code in (EXIT_CONFIG, EXIT_MISMATCH):
                say(f"the workers exited {code}: a restart cannot fix it; stopping this node's launcher")
                self._remaining_restarts = 0
            elif code == EXIT_STOPPED:
                say("the ranks stopped at a checkpoint (a node is leaving, or the run is being stopped): "
                    "re-forming the group with the nodes still here")
                self._remaining_restarts += 1  # the agent takes one off: a node's leave is free
            else:
                say(f"the workers exited {code} (a peer lost, or a crash): re-forming the group; the run "
                    f"resumes from its last checkpoint ({self._remaining_restarts - 1} restart(s) left)")
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch's agent restarts healthy workers when launchers wait to join the group: a node
        # back, or the others re-forming after a leave while this node's ranks were still closing
        if self._last_state == WorkerState.HEALTHY:
            say("nodes are waiting to join the group: the ranks stop at a checkpoint and the group re-forms "
                "with them")
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup, *args, **kwargs) -> None:
        self._shutdown(timeout=self._shutdown_timeout)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        least = self._nodes.split(":")[0] or "?"
        say(f"joining the run's group (at least {least} node(s), up to {self._nodes.split(':')[-1] or '?'})")
        joined = threading.Event()
        started = time.monotonic()

        def still_waiting() -> None:
            while not joined.wait(WAIT_SAY_S):
                say(f"still waiting for the group after {time.monotonic() - started:.0f} s: it needs at least "
                    f"{least} node(s) (min_nodes), and the master's launcher")
        threading.Thread(target=still_waiting, name="rendezvous-wait", daemon=True).start()
        try:
            super()._rendezvous(worker_group)
        finally:
            joined.set()
        # the workers' keys live in the rendezvous store (dist.workers_store), under a name this group
        # alone has: its rank 0 draws it in the round's own keys, every launcher hands it on
        round_keys = worker_group.store
        if worker_group.group_rank == 0:
            round_keys.set(GROUP_KEY, uuid.uuid4().hex)
        os.environ[GROUP_ENV] = round_keys.get(GROUP_KEY).decode()
        ranks = [w.global_rank for w in worker_group.workers]
        world = worker_group.workers[0].world_size if worker_group.workers else 0
        say(f"joined the group in {time.monotonic() - started:.1f} s: {worker_group.group_world_size} node(s), "
            f"this one with ranks {min(ranks)}-{max(ranks)} of {world} (the trainer numbers them by the "
            f"inventory's order)")


def wait_for_host(endpoint: str) -> None:
    """Before torchrun: the rendezvous host's port answers. Until it does the run is paused, and
    this launcher says so once a minute instead of failing (each failure costs the unit a start)."""
    host, _, port = endpoint.rpartition(":")
    started = said = time.monotonic()
    first = True
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=PROBE_S):
                if not first:
                    say(f"the master's rendezvous at {endpoint} answers after {time.monotonic() - started:.0f} s")
                return
        except OSError as exc:
            if first or time.monotonic() - said >= WAIT_SAY_S:
                say(f"waiting for the master's rendezvous at {endpoint} ({exc.strerror or exc}): the master node "
                    f"hosts the run's group, and the run is paused while it is away")
                said, first = time.monotonic(), False
            time.sleep(PROBE_S)


def elastic_setup(args) -> None:
    """An elastic launch (--rdzv-backend c10d): the environment torchrun's agent and our workers need."""
    low, _, high = str(args.nnodes).partition(":")
    os.environ[NODES_ENV] = f"{low}:{high or low}"
    os.environ[GROUP_STORE_ENV] = args.rdzv_endpoint  # the workers' store: the master launcher's
    # The agent's rank 0 otherwise shares its rendezvous store with the workers, and a node joining
    # a running group then waits on a store key its rank 0 never writes: both time out after 60 s
    # and close the rendezvous (torch 2.13, measured). Unshared, torchrun would have its rank 0
    # worker host a store for the group; ours use the rendezvous store under a name of the group's.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    launcher_api.LocalElasticAgent = NodeAgent  # launch_agent builds its agent by this name
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    NodeAgent.hosts_rendezvous = conf.get("is_host", "").lower() in ("1", "true")
    if not NodeAgent.hosts_rendezvous:
        wait_for_host(args.rdzv_endpoint)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rdzv_backend != "static":
        elastic_setup(args)
    try:
        run(args)
    except ChildFailedError as failure:
        code = exit_code_of(failure.failures)
        if code == EXIT_STOPPED:  # not a failure: a peer was stopped, and the ranks saved a checkpoint
            say("the ranks stopped at a checkpoint (SIGTERM on some node)")
        else:  # the same summary torchrun prints, then the workers' own code
            print(failure.format_msg(), file=sys.stderr, flush=True)
        return code
    except SignalException as stop:
        say(f"stopped by {stop.sigval.name}")
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    code = main()
    # Past main the launcher has nothing left to do, and the interpreter's teardown with torch's
    # threads about is where a launcher can die of SIGABRT after a good run (NodeAgent.run): a node
    # whose unit reads that as a crash restarts a finished run. So it leaves without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
