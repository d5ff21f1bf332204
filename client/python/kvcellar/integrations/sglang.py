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

Hybrid models (HybridCacheController: a Mamba state pool or a sliding-window pool beside the
KV pool) use the v2 calls. ``register_mem_host_pool_v2`` names each side pool, and the namespace
gets one KV group per pool (docs/api.md, "Groups"): ``kv`` full attention, ``swa`` a window of
``sliding_window`` tokens (the option, else the model's config), ``mamba`` a recurrent state.
Each pool is its own allocation with its own indices, so the layout gives every group its own
blocks (KvLayout.group_num_blocks, API revision 5); Mamba state slots are mapped as SGLang's
zero-copy meta names them (one run per state tensor, every layer). Then:
- ``batch_exists_v2``: the daemon's Match over all groups, the longest boundary at which every
  KV page before it, the swa pool's last ceil((W - 1) / P) pages and the Mamba state exist
  (SGLang's ALL_PAGES for kv, TRAILING_PAGES for swa and mamba); that boundary is the one
  restorable length reported.
- ``batch_get_v1`` loads the KV pages, ``batch_get_v2`` each side pool's trailing pages into its
  slots.
- ``batch_set_v2`` accepts the side pools' pages and ``batch_set_v1`` stores them with their KV
  pages (why, and why that is safe: batch_set_v2).
Other side pools (DeepSeek's indexer and compressed pools, draft pools) and side pools of MLA
models are refused at attach.

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
from sglang.srt.mem_cache.hicache_storage import (STORAGE_BATCH_SIZE, HiCacheStorage,
                                                  HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)

from .. import _native as N
from ..client import Client, Session
from ..keys import KvGroup, Namespace
from ..layout import Buffer, KvLayout, Region, kv_dtype_for
from ._options import parse_options
from ._settle import may_run, settle

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
    # A hybrid's sliding window W in tokens, as the model's config gives it (SGLang keeps the
    # W - 1 tokens before the current one); 0: read from the model's config (model_name).
    sliding_window: int = 0

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


def _tensor_region(fds: list, tensor: torch.Tensor, what: str) -> Region:
    """The region of whichever memfd of ``fds`` maps ``tensor``'s bytes."""
    nbytes = tensor.numel() * tensor.element_size()
    for fd in fds:
        try:
            return _memfd_region(int(fd), int(tensor.data_ptr()), nbytes)
        except ValueError:
            continue
    raise ValueError(f"{what}: not in shared memory; start SGLang with \"allocator\": \"shm\" in "
                     "--hicache-storage-backend-extra-config (inline JSON)")


def mamba_pool_layout(pool: Any) -> KvLayout:
    """A KvLayout over SGLang's Mamba host pool (pool_host/mamba.py, page_first): block b is
    state slot b, one contiguous run per state tensor (temporal, then each conv state) holding
    every Mamba layer's state, exactly what ``get_page_buffer_meta`` names. Each run is one
    kvcellar layer whose halves are its K and V (a state group's object is its bytes in order)."""
    if getattr(pool, "layout", None) not in ("page_first", "page_first_direct"):
        raise ValueError(f"mamba host pool: layout {getattr(pool, 'layout', None)!r}; kvcellar "
                         "maps page_first pools (SGLang's only Mamba host layouts)")
    if getattr(pool, "slot_state_buffers", ()):
        raise ValueError("mamba host pool: slot side states (registered checkpoint buffers) are "
                         "not supported")
    fds = list(getattr(getattr(pool, "allocator", None), "fds", None) or [])
    slots = int(pool.size)
    regions, layers = [], []
    for j, buf in enumerate([pool.temporal_buffer, *pool.conv_buffer]):
        if buf.numel() == 0:
            continue  # a conv-only model has no temporal state
        per_slot = buf[0].numel() * buf.element_size()
        if int(buf.shape[0]) != slots or not buf.is_contiguous() or per_slot % 2:
            raise ValueError(f"mamba host pool: state buffer {j} of shape {tuple(buf.shape)} is "
                             f"not {slots} contiguous slots of an even byte count")
        regions.append(_tensor_region(fds, buf, f"mamba host pool state buffer {j}"))
        r, half = len(regions) - 1, per_slot // 2
        layers.append((Buffer(r, 0, per_slot, half), Buffer(r, half, per_slot, half)))
    if not layers:
        raise ValueError("mamba host pool: no state buffers")
    return KvLayout(regions, layers, slots, N.DEVICE_SIM, device_name="host-shm", dtype="",
                    tokens_per_block=int(pool.page_size), _keep=[pool.temporal_buffer,
                                                                 *pool.conv_buffer])


def hybrid_layout(kv: KvLayout, sidecars: list[KvLayout]) -> KvLayout:
    """One layout of the KV pool (group 0) and each side pool (group 1, 2, ...), every group
    with its own blocks (KvLayout.group_num_blocks): SGLang's host pools are separate
    allocations with separate indices."""
    regions, layers, groups, counts = list(kv.regions), list(kv.layers), [0] * len(kv.layers), [
        kv.num_blocks]
    keep = list(kv._keep)
    for g, side in enumerate(sidecars, start=1):
        shift = len(regions)
        regions.extend(side.regions)
        for k, v in side.layers:
            layers.append((Buffer(k.region + shift, k.offset, k.block_stride, k.bytes_per_block),
                           None if v is None else
                           Buffer(v.region + shift, v.offset, v.block_stride, v.bytes_per_block)))
            groups.append(g)
        counts.append(side.num_blocks)
        keep.extend(side._keep)
    return KvLayout(regions, layers, max(counts), N.DEVICE_SIM, device_uuid=kv.device_uuid,
                    device_name=kv.device_name, dtype="", tokens_per_block=kv.tokens_per_block,
                    groups=groups, group_num_blocks=counts, _keep=keep)


def model_sliding_window(model_name: str) -> Optional[int]:
    """The sliding window of ``model_name``'s config (Gemma 3, gpt-oss, Mistral: ``sliding_window``,
    for multimodal models in ``text_config``), or None when it cannot be read."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_name)
    except Exception:  # noqa: BLE001 - a name transformers cannot resolve: the option says it
        return None
    for c in (cfg, getattr(cfg, "text_config", None)):
        w = getattr(c, "sliding_window", None) if c is not None else None
        if isinstance(w, int) and w > 0:
            return w
    return None


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
        self.layout: Optional[KvLayout] = None  # of the KV pool; of every pool once registered
        self.generation = 0  # flushes so far (clear)
        # A hybrid's side pools (register_mem_host_pool_v2), in registration order: its KV
        # groups after the KV pool's group 0. Fixed by on_host_pools_registered.
        self.sidecars: dict[str, Any] = {}
        self.groups: tuple[KvGroup, ...] = ()
        self.group_of: dict[str, int] = {}  # side pool name -> its group
        self._registered = False
        # Side-pool objects batch_set_v2 accepted, by page key, until the batch_set_v1 of the
        # same backup stores them with their pages (per backup thread; see batch_set_v2).
        self._pending = threading.local()
        self._lock = threading.Lock()  # session swaps and the stats below
        self._prefetch_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_pgs: list[int] = []
        self._backup_bw: list[float] = []
        self._warned_prefix = False

    # ---- registration ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV host pool (a hybrid's anchor). The session is registered once every pool is
        known (on_host_pools_registered, which SGLang calls next)."""
        super().register_mem_pool_host(mem_pool_host)
        self.layout = host_pool_layout(mem_pool_host, self.mla)
        self.page_size = int(mem_pool_host.page_size)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid's pools: the KV pool again (the anchor, already registered), then each side
        pool: ``swa`` (a sliding-window KV pool: a window group) and ``mamba`` (recurrent state
        slots: a state group). Others (DeepSeek's indexer and compressed pools, draft pools)
        are refused, which fails the attach with the reason."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value or host_pool is self.mem_pool_host:
            return
        if self._registered:
            log.warning("kvcellar: host pool %r registered after the others: not stored (its "
                        "prefetches miss)", name)
            return
        if name not in (PoolName.SWA.value, PoolName.MAMBA.value):
            raise ValueError(f"host pool {name!r}: kvcellar stores the kv, swa and mamba pools "
                             "of a hybrid model, not this one")
        if self.mla:
            raise ValueError(f"host pool {name!r}: side pools of an MLA model are not supported "
                             "(its KV is one shard for all ranks, a side pool's is per rank)")
        self.sidecars[name] = host_pool

    def on_host_pools_registered(self) -> None:
        if self.layout is None:
            raise ValueError("kvcellar: no KV host pool was registered")
        groups, layouts = [], []
        for name, pool in self.sidecars.items():
            if name == PoolName.SWA.value:
                w = self.options.sliding_window or model_sliding_window(self.config.model_name)
                if not w:
                    raise ValueError("hicache-storage-backend-extra-config: sliding_window (the "
                                     "model's sliding window in tokens: the swa host pool needs "
                                     f"it, and {self.config.model_name!r}'s config does not "
                                     "give it)")
                if int(pool.page_size) != self.page_size:
                    raise ValueError(f"swa host pool: pages of {pool.page_size} tokens, the kv "
                                     f"pool's are {self.page_size}")
                groups.append(KvGroup("window", int(w)))
                layouts.append(host_pool_layout(pool, False))
            else:
                groups.append(KvGroup("state"))
                layouts.append(mamba_pool_layout(pool))
            self.group_of[name] = len(groups)
        if groups:
            self.groups = (KvGroup("full"), *groups)
            self.layout = hybrid_layout(self.layout, layouts)
        self.session = self._register(0)
        self._registered = True

    def namespace(self, generation: int) -> Namespace:
        """Everything besides the tokens that decides a page's bytes."""
        cfg, pool, layout = self.config, self.mem_pool_host, self.layout
        kv_dtype = self.options.kv_cache_dtype or kv_dtype_for(pool.dtype)
        if kv_dtype is None:
            raise ValueError(f"kv_cache_dtype: the host pool holds {pool.dtype}; say which KV "
                             "format it carries (e.g. \"fp8_e4m3\") in the extra config")
        geometry = ",".join(f"{k.bytes_per_block}+{v.bytes_per_block if v else 0}"
                            for k, v in layout.layers)
        parts = [self.options.model_revision, f"sglang-hicache:{pool.layout}",
                 f"pages:{geometry}", f"pp:{cfg.pp_rank}/{cfg.pp_size}",
                 f"cp:{cfg.attn_cp_rank}/{cfg.attn_cp_size}", f"flush:{generation}"]
        if self.groups:  # each layer's group, and the side pools' dtypes
            parts.insert(3, "groups:" + ",".join(map(str, layout.groups)) + ":" + ",".join(
                f"{n}={getattr(p, 'dtype', '')}/{getattr(p, 'temporal_dtype', '')}"
                for n, p in self.sidecars.items()))
        return Namespace(cfg.model_name, "|".join(parts), kv_dtype, self.page_size,
                         layout="mla" if self.mla else "mha",
                         tp_size=cfg.tp_size, tenant=self.options.tenant,
                         opaque_keys=True, groups=self.groups)

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
                if st.done and st.leading_ok_pages and self.groups:
                    # A hybrid prefetch reads the objects the boundary needs: what landed is a
                    # hit only at a boundary every group serves, which L2 now says.
                    hit = s.match([_keys_array(keys)], by_keys=True,
                                  prefetch="none").results[0].l2_hit_pages
                elif st.done and st.leading_ok_pages:
                    hit += st.leading_ok_pages[0]
            return hit
        except Exception as e:  # a miss, never an engine error
            log.warning("kvcellar: batch_exists: %s", e)
            return 0

    def _blocks(self, keys: List[str], host_indices: torch.Tensor, page: int) -> np.ndarray:
        """The pool blocks of ``host_indices``: each page's first slot over ``page`` (the
        pool's page size: the KV and swa pools' page, 1 for Mamba state slots)."""
        if host_indices is None or len(host_indices) != len(keys) * page:
            got = 0 if host_indices is None else len(host_indices)
            raise ValueError(f"host_indices: {got} slots for {len(keys)} pages of {page}")
        starts = host_indices.reshape(len(keys), page)[:, 0].to(torch.int64).numpy()
        if np.any(starts % page):
            raise ValueError("host_indices: a page does not start on a page boundary")
        return (starts // page).astype(np.uint32)

    def _grid(self, blocks: np.ndarray, group: int) -> np.ndarray:
        """Load/Backup blocks moving ``group``'s objects only: the blocks themselves for a model
        of one group, else page-major pages x groups with NO_BLOCK in the other groups."""
        if not self.groups:
            return blocks
        grid = np.full((len(blocks), len(self.groups)), N.NO_BLOCK, dtype=np.uint32)
        grid[:, group] = blocks
        return grid

    def _io(self, name: str, keys: List[str], grid: Any, call: Any, pgs: list,
            bw: list) -> List[bool]:
        """One Load or Backup of ``keys`` into or from ``grid()``, waited for: per page, True for
        the leading pages it moved."""
        if not keys:
            return []
        s = self._session()
        if s is None:
            return [False] * len(keys)
        try:
            t0 = time.perf_counter()
            op = call(s, _keys_array(keys), np.ascontiguousarray(grid()).ravel())
            st = op.wait(self.options.io_timeout_ms) if op.ok else None
            if (st is None or not st.terminal) and may_run(op):
                # SGLang reuses the host slots once this returns, and the daemon's Loads and
                # Backups cannot be cancelled: waited for until the op has ended (_settle).
                st = settle(s, [op], self.options.io_timeout_ms, name)[0]
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
        return self._io("batch_get_v1", keys,
                        lambda: self._grid(self._blocks(keys, host_indices, self.page_size), 0),
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
        pending = self._pending_entries()

        def grid() -> np.ndarray:
            g = self._grid(self._blocks(keys, host_indices, self.page_size), 0)
            if pending:  # the side-pool objects of these pages batch_set_v2 accepted
                for i, key in enumerate(keys):
                    for group, block in pending.pop(key, {}).items():
                        g[i, group] = block
            return g

        ok = self._io("batch_set_v1", keys, grid,
                      lambda s, k, b: s.backup(k, b, parent=parent, ready=False,
                                               write_policy=self.options.write_policy),
                      self._backup_pgs, self._backup_bw)
        # The backup's KV writes end here when this batch failed (SGLang stops) or was its last
        # (short, or holding the side pages): what is still pending is never stored.
        if pending and (not all(ok) or len(keys) < STORAGE_BATCH_SIZE or
                        pending.get(self._pending.last) is None):
            pending.clear()
        self._pending.after_v1 = True
        return ok

    # ---- the v2 calls (hybrid models) -------------------------------------------------------

    def _pending_entries(self) -> dict:
        p = self._pending
        if not hasattr(p, "entries"):
            p.entries, p.after_v1, p.last = {}, False, None
        return p.entries

    def _window_pages(self, group: int) -> int:
        """A window group's pages before a boundary that a hit there needs (docs/api.md,
        "Groups"); 1 for a state group."""
        g = self.groups[group]
        return -(-(g.window_tokens - 1) // self.page_size) if g.kind == "window" else 1

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None
                        ) -> PoolTransferResult:
        """The longest boundary every pool serves: the daemon's Match over the namespace's
        groups (every KV page before it, the swa pool's last ceil((W - 1) / P) pages, the Mamba
        state at it), SGLang's ALL_PAGES for kv and TRAILING_PAGES for swa and mamba. The only
        restorable length reported is that boundary: every TP rank stores the same pages, and
        SGLang intersects the ranks' sets."""
        hits: dict[str, int] = {}
        for t in pool_transfers or ():
            name = str(t.name)
            g = self.group_of.get(name)
            want = max(1, len(t.keys or ()))
            if (g is None or t.hit_policy != PoolHitPolicy.TRAILING_PAGES
                    or want > self._window_pages(g)):
                # A pool not stored, or more trailing pages than its group keeps: a miss.
                log.debug("kvcellar: batch_exists_v2: pool %s (%s, %d pages) is not served",
                          name, t.hit_policy, want)
                return PoolTransferResult.empty()
            hits[name] = 0
        hit = self.batch_exists(keys, extra_info)
        if not hit:
            return PoolTransferResult.empty()
        return PoolTransferResult(hit, {PoolName.KV: hit, **{n: hit for n in hits}}, [hit])

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """Each side pool's objects of its pages (the trailing pages of a hit) into its slots."""
        results: dict[str, List[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or ())
            g = self.group_of.get(name)
            if g is None:
                results[name] = [False] * len(keys)
                continue
            page = int(self.sidecars[name].page_size)
            results[name] = self._io(
                f"batch_get_v2 {name}", keys,
                lambda: self._grid(self._blocks(keys, t.host_indices, page), g),
                lambda s, k, b: s.load(k, b, layerwise=False),
                self._prefetch_pgs, self._prefetch_bw)
        return results

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> dict[str, List[bool]]:
        """A side pool's pages of a backup: kept until the backup's batch_set_v1 of the same
        pages, which stores each page with all its objects, and answered True (accepted).

        Why not stored here: SGLang 0.5.23 (HybridCacheController._page_backup_with_stable_layout)
        writes the side pools before the KV pages, on the same thread, and the daemon's index is
        prefix-closed: a page exists only below its parent, whose KV is not stored yet. The
        slots stay the backup's until it is acked (the tree node is host-locked from
        write_backup_storage until the ack is drained), which is after its batch_set_v1 calls;
        the objects are read in those calls, never later (what one backup leaves pending is
        dropped when its KV writes end, see batch_set_v1). A swa transfer names every swa page
        the node holds, and each is stored: a later hit may end at any page boundary, and each
        window page is one that some boundary needs (a hit loads only its last
        ceil((W - 1) / P))."""
        entries = self._pending_entries()
        if self._pending.after_v1:  # a new backup: nothing of an earlier one is read any more
            entries.clear()
            self._pending.after_v1 = False
        results: dict[str, List[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or ())
            g = self.group_of.get(name)
            try:
                if g is None or self._session() is None:
                    raise ValueError(f"pool {name!r} is not stored")
                blocks = self._blocks(keys, t.host_indices, int(self.sidecars[name].page_size))
            except ValueError as e:
                log.debug("kvcellar: batch_set_v2 %s: %s", name, e)
                results[name] = [False] * len(keys)
                continue
            for key, block in zip(keys, blocks):
                entries.setdefault(key, {})[g] = int(block)
            if keys:
                self._pending.last = keys[-1]
            results[name] = [True] * len(keys)
        return results

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
