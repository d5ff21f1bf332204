#!/usr/bin/env bash
# The two commands of the README quick start, on a fresh Debian 12 machine:
#   deploy/dev.sh start [kvcellard args...]   install deps, build, run kvcellard on embedded defaults
#   deploy/dev.sh test  [ctest args...]       install deps, build, run every test
# Environment: BUILD_DIR (default build), ASAN_BUILD_DIR (default build-asan-tools: the daemon
# and engine tool under ASan+UBSan for the stress test), FUZZ_BUILD_DIR (default build-fuzz: the
# libFuzzer targets, clang-14; tests/fuzz/README.md), JOBS (default: number of cores),
# KVCELLAR_CUDA (AUTO|ON|OFF, default AUTO: the CUDA sources compile whenever nvcc is present).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${JOBS:-$(nproc)}
cmd=${1:-}
[[ $# -gt 0 ]] && shift

configure_and_build() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DKVCELLAR_CUDA="${KVCELLAR_CUDA:-AUTO}" >/dev/null
  ninja -C "$build" -j "$jobs" "$@"
}

case "$cmd" in
  start)
    "$root/deploy/install-deps.sh" system
    configure_and_build kvcellard kvcellarctl
    exec "$build/bin/kvcellard" "$@"
    ;;
  test)
    # The tests' Python venvs (deploy/install-deps.sh venvs: downloads and unpacking, about
    # 15 minutes on a fresh machine) are made while the three C++ builds below run.
    mkdir -p "$build"
    venv_log=$build/install-venvs.log
    "$root/deploy/install-deps.sh" system
    "$root/deploy/install-deps.sh" venvs >"$venv_log" 2>&1 &
    venv_pid=$!
    trap 'kill "$venv_pid" 2>/dev/null || true' EXIT
    configure_and_build
    # The 16-engine stress test runs a second time against kvcellard and kvcellar-engine-sim
    # built with AddressSanitizer and UBSan (tests/integration/test_datapath.py).
    asan=${ASAN_BUILD_DIR:-$root/build-asan-tools}
    cmake -S "$root" -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
          -DKVCELLAR_SANITIZE=ON -DKVCELLAR_CUDA=OFF -DKVCELLAR_BUILD_BENCHMARKS=OFF >/dev/null
    ninja -C "$asan" -j "$jobs" kvcellard kvcellar-engine-sim
    export KVCELLAR_ASAN_BIN_DIR="$asan/bin"
    # The fuzz targets (tests/fuzz): clang with libFuzzer, ASan and UBSan; ctest runs each for a
    # bounded time (fuzz.*), and tests/integration/test_grpc_fuzz.py drives the ASan daemon.
    fuzz=${FUZZ_BUILD_DIR:-$root/build-fuzz}
    CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$fuzz" -G Ninja \
          -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCELLAR_FUZZ=ON -DKVCELLAR_CUDA=OFF \
          -DKVCELLAR_BUILD_TESTS=OFF -DKVCELLAR_BUILD_BENCHMARKS=OFF >/dev/null
    ninja -C "$fuzz" -j "$jobs" kvcellar_fuzz
    export KVCELLAR_FUZZ_BIN_DIR="$fuzz/bin"
    wait "$venv_pid" && venv_rc=0 || venv_rc=$?
    trap - EXIT
    cat "$venv_log"
    if [[ $venv_rc -ne 0 ]]; then
      echo "dev.sh: making the Python venvs failed (exit $venv_rc; log above)" >&2
      exit "$venv_rc"
    fi
    cd "$build"
    rm -f soak-summary.txt
    ctest --output-on-failure -j "$jobs" "$@" && rc=0 || rc=$?
    # The soak's one-line summary (tests/integration/test_soak.py), which ctest shows only on
    # failure.
    cat soak-summary.txt 2>/dev/null || true
    exit "$rc"
    ;;
  *)
    echo "usage: deploy/dev.sh start [kvcellard args...] | test [ctest args...]" >&2
    exit 2
    ;;
esac
