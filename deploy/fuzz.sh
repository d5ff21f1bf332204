#!/usr/bin/env bash
# Runs the libFuzzer targets (tests/fuzz/README.md).
#   deploy/fuzz.sh [TARGET|all] [SECONDS]    build build-fuzz (clang-14) if needed, then fuzz each
#                                            target for SECONDS (default 600) of wall time
#   deploy/fuzz.sh --merge [TARGET|all] [SECONDS]
#                                            the same, then merge what the run found into the
#                                            tree's corpus (minimized: -merge=1; inputs up to
#                                            FUZZ_MERGE_MAX_BYTES, default 1024)
#   deploy/fuzz.sh --ci TARGET SECONDS       ctest's entry (tests/CMakeLists.txt): uses the built
#                                            targets in $KVCELLAR_FUZZ_BIN_DIR, exits 77 (skipped)
#                                            when it is not set
# Every run starts from the tree's corpus (tests/fuzz/corpus/TARGET), copied: the tree changes only
# with --merge. What a run finds stays in $FUZZ_WORK_DIR/TARGET (default build-fuzz/fuzz-work):
# corpus/, and run-<start>-crash-* (or leak-, oom-, timeout-) for an input that failed. Each run prints libFuzzer's final
# stats (executions, peak RSS) and one summary line:
#   fuzz TARGET: SECONDS s, CPU_SECONDS CPU s, EXECS execs, CORPUS inputs, CRASHES crashes
# Environment: BUILD_FUZZ_DIR (default build-fuzz), JOBS, KVCELLAR_FUZZ_BIN_DIR (skip the build).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=run
case "${1:-}" in
  --merge) mode=merge; shift ;;
  --ci) mode=ci; shift ;;
esac
target=${1:-all}
seconds=${2:-600}

# The targets: tests/fuzz/<name>_fuzz.cc is bin/fuzz_<name>.
all_targets() {
  for f in "$root"/tests/fuzz/*_fuzz.cc; do basename "$f" _fuzz.cc; done
}

if [[ $mode == ci ]]; then
  if [[ -z ${KVCELLAR_FUZZ_BIN_DIR:-} ]]; then
    echo "fuzz: KVCELLAR_FUZZ_BIN_DIR not set (deploy/dev.sh test builds the fuzz targets); skipped"
    exit 77
  fi
  bin=$KVCELLAR_FUZZ_BIN_DIR
  work=$(mktemp -d "${TMPDIR:-/tmp}/kvcellar-fuzz-XXXXXX")
  trap 'rm -rf "$work"' EXIT
elif [[ -n ${KVCELLAR_FUZZ_BIN_DIR:-} ]]; then
  bin=$KVCELLAR_FUZZ_BIN_DIR
  work=${FUZZ_WORK_DIR:-$root/build-fuzz/fuzz-work}
else
  build=${BUILD_FUZZ_DIR:-$root/build-fuzz}
  CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVCELLAR_FUZZ=ON -DKVCELLAR_CUDA=OFF -DKVCELLAR_BUILD_TESTS=OFF \
    -DKVCELLAR_BUILD_BENCHMARKS=OFF >/dev/null
  ninja -C "$build" -j "${JOBS:-$(nproc)}" kvcellar_fuzz
  bin=$build/bin
  work=${FUZZ_WORK_DIR:-$build/fuzz-work}
fi

targets=$target
[[ $target == all ]] && targets=$(all_targets)

failed=0
for t in $targets; do
  exe=$bin/fuzz_$t
  seeds=$root/tests/fuzz/corpus/$t
  [[ -x $exe ]] || { echo "fuzz: no $exe" >&2; exit 2; }
  out=$work/$t
  mkdir -p "$out/corpus"
  log=$out/fuzz.log
  # New inputs go to the first directory (the work copy); the tree's seeds are read only.
  # A hard kill past the time limit: a run stuck in an out-of-memory report must not hang CI.
  # ASan's leak check stays on: a leak is a finding like any other.
  status=0
  start=$(date +%s)
  /usr/bin/time -f "%U %S" -o "$out/cpu" timeout -s KILL $((seconds + 120)) \
    nice -n 10 "$exe" -max_total_time="$seconds" -print_final_stats=1 -timeout=25 \
    -rss_limit_mb=2048 -malloc_limit_mb=1024 -artifact_prefix="$out/run-$start-" \
    "$out/corpus" "$seeds" >"$log" 2>&1 || status=$?
  wall=$(( $(date +%s) - start ))
  cpu=$(awk '/^[0-9.]+ [0-9.]+$/ {printf "%.0f", $1 + $2}' "$out/cpu" 2>/dev/null || echo "?")
  execs=$(awk '/stat::number_of_executed_units:/ {print $2}' "$log")
  corpus=$(find "$out/corpus" "$seeds" -type f | wc -l)
  crashes=$(ls "$out" | grep -cE "^run-$start-(crash|leak|oom|timeout)-" || true)
  grep '^stat::' "$log" || true
  echo "fuzz $t: $wall s, $cpu CPU s, ${execs:-?} execs, $corpus inputs, $crashes crashes"
  if [[ $status -ne 0 || $crashes -ne 0 ]]; then
    failed=1
    echo "fuzz $t: FAILED (exit $status); the end of $log:" >&2
    grep -v -E '^#[0-9]+' "$log" | tail -60 >&2
  elif [[ $mode == merge ]]; then
    # Minimized: only inputs that add coverage over what the tree's corpus already has, and of
    # those only small ones (FUZZ_MERGE_MAX_BYTES, default 1024): the tree keeps a small corpus.
    small=$out/merge-candidates
    rm -rf "$small" && mkdir -p "$small"
    find "$out/corpus" -type f -size -"$(( ${FUZZ_MERGE_MAX_BYTES:-1024} + 1 ))"c \
      -exec cp -t "$small" {} +
    "$exe" -merge=1 -rss_limit_mb=2048 "$seeds" "$small" >"$out/merge.log" 2>&1
    echo "fuzz $t: tree corpus now $(find "$seeds" -type f | wc -l) inputs," \
         "$(du -sk "$seeds" | cut -f1) KiB"
  fi
done
exit $failed
