"""Disk full and a checkpoint write cut short, on a worker whose run directory is a small tmpfs.

First on 8 MiB, too small for the run's checkpoints: the preflight names the node and nothing starts.

Filled after checkpoint 10, so its write of checkpoint 20 fails: every rank stops with exit 2 naming
that node and "No space left on device" (no restart loop), checkpoint 10 intact everywhere, the partial
file gone. The units started again after freeing space resume from 10 with the same losses. Then the
worker's trainer SIGKILLed while it writes its next checkpoint: the half-written step is ignored, the
run resumes from the one before and finishes.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from nodes import Cluster, first, log, show_train_failure, start_everywhere, steps, wait_for
from runs import (
    CHECKPOINT_EVERY,
    COLLECTIVE_TIMEOUT,
    Run,
    assert_no_unit_started,
    check_resume,
    clean_run,
    complete_steps,
    refused,
    resume_after,
    run_state,
    wait_all_failed,
)

CASE = "checkpoint"
pytestmark = pytest.mark.incremental  # one run throughout, each test goes on from the last


@dataclass
class DiskRun:
    run: Run
    node: str  # the worker with the small disk
    started_again: float = 0.0  # when the units were started after space was freed
    losses_before: dict[int, float] = field(default_factory=dict)  # the master's, before the disk filled
    last_fault: float = 0.0  # the SIGKILL: the run's "done" lines are looked for after it


@pytest.fixture(scope="module")
def small_disk(cluster: Cluster) -> Iterator[DiskRun]:
    """The last worker's run directory on a filesystem of its own (128 MiB), so it can fill up."""
    d = DiskRun(Run("faults-disk", 60), cluster.workers[-1])
    rundir = d.run.dir
    cluster.sh(d.node, f"umount {rundir}", check=False)
    clean_run(cluster, d.run)
    cluster.sh(d.node, f"mkdir -p {rundir} && mount -t tmpfs -o size=128m,mode=0755 faults-disk {rundir} && "
                       f"chown nanochat:nanochat {rundir}")
    yield d
    cluster.sh(d.node, f"systemctl stop {d.run.unit}; umount {rundir}", check=False)
    clean_run(cluster, d.run)


def test_a_disk_too_small_for_the_runs_checkpoints_is_named_before_any_unit_starts(
        cluster: Cluster, small_disk: DiskRun, case_report: dict) -> None:
    """The same worker's run directory on 8 MiB first: the preflight's check sizes the run's
    checkpoints from the model and names that node; nothing starts."""
    run, node = small_disk.run, small_disk.node
    cluster.sh(node, f"umount {run.dir} && mount -t tmpfs -o size=8m,mode=0755 faults-disk {run.dir} && "
                     f"chown nanochat:nanochat {run.dir}")
    try:
        case_report["disk_too_small"] = refused(cluster, run.vars, "free on its disk, but the run's checkpoints need",
                                                "a disk too small for the run's checkpoints")
    finally:
        cluster.sh(node, f"umount {run.dir} && mount -t tmpfs -o size=128m,mode=0755 faults-disk {run.dir} && "
                         f"chown nanochat:nanochat {run.dir}")
    assert node in case_report["disk_too_small"]["message"], case_report["disk_too_small"]
    assert_no_unit_started(cluster, run.unit)


def test_full_disk_stops_every_rank_with_exit_2(cluster: Cluster, small_disk: DiskRun, case_report: dict) -> None:
    run, node = small_disk.run, small_disk.node
    run.started = time.time()
    rc, out, took = cluster.playbook("train.yml", run.vars)
    assert rc == 0, f"train.yml failed:\n{show_train_failure(out)}"
    # once step 10's checkpoint is sealed, fill the node's disk
    wait_for("step 10's checkpoint", lambda: 10 in complete_steps(cluster, node, run), timeout=300, every=0.2,
             state=lambda: run_state(cluster, run))
    # t0 before the fill: the ranks may reach step 20's write before `podman exec` has returned
    t0 = time.time()
    cluster.sh(node, f"dd if=/dev/zero of={run.dir}/filler bs=1M 2>/dev/null || true")
    log(f"{node}: {run.dir} filled")

    ended = wait_all_failed(cluster, run.unit, "every unit to stop on the full disk", timeout=COLLECTIVE_TIMEOUT + 60,
                            state=lambda: run_state(cluster, run))
    full = {}
    for n, u in ended.items():
        # exit 2 is in RestartPreventExitStatus: a full disk needs a person, not a restart loop
        assert u["ExecMainStatus"] == "2" and u["NRestarts"] == "0", f"{n}: expected exit 2, no restart: {u}"
        hit = first(cluster.journal(n, run.unit, t0), r"FATAL: .*cannot write checkpoint step 20")
        assert (hit is not None and f"@{node}: cannot write checkpoint step 20" in hit[1]
                and "No space left on device" in hit[1] and "newest complete: 10" in hit[1]), (
            f"{n}: no FATAL line naming {node}'s full disk: {hit}")
        assert complete_steps(cluster, n, run)[-1:] == [10], (
            f"{n}: newest complete checkpoint is not step 10: {complete_steps(cluster, n, run)}")
        full[n] = round(hit[0] - t0, 1)
    left = cluster.sh(node, f"ls -A {run.dir}/checkpoints/step_000020 2>/dev/null || true").split()
    assert not [f for f in left if ".tmp." in f], f"{node}: the failed write left its partial file: {left}"
    case_report["disk_full"] = {"fatal_s": full, "message": hit[1][:500], "left_in_step_20": left}
    log(f"disk full: every rank stopped with exit 2 naming {node}: {full}")


def test_units_started_again_resume_from_step_10(cluster: Cluster, small_disk: DiskRun, case_report: dict) -> None:
    """The operator frees space and starts the units again (train.yml would do the same, after a
    minute of preflight): the run resumes from step 10."""
    run, node = small_disk.run, small_disk.node
    cluster.sh(node, f"rm -f {run.dir}/filler")
    small_disk.started_again = t_again = time.time()
    start_everywhere(cluster, f"systemctl reset-failed {run.unit}; systemctl start {run.unit}")
    lines = wait_for("the run to resume", lambda: (j := cluster.journal(cluster.master, run.unit, t_again))
                     and first(j, r"resumed from checkpoint step 10") and steps(j) and j, timeout=300, every=2,
                     state=lambda: run_state(cluster, run))
    case_report["disk_full"]["resumed_s_after_start"] = round(first(lines, r"resumed from")[0] - t_again, 1)
    small_disk.losses_before = {s: loss for _, s, loss in steps(cluster.journal(cluster.master, run.unit, run.started),
                                                                before=t_again)}


def test_sigkill_mid_write_resumes_from_the_one_before(cluster: Cluster, small_disk: DiskRun,
                                                       case_report: dict) -> None:
    """A watcher on the node polls for the temporary file of a checkpoint's data write (it exists
    ~50 ms of each 0.1-s save) and SIGKILLs the node's trainer when it sees one. Not the seal's
    (COMPLETE.tmp): by then every disk has reported its write, the others seal the step, and the run
    rightly resumes from it (checkpoint_background.py's note); the test's kill is meant for the
    write. The kill still lands a moment after the file was seen: where that moment let the node
    finish its write and the others seal, the step is resumed and the node must get it back.

    The fault's time is the watcher's, taken just before its kill: the survivors' Gloo sees the
    dead peer's sockets close within milliseconds and they exit at once, before `podman exec` has
    returned (CI: a t0 taken after it missed their lines, and the wait for them ran out)."""
    run, node = small_disk.run, small_disk.node
    pid = cluster.unit(node, run.unit)["MainPID"]
    trainer = cluster.sh(node, f"pgrep -P {pid} -f nanochat_cpu.train").split()[0]
    watcher = (f"import glob, os, time\nend = time.time() + 120\n"
               f"while time.time() < end:\n"
               f"    hits = [h for h in glob.glob('{run.dir}/checkpoints/step_*/*.tmp.*') if '/COMPLETE.' not in h]\n"
               f"    if hits:\n        t = time.time()\n        os.kill({trainer}, 9)\n"
               f"        print(t, ' '.join(hits))\n        break\n")
    seen = cluster.sh(node, f"python3 -c \"{watcher}\"", timeout=150).strip()
    assert seen != "", f"{node}: never saw a checkpoint being written"
    at, killed = seen.split(" ", 1)
    small_disk.last_fault = t0 = float(at)  # the containers share the host's clock
    killed_step = int(re.search(r"step_(\d+)/", killed).group(1))
    left = cluster.sh(node, f"ls -A {run.dir}/checkpoints/step_{killed_step:06d}").split()
    log(f"SIGKILL {node} trainer {trainer} while writing {killed}; left {left}")
    assert "COMPLETE" not in left, f"{node}: step {killed_step} sealed despite the kill: {left}"
    m = resume_after(cluster, run.unit, t0, node, timeout=300, state=lambda: run_state(cluster, run))
    check_resume(cluster, run.unit, t0, m, node, run.started)
    log("the survivors' FATAL lines, seconds after the kill: "
        + ", ".join(f"{n} {m[n]['fatal_s']}" for n in cluster.nodes if n != node))
    restored = first(cluster.journal(node, run.unit, t0),
                     rf"checkpoint step {killed_step} was missing on this disk: restored from rank")
    if restored is None:
        assert m["resumed_from"] == killed_step - CHECKPOINT_EVERY, (
            f"resumed from {m['resumed_from']}, expected the last complete step {killed_step - CHECKPOINT_EVERY} "
            f"({node} did not restore step {killed_step} from another disk)")
    else:  # killed just after every disk had reported its write: the others sealed it
        assert m["resumed_from"] == killed_step, (
            f"{node} restored step {killed_step} from another disk, yet the run resumed from {m['resumed_from']}")
        log(f"{node} was killed after every disk had written step {killed_step}: resumed from it, restored there")
    case_report["sigkill_mid_write"] = {"writing": killed, "left": left, "sealed_elsewhere": restored is not None,
                                        **{k: v for k, v in m.items() if k not in cluster.nodes}}


def test_steps_redone_after_the_full_disk_match(cluster: Cluster, small_disk: DiskRun, case_report: dict) -> None:
    before = small_disk.losses_before
    after = {s: loss for _, s, loss in steps(cluster.journal(cluster.master, small_disk.run.unit,
                                                             small_disk.started_again))}
    redone = [s for s in range(11, 21) if s in before and s in after]
    diff = max((abs(before[s] - after[s]) for s in redone), default=math.inf)
    assert diff < 1e-2, f"the steps redone after the disk-full stop differ: {before} vs {after}"
    case_report["disk_full"]["max_loss_diff_redone"] = diff


def test_run_finishes(cluster: Cluster, small_disk: DiskRun, case_report: dict) -> None:
    run = small_disk.run

    def finished():
        return all(cluster.unit(n, run.unit)["ActiveState"] == "inactive" and
                   first(cluster.journal(n, run.unit, small_disk.last_fault), rf"done: {run.iterations} steps")
                   for n in cluster.nodes)
    wait_for(f"the run to finish step {run.iterations}", finished, timeout=400, every=3,
             state=lambda: run_state(cluster, run))
    for n in cluster.nodes:
        assert run.iterations in complete_steps(cluster, n, run), (
            f"{n}: no complete checkpoint for step {run.iterations}")
    log(f"checkpoint case: {json.dumps(case_report)[:600]}")
