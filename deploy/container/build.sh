#!/usr/bin/env bash
# Builds kvcellard's container image (deploy/container/Containerfile) from Debian 12 packages
# only: a debootstrap minbase root file system from the machine's Debian registry, the kvcellard
# Debian package installed into it (deploy/package.sh deb; apt pulls its runtime libraries), its
# user made as 65532:2000 (the manifests' runAsUser/runAsGroup), apt's caches dropped; then
# buildah builds the Containerfile over it.
#
#   deploy/container/build.sh [DEB]
#
# DEB: a kvcellard_<version>_amd64.deb to install (default: deploy/package.sh deb builds one).
# Output: the image in buildah's local storage as IMAGE (default
# registry.example.com/kvcellar/kvcellard:<version>, the name the manifests use), and as an OCI
# layout in $BUILD_DIR/packages/kvcellard-image (tag <version>) for `skopeo copy
# oci:build/packages/kvcellard-image:<version> docker://<your registry>/kvcellar/kvcellard:<version>`
# or `podman load`. Needs root (debootstrap, chroot), debootstrap and buildah
# (deploy/install-deps.sh system).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
deb=${1:-}
if [[ -z "$deb" ]]; then
  deb=$("$root/deploy/package.sh" deb | tail -n 1)
fi
deb=$(readlink -f "$deb")
version=$(dpkg-deb -f "$deb" Version)
image=${IMAGE:-registry.example.com/kvcellar/kvcellard:$version}
out=${OUT_DIR:-$build/packages/kvcellard-image}
# The Debian registry apt uses here.
mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources \
         2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d "${TMPDIR:-/tmp}/kvcellard-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
  { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp "$deb" "$rootfs/tmp/kvcellard.deb"
chroot "$rootfs" /bin/sh -e -c '
  export DEBIAN_FRONTEND=noninteractive LC_ALL=C
  # The package keeps an existing kvcellar user: this one has the ids the manifests run as.
  groupadd --gid 2000 kvcellar
  useradd --uid 65532 --gid 2000 --home-dir /nonexistent --no-create-home \
          --shell /usr/sbin/nologin --comment "kvcellar KV-cache daemon" kvcellar
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends /tmp/kvcellard.deb
  apt-get clean
  rm -rf /var/lib/apt/lists/* /tmp/kvcellard.deb /var/log/*.log /var/cache/debconf/*-old
  install -d -o 65532 -g 2000 -m 0750 /run/kvcellar
  install -d -o 65532 -g 2000 -m 0700 /var/lib/kvcellar /var/lib/kvcellar/l3
' >"$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; exit 1; }
rm -f "$rootfs/etc/resolv.conf"
tar --numeric-owner --xattrs -C "$rootfs" -cf "$work/rootfs.tar" .
cp "$root/deploy/container/Containerfile" "$work/Containerfile"

export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
buildah build --isolation chroot --build-arg "VERSION=$version" -f "$work/Containerfile" \
  -t "$image" "$work" >"$work/buildah.log" 2>&1 || { tail -n 30 "$work/buildah.log" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$(dirname "$out")"
buildah push "$image" "oci:$out:$version" >/dev/null 2>&1
# The build steps' intermediate images (the tagged image stays).
buildah rmi --prune >/dev/null 2>&1 || true
echo "$image"
echo "$out:$version"
