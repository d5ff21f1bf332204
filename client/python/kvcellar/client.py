"""Client and Session: the whole client API with Python types.

    client = kvcellar.Client()                       # the default socket; never waits
    session = client.register("engine-a", ns, layout=layout)   # one per TP rank
    m = session.match([tokens], pin=True)            # keys computed here, once
    op = session.load(m.results[0].keys[:m.results[0].l2_hit_pages], blocks,
                      pin_id=m.results[0].pin_id)
    for layer in range(num_layers): op.wait_layer(layer); ...  # run layer as soon as it landed
    ok_pages = op.wait().leading_ok_pages[0]         # recompute anything past it
    op = session.backup(new_keys, new_blocks, parent=parent_key, ready=True)

Failure semantics: registration checks its arguments and raises ``ValueError`` naming the bad
one before anything reaches the daemon. After that nothing raises: every data call (match, load,
backup, wait, release) returns a result whose ``ok`` is False and whose ``reason`` says why when
the cache could not serve it (daemon down, restarting or slow, a refused namespace, a bad
argument inside the step); the result is then a miss the engine recomputes. No call blocks past
its deadline (``rpc_timeout_ms``; waits: their timeout plus ``rpc_timeout_ms``).

Threading: Client and Session are thread-safe, like the C++ library under them.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from . import _native as N
from .keys import Namespace, TokensLike, as_keys, as_tokens, keys_of_full_pages, page_keys
from .layout import KvLayout

PREFETCH_POLICIES = {None: 0, "none": 1, "best_effort": 2, "wait_complete": 3, "timeout": 4}
WRITE_POLICIES = {None: 0, "write_through": 1, "write_through_selective": 2, "write_back": 3,
                  "l2_only": 4}
SESSION_STATES = {0: "connecting", 1: "active", 2: "suspect", 3: "refused", 4: "closed"}
OP_STATES = {0: "unknown", 1: "pending", 2: "done", 3: "failed", 4: "cancelled", 5: "unknown"}
PAGE_STATUS = {0: "unspecified", 1: "ok", 2: "pending", 3: "miss", 4: "already_present",
               5: "in_flight", 6: "skipped", 7: "no_space", 8: "throttled", 9: "parent_missing",
               10: "timeout", 11: "cancelled", 12: "l3_error", 13: "checksum_error",
               14: "device_error", 15: "internal_error"}

BlocksLike = Union[np.ndarray, Sequence[int]]
KeysLike = Union[np.ndarray, bytes, Sequence[bytes]]


_U32 = np.dtype(np.uint32)


def _blocks(blocks: BlocksLike) -> np.ndarray:
    if (type(blocks) is np.ndarray and blocks.dtype == _U32 and blocks.ndim == 1
            and blocks.flags.c_contiguous):
        return blocks  # every uint32 is a valid index: nothing to check or convert
    if hasattr(blocks, "detach"):
        blocks = blocks.detach().cpu().numpy()
    arr = np.asarray(blocks)
    if arr.ndim != 1:
        raise ValueError(f"blocks: expected a 1-D array, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("blocks: indices must fit in uint32")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _fill_pages(c: Any, i: int, s: Any, page_status: bool, per_page: int) -> tuple:
    """Points C sequence `c` (kvc_load_seq or kvc_backup_seq) at sequence i's keys and blocks
    (and a page-status array when asked); returns the arrays, which must outlive the call.
    ``per_page``: blocks per page, the number of KV groups of a hybrid namespace (blocks are then
    page-major, ``N.NO_BLOCK`` where a group's object is not moved), else 1."""
    k, b = as_keys(s.keys), _blocks(s.blocks)
    if len(k) * per_page != len(b):
        raise ValueError(f"sequence {i}: {len(k)} keys but {len(b)} blocks ({per_page} per page)")
    st = np.zeros(len(k), np.uint8) if page_status else None
    c.keys = N.address(k)
    c.blocks = N.address(b)
    c.num_pages = len(k)
    if st is not None:
        c.page_status = N.address(st)
    return (k, b, st)


# ---- results --------------------------------------------------------------------------------


@dataclass
class SessionInfo:
    session_id: int
    generation: int
    daemon_epoch: int
    lease_ms: int
    heartbeat_interval_ms: int
    shard_index: int
    num_shards: int
    is_shard_writer: bool
    page_object_bytes: int
    state: str
    ns_digest: bytes
    max_batch_pages: int
    max_batch_sequences: int
    num_l3_tiers: int
    # The daemon's KV events carry each page's tokens: pass them to backup(tokens=...).
    page_tokens: bool = False


@dataclass
class MatchResult:
    """One sequence's match. Pages are counted from ``num_computed_pages``; ``keys`` holds the
    keys of pages ``num_computed_pages`` onward, so ``keys[:l2_hit_pages]`` are the ones to Load
    and what follows the hit are the ones to compute and Backup."""

    l2_hit_pages: int = 0
    l3_hit_pages: int = 0
    total_pages: int = 0
    pin_id: int = 0
    keys: np.ndarray = field(default_factory=lambda: np.zeros((0, N.KEY_BYTES), np.uint8))


@dataclass
class MatchReply:
    results: list[MatchResult]
    prefetch_op: Optional["Op"] = None
    ok: bool = True
    reason: str = ""


@dataclass
class OpStatus:
    state: str  # pending, done, failed, cancelled, unknown
    leading_ok_pages: list[int]  # per sequence: the usable prefix (0 unless done)
    ok: bool = True
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def terminal(self) -> bool:
        return self.state not in ("pending",)


@dataclass
class LoadSeq:
    keys: KeysLike
    blocks: BlocksLike
    pin_id: int = 0
    release_pin: bool = False


@dataclass
class BackupSeq:
    keys: KeysLike
    blocks: BlocksLike
    parent: Optional[bytes] = None  # key of the page before keys[0]; None for page 0
    # The pages' tokens (page_size per page), for the daemon's KV events: sent when it publishes
    # events that carry them; in a chained namespace they must be the tokens the keys hash.
    tokens: Optional[Any] = None


class Op:
    """A submitted Load, Backup or prefetch. ``state``/``leading_ok_pages``/``page_status`` are
    as of submission; ``wait()`` gives the final outcome."""

    def __init__(self, session: "Session", c_op: N.Op, state: int, ok: bool, reason: str,
                 leading_ok_pages: list[int], page_status: Optional[list[np.ndarray]] = None,
                 slot: Optional[int] = None, num_sequences: int = 0) -> None:
        self.session = session
        self.c_op = c_op
        self.state = OP_STATES.get(state, "unknown")
        self.ok = ok
        self.reason = reason
        self.leading_ok_pages = leading_ok_pages
        self.page_status = page_status or []
        self.slot = slot  # the load slot whose per-layer signals this op uses
        self.num_sequences = num_sequences
        self._final: Optional[OpStatus] = None

    @property
    def op_id(self) -> int:
        return int(self.c_op.op_id)

    def wait_layer(self, layer: int, timeout_ms: int = 5000) -> bool:
        """Until layer ``layer`` of this Load has landed (True) or will never be signalled
        (False: the whole op is then a miss). On CUDA this enqueues a wait on the current stream
        and returns at once; on the sim device it waits on the host."""
        return self.session._wait_layer(self, layer, timeout_ms)

    def wait(self, timeout_ms: int = 5000) -> OpStatus:
        """The op's outcome; ``pending`` with ok False when it did not finish in time."""
        if self._final is None and self.state == "done" and self.ok and self.op_id:
            # DONE at submission (the daemon finished it within the call): that is final, and
            # its leading_ok_pages are the usable ones. No WaitOps round trip, as a C++ engine
            # checks OpResult::terminal() before calling WaitOps.
            self._final = OpStatus("done", list(self.leading_ok_pages))
            self.session._free_slot(self)
        if self._final is None:
            st = self.session.wait([self], timeout_ms)[0]
            if st.terminal:  # an unknown outcome is reported pending, so terminal is final
                self._final = st
                self.session._free_slot(self)
            return st
        return self._final


# ---- completion channels ---------------------------------------------------------------------


class _CudaEvents:
    """Interprocess CUDA events (torch.cuda.Event(interprocess=True)) the daemon records per
    Load layer and waits on before a Backup's gathers (docs/api.md, "CUDA: IPC events")."""

    def __init__(self, device: int, num_load_slots: int, num_layers: int,
                 num_ready_slots: int) -> None:
        import torch

        with torch.cuda.device(device):
            def ev() -> Any:
                return torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)

            self.load = [[ev() for _ in range(num_layers)] for _ in range(num_load_slots)]
            self.ready = [ev() for _ in range(num_ready_slots)]
        self.load_handles = b"".join(bytes(e.ipc_handle()) for row in self.load for e in row)
        self.ready_handles = b"".join(bytes(e.ipc_handle()) for e in self.ready)


# ---- client and session ---------------------------------------------------------------------


class Client:
    """A connection to kvcellard. Construction never waits for the daemon: an engine starts
    whether or not kvcellard is up. Raises ValueError only for bad options."""

    def __init__(self, socket: Optional[str] = None, *, rpc_timeout_ms: int = 250,
                 register_timeout_ms: int = 2000, backoff_min_ms: int = 100,
                 backoff_max_ms: int = 5000, heartbeat: bool = True,
                 heartbeat_interval_ms: int = 0, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_server_name: Optional[str] = None) -> None:
        for name, v in (("rpc_timeout_ms", rpc_timeout_ms),
                        ("register_timeout_ms", register_timeout_ms),
                        ("backoff_min_ms", backoff_min_ms), ("backoff_max_ms", backoff_max_ms),
                        ("heartbeat_interval_ms", heartbeat_interval_ms)):
            if not isinstance(v, int) or v < 0 or v >= 2**32:
                raise ValueError(f"{name}: {v!r} is not a non-negative u32")
        opts = N.ClientOptions()
        N.lib.kvc_client_options_init(ctypes.byref(opts))
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        opts.addr = enc(socket)
        opts.rpc_timeout_ms = rpc_timeout_ms
        opts.register_timeout_ms = register_timeout_ms
        opts.backoff_min_ms = backoff_min_ms
        opts.backoff_max_ms = backoff_max_ms
        opts.heartbeat = 1 if heartbeat else 0
        opts.heartbeat_interval_ms = heartbeat_interval_ms
        opts.tls_ca_file = enc(tls_ca_file)
        opts.tls_cert_file = enc(tls_cert_file)
        opts.tls_key_file = enc(tls_key_file)
        opts.tls_server_name = enc(tls_server_name)
        self._handle = ctypes.c_void_p()
        rc = N.lib.kvc_client_connect(ctypes.byref(opts), ctypes.byref(self._handle))
        if rc != N.OK:
            raise ValueError(f"Client: {N.last_error()}")
        self.socket = socket
        self.rpc_timeout_ms = rpc_timeout_ms
        self._sessions: list["Session"] = []

    def register(self, instance_id: str, ns: Namespace, *, layout: Optional[KvLayout] = None,
                 rank: int = 0, scheduler: bool = False, load_slots: int = 4,
                 ready_slots: int = 4, replace_existing: bool = False,
                 engine_name: str = "kvcellar-python") -> "Session":
        """Registers one engine rank (``layout`` required) or a scheduler process
        (``scheduler=True``: match only). Creates the completion channel: shared-memory
        counters on the sim device, interprocess CUDA events on a GPU.

        Raises ValueError naming the argument for a registration the daemon would refuse, or
        that the daemon refused (bad layout, a group mismatch). A daemon that is down is not an
        error: the session registers in the background and every call misses until then.
        """
        if not isinstance(ns, Namespace):
            raise ValueError(f"ns: expected kvcellar.Namespace, got {type(ns).__name__}")
        if not instance_id or not isinstance(instance_id, str):
            raise ValueError("instance_id: must be a non-empty str")
        if scheduler:
            layout = None
            load_slots = ready_slots = 0
        else:
            _check_worker(ns, layout, rank)
        return Session(self, instance_id, ns, layout, rank, scheduler, load_slots, ready_slots,
                       replace_existing, engine_name)

    def stats(self) -> dict[str, int]:
        """Counters over the client's lifetime (degraded calls, re-registrations, ...)."""
        s = N.ClientStats()
        N.lib.kvc_client_stats_get(self._handle, ctypes.byref(s))
        return {name: int(getattr(s, name)) for name, _ in N.ClientStats._fields_}

    def close(self) -> None:
        """Closes every session of this client, then the client."""
        for s in list(self._sessions):
            s.close()
        if self._handle:
            N.lib.kvc_client_close(self._handle)
            self._handle = ctypes.c_void_p()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_worker(ns: Namespace, layout: Optional[KvLayout], rank: int) -> None:
    if layout is None:
        raise ValueError("layout: a worker needs its KvLayout (KvLayout.from_vllm, from_sglang, "
                         "from_block_tensors)")
    if not isinstance(layout, KvLayout):
        raise ValueError(f"layout: expected kvcellar.KvLayout, got {type(layout).__name__}")
    if not 0 <= rank < ns.tp_size:
        raise ValueError(f"rank: {rank} is not in [0, ns.tp_size={ns.tp_size})")
    if layout.mla != (ns.layout == "mla"):
        raise ValueError(f"layout: {'MLA (latent only)' if layout.mla else 'K and V'} buffers, "
                         f"but ns.layout is {ns.layout!r}")
    if layout.kv_dtypes() and ns.kv_dtype not in layout.kv_dtypes():
        raise ValueError(f"layout: tensors of dtype {layout.dtype} cannot hold ns.kv_dtype "
                         f"{ns.kv_dtype!r}")
    if layout.tokens_per_block and layout.tokens_per_block != ns.page_size:
        raise ValueError(f"layout: blocks of {layout.tokens_per_block} tokens, but "
                         f"ns.page_size is {ns.page_size}")


class Session:
    """One registered engine rank or scheduler. Hides re-registrations: the engine keeps one
    Session for its lifetime. Data calls never raise (see the module docstring)."""

    def __init__(self, client: Client, instance_id: str, ns: Namespace,
                 layout: Optional[KvLayout], rank: int, scheduler: bool, load_slots: int,
                 ready_slots: int, replace_existing: bool, engine_name: str) -> None:
        self.client = client
        self.ns = ns
        self.layout = layout
        self.rank = rank
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._sim_signals = None
        self._cuda_events: Optional[_CudaEvents] = None
        self._free_load_slots: list[int] = list(range(load_slots))
        self._next_ready = 0
        self.num_ready_slots = ready_slots
        reg = N.Registration()
        keep: list = []
        reg.instance_id = instance_id.encode()
        reg.rank = rank
        reg.scheduler = 1 if scheduler else 0
        reg.ns = ns.to_c()
        reg.replace_existing = 1 if replace_existing else 0
        reg.engine_name = engine_name.encode()
        if layout is not None:
            layout.fill(reg, keep)
            reg.num_load_slots = load_slots
            reg.num_ready_slots = ready_slots
            if load_slots or ready_slots:
                if layout.device_kind == N.DEVICE_SIM:
                    from .sim import SimSignals

                    self._sim_signals = SimSignals(max(load_slots, 0), layout.num_layers,
                                                   max(ready_slots, 0))
                    reg.sim_signal_shm_name = self._sim_signals.name.encode()
                    reg.sim_signal_size = self._sim_signals.size
                else:
                    ev = _CudaEvents(layout.cuda_device or 0, load_slots, layout.num_layers,
                                     ready_slots)
                    self._cuda_events = ev
                    lh = (ctypes.c_uint8 * max(len(ev.load_handles), 1)).from_buffer_copy(
                        ev.load_handles or b"\0")
                    rh = (ctypes.c_uint8 * max(len(ev.ready_handles), 1)).from_buffer_copy(
                        ev.ready_handles or b"\0")
                    keep.extend([lh, rh])
                    reg.cuda_load_event_handles = ctypes.cast(lh, ctypes.POINTER(ctypes.c_uint8))
                    reg.cuda_ready_event_handles = ctypes.cast(rh, ctypes.POINTER(ctypes.c_uint8))
        self._handle = ctypes.c_void_p()
        rc = N.lib.kvc_register(client._handle, ctypes.byref(reg), ctypes.byref(self._handle))
        if rc != N.OK:
            msg = N.last_error()
            if self._sim_signals is not None:
                self._sim_signals.close()
            raise ValueError(f"register: {msg}")
        client._sessions.append(self)

    # ---- state -----------------------------------------------------------------------------

    def info(self) -> SessionInfo:
        i = N.SessionInfo()
        N.lib.kvc_session_info_get(self._handle, ctypes.byref(i))
        return SessionInfo(int(i.session_id), int(i.generation), int(i.daemon_epoch),
                           int(i.lease_ms), int(i.heartbeat_interval_ms), int(i.shard_index),
                           int(i.num_shards), bool(i.is_shard_writer), int(i.page_object_bytes),
                           SESSION_STATES.get(i.state, "closed"), bytes(i.ns_digest),
                           int(i.max_batch_pages), int(i.max_batch_sequences),
                           int(i.num_l3_tiers), bool(i.page_tokens))

    @property
    def state(self) -> str:
        return self.info().state

    def wait_active(self, timeout_ms: int = 2000) -> bool:
        """True once registered with the daemon; False after timeout_ms."""
        return N.lib.kvc_session_wait_active(self._handle, timeout_ms) == N.OK

    def keys(self, tokens: TokensLike, parent: Optional[bytes] = None) -> np.ndarray:
        """Keys of the full pages of ``tokens`` in this session's namespace, shape (n, 32). From
        position 0 (no ``parent``) they come through the session's key cache, so the pages of a
        conversation's earlier turns are not hashed again."""
        if parent is not None:
            return page_keys(self.ns, tokens, parent)
        return keys_of_full_pages(
            "keys", self.ns.page_size, tokens,
            lambda toks, out, n, got: N.lib.kvc_session_keys(self._handle, N.address(toks),
                                                             len(toks), N.address(out), n, got))

    # ---- Match -----------------------------------------------------------------------------

    def match(self, sequences: Sequence[Any], *, num_computed_pages: Optional[Sequence[int]] = None,
              by_keys: bool = False, pin: bool = False, pin_lease_ms: int = 0,
              prefetch: Optional[str] = None, prefetch_timeout_ms: int = 0,
              l3_lookup_timeout_ms: int = 0, step_id: int = 0) -> MatchReply:
        """The longest cached prefix of each sequence, consistent across the TP group.

        ``sequences``: token arrays (every token from position 0), or with ``by_keys`` key
        arrays of pages ``num_computed_pages[i]`` onward. ``pin`` holds the L2 hit under a lease
        until a Load with ``release_pin`` or ``release()``. ``prefetch``: none, best_effort,
        wait_complete or timeout (L3 hits into L2); None uses the daemon's default.
        """
        n = len(sequences)
        try:
            ncp = list(num_computed_pages) if num_computed_pages is not None else [0] * n
            if len(ncp) != n:
                raise ValueError(f"num_computed_pages: {len(ncp)} entries for {n} sequences")
            if prefetch not in PREFETCH_POLICIES:
                raise ValueError(f"prefetch: {prefetch!r} is not one of "
                                 f"{[p for p in PREFETCH_POLICIES if p]}")
            keys = []
            seqs = (N.MatchSeq * max(n, 1))()
            for i, s in enumerate(sequences):
                if by_keys:
                    k = as_keys(s)
                else:
                    k = self.keys(s)
                    if ncp[i]:
                        k = k[ncp[i]:]
                keys.append(k)
                c = seqs[i]
                c.keys = N.address(k)
                c.num_keys = len(k)
                c.num_computed_pages = ncp[i]
            opts = N.MatchOptions(1 if pin else 0, pin_lease_ms, PREFETCH_POLICIES[prefetch],
                                  prefetch_timeout_ms, step_id, l3_lookup_timeout_ms)
            pop = N.Op()
            rc = N.lib.kvc_match(self._handle, seqs, n, ctypes.byref(opts), ctypes.byref(pop))
            reason = N.status_reason(rc)
            results = []
            for i in range(n):
                c = seqs[i]
                results.append(MatchResult(c.l2_hit_pages, c.l3_hit_pages, c.total_pages,
                                           c.pin_id, keys[i]))
            prefetch_op = None
            if pop.op_id:
                prefetch_op = Op(self, pop, 1, True, "", [0] * n, num_sequences=n)
            return MatchReply(results, prefetch_op, rc == N.OK, reason)
        except Exception as e:  # a miss, never an exception in the engine's step
            return MatchReply([MatchResult() for _ in range(n)], None, False, f"error: {e}")

    # ---- Load / Backup ---------------------------------------------------------------------

    def load(self, keys: Union[KeysLike, Sequence[LoadSeq]], blocks: Optional[BlocksLike] = None,
             *, pin_id: int = 0, release_pin: bool = False, layerwise: bool = True,
             page_status: bool = False) -> Op:
        """Scatters cached pages into device blocks: ``blocks[i]`` receives ``keys[i]``. Pass
        one sequence as (keys, blocks) or several as a list of LoadSeq. ``layerwise`` signals
        each layer as it lands (``op.wait_layer``) when a load slot is free."""
        seqs_in = keys if blocks is None else [LoadSeq(keys, blocks, pin_id, release_pin)]
        slot = None
        try:
            n = len(seqs_in)
            seqs = (N.LoadSeq * max(n, 1))()
            arrays = []  # keeps every array the C structures point into alive over the call
            for i, s in enumerate(seqs_in):
                arrays.append(_fill_pages(seqs[i], i, s, page_status, self.ns.blocks_per_page))
                seqs[i].pin_id = s.pin_id
                seqs[i].release_pin = 1 if s.release_pin else 0
            if layerwise:
                slot = self._take_slot()
            c_op, state = N.Op(), ctypes.c_int(0)
            rc = N.lib.kvc_load(self._handle, seqs, n, 1 if slot is not None else 0,
                                slot or 0, ctypes.byref(c_op), ctypes.byref(state))
            reason = N.status_reason(rc)
            op = Op(self, c_op, state.value, rc == N.OK, reason,
                    [seqs[i].leading_ok_pages for i in range(n)],
                    [a[2] for a in arrays if len(a) == 3] if page_status else None,
                    slot if c_op.op_id else None, n)
            if slot is not None and not c_op.op_id:
                self._release_slot(slot)
            return op
        except Exception as e:
            if slot is not None:
                self._release_slot(slot)
            return Op(self, N.Op(), 3, False, f"error: {e}", [0] * len(seqs_in))

    def backup(self, keys: Union[KeysLike, Sequence[BackupSeq]],
               blocks: Optional[BlocksLike] = None, *, parent: Optional[bytes] = None,
               ready: bool = True, write_policy: Optional[str] = None,
               ready_timeout_ms: int = 0, page_status: bool = False,
               tokens: Optional[Any] = None) -> Op:
        """Gathers device blocks into host pages under ``keys`` (``parent``: key of the page
        before keys[0], None for page 0). ``ready``: the daemon waits for the writes the engine
        has issued so far (CUDA: an interprocess event recorded on the current stream now, so
        the engine never synchronizes; sim: the host writes are done, a ready token says so).
        The engine must not reuse the blocks until the op is terminal (``op.wait()``).
        ``tokens``: the pages' tokens (``page_size`` each), which the daemon's KV events carry
        for routers that hash tokens (docs/events.md)."""
        seqs_in = keys if blocks is None else [BackupSeq(keys, blocks, parent, tokens)]
        try:
            n = len(seqs_in)
            if write_policy not in WRITE_POLICIES:
                raise ValueError(f"write_policy: {write_policy!r} is not one of "
                                 f"{[p for p in WRITE_POLICIES if p]}")
            seqs = (N.BackupSeq * max(n, 1))()
            arrays = []  # keeps every array the C structures point into alive over the call
            for i, s in enumerate(seqs_in):
                arrays.append(_fill_pages(seqs[i], i, s, page_status, self.ns.blocks_per_page))
                if s.parent is not None:
                    if len(s.parent) != N.KEY_BYTES:
                        raise ValueError(f"sequence {i}: parent of {len(s.parent)} bytes")
                    par = (ctypes.c_uint8 * N.KEY_BYTES).from_buffer_copy(bytes(s.parent))
                    arrays.append((par,))
                    seqs[i].parent_key = ctypes.addressof(par)
                if s.tokens is not None:
                    tok = np.ascontiguousarray(s.tokens, np.uint32)
                    if len(tok) != seqs[i].num_pages * self.ns.page_size:
                        raise ValueError(f"sequence {i}: {len(tok)} tokens for "
                                         f"{seqs[i].num_pages} pages of {self.ns.page_size}")
                    arrays.append((tok,))
                    seqs[i].tokens = N.address(tok)
            opts = N.BackupOptions(0, 0, 0, WRITE_POLICIES[write_policy], ready_timeout_ms)
            if ready and self.num_ready_slots > 0:
                self._signal_ready(opts)
            c_op, state = N.Op(), ctypes.c_int(0)
            rc = N.lib.kvc_backup(self._handle, seqs, n, ctypes.byref(opts), ctypes.byref(c_op),
                                  ctypes.byref(state))
            return Op(self, c_op, state.value, rc == N.OK, N.status_reason(rc),
                      [seqs[i].leading_ok_pages for i in range(n)],
                      [a[2] for a in arrays if len(a) == 3] if page_status else None, None, n)
        except Exception as e:
            return Op(self, N.Op(), 3, False, f"error: {e}", [0] * len(seqs_in))

    def _signal_ready(self, opts: N.BackupOptions) -> None:
        with self._lock:
            slot = self._next_ready
            self._next_ready = (slot + 1) % self.num_ready_slots
        opts.has_ready = 1
        opts.ready_slot = slot
        if self._cuda_events is not None:
            # Recorded on the stream that wrote the blocks; the daemon's copy stream waits on it.
            self._cuda_events.ready[slot].record()
        elif self._sim_signals is not None:
            token = self._sim_signals.next_token(slot)
            opts.ready_token = token
            self._sim_signals.publish_ready(slot, token)

    # ---- waits -----------------------------------------------------------------------------

    def wait(self, ops: Sequence[Op], timeout_ms: int = 5000, any: bool = False) -> list[OpStatus]:
        """The state of each op after waiting up to ``timeout_ms`` for all (or ``any``) to end."""
        try:
            n = len(ops)
            arr = (N.OpStatus * max(n, 1))()
            caps = []  # per op, its leading_ok_pages out-array (alive over the call)
            for i, op in enumerate(ops):
                cap = (ctypes.c_uint32 * max(op.num_sequences, 1))()
                caps.append(cap)
                c = arr[i]
                c.op = op.c_op
                c.leading_ok_pages = ctypes.addressof(cap)
                c.leading_ok_cap = op.num_sequences
            rc = N.lib.kvc_wait(self._handle, arr, n, timeout_ms, 1 if any else 0)
            reason = N.status_reason(rc)
            out = []
            for i, op in enumerate(ops):
                # op_id 0 with a generation: never accepted, or a submission whose outcome was
                # lost (the daemon may still run it); the native state says which (pending until
                # the lost generation is settled). Without a generation it never left Python.
                if not op.c_op.op_id and not op.c_op.generation:
                    out.append(OpStatus("failed", [0] * op.num_sequences, False,
                                        op.reason or "not submitted"))
                    continue
                out.append(OpStatus(OP_STATES.get(arr[i].state, "unknown"),
                                    caps[i][:op.num_sequences], rc == N.OK, reason))
            return out
        except Exception as e:
            return [OpStatus("failed", [0] * op.num_sequences, False, f"error: {e}") for op in ops]

    def _wait_layer(self, op: Op, layer: int, timeout_ms: int) -> bool:
        if not op.c_op.op_id:
            return False
        if op.slot is None:  # no per-layer signals: the whole op
            return op.wait(timeout_ms).done
        if self._cuda_events is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._cuda_events.load[op.slot][layer])
            return True
        return N.lib.kvc_wait_layer(self._handle, op.c_op, op.slot, layer, timeout_ms) == N.OK

    def _take_slot(self) -> Optional[int]:
        with self._lock:
            return self._free_load_slots.pop(0) if self._free_load_slots else None

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._free_load_slots.append(slot)

    def _free_slot(self, op: Op) -> None:
        if op.slot is not None:
            slot, op.slot = op.slot, None
            self._release_slot(slot)

    # ---- Release / close -------------------------------------------------------------------

    def release(self, pins: Iterable[int] = (), cancel: Sequence[Op] = ()) -> bool:
        """Drops pins (from match) and cancels ops (a prefetch). False with nothing raised when
        the daemon could not be told (the leases then lapse by themselves)."""
        try:
            p = np.ascontiguousarray(np.fromiter(pins, dtype=np.uint64))
            ops = (N.Op * max(len(cancel), 1))(*[o.c_op for o in cancel])
            rc = N.lib.kvc_release(self._handle,
                                   ctypes.cast(p.ctypes.data, ctypes.POINTER(ctypes.c_uint64)),
                                   len(p), ops, len(cancel))
            return rc == N.OK
        except Exception:
            return False

    def close(self, drain_timeout_ms: int = 1000) -> None:
        """Unregisters (waiting up to drain_timeout_ms for unfinished ops). Idempotent."""
        if self._handle:
            N.lib.kvc_session_close(self._handle, drain_timeout_ms)
            self._handle = ctypes.c_void_p()
            if self in self.client._sessions:
                self.client._sessions.remove(self)
        if self._sim_signals is not None:
            self._sim_signals.close()
            self._sim_signals = None
