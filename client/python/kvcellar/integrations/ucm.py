"""kvcellar as a UCM store, written against UCM 0.8.1's ``UcmKVStoreBaseV1``
(ucm/store/ucmstore_v1.py of the ``uc-manager-cuda-cu130`` 0.8.1 wheel). UCM's factory
(ucm/store/factory_v1.py, ``UcmConnectorFactoryV1.create_connector``) imports the module that
``ucm_connector_module_path`` names and instantiates the class that ``ucm_connector_name`` names,
so no patching is needed:

    ucm_connectors:
      - ucm_connector_name: KvcellarStore
        ucm_connector_module_path: kvcellar.integrations.ucm
        ucm_connector_config:
          kvcellar_model: Qwen3-8B        # required: one name for every engine that shares blocks
          kvcellar_socket: /run/kvcellar/kvcellard.sock

Options: ``StoreOptions`` (the ``kvcellar_*`` keys of ``ucm_connector_config``). UCM hands every
store one dict: the user's keys plus its own (``unique_id``, ``tensor_layout``, ``device_id``,
``posix_gc_enable``, ...), and its built-in stores read the keys they know and ignore the rest
(the Posix store reads ``storage_backends``, ``posix_*``, ...). This store does the same for keys
that are not ``kvcellar_*``; a ``kvcellar_*`` key it does not know, or one of the wrong type, is
a ValueError naming it when the store is built (as the Posix store refuses a bad value of its own).

What UCM's vLLM connector tells a store (ucm/integration/vllm/ucm_connector.py ``_create_store``).
In a worker: ``device_id``, ``tensor_size_list`` (bytes of each KV tensor's block),
``gpu_kv_buffer_addrs`` / ``gpu_kv_buffer_sizes`` (each KV tensor's base address and bytes, in
the order of ``KVCacheLayout.base_ptrs``), ``shard_size`` / ``block_size`` (I/O sizes padded to
4 KiB) and ``tensor_layout`` (``gqa`` or ``mla``). In the scheduler: no ``device_id`` and no
tensors; it only looks blocks up. ``load_data`` / ``dump_data`` then name, per block, one address
per KV tensor: ``base[j] + vllm_block * tensor_size[j]`` (``extract_block_addrs``), with shard
index 0 (UCMDirectConnector stores whole blocks).

How the bytes move. The worker registers the KV tensors with kvcellard once, as a KvLayout: one
region per tensor buffer, tensor ``j`` a buffer whose block ``b`` is ``tensor_size[j]`` bytes at
``b * tensor_size[j]`` (columns paired as K and V layers; MLA: one latent buffer per column). On a
GPU the regions are CUDA IPC handles of the allocations holding the buffers; for a CPU engine they
are ``/proc/<pid>/mem`` regions of the engine's own process (the daemon copies with
process_vm_readv/writev). Each call's address rows are turned into block indices (every column
must be exactly block ``b`` of its buffer, or the call is refused with a ValueError naming the
address and nothing moves), and the daemon copies the blocks itself: ``dump_data`` is a Backup,
``load_data`` a Load. No byte passes through Python.

Keys. UCM's block ids are 16-byte MD5 digests that already name the model, TP size and rank,
dtype and UCM's layout version (``RequestHasher.meta_bytes``). Each is sent as the 32-byte opaque
key ``16 zero bytes || block id`` (injective; the daemon's KV events carry the key's last 8 bytes,
which are then the id's last 8) in the namespace ``(kvcellar_model, "ucm-store|" +
kvcellar_revision, kvcellar_kv_dtype, kvcellar_page_size, gqa/mla)``: the scheduler can compute it
with no tensors, and the first worker fixes its page geometry. ``dump_data`` receives no prefix
(nothing says which block precedes a block, and one call mixes requests), so each block is stored
as a one-page sequence (parent none), and lookups ask for each block on its own.

Semantics kept from UCM:
- ``lookup``: per block, whether kvcellard holds it (in its pool, or in an L3 tier it then brings
  into the pool, per ``kvcellar_prefetch_policy``); ``lookup_on_prefix``: the index of the last
  block of the leading run of present blocks, -1 for none; ``lookup_on_reverse``: the index of the
  rightmost present block, -1 for none; ``prefetch``: an asynchronous L3 -> pool prefetch.
- ``load``/``dump``/``load_data``/``dump_data`` return a ``KvcellarTask`` at once; ``check`` polls
  it without blocking (True once it has ended, however), ``wait`` blocks until it ends and raises
  when it failed, as the pipeline store's ``Wait`` does: ``StoreNotFoundError`` when a block to
  load is not there (UCM's rank-consistency manager then marks it missing), RuntimeError for other
  failures (a dump the daemon stored only in part, e.g. no pool space; the daemon lost mid-op).
  UCM reuses the blocks as soon as ``wait`` returns or raises, and the daemon's Loads and
  Backups cannot be cancelled, so ``wait`` returns only once the daemon has ended them (past
  ``kvcellar_io_timeout_ms`` it keeps waiting and logs; a daemon gone for that long counts as
  ended), and so does a submission refused after others of the same call were accepted. A call
  of more blocks than the daemon takes per request (``max_batch_sequences``) is split; its task
  covers every part.
- Dumping a block that exists succeeds and keeps the copy the daemon holds (ALREADY_PRESENT). The
  Posix store rewrites the file instead; with UCM's keys (equal id, equal tokens and model) both
  hold the same bytes.

Failure semantics: a daemon that is down, restarting or slow is never an engine error. Matched to
UCM's pipeline stores behind their health breaker (ucm/store/pipeline/cc/health_breaker_store.cc):
lookups answer "absent" (False, -1), prefetch does nothing, and ``load_data``/``dump_data`` raise
``StoreUnhealthyError`` at submission, which UCM's connector turns into a recompute (load) or a
skipped dump. The session registers again by itself when the daemon is back (a daemon restarted
with ``pool.shm_name`` still holds the blocks).

Limits: shard indices other than 0 (UCM's layerwise connectors store one shard per layer) are
refused; ``cc_store`` has no C++ store to return (UCM's GSA sparse prefetcher needs one).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket as socketlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from ucm.store.pipeline.errors import StoreNotFoundError, StoreUnhealthyError
from ucm.store.ucmstore_v1 import Task, UcmKVStoreBaseV1

from .. import _native as N
from ..client import BackupSeq, Client, LoadSeq, Op, Session
from ..keys import Namespace
from ..layout import Buffer, KvLayout, Region, _cuda_identity
from ._options import parse_options
from ._settle import may_run, settle

UCM_VERSION = "0.8.1"  # the UcmKVStoreBaseV1 this module implements

log = logging.getLogger(__name__)

_BLOCK_ID_BYTES = 16  # UCM's block ids: MD5 digests (integration/vllm/request_hasher.py)
_OPTION_PREFIX = "kvcellar_"
# Sequences per Match when the daemon has not said (SessionInfo.max_batch_sequences).
_DEFAULT_BATCH_SEQUENCES = 1024


@dataclass(frozen=True)
class StoreOptions:
    """``ucm_connector_config`` keys of the store, with their defaults."""

    kvcellar_model: str = ""  # required: the namespace's model, one name for every sharing engine
    kvcellar_socket: Optional[str] = None  # kvcellard's address; None: the library's default
    kvcellar_revision: str = ""  # the weights' revision, when the model name does not pin it
    kvcellar_tenant: str = ""  # the namespace's tenant
    kvcellar_kv_dtype: str = "bf16"  # the namespace's KV dtype label (UCM's ids also encode it)
    kvcellar_page_size: int = 16  # tokens per block (vLLM's --block-size): namespace and metrics
    kvcellar_instance_id: Optional[str] = None  # None: "ucm-<unique_id>-<host>-<pid>[-sched]"
    kvcellar_rpc_timeout_ms: int = 250  # deadline of each call to the daemon
    kvcellar_register_timeout_ms: int = 2000  # deadline of one registration attempt
    kvcellar_io_timeout_ms: int = 5000  # the longest wait() blocks for a load or dump
    kvcellar_prefetch_policy: str = "wait_complete"  # L3 -> pool in lookups: or none, timeout
    kvcellar_prefetch_timeout_ms: int = 5000  # the longest a lookup waits for L3 blocks
    kvcellar_write_policy: Optional[str] = None  # L3 writes of dumps; None: the daemon's default

    @classmethod
    def parse(cls, config: Any) -> "StoreOptions":
        if not isinstance(config, dict):
            raise ValueError(f"ucm_connector_config: expected a dict, got {type(config).__name__}")
        mine = {k: v for k, v in config.items()
                if isinstance(k, str) and k.startswith(_OPTION_PREFIX)}
        opts = parse_options(cls, mine, "ucm_connector_config")
        if not opts.kvcellar_model:
            raise ValueError("ucm_connector_config: kvcellar_model is required (the served "
                             "model's name; every engine that shares blocks gives the same)")
        if opts.kvcellar_page_size == 0:
            raise ValueError("ucm_connector_config: kvcellar_page_size (must be > 0)")
        if opts.kvcellar_prefetch_policy == "best_effort":
            raise ValueError("ucm_connector_config: kvcellar_prefetch_policy ('best_effort' is "
                             "what prefetch() does; lookups use wait_complete, timeout or none)")
        return opts


# ---- keys -------------------------------------------------------------------------------------


def page_keys(block_ids: Sequence[bytes]) -> np.ndarray:
    """UCM's 16-byte block ids as (n, 32) opaque keys: 16 zero bytes, then the id. Raises
    ValueError naming the first id that is not 16 bytes."""
    n = len(block_ids)
    raw = b"".join(block_ids) if n else b""
    if len(raw) != n * _BLOCK_ID_BYTES or any(len(b) != _BLOCK_ID_BYTES for b in block_ids):
        i = next(i for i, b in enumerate(block_ids)
                 if not isinstance(b, (bytes, bytearray)) or len(b) != _BLOCK_ID_BYTES)
        raise ValueError(f"block_ids[{i}]: expected {_BLOCK_ID_BYTES} bytes (an MD5 digest), "
                         f"got {block_ids[i]!r:.60}")
    keys = np.zeros((n, N.KEY_BYTES), np.uint8)
    keys[:, N.KEY_BYTES - _BLOCK_ID_BYTES:] = np.frombuffer(raw, np.uint8).reshape(
        n, _BLOCK_ID_BYTES)
    return keys


# ---- the engine's KV as a kvcellar layout -----------------------------------------------------


@dataclass(frozen=True)
class KvColumns:
    """The KV tensors UCM's connector registered, one column of every address row each: tensor
    ``j``'s block ``b`` is ``sizes[j]`` bytes at ``bases[j] + b * sizes[j]``."""

    bases: np.ndarray  # int64, per column
    sizes: np.ndarray  # int64, per column
    num_blocks: int

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "KvColumns":
        addrs = config.get("gpu_kv_buffer_addrs")
        sizes = config.get("gpu_kv_buffer_sizes")
        tsl = config.get("tensor_size_list")
        for name, v in (("gpu_kv_buffer_addrs", addrs), ("gpu_kv_buffer_sizes", sizes),
                        ("tensor_size_list", tsl)):
            if not isinstance(v, (list, tuple)) or not v or not all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x > 0
                    for x in v):
                raise ValueError(f"ucm_connector_config: {name} (expected a non-empty list of "
                                 f"positive ints, got {v!r:.80})")
        if len(addrs) != len(sizes):
            raise ValueError(f"ucm_connector_config: gpu_kv_buffer_addrs has {len(addrs)} "
                             f"entries, gpu_kv_buffer_sizes {len(sizes)}")
        # Direct layouts list every tensor's block size; layerwise ones list one layer's, the
        # same for every layer (KVCacheLayout.tensor_size_list).
        if len(addrs) % len(tsl):
            raise ValueError(f"ucm_connector_config: tensor_size_list ({len(tsl)} entries) does "
                             f"not describe {len(addrs)} KV buffers (gpu_kv_buffer_addrs); a "
                             "UCM block of several vLLM blocks (a chunk) is not served: "
                             "kvcellar stores UCMDirectConnector's one block per id")
        block = np.tile(np.asarray(tsl, np.int64), len(addrs) // len(tsl))
        total = np.asarray(sizes, np.int64)
        if np.any(total % block):
            j = int(np.flatnonzero(total % block)[0])
            raise ValueError(f"ucm_connector_config: gpu_kv_buffer_sizes[{j}] = {int(total[j])} "
                             f"is not a whole number of {int(block[j])}-byte blocks")
        counts = total // block
        if np.any(counts != counts[0]):
            j = int(np.flatnonzero(counts != counts[0])[0])
            raise ValueError(f"ucm_connector_config: KV buffer {j} holds {int(counts[j])} blocks, "
                             f"buffer 0 {int(counts[0])}")
        bases = np.asarray(addrs, np.uint64)
        if np.any(bases >= 2**63):
            raise ValueError("ucm_connector_config: gpu_kv_buffer_addrs holds an address >= 2**63")
        bases = bases.astype(np.int64)
        order = np.argsort(bases)
        ends = bases[order] + total[order]
        if np.any(ends[:-1] > bases[order][1:]):
            raise ValueError("ucm_connector_config: two KV buffers (gpu_kv_buffer_addrs/sizes) "
                             "share bytes")
        return cls(bases, block, int(counts[0]))

    def blocks_of(self, addrs: Any, what: str) -> np.ndarray:
        """The block index of each address row; ValueError naming the first address that is not
        exactly block ``b`` of its column's buffer, the same ``b`` across the row."""
        a = np.asarray(addrs)
        if a.ndim != 2 or a.shape[1] != len(self.bases):
            raise ValueError(f"{what}: shape {a.shape}: expected (blocks, {len(self.bases)}) "
                             "addresses, one per KV tensor")
        if a.size and (a.dtype.kind not in "ui" or (a.dtype.kind == "i" and a.min() < 0)):
            raise ValueError(f"{what}: addresses must be non-negative integers ({a.dtype})")
        a = a.astype(np.uint64)
        if np.any(a >= 2**63):
            r, c = np.argwhere(a >= 2**63)[0]
            raise ValueError(f"{what}[{r}][{c}]: address {int(a[r, c]):#x} is outside the "
                             "registered KV buffers")
        off = a.astype(np.int64) - self.bases[None, :]
        blocks = off[:, 0] // self.sizes[0]
        good = (off == blocks[:, None] * self.sizes[None, :]) & (blocks[:, None] >= 0) & (
            blocks[:, None] < self.num_blocks)
        if not good.all():
            r, c = np.argwhere(~good)[0]
            raise ValueError(f"{what}[{r}][{c}]: address {int(a[r, c]):#x} is not block "
                             f"{int(blocks[r])} of registered KV buffer {c} (base "
                             f"{int(self.bases[c]):#x}, {int(self.sizes[c])}-byte blocks, "
                             f"{self.num_blocks} blocks): refused")
        return blocks.astype(np.uint32)

    def layout(self, mla: bool, device_id: int) -> KvLayout:
        """The columns as a KvLayout: CUDA IPC regions for device memory, else /proc/<pid>/mem
        regions of this process."""
        if not mla and len(self.bases) % 2:
            raise ValueError(f"ucm_connector_config: {len(self.bases)} KV buffers for a gqa "
                             "layout (expected K and V per layer)")
        cuda = device_id >= 0 and torch.cuda.is_available()
        regions, offsets = (_cuda_regions if cuda else _host_regions)(self, device_id)
        bufs = [Buffer(r, off, int(s), int(s)) for r, off, s in zip(*offsets, self.sizes)]
        step = 1 if mla else 2
        layers = [(bufs[i], None if mla else bufs[i + 1]) for i in range(0, len(bufs), step)]
        kind = N.DEVICE_CUDA if cuda else N.DEVICE_SIM
        layout = KvLayout(regions, layers, self.num_blocks, kind,
                          cuda_device=device_id if cuda else None)
        if cuda:
            layout.device_uuid, layout.device_name = _cuda_identity(device_id)
        else:
            layout.device_name = "host"
        return layout


def _writable_ranges() -> list[tuple[int, int]]:
    """This process's writable mappings, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=2)
            if "w" not in parts[1]:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
    return out


def _host_regions(cols: KvColumns, device_id: int) -> tuple[list[Region], tuple[list, list]]:
    """One /proc/<pid>/mem region per buffer, each checked to be writable memory of this process
    (the daemon reaches only the registering process, and only what the engine registered)."""
    ranges = _writable_ranges()
    regions = []
    for j, (base, size) in enumerate(zip(cols.bases, cols.sizes * cols.num_blocks)):
        base, size = int(base), int(size)
        if not any(lo <= base and base + size <= hi for lo, hi in ranges):
            raise ValueError(f"ucm_connector_config: gpu_kv_buffer_addrs[{j}] ({base:#x}, "
                             f"{size} bytes) is not writable memory of this process")
        regions.append(Region(f"/proc/{os.getpid()}/mem", base, size))
    return regions, (list(range(len(regions))), [0] * len(regions))


class _CudaDriver:
    """The few CUDA driver calls the store needs, through libcuda (torch's CUDA build loads it)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise ValueError(f"{what}: {name.value.decode() if name.value else rc}")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                    ctypes.c_uint64(ptr)),
                   f"cuMemGetAddressRange({ptr:#x})")
        return base.value, size.value

    def ipc_handle(self, base: int, what: str) -> bytes:
        handle = (ctypes.c_uint8 * 64)()
        rc = self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(base))
        if rc != 0:
            self.check(rc, f"{what}: cuIpcGetMemHandle (an expandable segment cannot be shared: "
                           "run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
        return bytes(handle)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.check(self.lib.cuStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), 0),
                   "cuStreamWaitEvent(prerequisite_handle)")


def _cuda_regions(cols: KvColumns, device_id: int) -> tuple[list[Region], tuple[list, list]]:
    """One region per CUDA allocation holding a buffer (its IPC handle; torch's caching
    allocator hands out cudaMalloc blocks), each buffer at its offset inside."""
    torch.cuda.set_device(device_id)
    torch.cuda.init()
    drv = _CudaDriver()
    regions: list[Region] = []
    index: dict[int, int] = {}
    which, offsets = [], []
    for j, (base, size) in enumerate(zip(cols.bases, cols.sizes * cols.num_blocks)):
        base, size = int(base), int(size)
        what = f"ucm_connector_config: gpu_kv_buffer_addrs[{j}] ({base:#x})"
        alloc, alloc_size = drv.address_range(base)
        if base + size > alloc + alloc_size:
            raise ValueError(f"{what}: {size} bytes run past its allocation")
        if alloc not in index:
            index[alloc] = len(regions)
            regions.append(Region(drv.ipc_handle(alloc, what), 0, alloc_size))
        which.append(index[alloc])
        offsets.append(base - alloc)
    return regions, (which, offsets)


# ---- tasks ------------------------------------------------------------------------------------


@dataclass(eq=False)
class KvcellarTask(Task):
    """A submitted load or dump: the daemon's ops (one per ``max_batch_sequences`` blocks) over
    ``num_blocks`` one-block sequences."""

    kind: str  # "load" or "dump"
    ops: List[Op]
    num_blocks: int
    _final: Optional[Exception] = field(default=None, repr=False)
    _ended: bool = False


# ---- the store --------------------------------------------------------------------------------


class KvcellarStore(UcmKVStoreBaseV1):
    """UCM 0.8.1 store over kvcellard; one per UCM connector (scheduler, and each worker)."""

    def __init__(self, config: Dict[str, object]) -> None:
        super().__init__(config)
        self.options = o = StoreOptions.parse(config)
        self.mla = config.get("tensor_layout") == "mla"
        self.ns = Namespace(o.kvcellar_model, "ucm-store|" + o.kvcellar_revision,
                            o.kvcellar_kv_dtype, o.kvcellar_page_size,
                            layout="mla" if self.mla else "mha", tenant=o.kvcellar_tenant,
                            opaque_keys=True)
        # UCM's scheduler builds its store with no device_id and no tensors: lookups only.
        self.scheduler = config.get("device_id") is None
        self.device_id = -1 if self.scheduler else int(config["device_id"])
        self.columns: Optional[KvColumns] = None
        self.layout: Optional[KvLayout] = None
        if not self.scheduler and config.get("gpu_kv_buffer_addrs"):
            self.columns = KvColumns.from_config(config)
            self.layout = self.columns.layout(self.mla, self.device_id)
        self._cuda = self.layout is not None and self.layout.device_kind == N.DEVICE_CUDA
        self._driver = _CudaDriver() if self._cuda else None
        unique = str(config.get("unique_id", "")) or "engine"
        self.instance_id = o.kvcellar_instance_id or (
            f"ucm-{unique}-{socketlib.gethostname()}-{os.getpid()}"
            f"{'-sched' if self.layout is None else ''}")
        self.client = Client(o.kvcellar_socket, rpc_timeout_ms=o.kvcellar_rpc_timeout_ms,
                             register_timeout_ms=o.kvcellar_register_timeout_ms)
        try:
            self.session: Session = self.client.register(
                self.instance_id, self.ns, layout=self.layout, scheduler=self.layout is None,
                load_slots=0, ready_slots=4 if self._cuda else 0, replace_existing=True,
                engine_name=f"ucm {UCM_VERSION}")
        except Exception:
            self.client.close()
            raise

    def cc_store(self) -> int:
        raise RuntimeError("kvcellar's UCM store is a Python store: it has no C++ Store* (UCM's "
                           "GSA sparse prefetcher, the one caller, needs a pipeline store)")

    # ---- lookups ---------------------------------------------------------------------------

    def _present(self, block_ids: List[bytes], prefetch: Optional[str]) -> List[bool]:
        """Per block, whether the daemon's pool holds it (after bringing L3 blocks in, per
        ``prefetch``). Every failure is absence."""
        keys = page_keys(block_ids)
        o = self.options
        out: List[bool] = []
        try:
            step = self.session.info().max_batch_sequences or _DEFAULT_BATCH_SEQUENCES
            for lo in range(0, len(keys), step):
                chunk = [keys[i:i + 1] for i in range(lo, min(lo + step, len(keys)))]
                reply = self.session.match(chunk, by_keys=True, prefetch=prefetch,
                                           prefetch_timeout_ms=o.kvcellar_prefetch_timeout_ms)
                hits = [r.l2_hit_pages > 0 for r in reply.results]
                if reply.prefetch_op is not None and any(
                        r.l3_hit_pages for r in reply.results):
                    st = reply.prefetch_op.wait(o.kvcellar_prefetch_timeout_ms)
                    if st.done:
                        hits = [h or bool(n) for h, n in zip(hits, st.leading_ok_pages)]
                out.extend(hits)
        except Exception as e:  # absent, never an engine error
            log.warning("kvcellar: lookup of %d blocks: %s", len(block_ids), e)
            return [False] * len(block_ids)
        return out

    def lookup(self, block_ids: List[bytes]) -> List[bool]:
        return self._present(block_ids, self.options.kvcellar_prefetch_policy)

    def lookup_on_prefix(self, block_ids: List[bytes]) -> int:
        hits = self._present(block_ids, self.options.kvcellar_prefetch_policy)
        return (hits.index(False) if False in hits else len(hits)) - 1

    def lookup_on_reverse(self, block_ids: List[bytes]) -> int:
        hits = self._present(block_ids, self.options.kvcellar_prefetch_policy)
        return max((i for i, h in enumerate(hits) if h), default=-1)

    def prefetch(self, block_ids: List[bytes]) -> None:
        """L3 -> pool for the blocks kvcellard has only in an L3 tier, not waited for."""
        keys = page_keys(block_ids)
        try:
            self.session.match([keys[i:i + 1] for i in range(len(keys))], by_keys=True,
                               prefetch="best_effort")
        except Exception as e:
            log.debug("kvcellar: prefetch of %d blocks: %s", len(block_ids), e)

    # ---- transfers -------------------------------------------------------------------------

    def _blocks(self, block_ids: List[bytes], shard_index: List[int], addrs: Any,
                what: str) -> np.ndarray:
        if self.columns is None:
            raise RuntimeError("transfer is not enabled: this store was built without the "
                               "engine's KV tensors (UCM's scheduler side)")
        if len(shard_index) != len(block_ids):
            raise ValueError(f"shard_index: {len(shard_index)} entries for {len(block_ids)} "
                             "blocks")
        if any(int(s) != 0 for s in shard_index):
            i = next(i for i, s in enumerate(shard_index) if int(s) != 0)
            raise ValueError(f"shard_index[{i}] = {shard_index[i]}: kvcellar stores whole "
                             "blocks (UCMDirectConnector's shard 0); layerwise shards are not "
                             "supported")
        a = np.asarray(addrs, dtype=np.uint64) if not isinstance(addrs, np.ndarray) else addrs
        if len(a) != len(block_ids):
            raise ValueError(f"{what}: {len(a)} address rows for {len(block_ids)} blocks")
        return self.columns.blocks_of(a, what) if len(block_ids) else np.zeros(0, np.uint32)

    def _submit(self, kind: str, block_ids: List[bytes], blocks: np.ndarray,
                prerequisite_handle: int = 0) -> KvcellarTask:
        keys = page_keys(block_ids)
        n = len(block_ids)
        s = self.session
        if kind == "dump" and self._cuda and prerequisite_handle:
            # UCM's event after the step's KV writes: the ready event each Backup records on the
            # current stream then follows them.
            self._driver.stream_wait_event(torch.cuda.current_stream().cuda_stream,
                                           int(prerequisite_handle))
        step = s.info().max_batch_sequences or _DEFAULT_BATCH_SEQUENCES
        task = KvcellarTask(kind, [], n)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            if kind == "load":
                op = s.load([LoadSeq(keys[i:i + 1], blocks[i:i + 1]) for i in range(lo, hi)],
                            layerwise=False)
            else:
                op = s.backup([BackupSeq(keys[i:i + 1], blocks[i:i + 1]) for i in range(lo, hi)],
                              ready=self._cuda, write_policy=self.options.kvcellar_write_policy)
            if not op.ok:
                # Not accepted: the daemon is down, restarting or refusing (the health breaker's
                # StoreUnhealthy at submission, which UCM's connector turns into a miss). UCM
                # reuses the blocks at once: the ops of earlier chunks, and this one if its reply
                # was lost, must have ended first.
                running = task.ops + ([op] if may_run(op) else [])
                if running:
                    settle(s, running, self.options.kvcellar_io_timeout_ms, kind)
                raise StoreUnhealthyError(f"kvcellard: {kind} of {n} blocks not accepted: "
                                          f"{op.reason}")
            task.ops.append(op)
        return task

    def load(self, block_ids: List[bytes], shard_index: List[int],
             dst_tensor: List[List[torch.Tensor]]) -> Task:
        return self.load_data(block_ids, shard_index, _tensor_addrs(dst_tensor, self.columns))

    def dump(self, block_ids: List[bytes], shard_index: List[int],
             src_tensor: List[List[torch.Tensor]]) -> Task:
        return self.dump_data(block_ids, shard_index, _tensor_addrs(src_tensor, self.columns))

    def load_data(self, block_ids: List[bytes], shard_index: List[int],
                  dst_addr: List[List[int]] | np.ndarray) -> Task:
        blocks = self._blocks(block_ids, shard_index, dst_addr, "dst_addr")
        return self._submit("load", block_ids, blocks)

    def dump_data(self, block_ids: List[bytes], shard_index: List[int],
                  src_addr: List[List[int]] | np.ndarray, prerequisite_handle: int = 0) -> Task:
        blocks = self._blocks(block_ids, shard_index, src_addr, "src_addr")
        return self._submit("dump", block_ids, blocks, prerequisite_handle)

    def _end(self, task: KvcellarTask, timeout_ms: int) -> bool:
        """Ends ``task`` if all its ops have ended within ``timeout_ms``; True once ended."""
        if task._ended:
            return True
        sts = self.session.wait(task.ops, timeout_ms) if task.ops else []
        if not all(st.terminal for st in sts):
            return False
        ok = sum(sum(st.leading_ok_pages) for st in sts)
        failed = [st for st in sts if not st.done]
        if not failed and ok == task.num_blocks:
            task._final = None
        elif not failed and task.kind == "load":
            task._final = StoreNotFoundError(
                f"kvcellard: {task.num_blocks - ok} of {task.num_blocks} blocks not found")
        else:
            task._final = RuntimeError(f"kvcellard: {task.kind} of {task.num_blocks} blocks: "
                                       f"{ok} done, {failed[0].state if failed else 'done'}: "
                                       f"{failed[0].reason if failed else 'some not stored'}")
        task._ended = True
        return True

    def check(self, task: Task) -> bool:
        if not isinstance(task, KvcellarTask):
            raise ValueError(f"task: not a kvcellar task ({type(task).__name__})")
        try:
            return self._end(task, 0)
        except Exception as e:  # an op the daemon lost: ended, and wait() says how
            task._final, task._ended = RuntimeError(f"kvcellard: {e}"), True
            return True

    def wait(self, task: Task) -> None:
        if not isinstance(task, KvcellarTask):
            raise ValueError(f"task: not a kvcellar task ({type(task).__name__})")
        timeout = self.options.kvcellar_io_timeout_ms
        if not self._end(task, timeout):
            # UCM reuses the blocks once wait returns or raises, and the daemon's Load and
            # Backup cannot be cancelled: waited for until they end (_settle).
            settle(self.session, task.ops, timeout, f"{task.kind} of {task.num_blocks} blocks")
            if not self._end(task, 0):
                raise RuntimeError(f"kvcellard: {task.kind} of {task.num_blocks} blocks: the "
                                   "daemon went away before they ended")
        if task._final is not None:
            raise task._final

    def close(self) -> None:
        """Unregisters (the daemon then no longer touches the engine's memory)."""
        self.client.close()


def _tensor_addrs(tensors: List[List[torch.Tensor]], cols: Optional[KvColumns]) -> np.ndarray:
    """The address rows of UCM's tensor form (``tensors[i][j]``: block i's tensor j), each
    tensor checked to be one whole block of its column."""
    rows = []
    for i, row in enumerate(tensors):
        r = []
        for j, t in enumerate(row):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensors[{i}][{j}]: expected a torch.Tensor, got "
                                 f"{type(t).__name__}")
            nbytes = t.numel() * t.element_size()
            if cols is not None and j < len(cols.sizes) and (
                    nbytes != int(cols.sizes[j]) or not t.is_contiguous()):
                raise ValueError(f"tensors[{i}][{j}]: {nbytes} bytes (contiguous: "
                                 f"{t.is_contiguous()}), a block of KV tensor {j} is "
                                 f"{int(cols.sizes[j])} contiguous bytes")
            r.append(t.data_ptr())
        rows.append(r)
    return np.asarray(rows, dtype=np.uint64).reshape(len(rows), -1)
