"""Shared harness for integration tests: real kvcellard processes on temp sockets and ports.

Runs under Debian's /usr/bin/python3 (python3-grpcio, python3-pytest). Stubs for kvcellar.v1,
grpc.health.v1 and grpc.reflection are generated at build time into $KVCELLAR_PY_DIR.
"""
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

BIN_DIR = os.environ.get("KVCELLAR_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
PY_DIR = os.environ.get("KVCELLAR_PY_DIR", os.path.join(BIN_DIR, "../python"))
SOURCE_DIR = os.environ.get("KVCELLAR_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "../.."))
sys.path.insert(0, PY_DIR)

KVCELLARD = os.path.join(BIN_DIR, "kvcellard")
KVCELLARCTL = os.path.join(BIN_DIR, "kvcellarctl")

from kvcellard_process import (Daemon, Daemons, daemon, daemon_factory,  # noqa: E402,F401
                               parse_log_line, pool_shm_name)


def run(cmd, timeout=60, check=False, **kw):
    """Runs a command, returning CompletedProcess with text output."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res
