"""kvcellar.integrations.vllm against vLLM 0.33.0's own classes and a real kvcellard (sim device).

Runs in the repository's .venv-vllm (deploy/install-deps.sh, requirements-vllm.txt: vllm==0.33.0);
skipped under an interpreter without vLLM 0.33 unless KVCELLAR_REQUIRE_ENGINES=1. Real vLLM objects: KVTransferConfig, VllmConfig(DeviceConfig("cpu")),
ParallelConfig, CacheConfig, KVCacheConfig / KVCacheTensor / KVCacheGroupSpec / FullAttentionSpec,
KVConnectorFactory (loads the connector by module path), Request, KVCacheBlock(s),
NewRequestData, CachedRequestData, SchedulerOutput, and create_kv_cache_views (the function
vLLM's allocate_kv_cache uses) over a buffer in a SimDevice's shared memory, so the per-layer
tensors are exactly vLLM 0.33's views ([B, H, N, 2D], LBNHC strides, one int8 allocation).
Not real: ModelConfig needs a Hugging Face model to build, so ``vllm_config.model_config`` is a
stand-in with the two fields the connector reads (``model``, ``revision``); the engine loop is
this file's (``Engine``), calling the connectors in vLLM 0.33's order:

  scheduler (vllm/v1/core/sched/scheduler.py): get_num_new_matched_tokens(request,
    local_hit) L1139 -> allocate_slots -> update_state_after_alloc(request, blocks, n) L1482 ->
    SchedulerOutput L1725 -> build_connector_meta L1756; finish: request_finished L3395, the id
    in the next SchedulerOutput.finished_req_ids; blocks freed on finished_sending L3579.
  worker, V2 runner (vllm/v1/worker/gpu/kv_connector.py): handle_preemptions +
    bind_connector_metadata L75 -> start_load_kv (before the forward when has_sync_kv_loads)
    -> per attention layer wait_for_layer_load / save_kv_layer (kv_transfer_utils.py L15-59)
    -> post_forward L136: wait_for_save -> get_transfer_results(finished_req_ids) ->
    get_block_ids_with_load_errors -> clear_connector_metadata.
"""
import os
import re
import signal
import time
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest

# ctest sets KVCELLAR_REQUIRE_ENGINES=1 and runs this file in .venv-vllm, where vLLM must be:
# there a missing vLLM is a failure, not a skip.
if os.environ.get("KVCELLAR_REQUIRE_ENGINES") == "1":
    import torch
    import vllm
    assert vllm.__version__.startswith("0.33."), f"written for vLLM 0.33, found {vllm.__version__}"
else:
    torch = pytest.importorskip("torch")
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.33."):
        pytest.skip(f"written for vLLM 0.33, found {vllm.__version__}", allow_module_level=True)

from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig,  # noqa: E402
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (CachedRequestData, KVConnectorBlockState,  # noqa: E402
                                       NewRequestData, SchedulerOutput)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, MambaSpec,
                                        SlidingWindowSpec, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvcellar import SimDevice  # noqa: E402
from kvcellar.integrations.vllm import KvcellarConnector, check_vllm_version  # noqa: E402

P = 16  # block_size
LAYERS = 2
KV_HEADS = 2  # of the model; each TP rank holds KV_HEADS / tp
D = 8
BLOCKS = 24
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def vllm_config(sock, tp=1, rank=0, **extra):
    ktc = KVTransferConfig(kv_connector="KvcellarConnector",
                           kv_connector_module_path="kvcellar.integrations.vllm",
                           kv_role="kv_both", kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"socket": sock, "instance_id": "vllm-test",
                                                      **extra})
    vc = VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"),
                    parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
                    cache_config=CacheConfig(block_size=P))
    vc.model_config = SimpleNamespace(model="test-org/tiny-llama", revision="r1")  # see top
    return vc


def kv_cache_config(heads):
    spec = FullAttentionSpec(block_size=P, num_kv_heads=heads, head_size=D, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=list(NAMES),
                           layer_stride=page * BLOCKS, block_stride=page)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
                         kv_cache_layout="LBNHC")


def allocate(dev, kvcc):
    """vLLM 0.33's allocate_kv_cache (v1/worker/utils.py L564) with its one int8 buffer in
    shared memory: the same create_kv_cache_views call."""
    t = kvcc.kv_cache_tensors[0]
    raw = dev.empty((t.size,), torch.int8)
    spec = kvcc.kv_cache_groups[0].kv_cache_spec
    views = create_kv_cache_views(raw, spec, BLOCKS, KVCacheLayout.LBNHC, t)
    caches = dict(zip(t.layers, views))
    v = caches[NAMES[0]]
    heads = spec.num_kv_heads
    assert v.shape == (BLOCKS, heads, P, 2 * D)
    assert v.stride() == (heads * P * 2 * D, 2 * D, heads * 2 * D, 1)  # LBNHC, as the report
    assert v.is_contiguous() == (heads == 1)
    return caches


def kv_value(tokens, t, layer, rank, heads):
    """What 'attention' writes for token t: a function of the prefix, layer and rank only."""
    h = (int(np.sum(np.asarray(tokens[: t + 1], np.int64) * np.arange(1, t + 2))) % 997) / 8
    base = torch.arange(heads * 2 * D, dtype=torch.float32).view(heads, 2 * D) / 4
    return (base + h + layer * 100 + rank * 1000).to(torch.bfloat16)


class Engine:
    """A vLLM 0.33 engine reduced to what touches the connector: one scheduler-side connector
    and one worker-side connector per TP rank, made by KVConnectorFactory."""

    def __init__(self, sock, tp=1, **extra):
        self.tp = tp
        self.kvcc = kv_cache_config(KV_HEADS // tp)
        self.sched = KVConnectorFactory.create_connector(vllm_config(sock, tp, 0, **extra),
                                                         KVConnectorRole.SCHEDULER, self.kvcc)
        assert isinstance(self.sched, KvcellarConnector)
        self.devs, self.caches, self.workers = [], [], []
        for r in range(tp):
            w = KVConnectorFactory.create_connector(vllm_config(sock, tp, r, **extra),
                                                    KVConnectorRole.WORKER, self.kvcc)
            dev = SimDevice()
            caches = allocate(dev, self.kvcc)
            w.sim_device = dev
            w.register_kv_caches(caches)
            self.devs.append(dev)
            self.caches.append(caches)
            self.workers.append(w)
        self.free = list(range(BLOCKS))
        self.running = {}  # req_id -> (request, block_ids)
        self.delayed = {}  # req_id -> block ids kept until finished_sending from every rank
        self.finished_ids = set()
        self.last_errors = set()

    def wait_active(self):
        assert self.sched._scheduler.session.wait_active(10000)
        assert all(w._worker.session.wait_active(10000) for w in self.workers)

    def add(self, req_id, tokens):
        """Scheduling a WAITING request (scheduler.py L1109 ff.); no local prefix-cache hit."""
        req = Request(req_id, list(tokens), SamplingParams(max_tokens=4), None)
        ext, load_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert load_async is False and ext % P == 0 and ext < req.num_tokens
        n = -(-req.num_tokens // P)
        ids, self.free = self.free[:n], self.free[n:]
        self.sched.update_state_after_alloc(
            req, KVCacheBlocks(([KVCacheBlock(i) for i in ids],)), ext)
        req.num_computed_tokens = ext
        self.running[req_id] = (req, ids)
        return ext, ids

    def step(self, new=(), preempted=()):
        """One schedule() + execute_model() + update_from_output(): each new request prefills
        its whole uncomputed prompt in this step."""
        so = SchedulerOutput.make_empty()
        so.finished_req_ids, self.finished_ids = self.finished_ids, set()
        so.preempted_req_ids = set(preempted)
        for rid in new:
            req, ids = self.running[rid]
            so.scheduled_new_reqs.append(NewRequestData.from_request(req, (ids,)))
            so.num_scheduled_tokens[rid] = req.num_tokens - req.num_computed_tokens
            so.has_sync_kv_loads |= req.num_computed_tokens > 0
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.kv_connector_metadata = self.sched.build_connector_meta(so)
        sending, errors = [], set()
        for r, w in enumerate(self.workers):
            meta = so.kv_connector_metadata
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
            if so.total_num_scheduled_tokens:
                self.forward(r, w, so)
            else:
                w.start_load_kv(None)  # no_forward still calls it (post_forward)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            sending.append(res.finished_sending)
            errors |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        if errors:  # Scheduler.update_from_output -> _update_from_kv_xfer_finished
            self.sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
        for rid, n in so.num_scheduled_tokens.items():
            self.running[rid][0].num_computed_tokens += n
        done = set.intersection(*[set(s) for s in sending])  # KVOutputAggregator: every rank
        for rid in done:
            self.free.extend(self.delayed.pop(rid))
        self.last_errors = errors
        return so.kv_connector_metadata

    def forward(self, r, w, so):
        heads = KV_HEADS // self.tp
        for layer, name in enumerate(NAMES):
            w.wait_for_layer_load(name)
            view = self.caches[r][name]
            for rid, n in so.num_scheduled_tokens.items():
                req, ids = self.running[rid]
                toks = req.all_token_ids
                for t in range(req.num_computed_tokens, req.num_computed_tokens + n):
                    view[ids[t // P], :, t % P, :] = kv_value(toks, t, layer, r, heads)
            w.save_kv_layer(name, view, None)

    def finish(self, rid):
        req, ids = self.running.pop(rid)
        delay, params = self.sched.request_finished(req, ids)
        assert params is None
        self.finished_ids.add(rid)
        if delay:
            self.delayed[rid] = ids
        else:
            self.free.extend(ids)
        return delay

    def serve(self, rid, tokens):
        """A whole request in one step: computed, backed up, finished, its Backups settled."""
        self.add(rid, tokens)
        self.step(new=[rid])
        self.finish(rid)
        self.drain()

    def drain(self, timeout=30.0):  # A hang guard; loaded CI machines need the room.
        deadline = time.monotonic() + timeout
        while self.delayed or self.finished_ids:
            assert time.monotonic() < deadline, f"still delayed: {self.delayed}"
            self.step()
            time.sleep(0.01)

    def blocks(self, r, ids):
        return {n: self.caches[r][n][ids].clone() for n in NAMES}

    def hits(self, tokens):
        return self.sched._scheduler.session.match([np.asarray(tokens, np.uint32)]) \
            .results[0].l2_hit_pages

    def close(self):
        for c in [self.sched, *self.workers]:
            c.shutdown()
        for d in self.devs:
            d.close()


def prompt(seed, n):
    return list(np.random.default_rng(seed).integers(0, 30000, n))


def test_save_then_prefix_hit_loads_identical_bytes(daemon):
    eng = Engine(daemon.socket)
    eng.wait_active()
    a = prompt(1, 3 * P + 5)
    ext, a_ids = eng.add("a", a)
    assert ext == 0
    meta = eng.step(new=["a"])
    assert [len(s.block_ids) for s in meta.saves] == [3] and not meta.loads
    assert meta.saves[0].block_ids == a_ids[:3] and meta.saves[0].parent is None
    a_kv = eng.blocks(0, a_ids[:3])
    assert eng.finish("a") is True  # its Backup may still be in flight: delay the free
    eng.drain()
    assert eng.hits(a) == 3

    b = a[: 3 * P] + prompt(2, 20)  # shares 3 pages, 4 full pages in all
    ext, b_ids = eng.add("b", b)
    assert ext == 3 * P
    for n in NAMES:  # stale bytes where the load goes
        eng.caches[0][n][b_ids[:3]] = -7
    meta = eng.step(new=["b"])
    assert [(l.block_ids, l.pin_id != 0) for l in meta.loads] == [(b_ids[:3], True)]
    assert [(s.block_ids, s.parent is not None) for s in meta.saves] == [(b_ids[3:4], True)]
    assert eng.last_errors == set()
    got = eng.blocks(0, b_ids[:3])
    for n in NAMES:
        assert torch.equal(got[n].view(torch.int16), a_kv[n].view(torch.int16))  # bit-exact
    eng.finish("b")
    eng.drain()
    assert eng.hits(b) == 4

    # A full-prompt hit leaves one token to compute: the last page is recomputed.
    ext, _ = eng.add("c", a[: 3 * P])
    assert ext == 2 * P
    eng.step(new=["c"])
    assert eng.last_errors == set()
    eng.finish("c")
    eng.drain()
    eng.close()


def test_saves_carry_the_pages_tokens_to_a_daemon_publishing_events(daemon_factory):
    """With events.endpoint set the daemon asks for page tokens: the scheduler puts each saved
    page's tokens in its SaveSpec, the worker's Backup sends them, and the daemon's BlockStored
    carries them under vLLM's integer block hashes (docs/events.md)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    d = daemon_factory(args=["--set", "events.endpoint=tcp://127.0.0.1:*"])
    endpoint = re.search(r" endpoint=(\S+)", d.wait_for_line(r'msg="events publishing"')).group(1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    assert mon.poll(5000), "no ZMQ handshake"
    sub.disable_monitor()
    mon.close(0)
    time.sleep(0.1)
    eng = Engine(d.socket)
    try:
        eng.wait_active()
        a = prompt(3, 3 * P + 5)
        eng.add("a", a)
        meta = eng.step(new=["a"])
        assert np.frombuffer(meta.saves[0].tokens, np.uint32).tolist() == a[:3 * P]
        eng.finish("a")
        eng.drain()
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        stored = []
        deadline = time.monotonic() + 5
        while sum(len(e.block_hashes) for e in stored) < 3:
            assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), stored
            stored += [e for e in decoder.decode(sub.recv_multipart()[2]).events
                       if isinstance(e, BlockStored)]
        assert [t for e in stored for t in e.token_ids] == a[:3 * P]
        keys = np.frombuffer(meta.saves[0].keys, np.uint8).reshape(-1, 32)
        assert [h for e in stored for h in e.block_hashes] == [
            int.from_bytes(bytes(k[-8:]), "big") for k in keys]
    finally:
        eng.close()
        sub.close(0)
        ctx.term()

    # Without events the daemon wants no tokens: none are shipped to the workers.
    plain = daemon_factory(name="plain")
    eng = Engine(plain.socket)
    try:
        eng.wait_active()
        eng.add("b", prompt(4, 2 * P))
        assert eng.step(new=["b"]).saves[0].tokens is None
        eng.finish("b")
        eng.drain()
    finally:
        eng.close()


def test_sleep_mode_unregisters_then_restores_the_kv_caches(daemon):
    """vLLM 0.33's sleep mode: unregister_kv_caches before the KV memory is freed ends the
    worker's session (its Backups settled first), twice is harmless; restore_kv_caches after
    wake-up registers the same tensors again and hits load as before."""
    eng = Engine(daemon.socket)
    eng.wait_active()
    a = prompt(1, 3 * P + 5)
    eng.serve("a", a)
    w = eng.workers[0]
    assert type(w).supports_sleep_mode(w._kv_transfer_config)
    ended = daemon.log().count("reason=unregistered")
    w.unregister_kv_caches()
    w.unregister_kv_caches()
    assert w._worker.session is None
    deadline = time.monotonic() + 10
    while daemon.log().count("reason=unregistered") == ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.log().count("reason=unregistered") == ended + 1
    w.restore_kv_caches()
    assert w._worker.session.wait_active(5000)
    b = a[: 3 * P] + prompt(2, 20)
    ext, b_ids = eng.add("b", b)
    assert ext == 3 * P
    eng.step(new=["b"])
    assert eng.last_errors == set()
    eng.finish("b")
    eng.drain()
    eng.close()


def test_other_vllm_releases_are_refused_at_start():
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.1")
    for v in ("0.31.2", "0.34.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=f"0.32.x and 0.33.x .* this is vLLM {v}"):
            check_vllm_version(v)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_windowed_kv_is_refused_at_start(role):
    # A model whose every layer has a sliding window (Mistral-style `sliding_window`, no
    # `layer_types`) gets one SlidingWindowSpec group even with vLLM's hybrid manager off. Its
    # block tables hold the null block (id 0) where the window has passed and no group holds
    # every page: the connector must refuse at start rather than save or load block 0 under the
    # prompt's keys.
    spec = SlidingWindowSpec(block_size=P, num_kv_heads=KV_HEADS, head_size=D,
                             dtype=torch.bfloat16, sliding_window=4 * P)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=list(NAMES),
                           layer_stride=page * BLOCKS, block_stride=page)
    kvcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
                         kv_cache_layout="LBNHC")
    with pytest.raises(ValueError, match="a SlidingWindowSpec group and no full-attention one; "
                                         "KvcellarConnector serves full attention"):
        KVConnectorFactory.create_connector(vllm_config("/nonexistent/kvcellar.sock"), role, kvcc)


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_recurrent_state_without_prefix_caching_is_refused_at_start(role):
    # Without prefix caching vLLM keeps one in-place state per request (mamba_cache_mode "none"):
    # no state at a page boundary exists to store or to load into.
    full = FullAttentionSpec(block_size=P, num_kv_heads=KV_HEADS, head_size=D,
                             dtype=torch.bfloat16)
    state = MambaSpec(block_size=P, shapes=((2, 64),), dtypes=(torch.bfloat16,),
                      page_size_padded=full.page_size_bytes, mamba_cache_mode="none")
    tensors = [KVCacheTensor(size=full.page_size_bytes * BLOCKS, layers=[n],
                             layer_stride=full.page_size_bytes * BLOCKS,
                             block_stride=full.page_size_bytes) for n in NAMES]
    kvcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec([NAMES[0]], full),
                                          KVCacheGroupSpec([NAMES[1]], state)],
                         kv_cache_layout="LBNHC")
    with pytest.raises(ValueError, match=r"kv_cache_groups\[1\]: a MambaSpec group in "
                                         "mamba_cache_mode 'none'.*--enable-prefix-caching"):
        KVConnectorFactory.create_connector(vllm_config("/nonexistent/kvcellar.sock"), role, kvcc)


def test_tp2_hits_are_group_consistent(daemon):
    eng = Engine(daemon.socket, tp=2)
    eng.wait_active()
    a = prompt(3, 2 * P + 3)
    eng.add("a", a)
    # Only rank 0 runs its Backup: rank 1's shards are missing, so the group has no hit.
    so = SchedulerOutput.make_empty()
    req, ids = eng.running["a"]
    so.scheduled_new_reqs.append(NewRequestData.from_request(req, (ids,)))
    so.num_scheduled_tokens["a"] = req.num_tokens
    meta = eng.sched.build_connector_meta(so)
    w0 = eng.workers[0]
    w0.bind_connector_metadata(meta)
    eng.forward(0, w0, so)
    w0.wait_for_save()
    w0.clear_connector_metadata()
    deadline = time.monotonic() + 5
    while w0._worker.backups and time.monotonic() < deadline:
        w0._worker._poll_backups(50)
    assert eng.hits(a) == 0
    ext, _ = eng.add("a2", a)
    assert ext == 0
    # Both ranks compute and save: every shard is there, and every rank loads its own.
    eng.running.pop("a2")
    b = prompt(4, 2 * P + 3)
    eng.add("b", b)
    eng.step(new=["b"])
    b_kv = [eng.blocks(r, eng.running["b"][1][:2]) for r in range(2)]
    eng.finish("b")
    eng.drain()
    assert eng.hits(b) == 2
    ext, ids = eng.add("b2", b[: 2 * P] + [7, 8, 9])
    assert ext == 2 * P
    eng.step(new=["b2"])
    assert eng.last_errors == set()
    for r in range(2):
        got = eng.blocks(r, ids[:2])
        for n in NAMES:
            assert torch.equal(got[n].view(torch.int16), b_kv[r][n].view(torch.int16))
    assert not torch.equal(b_kv[0][NAMES[0]], b_kv[1][NAMES[0]])  # ranks hold their own shard
    eng.close()


def test_daemon_killed_and_restarted_misses_then_hits(daemon_factory):
    d = daemon_factory()
    eng = Engine(d.socket, rpc_timeout_ms=200, register_timeout_ms=300, load_timeout_ms=1000)
    eng.wait_active()
    a = prompt(5, 2 * P + 1)
    eng.serve("a", a)
    assert eng.hits(a) == 2
    d.stop(signal.SIGKILL)
    # Down: a miss, and a whole request's steps run without an exception.
    ext, _ = eng.add("b", a + [1, 2, 3])
    assert ext == 0
    eng.step(new=["b"])
    assert eng.last_errors == set()
    eng.finish("b")
    eng.drain(timeout=15)  # unanswerable Backups count as over after load_timeout_ms
    daemon_factory()  # same socket, an empty pool
    eng.wait_active()  # the connectors' sessions registered again by themselves
    ext, _ = eng.add("c", a)
    assert ext == 0
    eng.step(new=["c"])
    eng.finish("c")
    eng.drain()
    ext, ids = eng.add("d", a)
    assert ext == 2 * P
    eng.step(new=["d"])
    assert eng.last_errors == set()
    eng.close()


def test_load_failure_reports_blocks(daemon):
    eng = Engine(daemon.socket, load_timeout_ms=1000)
    eng.wait_active()
    a = prompt(6, 2 * P + 1)
    eng.serve("a", a)
    # The worker has no session (as after a daemon restart, before it has registered again) when
    # the scheduler Matches: it cannot Load, and its blocks are reported.
    eng.workers[0]._worker.session.close()
    eng.workers[0]._worker.session = None
    ext, ids = eng.add("b", a)
    assert ext == 2 * P
    eng.step(new=["b"])
    assert eng.last_errors == set(ids[:2])
    # The Match's pin, which no rank's Load dropped, is released by the scheduler at once, not
    # left on the daemon until pin_lease_ms.
    text = urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=10).read().decode()
    assert re.search(r"^kvcellar_pins 0$", text, re.M), [
        line for line in text.splitlines() if line.startswith("kvcellar_pins")]
    eng.close()


@pytest.mark.parametrize("extra,name", [({"bogus_key": 1}, "bogus_key"),
                                        ({"rpc_timeout_ms": "fast"}, "rpc_timeout_ms"),
                                        ({"write_policy": "sometimes"}, "write_policy")])
def test_bad_extra_config_fails_at_construction(tmp_path, extra, name):
    vc = vllm_config(str(tmp_path / "none.sock"), **extra)
    with pytest.raises(ValueError, match=name):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kv_cache_config(2))


# ---- hybrid models (several KV cache groups) ----------------------------------------------------


def test_hybrid_groups_load_whole_hits_asynchronously_and_a_failed_load_is_recomputed(
        daemon_factory, tmp_path):
    """vLLM's hybrid manager with a full-attention group and a sliding-window group of one layer
    each, aliasing one buffer from byte 0 (allocate_kv_cache). Saves name every group's block
    from the live tables; a hit is one asynchronous Load of the full group's pages and the
    window's last pages; a Load that cannot run is reported in failed_recving (vLLM raises on
    block-level errors with several groups) and that request is not offered a hit again."""
    sock = str(tmp_path / "hyb.sock")
    args = ("--set", f"listen.unix_socket={sock}", "--set",
            f"pool.shm_name=kvc-vllm-hyb-{os.getpid()}")
    d = daemon_factory(args=args)
    window = 2 * P  # real blocks: the last cdiv(2P - 1, P) = 2 pages before the position
    specs = [FullAttentionSpec(block_size=P, num_kv_heads=KV_HEADS, head_size=D,
                               dtype=torch.bfloat16),
             SlidingWindowSpec(block_size=P, num_kv_heads=KV_HEADS, head_size=D,
                               dtype=torch.bfloat16, sliding_window=window)]
    page = specs[0].page_size_bytes
    tensors = [KVCacheTensor(size=page * BLOCKS, layers=[n], layer_stride=page * BLOCKS,
                             block_stride=page) for n in NAMES]
    kvcc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in zip(NAMES, specs)],
                         kv_cache_layout="LBNHC")
    sched = KVConnectorFactory.create_connector(vllm_config(sock), KVConnectorRole.SCHEDULER, kvcc)
    worker = KVConnectorFactory.create_connector(vllm_config(sock), KVConnectorRole.WORKER, kvcc)
    assert sched.ns.hybrid and [g.kind for g in sched.ns.groups] == ["full", "window"]
    dev = SimDevice()
    raw = dev.empty((page * BLOCKS,), torch.int8)
    caches = {n: create_kv_cache_views(raw, s, BLOCKS, KVCacheLayout.LBNHC, t)[0]
              for n, s, t in zip(NAMES, specs, tensors)}
    assert caches[NAMES[0]].data_ptr() == caches[NAMES[1]].data_ptr()  # the groups alias
    worker.sim_device = dev
    worker.register_kv_caches(caches)
    assert sched._scheduler.session.wait_active(10000)
    assert worker._worker.session.wait_active(10000)
    tables = {}

    def step(so):
        so.kv_connector_block_state = KVConnectorBlockState(set(tables), lambda r: tables[r], {})
        meta = sched.build_connector_meta(so)
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for rid, n in so.num_scheduled_tokens.items():  # "attention" writes its group's blocks
            for g, name in enumerate(NAMES):
                for p in range(len(tables[rid][g])):
                    if tables[rid][g][p]:
                        caches[name][tables[rid][g][p]] = hash((rid, g, p)) % 1000
        worker.wait_for_save()  # the hybrid Backup is over when it returns
        res = worker.get_transfer_results(set())
        assert worker.get_block_ids_with_load_errors() == set()
        worker.clear_connector_metadata()
        return meta, res

    # A computes 5 full pages: every group's block of each page is stored.
    a = prompt(1, 5 * P + 3)
    req = Request("a", list(a), SamplingParams(max_tokens=4), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    tables["a"] = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    sched.update_state_after_alloc(req, KVCacheBlocks(tuple(
        [KVCacheBlock(i) for i in t] for t in tables["a"])), 0)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs.append(NewRequestData.from_request(req, tables["a"]))
    so.num_scheduled_tokens["a"] = req.num_tokens
    so.total_num_scheduled_tokens = req.num_tokens
    meta, _ = step(so)
    NO = 0xFFFFFFFF
    assert [s.block_ids for s in meta.saves] == [[1, 7, 2, 8, 3, 9, 4, 10, 5, 11]]
    a_full, a_win = caches[NAMES[0]][[1, 2, 3, 4]].clone(), caches[NAMES[1]][[9, 10]].clone()
    assert sched.request_finished_all_groups(req, tables.pop("a")) == (False, None)

    # B shares 4 pages: a hit of 4 pages, loaded asynchronously into the blocks vLLM allocated
    # for it: the full group's 4, and the window group's last 2 (null below the window).
    b = a[:4 * P] + prompt(2, 9)
    req = Request("b", list(b), SamplingParams(max_tokens=4), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * P, True)
    tables["b"] = ([13, 14, 15, 16, 17], [0, 0, 18, 19, 20])
    caches[NAMES[0]][[13, 14, 15, 16]] = -7
    caches[NAMES[1]][[18, 19]] = -7
    sched.update_state_after_alloc(req, KVCacheBlocks(tuple(
        [KVCacheBlock(i) for i in t] for t in tables["b"])), 4 * P)
    meta, res = step(SchedulerOutput.make_empty())  # b waits: nothing scheduled
    assert [(l.block_ids, l.pin_id != 0) for l in meta.loads] == \
        [([13, NO, 14, NO, 15, 18, 16, 19], True)]
    deadline = time.monotonic() + 30
    while "b" not in res.finished_recving:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        _, res = step(SchedulerOutput.make_empty())
    assert res.failed_recving == set()
    assert torch.equal(caches[NAMES[0]][[13, 14, 15, 16]].view(torch.int16),
                       a_full.view(torch.int16))
    assert torch.equal(caches[NAMES[1]][[18, 19]].view(torch.int16), a_win.view(torch.int16))
    assert sched.request_finished_all_groups(req, tables.pop("b")) == (False, None)

    # C hits too, but the daemon is gone before its Load (stopped: its pool is kept for the warm
    # restart below): reported failed (and finished), and C is recomputed from scratch without
    # another hit.
    req = Request("c", list(a[:4 * P] + prompt(3, 9)), SamplingParams(max_tokens=4), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * P, True)
    tables["c"] = ([21, 22, 23, 24, 13], [0, 0, 14, 15, 16])
    sched.update_state_after_alloc(req, KVCacheBlocks(tuple(
        [KVCacheBlock(i) for i in t] for t in tables["c"])), 4 * P)
    d.stop(signal.SIGTERM)
    _, res = step(SchedulerOutput.make_empty())
    deadline = time.monotonic() + 30
    while "c" not in res.finished_recving:
        assert time.monotonic() < deadline
        _, res = step(SchedulerOutput.make_empty())
    assert res.failed_recving == {"c"}
    sched.update_connector_output(KVConnectorOutput(finished_recving={"c"},
                                                    failed_recving={"c"}))
    # The daemon is back with its pool (warm restart): C gets no hit again, a new request does.
    daemon_factory(args=args)
    assert sched._scheduler.session.wait_active(10000)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    again = Request("d", list(req.prompt_token_ids), SamplingParams(max_tokens=4), None)
    assert sched.get_num_new_matched_tokens(again, 0) == (4 * P, True)
    sched.request_finished_all_groups(again, ([], []))
    for c in (sched, worker):
        c.shutdown()
    dev.close()
