"""kvcellar as a UCM 0.8.1 store (kvcellar.integrations.ucm), against the real ``ucm`` package on
CPU: UCM's own factory (``UcmConnectorFactoryV1.create_connector`` with
``ucm_connector_module_path``) builds the store from the config dict UCM's vLLM connector builds,
and UCM's ``RankConsistencyManager`` (what that connector calls the store through) submits and
waits. Real kvcellard processes, a second engine process, a daemon restart.

UCM's vLLM connector itself (UCMDirectConnector) cannot run here: it imports vLLM, which this
environment does not have, and refuses any platform but CUDA and NPU ("Unsupported device
platform"). ``ucm_config`` below builds the worker's store config exactly as its
``_create_store`` and ``KVCacheLayout`` do (ucm/integration/vllm/ucm_connector.py), and
``block_addrs`` the address rows of ``KVCacheLayout.extract_block_addrs``.
"""
import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from framework_util import require  # noqa: E402

require("ucm")
from ucm.integration.vllm.rank_consistency import RankConsistencyManager  # noqa: E402
from ucm.store.factory_v1 import UcmConnectorFactoryV1  # noqa: E402
from ucm.store.pipeline.errors import StoreNotFoundError, StoreUnhealthyError  # noqa: E402

from kvcellar.integrations.ucm import KvcellarStore  # noqa: E402

PKG = Path(__file__).resolve().parents[1]
MODULE = "kvcellar.integrations.ucm"
LAYERS, NUM_BLOCKS, BLOCK_TOKENS, HEADS, HEAD_DIM = 4, 32, 16, 2, 64
DTYPE = torch.bfloat16
ALIGN = 4096  # ucm_connector._get_store_io_sizes


def kv_caches(num_blocks=NUM_BLOCKS, heads=HEADS, head_dim=HEAD_DIM):
    """vLLM's FlashAttention layout on CPU: per layer [2, num_blocks, block_size, heads, dim]."""
    return {f"model.layers.{i}.self_attn.attn":
            torch.zeros((2, num_blocks, BLOCK_TOKENS, heads, head_dim), dtype=DTYPE)
            for i in range(LAYERS)}


def tensors_of(caches):
    """KVCacheLayout._tensor_infos order: K then V of each layer."""
    return [t for kv in caches.values() for t in (kv[0], kv[1])]


def ucm_config(caches, socket, **user):
    """The dict UCMDirectConnector._create_store hands a worker's store (use_layerwise false)."""
    ts = tensors_of(caches)
    sizes = [math.prod(t.shape[1:]) * t.element_size() for t in ts]
    shard = sum(sizes)
    padded = (shard + ALIGN - 1) // ALIGN * ALIGN
    config = {"kvcellar_model": "tiny-ucm", "kvcellar_socket": socket, **user}
    config.setdefault("share_buffer_enable", False)
    config.update(unique_id="engine-a", tensor_layout="gqa", device_id=-1,
                  tensor_size_list=sizes, shard_size=padded, block_size=padded,
                  local_rank_size=1,
                  gpu_kv_buffer_addrs=[t[0].data_ptr() for t in ts],
                  gpu_kv_buffer_sizes=[t.shape[0] * s for t, s in zip(ts, sizes)],
                  posix_gc_enable=False)
    return config


def block_addrs(caches, blocks):
    """KVCacheLayout.extract_block_addrs (direct): one row per block, one address per tensor."""
    ts = tensors_of(caches)
    base = np.asarray([t[0].data_ptr() for t in ts], np.uint64)
    stride = np.asarray([math.prod(t.shape[1:]) * t.element_size() for t in ts], np.uint64)
    return np.asarray(blocks, np.uint64)[:, None] * stride[None, :] + base[None, :]


def make_store(config):
    """UCM's own loading path: the factory imports ucm_connector_module_path."""
    store = UcmConnectorFactoryV1.create_connector("KvcellarStore", config, MODULE)
    assert type(store) is KvcellarStore
    return store


def block_ids(n, salt=b""):
    return [hashlib.md5(salt + b"block-%d" % i).digest() for i in range(n)]


def fill(caches, blocks, seed):
    """Writes seeded random bytes into `blocks` of every tensor; returns them per tensor."""
    g = torch.Generator().manual_seed(seed)
    want = []
    for t in tensors_of(caches):
        data = torch.randn((len(blocks), *t.shape[1:]), generator=g).to(DTYPE)
        t[list(blocks)] = data
        want.append(data)
    return want


def read(caches, blocks):
    return [t[list(blocks)].clone() for t in tensors_of(caches)]


def dump(store, ids, caches, blocks):
    """As the connector's wait_for_save: submit through the manager, wait, finish."""
    rc = RankConsistencyManager(is_scheduler=False)
    task = rc.submit_dump(store, {"req": set(ids)}, ids, [0] * len(ids),
                          block_addrs(caches, blocks), 0)
    rc.wait_dump(task)
    rc.finish_dump({"req"})


def load(store, ids, caches, blocks):
    rc = RankConsistencyManager(is_scheduler=False)
    task = rc.submit_load(store, {"req": list(ids)}, ids, [0] * len(ids),
                          block_addrs(caches, blocks))
    rc.wait_load(task)


@pytest.fixture
def shm_name(pool_shm_name):
    return pool_shm_name


SECOND_ENGINE = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    import test_ucm as T
    caches = T.kv_caches()
    store = T.make_store(T.ucm_config(caches, {socket!r}, kvcellar_instance_id="engine-b"))
    assert store.session.wait_active(10000)
    ids = T.block_ids({n})
    hits = store.lookup(ids)
    prefix = store.lookup_on_prefix(ids)
    T.load(store, ids, caches, list(range(20, 20 + {n})))
    got = T.read(caches, list(range(20, 20 + {n})))
    want = [w for w in T.expected({n}, {seed})]
    exact = all(torch.equal(g, w) for g, w in zip(got, want))
    print(json.dumps({{"hits": hits, "prefix": prefix, "exact": exact}}))
    store.close()
""")


def expected(n, seed):
    """What fill(caches, range(n), seed) wrote, without a cache to write it to."""
    return fill(kv_caches(), list(range(n)), seed)


def test_second_engine_and_restarted_daemon_get_blocks_byte_exact(daemon_factory, shm_name):
    args = ["--set", f"pool.shm_name={shm_name}"]
    d = daemon_factory(args=args, name="a", subdir="a")
    caches = kv_caches()
    store = make_store(ucm_config(caches, d.socket))
    assert store.layout.regions[0].handle == f"/proc/{os.getpid()}/mem"
    assert store.session.wait_active(10000)
    n, seed = 6, 11
    ids = block_ids(n)
    want = fill(caches, range(n), seed)
    dump(store, ids, caches, list(range(n)))

    child = subprocess.run(
        [sys.executable, "-c", SECOND_ENGINE.format(tests=str(Path(__file__).parent),
                                                    socket=d.socket, n=n, seed=seed)],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(PKG)))
    assert child.returncode == 0, child.stdout + child.stderr
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got == {"hits": [True] * n, "prefix": n - 1, "exact": True}

    # The same engine after the daemon's restart: the pool survives (pool.shm_name) and the
    # session registers again by itself.
    assert d.stop() == 0
    for t in tensors_of(caches):
        t.zero_()
    d2 = daemon_factory(args=args, name="a", subdir="a")
    assert d2.socket == d.socket
    deadline = time.monotonic() + 20
    while store.lookup(ids) != [True] * n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.lookup(ids) == [True] * n
    load(store, ids, caches, list(range(8, 8 + n)))
    assert all(torch.equal(g, w) for g, w in zip(read(caches, range(8, 8 + n)), want))
    store.close()


def test_lookup_prefix_reverse_and_dump_of_existing_blocks(daemon):
    caches = kv_caches()
    store = make_store(ucm_config(caches, daemon.socket))
    assert store.session.wait_active(10000)
    a, b, c, dd = block_ids(4, b"lk")
    want = fill(caches, [0, 1, 3], seed=3)
    dump(store, [a, b, dd], caches, [0, 1, 3])
    assert store.lookup([a, b, c, dd]) == [True, True, False, True]
    assert store.lookup_on_prefix([a, b, c, dd]) == 1
    assert store.lookup_on_prefix([c, a]) == -1
    assert store.lookup_on_reverse([a, b, c, dd]) == 3
    assert store.lookup_on_reverse([a, c]) == 0
    assert store.lookup_on_reverse([c]) == -1
    assert store.lookup([]) == [] and store.lookup_on_prefix([]) == -1
    assert store.lookup_on_reverse([]) == -1
    store.prefetch([a, c])  # nothing in L3 here: returns at once, changes nothing
    assert store.lookup([c]) == [False]

    # A dump of a block that exists succeeds and the daemon keeps its copy (UCM's keys promise
    # equal bytes); a load of a missing block fails the task as the pipeline store's Wait does.
    fill(caches, [5], seed=99)
    task = store.dump_data([a], [0], block_addrs(caches, [5]))
    store.wait(task)
    assert store.check(task)
    load(store, [a, b], caches, [10, 11])
    assert torch.equal(read(caches, [10])[0], want[0][:1])
    rc = RankConsistencyManager(is_scheduler=False)
    task = rc.submit_load(store, {"r": [a, c]}, [a, c], [0, 0], block_addrs(caches, [12, 13]))
    with pytest.raises(StoreNotFoundError, match="1 of 2 blocks not found"):
        rc.wait_load(task)

    # The tensor form (load/dump with one tensor per block and KV tensor).
    views = lambda blk: [t[blk] for t in tensors_of(caches)]  # noqa: E731
    store.wait(store.dump([c], [0], [views(1)]))
    assert store.lookup([c]) == [True]
    store.wait(store.load([c], [0], [views(14)]))
    assert all(torch.equal(t[14], t[1]) for t in tensors_of(caches))

    # UCM's scheduler builds its store with no device and no tensors: lookups only.
    sched_config = {k: v for k, v in ucm_config(caches, daemon.socket).items()
                    if not k.startswith("gpu_kv") and k not in ("device_id", "tensor_size_list")}
    sched = make_store(sched_config)
    assert sched.session.wait_active(10000)
    assert sched.lookup_on_prefix([a, b, c, dd]) == 3
    with pytest.raises(RuntimeError, match="transfer is not enabled"):
        sched.load_data([a], [0], block_addrs(caches, [0]))
    sched.close()
    store.close()


def test_addresses_outside_the_registered_kv_are_refused(daemon):
    caches = kv_caches()
    store = make_store(ucm_config(caches, daemon.socket))
    assert store.session.wait_active(10000)
    ids = block_ids(2, b"refuse")
    fill(caches, [0, 1], seed=5)
    stranger = torch.ones(1 << 16, dtype=torch.uint8)
    rows = block_addrs(caches, [0, 1])
    cases = []
    bad = rows.copy()
    bad[1, 2] = stranger.data_ptr()
    cases.append((bad, r"src_addr\[1\]\[2\]: address 0x[0-9a-f]+ is not block 1"))
    bad = rows.copy()
    bad[0, 0] += 1  # inside the buffer, but not a block boundary
    cases.append((bad, r"src_addr\[0\]\[0\]"))
    bad = rows.copy()
    bad[0, 3] = block_addrs(caches, [7])[0, 3]  # another block in one column
    cases.append((bad, r"src_addr\[0\]\[3\]: .* is not block 0"))
    bad = block_addrs(caches, [NUM_BLOCKS - 1, 0])
    bad[0] += bad[0] - block_addrs(caches, [NUM_BLOCKS - 2])[0]  # one past the last block
    cases.append((bad, r"src_addr\[0\]\[0\]: .* is not block 32"))
    cases.append((rows[:, :3], r"src_addr: shape \(2, 3\)"))
    for addrs, why in cases:
        with pytest.raises(ValueError, match=why):
            store.dump_data(ids, [0, 0], addrs)
        with pytest.raises(ValueError, match=why.replace("src_addr", "dst_addr")):
            store.load_data(ids, [0, 0], addrs)
    with pytest.raises(ValueError, match=r"shard_index\[1\] = 3"):
        store.dump_data(ids, [0, 3], rows)
    with pytest.raises(ValueError, match=r"block_ids\[0\]: expected 16 bytes"):
        store.dump_data([b"short", ids[1]], [0, 0], rows)
    assert store.lookup(ids) == [False, False]  # nothing was stored
    assert stranger.eq(1).all()  # nor written
    store.close()


def test_configuration_is_checked_like_ucms_own_stores(tmp_path):
    caches = kv_caches()
    sock = str(tmp_path / "none.sock")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['kvcellar_sockets'\]"):
        make_store({**ucm_config(caches, sock), "kvcellar_sockets": "/x"})
    with pytest.raises(ValueError, match=r"kvcellar_io_timeout_ms \(expected an int"):
        make_store(ucm_config(caches, sock, kvcellar_io_timeout_ms="5s"))
    with pytest.raises(ValueError, match="kvcellar_model is required"):
        make_store({k: v for k, v in ucm_config(caches, sock).items() if k != "kvcellar_model"})
    with pytest.raises(ValueError, match=r"gpu_kv_buffer_sizes\[3\] = .* not a whole number"):
        cfg = ucm_config(caches, sock)
        cfg["gpu_kv_buffer_sizes"][3] += 1
        make_store(cfg)
    with pytest.raises(ValueError, match=r"gpu_kv_buffer_addrs\[0\] .* not writable memory"):
        cfg = ucm_config(caches, sock)
        cfg["gpu_kv_buffer_addrs"][0] = 4096
        make_store(cfg)
    # Keys that are not the store's are ignored, as UCM's Posix store ignores what it does not
    # read (it is handed the same dict, with UCM's own keys in it).
    make_store({**ucm_config(caches, sock), "posix_io_engine": "psync", "some_key": 1}).close()
    posix = UcmConnectorFactoryV1.create_connector(
        "UcmPipelineStore", {"store_pipeline": "Posix", "storage_backends": [str(tmp_path)],
                             "device_id": -1, "some_key": 1})
    assert list(posix.lookup(block_ids(1))) == [False]


def test_daemon_down_is_a_miss_as_with_ucms_health_breaker(tmp_path):
    """Behaves as UCM's pipeline store behind its health breaker with the backend down:
    lookups absent, prefetch nothing, load/dump StoreUnhealthyError at submission (which the
    connector's RankConsistencyManager records as a failed dump and a failed load)."""
    caches = kv_caches()
    store = make_store(ucm_config(caches, str(tmp_path / "no-daemon.sock"),
                                  kvcellar_register_timeout_ms=200))
    ids = block_ids(3, b"down")
    assert store.lookup(ids) == [False, False, False]
    assert store.lookup_on_prefix(ids) == -1 and store.lookup_on_reverse(ids) == -1
    assert store.prefetch(ids) is None
    rc = RankConsistencyManager(is_scheduler=False)
    with pytest.raises(StoreUnhealthyError):
        rc.submit_dump(store, {"r": set(ids)}, ids, [0] * 3, block_addrs(caches, [0, 1, 2]), 0)
    assert rc._dump_failed_blocks_by_request == {"r": set(ids)}
    with pytest.raises(StoreUnhealthyError):
        rc.submit_load(store, {"r": ids}, ids, [0] * 3, block_addrs(caches, [0, 1, 2]))
    store.close()


def test_calls_larger_than_one_daemon_batch(daemon_factory):
    """More blocks than the daemon takes sequences per call (max_batch_sequences, 4096): the
    store splits dumps, loads and lookups, and one task covers them all. (A pool slot is at
    least 64 KiB: 4100 blocks need a pool of 320 MiB.)"""
    n = 4100
    daemon = daemon_factory(args=["--set", "pool.capacity=320MiB"])
    caches = kv_caches(num_blocks=n, heads=1, head_dim=8)
    store = make_store(ucm_config(caches, daemon.socket))
    assert store.session.wait_active(10000)
    assert store.session.info().max_batch_sequences < n
    ids = block_ids(n, b"big")
    want = fill(caches, range(n), seed=4)
    task = store.dump_data(ids, [0] * n, block_addrs(caches, range(n)))
    assert len(task.ops) == 2
    store.wait(task)
    assert store.lookup(ids) == [True] * n and store.lookup_on_prefix(ids) == n - 1
    for t in tensors_of(caches):
        t.zero_()
    store.wait(store.load_data(ids, [0] * n, block_addrs(caches, range(n))))
    assert all(torch.equal(g, w) for g, w in zip(read(caches, range(n)), want))
    store.close()


def test_wait_returns_only_once_the_daemon_no_longer_touches_the_blocks(daemon):
    """UCM reuses a block as soon as ``wait`` returns or raises, and the daemon's Backups cannot
    be cancelled: a dump whose wait runs out of time (io 0 ms, RPCs of 2 ms, 32 MiB blocks) must
    still end before ``wait`` comes back, so the engine's next bytes in that block never reach
    what another engine loads under the first block's id."""
    heads, dim = 128, 1024  # 16 tokens: 4 MiB per tensor-block, 8 tensors: 32 MiB per block
    ca = kv_caches(num_blocks=4, heads=heads, head_dim=dim)
    cb = kv_caches(num_blocks=4, heads=heads, head_dim=dim)
    a = KvcellarStore(ucm_config(ca, daemon.socket, kvcellar_io_timeout_ms=0,
                                 kvcellar_rpc_timeout_ms=2))
    cfg_b = ucm_config(cb, daemon.socket)
    cfg_b["unique_id"] = "engine-b"
    b = KvcellarStore(cfg_b)
    assert a.session.wait_active(5000) and b.session.wait_active(5000)
    loaded = 0
    for trial in range(5):
        bid = bytes([trial + 1]) * 16
        for t in tensors_of(ca):
            t[0].fill_(1.0)  # block 0: request X's KV
        try:
            a.wait(a.dump_data([bid], [0], block_addrs(ca, [0])))
        except (RuntimeError, StoreUnhealthyError):
            pass  # a failed dump is fine; what it may have stored must be X's bytes
        for t in tensors_of(ca):
            t[0].fill_(2.0)  # UCM gives block 0 to request Y
        for t in tensors_of(cb):
            t[0].zero_()
        if b.lookup([bid])[0]:
            try:
                b.wait(b.load_data([bid], [0], block_addrs(cb, [0])))
            except StoreNotFoundError:
                continue  # still being written when looked up: a miss, which UCM recomputes
            assert all(bool((t[0] == 1.0).all()) for t in tensors_of(cb)), \
                f"trial {trial}: block {bid.hex()} served bytes other than request X's"
            loaded += 1
    a.close()
    b.close()
    assert loaded, "no dump was ever stored"
