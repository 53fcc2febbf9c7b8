"""Filters for the firewall role: the ufw rules a node wants, and which of ours are stale.

ufw keeps its rules in /etc/ufw/user.rules (IPv4) and user6.rules (IPv6), one
``### tuple ### <action> <proto> <dport> <dst> <sport> <src> <direction> [comment=<hex>]`` line per
rule. The role's rules carry a comment starting with ``nanochat ``: that marks them as ours, so a
rule of ours whose source is no longer a node (a node removed, an address changed, the lan_subnet-wide
rules of earlier versions) can be found and deleted, while rules a person added are left alone.
"""

from __future__ import annotations

import ipaddress
from typing import Any

OUR_COMMENT_PREFIX = "nanochat "
RENDEZVOUS_COMMENT = "nanochat torchrun rendezvous"
GLOO_COMMENT = "nanochat gloo"
MLFLOW_COMMENT = "nanochat mlflow"


def _network(source: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if source == "any":  # how rules are given to ufw; its files say 0.0.0.0/0
        source = "0.0.0.0/0"
    try:
        return ipaddress.ip_network(str(source), strict=False)
    except ValueError:
        return None


def _rule_key(rule: dict[str, str]) -> tuple[str, str, str, Any, Any]:
    # what makes two rules the same rule for ufw; the comment is only a label
    return (rule["rule"], rule["proto"], str(rule["port"]), _network(rule["from_ip"]), _network(rule["to_ip"]))


def firewall_training_rules(addresses: list[str], ports: dict[str, Any], mlflow_sources: list[str]) -> list[dict]:
    """The allow rules of a node: each node address to the rendezvous port and the Gloo range, and
    each of mlflow_sources (empty except on the master of a cluster with an MLflow server) to MLflow."""
    rules = []
    for address in dict.fromkeys(addresses):
        rules.append({"port": str(ports["master"]), "from_ip": address, "comment": RENDEZVOUS_COMMENT})
        rules.append({"port": f"{ports['gloo_min']}:{ports['gloo_max']}", "from_ip": address, "comment": GLOO_COMMENT})
    for source in dict.fromkeys(mlflow_sources):
        rules.append({"port": str(ports["mlflow"]), "from_ip": source, "comment": MLFLOW_COMMENT})
    return [rule | {"rule": "allow", "proto": "tcp", "to_ip": "any"} for rule in rules]


def _parse_rules(text: str) -> list[dict[str, str]]:
    rules = []
    for line in text.splitlines():
        if not line.startswith("### tuple ###"):
            continue
        fields = line.split()[3:]
        if len(fields) < 7:
            continue
        action, proto, dport, dst, _sport, src, _direction = fields[:7]
        comment = next((f.removeprefix("comment=") for f in fields[7:] if f.startswith("comment=")), "")
        try:
            comment = bytes.fromhex(comment).decode("utf-8", "replace")
        except ValueError:
            comment = ""
        rules.append({"rule": action.split("_")[0], "proto": proto, "port": dport, "from_ip": src, "to_ip": dst,
                      "comment": comment})
    return rules


def firewall_stale_rules(rule_files: list[str], wanted: list[dict]) -> list[dict[str, str]]:
    """Our rules (comment 'nanochat ...') in the texts of user.rules/user6.rules that are not wanted."""
    wanted_keys = {_rule_key(rule) for rule in wanted}
    stale = []
    for text in rule_files:
        for rule in _parse_rules(text):
            if rule["comment"].startswith(OUR_COMMENT_PREFIX) and _rule_key(rule) not in wanted_keys:
                stale.append(rule)
    return stale


def _port_span(port: str) -> tuple[int, int] | None:
    """A rule's destination port as (low, high): '29500', '40000:40999', 'any'; None if unreadable."""
    if port == "any":
        return 0, 65535
    low, _, high = str(port).partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        return None


def firewall_rule_problems(rule_files: list[str], wanted: list[dict], some_unknown: bool = False) -> list[str]:
    """How the rules in user.rules/user6.rules differ from `wanted` on the training ports, one line
    each ([] when they are exactly `wanted`): a wanted rule missing, or any allow rule, ours or a
    person's, that admits another source to one of those ports (a port range or 'any' included).
    `some_unknown`: `wanted` lacks the nodes whose address is not known here (out of the play),
    so our own rules from single addresses are theirs, not extra."""
    wanted_keys = {_rule_key(rule) for rule in wanted}
    spans = [span for rule in wanted if (span := _port_span(rule["port"]))]
    present = [rule for text in rule_files for rule in _parse_rules(text)]
    present_keys = {_rule_key(rule) for rule in present}
    problems = [f"no rule allows {rule['port']}/tcp from {rule['from_ip']}" for rule in wanted
                if _rule_key(rule) not in present_keys]
    for rule in present:
        span = _port_span(rule["port"])
        reaches = span is None or any(span[0] <= high and low <= span[1] for low, high in spans)
        theirs = (some_unknown and rule["comment"].startswith(OUR_COMMENT_PREFIX)
                  and (net := _network(rule["from_ip"])) is not None and net.num_addresses == 1)
        if rule["rule"] == "allow" and reaches and _rule_key(rule) not in wanted_keys and not theirs:
            source = "anywhere" if rule["from_ip"] in ("0.0.0.0/0", "::/0", "any") else rule["from_ip"]
            label = f" ({rule['comment']})" if rule["comment"] else ""
            problems.append(f"a rule allows {rule['port']}/{rule['proto']} from {source}{label}, which is not a node")
    return problems


def firewall_source_problems(nodes: dict[str, str], clients: list[str], lan_subnet: str) -> list[str]:
    """What is wrong with the sources the role would open ports to, one line each ([] when all is well).

    nodes: host -> training address, each an IPv4 address in lan_subnet ('' = unknown). clients:
    mlflow_clients, IPv4 addresses or networks no wider than a /8. Nothing IPv6: an IPv6
    source would open the port on IPv6 too, where nothing of ours listens.
    """
    lan = ipaddress.IPv4Network(str(lan_subnet), strict=False)  # cluster_facts checked it
    problems = []
    for host, address in nodes.items():
        network = _network(address)
        if not address:
            problems.append(f"{host}: no training address (not in this play, and no node_ipv4 in the inventory)")
        elif network is None or network.version != 4 or network.num_addresses != 1 or not network.subnet_of(lan):
            problems.append(f"{host}: training address {address!r} is not an IPv4 address in lan_subnet {lan}")
    for client in clients:
        network = _network(client)
        if network is None or network.version != 4 or network.prefixlen < 8:
            problems.append(f"mlflow_clients: {client!r} is not an IPv4 address or a network of /8 or longer")
    return problems


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {f.__name__: f for f in (firewall_training_rules, firewall_stale_rules, firewall_rule_problems,
                                          firewall_source_problems)}
