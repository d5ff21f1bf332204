#!/usr/bin/env bash
# The two commands of the README quick start, on a fresh Debian 12 machine:
#   deploy/dev.sh start [kvcellard args...]   install deps, build, run kvcellard on embedded defaults
#   deploy/dev.sh test  [ctest args...]       install deps, build, run every test
# Environment: BUILD_DIR (default build), FUZZ_BUILD_DIR (default build-fuzz: clang-14 with ASan
# and UBSan, the libFuzzer targets of tests/fuzz/README.md and the daemon and engine tool for the
# sanitizer runs of the integration tests), JOBS (default: number of cores),
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
    # 15 minutes on a fresh machine) are made while the two C++ builds below run.
    mkdir -p "$build"
    venv_log=$build/install-venvs.log
    "$root/deploy/install-deps.sh" system
    "$root/deploy/install-deps.sh" venvs >"$venv_log" 2>&1 &
    venv_pid=$!
    trap 'kill "$venv_pid" 2>/dev/null || true' EXIT
    configure_and_build
    # One clang build with ASan and UBSan on everything (build-fuzz/, tests/fuzz/README.md):
    # the libFuzzer targets, which ctest runs for a bounded time each (fuzz.*), and kvcellard and
    # kvcellar-engine-sim, against which the 16-engine stress test runs a second time
    # (tests/integration/test_datapath.py) and tests/integration/test_grpc_fuzz.py sends every
    # RPC. One build serves both: the libraries compile once, and clang compiles them in about
    # half of gcc's time under the sanitizers.
    sanitize=${FUZZ_BUILD_DIR:-$root/build-fuzz}
    CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$sanitize" -G Ninja \
          -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCELLAR_FUZZ=ON -DKVCELLAR_CUDA=OFF \
          -DKVCELLAR_BUILD_TESTS=OFF -DKVCELLAR_BUILD_BENCHMARKS=OFF >/dev/null
    ninja -C "$sanitize" -j "$jobs" kvcellar_fuzz kvcellard kvcellar-engine-sim
    export KVCELLAR_FUZZ_BIN_DIR="$sanitize/bin" KVCELLAR_ASAN_BIN_DIR="$sanitize/bin"
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
    if [[ $rc -ne 0 ]]; then
      # Each failed test's last lines once more, at the end of the log where a CI excerpt that
      # keeps only the tail still shows why every one failed (ctest printed them in full above,
      # in the middle of the others).
      echo "=== failed tests, the end of each one's output (in full above) ==="
      sed -n 's/^[0-9]*:\(.*\)$/\1/p' Testing/Temporary/LastTestsFailed.log 2>/dev/null |
        while read -r name; do
          echo "--- $name"
          awk -v t="$name" '$0 ~ "^[0-9]+/[0-9]+ Test: " && $3 == t {on = 1; next}
                            on && /^<end of output>$/ {exit}
                            on' Testing/Temporary/LastTest.log | tail -n 60
        done
    fi
    exit "$rc"
    ;;
  *)
    echo "usage: deploy/dev.sh start [kvcellard args...] | test [ctest args...]" >&2
    exit 2
    ;;
esac
