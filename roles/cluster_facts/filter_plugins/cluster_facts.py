"""Filters that check lan_subnet and pick a node's training interface from its gathered facts.

Written with the standard library's ``ipaddress`` so the roles need neither ``netaddr`` nor
the ``ansible.utils`` collection on the controller.
"""

from __future__ import annotations

import ipaddress
from typing import Any


def _fact_key(interface: str) -> str:
    # setup stores interface 'br-lan' or 'eth0.100' under the key 'br_lan' / 'eth0_100'
    return interface.replace("-", "_").replace(".", "_").replace(":", "_")


def _ipv4_addresses(facts: dict[str, Any], interface: str) -> list[str]:
    entry = facts.get(_fact_key(interface)) or {}
    found = []
    primary = entry.get("ipv4") or {}
    if primary.get("address"):
        found.append(primary["address"])
    for extra in entry.get("ipv4_secondaries") or []:
        if extra.get("address"):
            found.append(extra["address"])
    return found


def _in_subnet(address: str, network: ipaddress.IPv4Network) -> bool:
    try:
        return ipaddress.ip_address(address) in network
    except ValueError:
        return False


# The private IPv4 ranges of RFC 1918: a LAN's subnet lies inside one of them. Anything else (a public
# range, 0.0.0.0/0, CGNAT's 100.64.0.0/10) is not a home or office LAN.
PRIVATE_RANGES = tuple(ipaddress.IPv4Network(r) for r in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def cluster_facts_subnet_problem(lan_subnet: str) -> str:
    """'' when lan_subnet is a private IPv4 network of prefix /8 or longer, else what is wrong and the fix."""
    fix = "Fix: set lan_subnet to your LAN's network, e.g. 192.168.1.0/24 (ip -4 addr on a node shows it)"
    if not str(lan_subnet):
        return f"lan_subnet is not set. {fix}"
    try:
        network = ipaddress.IPv4Network(str(lan_subnet), strict=False)
    except ValueError:
        return f"lan_subnet={lan_subnet!r} is not an IPv4 network in CIDR form. {fix}"
    if "/" not in str(lan_subnet):
        return f"lan_subnet={lan_subnet!r} has no prefix length (/24, ...). {fix}"
    if not any(network.subnet_of(private) for private in PRIVATE_RANGES):
        return (
            f"lan_subnet={lan_subnet!r} is not inside a private range (10.0.0.0/8, 172.16.0.0/12, "
            f"192.168.0.0/16), as a LAN's network is. {fix}"
        )
    return ""


def cluster_facts_train_net(facts: dict[str, Any], lan_subnet: str, requested: str = "") -> dict[str, str]:
    """Return {'interface', 'ipv4', 'error'} for the node whose ``ansible_facts`` are given.

    requested: the inventory's ``train_interface`` ('' = derive it: the one interface holding an
    IPv4 address in ``lan_subnet``). On a problem ``error`` says what is wrong and how to fix it
    (without the host name, which the caller adds) and the other two are ''.
    """
    result = {"interface": "", "ipv4": "", "error": ""}
    try:
        network = ipaddress.IPv4Network(str(lan_subnet), strict=False)
    except ValueError:
        result["error"] = f"lan_subnet={lan_subnet!r} is not an IPv4 network such as 192.168.1.0/24"
        return result
    interfaces = sorted(i for i in facts.get("interfaces") or [] if i != "lo")
    holders = {i: [a for a in _ipv4_addresses(facts, i) if _in_subnet(a, network)] for i in interfaces}
    holders = {i: addrs for i, addrs in holders.items() if addrs}
    hint = (
        "; ".join(f"{i} has {', '.join(addrs)}" for i, addrs in holders.items())
        or f"no interface has an IPv4 address in {network}"
    )
    if requested:
        if requested not in interfaces:
            result["error"] = (
                f"train_interface {requested!r} does not exist (interfaces: {', '.join(interfaces) or 'none'}; "
                f"{hint}). Fix: set train_interface to the interface on the LAN {network}"
            )
            return result
        addrs = holders.get(requested, [])
        if not addrs:
            have = ", ".join(_ipv4_addresses(facts, requested)) or "no IPv4 address"
            result["error"] = (
                f"train_interface {requested!r} has no IPv4 address in lan_subnet {network} (it has {have}; "
                f"{hint}). Fix: set train_interface to the interface on that LAN, or correct lan_subnet"
            )
            return result
        result.update(interface=requested, ipv4=addrs[0])
        return result
    if not holders:
        result["error"] = (
            f"no interface has an IPv4 address in lan_subnet {network} "
            f"(interfaces: {', '.join(interfaces) or 'none'}). "
            "Fix: connect the node to the LAN, correct lan_subnet, or set train_interface"
        )
        return result
    if len(holders) > 1:
        result["error"] = (
            f"several interfaces are on lan_subnet {network} ({hint}); "
            "set train_interface to the one training traffic should use (the wired one, if any)"
        )
        return result
    interface, addrs = next(iter(holders.items()))
    result.update(interface=interface, ipv4=addrs[0])
    return result


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {
            "cluster_facts_subnet_problem": cluster_facts_subnet_problem,
            "cluster_facts_train_net": cluster_facts_train_net,
        }
