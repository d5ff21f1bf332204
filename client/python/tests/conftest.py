"""Fixtures of the kvcellar package's tests: real kvcellard processes (the repository's build)
on temp sockets, through the integration tests' harness (tests/integration/kvcellard_process.py).

Runs under the Python that has the package's test dependencies (torch, transformers, numpy,
pytest): the project's virtual environment, made by deploy/install-deps.sh.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "client" / "python"))

from kvcellard_process import (BIN_DIR, Daemons, daemon, daemon_factory,  # noqa: E402,F401
                               pool_shm_name)

GOLDEN_KEYS = ROOT / "tests" / "data" / "keys_golden.json"


def bin_path(name: str) -> str:
    return os.path.join(BIN_DIR, name)


def run_bench(script, *args: str, timeout: int = 300):
    """Runs a benchmark script (client/python/bench/) under this interpreter; returns the
    completed process and the names in the first column of its Markdown table."""
    import subprocess

    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [line.split("|")[1].strip() for line in rows[1:]] if rows else []
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if rows:
        assert rows[0].startswith("| call |"), proc.stdout
    return proc, names
