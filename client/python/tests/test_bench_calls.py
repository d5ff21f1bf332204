"""Smoke test of the per-call benchmark (client/python/bench/bench_calls.py): with very few
iterations it starts a daemon, runs both sides (the C++ kvcellar_bench_pyclient and the package)
and prints a row for every call, as a table and as JSON. Timings are not asserted: they are a
benchmark's output, not a test's, and this machine is shared.

Skipped only when kvcellar_bench_pyclient has not been built (KVCELLAR_BIN_DIR, else build/bin).
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, bin_path, run_bench

SCRIPT = ROOT / "client" / "python" / "bench" / "bench_calls.py"
CXX_BENCH = bin_path("kvcellar_bench_pyclient")
CALLS = ["match_keys", "match_tokens", "load", "load_submit", "backup", "backup_submit"]
# Tiny: two timed calls per case; the smallest pool that holds both sides' pinned prompts and a
# Backup batch (each page takes a 64 KiB slot: 128 MiB per 2048-page batch).
SMOKE_ARGS = ["--iterations", "2", "--warmup", "1", "--rounds", "1", "--pool-mib", "512"]

pytestmark = pytest.mark.skipif(not os.access(CXX_BENCH, os.X_OK),
                                reason=f"{CXX_BENCH} not built")


def run_script(*extra: str):
    return run_bench(SCRIPT, *SMOKE_ARGS, *extra, timeout=120)


def test_table_has_every_call():
    proc, names = run_script()
    assert names == CALLS, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for line in rows[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 8 and cells[-1] in ("yes", "NO"), line


def test_json_has_every_call():
    proc, _ = run_script("--json")
    doc = json.loads(proc.stdout)
    assert [r["call"] for r in doc["rows"]] == CALLS
    for r in doc["rows"]:
        assert r["cxx_p50_us"] > 0 and r["py_p50_us"] > 0
        assert len(r["rounds"]) == 1 and isinstance(r["meets_goal"], bool)


SESSIONS = ROOT / "client" / "python" / "bench" / "bench_sessions.py"


def test_sessions_bench_registers_them_all():
    """bench_sessions.py, smoke-sized: every session becomes active, and the table has both
    phases."""
    proc = subprocess.run([sys.executable, str(SESSIONS), "--sessions", "50", "--calls", "20"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "50 sessions (0 not active)" in proc.stdout, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "50"], proc.stdout
