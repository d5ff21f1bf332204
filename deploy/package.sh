#!/usr/bin/env bash
# Packages of kvcellar, built from this tree:
#   deploy/package.sh deb     build/packages/kvcellard_<version>_amd64.deb: the daemon, kvcellarctl,
#                             the systemd unit, the default config, the kvcellar user
#                             (deploy/debian/package.cmake). Install with
#                             `apt install ./kvcellard_<version>_amd64.deb`.
# Environment: BUILD_DIR (default build), JOBS (default: number of cores), KVCELLAR_CUDA (AUTO|ON|
# OFF, default AUTO). Needs the build dependencies (deploy/install-deps.sh system) and dpkg-dev.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${JOBS:-$(nproc)}

case "${1:-}" in
  deb)
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DKVCELLAR_CUDA="${KVCELLAR_CUDA:-AUTO}" >/dev/null
    ninja -C "$build" -j "$jobs" kvcellard kvcellarctl
    cpack -G DEB --config "$build/CPackConfig.cmake" -B "$build/packages" >/dev/null
    ls "$build"/packages/kvcellard_*_amd64.deb
    ;;
  *)
    echo "usage: deploy/package.sh deb" >&2
    exit 2
    ;;
esac
