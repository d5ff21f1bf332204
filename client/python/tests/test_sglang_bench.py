"""Smoke tests of the SGLang benchmarks (client/python/bench/bench_sglang.py and
bench_sglang_peers.py). The path benchmark: with a few
small calls it starts a daemon, builds SGLang's real host pool and the backend, and prints a row
per call, as a table and as JSON. Timings are not asserted (a benchmark's output, not a test's);
every call's result is (the script fails when a backup, prefetch or hit query comes back short).
Runs in .venv-sglang, like test_sglang_backend.py.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_bench

if os.environ.get("KVCELLAR_REQUIRE_ENGINES") != "1":
    pytest.importorskip("sglang")

SCRIPT = ROOT / "client" / "python" / "bench" / "bench_sglang.py"
SMOKE_ARGS = ["--pages", "8", "--layers", "2", "--iterations", "3", "--warmup", "1",
              "--pool-mib", "128"]
CALLS = ["memcpy", "batch_set_v1", "batch_get_v1", "batch_exists"]


def test_table_has_every_call():
    proc, names = run_bench(SCRIPT, *SMOKE_ARGS)
    assert names == CALLS, proc.stdout


def test_json_rows():
    proc, _ = run_bench(SCRIPT, *SMOKE_ARGS, "--json", "--layout", "layer_first")
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert [r["call"] for r in out["rows"]] == CALLS
    assert out["layout"] == "layer_first" and out["pages"] == 8
    assert all(r["median_us"] > 0 for r in out["rows"])


PEERS = ROOT / "client" / "python" / "bench" / "bench_sglang_peers.py"


def test_peers_bench_finds_every_page_with_every_backend():
    """bench_sglang_peers.py, smoke-sized (2 conversations x 2 rounds of 4 pages, each round
    backed up under the earlier ones): kvcellar, SGLang's file backend and Mooncake's store (its
    master and a standalone client holding the node's segment, over TCP) under SGLang's
    HiCacheController each find every page of every conversation on a second engine and after an
    engine restart, restore the long prompt whole, and every prefetched page equals what was
    written."""
    proc = subprocess.run([sys.executable, str(PEERS), "--clients", "2", "--rounds", "2",
                           "--round-pages", "4",
                           "--restore-tokens", "1024", "--layers", "2", "--pool-mib", "256",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    assert [r["backend"] for r in rows] == ["kvcellar", "file", "mooncake"]
    for r in rows:
        assert r["second_engine_found"] == 1.0 and r["after_restart_found"] == 1.0, r
        assert r["restore_found"] == 1.0 and r["mismatched_pages"] == 0, r
        assert r["backup_pages_per_s"] > 0 and r["restore_16k_s"] > 0, r
