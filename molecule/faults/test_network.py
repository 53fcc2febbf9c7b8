"""Network misconfiguration: each stopped by the preflight naming the host, the interface or port, and the fix.

A worker's train_interface wrong and another's an interface with only IPv6 (one train.yml); a
worker's packet filter dropping the Gloo range behind ufw's back; ufw disabled on a worker, and a
rule of a person's opening the rendezvous port to the LAN. No unit starts.
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
    """The last worker dropping the Gloo range in its packet filter, ahead of ufw's chains (ufw's own
    rules are as site.yml left them: the firewall check passes, the TCP check must find it)."""
    node = cluster.workers[-1]
    rule = f"INPUT -p tcp --dport {GLOO_MIN}:{GLOO_MAX} -j DROP"
    cluster.sh(node, f"iptables -I {rule}")
    yield node
    cluster.sh(node, f"iptables -D {rule}", check=False)


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


@pytest.fixture
def firewall_loosened(cluster: Cluster) -> Iterator[tuple[str, str]]:
    """ufw disabled on the first worker (an admin debugging); on the last, a person's rule opening
    the rendezvous port to the whole LAN."""
    off, loose = cluster.workers[0], cluster.workers[-1]
    lan = cluster.subnet
    cluster.sh(off, "ufw disable")
    cluster.sh(loose, f"ufw allow proto tcp from {lan} to any port 29500")
    yield off, loose
    cluster.sh(off, "ufw --force enable", check=False)
    cluster.sh(loose, f"ufw delete allow proto tcp from {lan} to any port 29500", check=False)


def test_a_firewall_not_as_site_yml_left_it_is_named(cluster: Cluster, firewall_loosened: tuple[str, str],
                                                       case_report: dict) -> None:
    off, loose = firewall_loosened
    lan = cluster.subnet
    rc, out, took = cluster.playbook("train.yml", RUN.vars)
    assert rc != 0, "train.yml started with ufw off on a node"
    text = " ".join(out.split())
    for node, want in ((off, "ufw is not active"), (loose, f"a rule allows 29500/tcp from {lan}, which is not a node")):
        said = f"{node}: the firewall is not as site.yml left it: "
        assert said in text and want in text.split(said, 1)[1][:600], (
            f"the preflight did not say {want!r} for {node}:\n{show_train_failure(out)}")
    assert "Fix: re-run site.yml" in text
    case_report["ufw_disabled"] = {"seconds": round(took, 1), "message": text.split(f"{off}: the firewall", 1)[1][:300]}
    log(f"firewall not as site.yml left it stopped in {took:.0f}s")
    assert_not_started(cluster)
