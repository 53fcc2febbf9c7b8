"""Nodes that come and go: real elastic launchers (`python -m nanochat_cpu.launch`, torchrun's
c10d rendezvous hosted by the master's launcher) on loopback, one launcher per node, each node with
its own --out-dir as real nodes have their own disks.

One run lives through a node leaving (SIGTERM, as `systemctl stop` or a laptop going to sleep), that
node coming back, a node lost (SIGKILL of its launcher and workers, as a power cut) and that node
coming back: the others train on at 2 ranks each time and take the node back at 3, a leave loses no
step, a loss at most the steps since the last checkpoint, and the run ends at its last step on
every node with every step of its history trained once. Another run lives through a node freezing
(SIGSTOP of all its processes, a laptop shut): the others notice within --peer-timeout and go on
at 2; a node that wakes up joins again. With fewer nodes than the run's least (min_nodes) the one
left waits, trains nothing and says so, until a node comes.

The times between an event and the training that follows it are printed (pytest -s shows them).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from nanochat_cpu.launch import exit_code_of
from tests.trainer_runs import Watched, descendants, elastic_cmd, free_port, node_env, tiny_flags, train_target

NODES = "2:3"  # min_nodes:max_nodes, as the units pass --nnodes
PEER_TIMEOUT = 8
QUIET_S = 15  # how long a node below min_nodes is watched training nothing
CHECKPOINT_EVERY = 10
# the master's (rank 0's) lines: its steps at a world size, at any, the checkpoint a group starts from
# ("resumed step N, written by R ranks ..., re-sharded to W ranks" where the layout changed), a stop
# by SIGTERM (every rank's), and the checkpoints it saved
STEP_AT = r"\[\S+ rank 0/{world}\] step (\d+)/\d+ \("
ANY_STEP = re.compile(r"\[\S+ rank 0/(\d+)\] step (\d+)/\d+ \(")
RESUMED = re.compile(r"\[\S+ rank 0/(\d+)\] resumed (?:from checkpoint )?step (\d+)")
STOPPED = re.compile(r"stopped by SIGTERM after step (\d+) of")
SAVED = re.compile(r"\[\S+ rank 0/\d+\] checkpoint step (\d+) saved")


def node_flags(data: Path, tok: Path, run: Path, node: int, iterations: int) -> list[str]:
    """384 tokens a step: 2 rows of 64 on each of 3 ranks, 3 rows on each of 2."""
    return tiny_flags(data, tok, run / f"node{node}", total_batch_size=384, num_iterations=iterations,
                      checkpoint_every=CHECKPOINT_EVERY, collective_timeout=60, peer_timeout=PEER_TIMEOUT)


class Cluster:
    """Three nodes of one elastic run on loopback; node 0, the master, hosts the rendezvous. The
    nodes' addresses sort backwards (node 2 is 127.0.0.1), so torchrun's rendezvous numbers node 2
    first, as it would a laptop whose address sorts before the workstation's: the group's ranks
    must still be the inventory's, and the group's keys must not live with node 2, which freezes."""

    def __init__(self, data: Path, tok: Path, run: Path, iterations: int):
        self.data, self.tok, self.run, self.iterations = data, tok, run, iterations
        self.port, self.run_id = free_port(), run.name
        self.nodes: dict[int, Watched] = {}
        self.launched: list[tuple[int, Watched]] = []  # every launcher started, the ended ones too

    def start(self, node: int, max_restarts: int = 5) -> Watched:
        env = {**node_env(), "NODE_RANK": str(node)}
        target = train_target(*node_flags(self.data, self.tok, self.run, node, self.iterations))
        self.nodes[node] = Watched(elastic_cmd(node, NODES, self.port, target, run_id=self.run_id,
                                               local_addr=f"127.0.0.{3 - node}", max_restarts=max_restarts), env)
        self.launched.append((node, self.nodes[node]))
        return self.nodes[node]

    def drop(self, node: int) -> Watched:
        """Node `node`'s launcher, no longer counted as running."""
        return self.nodes.pop(node)

    def kill_all(self) -> None:
        """Every launcher and its workers gone; what each one printed kept beside the run's disks
        (node<N>.<its start>.log)."""
        self.run.mkdir(parents=True, exist_ok=True)
        for i, (node, w) in enumerate(self.launched):
            w.kill()
            (self.run / f"node{node}.{i}.log").write_text(w.text())

    @property
    def master(self) -> Watched:
        return self.nodes[0]

    def found(self, pattern: str, marks: dict[int, int]) -> list[float]:
        """When the nodes in `marks` printed a line `pattern` matches, since their mark."""
        return [self.nodes[n].at(i)[0] for n, mark in marks.items() for i in self.nodes[n].found(pattern, mark)]

    def step_at(self, world: int, since: int, timeout: float = 120) -> int:
        """The master's next step line with `world` ranks."""
        return self.master.wait_for(STEP_AT.format(world=world), since, timeout)


def test_the_launcher_exits_with_the_code_a_restart_cannot_fix():
    def failed(*codes: int) -> dict[int, SimpleNamespace]:
        return {rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)}
    assert exit_code_of(failed(2, -9)) == 2 and exit_code_of(failed(4, 3)) == 3  # one rank's bad input, one killed
    assert exit_code_of(failed(5, 5)) == 5 and exit_code_of(failed(-9)) == 137  # a kill reads as a shell's
    assert exit_code_of(failed(4, -15)) == 1  # anything else mixed: the launcher's own


def test_a_launcher_that_ends_leaves_no_keep_alive_thread_behind():
    """Two launchers of a run whose one step is `true`, with torch's rendezvous handlers kept
    alive past their agents (tests/entry_points/kept_handler_launch.py): when each one's main
    returns, no thread is left, on the master or off it. A keep-alive thread left calling the
    master's store, gone by then, is what a launcher's teardown can die of (SIGABRT)."""
    port, entry = free_port(), str(Path(__file__).parent / "entry_points" / "kept_handler_launch.py")
    nodes = [Watched([sys.executable, entry, *elastic_cmd(node, "2:2", port, ["--no-python", "true"],
                                                          run_id="threads", local_addr=f"127.0.0.{1 + node}")[3:]],
                     node_env()) for node in (0, 1)]
    try:
        codes = [w.end(timeout=120) for w in nodes]
    finally:
        for w in nodes:
            w.kill()
    for w, code in zip(nodes, codes, strict=True):
        assert code == 0, w.text()
        assert "threads left: [] (1 handler(s) kept)" in w.text(), w.text()


def number(regex: re.Pattern, line: str, group: int = 1) -> int:
    found = regex.search(line)
    assert found, (regex.pattern, line)
    return int(found.group(group))


def history(output: str) -> list[tuple[str, int, int]]:
    """The master's step lines and resumes in order: ("step", world, step) and ("resumed", world, step)."""
    events = []
    for line in output.splitlines():
        if found := ANY_STEP.search(line):
            events.append(("step", int(found.group(1)), int(found.group(2))))
        elif found := RESUMED.search(line):
            events.append(("resumed", int(found.group(1)), int(found.group(2))))
    return events


def segments_are_consecutive(events: list[tuple[str, int, int]]) -> None:
    """Between two resumes the master trains step after step, and the first step after a resume is the
    one after the resumed step: no step skipped, none done twice within a group."""
    last = 0
    for kind, _, step in events:
        if kind == "resumed":
            last = step
        else:
            assert step == last + 1, (kind, step, last)
            last = step


def test_a_node_leaves_comes_back_is_lost_comes_back_and_the_run_ends_whole(tiny_data_dir, tiny_tokenizer_dir,
                                                                            tmp_path):
    iterations = 500
    c = Cluster(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "grow", iterations)
    took: dict[str, float] = {}
    t_start = time.monotonic()
    try:
        for node in range(3):
            c.start(node)
        begun = c.step_at(3, 0, timeout=180)
        took["start -> training at 3"] = c.master.at(begun)[0] - t_start

        # ---- node 2 leaves (SIGTERM): every rank stops at one step with its checkpoint, the
        # other two re-form and resume at exactly that step
        c.nodes[2].wait_for(r"rank 2/3\] step", 0)
        marks, t0 = {node: c.nodes[node].mark() for node in (0, 1)}, time.monotonic()
        mark = marks[0]
        c.nodes[2].proc.send_signal(signal.SIGTERM)
        left = c.drop(2)
        assert left.end(timeout=120) == 128 + signal.SIGTERM, left.text()
        stop = number(STOPPED, c.master.at(c.master.wait_for(STOPPED.pattern, mark))[1])
        assert f"stopped by SIGTERM after step {stop} of {iterations}" in left.text()
        assert f"stopped by SIGTERM after step {stop} of {iterations}" in c.nodes[1].text()
        joined = c.master.wait_for(r"launcher: joined the group in [0-9.]+ s: 2 node\(s\)", mark)
        resumed = c.master.wait_for(RESUMED.pattern, joined)
        # the launcher that saw its ranks stop first re-formed the group (the other's may restart its
        # ranks for that group before it sees them exit)
        assert c.found(r"launcher: the ranks stopped at a checkpoint \(a node is leaving", marks), c.master.text(mark)
        assert f"resumed step {stop}, written by 3 ranks" in c.master.at(resumed)[1]  # no step lost
        assert "re-sharded to 2 ranks" in c.master.at(resumed)[1]
        first = c.step_at(2, resumed)
        assert number(ANY_STEP, c.master.at(first)[1], 2) == stop + 1
        assert "3 rows a rank per micro-step" in c.master.text(resumed, first)  # a step keeps its 384 tokens
        took["SIGTERM -> training at 2"] = c.master.at(first)[0] - t0

        # ---- node 2 comes back: the two stop at a checkpoint for it, and all three go on from there
        marks, t0 = {node: c.nodes[node].mark() for node in (0, 1)}, time.monotonic()
        mark = marks[0]
        c.start(2)
        first = c.step_at(3, mark, timeout=180)
        took["node 2 back -> training at 3"] = c.master.at(first)[0] - t0
        events = history(c.master.text(mark, first + 1))
        stops = [int(s) for s in STOPPED.findall(c.master.text(mark, first))]
        assert len(stops) == 1 and ("resumed", 3, stops[0]) in events, c.master.text(mark)  # none lost
        # torch's agent restarts the healthy ranks for the waiting node: the journal of the launcher
        # that saw the node first says why (the other's ranks may stop at the checkpoint before it looks)
        assert c.found(r"launcher: nodes are waiting to join the group", marks), c.master.text(mark)
        c.nodes[2].wait_for(r"rank 2/3\] step", 0)

        # ---- node 1 is lost (SIGKILL, launcher and workers): the other two lose at most the steps
        # since the last checkpoint and go on at 2
        at = c.master.wait_for(SAVED.pattern, first)  # a checkpoint at 3 ranks,
        for _ in range(3):  # and a few steps past it, which the kill loses
            at = c.step_at(3, at + 1)
        marks, t0 = {node: c.nodes[node].mark() for node in (0, 2)}, time.monotonic()
        mark = marks[0]
        c.nodes[1].kill()
        lost = c.drop(1)
        assert lost.end(timeout=30) == -signal.SIGKILL
        first = c.step_at(2, mark)
        took["SIGKILL -> training at 2"] = c.master.at(first)[0] - t0
        reform = c.master.text(mark, first)
        # a restart counted against --max-restarts 5: the first one, as the leave and the return were free
        assert c.found(r"launcher: the workers exited 4 \(a peer lost, or a crash\).*\(4 restart\(s\) left\)",
                       marks), reform
        resumed = number(RESUMED, reform, 2)
        killed_at = [step for kind, world, step in history(c.master.text(0, first)) if kind == "step"][-1]
        saved = [int(s) for s in SAVED.findall(c.master.text(0, first))]
        # the newest checkpoint this side of the kill: the steps after it are trained again, fewer than
        # --checkpoint-every of them
        assert resumed == max(s for s in saved if s <= killed_at), (resumed, killed_at, saved)
        assert killed_at - resumed < CHECKPOINT_EVERY and resumed % CHECKPOINT_EVERY == 0, (resumed, killed_at)

        # ---- node 1 comes back, with its disk as the kill left it
        mark, t0 = c.master.mark(), time.monotonic()
        c.start(1)
        first = c.step_at(3, mark, timeout=180)
        took["node 1 back -> training at 3"] = c.master.at(first)[0] - t0
        assert "re-sharded to 3 ranks" in c.master.text(mark, first)
        c.nodes[1].wait_for(r"rank 1/3\] step", 0)

        # ---- the run ends at its last step on every node
        t0 = time.monotonic()
        codes = {node: w.end(timeout=600) for node, w in c.nodes.items()}
        took["the last join -> done"] = time.monotonic() - t0
    finally:
        c.kill_all()
    for node, w in c.nodes.items():
        assert codes[node] == 0, w.text()[-12000:]
        assert f"done: {iterations} steps" in w.text(), node
    events = history(c.master.text())
    segments_are_consecutive(events)
    trained: list[int] = []  # the run's history: a resume takes back the steps after its checkpoint
    for kind, _, step in events:
        trained = [s for s in trained if s <= step] if kind == "resumed" else [*trained, step]
    assert trained == list(range(1, iterations + 1))
    print("\n" + "\n".join(f"{what}: {s:.1f} s" for what, s in took.items()))


def test_a_frozen_node_is_dropped_within_the_peer_timeout_and_below_min_nodes_the_rest_waits(
        tiny_data_dir, tiny_tokenizer_dir, tmp_path):
    c = Cluster(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "freeze", 100_000)
    took: dict[str, float] = {}
    try:
        for node in range(3):
            c.start(node)
        c.nodes[2].wait_for(r"rank 2/3\] step", 0, timeout=180)
        c.master.wait_for(SAVED.pattern, c.step_at(3, 0))  # a checkpoint the others will go on from

        # ---- node 2 freezes (SIGSTOP of its launcher and workers: a laptop shut): it closes no socket,
        # and the others notice by its heartbeat after --peer-timeout, then go on at 2
        marks, t0 = {node: c.nodes[node].mark() for node in (0, 1)}, time.monotonic()
        c.nodes[2].signal_tree(signal.SIGSTOP)
        first = c.step_at(2, marks[0])
        took["freeze -> training at 2"] = c.master.at(first)[0] - t0
        assert "re-sharded to 2 ranks" in c.master.text(marks[0], first)
        # whichever survivor's heartbeat thread sees it first (the other may be stopped by its launcher,
        # or lose the group's store, before it does)
        silent = rf"FATAL: rank 2@\S+ has been silent for \d+ s \(--peer-timeout {PEER_TIMEOUT}\)"
        noticed = c.found(silent, marks)
        assert noticed, c.master.text(marks[0]) + c.nodes[1].text(marks[1])
        took["freeze -> noticed"] = min(noticed) - t0
        # not before the peer was silent for the bound (a heartbeat a second), and soon after it
        assert PEER_TIMEOUT - 2 < took["freeze -> noticed"] < PEER_TIMEOUT + 4, took

        # ---- node 2 wakes up: its ranks find the group gone and exit 4, and its launcher joins the
        # run again: the two stop at a checkpoint for it, and all three go on
        mark, t0 = c.master.mark(), time.monotonic()
        woken = c.nodes[2].mark()
        c.nodes[2].signal_tree(signal.SIGCONT)
        first = c.step_at(3, mark, timeout=120)
        took["SIGCONT -> training at 3"] = c.master.at(first)[0] - t0
        c.nodes[2].wait_for(r"rank 2/3\] step", woken)
        assert "launcher: the workers exited 4" in c.nodes[2].text(woken), c.nodes[2].text(woken)

        # ---- nodes 1 and 2 lost: one node is fewer than the run's least (2), so node 0 trains nothing
        # and waits for a group, saying so, until a node comes back
        mark = c.master.mark()
        for node in (1, 2):  # both at once: neither may join a group with node 0 before the other is gone
            c.nodes[node].signal_tree(signal.SIGKILL)
        for node in (1, 2):
            c.drop(node).end(timeout=30)
        waiting = c.master.wait_for(r"launcher: joining the run's group \(at least 2 node\(s\), up to 3\)", mark)
        time.sleep(QUIET_S)
        quiet = c.master.text(waiting)
        assert c.master.proc.poll() is None and not ANY_STEP.search(quiet) and "joined the group" not in quiet, quiet
        t0 = time.monotonic()
        c.start(1)
        first = c.step_at(2, waiting, timeout=120)
        took["a second node back -> training at 2"] = c.master.at(first)[0] - t0
        assert re.search(r"launcher: joined the group in [0-9.]+ s: 2 node\(s\)", c.master.text(waiting, first))

        # ---- a node whose launcher gives up (no restart left; here it had none) leaves the run's
        # rendezvous open: torch's launcher would close it for every node on its way out, and the
        # others' next group would fail
        c.start(2, max_restarts=0)
        joined = c.step_at(3, first, timeout=120)
        c.nodes[2].wait_for(r"rank 2/3\] step", 0)
        mark, t0 = c.master.mark(), time.monotonic()
        for worker in descendants(c.nodes[2].proc.pid):
            os.kill(worker, signal.SIGKILL)
        assert c.drop(2).end(timeout=60) != 0
        again = c.step_at(2, mark, timeout=120)
        took["a launcher out of restarts -> the others at 2"] = c.master.at(again)[0] - t0
        assert "RendezvousClosedError" not in c.master.text(joined) + c.nodes[1].text()
    finally:
        c.kill_all()
    print("\n" + "\n".join(f"{what}: {s:.1f} s" for what, s in took.items()))
