"""kvcellar as AIBrix's L2 cache backend, written against ``aibrix-kvcache`` 0.8.0's L2
``Connector`` (aibrix_kvcache/l2/connectors/connector.py of the 0.8.0 wheel).

AIBrix 0.8.0 picks its L2 backend from a fixed list (``Connector.create``, keyed by
``AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND``) and has no plug-in registry, so the backend comes in
through :func:`install`, which adds ``KVCELLAR`` to that factory in this process:

    AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND=KVCELLAR
    AIBRIX_KV_CACHE_OL_L2_CACHE_NAMESPACE=<model name>      # AIBrix's own namespace
    AIBRIX_KV_CACHE_OL_KVCELLAR_SOCKET=/run/kvcellar/kvcellard.sock   # options: KvcellarOptions

    import kvcellar.integrations.aibrix as kvc_aibrix
    kvc_aibrix.install()          # before the BaseKVCacheManager / GroupAwareKVCacheManager

vLLM users load AIBrix's offloading connector through a subclass that installs first (vLLM is
not imported until the class is asked for):

    --kv-transfer-config '{"kv_connector": "KvcellarOffloadingConnector",
        "kv_connector_module_path": "kvcellar.integrations.aibrix", "kv_role": "kv_both"}'

(``KvcellarOffloadingConnectorType2`` wraps AIBrix's type-2 connector the same way.) The patch
that would make :func:`install` unnecessary upstream (a backend registry plus the block spec in
``ConnectorConfig``) is described in docs/integrations.md; :func:`install` uses that registry
when the installed AIBrix has it.

How the bytes move. The connector owns an arena: a CPU tensor of fixed-size slots (pinned when
CUDA is present, so AIBrix's offload kernels write into it), registered once with kvcellard as
this process's memory (``/proc/<pid>/mem``, docs/api.md "Process memory"). A slot is one AIBrix
object: one block of ``block_nbytes`` bytes (AIBrix's compact layout). In the zero-copy mode
(the default; ``ConnectorFeature.zero_copy``), AIBrix reads and writes the slots themselves:
``allocate`` hands out a slot, ``seal`` is a Backup of it under the key, ``acquire`` a Load into
a free slot, ``release``/``drop`` give the slot back; the daemon copies between the slot and its
node-wide pool, and Python copies nothing. ``get``/``put`` and the batched ``mget``/``mput``
(used by AIBrix's L1-backed configurations, with ``zero_copy`` off) copy once between AIBrix's
memory region and a slot, then Load/Backup the slot.

Keys and namespaces. AIBrix's cache keys (16-byte rolling hashes by default) are hashed to
kvcellar's 32-byte opaque keys (SHA-256). The namespace holds everything that decides an
object's bytes: AIBrix's namespace (the model: AIBrix's own convention, as for every AIBrix
backend), its connector id (head and layer partition, block layout and tokens, key builder,
layout), the block dtype and head size, and the object size, so an engine of another geometry or
dtype never sees these objects. Every object is its own one-page sequence. An object of another
size than the namespace's is never stored or served (``INVALID``).

Semantics, as 0.8.0 defines them and its built-in connectors report them:
- ``exists``: OK when the object is in the daemon's pool (or, with ``prefetch_policy``, was
  brought there from its L3 tiers in time), else NOT_FOUND.
- ``get``/``acquire``: OK with the bytes, NOT_FOUND when the daemon does not have them.
- ``put``/``seal``: OK once the daemon holds the bytes (``seal`` logs a failure, as PrisKV's).
- ``delete``: DENIED. An engine cannot remove objects from the node's shared pool (eviction is
  the daemon's: ``kvcellarctl evict``); AIBrix's L2Cache.delete ignores the per-key status.
- ``prefetch``: starts an L3 -> pool prefetch and returns (AIBrix 0.8.0's manager never calls it).
- A daemon that is down, restarting or slow: ERROR with the reason (InfiniStore's behaviour for
  a lost server), which AIBrix's L2Cache turns into a miss for reads and a logged failed write.
  Unlike InfiniStore, ``open`` does not fail when the daemon is down at engine start: the session
  registers in the background and calls report ERROR until it is active.
- Bad configuration (an unknown ``AIBRIX_KV_CACHE_OL_KVCELLAR_*`` variable, a bad value, the
  token-validation layout, AIBrix's cluster/placement mode) fails at the manager's construction
  with a ValueError naming it, as the built-in connectors' ``from_envs`` checks do.

Threading: AIBrix calls the async methods on its L2 event loop; each runs in AIBrix's executor
(``AsyncBase``). The Session and the arena's free list are thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket as socketlib
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, fields
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from aibrix_kvcache.common import AsyncBase
from aibrix_kvcache.l2.connectors import (Connector, ConnectorConfig, ConnectorFeature,
                                          ConnectorZeroCopyMemoryRegion)
from aibrix_kvcache.memory import MemoryRegion
from aibrix_kvcache.status import Status, StatusCodes

from ..client import BackupSeq, Client, LoadSeq, Session
from ..keys import Namespace
from ..layout import kv_dtype_for
from ._arena import SlotArena
from ._options import parse_options

AIBRIX_VERSION = "0.8.0"  # the aibrix-kvcache Connector this module implements
BACKEND_NAME = "KVCELLAR"  # AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND (AIBrix upper-cases it)
ENV_PREFIX = "AIBRIX_KV_CACHE_OL_KVCELLAR_"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvcellarOptions:
    """The backend's options: environment variables ``AIBRIX_KV_CACHE_OL_KVCELLAR_<NAME>``
    (AIBrix configures everything through its environment), with their defaults."""

    socket: Optional[str] = None  # kvcellard's address; None: the client library's default
    tenant: str = ""  # the namespace's tenant
    instance_id: Optional[str] = None  # None: "aibrix-<namespace>-<host>-<pid>"
    model_revision: str = ""  # the weights' revision, when AIBrix's namespace does not pin it
    kv_cache_dtype: Optional[str] = None  # needed when blocks hold fp8 as uint8
    zero_copy: bool = True  # AIBrix reads/writes the arena itself (bypasses AIBrix's L1)
    arena_mb: int = 512  # the arena's size (slots of one block each; at least 4 slots)
    rpc_timeout_ms: int = 250  # deadline of each call to the daemon
    register_timeout_ms: int = 2000  # deadline of one registration attempt (and open's wait)
    io_timeout_ms: int = 5000  # the longest a Load or Backup is waited for
    prefetch_policy: str = "wait_complete"  # L3 -> pool in exists: or none, timeout
    prefetch_timeout_ms: int = 5000  # the longest exists waits for L3 objects
    write_policy: Optional[str] = None  # L3 writes of backups; None: the daemon's default

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "KvcellarOptions":
        """The options from ``environ`` (default os.environ). Raises ValueError naming every
        unknown variable of the prefix and every value of the wrong type."""
        environ = os.environ if environ is None else environ
        types = {f.name: str(f.type) for f in fields(cls)}
        raw: dict[str, Any] = {}
        bad = []
        for var, text in environ.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX):].lower()
            kind = types.get(name)
            if kind is None:
                bad.append(f"{var} (unknown; known: "
                           f"{', '.join(ENV_PREFIX + n.upper() for n in types)})")
            elif kind == "int":
                try:
                    raw[name] = int(text.strip())
                except ValueError:
                    bad.append(f"{var} (expected an int, got {text!r})")
            elif kind == "bool":
                v = text.strip().lower()
                if v in ("1", "true"):
                    raw[name] = True
                elif v in ("0", "false"):
                    raw[name] = False
                else:
                    bad.append(f"{var} (expected 1, 0, true or false, got {text!r})")
            else:
                raw[name] = text
        if bad:
            raise ValueError(f"{ENV_PREFIX}*: " + "; ".join(bad))
        opts = parse_options(cls, raw, f"{ENV_PREFIX}<NAME> (lower-cased)")
        if opts.prefetch_policy == "best_effort":
            raise ValueError(f"{ENV_PREFIX}PREFETCH_POLICY ('best_effort' is not used: exists "
                             "counts what is in the pool; use wait_complete, timeout or none)")
        if opts.arena_mb == 0:
            raise ValueError(f"{ENV_PREFIX}ARENA_MB (must be at least 1)")
        return opts


# ---- the arena --------------------------------------------------------------------------------

MIN_SLOTS = 4  # below this a chunk of AIBrix's (at least 4 blocks, cache_manager.py) cannot fit


class SlotRegion(ConnectorZeroCopyMemoryRegion):
    """A slot lent to AIBrix by allocate (to be sealed or dropped) or acquire (to be released).
    ``done`` guards against giving the slot back twice."""

    def __init__(self, arena: SlotArena, slot: int, key: bytes, length: int) -> None:
        self.arena = arena
        self.slot = slot
        self.key = key
        self._length = length
        self.done = False
        self._lock = threading.Lock()

    @property
    def addr(self) -> int:
        return self.arena.address(self.slot)

    @property
    def length(self) -> int:
        return self._length

    def finish(self) -> bool:
        """True the first time: the caller then gives the slot back."""
        with self._lock:
            first, self.done = not self.done, True
            return first


class SpillRegion(SlotRegion):
    """An allocation made while every slot was lent: its own buffer, outside the arena."""

    def __init__(self, key: bytes, length: int) -> None:
        self.tensor = torch.empty(length, dtype=torch.uint8)
        self.slot = -1
        self.key = key
        self._length = length
        self.done = False
        self._lock = threading.Lock()

    @property
    def addr(self) -> int:
        return int(self.tensor.data_ptr())


# ---- keys --------------------------------------------------------------------------------------


def object_key(key: Any) -> bytes:
    """An AIBrix cache key (bytes from its key builder; block hashes joined and encoded) as a
    32-byte opaque key."""
    if isinstance(key, str):
        key = key.encode()
    return hashlib.sha256(bytes(key)).digest()


def _keys_array(keys: Sequence[Any]) -> np.ndarray:
    return np.frombuffer(b"".join(object_key(k) for k in keys), np.uint8).reshape(len(keys), 32)


def _error(reason: str) -> Status:
    return Status(StatusCodes.ERROR, f"kvcellar: {reason}")


# ---- the connector ----------------------------------------------------------------------------


@AsyncBase.async_wrap(exists="_exists", get="_get", put="_put", delete="_delete",
                      mget="_mget", mput="_mput", allocate="_allocate", seal="_seal",
                      drop="_drop", acquire="_acquire", release="_release",
                      prefetch="_prefetch")
class KvcellarConnector(Connector[bytes, torch.Tensor], AsyncBase):
    """AIBrix 0.8.0's L2 Connector over kvcellard; one per L2Cache (per TP rank)."""

    def __init__(self, conn_id: str, executor: Executor, block_spec: Any, namespace: str,
                 options: KvcellarOptions) -> None:
        super().__init__(executor)
        if not MemoryRegion.use_compact_layout():
            raise ValueError("AIBRIX_KV_CACHE_OL_TOKEN_VALIDATION_ENABLED: kvcellar stores "
                             "AIBrix's compact layout (objects of exactly block_nbytes); unset "
                             "it or set it to 0 (kvcellar's keys are SHA-256 digests)")
        self.conn_id = conn_id
        self.block_spec = block_spec
        self.options = options
        self.object_bytes = int(block_spec.block_nbytes)
        dtype = str(block_spec.block_dtype).replace("torch.", "")
        self.kv_dtype = options.kv_cache_dtype or kv_dtype_for(block_spec.block_dtype)
        if self.kv_dtype is None:
            raise ValueError(f"{ENV_PREFIX}KV_CACHE_DTYPE: blocks of {dtype} do not say which KV "
                             "format they hold; name it (e.g. fp8_e4m3)")
        ts = block_spec.tensor_spec
        revision = "|".join([
            options.model_revision, f"aibrix-kvcache-l2:{conn_id}",
            f"dtype:{dtype}", f"heads:{len(ts.heads)}", f"layers:{len(ts.layers)}",
            f"head_size:{ts.head_size}", f"object:{self.object_bytes}"])
        self.namespace = Namespace(namespace or "aibrix", revision, self.kv_dtype,
                                   int(block_spec.block_ntokens), layout="mla", tp_size=1,
                                   tenant=options.tenant, opaque_keys=True)
        self.instance_id = options.instance_id or (
            f"aibrix-{(namespace or 'aibrix').rstrip('/').split('/')[-1]}-"
            f"{socketlib.gethostname()}-{os.getpid()}-{abs(hash(conn_id)) % 10**8}")
        slots = max(MIN_SLOTS, options.arena_mb * (1 << 20) // self.object_bytes)
        self.arena: Optional[SlotArena] = None
        self._slots = slots
        self.client: Optional[Client] = None
        self.session: Optional[Session] = None
        self._lock = threading.Lock()
        self._warned_delete = False

    @classmethod
    def from_envs(cls, conn_id: str, executor: Executor, **kwargs: Any) -> "KvcellarConnector":
        """AIBrix's constructor hook. ``block_spec`` and ``namespace`` come from the L2Cache
        being built (install() captures them; an upstream ConnectorConfig carries them)."""
        block_spec = kwargs.pop("block_spec", None)
        namespace = kwargs.pop("namespace", "")
        if kwargs:
            raise ValueError(f"kvcellar: AIBrix's cluster mode (meta service members "
                             f"{sorted(kwargs)}) is not supported: kvcellard is the node's tier; "
                             "unset AIBRIX_KV_CACHE_OL_META_SERVICE_BACKEND")
        if block_spec is None:
            raise ValueError("kvcellar: no block spec: create the connector through AIBrix's "
                             "L2Cache after kvcellar.integrations.aibrix.install()")
        return cls(conn_id, executor, block_spec, namespace, KvcellarOptions.from_env())

    @property
    def name(self) -> str:
        return "kvcellar"

    @property
    def feature(self) -> ConnectorFeature:
        return ConnectorFeature(mput_mget=True, prefetch=True, zero_copy=self.options.zero_copy)

    # ---- lifecycle ------------------------------------------------------------------------

    def open(self) -> Status:
        """Allocates and registers the arena. A daemon that is down is not an error: the
        session registers in the background (calls report ERROR until then)."""
        with self._lock:
            if self.session is not None:
                return Status.ok()
            o = self.options
            try:
                self.arena = SlotArena(self.object_bytes, self._slots, torch.cuda.is_available())
                self.client = Client(o.socket, rpc_timeout_ms=o.rpc_timeout_ms,
                                     register_timeout_ms=o.register_timeout_ms)
                self.session = self.client.register(
                    self.instance_id, self.namespace,
                    layout=self.arena.layout("aibrix-arena", int(self.block_spec.block_ntokens)),
                    rank=0, load_slots=0, ready_slots=0, replace_existing=True,
                    engine_name=f"aibrix-kvcache {AIBRIX_VERSION}")
            except ValueError as e:  # refused registration: a configuration error
                self._close_locked()
                return Status(StatusCodes.INVALID, f"kvcellar: {e}")
            s = self.session
        if not s.wait_active(o.register_timeout_ms):
            log.warning("kvcellar: kvcellard at %s is not reachable yet (%s); AIBrix's L2 "
                        "misses until the session registers", o.socket or "default", s.state)
        log.info("kvcellar: L2 connector open: instance=%s objects=%d bytes slots=%d "
                 "zero_copy=%s", self.instance_id, self.object_bytes, self._slots, o.zero_copy)
        return Status.ok()

    def _close_locked(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> Status:
        with self._lock:
            self._close_locked()
        return Status.ok()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def register_slabs(self, slabs: List[torch.Tensor]) -> Status:
        return Status.ok()  # not an RDMA connector: AIBrix never calls this

    def _live(self) -> Tuple[Optional[Session], Optional[Status]]:
        """The session when it can serve a call, else the status the call returns."""
        s = self.session
        if s is None or self.arena is None:
            return None, _error("connector is not open")
        state = s.state
        if state != "active":
            return None, _error(f"kvcellard unavailable (session {state})")
        return s, None

    def _check_size(self, length: int) -> Optional[Status]:
        if length != self.object_bytes:
            return Status(StatusCodes.INVALID,
                          f"kvcellar: object of {length} bytes; this namespace stores "
                          f"{self.object_bytes}-byte objects")
        return None

    # ---- the daemon's calls on slots --------------------------------------------------------

    def _chunks(self, n: int) -> int:
        s = self.session
        limit = s.info().max_batch_sequences if s is not None else 0
        return max(1, min(limit or n, n))

    def _take(self, n: int) -> List[int]:
        """Up to ``n`` free slots, after taking back those whose ops have ended."""
        return self.arena.take(n, self.session)

    def _one_page_ops(self, keys: Sequence[Any], slots: Sequence[int], submit: Callable
                      ) -> Any:
        """keys[i] with slots[i], each object a one-page sequence, in ops of at most the
        daemon's max_batch_sequences: per op (its objects, the op, its status once ended in
        io_timeout_ms, else None with its slots held until it ends)."""
        step = self._chunks(len(keys))
        for lo in range(0, len(keys), step):
            ks, ss = keys[lo:lo + step], slots[lo:lo + step]
            arr = _keys_array(ks)
            op = submit([(arr[i:i + 1], np.array([ss[i]], np.uint32)) for i in range(len(ks))])
            yield len(ks), op, self.arena.outcome(op, ss, self.options.io_timeout_ms)

    def _load(self, s: Session, keys: Sequence[Any], slots: Sequence[int]) -> List[bool]:
        """Loads keys[i] into slots[i]: per object, whether it landed."""
        out: List[bool] = []
        for n, op, st in self._one_page_ops(keys, slots, lambda seqs: s.load(
                [LoadSeq(k, b) for k, b in seqs], layerwise=False)):
            if st is None or not st.done:
                log.debug("kvcellar: load of %d objects: %s", n,
                          op.reason if st is None else st.reason or st.state)
                out.extend([False] * n)
            else:
                out.extend(bool(k) for k in st.leading_ok_pages)
        return out

    def _backup(self, s: Session, keys: Sequence[Any], slots: Sequence[int]) -> List[Status]:
        """Backs slots[i] up under keys[i], waited for until the daemon holds the bytes."""
        out: List[Status] = []
        for n, op, st in self._one_page_ops(keys, slots, lambda seqs: s.backup(
                [BackupSeq(k, b) for k, b in seqs], ready=False,
                write_policy=self.options.write_policy)):
            if st is None or not st.done:
                why = op.reason if st is None else st.reason or st.state
                out.extend([_error(f"backup: {why}")] * n)
            else:
                out.extend(Status.ok() if k else _error("backup: not stored")
                           for k in st.leading_ok_pages)
        return out

    # ---- exists / prefetch / delete -------------------------------------------------------

    @Status.capture_exception
    def _exists(self, key: bytes) -> Status:
        s, err = self._live()
        if s is None:
            return err
        o = self.options
        reply = s.match([_keys_array([key])], by_keys=True, prefetch=o.prefetch_policy,
                        prefetch_timeout_ms=o.prefetch_timeout_ms)
        if not reply.ok:
            return _error(f"match: {reply.reason}")
        r = reply.results[0]
        if r.l2_hit_pages:
            return Status.ok()
        if reply.prefetch_op is not None and r.l3_hit_pages:
            st = reply.prefetch_op.wait(o.prefetch_timeout_ms)
            if st.done and st.leading_ok_pages and st.leading_ok_pages[0]:
                return Status.ok()
        return Status(StatusCodes.NOT_FOUND)

    @Status.capture_exception
    def _prefetch(self, keys: Any) -> None:
        """Starts bringing the objects from the daemon's L3 tiers into its pool; returns at once
        (L2Cache passes one key, the base class documents a list)."""
        s, _ = self._live()
        if s is None:
            return None
        if isinstance(keys, (bytes, bytearray, str)):
            keys = [keys]
        keys = list(keys)
        if keys:
            s.match([_keys_array([k]) for k in keys], by_keys=True, prefetch="best_effort")
        return None

    def _delete(self, key: bytes) -> Status:
        if not self._warned_delete:
            self._warned_delete = True
            log.warning("kvcellar: delete is not an engine's call: objects leave the node's "
                        "shared pool by eviction (kvcellarctl evict); answering DENIED")
        return Status(StatusCodes.DENIED, "kvcellar: objects are evicted by the daemon")

    # ---- get / put (one copy through the arena) ---------------------------------------------

    def get_batches(self, keys: Sequence[Any], mrs: Sequence[Any], batch_size: int
                    ) -> Sequence[Sequence[Tuple[Any, Any]]]:
        pairs = list(zip(keys, mrs))
        step = max(1, batch_size)
        return [pairs[i:i + step] for i in range(0, len(pairs), step)]

    @staticmethod
    def _mr_view(mr: Any) -> Optional[torch.Tensor]:
        if not isinstance(mr, MemoryRegion):
            return None  # a GDR list of regions: not a feature this connector has
        return mr.slab[mr.addr:mr.addr + mr.length]

    @Status.capture_exception
    def _get(self, key: bytes, mr: Any) -> Status:
        return self._mget([key], [mr])[0]

    @Status.capture_exception
    def _put(self, key: bytes, mr: Any) -> Status:
        return self._mput([key], [mr])[0]

    def _mget(self, keys: Sequence[Any], mrs: Sequence[Any]) -> List[Status]:
        """Loads the objects into arena slots, then copies each into its region."""

        def move(s: Session, batch: list, slots: List[int], out: List[Status]) -> None:
            landed = self._load(s, [keys[i] for i, _ in batch], slots)
            for (i, view), slot, ok in zip(batch, slots, landed):
                if ok:
                    view.copy_(self.arena.tensor[slot])
                    out[i] = Status.ok()

        return self._through_slots("get", keys, mrs, Status(StatusCodes.NOT_FOUND), move)

    def _mput(self, keys: Sequence[Any], mrs: Sequence[Any]) -> List[Status]:
        """Copies each region into an arena slot, then backs the slots up."""

        def move(s: Session, batch: list, slots: List[int], out: List[Status]) -> None:
            for (_, view), slot in zip(batch, slots):
                self.arena.tensor[slot].copy_(view)
            for (i, _), st in zip(batch, self._backup(s, [keys[i] for i, _ in batch], slots)):
                out[i] = st

        return self._through_slots("put", keys, mrs, _error("not stored"), move)

    def _through_slots(self, what: str, keys: Sequence[Any], mrs: Sequence[Any],
                       initial: Status, move: Callable[..., None]) -> List[Status]:
        """The copy mode's get and put: each region of the right size gets a slot, as many at
        a time as the arena has free, and ``move(session, [(index, view)], slots, out)`` moves
        that batch; every failure is a status (a miss or a failed write), never an error."""
        out: List[Status] = [initial] * len(keys)
        try:
            s, err = self._live()
            if s is None:
                return [err] * len(keys)
            todo = []
            for i, mr in enumerate(mrs):
                view = self._mr_view(mr)
                bad = (self._check_size(mr.length) if view is not None else
                       Status(StatusCodes.INVALID, "kvcellar: one memory region per object"))
                if bad is not None:
                    out[i] = bad
                else:
                    todo.append((i, view))
            while todo:
                slots = self._take(len(todo))
                if not slots:
                    for i, _ in todo:
                        out[i] = Status(StatusCodes.OUT_OF_MEMORY, "kvcellar: arena is full")
                    break
                batch, todo = todo[:len(slots)], todo[len(slots):]
                try:
                    move(s, batch, slots, out)
                finally:
                    self.arena.give(slots)
            return out
        except Exception as e:  # a miss or a failed write, never an engine error
            log.warning("kvcellar: %s: %s", what, e)
            return [Status(StatusCodes.ERROR, e)] * len(keys)

    # ---- zero copy: AIBrix reads and writes the slots -------------------------------------

    @Status.capture_exception
    def _allocate(self, key: bytes, length: int) -> Status:
        """A slot for AIBrix to write the object into. Never fails for a daemon that is down or
        an arena that is full: AIBrix 0.8.0's manager asserts (an engine error) when a call's
        first allocation fails (L2Cache.allocate returns no regions, MemoryRegionKVCacheHandle
        asserts some). Such an object gets a spill buffer of its own; its seal stores it through
        a slot when one is free, else drops it (a failed write)."""
        bad = self._check_size(int(length))
        if bad is not None:
            return bad
        if self.arena is None:
            return _error("connector is not open")
        slots = self._take(1)
        if slots:
            return Status.ok(SlotRegion(self.arena, slots[0], bytes(key), int(length)))
        return Status.ok(SpillRegion(bytes(key), int(length)))

    def _seal(self, mr: SlotRegion) -> None:
        """Stores the slot under its key, waited for; the slot is free again either way."""
        if not mr.finish():
            return None
        if isinstance(mr, SpillRegion):
            slots = self._take(1)
            if not slots:
                log.warning("kvcellar: seal: arena is full: an object was not stored")
                return None
            self.arena.tensor[slots[0]].copy_(mr.tensor)
            mr = SlotRegion(self.arena, slots[0], mr.key, mr.length)
        try:
            s, err = self._live()
            st = err if s is None else self._backup(s, [mr.key], [mr.slot])[0]
            if not st.is_ok():
                log.warning("kvcellar: seal: %s", st.value)
        except Exception as e:  # a failed write, never an engine error
            log.warning("kvcellar: seal: %s", e)
        finally:
            self.arena.give([mr.slot])
        return None

    def _drop(self, mr: SlotRegion) -> None:
        if mr.finish() and not isinstance(mr, SpillRegion):
            self.arena.give([mr.slot])
        return None

    @Status.capture_exception
    def _acquire(self, key: bytes) -> Status:
        s, err = self._live()
        if s is None:
            return err
        slots = self._take(1)
        if not slots:
            return Status(StatusCodes.OUT_OF_MEMORY, "kvcellar: arena is full")
        try:
            if self._load(s, [key], slots)[0]:
                mr = SlotRegion(self.arena, slots[0], bytes(key), self.object_bytes)
                slots = []
                return Status.ok(mr)
            return Status(StatusCodes.NOT_FOUND)
        finally:
            if slots:
                self.arena.give(slots)

    def _release(self, mr: SlotRegion) -> None:
        if mr.finish():
            self.arena.give([mr.slot])
        return None


# ---- the way in ---------------------------------------------------------------------------------

_install_lock = threading.Lock()
_building = threading.local()  # the L2Cache whose constructor is running on this thread


def _conn_id(config: ConnectorConfig) -> str:
    """AIBrix 0.8.0's connector id (Connector.create): namespace, partition, signatures."""
    conn_id = f"{config.namespace}_{config.partition_id}"
    sig = f"{config.block_spec_signature}{config.key_builder_signature}{config.layout_signature}"
    return f"{conn_id}_{sig}" if sig else conn_id


def _create(config: ConnectorConfig, conn_id: Optional[str] = None, **kwargs: Any) -> Connector:
    """The factory: AIBrix's (patched) registry calls it with the connector id, install()'s
    wrapper of 0.8.0's Connector.create without."""
    spec = getattr(config, "block_spec", None)
    if spec is None:
        l2 = getattr(_building, "l2", None)
        spec = getattr(l2, "block_spec", None)
    if spec is not None:
        kwargs["block_spec"] = spec
    return KvcellarConnector.from_envs(conn_id or _conn_id(config), config.executor,
                                       namespace=config.namespace, **kwargs)


def install() -> None:
    """Makes ``AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND=KVCELLAR`` create a KvcellarConnector in this
    process. Idempotent. With an AIBrix that has a backend registry (the upstream patch,
    ``Connector.register_backend``) it registers there; with 0.8.0 it wraps ``Connector.create``
    (other backend names go to AIBrix's own factory unchanged) and ``L2Cache.__init__`` (to give
    the connector the block spec, which 0.8.0's ConnectorConfig does not carry)."""
    with _install_lock:
        register = getattr(Connector, "register_backend", None)
        if register is not None:
            register(BACKEND_NAME, _create)
            return
        if getattr(Connector.create, "_kvcellar", False):
            return
        from aibrix_kvcache.l2 import l2_cache

        builtin = Connector.create

        def create(config: ConnectorConfig, **kwargs: Any) -> Connector:
            if config.backend_name == BACKEND_NAME:
                return _create(config, **kwargs)
            return builtin(config, **kwargs)

        create._kvcellar = True  # type: ignore[attr-defined]
        Connector.create = staticmethod(create)  # type: ignore[method-assign]

        init = l2_cache.L2Cache.__init__

        def l2_init(self: Any, *args: Any, **kwargs: Any) -> None:
            prev, _building.l2 = getattr(_building, "l2", None), self
            try:
                init(self, *args, **kwargs)
            finally:
                _building.l2 = prev

        l2_init.__wrapped__ = init  # type: ignore[attr-defined]
        l2_cache.L2Cache.__init__ = l2_init  # type: ignore[method-assign]
        log.info("kvcellar: AIBrix L2 backend %s installed", BACKEND_NAME)


def installed() -> bool:
    return bool(getattr(Connector.create, "_kvcellar", False))


# ---- vLLM: AIBrix's offloading connector, installing kvcellar first -----------------------------

_VLLM_CONNECTORS = {
    "KvcellarOffloadingConnector": "aibrix_offloading_connector_type1",
    "KvcellarOffloadingConnectorType2": "aibrix_offloading_connector_type2",
}


def offloading_connector_class(base: type, name: str) -> type:
    """A subclass of AIBrix's vLLM connector ``base`` whose construction installs kvcellar's
    backend first, in whichever process vLLM builds it (scheduler and workers)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        install()
        base.__init__(self, *args, **kwargs)

    return type(name, (base,), {"__init__": __init__, "__module__": __name__,
                                "__doc__": f"{base.__name__} with kvcellar's L2 backend."})


def __getattr__(name: str) -> Any:
    """vLLM's ``kv_connector_module_path`` loader asks for the class by name; it is built then,
    so importing this module never imports vLLM."""
    module = _VLLM_CONNECTORS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        mod = importlib.import_module(f"aibrix_kvcache.integration.vllm.kv_connector.{module}")
    except ImportError as e:
        raise ImportError(f"{name}: AIBrix's vLLM connector needs vLLM ({e})") from e
    cls = offloading_connector_class(mod.AIBrixOffloadingConnector, name)
    globals()[name] = cls
    return cls
