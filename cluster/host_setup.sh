#!/usr/bin/env bash
# Idempotent host set-up for the local podman cluster (Debian 12+/Ubuntu 24.04+, run as root).
#
#  * installs podman, runc, netavark, aardvark-dns, iptables, debootstrap, iproute2 when missing,
#    fortunes (the demo corpus the controller builds: real English text, offline) and chromium
#    (the headless browser pytest opens the MLflow UI in: tests/test_mlflow_ui.py);
#    iptables because Debian 12's netavark sets up the bridge with it but does not depend on it:
#    without it every container start fails with "netavark: No such file or directory";
#  * writes /etc/containers/containers.conf.d/50-nanochat.conf:
#      runtime = "runc"      crun refuses some kernels' hybrid (v1+v2) cgroup layouts
#      default_ulimits = []  podman otherwise sets RLIMIT_NOFILE, which needs CAP_SYS_RESOURCE
#  * checks podman's network backend is netavark (needed for per-container interface names).
#
# Safe to re-run: every step first checks whether it is already done and says so.
set -euo pipefail

log() { printf 'host_setup: %s\n' "$*"; }

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root (podman runs the node containers as root: --privileged systemd)"
    exit 1
fi

# Debian packages the browser as chromium; Ubuntu as chromium-browser (an apt package that installs the snap)
BROWSER=chromium
grep -qx 'ID=ubuntu' /etc/os-release && BROWSER=chromium-browser
PACKAGES=(podman runc netavark aardvark-dns iptables debootstrap iproute2 fortunes "$BROWSER")
missing=()
for p in "${PACKAGES[@]}"; do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        log "package $p: already installed"
    else
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

CONF_DIR=/etc/containers/containers.conf.d
CONF=$CONF_DIR/50-nanochat.conf
read -r -d '' WANT <<'CONF' || true
# Written by nanochat cluster/host_setup.sh; safe to delete (re-run host_setup.sh to restore).
[containers]
# No default ulimits: setting RLIMIT_NOFILE needs CAP_SYS_RESOURCE, which sandboxes may lack.
default_ulimits = []

[engine]
# crun refuses hybrid cgroup v1/v2 layouts on some kernels; runc handles them.
runtime = "runc"
CONF
mkdir -p "$CONF_DIR"
if [[ -f $CONF ]] && [[ "$(cat "$CONF")" == "$WANT" ]]; then
    log "$CONF: already up to date"
else
    printf '%s\n' "$WANT" >"$CONF"
    log "$CONF: written"
fi

ver=$(podman version --format '{{.Client.Version}}')
major=${ver%%.*}
if ((major < 4)); then
    log "podman $ver is too old: need >= 4.0 (netavark, interface_name). Debian 12 / Ubuntu 24.04 have it."
    exit 1
fi
backend=$(podman info --format '{{.Host.NetworkBackend}}')
runtime=$(podman info --format '{{.Host.OCIRuntime.Name}}')
log "podman $ver, OCI runtime $runtime, network backend $backend"
if [[ $runtime != runc ]]; then
    log "OCI runtime is $runtime, expected runc (another containers.conf overrides $CONF?)"
    exit 1
fi
if [[ $backend != netavark ]]; then
    log "network backend is $backend: the local cluster needs netavark (interface_name)."
    log "podman picks CNI while CNI networks exist; to switch: remove them (or 'podman system reset'),"
    log "or add network_backend = \"netavark\" under [network] in $CONF."
    exit 1
fi
log "done"
