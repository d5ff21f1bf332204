"""The framework adapters (kvcellar.integrations.ucm, .aibrix, .lmcache) against kvcellard's
direct path on the same bytes, in one run against one kvcellard.

Each framework's adapter stores N objects (KV blocks, chunks) and loads them back through the
framework's own API, built by the framework's own factory:
    ucm             KvcellarStore from UCM 0.8.1's UcmConnectorFactoryV1 over vLLM's CPU KV
                    tensors: dump_data / load_data of the blocks' address rows, then wait
    aibrix zc       AIBrix 0.8.0's BaseKVCacheManager, L1 off, zero copy (the manager writes and
                    reads the connector's arena): allocate_for + put + flush / acquire
    aibrix copy     the same manager with the connector's zero copy off (one copy each way
                    between AIBrix's buffers and the arena)
    lmcache mp      LMCache 0.5.6's multiprocess L2 adapter (create_l2_adapter, type
                    native_plugin: NativeConnectorL2Adapter over KvcellarNativeClient's
                    submit_batch_set / submit_batch_get): submit_store_task / submit_load_task,
                    completions on the adapter's event fds
    lmcache inproc  LMCache 0.5.6's in-process remote connector as LMCache's RemoteBackend holds
                    it (an LMCacheEngine built by LMCacheEngineBuilder with
                    remote_storage_plugins: [kvcellar]): batched_put / batched_get on the
                    engine's event loop
and the direct path is a plain kvcellar Session of the same geometry: Session.backup of the same
bytes into the daemon's pool, Session.load of them into other blocks. Every object is a one-page
sequence on both paths (the adapters' objects are unrelated: parent none), split into calls of
at most max_batch_sequences as the adapters split theirs; the adapters are given room for a
whole call at once (AIBrix's arena, LMCache's ``slots``).

Per repetition (one untimed warm-up first) each pair runs adapter store, adapter load, direct
store, direct load, the adapter first in even repetitions and second in odd ones; every store
writes fresh keys, every load goes into zeroed memory and is compared byte for byte with what
was stored (a wrong byte ends the run with an error). Untimed: filling the engine's memory,
building keys and address rows, releasing what a load handed back. The table gives the median
GB/s of each path (object bytes moved per second) and the median and range over the
repetitions of the per-repetition ratio adapter/direct (1.00x: the adapter costs nothing).

    .venv-frameworks/bin/python client/python/bench/bench_frameworks.py            # ~30 s
    .venv-frameworks/bin/python client/python/bench/bench_frameworks.py --quick    # ~10 s
    .venv-frameworks/bin/python client/python/bench/bench_frameworks.py --json \\
        --objects 64 --object-kib 256 --repeats 7 --frameworks ucm,aibrix,lmcache
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcellar import Client, KvLayout, Namespace  # noqa: E402
from kvcellar.client import BackupSeq, LoadSeq, Session  # noqa: E402
from kvcellar.integrations._arena import SlotArena  # noqa: E402

FRAMEWORKS = ("ucm", "aibrix", "lmcache")
OP_TIMEOUT_MS = 60000
BLOCK_TOKENS = 16  # tokens per block (UCM, AIBrix) and per LMCache chunk
LAYERS = 4  # UCM and AIBrix: 4 layers of K and V; object bytes = 1 KiB x (heads x head_dim / 4)
HEADS = 4  # with head_dim = object_kib, an object is object_kib KiB in every framework
LMC_LAYERS = 2  # LMCache: [2, 2 layers, 16 tokens, 4 x object_kib] float32 = object_kib KiB
UCM_ALIGN = 4096  # ucm_connector._get_store_io_sizes pads a block's I/O size to 4 KiB


class Mismatch(RuntimeError):
    """A load delivered bytes other than those stored."""


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Mismatch(what)


def one_page_calls(keys: np.ndarray, blocks: np.ndarray, step: int, seq: type) -> list[list]:
    """Calls of at most ``step`` one-page sequences: key i in block blocks[i]."""
    return [[seq(keys[i:i + 1], blocks[i:i + 1]) for i in range(lo, min(len(keys), lo + step))]
            for lo in range(0, len(keys), step)]


class Direct:
    """kvcellar's own path over a registered layout: Session.backup of blocks [0, n) and
    Session.load into blocks [n, 2n), one-page sequences, fresh keys per repetition."""

    def __init__(self, client: Client, name: str, layout: KvLayout, page_size: int,
                 kv_dtype: str, n: int, verify: Callable[[], bool],
                 clear: Callable[[], None]) -> None:
        ns = Namespace(f"bench-direct-{name}", "r", kv_dtype, page_size,
                       layout="mla" if layout.mla else "mha", opaque_keys=True)
        self.session: Session = client.register(f"bench-direct-{name}", ns, layout=layout,
                                                load_slots=0, ready_slots=0,
                                                replace_existing=True)
        if not self.session.wait_active(10000):
            raise RuntimeError(f"direct {name}: the session did not register")
        self.name, self.n = name, n
        self.step = self.session.info().max_batch_sequences or n
        self.verify, self.clear = verify, clear
        self.keys: Optional[np.ndarray] = None

    def store(self, rep: int) -> float:
        digest = [hashlib.sha256(b"%s-%d-%d" % (self.name.encode(), rep, i)).digest()
                  for i in range(self.n)]
        self.keys = np.frombuffer(b"".join(digest), np.uint8).reshape(self.n, 32)
        calls = one_page_calls(self.keys, np.arange(self.n, dtype=np.uint32), self.step,
                               BackupSeq)

        def run() -> None:
            for seqs in calls:
                st = self.session.backup(seqs, ready=False).wait(OP_TIMEOUT_MS)
                check(st.done and list(st.leading_ok_pages) == [1] * len(seqs),
                      f"direct {self.name}: backup {st.state} {st.reason}")
        return timed(run)

    def load(self, rep: int) -> float:
        calls = one_page_calls(self.keys, np.arange(self.n, 2 * self.n, dtype=np.uint32),
                               self.step, LoadSeq)
        self.clear()

        def run() -> None:
            for seqs in calls:
                st = self.session.load(seqs, layerwise=False).wait(OP_TIMEOUT_MS)
                check(st.done and list(st.leading_ok_pages) == [1] * len(seqs),
                      f"direct {self.name}: load {st.state} {st.reason}")
        sec = timed(run)
        check(self.verify(), f"direct {self.name}: loaded bytes differ from the stored ones")
        return sec

    def close(self) -> None:
        self.session.close()


def plain_arena(n: int, obj: int, seed: int) -> tuple[torch.Tensor, KvLayout]:
    """A [2n, obj] byte tensor registered as /proc/<pid>/mem, rows [0, n) random."""
    arena = SlotArena(obj, 2 * n)
    arena.tensor[:n] = torch.randint(0, 256, (n, obj), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed))
    return arena.tensor, arena.layout("bench-direct")


def plain_direct(client: Client, name: str, n: int, obj: int, seed: int) -> tuple[Direct,
                                                                                   torch.Tensor]:
    arena, layout = plain_arena(n, obj, seed)
    direct = Direct(client, name, layout, 1, "int8", n,
                    verify=lambda: torch.equal(arena[n:], arena[:n]),
                    clear=lambda: arena[n:].zero_())
    return direct, arena


class Pair:
    """One row: an adapter's store and load, and the direct path's, on the same bytes."""

    name = ""

    def adapter_store(self, rep: int) -> float:
        raise NotImplementedError

    def adapter_load(self, rep: int) -> float:
        raise NotImplementedError

    direct: Direct

    def close(self) -> None:
        self.direct.close()


# ---- UCM ---------------------------------------------------------------------------------------


class UcmPair(Pair):
    """KvcellarStore built by UCM's factory over vLLM's CPU KV tensors (per layer
    [2, blocks, 16 tokens, heads, head_dim] bf16); the direct path registers the store's own
    layout (the same tensors) under a second session."""

    name = "ucm"

    def __init__(self, client: Client, socket: str, n: int, kib: int) -> None:
        from ucm.store.factory_v1 import UcmConnectorFactoryV1

        self.n = n
        self.caches = [torch.zeros((2, 2 * n, BLOCK_TOKENS, HEADS, kib), dtype=torch.bfloat16)
                       for _ in range(LAYERS)]
        self.tensors = [t for kv in self.caches for t in (kv[0], kv[1])]
        g = torch.Generator().manual_seed(1)
        for t in self.tensors:
            t[:n] = torch.randn(t[:n].shape, generator=g).to(torch.bfloat16)
        sizes = [math.prod(t.shape[1:]) * t.element_size() for t in self.tensors]
        padded = (sum(sizes) + UCM_ALIGN - 1) // UCM_ALIGN * UCM_ALIGN
        # The dict UCMDirectConnector._create_store hands a worker's store (see test_ucm.py).
        config = {"ucm_connector_name": "KvcellarStore", "kvcellar_model": "bench-ucm",
                  "kvcellar_socket": socket, "kvcellar_io_timeout_ms": OP_TIMEOUT_MS,
                  "kvcellar_instance_id": "bench-ucm", "share_buffer_enable": False,
                  "unique_id": "bench-ucm", "tensor_layout": "gqa", "device_id": -1,
                  "tensor_size_list": sizes, "shard_size": padded, "block_size": padded,
                  "local_rank_size": 1,
                  "gpu_kv_buffer_addrs": [t[0].data_ptr() for t in self.tensors],
                  "gpu_kv_buffer_sizes": [t.shape[0] * s for t, s in zip(self.tensors, sizes)],
                  "posix_gc_enable": False}
        self.store = UcmConnectorFactoryV1.create_connector("KvcellarStore", config,
                                                            "kvcellar.integrations.ucm")
        if not self.store.session.wait_active(10000):
            raise RuntimeError("ucm: the store's session did not register")
        self.object_bytes = self.store.layout.page_object_bytes
        # KVCacheLayout.extract_block_addrs: one row per block, one address per tensor.
        base = np.asarray([t[0].data_ptr() for t in self.tensors], np.uint64)
        stride = np.asarray(sizes, np.uint64)
        self.src = np.arange(n, dtype=np.uint64)[:, None] * stride + base
        self.dst = np.arange(n, 2 * n, dtype=np.uint64)[:, None] * stride + base
        self.ids: list[bytes] = []
        self.direct = Direct(client, "ucm", self.store.layout, BLOCK_TOKENS, "bf16", n,
                             verify=self.verify, clear=self.clear)

    def verify(self) -> bool:
        n = self.n
        return all(torch.equal(t[n:].view(torch.int16), t[:n].view(torch.int16))
                   for t in self.tensors)

    def clear(self) -> None:
        for t in self.tensors:
            t[self.n:].zero_()

    def adapter_store(self, rep: int) -> float:
        self.ids = [hashlib.md5(b"ucm-%d-%d" % (rep, i)).digest() for i in range(self.n)]
        shards = [0] * self.n
        return timed(lambda: self.store.wait(self.store.dump_data(self.ids, shards, self.src)))

    def adapter_load(self, rep: int) -> float:
        self.clear()
        shards = [0] * self.n
        sec = timed(lambda: self.store.wait(self.store.load_data(self.ids, shards, self.dst)))
        check(self.verify(), "ucm: loaded bytes differ from the stored ones")
        return sec

    def close(self) -> None:
        super().close()
        self.store.close()


# ---- AIBrix ------------------------------------------------------------------------------------


class AibrixPair(Pair):
    """AIBrix's BaseKVCacheManager with kvcellar as its L2 backend (L1 off), zero copy or copy
    mode; the direct path moves the same object bytes from a plain registered tensor."""

    def __init__(self, client: Client, socket: str, n: int, kib: int, zero_copy: bool) -> None:
        from aibrix_kvcache import (BaseKVCacheManager, KVCacheBlockLayout, KVCacheBlockSpec,
                                    KVCacheConfig, KVCacheTensorSpec, ModelSpec)
        from aibrix_kvcache import cache_manager
        from kvcellar.integrations import aibrix as kvc_aibrix

        self.name = "aibrix zc" if zero_copy else "aibrix copy"
        self.n = n
        cache_manager.TESTING_DISABLE_PIN_MEMORY = True  # CPU only, as AIBrix's own tests
        spec = KVCacheBlockSpec(block_ntokens=BLOCK_TOKENS, block_dtype=torch.bfloat16,
                                block_layout=KVCacheBlockLayout.NCLD,
                                tensor_spec=KVCacheTensorSpec(heads=list(range(HEADS)),
                                                              layers=list(range(LAYERS)),
                                                              head_size=kib))
        self.object_bytes = spec.block_nbytes
        # Room for a whole call's objects at once, twice (the store's and the load's).
        arena_mb = max(4, (2 * n + 4) * self.object_bytes // (1 << 20) + 1)
        for k in [k for k in os.environ if k.startswith("AIBRIX_KV_CACHE_OL_")]:
            del os.environ[k]
        os.environ.update({
            "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "kvcellar",
            "AIBRIX_KV_CACHE_OL_L2_CACHE_NAMESPACE": f"bench-{'zc' if zero_copy else 'copy'}",
            "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "0",
            "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_TYPE": "ALL",
            "AIBRIX_KV_CACHE_OL_KVCELLAR_SOCKET": socket,
            "AIBRIX_KV_CACHE_OL_KVCELLAR_ZERO_COPY": "1" if zero_copy else "0",
            "AIBRIX_KV_CACHE_OL_KVCELLAR_ARENA_MB": str(arena_mb)})
        kvc_aibrix.install()
        self.manager = BaseKVCacheManager(KVCacheConfig(
            block_spec=spec, model_spec=ModelSpec(n * BLOCK_TOKENS)))
        conn = self.manager._l2_cache._backend
        if not conn.session.wait_active(10000):
            raise RuntimeError(f"{self.name}: the connector's session did not register")
        self.direct, self.arena = plain_direct(client, self.name.replace(" ", "-"), n,
                                               self.object_bytes, seed=2)
        self.want = self.arena[:n]
        self.tokens: Any = None

    def _tokens(self, rep: int) -> Any:
        from aibrix_kvcache import TokenListView

        rng = np.random.default_rng([3, rep])
        return TokenListView(rng.integers(0, 50000, self.n * BLOCK_TOKENS).astype(np.int32))

    def adapter_store(self, rep: int) -> float:
        m = self.manager
        self.tokens = self._tokens(rep)
        st = m.allocate_for(None, self.tokens)
        check(st.is_ok(), f"{self.name}: allocate_for {st}")
        handle = st.get()
        blocks = handle.to_tensors()
        check(len(blocks) == self.n, f"{self.name}: {len(blocks)} blocks allocated")
        for i, t in enumerate(blocks):  # the engine's device->host copy: not timed
            t.view(torch.uint8).view(-1).copy_(self.want[i])

        def run() -> None:
            st = m.put(None, self.tokens, handle)
            check(st.is_ok() and st.get() == self.n * BLOCK_TOKENS, f"{self.name}: put {st}")
            check(m.flush().is_ok(), f"{self.name}: flush")
        return timed(run)

    def adapter_load(self, rep: int) -> float:
        got: list = []
        sec = timed(lambda: got.append(self.manager.acquire(None, self.tokens)))
        st = got[0]
        check(st.is_ok() and st.get()[0] == self.n * BLOCK_TOKENS,
              f"{self.name}: acquire {st}")
        handle = st.get()[1]
        exact = all(torch.equal(t.view(torch.uint8).view(-1), self.want[i])
                    for i, t in enumerate(handle.to_tensors()))
        handle.release()
        self.manager.flush()  # AIBrix queues the release on its L2 loop
        check(exact, f"{self.name}: acquired bytes differ from the stored ones")
        return sec

    def close(self) -> None:
        super().close()
        self.manager.close()


# ---- LMCache -----------------------------------------------------------------------------------


class LmcacheMpPair(Pair):
    """LMCache's MP-server L2 adapter built by LMCache's create_l2_adapter from the
    ``--l2-adapter`` JSON a user writes; objects are L1 buffers of object_kib KiB."""

    name = "lmcache mp"

    def __init__(self, client: Client, socket: str, n: int, kib: int) -> None:
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
        from lmcache.v1.memory_management import (MemoryFormat, MemoryObjMetadata,
                                                  TensorMemoryObj)

        self.n, self.object_bytes = n, kib << 10
        spec = json.dumps({"type": "native_plugin",
                           "module_path": "kvcellar.integrations.lmcache",
                           "class_name": "KvcellarNativeClient",
                           "adapter_params": {"socket": socket, "object_bytes": self.object_bytes,
                                              "slots": n, "io_timeout_ms": OP_TIMEOUT_MS,
                                              "instance_id": "bench-lmcache-mp"}})
        cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
        self.adapter = create_l2_adapter(cfg.adapters[0])
        self.direct, self.arena = plain_direct(client, "lmcache-mp", n, self.object_bytes, 4)
        self.dst = torch.zeros_like(self.arena[:n])

        def objs(rows: torch.Tensor) -> list:
            return [TensorMemoryObj(raw_data=row, metadata=MemoryObjMetadata(
                shape=torch.Size([row.numel()]), dtype=row.dtype, address=0,
                phy_size=row.numel(), ref_count=1, pin_count=0, fmt=MemoryFormat.BINARY_BUFFER),
                parent_allocator=None) for row in rows]
        self.src_objs, self.dst_objs = objs(self.arena[:n]), objs(self.dst)
        self.key = lambda rep, i: ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(rep * n + i),
                                            model_name="bench-mp", kv_rank=0)
        self.keys: list = []

    def _await(self, fd: int, poll: Callable[[], Any]) -> Any:
        import select

        p = select.poll()
        p.register(fd, select.POLLIN)
        deadline = time.monotonic() + OP_TIMEOUT_MS / 1000
        while time.monotonic() < deadline:
            p.poll(100)
            got = poll()
            if got is not None:
                return got
        raise RuntimeError(f"{self.name}: no completion")

    def adapter_store(self, rep: int) -> float:
        a = self.adapter
        self.keys = [self.key(rep + 1, i) for i in range(self.n)]

        def run() -> None:
            tid = a.submit_store_task(self.keys, self.src_objs)
            done = self._await(a.get_store_event_fd(),
                               lambda: a.pop_completed_store_tasks().get(tid))
            check(done.is_successful(), f"{self.name}: store task failed")
        return timed(run)

    def adapter_load(self, rep: int) -> float:
        a = self.adapter
        self.dst.zero_()

        def run() -> None:
            tid = a.submit_load_task(self.keys, self.dst_objs)
            bits = self._await(a.get_load_event_fd(), lambda: a.query_load_result(tid))
            check(all(bits.test(i) for i in range(self.n)), f"{self.name}: load missed")
        sec = timed(run)
        check(torch.equal(self.dst, self.arena[:self.n]),
              f"{self.name}: loaded bytes differ from the stored ones")
        return sec

    def close(self) -> None:
        super().close()
        self.adapter.close()


class LmcacheInprocPair(Pair):
    """The remote connector LMCache's RemoteBackend holds (InstrumentedRemoteConnector over
    KvcellarConnector), from an LMCacheEngine configured as a user configures it; objects are
    LMCache's KV_2LTD chunk objects from the engine's LocalCPUBackend."""

    name = "lmcache inproc"

    def __init__(self, client: Client, socket: str, n: int, kib: int) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.utils import CacheEngineKey

        self.n = n
        shape = torch.Size([2, LMC_LAYERS, BLOCK_TOKENS, HEADS * kib])
        self.object_bytes = math.prod(shape) * 4
        # Room for the stored objects and the loaded ones, with LMCache's allocator slack.
        local_gb = 2.5 * n * (self.object_bytes + 4096) / 1e9 + 0.01
        cfg = LMCacheEngineConfig.from_dict({
            "chunk_size": BLOCK_TOKENS, "local_cpu": False, "max_local_cpu_size": local_gb,
            "save_unfull_chunk": True, "blocking_timeout_secs": 60,
            "remote_storage_plugins": ["kvcellar"],
            "extra_config": {
                "remote_storage_plugin.kvcellar.module_path": "kvcellar.integrations.lmcache",
                "remote_storage_plugin.kvcellar.class_name": "KvcellarConnectorAdapter",
                "remote_storage_plugin.kvcellar.socket": socket,
                "remote_storage_plugin.kvcellar.slots": n,
                "remote_storage_plugin.kvcellar.io_timeout_ms": OP_TIMEOUT_MS,
                "remote_storage_plugin.kvcellar.instance_id": "bench-lmcache-inproc"}})
        meta = LMCacheMetadata(model_name="bench-inproc", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.float32,
                               kv_shape=(LMC_LAYERS, 2, BLOCK_TOKENS, HEADS, kib),
                               chunk_size=BLOCK_TOKENS)
        self.engine_name = f"bench-inproc-{os.getpid()}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.engine_name, cfg, meta, MockGPUConnector((LMC_LAYERS, 2, 2 * n, HEADS, kib)),
            lambda t, r: None, lambda o, r: o)
        self.engine.post_init()
        remote = self.engine.storage_manager.storage_backends.get("RemoteBackend-kvcellar")
        if remote is None or remote.connection is None:
            raise RuntimeError(f"{self.name}: LMCache did not connect the kvcellar plugin")
        self.conn, self.loop, self.cpu = remote.connection, remote.loop, remote.local_cpu_backend
        if not self.conn._connector.store.session.wait_active(10000):
            raise RuntimeError(f"{self.name}: the connector's session did not register")
        self.direct, self.arena = plain_direct(client, "lmcache-inproc", n, self.object_bytes, 5)
        self.objs = []
        for i in range(n):
            o = self.cpu.allocate(shape, torch.float32, MemoryFormat.KV_2LTD)
            if o is None:
                raise RuntimeError(f"{self.name}: LMCache's local CPU backend is full")
            np.frombuffer(o.byte_array, np.uint8)[:] = self.arena[i].numpy()
            self.objs.append(o)
        self.key = lambda rep, i: CacheEngineKey("bench-inproc", 1, 0, rep * n + i,
                                                 torch.float32)
        self.keys: list = []

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(OP_TIMEOUT_MS / 1000)

    def adapter_store(self, rep: int) -> float:
        self.keys = [self.key(rep + 1, i) for i in range(self.n)]
        for o in self.objs:
            o.ref_count_up()  # batched_put releases one reference, as RemoteBackend's put does
        sec = timed(lambda: self._run(self.conn.batched_put(self.keys, self.objs)))
        check(self.conn.batched_contains(self.keys) == self.n, f"{self.name}: put dropped")
        return sec

    def adapter_load(self, rep: int) -> float:
        got: list = []
        sec = timed(lambda: got.extend(self._run(self.conn.batched_get(self.keys))))
        exact = all(g is not None and bytes(g.byte_array) == bytes(o.byte_array)
                    for g, o in zip(got, self.objs))
        for g in got:
            if g is not None:
                g.ref_count_down()
        check(exact and len(got) == self.n,
              f"{self.name}: loaded objects missing or differ from the stored ones")
        return sec

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        super().close()
        for o in self.objs:
            o.ref_count_down()
        LMCacheEngineBuilder.destroy(self.engine_name)


# ---- the run -----------------------------------------------------------------------------------


def pairs_for(framework: str, client: Client, socket: str, n: int, kib: int) -> list[Pair]:
    if framework == "ucm":
        return [UcmPair(client, socket, n, kib)]
    if framework == "aibrix":
        return [AibrixPair(client, socket, n, kib, zero_copy=True),
                AibrixPair(client, socket, n, kib, zero_copy=False)]
    return [LmcacheMpPair(client, socket, n, kib), LmcacheInprocPair(client, socket, n, kib)]


def measure(pair: Pair, repeats: int) -> list[dict[str, Any]]:
    """Rows ``<pair> store`` and ``<pair> load``: per repetition (after one warm-up) the
    adapter's and the direct path's seconds, alternating which goes first."""
    secs: dict[str, list[float]] = {k: [] for k in ("as", "al", "ds", "dl")}
    for rep in range(repeats + 1):
        def adapter() -> tuple[float, float]:
            return pair.adapter_store(rep), pair.adapter_load(rep)

        def direct() -> tuple[float, float]:
            return pair.direct.store(rep), pair.direct.load(rep)
        if rep % 2 == 0:
            a, d = adapter(), direct()
        else:
            d, a = direct(), adapter()
        if rep == 0:
            continue
        for k, v in zip(("as", "al", "ds", "dl"), (*a, *d)):
            secs[k].append(v)
    nbytes = pair.direct.n * pair.object_bytes
    rows = []
    for op, a, d in (("store", "as", "ds"), ("load", "al", "dl")):
        ratios = [td / ta for ta, td in zip(secs[a], secs[d])]
        rows.append({"call": f"{pair.name} {op}", "objects": pair.direct.n,
                     "object_bytes": pair.object_bytes,
                     "adapter_gbps": nbytes / statistics.median(secs[a]) / 1e9,
                     "direct_gbps": nbytes / statistics.median(secs[d]) / 1e9,
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios), "repeats": repeats,
                     "verified_loads": repeats + 1})
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvcellard_process import temp_daemons

    n, kib = args.objects, args.object_kib
    # Every store writes fresh keys: room for all of them, so no store waits for an eviction.
    pages = 2 * 5 * n * (args.repeats + 1)
    pool_mib = args.pool_mib or max(256, pages * (kib + 1) // 1024 * 5 // 4 + 64)
    pool_mib = (pool_mib + 63) // 64 * 64  # a whole number of pool.region_size (64 MiB)
    rows: list[dict[str, Any]] = []
    with temp_daemons("kvc-bench-frameworks-") as daemons:
        d = daemons.start(args=("--set", f"pool.capacity={pool_mib}MiB",
                                "--set", "device.kind=sim"))
        with Client(d.socket, rpc_timeout_ms=10000) as client:
            for fw in args.frameworks:
                for pair in pairs_for(fw, client, d.socket, n, kib):
                    try:
                        rows += measure(pair, args.repeats)
                    finally:
                        pair.close()
        return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=64, help="objects per store and load")
    ap.add_argument("--object-kib", type=int, default=256,
                    help="bytes of one object (block, chunk) in KiB")
    ap.add_argument("--repeats", type=int, default=7, help="timed repetitions per pair")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help="comma-separated, of " + ", ".join(FRAMEWORKS))
    ap.add_argument("--pool-mib", type=int, default=0, help="kvcellard's pool; 0: enough "
                    "for every store of the run")
    ap.add_argument("--quick", action="store_true",
                    help="32 objects of 64 KiB, 3 repetitions (a smoke run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.objects, args.object_kib, args.repeats = 32, 64, 3
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in args.frameworks if f not in FRAMEWORKS]
    if bad or not args.frameworks:
        ap.error(f"--frameworks: unknown {bad} (choose from {', '.join(FRAMEWORKS)})")
    if args.objects < 1 or args.repeats < 1 or args.object_kib < 1:
        ap.error("--objects, --object-kib and --repeats must be at least 1")
    try:
        rows = run(args)
    except Mismatch as e:
        print(f"bench_frameworks: WRONG BYTES: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"objects": args.objects, "object_kib": args.object_kib,
                          "repeats": args.repeats, "rows": rows}, indent=1))
    else:
        print(f"{args.objects} objects of {args.object_kib} KiB per call, one kvcellard (sim "
              f"device), {args.repeats} repetitions after a warm-up; medians, ratio = "
              "adapter/direct (range over repetitions)")
        print("| call | adapter GB/s | direct GB/s | adapter/direct | range | verified loads |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['call']} | {r['adapter_gbps']:.2f} | {r['direct_gbps']:.2f} | "
                  f"{r['ratio_median']:.2f}x | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | "
                  f"{r['verified_loads']}/{r['verified_loads']} |")
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # argparse
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # LMCache's engine threads are not daemon threads
