#!/usr/bin/env bash
# Every traffic shape of core/eviction_shapes.h through a real kvcellard, once per eviction policy,
# a fresh daemon per run: kvcellar-bench --shape replays the trace (every loaded byte verified)
# and gives Belady's bound at the run's L2 pages. Prints one line per run and exits non-zero if a
# run failed or loaded a wrong byte. The README's "Eviction against the optimum" table.
#
#   tests/bench/eviction/daemon_shapes.sh [BIN_DIR] [POLICY...]   (default: build/bin, s3fifo adaptive)
#
# Page objects of 64 KiB (--layers 1 at the shapes' 128-token pages) in 4 MiB regions, so that
# pool.capacity sets L2 to within 64 pages of each shape's size. About 15 s per policy.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
bin=${1:-$root/build/bin}
[[ $# -gt 0 ]] && shift
if [[ $# -gt 0 ]]; then policies=("$@"); else policies=(s3fifo adaptive); fi
work=$(mktemp -d)
daemon=
cleanup() {
  [[ -n $daemon ]] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
# shape and the pool capacity that gives it its L2 size (core/eviction_shapes.cc)
shapes=("multi_turn 512MiB" "multi_turn_2 400MiB" "zipf_prompts 68MiB" "chat_and_scans 256MiB"
        "two_tenants 124MiB")
rc=0
printf '%-15s %-9s %9s %8s %8s %8s %6s\n' shape policy l2_pages best bound measured ratio
for entry in "${shapes[@]}"; do
  read -r shape capacity <<<"$entry"
  for policy in "${policies[@]}"; do
    dir=$work/$shape-$policy
    mkdir -p "$dir"
    "$bin/kvcellard" --set "listen.unix_socket=$dir/d.sock" --set "listen.admin_socket=$dir/a.sock" \
      --set http.address=127.0.0.1:0 --set device.kind=sim --set "pool.capacity=$capacity" \
      --set pool.region_size=4MiB --set "eviction.policy=$policy" 2>"$dir/daemon.log" &
    daemon=$!
    for _ in $(seq 100); do [[ -S $dir/d.sock ]] && break; sleep 0.1; done
    if ! "$bin/kvcellar-bench" --socket "$dir/d.sock" --shape "$shape" --layers 1 --no-progress \
        --json "$dir/out.json" >"$dir/out.txt" 2>&1; then
      echo "$shape $policy: kvcellar-bench failed:" >&2
      tail -5 "$dir/out.txt" "$dir/daemon.log" >&2
      rc=1
    else
      python3 - "$dir/out.json" "$shape" "$policy" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
h = r["hit_rate"]
print("%-15s %-9s %9d %8.3f %8.3f %8.3f %6.2f" % (sys.argv[2], sys.argv[3], h["l2_pages"],
      h["best_case"], h["bound"], h["measured"], h["measured"] / h["bound"]))
sys.exit(1 if r["verification"]["mismatched_bytes"] else 0)
PY
    fi
    kill "$daemon"
    wait "$daemon" 2>/dev/null || true
    daemon=
  done
done
exit $rc
