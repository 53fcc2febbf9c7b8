"""Stale processes and ports: the preflight names each PID (and the process name) with the fix; no unit starts.

A foreign server on the master's rendezvous port, then a launcher left over from a run started by
hand on a worker, each as a transient unit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nodes import Cluster, wait_for
from runs import Run, assert_no_unit_started, refused

CASE = "stale"
RUN = Run("faults-stale", 10)


@pytest.fixture
def squatter(cluster: Cluster) -> Iterator[None]:
    """A foreign server on the master port."""
    cluster.sh(cluster.master, f"systemd-run --unit faults-squatter /usr/bin/python3 -m http.server "
                               f"{cluster.master_port}")
    yield
    cluster.sh(cluster.master, "systemctl stop faults-squatter.service", check=False)


def test_master_port_held_by_a_foreign_process(cluster: Cluster, squatter: None, case_report: dict) -> None:
    port = cluster.master_port
    pid = wait_for("the squatter to listen", lambda: cluster.sh(cluster.master, f"ss -H -ltnp 'sport = :{port}'")
                   .strip() and cluster.unit(cluster.master, "faults-squatter.service")["MainPID"],
                   timeout=30, every=0.5)
    r = refused(cluster, RUN.vars, f"{cluster.master}: port {port} (master_port) is held by PID {pid} (python3)",
                "a foreign process on the master port")
    assert f"kill {pid}" in r["message"], f"no fix in: {r['message']}"
    case_report["master_port_held"] = r
    assert_no_unit_started(cluster, RUN.unit)


@pytest.fixture
def orphan(cluster: Cluster) -> Iterator[str]:
    """A launcher left over from a run started by hand, waiting in its rendezvous on the first worker."""
    node = cluster.workers[0]
    cluster.sh(node, "systemd-run --unit faults-orphan /opt/nanochat/venv/bin/python -m nanochat_cpu.launch "
                     "--nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29411 "
                     "-m nanochat_cpu.train --depth 2")
    yield node
    cluster.sh(node, "systemctl stop faults-orphan.service", check=False)


def test_orphan_launcher_on_a_worker(cluster: Cluster, orphan: str, case_report: dict) -> None:
    node = orphan
    pid = wait_for("the orphan to run", lambda: cluster.unit(node, "faults-orphan.service")["MainPID"] != "0"
                   and cluster.unit(node, "faults-orphan.service")["MainPID"], timeout=30, every=0.5)
    r = refused(cluster, RUN.vars, f"{node}: trainer process {pid} runs outside any nanochat-train@ unit",
                "an orphan trainer")
    assert f"kill {pid}" in r["message"], f"no fix in: {r['message']}"
    case_report["orphan_trainer"] = r
    assert_no_unit_started(cluster, RUN.unit)
