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

_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_log_line(line):
    """Parses one key=value log line into a dict (quoted values unescaped)."""
    out = {}
    for key, value in _FIELD.findall(line):
        if value.startswith('"'):
            value = bytes(value[1:-1], "utf-8").decode("unicode_escape")
        out[key] = value
    return out


class Daemon:
    """A kvcellard child process. Its stderr log is collected line by line."""

    def __init__(self, tmp_path, args=(), env=None, name="kvcellard"):
        self.dir = tmp_path
        self.socket = str(tmp_path / f"{name}.sock")
        self.admin_socket = str(tmp_path / f"{name}-admin.sock")
        self.args = [
            KVCELLARD,
            "--set", f"listen.unix_socket={self.socket}",
            "--set", f"listen.admin_socket={self.admin_socket}",
            "--set", "http.address=127.0.0.1:0",
            "--set", "pool.capacity=64MiB",
            *args,
        ]
        self.env = dict(os.environ, **(env or {}))
        self.lines = []
        self.ready = None
        self.proc = None
        self._eof = False
        self._cv = threading.Condition()

    def start(self, wait=True, timeout=30):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=self.env, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        if wait:
            self.wait_ready(timeout)
        return self

    def _pump(self):
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                fields = parse_log_line(line)
                if fields.get("msg") == "ready":
                    self.ready = fields
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def wait_ready(self, timeout=30):
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.ready is None:
                if self._eof:
                    raise AssertionError("kvcellard exited before ready:\n" + self.log())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("kvcellard not ready in time:\n" + self.log())
                self._cv.wait(min(left, 0.2))
        return self.ready

    def wait_for_line(self, pattern, timeout=10):
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        with self._cv:
            while True:
                for line in self.lines:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no log line matching {pattern!r}:\n" + self.log())
                self._cv.wait(min(left, 0.2))

    @property
    def http(self):
        return self.ready["http"]

    def log(self):
        with self._cv:
            return "\n".join(self.lines)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("kvcellard did not exit in time:\n" + self.log())


@pytest.fixture
def daemon_factory(tmp_path):
    started = []

    def make(args=(), env=None, name="kvcellard", wait=True, subdir=None):
        d = tmp_path if subdir is None else tmp_path / subdir
        d.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(d, args=args, env=env, name=name)
        started.append(daemon)
        return daemon.start(wait=wait)

    yield make
    for daemon in started:
        if daemon.proc and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


def run(cmd, timeout=60, check=False, **kw):
    """Runs a command, returning CompletedProcess with text output."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res
