"""kvcellar as SGLang's HiCache L3 storage, written against SGLang 0.5.23's ``HiCacheStorage``
(sglang/srt/mem_cache/hicache_storage.py of the 0.5.23 wheel). Loaded as a dynamic backend:

    --enable-hierarchical-cache --page-size 64 --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcellar",
        "module_path": "kvcellar.integrations.sglang", "class_name": "KvcellarStorage",
        "interface_v1": 1, "allocator": "shm", "hicache_storage_pass_prefix_keys": true}'

Options: ``StorageOptions`` (more keys of the same JSON object). The extra config must be inline
JSON: SGLang reads ``allocator`` from the raw flag text, so the ``@file`` form loses it.

How the bytes move. SGLang's host pool (its L2) is its own memory. ``"allocator": "shm"`` makes
SGLang allocate it with memfd_create, and the backend registers that memfd with kvcellard as
host shared memory (``/proc/<pid>/fd/<fd>``; the daemon maps the same pages, DESIGN "sim device":
engine memory in host shared memory, the mode the sim device runs in production). Pages then
move between SGLang's host pool and kvcellard's node-wide pool with one memcpy in the daemon and
no copy in the engine: ``batch_set_v1`` is a Backup of the pages' host slots, ``batch_get_v1`` a
Load into them. The daemon's L3 tiers (NVMe, file systems, Redis) sit behind its pool.

The daemon must be able to open the engine's fd: run it as the engine's user (or give it
CAP_SYS_PTRACE) and, in Kubernetes, share the pod's PID namespace (shareProcessNamespace).

Calls (SGLang's controller threads; the Session is thread-safe):
- ``batch_exists`` (prefetch thread): a Match by keys; pages found only in L3 are brought into
  the daemon's pool first (``prefetch_policy``, bounded by ``prefetch_timeout_ms``), and the
  answer counts the leading pages in the pool. Nothing is pinned: a page evicted before the
  ``batch_get_v1`` that follows is a miss there, and SGLang recomputes it.
- ``batch_get_v1`` (prefetch I/O thread): a Load of the pages into their host slots, waited for.
- ``batch_set_v1`` (backup thread): a Backup of the host slots under the keys, waited for until
  the daemon has copied the bytes (SGLang frees the slots when the call returns). The daemon's
  index is a tree: a batch's first page hangs under the key before it, which SGLang passes only
  with ``hicache_storage_pass_prefix_keys`` (without it, that page starts a sequence of its
  own: lookups are the same, eviction knows less).
- ``clear`` (flush_cache, e.g. after a weight update): moves the engine to a fresh namespace
  (the flush generation is part of it), so no page cached before the flush is ever served
  again; the old pages age out of the daemon's pool and tiers (``kvcellarctl clear`` frees them
  at once). Every TP rank gets the call, so the ranks stay in one namespace.

Keys. SGLang's page keys are SHA-256 chains over the tokens (64 hex digits) and name neither
the model nor the rank; the backend sends them as opaque keys (docs/keys.md) in a namespace that
holds the model, the pipeline stage, the host layout and the page geometry, and for MHA the TP
size (each rank stores its own heads' shard; MLA stores one shard that rank 0 writes).

Failure semantics: a daemon that is down, dying, slow or refusing is never an engine error:
``batch_exists`` finds nothing, a get or set reports False for the pages it did not move, and
SGLang recomputes or skips them. The session registers again by itself when the daemon is back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket as socketlib
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo)

from .. import _native as N
from ..client import Client, Session
from ..keys import Namespace
from ..layout import Buffer, KvLayout, Region, kv_dtype_for
from ._options import parse_options

SGLANG_VERSION = "0.5.23"  # the HiCacheStorage this module implements

log = logging.getLogger(__name__)

# Keys of the extra config that belong to SGLang itself (hicache_storage.py, backend_factory.py,
# pool_host/common.py); the controller pops its own prefetch keys before the backend sees them.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator",
                "file_storage_path", "tp_lcm_size")


@dataclass(frozen=True)
class StorageOptions:
    """``--hicache-storage-backend-extra-config`` keys of the backend, with their defaults."""

    socket: Optional[str] = None  # kvcellard's address; None: the client library's default
    tenant: str = ""  # the namespace's tenant
    instance_id: Optional[str] = None  # None: "sglang-<model>-<host>-<pid>", one per rank
    model_revision: str = ""  # the weights' revision, when model_name does not pin it
    kv_cache_dtype: Optional[str] = None  # needed when the host pool holds fp8 as uint8
    rpc_timeout_ms: int = 250  # deadline of each call to the daemon
    register_timeout_ms: int = 2000  # deadline of one registration attempt
    prefetch_policy: str = "wait_complete"  # L3 -> pool in batch_exists: or none, timeout
    prefetch_timeout_ms: int = 5000  # the longest batch_exists waits for L3 pages
    io_timeout_ms: int = 5000  # the longest a get or set waits for the daemon's copy
    write_policy: Optional[str] = None  # L3 writes of backups; None: the daemon's default

    @classmethod
    def parse(cls, extra: Any) -> "StorageOptions":
        opts = parse_options(cls, extra, "hicache-storage-backend-extra-config", _SGLANG_KEYS)
        if opts.prefetch_policy == "best_effort":
            raise ValueError("hicache-storage-backend-extra-config: prefetch_policy "
                             "('best_effort' is not used: batch_exists counts what is in the pool; "
                             "use wait_complete, timeout or none)")
        return opts


# ---- the host pool as a kvcellar layout --------------------------------------------------------


def _memfd_region(fd: int, address: int, nbytes: int) -> Region:
    """The region of the engine's memfd `fd` that holds [address, address + nbytes), found
    through this process's mappings (the tensor need not start at the file's first byte)."""
    st = os.fstat(fd)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi and int(parts[4]) == st.st_ino:
                offset = address - lo + int(parts[2], 16)
                if offset + nbytes > st.st_size:
                    raise ValueError(f"host pool: {nbytes} bytes at offset {offset} exceed its "
                                     f"memfd ({st.st_size} bytes)")
                return Region(f"/proc/{os.getpid()}/fd/{fd}", offset, nbytes)
    raise ValueError("host pool: its kv_buffer is not a mapping of host_pool.fd; start SGLang "
                     "with \"allocator\": \"shm\" in --hicache-storage-backend-extra-config")


def host_pool_layout(pool: Any, mla: bool) -> KvLayout:
    """A KvLayout over SGLang's host pool: block b is the page whose first token slot is
    b * page_size. The page's regions are exactly those SGLang's zero-copy calls name
    (``get_page_buffer_meta``): [K, V] per page for the page-major layouts (one buffer pair, all
    layers), [K_l, V_l] per layer for layer_first; K only for MLA."""
    if getattr(pool, "fd", None) is None:
        raise ValueError("host pool: not in shared memory; start SGLang with \"allocator\": "
                         "\"shm\" in --hicache-storage-backend-extra-config (inline JSON)")
    if getattr(pool, "dcp_size", 1) != 1:
        raise ValueError(f"host pool: decode context parallel (dcp_size {pool.dcp_size}) is not "
                         "supported")
    page = int(pool.page_size)
    num_blocks = int(pool.size) // page
    if num_blocks < 2:
        raise ValueError(f"host pool: {pool.size} token slots hold fewer than 2 pages of {page}")

    def meta(block: int) -> tuple[list[int], list[int]]:
        idx = torch.arange(block * page, (block + 1) * page, dtype=torch.int64)
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        return [int(p) for p in ptrs], [int(s) for s in sizes]

    p0, sizes = meta(0)
    p1, _ = meta(1)
    plast, _ = meta(num_blocks - 1)
    per_layer = 1 if mla else 2
    if not p0 or len(p0) % per_layer:
        raise ValueError(f"host pool ({pool.layout}): {len(p0)} regions per page")
    buf = pool.kv_buffer
    base = int(buf.data_ptr())
    nbytes = buf.numel() * buf.element_size()
    region = _memfd_region(int(pool.fd), base, nbytes)
    bufs = []
    for j, (a, b, z, size) in enumerate(zip(p0, p1, plast, sizes)):
        stride = b - a
        if stride < size or z != a + (num_blocks - 1) * stride:
            raise ValueError(f"host pool ({pool.layout}): page region {j} is not at a fixed "
                             "stride per page")
        if a < base or z + size > base + nbytes:
            raise ValueError(f"host pool ({pool.layout}): page region {j} lies outside kv_buffer")
        bufs.append(Buffer(0, a - base, stride, size))
    layers = [(bufs[i], None if mla else bufs[i + 1]) for i in range(0, len(bufs), per_layer)]
    return KvLayout([region], layers, num_blocks, N.DEVICE_SIM,
                    device_uuid=hashlib.sha256(region.handle.encode()).digest()[:16],
                    device_name="host-shm", dtype=str(pool.dtype).replace("torch.", ""),
                    tokens_per_block=page, _keep=[buf])


# ---- keys -------------------------------------------------------------------------------------


def page_key(key: str) -> bytes:
    """SGLang's page hash (64 hex digits: a SHA-256) as the 32-byte opaque key; any other string
    (another key scheme) is hashed."""
    if len(key) == 64:
        try:
            raw = bytes.fromhex(key)
            if len(raw) == 32:  # fromhex skips whitespace: such a key is no digest
                return raw
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


def _keys_array(keys: List[str]) -> np.ndarray:
    """The keys as an (n, 32) uint8 array. SGLang's are all 64 hex digits: then one conversion
    for the batch, no Python step per page."""
    n = len(keys)
    if n and set(map(len, keys)) == {64}:
        try:
            raw = bytes.fromhex("".join(keys))
            if len(raw) == 32 * n:
                return np.frombuffer(raw, np.uint8).reshape(n, 32)
        except ValueError:
            pass
    return np.frombuffer(b"".join(page_key(k) for k in keys), np.uint8).reshape(n, 32)


# ---- the backend ------------------------------------------------------------------------------


class KvcellarStorage(HiCacheStorage):
    """SGLang 0.5.23 HiCache storage over kvcellard; one instance per TP rank."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None
                 ) -> None:
        cfg = storage_config
        extra = dict(cfg.extra_config or {})
        self.options = StorageOptions.parse(extra)
        if not extra.get("interface_v1"):
            raise ValueError("hicache-storage-backend-extra-config: interface_v1 must be 1 "
                             "(kvcellar serves the zero-copy batch_get_v1/batch_set_v1 calls)")
        if extra.get("allocator") != "shm":
            raise ValueError("hicache-storage-backend-extra-config: allocator must be \"shm\" "
                             "(the host pool in shared memory the daemon maps), got "
                             f"{extra.get('allocator')!r}")
        if not cfg.model_name:
            raise ValueError("HiCacheStorageConfig.model_name: kvcellar needs the model's name")
        if cfg.dcp_size != 1:
            raise ValueError(f"HiCacheStorageConfig.dcp_size {cfg.dcp_size}: not supported")
        self.config = cfg
        self.mla = bool(cfg.is_mla_model)
        o = self.options
        # Each rank process is its own instance by default: SGLang agrees on hits across its
        # TP group itself (a MIN all-reduce of batch_exists), and nothing the backend sees names
        # one launch's group (DP replicas can share a parent process and every rank number).
        self.instance_id = o.instance_id or (
            f"sglang-{cfg.model_name.rstrip('/').split('/')[-1]}-{socketlib.gethostname()}-"
            f"{os.getpid()}")
        self.client = Client(o.socket, rpc_timeout_ms=o.rpc_timeout_ms,
                             register_timeout_ms=o.register_timeout_ms)
        self.session: Optional[Session] = None
        self.layout: Optional[KvLayout] = None
        self.generation = 0  # flushes so far (clear)
        self._lock = threading.Lock()  # session swaps and the stats below
        self._prefetch_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_pgs: list[int] = []
        self._backup_bw: list[float] = []
        self._warned_prefix = False

    # ---- registration ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = host_pool_layout(mem_pool_host, self.mla)
        self.page_size = int(mem_pool_host.page_size)
        self.session = self._register(0)

    def namespace(self, generation: int) -> Namespace:
        """Everything besides the tokens that decides a page's bytes."""
        cfg, pool, layout = self.config, self.mem_pool_host, self.layout
        kv_dtype = self.options.kv_cache_dtype or kv_dtype_for(pool.dtype)
        if kv_dtype is None:
            raise ValueError(f"kv_cache_dtype: the host pool holds {pool.dtype}; say which KV "
                             "format it carries (e.g. \"fp8_e4m3\") in the extra config")
        geometry = ",".join(f"{k.bytes_per_block}+{v.bytes_per_block if v else 0}"
                            for k, v in layout.layers)
        revision = "|".join([self.options.model_revision, f"sglang-hicache:{pool.layout}",
                             f"pages:{geometry}", f"pp:{cfg.pp_rank}/{cfg.pp_size}",
                             f"cp:{cfg.attn_cp_rank}/{cfg.attn_cp_size}", f"flush:{generation}"])
        return Namespace(cfg.model_name, revision, kv_dtype, self.page_size,
                         layout="mla" if self.mla else "mha",
                         tp_size=cfg.tp_size, tenant=self.options.tenant,
                         opaque_keys=True)

    def _register(self, generation: int) -> Session:
        """A WORKER session for this rank in the namespace of flush `generation`. Each
        generation is its own instance (an instance agrees on one namespace), so ranks that
        flush a moment apart never refuse each other."""
        cfg = self.config
        instance = self.instance_id + (f"-flush{generation}" if generation else "")
        return self.client.register(
            instance, self.namespace(generation), layout=self.layout, rank=cfg.tp_rank,
            load_slots=0, ready_slots=0, replace_existing=True,
            engine_name=f"sglang {SGLANG_VERSION}")

    def _session(self) -> Optional[Session]:
        with self._lock:
            return self.session

    # ---- the v1 calls ----------------------------------------------------------------------

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        s = self._session()
        if s is None or not keys:
            return 0
        try:
            o = self.options
            reply = s.match([_keys_array(keys)], by_keys=True,
                            prefetch=o.prefetch_policy,
                            prefetch_timeout_ms=o.prefetch_timeout_ms)
            r = reply.results[0]
            hit = r.l2_hit_pages
            if reply.prefetch_op is not None and r.l3_hit_pages > 0:
                st = reply.prefetch_op.wait(o.prefetch_timeout_ms)
                if st.done and st.leading_ok_pages:
                    hit += st.leading_ok_pages[0]
            return hit
        except Exception as e:  # a miss, never an engine error
            log.warning("kvcellar: batch_exists: %s", e)
            return 0

    def _blocks(self, keys: List[str], host_indices: torch.Tensor) -> np.ndarray:
        page = self.page_size
        if len(host_indices) != len(keys) * page:
            raise ValueError(f"host_indices: {len(host_indices)} slots for {len(keys)} pages of "
                             f"{page}")
        starts = host_indices.reshape(len(keys), page)[:, 0].to(torch.int64).numpy()
        if np.any(starts % page):
            raise ValueError("host_indices: a page does not start on a page boundary")
        return (starts // page).astype(np.uint32)

    def _io(self, name: str, keys: List[str], host_indices: torch.Tensor, call: Any,
            pgs: list, bw: list) -> List[bool]:
        if not keys:
            return []
        s = self._session()
        if s is None:
            return [False] * len(keys)
        try:
            t0 = time.perf_counter()
            op = call(s, _keys_array(keys), self._blocks(keys, host_indices))
            st = op.wait(self.options.io_timeout_ms) if op.ok else None
            ok = st.leading_ok_pages[0] if st is not None and st.done else 0
            if ok:
                secs = max(time.perf_counter() - t0, 1e-9)
                with self._lock:
                    pgs.append(ok)
                    bw.append(ok * self.layout.page_object_bytes / secs / 1e9)
            elif op.ok is False or (st is not None and not st.done):
                log.debug("kvcellar: %s of %d pages: %s", name, len(keys),
                          op.reason if st is None else st.reason or st.state)
            return [True] * ok + [False] * (len(keys) - ok)
        except Exception as e:
            log.warning("kvcellar: %s: %s", name, e)
            return [False] * len(keys)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._io("batch_get_v1", keys, host_indices,
                        lambda s, k, b: s.load(k, b, layerwise=False),
                        self._prefetch_pgs, self._prefetch_bw)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None and not self._warned_prefix:
            self._warned_prefix = True
            log.warning("kvcellar: SGLang passes no prefix keys, so each batch's first page is "
                        "stored as the start of a sequence: lookups are unaffected, but the "
                        "daemon evicts without knowing which pages continue which; add "
                        "\"hicache_storage_pass_prefix_keys\": true to "
                        "--hicache-storage-backend-extra-config")
        parent = page_key(prefix[-1]) if prefix else None
        return self._io("batch_set_v1", keys, host_indices,
                        lambda s, k, b: s.backup(k, b, parent=parent, ready=False,
                                                 write_policy=self.options.write_policy),
                        self._backup_pgs, self._backup_bw)

    # ---- the rest of HiCacheStorage ---------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # The copy API (flat page tensors outside the host pool) is what SGLang uses without
    # interface_v1, which the constructor requires; these answer "not stored".
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        return None

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> List[None]:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    def clear(self) -> None:
        """SGLang's flush: a fresh namespace from now on (see the module docstring)."""
        if self.layout is None:
            return
        new = self._register(self.generation + 1)
        with self._lock:
            old, self.session = self.session, new
            self.generation += 1
        if old is not None:
            old.close()
        log.info("kvcellar: cache cleared: namespace generation %d", self.generation)

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_pgs.extend(self._backup_pgs)
            m.backup_bandwidth.extend(self._backup_bw)
            for lst in (self._prefetch_pgs, self._prefetch_bw, self._backup_pgs,
                        self._backup_bw):
                lst.clear()
        return m

    def close(self) -> None:
        with self._lock:
            s, self.session = self.session, None
        if s is not None:
            s.close()
        self.client.close()
