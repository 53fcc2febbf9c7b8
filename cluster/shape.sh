#!/usr/bin/env bash
# Limit the bandwidth of one local-cluster node's link, both ways, with a token bucket (tbf):
#   egress:  on the node's interface, inside the container;
#   ingress: on the host end of the node's veth pair (its egress is the node's ingress).
# usage: cluster/shape.sh CONTAINER IFACE RATE|none [BURST] [LATENCY]
#   RATE as tc writes it (100mbit, 20mbit, 1gbit); none removes the limit.
#   BURST defaults to 10 ms of traffic at RATE (at least 32kbit): a bucket much smaller than
#   that (tbf examples use 32kbit, under 1 ms at 1 Gbit/s) caps the link far below its rate.
# Prints "changed" when it changed something, "unchanged" otherwise. Run as root on the host.
set -euo pipefail
container=$1 iface=$2 rate=$3 latency=${5:-400ms}

ten_ms_of() { # RATE -> a tbf burst holding 10 ms of traffic, at least 32kbit
    local kbit=32 mult
    if [[ ${1,,} =~ ^([0-9]+)(k|m|g)bit$ ]]; then
        case ${BASH_REMATCH[2]} in k) mult=1 ;; m) mult=1000 ;; g) mult=1000000 ;; esac
        kbit=$((BASH_REMATCH[1] * mult / 100))
        ((kbit >= 32)) || kbit=32
    fi
    echo "${kbit}kbit"
}
burst=${4:-$(ten_ms_of "$rate")}

in_node() { podman exec "$container" "$@"; }

peer_index=$(in_node cat "/sys/class/net/$iface/iflink")
host_if=$(ip -o link show | awk -F': ' -v idx="$peer_index" '$1 == idx { sub(/@.*/, "", $2); print $2 }')
if [[ -z $host_if ]]; then
    echo "shape.sh: no host interface with index $peer_index (peer of $container:$iface)" >&2
    exit 1
fi

changed=0
# qdisc_is DEV-RUNNER... : true when the root qdisc already is the wanted one
apply() { # apply WHERE DEV  (WHERE: node|host)
    local where=$1 dev=$2 run=()
    [[ $where == node ]] && run=(podman exec "$container")
    local current
    current=$("${run[@]}" tc qdisc show dev "$dev" root)
    if [[ $rate == none ]]; then
        if [[ $current == *"qdisc tbf"* ]]; then
            "${run[@]}" tc qdisc del dev "$dev" root
            changed=1
        fi
        return
    fi
    # tc prints rates like 100Mbit; compare case-insensitively.
    if [[ ${current,,} == *"qdisc tbf"*"rate ${rate,,} "* ]]; then
        return
    fi
    "${run[@]}" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency "$latency"
    changed=1
}
apply node "$iface"
apply host "$host_if"
if ((changed)); then echo changed; else echo unchanged; fi
