"""A kvcellard child process on a temp socket and an ephemeral HTTP port, with its log.

Shared by the integration tests (tests/integration/conftest.py) and the Python package's tests
(client/python/tests); plain Python, no third-party imports, so either interpreter can use it.
"""
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid

BIN_DIR = os.environ.get("KVCELLAR_BIN_DIR", os.path.join(os.path.dirname(__file__), "../../build/bin"))
KVCELLARD = os.path.join(BIN_DIR, "kvcellard")

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


def end_process(proc, timeout=10):
    """SIGTERM, then SIGKILL after `timeout` s; the exit status (None if it had not started)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Daemons:
    """Daemons started under one directory; close() kills those still running (a test's
    fixture teardown)."""

    def __init__(self, root):
        self.root = root
        self.started = []

    def start(self, args=(), env=None, name="kvcellard", wait=True, subdir=None):
        d = self.root if subdir is None else self.root / subdir
        d.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(d, args=args, env=env, name=name)
        self.started.append(daemon)
        return daemon.start(wait=wait)

    def close(self):
        for daemon in self.started:
            if daemon.proc and daemon.proc.poll() is None:
                daemon.proc.kill()
                daemon.proc.wait()


@contextlib.contextmanager
def temp_daemons(prefix):
    """Daemons under a temp folder of their own (``daemons.root``), for a script: at the end
    those still running are killed and the folder is removed."""
    root = tempfile.mkdtemp(prefix=prefix)
    daemons = Daemons(pathlib.Path(root))
    try:
        yield daemons
    finally:
        daemons.close()
        shutil.rmtree(root, ignore_errors=True)


# pytest fixtures for any test folder: a conftest imports them (`from kvcellard_process import
# daemon, daemon_factory`). Imported lazily so the module itself needs no pytest.
try:
    import pytest

    @pytest.fixture
    def daemon_factory(tmp_path):
        daemons = Daemons(tmp_path)
        yield daemons.start
        daemons.close()

    @pytest.fixture
    def daemon(daemon_factory):
        return daemon_factory()

    @pytest.fixture
    def pool_shm_name():
        """A unique pool.shm_name for a daemon whose pool is to survive its restarts; the pool,
        its journal and its label log are removed after the test."""
        name = f"kvc-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        yield name
        for suffix in ("", ".journal", ".labels"):
            try:
                os.unlink(f"/dev/shm/{name}{suffix}")
            except FileNotFoundError:
                pass
except ImportError:  # a script without pytest
    pass
