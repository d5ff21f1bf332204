"""Smoke test of client/python/bench/bench_frameworks.py: at small sizes it starts a kvcellard,
drives every framework adapter (UCM's store, AIBrix's manager in both modes, LMCache's MP L2
adapter and in-process connector) and kvcellard's direct path, and prints a row per adapter and
direction, as a table and as JSON. Timings are not asserted (a benchmark's output, not a
test's); every load's bytes are (the script fails on a wrong byte). Runs in .venv-frameworks,
like test_ucm.py, test_aibrix.py and test_lmcache*.py.
"""
import json

from conftest import ROOT, run_bench
from framework_util import require

for _module in ("ucm", "aibrix_kvcache", "lmcache"):
    require(_module)

SCRIPT = ROOT / "client" / "python" / "bench" / "bench_frameworks.py"
SMOKE_ARGS = ["--objects", "8", "--object-kib", "16", "--repeats", "2"]
CALLS = [f"{pair} {op}" for pair in ("ucm", "aibrix zc", "aibrix copy", "lmcache mp",
                                     "lmcache inproc") for op in ("store", "load")]


def test_table_has_every_framework_verified():
    proc, names = run_bench(SCRIPT, *SMOKE_ARGS, timeout=120)
    assert names == CALLS, proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    for cells in rows[2:]:  # after the header and its rule
        assert cells[-1].strip() == "3/3", cells  # the warm-up's load and both timed ones


def test_json_rows_and_one_framework():
    proc, _ = run_bench(SCRIPT, *SMOKE_ARGS, "--frameworks", "lmcache", "--json", timeout=120)
    out = json.loads(proc.stdout[proc.stdout.index('{\n "objects"'):])
    assert [r["call"] for r in out["rows"]] == CALLS[6:]
    for r in out["rows"]:
        assert r["verified_loads"] == 3 and r["objects"] == 8, r
        assert r["object_bytes"] == 16 << 10, r
        assert r["adapter_gbps"] > 0 and r["direct_gbps"] > 0, r
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"], r


def test_unknown_framework_is_refused():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(SCRIPT), "--frameworks", "ucm,vllm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--frameworks: unknown ['vllm']" in proc.stderr
