"""kvcellar as AIBrix's L2 backend (kvcellar.integrations.aibrix) against the real aibrix-kvcache
0.8.0: its BaseKVCacheManager and GroupAwareKVCacheManager, with AIBrix's L1 off (zero copy: the
manager reads and writes the connector's arena) or on (copy mode: L1 ingests into L2 through
mput, reads come back through mget), storing through real kvcellard processes. A second process
reads the objects back byte-exact; the same manager reads them after a warm daemon restart; bad
configuration, the daemon being down and objects of another geometry behave as AIBrix's built-in
connectors do; the way in (install, the vLLM subclass) is checked. The connector's cost against
kvcellard's direct path is measured by bench/bench_frameworks.py, not here.

Runs on CPU with aibrix_kvcache.cache_manager.TESTING_DISABLE_PIN_MEMORY, as AIBrix's own tests.
"""
import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from framework_util import require  # noqa: E402

aibrix = require("aibrix_kvcache")
import torch  # noqa: E402
from aibrix_kvcache import (BaseKVCacheManager, KVCacheBlockLayout, KVCacheBlockSpec,  # noqa: E402
                            KVCacheConfig, KVCacheTensorSpec, ModelSpec, TokenListView)
from aibrix_kvcache import cache_manager  # noqa: E402
from aibrix_kvcache.status import StatusCodes  # noqa: E402

from kvcellar.integrations import aibrix as kvc_aibrix  # noqa: E402

cache_manager.TESTING_DISABLE_PIN_MEMORY = True
PKG = str(Path(__file__).resolve().parents[1])
BLOCK = 16  # tokens per block
DAEMON_ARGS = ["--set", "device.kind=sim", "--set", "sessions.lease_ms=1000"]


def spec(head_size=32, heads=(0, 1), layers=(0, 1)):
    return KVCacheBlockSpec(block_ntokens=BLOCK, block_dtype=torch.bfloat16,
                            block_layout=KVCacheBlockLayout.NCLD,
                            tensor_spec=KVCacheTensorSpec(heads=list(heads), layers=list(layers),
                                                          head_size=head_size))


def aibrix_env(socket, zero_copy=True, l1=False, arena_mb=4, **extra):
    env = {"AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "kvcellar",
           "AIBRIX_KV_CACHE_OL_L2_CACHE_NAMESPACE": "test-model",
           "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "1" if l1 else "0",
           "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB": "0.01",
           "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_TYPE": "ALL",
           "AIBRIX_KV_CACHE_OL_KVCELLAR_SOCKET": socket,
           "AIBRIX_KV_CACHE_OL_KVCELLAR_ZERO_COPY": "1" if zero_copy else "0",
           "AIBRIX_KV_CACHE_OL_KVCELLAR_ARENA_MB": str(arena_mb),
           "AIBRIX_KV_CACHE_OL_KVCELLAR_REGISTER_TIMEOUT_MS": "300"}
    env.update(extra)
    return env


@pytest.fixture
def env(monkeypatch):
    """Sets AIBrix's environment for a manager built in this process (AIBrix reads it then)."""
    def apply(values):
        for k in list(os.environ):
            if k.startswith("AIBRIX_KV_CACHE_OL_"):
                monkeypatch.delenv(k)
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    return apply


def manager(block_spec=None, max_model_len=1024):
    kvc_aibrix.install()
    cfg = KVCacheConfig(block_spec=block_spec or spec(), model_spec=ModelSpec(max_model_len))
    return BaseKVCacheManager(cfg)


def tokens(seed, blocks):
    rng = np.random.default_rng(seed)
    return TokenListView(rng.integers(0, 50000, blocks * BLOCK).astype(np.int32))


def expected(seed, i, shape):
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def put(m, seed, blocks):
    """Stores `blocks` blocks of sequence `seed` through the manager, as AIBrix's vLLM connector
    does (allocate_for, write the blocks, put), then waits for the writes (flush)."""
    toks = tokens(seed, blocks)
    st = m.allocate_for(None, toks)
    assert st.is_ok(), st
    handle = st.get()
    ts = handle.to_tensors()
    assert len(ts) == blocks
    for i, t in enumerate(ts):
        t.copy_(expected(seed, i, t.shape))
    st = m.put(None, toks, handle)
    assert st.is_ok() and st.get() == blocks * BLOCK, st
    assert m.flush().is_ok()


def read(m, seed, blocks):
    """(tokens the manager found, whether every found block is byte-exact)."""
    st = m.acquire(None, tokens(seed, blocks))
    if not st.is_ok():
        return 0, True, st.error_code
    n, handle = st.get()
    ok = all(torch.equal(t, expected(seed, i, t.shape)) for i, t in enumerate(handle.to_tensors()))
    handle.release()
    return n, ok, StatusCodes.OK


CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    from aibrix_kvcache import cache_manager
    from aibrix_kvcache.status import StatusCodes
    cache_manager.TESTING_DISABLE_PIN_MEMORY = True
    import test_aibrix as T
    args = json.loads(sys.argv[1])
    out = {{}}
    if args.get("without_install"):
        from aibrix_kvcache import BaseKVCacheManager, KVCacheConfig, ModelSpec
        try:
            BaseKVCacheManager(KVCacheConfig(block_spec=T.spec(), model_spec=ModelSpec(1024)))
        except Exception as e:
            out["error"] = f"{{type(e).__name__}}: {{e}}"
    m = T.manager(T.spec(**args.get("spec", {{}})))
    for seed, blocks in args["read"]:
        ex = m.exists(None, T.tokens(seed, blocks))
        n, ok, code = T.read(m, seed, blocks)
        out[str(seed)] = [ex.get() if ex.is_ok() else 0, n, ok]
    m.close()
    print("RESULT " + json.dumps(out))
""").format(tests=str(Path(__file__).resolve().parent))


def child(env_values, **args):
    """Runs a second engine process (its own manager and connector) and returns what it read."""
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("AIBRIX_KV_CACHE_OL_"):
            del e[k]
    e.update(env_values)
    e["PYTHONPATH"] = PKG + os.pathsep + e.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                       text=True, timeout=60, env=e)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# ---- round trips ------------------------------------------------------------------------------


def test_zero_copy_round_trip_second_process_and_other_geometry(daemon, env):
    """L1 off, zero copy: AIBrix writes into the arena, seal backs the slots up; a second process
    finds and acquires the same bytes; an engine of another geometry never sees them."""
    env(aibrix_env(daemon.socket))
    m = manager()
    conn = m._l2_cache._backend
    assert isinstance(conn, kvc_aibrix.KvcellarConnector) and conn.feature.zero_copy
    put(m, 1, 5)
    put(m, 2, 3)
    assert conn.arena.free == conn.arena.num_slots  # every sealed slot came back
    assert m.exists(None, tokens(1, 5)).get() == 5 * BLOCK
    assert read(m, 1, 5) == (5 * BLOCK, True, StatusCodes.OK)
    assert m.flush().is_ok()  # AIBrix queues the releases on its L2 loop
    assert conn.arena.free == conn.arena.num_slots  # every acquired slot came back
    # A sequence that shares the first 2 blocks: only those are found.
    other = TokenListView(np.concatenate([tokens(1, 5)._data[:2 * BLOCK],
                                          np.arange(3 * BLOCK, dtype=np.int32)]))
    assert m.exists(None, other).get() == 2 * BLOCK
    assert m.acquire(None, tokens(99, 2)).error_code == StatusCodes.NOT_FOUND
    m.close()
    got = child(aibrix_env(daemon.socket), read=[[1, 5], [2, 3], [99, 2]])
    assert got["1"] == [5 * BLOCK, 5 * BLOCK, True]
    assert got["2"] == [3 * BLOCK, 3 * BLOCK, True]
    assert got["99"] == [0, 0, True]
    # head_size 64: another object size and geometry, another namespace: nothing is served.
    got = child(aibrix_env(daemon.socket), read=[[1, 5]], spec={"head_size": 64})
    assert got["1"] == [0, 0, True]


def test_copy_mode_with_l1_ingests_through_mput_and_reads_through_mget(daemon, env):
    """zero_copy off and AIBrix's L1 on: puts land in L1 and are ingested into kvcellard (mput,
    one copy into the arena); a second process with an empty L1 reads them through mget."""
    env(aibrix_env(daemon.socket, zero_copy=False, l1=True))
    m = manager()
    conn = m._l2_cache._backend
    assert not conn.feature.zero_copy and conn.feature.mput_mget
    put(m, 3, 6)
    assert read(m, 3, 6) == (6 * BLOCK, True, StatusCodes.OK)
    m.close()
    got = child(aibrix_env(daemon.socket, zero_copy=False, l1=True), read=[[3, 6]])
    assert got["3"] == [6 * BLOCK, 6 * BLOCK, True]
    # The zero-copy reader sees the same objects: the mode is not part of the namespace.
    got = child(aibrix_env(daemon.socket), read=[[3, 6]])
    assert got["3"] == [6 * BLOCK, 6 * BLOCK, True]


def test_group_aware_manager(daemon, env, tmp_path):
    """GroupAwareKVCacheManager (a gloo group of one on CPU) over the connector."""
    import torch.distributed as dist

    env(aibrix_env(daemon.socket))
    kvc_aibrix.install()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        m = cache_manager.GroupAwareKVCacheManager(
            KVCacheConfig(block_spec=spec(), model_spec=ModelSpec(1024)),
            process_group=dist.group.WORLD)
        put(m, 4, 4)
        assert read(m, 4, 4) == (4 * BLOCK, True, StatusCodes.OK)
        assert read(m, 98, 2)[0] == 0
        m.close()
    finally:
        dist.destroy_process_group()


def test_objects_survive_a_warm_daemon_restart(daemon_factory, env):
    """pool.shm_name: the daemon is stopped and started again on the same socket; the same
    manager (its session registers again by itself) reads every object byte-exact."""
    shm = f"kvc-aibrix-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    args = [*DAEMON_ARGS, "--set", f"pool.shm_name={shm}"]
    try:
        d = daemon_factory(args=args, name="warm")
        env(aibrix_env(d.socket, REGISTER_TIMEOUT_MS="300"))
        m = manager()
        put(m, 5, 4)
        assert d.stop() == 0
        assert m.acquire(None, tokens(5, 4)).error_code == StatusCodes.NOT_FOUND  # down: a miss
        d = daemon_factory(args=args, name="warm")
        conn = m._l2_cache._backend
        assert conn.session.wait_active(10000)
        assert read(m, 5, 4) == (4 * BLOCK, True, StatusCodes.OK)
        m.close()
        assert d.stop() == 0
    finally:
        for p in (f"/dev/shm/{shm}", f"/dev/shm/{shm}.journal"):
            if os.path.exists(p):
                os.unlink(p)


# ---- failures -------------------------------------------------------------------------------


def test_daemon_down_is_a_miss_then_the_backend_comes_up(daemon_factory, env, tmp_path):
    """The daemon is not running at engine start: the manager starts (InfiniStore's open would
    fail; see the module docstring), every call reports ERROR, which AIBrix turns into misses and
    a failed put; once kvcellard is up on that socket the same manager stores and reads."""
    sock = str(tmp_path / "late.sock")
    env(aibrix_env(sock))
    m = manager()
    conn = m._l2_cache._backend
    toks = tokens(6, 3)
    loop = m._event_loop
    st = asyncio.run_coroutine_threadsafe(conn.exists(b"k"), loop).result()
    assert st.error_code == StatusCodes.ERROR and "unavailable" in str(st.value)
    assert m.exists(None, toks).error_code == StatusCodes.NOT_FOUND  # L2Cache: a miss
    assert m.acquire(None, toks).error_code == StatusCodes.NOT_FOUND
    # Blocks are still handed out (AIBrix asserts, an engine error, when none are); the put
    # answers OK as AIBrix's zero-copy put does, and the seal's failure is logged, not stored.
    put(m, 6, 3)
    assert conn.arena.free == conn.arena.num_slots
    assert m.acquire(None, toks).error_code == StatusCodes.NOT_FOUND
    mr = _plain_region(conn.object_bytes)
    st = asyncio.run_coroutine_threadsafe(conn.put(b"k", mr), loop).result()
    assert st.error_code == StatusCodes.ERROR
    st = asyncio.run_coroutine_threadsafe(conn.get(b"k", mr), loop).result()
    assert st.error_code == StatusCodes.ERROR
    d = daemon_factory(args=DAEMON_ARGS, name="late")
    assert d.socket == sock
    assert conn.session.wait_active(10000)
    put(m, 6, 3)
    assert read(m, 6, 3) == (3 * BLOCK, True, StatusCodes.OK)
    m.close()


def _plain_region(nbytes):
    from aibrix_kvcache.memory import ExternalMemoryRegion

    slab = torch.zeros(nbytes * 2, dtype=torch.uint8)
    return ExternalMemoryRegion(slab, 0, nbytes)


def test_objects_of_another_size_are_refused_and_never_served(daemon, env):
    """The connector's own calls: a region of another size is INVALID for put and get (never
    stored, never filled); delete is DENIED (the daemon evicts); batches report per object."""
    env(aibrix_env(daemon.socket, zero_copy=False))
    m = manager()
    conn, loop = m._l2_cache._backend, m._event_loop

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    good = _plain_region(conn.object_bytes)
    good.slab[:conn.object_bytes] = torch.arange(conn.object_bytes) % 251
    small = _plain_region(conn.object_bytes // 2)
    assert run(conn.put(b"k1", small)).error_code == StatusCodes.INVALID
    assert run(conn.exists(b"k1")).error_code == StatusCodes.NOT_FOUND
    assert run(conn.put(b"k1", good)).is_ok()
    assert run(conn.exists(b"k1")).is_ok()
    small.slab.fill_(7)
    assert run(conn.get(b"k1", small)).error_code == StatusCodes.INVALID
    assert torch.all(small.slab == 7)  # not touched
    big = _plain_region(conn.object_bytes)
    st = run(conn.mget([b"k1", b"nope", b"k1"], [big, _plain_region(conn.object_bytes), small]))
    assert [s.error_code for s in st] == [StatusCodes.OK, StatusCodes.NOT_FOUND,
                                          StatusCodes.INVALID]
    assert torch.equal(big.slab[:conn.object_bytes], good.slab[:conn.object_bytes])
    assert run(conn.delete(b"k1")).error_code == StatusCodes.DENIED
    st = run(conn.allocate(b"k2", conn.object_bytes // 2))
    assert st.error_code == StatusCodes.INVALID and "8192-byte objects" in str(st.value)
    assert run(conn.acquire(b"nope")).error_code == StatusCodes.NOT_FOUND
    st = run(conn.acquire(b"k1"))  # zero copy: the slot holds the object
    assert st.is_ok() and st.get().length == conn.object_bytes
    slot = conn.arena.tensor[st.get().slot]
    assert torch.equal(slot, good.slab[:conn.object_bytes])
    free = conn.arena.free
    run(conn.release(st.get()))
    run(conn.release(st.get()))  # a second release gives nothing back twice
    assert conn.arena.free == free + 1
    # Every slot lent: allocate still answers (a spill buffer), and its seal stores the object
    # once a slot is free again.
    held = conn.arena.take(conn.arena.num_slots)
    st = run(conn.allocate(b"k3", conn.object_bytes))
    assert st.is_ok() and isinstance(st.get(), kvc_aibrix.SpillRegion)
    spill = st.get()
    spill.tensor.copy_(good.slab[:conn.object_bytes])
    conn.arena.give(held)
    run(conn.seal(spill))
    assert run(conn.exists(b"k3")).is_ok()
    assert conn.arena.free == conn.arena.num_slots
    m.close()


def test_bad_configuration_fails_at_start_naming_it(env, tmp_path):
    """An unknown or mistyped AIBRIX_KV_CACHE_OL_KVCELLAR_* variable, AIBrix's cluster mode and
    the token-validation layout fail the manager's construction with the reason, as the built-in
    connectors' from_envs checks do; nothing is registered."""
    sock = str(tmp_path / "none.sock")
    env(aibrix_env(sock, AIBRIX_KV_CACHE_OL_KVCELLAR_SOKET="/x"))
    with pytest.raises(ValueError, match="AIBRIX_KV_CACHE_OL_KVCELLAR_SOKET .unknown"):
        manager()
    env(aibrix_env(sock, AIBRIX_KV_CACHE_OL_KVCELLAR_ARENA_MB="lots",
                   AIBRIX_KV_CACHE_OL_KVCELLAR_ZERO_COPY="maybe"))
    with pytest.raises(ValueError, match="ZERO_COPY .expected 1, 0.*ARENA_MB .expected an int"):
        manager()
    env(aibrix_env(sock, AIBRIX_KV_CACHE_OL_KVCELLAR_PREFETCH_POLICY="sometimes"))
    with pytest.raises(ValueError, match="prefetch_policy"):
        manager()
    with pytest.raises(ValueError, match="cluster mode"):
        kvc_aibrix.KvcellarConnector.from_envs("c", None, block_spec=spec(), addr="10.0.0.1")
    code = ("import os; os.environ['AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED'] = '1';"
            "import test_aibrix as T; T.manager()")
    e = {k: v for k, v in os.environ.items() if not k.startswith("AIBRIX_KV_CACHE_OL_")}
    e.update(PYTHONPATH=PKG, **aibrix_env(sock))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=e, cwd=str(Path(__file__).resolve().parent))
    assert p.returncode != 0 and "TOKEN_VALIDATION_ENABLED: kvcellar stores" in p.stderr


def test_the_way_in(daemon, env):
    """Without install() AIBrix 0.8.0 refuses the name (its fixed list); install() adds it and
    leaves the built-in backends alone; the vLLM connector class is built on demand and needs
    vLLM, which is not installed here."""
    got = child(aibrix_env(daemon.socket), without_install=True, read=[])
    assert "Unknown connector type: KVCELLAR" in got["error"]
    kvc_aibrix.install()
    kvc_aibrix.install()  # idempotent
    assert kvc_aibrix.installed()
    env({"AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "MOCK", "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "0"})
    m = manager()
    assert m._l2_cache._backend.name == "Mock"
    m.close()
    try:
        import vllm  # noqa: F401
        has_vllm = True
    except ImportError:
        has_vllm = False
    if not has_vllm:
        with pytest.raises(ImportError, match="KvcellarOffloadingConnector: AIBrix's vLLM "
                                              "connector needs vLLM"):
            kvc_aibrix.KvcellarOffloadingConnector  # noqa: B018
    with pytest.raises(AttributeError):
        kvc_aibrix.NoSuchConnector  # noqa: B018

    class Base:
        def __init__(self, config, role):
            self.args = (config, role)

    cls = kvc_aibrix.offloading_connector_class(Base, "KvcellarOffloadingConnector")
    assert issubclass(cls, Base) and cls("cfg", "worker").args == ("cfg", "worker")


def test_a_slot_is_not_reused_while_the_daemon_may_still_read_it(daemon_factory, env):
    """A put whose Backup has not ended when the connector stops waiting (io 0 ms, 32 MiB
    objects) keeps its slot out of use until the daemon ends it: the next put takes another
    slot instead of overwriting bytes the daemon is still copying, so what is stored under the
    first key is that object's bytes, never the next one's."""
    big = spec(head_size=1 << 17)  # 16 tokens x 2 heads x 2 layers x 128 Ki x K, V x bf16
    daemon = daemon_factory(args=["--set", "pool.capacity=512MiB"])
    env(aibrix_env(daemon.socket, zero_copy=False, arena_mb=160,
                   AIBRIX_KV_CACHE_OL_KVCELLAR_IO_TIMEOUT_MS="0"))
    writer = manager(big)
    env(aibrix_env(daemon.socket, zero_copy=False, arena_mb=160,
                   AIBRIX_KV_CACHE_OL_KVCELLAR_INSTANCE_ID="reader"))
    reader = manager(big)
    w, r = writer._l2_cache._backend, reader._l2_cache._backend
    assert w.session.wait_active(5000) and r.session.wait_active(5000)

    def run(m, coro):
        return asyncio.run_coroutine_threadsafe(coro, m._event_loop).result()

    x, y = _plain_region(w.object_bytes), _plain_region(w.object_bytes)
    x.slab.fill_(0x11)
    y.slab.fill_(0x22)
    seen = 0
    for trial in range(4):
        kx, ky = b"x%d" % trial, b"y%d" % trial
        run(writer, w.put(kx, x))
        run(writer, w.put(ky, y))
        got = _plain_region(w.object_bytes)
        deadline = time.time() + 10
        while not run(reader, r.get(kx, got)).is_ok() and time.time() < deadline:
            time.sleep(0.05)
        if time.time() < deadline:
            seen += 1
            assert torch.all(got.slab[:w.object_bytes] == 0x11), f"trial {trial}: other bytes"
    assert seen, "no put of x was ever stored"
    writer.close()
    reader.close()
