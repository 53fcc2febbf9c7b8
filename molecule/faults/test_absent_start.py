"""A run started while a node is away, and the node joining it once back.

The last worker's container is stopped (a laptop shut down or out of the house). train.yml starts
the run on the other two, naming the absent one; status.yml shows it as a row of its own and the
run's group without it. Started again, the node has no unit of this run (it was away when the run
began), so it stays out until train.yml is run again with the same settings: that starts the run
on it alone, the nodes already training keep their units' invocations, and it joins at a
checkpoint. Other settings are refused, naming the flags that differ; restart=true with a
drifted shard is refused by the preflight and leaves the run training.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from nodes import Cluster, first, log, podman, show_train_failure, wait_for
from runs import RESUMED, SHARD, Run, clean_run, last_step, refused, run_state, wait_step, world_steps

CASE = "absent-start"
pytestmark = pytest.mark.incremental  # one run throughout

ITERATIONS = 5000  # never reached: the case ends the run once the node has joined; at 0.15 s a step
# (two nodes of a fast machine) train.yml, status.yml, the node's boot and train.yml again take ~1,300 steps


def worlds(c: Cluster, run: Run, since: float) -> list[tuple[int, int]]:
    """(world size, step) of the master's step lines since `since`."""
    return [(world, step) for _, world, step in world_steps(c.journal(c.master, run.unit, since), since)]


@pytest.fixture(scope="module")
def absent_run(cluster: Cluster) -> Iterator[tuple[Run, str]]:
    run = Run("faults-absent", ITERATIONS)
    clean_run(cluster, run)
    away = cluster.workers[-1]
    podman("stop", cluster.ct(away))
    try:
        yield run, away
    finally:  # every node back and this run ended on all of them: the cases after this one start their own
        podman("start", cluster.ct(away))
        cluster.sh(away, "timeout 120 systemctl is-system-running --wait", check=False)
        for n in cluster.nodes:
            cluster.sh(n, f"systemctl disable --now {run.unit}", check=False)


def test_train_yml_starts_without_the_absent_node(cluster: Cluster, absent_run: tuple[Run, str],
                                                  case_report: dict) -> None:
    run, away = absent_run
    run.started = time.time()
    rc, out, took = cluster.playbook("train.yml", run.vars)
    assert rc == 0, f"train.yml failed with {away} away:\n{show_train_failure(out)}"
    flat = " ".join(out.split())
    assert f"Absent: {away}" in flat, f"train.yml did not name the absent {away}:\n{out[-3000:]}"
    present = [n for n in cluster.nodes if n != away]
    for n in present:
        assert cluster.unit(n, run.unit)["ActiveState"] == "active", f"{n}: {run.unit} did not start"
    wait_step(cluster, run.unit, 3, run.started, timeout=300)
    assert {w for w, _ in worlds(cluster, run, run.started)} == {len(present)}, (
        f"the run trained at another world than {len(present)} nodes: {worlds(cluster, run, run.started)[-5:]}")
    case_report["train_yml_with_one_away_s"] = round(took, 1)
    case_report["absent_named"] = next((ln.strip() for ln in out.splitlines() if "Absent:" in ln), "")[:300]
    log(f"train.yml started {run.name} on {', '.join(present)} in {took:.0f}s, {away} named absent")


def test_status_yml_shows_the_absent_node(cluster: Cluster, absent_run: tuple[Run, str], case_report: dict) -> None:
    run, away = absent_run
    rc, out, took = cluster.playbook("status.yml", {"run_name": run.name})
    flat = " ".join(out.split())
    row = re.search(rf"{away}\s+\d+\s+{run.name}\s+unreachable", out)
    assert row, f"status.yml has no row for the absent {away}:\n{out[-4000:]}"
    present = [n for n in cluster.nodes if n != away]
    group = (f"{run.name}: in the group now {', '.join(present)} ({len(present)} of {len(cluster.nodes)} nodes); "
             f"away: {away}")
    assert group in flat, f"status.yml's summary does not say who is in the run:\n{out[-4000:]}"
    master_row = re.search(rf"^\s*{cluster.master}\s+0\s+{run.name}\s+(\S+)", out, flags=re.MULTILINE)
    assert master_row and master_row.group(1) in ("training", "starting"), (
        f"the master's row does not say the run trains:\n{out[-4000:]}")
    case_report["status_yml"] = {"rc": rc, "seconds": round(took, 1), "group": group}
    log(f"status.yml in {took:.0f}s (rc {rc}): {group}")
    # a run name no node has: named, with the runs there are
    rc, out, _ = cluster.playbook("status.yml", {"run_name": f"{run.name}-typo"})
    flat = " ".join(out.split())
    assert rc != 0 and f"No run named {run.name}-typo on" in flat and f"{run.name} on {cluster.master}" in flat, (
        f"status.yml with an unknown run_name did not name the runs there are (rc {rc}):\n{out[-3000:]}")


def test_other_settings_are_refused(cluster: Cluster, absent_run: tuple[Run, str], case_report: dict) -> None:
    run, away = absent_run
    present = [n for n in cluster.nodes if n != away]
    before = {n: cluster.unit(n, run.unit)["InvocationID"] for n in present}
    case_report["other_settings_refused"] = refused(
        cluster, {**run.vars, "num_iterations": ITERATIONS + 1}, "with other settings than these",
        "a running run's num_iterations changed")
    flat = case_report["other_settings_refused"]["message"]
    assert f"--num-iterations {ITERATIONS}" in flat and "restart=true" in flat, f"the refusal names no flag: {flat}"
    after = {n: cluster.unit(n, run.unit)["InvocationID"] for n in present}
    assert after == before, f"the refused train.yml changed the running units: {before} -> {after}"


def test_train_yml_again_starts_only_the_node_back(cluster: Cluster, absent_run: tuple[Run, str],
                                                   case_report: dict) -> None:
    run, away = absent_run
    podman("start", cluster.ct(away))
    cluster.sh(away, "timeout 120 systemctl is-system-running --wait", check=False)
    assert cluster.unit(away, run.unit)["ActiveState"] == "inactive", (
        f"{away} started {run.unit} by itself, though it was away when the run began")
    present = [n for n in cluster.nodes if n != away]
    before = {n: cluster.unit(n, run.unit)["InvocationID"] for n in present}
    t0 = time.time()
    rc, out, took = cluster.playbook("train.yml", run.vars)
    assert rc == 0, f"train.yml did not start the run on {away}:\n{show_train_failure(out)}"
    flat = " ".join(out.split())
    assert f"already trains on {', '.join(present)}: left as it is" in flat, f"train.yml did not say so:\n{out[-3000:]}"
    after = {n: cluster.unit(n, run.unit)["InvocationID"] for n in present}
    assert after == before, f"train.yml touched the nodes already in the run: {before} -> {after}"
    assert cluster.unit(away, run.unit)["ActiveState"] == "active", f"{away}: {run.unit} did not start"

    def all_three():
        return next((s for w, s in worlds(cluster, run, t0) if w == len(cluster.nodes)), None)
    first_together = wait_for(f"{away} to train with the others", all_three, timeout=300, every=3,
                              state=lambda: run_state(cluster, run))
    lines = cluster.journal(cluster.master, run.unit, t0)
    stop, rejoin = first(lines, r"stopped by SIGTERM after step \d+"), first(lines, RESUMED)
    assert stop and rejoin, f"{away} joined without the others stopping at a checkpoint: {lines[-20:]}"
    stop_step = int(re.search(r"after step (\d+)", stop[1]).group(1))
    rejoin_step = int(re.search(r"step (\d+)", rejoin[1]).group(1))
    assert rejoin_step == stop_step and first_together == stop_step + 1, (
        f"{away} joined at step {rejoin_step} after a stop at {stop_step}, first step together {first_together}: "
        "a join must cost the others no step")
    case_report["train_yml_to_join_s"] = round(took, 1)
    case_report["joined_at_step"] = first_together
    case_report["together_after_s"] = round(time.time() - t0, 1)
    log(f"train.yml started {run.name} on {away} alone in {took:.0f}s; all {len(cluster.nodes)} "
        f"train together from step {first_together}")


def test_a_restart_whose_checks_fail_leaves_the_run_training(cluster: Cluster, absent_run: tuple[Run, str],
                                                            case_report: dict) -> None:
    """train.yml -e restart=true while one node's shard has drifted: the preflight names it, and
    the run it was to replace trains on, untouched (its units are stopped only once the new run's
    checks passed)."""
    run, _ = absent_run
    node = cluster.workers[0]
    before = {n: cluster.unit(n, run.unit)["InvocationID"] for n in cluster.nodes}
    cluster.sh(node, f"cp -p {SHARD} /root/shard.orig && printf drift >> {SHARD}")
    try:
        case_report["restart_with_a_failed_check"] = refused(
            cluster, {**run.vars, "restart": True}, f"data verify FAILED on {node}: shard_00001.parquet",
            "a restart onto a drifted shard")
    finally:
        cluster.sh(node, f"cp -p /root/shard.orig {SHARD}", check=False)
    after = {n: cluster.unit(n, run.unit) for n in cluster.nodes}
    assert {n: u["InvocationID"] for n, u in after.items()} == before and all(
        u["ActiveState"] == "active" for u in after.values()), (
        f"the failed restart stopped the run it was to replace: {before} -> {after}")
    wait_step(cluster, run.unit, last_step(cluster, run.unit, run.started) + 2, run.started, timeout=120)
    log(f"restart=true with a drifted shard on {node}: refused in "
        f"{case_report['restart_with_a_failed_check']['seconds']:.0f}s, the run trains on")
