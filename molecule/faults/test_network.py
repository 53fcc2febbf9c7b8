"""Network misconfiguration: each stopped by the preflight naming the host, the interface or port, and the fix.

A worker's train_interface wrong and another's an interface with only IPv6 (one train.yml); ufw on a
worker dropping the Gloo range. No unit starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from nodes import Cluster, log, show_train_failure
from runs import Run

CASE = "network"
RUN = Run("faults-net", 10)
GLOO_MIN, GLOO_MAX = 40000, 40999


def assert_not_started(c: Cluster) -> None:
    for n in c.nodes:
        assert c.unit(n, RUN.unit).get("InvocationID", "") == "", f"{n}: {RUN.unit} started despite the preflight"


@pytest.fixture
def wrong_interfaces(cluster: Cluster, tmp_path: Path) -> Iterator[Path]:
    """An inventory over the scenario's: eth7 (absent) for the first worker, v6only for the last."""
    v6_node = cluster.workers[-1]
    # an interface with only an IPv6 address (one end of a veth pair), chosen as train_interface
    cluster.sh(v6_node, "ip link add v6only type veth peer name v6peer && ip -6 addr add fd77::12/64 dev v6only "
                        "nodad && ip link set v6only up && ip link set v6peer up")
    override = tmp_path / "faults-wrong-interfaces.yml"
    override.write_text(yaml.safe_dump({"all": {"hosts": {cluster.workers[0]: {"train_interface": "eth7"},
                                                          v6_node: {"train_interface": "v6only"}}}}))
    yield override
    cluster.sh(v6_node, "ip link del v6only", check=False)


def test_wrong_and_ipv6_only_interfaces(cluster: Cluster, wrong_interfaces: Path, case_report: dict) -> None:
    wrong_if, v6_node = cluster.workers[0], cluster.workers[-1]
    rc, out, took = cluster.playbook("train.yml", RUN.vars, extra_inventory=wrong_interfaces)
    assert rc != 0, "train.yml started with wrong interfaces"
    msgs = {
        "wrong_interface": f"{wrong_if}: train_interface 'eth7' does not exist",
        "ipv6_only": f"{v6_node}: train_interface 'v6only' has no IPv4 address in lan_subnet",
    }
    for key, want in msgs.items():
        line = next((ln.strip() for ln in out.splitlines() if want in ln), "")
        assert line != "", f"the preflight did not say {want!r}:\n{show_train_failure(out)}"
        assert "Fix:" in line, f"no fix in: {line}"
        case_report[key] = {"seconds": round(took, 1), "message": line[:400]}
    log(f"wrong interfaces stopped in {took:.0f}s")
    assert_not_started(cluster)


@pytest.fixture
def gloo_blocked(cluster: Cluster) -> Iterator[str]:
    """The last worker, its ufw rules for the Gloo range (one per node address) deleted."""
    node = cluster.workers[-1]
    sources = [cluster.hostvars[n]["node_ipv4"] for n in cluster.nodes]
    rules = [f"proto tcp from {source} to any port {GLOO_MIN}:{GLOO_MAX}" for source in sources]
    for rule in rules:
        cluster.sh(node, f"ufw delete allow {rule}")
    yield node
    for rule in rules:
        cluster.sh(node, f"ufw allow {rule} comment 'nanochat gloo'", check=False)


def test_gloo_range_dropped_by_ufw(cluster: Cluster, gloo_blocked: str, case_report: dict) -> None:
    node = gloo_blocked
    rc, out, took = cluster.playbook("train.yml", RUN.vars)
    assert rc != 0, "train.yml started with the Gloo range blocked"
    line = next((ln.strip() for ln in out.splitlines() if f"cannot reach {node}" in ln and "Gloo range" in ln), "")
    assert line != "" and f"Check ufw on {node}" in line, (
        f"the preflight did not name {node}'s blocked Gloo port:\n{show_train_failure(out)}")
    case_report["ufw_gloo_blocked"] = {"seconds": round(took, 1), "message": line[:400]}
    log(f"blocked Gloo range stopped in {took:.0f}s: {line[:200]}")
    assert_not_started(cluster)
