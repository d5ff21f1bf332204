#!/usr/bin/env bash
# Makes an upgrade fixture (tests/integration/test_upgrade.py, docs/versions.md): what a daemon of
# some version leaves behind after a SIGTERM, for the next versions to take over.
#
#   tests/data/upgrade/make_fixture.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds that version's kvcellard and kvcellar-engine-sim. The daemon runs with a named
# pool (pool.shm_name, 64 MiB) and a file tier written through; an engine backs up PAGES pages
# (seed, tokens seed and geometry below, which the test uses to verify every byte); the daemon
# is stopped with SIGTERM (it seals every L2 page). OUT_DIR gets:
#   pool.xz, journal.xz   the pool's and the slot journal's shm objects, xz-compressed
#   l3.tar.xz             the file tier's directory
#   fixture.json          the version, its commit, the daemon's settings and the engine's
set -euo pipefail

bin=$(readlink -f "$1")
out=$2
mkdir -p "$out"
out=$(readlink -f "$out")
work=$(mktemp -d "${TMPDIR:-/tmp}/kvc-fixture.XXXXXX")
shm=kvc-fixture-$$
cleanup() {
  [[ -n "${pid:-}" ]] && kill -9 "$pid" 2>/dev/null || true
  rm -f "/dev/shm/$shm" "/dev/shm/$shm.journal"
  rm -rf "$work"
}
trap cleanup EXIT

settings=(--set device.kind=sim --set "pool.shm_name=$shm" --set pool.capacity=64MiB
          --set "storage.tiers=file:$work/l3?name=nvme" --set storage.write_policy=write_through)
"$bin/kvcellard" "${settings[@]}" --set "listen.unix_socket=$work/d.sock" \
  --set "listen.admin_socket=$work/a.sock" --set http.address=127.0.0.1:0 >"$work/daemon.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  grep -q 'msg=ready' "$work/daemon.log" && break
  sleep 0.1
done
grep -q 'msg=ready' "$work/daemon.log" || { cat "$work/daemon.log" >&2; exit 1; }

geometry=(--layers 2 --block-bytes 4096 --blocks 16 --page-size 16 --model upgrade-model)
"$bin/kvcellar-engine-sim" --addr "$work/d.sock" --instance fixture-writer --seed 7 \
  --tokens-seed 8 --pages 8 "${geometry[@]}" backup >"$work/engine.json"
# Every page in the file tier too (written through, asynchronously).
for _ in $(seq 100); do
  [[ $(find "$work/l3" -type f -not -name '*.tmp*' | wc -l) -ge 8 ]] && break
  sleep 0.1
done
kill -TERM "$pid"
wait "$pid" || true
pid=

version=$("$bin/kvcellard" --version 2>/dev/null | awk '{print $2}' || true)
commit=$("$bin/kvcellard" --version 2>/dev/null | sed -n 's/.*commit \([0-9a-f]*\).*/\1/p' || true)
xz -9 -c "/dev/shm/$shm" >"$out/pool.xz"
xz -9 -c "/dev/shm/$shm.journal" >"$out/journal.xz"
tar --numeric-owner -C "$work" -cJf "$out/l3.tar.xz" l3
cat >"$out/fixture.json" <<JSON
{
  "version": "${FIXTURE_VERSION:-$version}",
  "commit": "${FIXTURE_COMMIT:-$commit}",
  "daemon": {"pool.capacity": "64MiB", "storage.tiers": "file:<dir>/l3?name=nvme",
             "storage.write_policy": "write_through", "device.kind": "sim"},
  "engine": {"seed": 7, "tokens_seed": 8, "pages": 8, "layers": 2, "block_bytes": 4096,
             "blocks": 16, "page_size": 16, "model": "upgrade-model"},
  "l3_objects": $(find "$work/l3" -type f | wc -l)
}
JSON
ls -la "$out"
