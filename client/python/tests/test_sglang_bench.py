"""Smoke test of the SGLang path benchmark (client/python/bench/bench_sglang.py): with a few
small calls it starts a daemon, builds SGLang's real host pool and the backend, and prints a row
per call, as a table and as JSON. Timings are not asserted (a benchmark's output, not a test's);
every call's result is (the script fails when a backup, prefetch or hit query comes back short).
Runs in .venv-sglang, like test_sglang_backend.py.
"""
import json
import os

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
