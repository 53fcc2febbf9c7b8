"""Data drift after site.yml: one node's shard modified, another node's missing.

train.yml stops in the preflight naming each host and file, and no unit starts; the units started
by hand anyway exit on every node with the fingerprint message (exit 3, no restart). Starting them
by hand copies an env file of the node-loss run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodes import Cluster, first, log, show_train_failure, start_everywhere, wait_for
from runs import DATA, SHARD, Run, assert_no_unit_started, wait_all_failed

CASE = "drift"
RUN = Run("faults-drift", 10)
GONE = f"{DATA}/shard_00003.parquet"


@pytest.fixture(scope="module")
def drifted(cluster: Cluster) -> Iterator[tuple[str, str]]:
    """(node with a changed shard, node with a missing one): what a partial re-push or a stray edit leaves."""
    node, gone_node = cluster.workers[-1], cluster.workers[0]
    cluster.sh(node, f"cp -p {SHARD} /root/shard.orig && printf drift >> {SHARD}")
    cluster.sh(gone_node, f"mv {GONE} /root/shard.gone")
    yield node, gone_node
    cluster.sh(node, f"cp -p /root/shard.orig {SHARD}", check=False)
    cluster.sh(gone_node, f"mv /root/shard.gone {GONE}", check=False)
    for n in cluster.nodes:
        cluster.sh(n, f"systemctl stop {RUN.unit}; systemctl reset-failed {RUN.unit}; "
                      f"rm -f /etc/nanochat/{RUN.name}.env", check=False)


def test_preflight_names_each_host_and_file(cluster: Cluster, drifted: tuple[str, str], case_report: dict) -> None:
    node, gone_node = drifted
    rc, out, took = cluster.playbook("train.yml", RUN.vars)
    assert rc != 0, "train.yml started a run on drifted data"
    msg = next((ln.strip() for ln in out.splitlines() if f"data verify FAILED on {node}" in ln), "")
    msg_gone = next((ln.strip() for ln in out.splitlines() if f"data verify FAILED on {gone_node}" in ln), "")
    assert f"data verify FAILED on {node}: shard_00001.parquet" in msg and "site.yml" in msg, (
        f"the preflight did not name {node} and the file:\n{show_train_failure(out)}")
    assert f"data verify FAILED on {gone_node}: shard_00003.parquet" in msg_gone and "no file" in msg_gone, (
        f"the preflight did not name {gone_node} and the missing file:\n{show_train_failure(out)}")
    assert_no_unit_started(cluster, RUN.unit)
    case_report["preflight"] = {"seconds": round(took, 1), "message": msg[:400], "message_missing": msg_gone[:400]}
    log(f"preflight stopped train.yml in {took:.0f}s: {msg[:200]}")


def test_units_started_by_hand_exit_with_the_fingerprint_mismatch(
        cluster: Cluster, drifted: tuple[str, str], case_report: dict) -> None:
    node, gone_node = drifted
    unit = RUN.unit
    # started by hand anyway, with an env file like train.yml renders
    src = next(iter(cluster.sh(cluster.master, "ls /etc/nanochat/*.env").split()), "")
    assert src != "", "no env file to copy (run the node-loss case first)"
    old = Path(src).stem
    for n in cluster.nodes:
        cluster.sh(n, f"sed 's/{old}/{RUN.name}/g' /etc/nanochat/{old}.env > /etc/nanochat/{RUN.name}.env && "
                      f"chgrp nanochat /etc/nanochat/{RUN.name}.env && chmod 0640 /etc/nanochat/{RUN.name}.env")
    t0 = time.time()
    start_everywhere(cluster, f"systemctl start {unit}")

    def all_fatal():
        got = {n: first(cluster.journal(n, unit, t0), r"FATAL") for n in cluster.nodes}
        return got if all(got.values()) else None
    fatal = wait_for("every rank's fingerprint message", all_fatal, timeout=240)
    # exit 3 (ranks disagree) is in RestartPreventExitStatus: each unit fails once, no restart loop
    ended = wait_all_failed(cluster, unit, "every unit to fail without a restart", timeout=60)
    for n, u in ended.items():
        assert u["NRestarts"] == "0" and u["ExecMainStatus"] == "3", f"{n}: expected exit 3 and no restart: {u}"
    for n in cluster.nodes:
        cluster.sh(n, f"systemctl stop {unit}; systemctl reset-failed {unit} || true")
    case_report["by_hand"] = {}
    for n, (t, m) in fatal.items():
        assert ("run fingerprint mismatch" in m and "file data/shard_00001.parquet" in m and f"{node} has" in m
                and "file data/shard_00003.parquet" in m and f"{gone_node} has missing" in m), (
            f"{n}: not the fingerprint message naming both files: {m}")
        banner = first(cluster.journal(n, unit, t0), r"\] nanochat_cpu ")
        case_report["by_hand"][n] = {"fatal_s": round(t - t0, 1),
                                     "after_banner_s": round(t - banner[0], 1) if banner else None}
        assert banner is None or t - banner[0] < 30, f"{n}: {t - banner[0]:.0f}s from start to the message"
    case_report["by_hand"]["message"] = fatal[cluster.master][1][:500]
    log(f"units started by hand: {json.dumps(case_report['by_hand'])}")
