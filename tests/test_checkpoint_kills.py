"""A rank SIGKILLed at each point where a checkpoint waits on it, on real torchrun + Gloo processes:
three nodes on loopback (a launcher each, one rank each), the fault in one of them.

Where a checkpoint waits on a peer: its states crossing to every disk, in rounds; its write to
each disk (model.pt, a rank's state); the seal; the same write crossing in the background of the
inner steps (local steps); and at the start, a restored file sent to a disk that lacks the step,
and the sha256 check of the step's files that every rank waits for. A peer killed at any of these
closes its sockets: the survivors' collective fails at once and they exit 4 naming it, the step
and their peers, in hundredths of a second here. A survivor that takes longer than DEAD_PEER_S
fails the test: one that waits for the watchdog (--collective-timeout + 30 s, there for a peer
that closes nothing: test_faults_trainer.py) or for ever. Each case prints what the survivors took.

The cluster's own case (molecule/faults/test_checkpoint.py) kills a node's trainer from outside,
at whatever write it meets; these put the kill at each point in turn.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nanochat_cpu import checkpoint_files
from nanochat_cpu.dist import EXIT_COLLECTIVE, WATCHDOG_GRACE_S
from tests.trainer_runs import ENTRY_POINTS, Watched, free_port, node_env, tiny_flags, torchrun_cmd

FAULT_TRAIN = str(ENTRY_POINTS / "fault_train.py")
NODES = 3
TIMEOUT = 20  # --collective-timeout: the watchdog's bound is TIMEOUT + WATCHDOG_GRACE_S
# a killed peer's sockets close with it: its survivors exit in 0.01-0.05 s on an idle 2-core machine;
# what is left is for a loaded one (the seal's survivors also train a step before their collective)
DEAD_PEER_S = 10.0
# the checkpoint written while rank 2 dies (every 4 steps), and what the step's files may be sealed at
STEP = 8
BATCH = 2 * 64 * NODES  # tiny_flags' rows of 64 tokens, 2 a rank
LOCAL_STEPS = {"sync_every": 2, "sync_warmup_ratio": 0}

# point -> (the rank killed, FAULT_FILE, extra flags, the checkpoints each node's disk holds after)
WRITES = {
    "the states crossing to every disk": (2, "transfer", {}, [[4], [4], [4]]),
    "the write of model.pt": (2, "model.pt", {}, [[4], [4], [4]]),
    "the write of a rank's state": (2, "rank0.pt", {}, [[4], [4], [4]]),
    # every disk reported its write: the survivors seal step 8 and die at step 9's first collective
    "the seal": (2, "COMPLETE", {}, [[4, 8], [4, 8], [4]]),
    "the write, crossing in the background of local steps": (2, "model.pt", LOCAL_STEPS, [[4], [4], [4]]),
}
# at the start of a run that resumes step 8: node 1's copy of it is gone, rank 0 sends it the files
STARTS = {
    "a restored file on its way to a disk that lacks it": (0, "restore", [[4, 8], [4], [4, 8]]),
    "the sha256 check of the files to resume": (2, "check", [[4, 8], [4], [4, 8]]),
}


def run_nodes(nodes_dir: Path, data: Path, tok: Path, killed: int, fault: str, iterations: int,
              **over) -> dict[str, float]:
    """Three nodes, rank `killed` SIGKILLed at `fault`: every survivor exits 4 naming the collective,
    within DEAD_PEER_S of the kill. Returns the seconds each survivor took."""
    port, env = free_port(), {**node_env(), "FAULT_RANK": str(killed), "FAULT_STEP": str(STEP),
                              "FAULT_FILE": fault, "FAULT_MODE": "kill"}
    flags = {"collective_timeout": TIMEOUT, "num_iterations": iterations, "total_batch_size": BATCH, **over}
    nodes = [Watched(torchrun_cmd(1, port, [FAULT_TRAIN, *tiny_flags(data, tok, nodes_dir / f"node{r}", **flags)],
                                  nnodes=NODES, node_rank=r), env) for r in range(NODES)]
    try:
        at = nodes[killed].wait_for(r"FAULT: SIGKILL", timeout=240)
        killed_at = nodes[killed].at(at)[0]
        took = {}
        for r, node in enumerate(nodes):
            code = node.end(timeout=TIMEOUT + WATCHDOG_GRACE_S + 60)
            if r == killed:
                assert code != 0, node.text()
                continue
            fatal = node.found(r"FATAL: ")
            assert fatal and code == EXIT_COLLECTIVE, f"rank {r} exited {code}, expected {EXIT_COLLECTIVE} with " \
                                                      f"a FATAL line:\n{node.text()[-6000:]}"
            when, line = node.at(fatal[0])
            took[f"rank {r}"] = round(when - killed_at, 2)
            assert when - killed_at <= DEAD_PEER_S, (
                f"rank {r} gave up {when - killed_at:.1f}s after rank {killed} was killed, a dead peer whose "
                f"sockets closed (allowed {DEAD_PEER_S:.0f}s; the watchdog's bound is "
                f"{TIMEOUT + WATCHDOG_GRACE_S:.0f}s):\n{line}")
            assert "collective '" in line and " at step " in line and f"rank {killed}@" in line, line
        return took
    finally:
        for node in nodes:
            node.kill()


def holds(nodes_dir: Path) -> list[list[int]]:
    return [checkpoint_files.complete_steps(str(nodes_dir / f"node{r}")) for r in range(NODES)]


@pytest.mark.parametrize("point", list(WRITES))
def test_a_rank_killed_while_a_checkpoint_is_written_stops_the_others_within_the_bound(point, tiny_data_dir,
                                                                                       tiny_tokenizer_dir, tmp_path):
    killed, fault, over, after = WRITES[point]
    took = run_nodes(tmp_path, tiny_data_dir, tiny_tokenizer_dir, killed, fault, 12, **over)
    print(f"{point}: survivors exited {took} s after the kill")
    assert holds(tmp_path) == after


@pytest.fixture(scope="module")
def sealed_at_8(tiny_data_dir, tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """Three nodes' disks after a run of 8 steps: steps 4 and 8 sealed on each."""
    nodes_dir = tmp_path_factory.mktemp("sealed")
    port = free_port()
    nodes = [Watched(torchrun_cmd(1, port, ["-m", "nanochat_cpu.train",
                                            *tiny_flags(tiny_data_dir, tiny_tokenizer_dir, nodes_dir / f"node{r}",
                                                        num_iterations=STEP, total_batch_size=BATCH)],
                                  nnodes=NODES, node_rank=r),
                     node_env()) for r in range(NODES)]
    try:
        assert [node.end(timeout=300) for node in nodes] == [0] * NODES, nodes[0].text()
    finally:
        for node in nodes:
            node.kill()
    assert holds(nodes_dir) == [[4, 8]] * NODES
    return nodes_dir


@pytest.mark.parametrize("point", list(STARTS))
def test_a_rank_killed_while_a_checkpoint_is_resumed_stops_the_others_within_the_bound(point, sealed_at_8,
                                                                                       tiny_data_dir,
                                                                                       tiny_tokenizer_dir, tmp_path):
    killed, fault, after = STARTS[point]
    nodes_dir = tmp_path / "nodes"
    shutil.copytree(sealed_at_8, nodes_dir)
    shutil.rmtree(nodes_dir / "node1" / "checkpoints" / f"step_{STEP:06d}")
    took = run_nodes(nodes_dir, tiny_data_dir, tiny_tokenizer_dir, killed, fault, 12)
    print(f"{point}: survivors exited {took} s after the kill")
    assert holds(nodes_dir) == after
