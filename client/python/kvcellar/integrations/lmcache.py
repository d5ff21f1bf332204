"""kvcellar as LMCache's shared node tier, written against LMCache 0.5.6 (the 0.5.6 wheel's
``lmcache/v1/storage_backend/connector/`` and ``lmcache/v1/distributed/l2_adapters/``). Two
plug-in points, one store underneath:

In-process engines (LMCacheEngine inside vLLM or SGLang): a remote storage plugin. LMCache's
ConnectorManager imports ``module_path``/``class_name`` and, for a ``ConnectorAdapter``
subclass, asks it ``can_parse("plugin://<name>")`` and ``create_connector(context)``::

    remote_storage_plugins: ["kvcellar"]
    extra_config:
      remote_storage_plugin.kvcellar.module_path: kvcellar.integrations.lmcache
      remote_storage_plugin.kvcellar.class_name: KvcellarConnectorAdapter
      remote_storage_plugin.kvcellar.socket: /run/kvcellar/kvcellard.sock   # optional

The connector is LMCache's ``RemoteConnector`` (exists/exists_sync/get/put, batched_get,
batched_put, batched_contains, batched_async_contains); LMCache's RemoteBackend calls it.

The multiprocess server (``lmcache server``): an L2 adapter of type ``native_plugin``. LMCache's
NativeConnectorL2Adapter wraps the client object and runs its event-fd demultiplexer::

    --l2-adapter '{"type": "native_plugin", "module_path": "kvcellar.integrations.lmcache",
                   "class_name": "KvcellarNativeClient",
                   "adapter_params": {"object_bytes": 1048576, "socket": "..."}}'

``object_bytes`` is the L1 object size of one full chunk (2 x layers x chunk_size x hidden x
dtype bytes for the KV_2LTD format); larger objects are refused (the store task fails).

How the bytes move. kvcellard moves a page between its pool and an engine's memory by block
index: a block is ``bytes_per_block`` bytes at a fixed stride in a registered region, and blocks
never overlap (core/kv_layout.h). LMCache hands the backend objects of several sizes at
arbitrary addresses: the in-process LocalCPUBackend and the MP server's L1 arena both allocate
first-fit (MixedMemoryAllocator, ``align_bytes`` granules) and a partial last chunk is smaller
than a full one, so no fixed-stride block grid covers LMCache's objects. Each adapter therefore
owns an arena (one torch CPU tensor of ``slots`` slots, registered once as ``/proc/<pid>/mem``;
the daemon reads and writes it with process_vm_readv/writev) and copies each object once
between LMCache's memory and a slot: a put is copy-in + Backup, a get is Load + copy-out. The
copy is measured against kvcellard's direct path by bench/bench_frameworks.py.

Pages. One LMCache object is one kvcellar page, a one-page sequence of its own (parent None:
LMCache's chunk hashes already chain the prefix). The page is the whole slot: a 256-byte header
(magic, the object's byte length, the 32-byte key digest, and for the in-process connector
LMCache's RemoteMetadata: shapes, dtypes, format) then the object's bytes. A get serves an
object only when the header's magic and digest match the key and its length equals what the
caller expects (MP: the L1 buffer's length; in-process: the bytes of the shapes the header
names), so an object of another size, or a slot's stale bytes, are never served.

Keys. The daemon's opaque 32-byte key of an object is
``sha256(b"lmcache-0.5.6\\0" + <LMCache's key string>)``: ``CacheEngineKey.to_string()``
in-process (model, world size, worker id, chunk hash, dtype, tags) and the native wire key in
the MP server (model, kv rank, object group, chunk hash, cache salt). The namespace holds the
object geometry (in-process: model, chunk size, shapes, dtypes, format, world size; MP:
``object_bytes``) and the tenant, so engines whose objects differ never share a page.

Failure semantics, matched to LMCache's own: a daemon that is down, slow or refusing is a miss
(contains False, get None, a put dropped with a log line) exactly as RemoteBackend treats a
failing built-in connector (fs, redis); the session registers again by itself when the daemon
is back. Bad options raise ValueError naming the key from ``create_connector`` (LMCache then
logs "Failed to initialize/re-establish remote connection" and runs without the backend, as
for a bad SageMaker HyperPod option) or from the MP adapter's constructor (the server refuses
to start, as for a bad built-in adapter config).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ..client import Client, LoadSeq, BackupSeq, Session
from ..keys import Namespace
from ..layout import kv_dtype_for
from ._arena import SlotArena
from ._options import parse_options

LMCACHE_VERSION = "0.5.6"  # the RemoteConnector and native L2 client contracts implemented here

log = logging.getLogger(__name__)

# The slot header: magic, object bytes, key digest, metadata length, LMCache's RemoteMetadata
# (4 * (2 + 5 * groups) bytes: 1 group 28 bytes). 256 keeps the object 256-byte aligned and
# holds the metadata of up to 10 object groups.
HEADER_BYTES = 256
_MAGIC = b"KVCLMC01"
_HEADER = struct.Struct("<8sQ32sI")
_KEY_SALT = f"lmcache-{LMCACHE_VERSION}\0".encode()


def object_digest(key_string: str) -> bytes:
    """The daemon's 32-byte opaque key of the LMCache object named ``key_string``."""
    return hashlib.sha256(_KEY_SALT + key_string.encode()).digest()


# ---- the store both plug-ins share -------------------------------------------------------------


class ObjectStore:
    """LMCache objects as kvcellar pages through an arena of ``slots`` slots this process owns.

    Threads: any; put/get/exists may run concurrently (slots are handed out under a lock, the
    Session is thread-safe). No call raises: a failure is False / None with a log line.
    """

    def __init__(self, client: Client, ns: Namespace, instance_id: str, object_bytes: int,
                 slots: int, io_timeout_ms: int, write_policy: Optional[str],
                 prefetch_policy: Optional[str], prefetch_timeout_ms: int) -> None:
        self.object_bytes = object_bytes
        # Slots are whole 4 KiB pages: the daemon copies page-aligned runs several times faster
        # (process_vm_readv) than runs that start mid-page (bench/bench_frameworks.py).
        self.slot_bytes = -(-(HEADER_BYTES + object_bytes) // 4096) * 4096
        self.io_timeout_ms = io_timeout_ms
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_ms = prefetch_timeout_ms
        # Slots of ops that did not end in time stay out of use until they do (_arena).
        self.slots = SlotArena(self.slot_bytes, slots)
        self._np = self.slots.tensor.numpy()
        self.session: Session = client.register(
            instance_id, ns, layout=self.slots.layout("lmcache-arena"), load_slots=0,
            ready_slots=0, replace_existing=True, engine_name=f"lmcache-{LMCACHE_VERSION}")

    def _rounds(self, n: int) -> Any:
        """The batch of ``n`` objects in rounds of as many slots as are free (waiting up to
        io_timeout_ms for one): (index of the round's first object, its slots)."""
        i = 0
        while i < n:
            slots = self.slots.take(n - i, self.session, self.io_timeout_ms / 1000)
            if not slots:
                log.warning("kvcellar: no free slot in %d ms (%d held by ops the daemon has not "
                            "ended)", self.io_timeout_ms, self.slots.held)
                return
            try:
                yield i, slots
            finally:
                self.slots.give(slots)
            i += len(slots)

    def _outcome(self, op: Any, slots: list[int], what: str) -> Optional[Any]:
        """The op's status once it has ended within io_timeout_ms, else None (its slots held
        until it ends); logs what did not succeed."""
        st = self.slots.outcome(op, slots, self.io_timeout_ms)
        if st is None or not st.done:
            log.debug("kvcellar: %s of %d objects: %s", what, len(slots),
                      op.reason if st is None else st.reason or st.state)
        return st

    def put(self, digests: Sequence[bytes], views: Sequence[memoryview],
            metas: Optional[Sequence[bytes]] = None) -> list[bool]:
        """Stores each object (its bytes ``views[i]``, LMCache's metadata ``metas[i]``); per
        object True once the daemon holds it."""
        ok = [False] * len(digests)
        try:
            for start, slots in self._rounds(len(digests)):
                seqs, idx = [], []
                for j, slot in enumerate(slots):
                    i = start + j
                    data = np.frombuffer(views[i], dtype=np.uint8)
                    meta = metas[i] if metas is not None else b""
                    if len(data) > self.object_bytes or _HEADER.size + len(meta) > HEADER_BYTES:
                        log.warning("kvcellar: put: object of %d bytes (metadata %d) exceeds "
                                    "object_bytes %d", len(data), len(meta), self.object_bytes)
                        continue
                    row = self._np[slot]
                    row[:_HEADER.size] = np.frombuffer(
                        _HEADER.pack(_MAGIC, len(data), digests[i], len(meta)), np.uint8)
                    row[_HEADER.size:_HEADER.size + len(meta)] = np.frombuffer(meta, np.uint8)
                    row[HEADER_BYTES:HEADER_BYTES + len(data)] = data
                    seqs.append(BackupSeq(_key_array(digests[i]), np.array([slot], np.uint32)))
                    idx.append(i)
                if not seqs:
                    continue
                op = self.session.backup(seqs, ready=False, write_policy=self.write_policy)
                st = self._outcome(op, slots, "put")
                if st is None or not st.done:
                    continue
                for i, n in zip(idx, st.leading_ok_pages):
                    ok[i] = n == 1
        except Exception as e:
            log.warning("kvcellar: put: %s", e)
        return ok

    def get(self, digests: Sequence[bytes],
            deliver: Callable[[int, memoryview, bytes], bool]) -> list[bool]:
        """Loads each object into a slot and hands ``deliver(i, bytes, metadata)`` the object's
        bytes (a view of the slot, valid during the call); per object True when the header
        matched its key and ``deliver`` took the bytes."""
        ok = [False] * len(digests)
        try:
            for start, slots in self._rounds(len(digests)):
                seqs = [LoadSeq(_key_array(digests[start + j]), np.array([s], np.uint32))
                        for j, s in enumerate(slots)]
                for s in slots:  # a slot's stale header must never pass for a loaded one
                    self._np[s, :8] = 0
                op = self.session.load(seqs, layerwise=False)
                st = self._outcome(op, slots, "get")
                if st is None or not st.done:
                    continue
                for j, (slot, n) in enumerate(zip(slots, st.leading_ok_pages)):
                    i = start + j
                    if n != 1:
                        continue
                    row = self._np[slot]
                    magic, nbytes, digest, mlen = _HEADER.unpack_from(row)
                    if (magic != _MAGIC or digest != digests[i] or nbytes > self.object_bytes
                            or _HEADER.size + mlen > HEADER_BYTES):
                        log.warning("kvcellar: get: page of another object under key %s",
                                    digests[i].hex()[:16])
                        continue
                    meta = row[_HEADER.size:_HEADER.size + mlen].tobytes()
                    ok[i] = bool(deliver(i, memoryview(row[HEADER_BYTES:HEADER_BYTES + nbytes]),
                                         meta))
        except Exception as e:
            log.warning("kvcellar: get: %s", e)
        return ok

    def exists(self, digests: Sequence[bytes]) -> list[bool]:
        """Per object, whether the daemon's pool holds it (L3-only objects are brought into the
        pool first under ``prefetch_policy``)."""
        if not digests:
            return []
        reply = self.session.match([_key_array(d) for d in digests], by_keys=True,
                                   prefetch=self.prefetch_policy,
                                   prefetch_timeout_ms=self.prefetch_timeout_ms)
        if not reply.ok:
            log.debug("kvcellar: exists of %d objects: %s", len(digests), reply.reason)
        return [r.l2_hit_pages >= 1 for r in reply.results]

    def close(self) -> None:
        self.session.close()


def _key_array(digest: bytes) -> np.ndarray:
    return np.frombuffer(digest, dtype=np.uint8).reshape(1, 32)


# ---- options -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorOptions:
    """``remote_storage_plugin.<name>.<key>`` keys of LMCache's extra_config (in-process), or
    the ``adapter_params`` of the MP server's native_plugin adapter, with their defaults."""

    socket: Optional[str] = None  # kvcellard's address; None: the client library's default
    tenant: str = ""  # the namespace's tenant
    instance_id: Optional[str] = None  # None: "lmcache-<host>-<pid>"
    model_revision: str = ""  # the weights' revision, when the model name does not pin it
    slots: int = 16  # arena slots: objects in flight at once (each object_bytes + 256 B)
    rpc_timeout_ms: int = 250  # deadline of each call to the daemon
    register_timeout_ms: int = 2000  # deadline of one registration attempt
    io_timeout_ms: int = 5000  # the longest a put or get waits for the daemon's copy
    prefetch_policy: str = "wait_complete"  # L3 -> pool in exists: or none, timeout
    prefetch_timeout_ms: int = 5000  # the longest exists waits for L3 pages
    write_policy: Optional[str] = None  # L3 writes of puts; None: the daemon's default
    object_bytes: int = 0  # MP only (required there): one full chunk's L1 object bytes

    @classmethod
    def parse(cls, extra: Any, what: str) -> "ConnectorOptions":
        opts = parse_options(cls, extra, what)
        if opts.slots < 1:
            raise ValueError(f"{what}: slots (must be at least 1)")
        return opts


def _client(o: ConnectorOptions) -> Client:
    return Client(o.socket, rpc_timeout_ms=o.rpc_timeout_ms,
                  register_timeout_ms=o.register_timeout_ms)


def _instance_id(o: ConnectorOptions, what: str) -> str:
    return o.instance_id or f"lmcache-{what}-{os.uname().nodename}-{os.getpid()}"


# ---- in-process: LMCache's RemoteConnector -----------------------------------------------------

from lmcache.v1.memory_management import MemoryObj  # noqa: E402
from lmcache.v1.protocol import RemoteMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import (ConnectorAdapter,  # noqa: E402
                                                  ConnectorContext, extract_plugin_type)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector  # noqa: E402

PLUGIN_TYPE = "kvcellar"
# extra_config keys of a remote storage plugin that belong to LMCache (connector/__init__.py).
_LMCACHE_KEYS = ("module_path", "class_name")


def plugin_options(extra_config: Optional[dict], plugin_name: str) -> ConnectorOptions:
    """This plug-in's ``remote_storage_plugin.<plugin_name>.*`` keys, checked."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    mine = {k[len(prefix):]: v for k, v in (extra_config or {}).items() if k.startswith(prefix)}
    for k in _LMCACHE_KEYS:
        mine.pop(k, None)
    return ConnectorOptions.parse(mine, f"extra_config remote_storage_plugin.{plugin_name}")


class KvcellarConnector(RemoteConnector):
    """LMCache's RemoteConnector over kvcellard. LMCache's event loop calls the async methods;
    the blocking daemon calls run in the loop's default executor. Objects are whole chunks or a
    request's partial last chunk (fewer tokens, the same per-token bytes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: str = PLUGIN_TYPE) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        meta = local_cpu_backend.metadata
        self.options = plugin_options(config.extra_config if config else None, plugin_name)
        if self.options.object_bytes:
            raise ValueError(f"extra_config remote_storage_plugin.{plugin_name}: object_bytes "
                             "(MP server only: in-process the chunk geometry gives it)")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        geometry = hashlib.sha256(repr((
            [tuple(s) for s in self.meta_shapes], [str(d) for d in self.meta_dtypes],
            str(self.meta_fmt), int(meta.chunk_size), int(meta.world_size),
            bool(meta.use_mla))).encode()).hexdigest()[:16]
        ns = Namespace(str(meta.model_name), f"{self.options.model_revision}|lmcache-inproc|"
                       f"{geometry}", kv_dtype_for(self.meta_dtypes[0]) or "int8", int(meta.chunk_size),
                       layout="mla", tp_size=1,
                       tenant=self.options.tenant, opaque_keys=True)
        self.client = _client(self.options)
        self.store = ObjectStore(self.client, ns, _instance_id(self.options, "inproc"),
                                 self.full_chunk_size_bytes,
                                 self.options.slots, self.options.io_timeout_ms,
                                 self.options.write_policy, self.options.prefetch_policy,
                                 self.options.prefetch_timeout_ms)
        log.info("kvcellar: LMCache remote connector: model=%s object_bytes=%d slots=%d",
                 meta.model_name, self.full_chunk_size_bytes, self.options.slots)

    @staticmethod
    def digest(key: Any) -> bytes:
        return object_digest(key.to_string())

    # ---- blocking bodies ------------------------------------------------------------------

    def _put_many(self, keys: Sequence[Any], objs: Sequence[MemoryObj]) -> list[bool]:
        metas, views = [], []
        for o in objs:
            view = o.byte_array
            views.append(view)
            metas.append(RemoteMetadata(len(view), o.get_shapes(), o.get_dtypes(),
                                        o.get_memory_format()).serialize())
        return self.store.put([self.digest(k) for k in keys], views, metas)

    def _get_many(self, keys: Sequence[Any]) -> list[Optional[MemoryObj]]:
        out: list[Optional[MemoryObj]] = [None] * len(keys)

        def deliver(i: int, data: memoryview, meta: bytes) -> bool:
            m = RemoteMetadata.deserialize(meta)
            obj = self.local_cpu_backend.allocate(m.shapes, m.dtypes, m.fmt)
            if obj is None:
                return False
            view = obj.byte_array
            if m.length != len(data) or len(view) != len(data):
                obj.ref_count_down()  # an object of another size is never served
                return False
            np.frombuffer(view, np.uint8)[:] = np.frombuffer(data, np.uint8)
            out[i] = obj
            return True

        self.store.get([self.digest(k) for k in keys], deliver)
        return out

    def _exists_many(self, keys: Sequence[Any]) -> list[bool]:
        try:
            return self.store.exists([self.digest(k) for k in keys])
        except Exception as e:
            log.warning("kvcellar: exists: %s", e)
            return [False] * len(keys)

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- RemoteConnector ------------------------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return (await self._run(self._exists_many, [key]))[0]

    def exists_sync(self, key: Any) -> bool:
        return self._exists_many([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[Any]) -> int:
        """Leading keys the daemon holds (LMCache's prefix-match contract)."""
        found = self._exists_many(keys)
        return found.index(False) if False in found else len(found)

    async def batched_async_contains(self, lookup_id: str, keys: List[Any],
                                     pin: bool = False) -> int:
        return await self._run(self.batched_contains, keys)

    async def get(self, key: Any) -> Optional[MemoryObj]:
        return (await self._run(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Optional[MemoryObj]]:
        return await self._run(self._get_many, keys)

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[Any]) -> List[MemoryObj]:
        """The leading objects found; the objects after the first miss are released."""
        objs = await self._run(self._get_many, keys)
        lead: list[MemoryObj] = []
        missed = False
        for o in objs:
            missed = missed or o is None
            if o is not None and missed:
                o.ref_count_down()
            elif o is not None:
                lead.append(o)
        return lead

    async def put(self, key: Any, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[MemoryObj]) -> None:
        """Stores the objects; LMCache's RemoteBackend treats the put as fire-and-forget, so a
        failure is logged, not raised."""
        ok = await self._run(self._put_many, keys, memory_objs)
        if not all(ok):
            log.debug("kvcellar: put: %d of %d objects not stored", ok.count(False), len(ok))

    async def list(self) -> List[str]:
        return []  # kvcellard indexes digests; LMCache's key strings are not kept

    async def close(self) -> None:
        self.store.close()
        self.client.close()

    def __repr__(self) -> str:
        return f"<KvcellarConnector socket={self.options.socket}>"


class KvcellarConnectorAdapter(ConnectorAdapter):
    """The adapter LMCache's ConnectorManager loads: it claims ``plugin://kvcellar`` (and
    ``plugin://kvcellar.<instance>``) and builds a KvcellarConnector from the context."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return (url.startswith("plugin://")
                and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KvcellarConnector(context.loop, context.local_cpu_backend, context.config,
                                 context.plugin_name or PLUGIN_TYPE)


# ---- multiprocess server: LMCache's native L2 client contract ----------------------------------


class KvcellarNativeClient:
    """The client object LMCache 0.5.6's ``native_plugin`` L2 adapter type wraps
    (NativeConnectorL2Adapter): ``submit_batch_set/get/exists`` return a future id at once, one
    worker thread runs the batches in order, and each completion
    ``(future_id, ok, error, per_key_bools)`` is queued and signalled on ``event_fd()``, which
    LMCache's demultiplexer polls before ``drain_completions()``. Keys are LMCache's wire keys
    (``model@kv_rank@group@chunk_hash[@cache_salt]``); buffers are the L1 objects' bytes.
    """

    def __init__(self, **adapter_params: Any) -> None:
        what = "l2-adapter native_plugin adapter_params"
        self.options = ConnectorOptions.parse(adapter_params, what)
        if not self.options.object_bytes:
            raise ValueError(f"{what}: object_bytes (required: the L1 object bytes of one "
                             "full chunk)")
        ns = Namespace("lmcache-mp", f"{self.options.model_revision}|lmcache-mp|"
                       f"{self.options.object_bytes}", "int8", 1, layout="mla",
                       tp_size=1, tenant=self.options.tenant, opaque_keys=True)
        self.client = _client(self.options)
        self.store = ObjectStore(self.client, ns, _instance_id(self.options, "mp"),
                                 self.options.object_bytes, self.options.slots,
                                 self.options.io_timeout_ms, self.options.write_policy,
                                 self.options.prefetch_policy, self.options.prefetch_timeout_ms)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: list[tuple[int, bool, str, Optional[list[bool]]]] = []
        self._jobs: "queue.Queue[Optional[tuple[int, Callable[[], list[bool]]]]]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kvcellar-l2", daemon=True)
        self._worker.start()

    def event_fd(self) -> int:
        return self._efd

    def _submit(self, job: Callable[[], list[bool]]) -> int:
        fid = next(self._ids)
        self._jobs.put((fid, job))
        return fid

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fid, job = item
            try:
                res, err = job(), ""
            except Exception as e:  # a miss, never an error in LMCache's controllers
                res, err = None, str(e)
                log.warning("kvcellar: L2 batch %d: %s", fid, e)
            with self._lock:
                self._done.append((fid, res is not None and all(res), err, res))
            os.eventfd_write(self._efd, 1)

    def submit_batch_set(self, keys: List[str], buffers: List[Any]) -> int:
        digests = [object_digest(k) for k in keys]
        views = [memoryview(b).cast("B") for b in buffers]
        return self._submit(lambda: self.store.put(digests, views))

    def submit_batch_get(self, keys: List[str], buffers: List[Any]) -> int:
        digests = [object_digest(k) for k in keys]
        views = [memoryview(b).cast("B") for b in buffers]

        def deliver(i: int, data: memoryview, meta: bytes) -> bool:
            if len(data) != len(views[i]):
                return False  # an object of another size is never served
            np.frombuffer(views[i], np.uint8)[:] = np.frombuffer(data, np.uint8)
            return True

        return self._submit(lambda: self.store.get(digests, deliver))

    def submit_batch_exists(self, keys: List[str]) -> int:
        digests = [object_digest(k) for k in keys]
        return self._submit(lambda: self.store.exists(digests))

    def drain_completions(self) -> list[tuple[int, bool, str, Optional[list[bool]]]]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._jobs.put(None)
        # A job ends within its io_timeout_ms (and a slot wait of as long): the session is
        # closed only after it, never under a job still calling the daemon.
        self._worker.join(timeout=10 + 3 * self.store.io_timeout_ms / 1000)
        if self._worker.is_alive():
            log.warning("kvcellar: MP adapter closed with a job still running; its session is "
                        "left to lapse")
        else:
            self.store.close()
            self.client.close()
        os.close(self._efd)
