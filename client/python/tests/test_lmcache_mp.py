"""kvcellar as the L2 adapter of LMCache 0.5.6's multiprocess server: the ``native_plugin``
adapter type (LMCache's NativeConnectorL2Adapter over kvcellar.integrations.lmcache
KvcellarNativeClient), built by LMCache's own factory (create_l2_adapter, as the storage manager
does) and driven through its event fds; LMCache's L2 check tool (basic_check test_l2_adapter);
a second process loading the objects byte-exact; the same adapter after a daemon warm restart;
an object of another size never served; a bad option and a daemon that is down. The adapter's
cost against kvcellard's direct path is measured by bench/bench_frameworks.py, not here.

End to end (test_mp_server_end_to_end): the real ``lmcache server`` processes (LMCache's MP
server with its storage manager, CPU mode) configured with the ``--l2-adapter`` JSON users
write, driven by LMCache's own engine-side client (``lmcache bench server``'s
ServerBenchClient: REGISTER_KV_CACHE, STORE, LOOKUP, RETRIEVE over ZMQ, the KV cache in POSIX
shared memory, the lmcache_driven transfer mode the server picks on CPU).
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import urllib.request

import pytest

from framework_util import require  # noqa: E402

require("lmcache")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
OBJ = 4096  # float32 elements per object: 16 KiB
N_OBJ = 8


def _spec(socket: str, **params) -> str:
    return json.dumps({"type": "native_plugin", "module_path": "kvcellar.integrations.lmcache",
                       "class_name": "KvcellarNativeClient",
                       "adapter_params": {"socket": socket, "object_bytes": OBJ * 4,
                                          "io_timeout_ms": 2000, **params}})


def _adapter(spec: str):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    import argparse

    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return create_l2_adapter(cfg.adapters[0])


def _keys(tag: str, n: int = N_OBJ):
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1000 + i), model_name=f"m-{tag}",
                      kv_rank=0) for i in range(n)]


def _objs(data: torch.Tensor):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    out = []
    for row in data:
        meta = MemoryObjMetadata(shape=torch.Size([row.numel()]), dtype=row.dtype, address=0,
                                 phy_size=row.numel() * row.element_size(), ref_count=1,
                                 pin_count=0, fmt=MemoryFormat.BINARY_BUFFER)
        out.append(TensorMemoryObj(raw_data=row, metadata=meta, parent_allocator=None))
    return out


def _wait(fd: int, timeout_s: float = 20) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(int(timeout_s * 1000)), "no completion on the event fd"


def _store(a, keys, objs) -> bool:
    tid = a.submit_store_task(keys, objs)
    deadline = time.time() + 20
    while time.time() < deadline:
        _wait(a.get_store_event_fd())
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid].is_successful()
    raise AssertionError("store never completed")


def _bits(bitmap, n):
    return [bool(bitmap.test(i)) for i in range(n)]


def _lookup(a, keys):
    tid = a.submit_lookup_and_lock_task(keys, {})
    deadline = time.time() + 20
    while time.time() < deadline:
        _wait(a.get_lookup_and_lock_event_fd())
        r = a.query_lookup_and_lock_result(tid)
        if r is not None:
            a.submit_unlock(keys)
            return _bits(r, len(keys))
    raise AssertionError("lookup never completed")


def _load(a, keys, objs):
    tid = a.submit_load_task(keys, objs)
    deadline = time.time() + 20
    while time.time() < deadline:
        _wait(a.get_load_event_fd())
        r = a.query_load_result(tid)
        if r is not None:
            return _bits(r, len(keys))
    raise AssertionError("load never completed")


def _data(seed: int, n: int = N_OBJ, size: int = OBJ) -> torch.Tensor:
    return torch.randn(n, size, generator=torch.Generator().manual_seed(seed))


def reader_main() -> None:
    """A second MP server process: argv socket, tag, seed; loads the objects and prints whether
    each is found and byte-exact."""
    socket, tag, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    a = _adapter(_spec(socket))
    keys = _keys(tag)
    buf = torch.zeros(N_OBJ, OBJ)
    found = _lookup(a, keys)
    loaded = _load(a, keys, _objs(buf))
    print(json.dumps({"found": found, "loaded": loaded,
                      "exact": bool(torch.equal(buf, _data(seed)))}), flush=True)
    a.close()


@pytest.fixture
def shm_name(pool_shm_name):
    return pool_shm_name


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent),
                                                         os.environ.get("PYTHONPATH", "")]))


def test_lmcache_l2_check_tool(daemon):
    """LMCache's own L2 adapter check passes every phase through kvcellard."""
    spec = _spec(daemon.socket)
    r = subprocess.run([sys.executable, "-m", "lmcache.v1.basic_check", "--mode",
                        "test_l2_adapter", "--num-keys", "8", "--obj-size", str(OBJ),
                        "--l2-adapter", spec], env=_env(), capture_output=True, text=True,
                       timeout=90)
    out = r.stdout
    assert "Validation: 8/8 correctly absent" in out, out + r.stderr[-2000:]
    assert "Validation: 8/8 found" in out, out
    assert "Validation (content): 8/8" in out, out


def test_second_process_warm_restart_and_sizes(daemon_factory, shm_name):
    d = daemon_factory(args=["--set", f"pool.shm_name={shm_name}",
                             "--set", "pool.capacity=64MiB"])
    a = _adapter(_spec(d.socket))
    try:
        keys, data = _keys("a"), _data(1)
        assert _lookup(a, keys) == [False] * N_OBJ
        assert _store(a, keys, _objs(data.clone()))
        assert _lookup(a, keys) == [True] * N_OBJ
        r = subprocess.run([sys.executable, "-c", "import test_lmcache_mp as t; t.reader_main()",
                            d.socket, "a", "1"], cwd=HERE, env=_env(), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout.splitlines()[-1]) == {
            "found": [True] * N_OBJ, "loaded": [True] * N_OBJ, "exact": True}

        # An object is never served into a buffer of another size (a partial chunk's L1
        # object is smaller than a full one): a miss, the buffer untouched.
        small = torch.full((1, OBJ // 2), 7.0)
        assert _load(a, keys[:1], _objs(small)) == [False]
        assert bool((small == 7.0).all())
        part_keys, part = _keys("partial", 1), _data(5, 1, OBJ // 4)
        assert _store(a, part_keys, _objs(part.clone()))
        full = torch.zeros(1, OBJ)
        assert _load(a, part_keys, _objs(full)) == [False]
        exact = torch.zeros(1, OBJ // 4)
        assert _load(a, part_keys, _objs(exact)) == [True] and torch.equal(exact, part)

        d.stop()
        d.start()
        deadline = time.time() + 20
        while _lookup(a, keys) != [True] * N_OBJ and time.time() < deadline:
            time.sleep(0.1)
        buf = torch.zeros(N_OBJ, OBJ)
        assert _load(a, keys, _objs(buf)) == [True] * N_OBJ
        assert torch.equal(buf, data)
    finally:
        a.close()


def test_bad_options_and_daemon_down(tmp_path):
    """A bad adapter_params key is refused by name at creation (LMCache's server then refuses
    to start, as for a bad built-in adapter config); a daemon that is down makes every lookup
    and load a miss and every store a failed task, never an exception."""
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['bogus'\]"):
        _adapter(_spec(str(tmp_path / "x.sock"), bogus=1))
    with pytest.raises(ValueError, match="object_bytes"):
        _adapter(json.dumps({"type": "native_plugin",
                             "module_path": "kvcellar.integrations.lmcache",
                             "class_name": "KvcellarNativeClient", "adapter_params": {}}))
    a = _adapter(_spec(str(tmp_path / "nobody.sock")))
    try:
        keys = _keys("down", 2)
        assert _lookup(a, keys) == [False, False]
        assert not _store(a, keys, _objs(_data(2, 2)))
        assert _load(a, keys, _objs(torch.zeros(2, OBJ))) == [False, False]
    finally:
        a.close()


# ---- end to end: the real ``lmcache server`` with kvcellar as its L2 ---------------------------

# The engine's KV cache: 2 layers of (K/V, blocks, block tokens, heads, head dim) float16; one
# 64-token chunk is an L1 object of 2 x 2 x 64 x 2 x 64 x 2 B (KV_2LTD) = object_bytes.
CHUNK = 64
SHAPE_SPEC = "(2,64,16,2,64):float16:2"
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 64 * 2
TOKENS = 256  # 4 full chunks per request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(d, name: str, **labels) -> float:
    """The sum of a counter or gauge's series with ``labels`` on the daemon's /metrics."""
    with urllib.request.urlopen(f"http://{d.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name and all(w in line for w in want))


class _Server:
    """An ``lmcache server`` process (the command users run) with kvcellar as its L2."""

    def __init__(self, log_path: Path, kvcellar_socket: str) -> None:
        self.port, self.http_port = _free_port(), _free_port()
        self.log_path = log_path
        spec = json.dumps({"type": "native_plugin",
                           "module_path": "kvcellar.integrations.lmcache",
                           "class_name": "KvcellarNativeClient",
                           "adapter_params": {"object_bytes": CHUNK_BYTES,
                                              "socket": kvcellar_socket}})
        self.args = [str(Path(sys.executable).parent / "lmcache"), "server",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                     "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05",
                     "--eviction-policy", "LRU", "--disable-observability",
                     "--l2-adapter", spec]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         env=_env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60) -> "_Server":
        deadline = time.time() + timeout_s
        while "Application startup complete" not in self.log():
            assert self.proc.poll() is None, "lmcache server exited:\n" + self.log()[-4000:]
            assert time.time() < deadline, "lmcache server not ready:\n" + self.log()[-4000:]
            time.sleep(0.2)
        return self

    def clear_l1(self) -> None:
        """LMCache's own HTTP API: drop every object of the server's L1."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/cache/clear",
                                     data=json.dumps({"tier": "l1", "force": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["status"] == "ok"

    def stop(self) -> None:
        """Asks the server to shut down (SIGINT: its clean exit, L1 shm unlinked)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Engine:
    """One engine worker on a server: LMCache's ServerBenchClient (CPU mode) over ZMQ."""

    def __init__(self, server: _Server) -> None:
        from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
        from lmcache.cli.commands.bench.server_bench.config import BenchConfig

        cfg = BenchConfig(rpc_url=f"tcp://127.0.0.1:{server.port}",
                          http_url=f"http://127.0.0.1:{server.http_port}", mode="cpu",
                          transfer_mode="lmcache_driven", tp_size=1, use_mla=False,
                          num_tokens=TOKENS, kvcache_shape_spec=SHAPE_SPEC, num_blocks=64,
                          block_size=16)
        self.client = ServerBenchClient(cfg, lambda msg: None)
        self.client.start()
        # The layers' tensors, shared with the server through POSIX shm: written in place.
        self.kv = list(self.client._workers[0].kv_caches.values())

    def _req(self, seq: int):
        return self.client.create_request(seq, f"req-{seq}-{uuid.uuid4().hex[:8]}", "test")

    def _blocks(self, r) -> list[torch.Tensor]:
        return [t[:, r.block_offset:r.block_offset + r.num_blocks] for t in self.kv]

    def fill(self, seq: int) -> list[torch.Tensor]:
        """Writes seeded KV into the request's blocks; the bytes written."""
        g = torch.Generator().manual_seed(seq)
        out = []
        for view in self._blocks(self._req(seq)):
            view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
            out.append(view.clone())
        return out

    def lookup(self, seq: int) -> int:
        r = self._req(seq)
        hit = self.client.lookup(r).hit_chunks
        self.client.end_session(r)
        return hit

    def store(self, seq: int) -> bool:
        """STORE, then LOOKUP until the server's L1 shows every chunk: LMCache answers a STORE
        before its L1 write is visible (a LOOKUP at once may miss, with or without an L2)."""
        r = self._req(seq)
        ok = self.client.store(r, 0, r.num_full_tokens).succeeded
        self.client.end_session(r)
        deadline = time.time() + 10
        while ok and self.lookup(seq) != r.total_chunks:
            if time.time() > deadline:
                return False
            time.sleep(0.05)
        return ok

    def retrieve(self, seq: int) -> tuple[int, bool, list[torch.Tensor]]:
        """LOOKUP (prefetch into L1), then RETRIEVE into zeroed blocks: (hit chunks, retrieve
        ok, the bytes the blocks hold afterwards)."""
        r = self._req(seq)
        for t in self.kv:
            t.zero_()
        hit = self.client.lookup(r).hit_chunks
        ok = hit == r.total_chunks and self.client.retrieve(r, 0, r.num_full_tokens).succeeded
        self.client.end_session(r)
        return hit, ok, [v.clone() for v in self._blocks(r)]

    def close(self) -> None:
        self.client.close()


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def test_mp_server_end_to_end(daemon_factory, shm_name, tmp_path):
    """Objects stored through one ``lmcache server`` are served byte-exact through another (its
    L1 empty, then cleared) from kvcellard, again after a kvcellard warm restart; with kvcellard
    down a lookup is a miss and the server keeps serving from its L1."""
    d = daemon_factory(args=["--set", f"pool.shm_name={shm_name}",
                             "--set", "pool.capacity=64MiB"])
    chunks = TOKENS // CHUNK
    servers = [_Server(tmp_path / "server-a.log", d.socket),
               _Server(tmp_path / "server-b.log", d.socket)]
    engines: list[_Engine] = []
    try:
        a, b = (s.wait_ready() for s in servers)

        # Server A: the engine's chunks go to A's L1 and, by A's store controller, to kvcellard.
        ea = _Engine(a)
        engines.append(ea)
        assert ea.lookup(1) == 0
        data = ea.fill(1)
        assert ea.store(1)
        deadline = time.time() + 20
        while _metric(d, "kvcellar_op_pages_total", kind="backup", status="ok") < chunks:
            assert time.time() < deadline, "A's L2 store never reached kvcellard"
            time.sleep(0.1)
        assert _metric(d, "kvcellar_l2_pages") == chunks

        # Server B, a fresh process whose L1 never held them: served from kvcellard.
        eb = _Engine(b)
        engines.append(eb)

        def retrieve_from_kvcellar():
            """B retrieves request 1 byte-exact, every chunk loaded from kvcellard's pool."""
            loads = _metric(d, "kvcellar_op_pages_total", kind="load", status="ok")
            hit, ok, got = eb.retrieve(1)
            assert (hit, ok) == (chunks, True)
            assert _same(got, data)
            assert _metric(d, "kvcellar_op_pages_total", kind="load", status="ok") == \
                loads + chunks

        retrieve_from_kvcellar()

        # kvcellard warm restart; B's L1 cleared: B's adapter registers again by itself and the
        # chunks come from the surviving pool.
        d.stop()
        d.start()
        b.clear_l1()
        deadline = time.time() + 20
        while eb.lookup(1) != chunks:
            assert time.time() < deadline, "no hit after kvcellard's warm restart"
            b.clear_l1()
            time.sleep(0.2)
        b.clear_l1()
        retrieve_from_kvcellar()

        # kvcellard down: a lookup of chunks only kvcellard held is a miss; the server still
        # stores and serves from its L1.
        d.stop()
        b.clear_l1()
        assert eb.lookup(1) == 0
        data2 = eb.fill(2)
        assert eb.store(2)
        hit, ok, got = eb.retrieve(2)
        assert (hit, ok) == (chunks, True) and _same(got, data2)
        # ... and its store to kvcellar is a failed L2 task, as for LMCache's own adapters.
        deadline = time.time() + 10
        while "to adapter 0 failed" not in b.log():
            assert time.time() < deadline, b.log()[-4000:]
            time.sleep(0.1)
        assert b.proc.poll() is None and a.proc.poll() is None
        for s in (a, b):
            assert "Traceback" not in s.log(), s.log()[-4000:]
    finally:
        for e in engines:
            e.close()
        for s in servers:
            s.stop()
        for s in servers:
            s.wait_stopped()


def test_a_slot_is_not_reused_while_the_daemon_may_still_read_it(daemon_factory):
    """A put whose Backup has not ended when the adapter stops waiting (io_timeout_ms 0) keeps
    its slot out of use until it ends: the next put gets no slot rather than overwriting the
    bytes the daemon is still copying, and what a reader gets under the first key is never the
    second object's bytes (nor a mix)."""
    from kvcellar import Client, Namespace
    from kvcellar.integrations.lmcache import ObjectStore, object_digest

    d = daemon_factory(args=["--set", "pool.capacity=512MiB"])
    size = 48 << 20  # large enough that the daemon's copy outlasts a zero wait
    ns = Namespace("lmc-race", "r", "int8", 1, layout="mla", tp_size=1, opaque_keys=True)
    with Client(d.socket) as ca, Client(d.socket) as cb:
        writer = ObjectStore(ca, ns, "writer", size, 1, 0, None, "none", 0)
        reader = ObjectStore(cb, ns, "reader", size, 1, 5000, None, "none", 0)
        assert writer.session.wait_active(5000) and reader.session.wait_active(5000)
        x, y = np.full(size, 0x11, np.uint8), np.full(size, 0x22, np.uint8)
        seen = 0
        for trial in range(4):
            kx, ky = object_digest(f"x{trial}"), object_digest(f"y{trial}")
            writer.put([kx], [memoryview(x)])
            writer.put([ky], [memoryview(y)])
            got = {}

            def deliver(i, data, meta):
                got[i] = np.frombuffer(data, np.uint8).copy()
                return True

            deadline = time.time() + 10
            while not reader.get([kx], deliver)[0] and time.time() < deadline:
                time.sleep(0.05)
            if 0 in got:
                seen += 1
                assert np.array_equal(got[0], x), f"trial {trial}: key x served other bytes"
        assert seen, "no put of x was ever stored"
        writer.close()
        reader.close()
