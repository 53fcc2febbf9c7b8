#!/usr/bin/env bash
# Build the local cluster's node image: a Debian bookworm rootfs made with debootstrap, booting
# systemd, imported into podman as localhost/nanochat-node:<recipe-hash> and tagged :latest.
#
# The recipe hash is the sha256 of this script and cluster/node-image.packages; when an image with
# that tag exists the build is skipped (the image is the cache). Downloaded .debs are cached under
# build/node-image/debs so a rebuild after a recipe change does not fetch them again.
#
# usage: cluster/build_node_image.sh [--force]
# env:   MIRROR (default http://deb.debian.org/debian), SUITE is fixed to bookworm (python 3.11).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PKG_FILE=$HERE/node-image.packages
IMAGE=localhost/nanochat-node
SUITE=bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WORK=$ROOT/build/node-image
FORCE=0
[[ ${1:-} == --force ]] && FORCE=1

log() { printf '[%s] build_node_image: %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root (debootstrap, podman import for the root podman store)"
    exit 1
fi
for tool in debootstrap podman sha256sum; do
    command -v "$tool" >/dev/null || { log "$tool not found: run cluster/host_setup.sh first"; exit 1; }
done

HASH=$(cat "${BASH_SOURCE[0]}" "$PKG_FILE" | sha256sum | cut -c1-12)
TAG=$IMAGE:$HASH
PACKAGES=$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$PKG_FILE" | tr -d ' \t' | paste -sd, -)

if ((FORCE == 0)) && podman image exists "$TAG"; then
    log "$TAG exists: nothing to build"
    podman tag "$TAG" "$IMAGE:latest"
    log "tagged $IMAGE:latest -> $TAG"
    exit 0
fi

START=$SECONDS
mkdir -p "$WORK/debs"
ROOTFS=$WORK/rootfs-$HASH
TARBALL=$WORK/rootfs-$HASH.tar
rm -rf "$ROOTFS"
cleanup() { rm -rf "$ROOTFS"; }
trap cleanup EXIT

log "recipe $HASH: debootstrap $SUITE (minbase) from $MIRROR"
log "packages: $PACKAGES"
debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$WORK/debs" \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
    tail -30 "$WORK/debootstrap.log"
    log "debootstrap failed; full log in $WORK/debootstrap.log"
    exit 1
}
log "debootstrap done ($((SECONDS - START)) s)"

log "configuring the rootfs for systemd in a container"
# A fresh machine-id per container: systemd generates a transient one at boot when it is empty.
: >"$ROOTFS/etc/machine-id"
rm -f "$ROOTFS/var/lib/dbus/machine-id"
# Units that have nothing to do, or fail, in a container and would leave the system 'degraded'.
for unit in \
    systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
    systemd-udev-trigger.service systemd-udev-settle.service \
    systemd-modules-load.service systemd-remount-fs.service \
    sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount sys-fs-fuse-connections.mount \
    getty.target console-getty.service getty@tty1.service serial-getty@.service \
    apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer; do
    ln -sf /dev/null "$ROOTFS/etc/systemd/system/$unit"
done
# Keep later installs as small as this image: no docs, man pages or foreign locales.
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/01-nanochat-nodoc" <<'CFG'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/usr/share/lintian/*
CFG
echo 'APT::Install-Recommends "false";' >"$ROOTFS/etc/apt/apt.conf.d/01-nanochat-norecommends"
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/lintian/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
    "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/var/lib/dpkg/*-old "$ROOTFS"/tmp/* "$ROOTFS"/root/.cache
# Podman manages these per container.
: >"$ROOTFS/etc/hostname"
rm -f "$ROOTFS/etc/resolv.conf"
echo "$HASH" >"$ROOTFS/etc/nanochat-node-image"
log "rootfs size: $(du -sh "$ROOTFS" | cut -f1)"

log "packing and importing as $TAG"
tar --numeric-owner --xattrs --acls -C "$ROOTFS" -cf "$TARBALL" .
podman import \
    --change 'CMD ["/sbin/init"]' \
    --change 'STOPSIGNAL SIGRTMIN+3' \
    --change 'ENV container=podman' \
    --change "LABEL org.nanochat.recipe=$HASH" \
    --message "nanochat node image, recipe $HASH" \
    "$TARBALL" "$TAG" >/dev/null
rm -f "$TARBALL"
podman tag "$TAG" "$IMAGE:latest"
# Drop older recipes of this image that no container uses.
for old in $(podman images --format '{{.Repository}}:{{.Tag}}' "$IMAGE" | grep -v -e ":$HASH\$" -e ':latest$' || true); do
    podman rmi "$old" >/dev/null 2>&1 && log "removed old image $old" || true
done
log "built $TAG (+ :latest), $(podman image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec) in $((SECONDS - START)) s"
