"""Drives kvcellar-engine-sim processes (client/tools/kvcellar_engine_sim.cc) and the daemon's
admin API for the data-path integration tests.

An engine command prints one JSON object on stdout; exit codes: 0 ok, 1 wrong bytes loaded,
2 usage, 3 setup failed, 4 the cache did less than asked.
"""
import glob
import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest

from conftest import BIN_DIR

from kvcellar.v1 import admin_service_pb2, admin_service_pb2_grpc
from kvcellar.v1 import cache_service_pb2, cache_service_pb2_grpc

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_SETUP, EXIT_EXPECTATION = 0, 1, 2, 3, 4

# Daemon settings for data-path tests: the sim device, and a short session lease so that a
# killed engine's pins go within a test's patience; pins themselves outlive the tests.
DAEMON_ARGS = (
    "--set", "device.kind=sim",
    "--set", "sessions.lease_ms=1000",
    "--set", "sessions.pin_lease_ms=60000",
)


def engine_binary(bin_dir=None):
    return os.path.join(bin_dir or BIN_DIR, "kvcellar-engine-sim")


class EngineResult:
    def __init__(self, cmd, rc, out, err):
        self.cmd, self.rc, self.out, self.err = cmd, rc, out, err
        self.json = None
        for line in reversed(out.strip().splitlines()):
            try:
                self.json = json.loads(line)
                break
            except ValueError:
                continue

    def __getitem__(self, key):
        assert self.json is not None, f"no JSON from {' '.join(self.cmd)}:\n{self.out}\n{self.err}"
        return self.json[key]

    def describe(self):
        return f"{' '.join(self.cmd)} -> rc {self.rc}\nstdout: {self.out}\nstderr: {self.err[-4000:]}"


def engine_args(sock, command, bin_dir=None, **flags):
    """The argv for one engine command. Flags: instance, rank, tp, layout, layers, block_bytes,
    blocks, page_size, model, and the command's own (seed, tokens_seed, pages, first_block, ...);
    True means a bare boolean flag."""
    args = [engine_binary(bin_dir), "--addr", sock]
    for key, value in flags.items():
        if value is None or value is False:
            continue
        name = "--" + key.replace("_", "-")
        args += [name] if value is True else [name, str(value)]
    args.append(command)
    return args


_U64 = (1 << 64) - 1
VOCAB = 128000  # kvcellar-engine-sim's kVocab


def _splitmix64(x):
    """core/splitmix.h."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def engine_tokens(tokens_seed, n, doc=0):
    """The first n tokens of document `doc` of --tokens-seed (kvcellar-engine-sim's Tokens)."""
    base = _splitmix64(_splitmix64(tokens_seed) ^ doc)
    return [_splitmix64((base + i) & _U64) % VOCAB for i in range(n)]


def run_engine(sock, command, timeout=60, bin_dir=None, **flags):
    cmd = engine_args(sock, command, bin_dir=bin_dir, **flags)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return EngineResult(cmd, p.returncode, p.stdout, p.stderr)


SHM_PREFIX = f"kvc-it-{os.getpid()}"


def remove_engine_shm(pid):
    """Unlinks the sim shm objects of a dead engine started with --shm-prefix SHM_PREFIX (a
    SIGKILLed process cannot)."""
    for name in glob.glob(f"/dev/shm/{SHM_PREFIX}-{pid}-*"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass


class EngineProcess:
    """A background engine (random, hold): start(), then finish() or kill()."""

    def __init__(self, sock, command, bin_dir=None, **flags):
        flags.setdefault("shm_prefix", SHM_PREFIX)
        self.cmd = engine_args(sock, command, bin_dir=bin_dir, **flags)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def first_line(self, timeout=30):
        """The first stdout line as JSON (hold prints it before sleeping)."""
        line = self.proc.stdout.readline()  # hold flushes its line before it sleeps
        if not line:
            self.proc.wait(timeout=timeout)
            raise AssertionError(f"engine printed nothing (rc {self.proc.returncode}):\n"
                                 + self.proc.stderr.read())
        return json.loads(line)

    def finish(self, timeout=120):
        out, err = self.proc.communicate(timeout=timeout)
        return EngineResult(self.cmd, self.proc.returncode, out, err)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=30)
        remove_engine_shm(self.proc.pid)


def metrics(daemon):
    """The daemon's /metrics as {(name, frozenset(labels.items())): value}."""
    with urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$', line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(daemon, name, **labels):
    """Sum of the series of `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics(daemon).items() if n == name and want <= set(ls))


def optional_admin(call):
    """call() or None when the daemon answers UNIMPLEMENTED (an admin RPC not built yet)."""
    try:
        return call()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


def admin(daemon):
    return admin_service_pb2_grpc.AdminServiceStub(grpc.insecure_channel(f"unix:{daemon.admin_socket}"))


def status(daemon):
    return admin(daemon).GetStatus(admin_service_pb2.GetStatusRequest(), timeout=5)


def engines(daemon):
    return admin(daemon).ListEngines(admin_service_pb2.ListEnginesRequest(), timeout=5).sessions


def namespaces(daemon):
    return admin(daemon).ListNamespaces(admin_service_pb2.ListNamespacesRequest(), timeout=5).namespaces


def evict_l2(daemon, dry_run=False):
    req = admin_service_pb2.EvictRequest(tiers=[admin_service_pb2.TIER_L2], dry_run=dry_run)
    return admin(daemon).Evict(req, timeout=10)


def wait_until(pred, timeout=10.0, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def require_cache_service(daemon):
    """Skips the test while the daemon's CacheService answers UNIMPLEMENTED."""
    stub = cache_service_pb2_grpc.CacheServiceStub(grpc.insecure_channel(f"unix:{daemon.socket}"))
    try:
        stub.Heartbeat(cache_service_pb2.HeartbeatRequest(session_id=1), timeout=5)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            pytest.skip("kvcellard's CacheService is not implemented yet")
