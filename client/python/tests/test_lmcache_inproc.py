"""kvcellar as LMCache 0.5.6's in-process remote storage plugin (kvcellar.integrations.lmcache
KvcellarConnectorAdapter), against the real package: an LMCacheEngine (LMCacheEngineBuilder,
LMCache's RemoteBackend and ConnectorManager loading the adapter from extra_config) stores a
request's chunks, including a partial last chunk, through kvcellard; a second engine process
retrieves them byte-exact; the first engine retrieves them again after a daemon warm restart
(pool.shm_name). A bad option and a daemon that is down behave as LMCache's built-in remote
connectors do: the engine runs, the remote tier misses.

The engines run in child processes with PYTHONHASHSEED=0: without vLLM, LMCache's token
database hashes chunks with Python's builtin hash, so only a fixed seed gives two processes the
same keys. The GPU connector is LMCache's MockGPUConnector with from_gpu/to_gpu copying a CPU
tensor (its own are no-ops: the CUDA ops do not load against this torch).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from framework_util import require  # noqa: E402

require("lmcache")

HERE = Path(__file__).resolve().parent
L, T, H, D, CHUNK = 2, 64, 2, 8, 16
TOKENS = 40  # two full chunks and a partial one of 8 tokens


# ---- the engine (runs in a child process) ------------------------------------------------------


def _engine(socket: str, extra: dict, name: str):
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    class CpuKv(MockGPUConnector):
        """LMCache's mock connector over a CPU 'paged KV' [2, layers, tokens, hidden]."""

        def __init__(self) -> None:
            super().__init__((L, 2, T, H, D))
            self.kv = torch.zeros(2, L, T, H * D)

        def from_gpu(self, m, start, end, **kw):
            m.tensor.copy_(self.kv[:, :, start:end].reshape(m.tensor.shape))

        def to_gpu(self, m, start, end, **kw):
            self.kv[:, :, start:end] = m.tensor.reshape(2, L, end - start, H * D)

        def batched_from_gpu(self, ms, starts, ends, **kw):
            for m, s, e in zip(ms, starts, ends):
                self.from_gpu(m, s, e)

        def batched_to_gpu(self, ms, starts, ends, **kw):
            for m, s, e in zip(ms, starts, ends):
                if m is not None:
                    self.to_gpu(m, s, e)

    cfg = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05,
        "save_unfull_chunk": True, "blocking_timeout_secs": 5,
        "remote_storage_plugins": ["kvcellar"],
        "extra_config": {"remote_storage_plugin.kvcellar.module_path":
                         "kvcellar.integrations.lmcache",
                         "remote_storage_plugin.kvcellar.class_name": "KvcellarConnectorAdapter",
                         "remote_storage_plugin.kvcellar.socket": socket,
                         "remote_storage_plugin.kvcellar.io_timeout_ms": 2000, **extra}})
    meta = LMCacheMetadata(model_name="lmc-test", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, kv_shape=(L, 2, CHUNK, H, D),
                           chunk_size=CHUNK)
    gc = CpuKv()
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, meta, gc, lambda t, r: None,
                                            lambda o, r: o)
    eng.post_init()
    return eng, gc


def _kv(seed: int):
    import torch

    return torch.randn(2, L, TOKENS, H * D, generator=torch.Generator().manual_seed(seed))


def _lookup(eng, tokens, want: int, tries: int = 100) -> int:
    import time

    n = 0
    for _ in range(tries):
        n = eng.lookup(tokens)
        if n == want:
            break
        time.sleep(0.05)
    return n


def _retrieve_exact(eng, gc, tokens, seed: int) -> dict:
    import torch

    gc.kv.zero_()
    got = int(eng.retrieve(tokens).sum())
    return {"retrieved": got, "exact": bool(torch.equal(gc.kv[:, :, :TOKENS], _kv(seed)))}


def engine_main() -> None:
    """argv: socket, mode (store | read | down | badkey), seed. Prints one JSON line per step;
    'store' then waits for a line on stdin (the daemon restarted) and reads again."""
    import torch

    socket, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tokens = torch.arange(TOKENS) + 1000 * seed
    extra = {"remote_storage_plugin.kvcellar.bogus_key": 1} if mode == "badkey" else {}
    eng, gc = _engine(socket, extra, f"e-{mode}")
    remote = eng.storage_manager.storage_backends.get("RemoteBackend-kvcellar")
    out = {"connected": remote is not None and remote.connection is not None}
    if mode in ("store", "down", "badkey"):
        gc.kv[:, :, :TOKENS] = _kv(seed)
        eng.store(tokens)
        out["lookup"] = _lookup(eng, tokens, TOKENS, tries=100 if mode == "store" else 5)
    if mode in ("store", "read", "down", "badkey"):
        if mode == "read":
            out["lookup"] = eng.lookup(tokens)
        out.update(_retrieve_exact(eng, gc, tokens, seed))
    print(json.dumps(out), flush=True)
    if mode == "store":
        sys.stdin.readline()  # the test restarted the daemon
        out = {"lookup": _lookup(eng, tokens, TOKENS, tries=200)}
        out.update(_retrieve_exact(eng, gc, tokens, seed))
        print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # LMCache's engine threads are not daemons


# ---- the tests ---------------------------------------------------------------------------------


def _spawn(socket: str, mode: str, seed: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    err = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, "-c", "import test_lmcache_inproc as t; "
                          "t.engine_main()", socket, mode, str(seed)],
                         cwd=HERE, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=err, text=True)
    p.err = err
    return p


def _stderr(p: subprocess.Popen) -> str:
    p.err.seek(0)
    return p.err.read()


def _result(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    if not line:
        p.wait(30)
        raise AssertionError(f"engine exited {p.returncode}: {_stderr(p)[-3000:]}")
    return json.loads(line)


@pytest.fixture
def shm_name(pool_shm_name):
    return pool_shm_name


def test_engine_second_process_and_warm_restart(daemon_factory, shm_name):
    """Chunks an engine stored (two full, one partial) come back byte-exact in a second engine
    process, and in the first engine after the daemon is stopped and started on its pool."""
    d = daemon_factory(args=["--set", f"pool.shm_name={shm_name}",
                             "--set", "pool.capacity=64MiB"])
    a = _spawn(d.socket, "store", 1)
    try:
        first = _result(a)
        assert first == {"connected": True, "lookup": TOKENS, "retrieved": TOKENS,
                         "exact": True}, first
        b = _spawn(d.socket, "read", 1)
        second = _result(b)
        b.wait(30)
        assert second == {"connected": True, "lookup": TOKENS, "retrieved": TOKENS,
                          "exact": True}, second
        # Another request's tokens: nothing of request 1 is served for them.
        c = _spawn(d.socket, "read", 2)
        other = _result(c)
        c.wait(30)
        assert other["lookup"] == 0 and other["retrieved"] == 0, other

        d.stop()
        d.start()
        a.stdin.write("restarted\n")
        a.stdin.flush()
        after = _result(a)
        assert after == {"lookup": TOKENS, "retrieved": TOKENS, "exact": True}, after
    finally:
        a.kill()
        a.wait()


def test_daemon_down_is_a_miss(tmp_path):
    """As LMCache's RemoteBackend with a failing built-in connector: the engine stores and
    retrieves without error, the remote tier finds nothing."""
    p = _spawn(str(tmp_path / "nobody.sock"), "down", 3)
    out = _result(p)
    p.wait(30)
    assert out == {"connected": True, "lookup": 0, "retrieved": 0, "exact": False}, out


def test_unknown_option_leaves_the_engine_without_the_backend(daemon):
    """An unknown remote_storage_plugin.kvcellar.* key is refused by name; LMCache (as for a bad
    built-in plugin option) logs it and runs without the remote connection."""
    from kvcellar.integrations.lmcache import plugin_options

    with pytest.raises(ValueError, match=r"remote_storage_plugin.kvcellar: unknown key\(s\) "
                                         r"\['bogus_key'\]"):
        plugin_options({"remote_storage_plugin.kvcellar.module_path": "x",
                        "remote_storage_plugin.kvcellar.bogus_key": 1}, "kvcellar")
    with pytest.raises(ValueError, match="slots"):
        plugin_options({"remote_storage_plugin.kvcellar.slots": "8"}, "kvcellar")
    p = _spawn(daemon.socket, "badkey", 4)
    out = _result(p)
    p.wait(30)
    assert p.returncode == 0
    assert out == {"connected": False, "lookup": 0, "retrieved": 0, "exact": False}, out
    assert "bogus_key" in _stderr(p)
