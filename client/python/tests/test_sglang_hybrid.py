"""kvcellar.integrations.sglang for hybrid models: SGLang 0.5.23's v2 storage interface
(register_mem_host_pool_v2, batch_exists_v2, batch_get_v2, batch_set_v2 with PoolTransfers and
TRAILING_PAGES) driven by SGLang's own HybridCacheController over its own hybrid pools, on CPU,
against real kvcellards.

Real SGLang objects: the device pools of a Mamba hybrid (HybridLinearKVPool over MambaPool) and
of a sliding-window hybrid (SWAKVPool), the host pools in shared memory (MHATokenToKVPoolHost for
the KV and swa pools, MambaPoolHost for the state slots: ``"allocator": "shm"``), HostPoolGroup,
and HybridCacheController, which loads the backend through its factory and calls it from its
own threads (hybrid_cache/hybrid_cache_controller.py, 0.5.23):

  attach: register_mem_pool_host(kv) -> register_mem_host_pool_v2 for kv, then the side pool ->
    on_host_pools_registered.
  backup: write_storage(kv slots, tokens, hashes, prefix_keys, extra_pools) -> backup thread ->
    batch_set_v2(side pool) then batch_set_v1(kv) per 128 pages -> ack.
  prefetch: prefetch(handle, tokens, ..., extra_pools=[placeholder keys]) -> batch_exists_v2 ->
    restorable lengths MIN-reduced -> the scheduler allocates KV and side slots -> I/O thread:
    batch_get_v1(kv), then _sync_trailing_keys and batch_get_v2(side pool) -> acks.

Not real: the scheduler and its radix tree (HybridEngine plays them: it owns the slots and builds
the PoolTransfers the unified radix cache's Mamba and SWA components build:
unified_cache/components/mamba.py L917-941, swa.py L1207-1233).
"""
import json
import re
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

# First: it skips this module without SGLang 0.5.23, which the imports below need.
from sglang_util import (engine_factory, extra_config, init_single_rank,  # noqa: E402
                         rank_config)
import psutil  # noqa: E402
import torch  # noqa: E402

import torch.distributed as dist  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (STORAGE_BATCH_SIZE,  # noqa: E402
                                                  HiCacheStorageExtraInfo)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.configs.mamba_utils import (Mamba2CacheParams, Mamba2StateDType,  # noqa: E402
                                            Mamba2StateShape)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName,  # noqa: E402
                                                  PoolTransfer)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController)
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

PAGE = 16
DEVICE_TOKENS = 512  # host pools of 2x: 64 KV pages
MAMBA_SLOTS = 8  # device Mamba slots: host pools of 2x + 1 = 17 state slots, not 64
MODEL = "test-org/tiny-hybrid"
WINDOW = 49  # the model's sliding window: SGLang keeps the 48 tokens before, 3 pages of 16


@pytest.fixture(scope="module", autouse=True)
def single_rank_process():
    init_single_rank()
    yield


def kv_host(dev):
    return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE,
                                "page_first", pin_memory=False, device="cpu",
                                allocator_type="shm", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer)


def mapper(mapping):
    return lambda layer_id: mapping.get(layer_id)


def mamba_pools(device_tokens=DEVICE_TOKENS):
    """Layers 0 and 2 full attention, 1 and 3 Mamba 2 (fp32 temporal state, bf16 conv)."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1,
                                    num_heads=4, head_dim=8, state_size=16, conv_kernel=4)
    params = Mamba2CacheParams(layers=[1, 3], shape=shape,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    mamba_dev = MambaPool(size=MAMBA_SLOTS, spec_state_size=MAMBA_SLOTS, cache_params=params,
                          mamba_layer_ids=[1, 3], device="cpu")
    kv_dev = HybridLinearKVPool(size=device_tokens, dtype=torch.bfloat16, page_size=PAGE,
                                head_num=2, head_dim=8, full_attention_layer_ids=[0, 2],
                                device="cpu", mamba_pool=mamba_dev)
    alloc = PagedTokenToKVPoolAllocator(device_tokens, PAGE, torch.bfloat16, "cpu", kv_dev, False)
    # Checked against the available memory itself, not less SGLang's 10 GiB server reserve
    # (see test_sglang_backend.host_pool).
    with host_memory_budget_scope(psutil.virtual_memory().available):
        kvh = kv_host(kv_dev.full_kv_pool)
        side = MambaPoolHost(mamba_dev.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                             device_capacity=mamba_dev.size, pin_memory=False, device="cpu",
                             allocator_type="shm", layout="page_first")
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kvh, kv_dev.full_kv_pool, mapper({0: 0, 2: 1}),
                  is_primary_index_anchor=True),
        PoolEntry(PoolName.MAMBA, side, mamba_dev, mapper({1: 0, 3: 1}))])
    return alloc, group, kvh, side


def swa_pools(device_tokens=DEVICE_TOKENS):
    """Layers 0 and 2 full attention, 1 and 3 sliding window; the swa pool has half the slots."""
    kv_dev = SWAKVPool(size=device_tokens, size_swa=device_tokens // 2, page_size=PAGE,
                       dtype=torch.bfloat16, head_num=2, head_dim=8,
                       swa_attention_layer_ids=[1, 3], full_attention_layer_ids=[0, 2],
                       device="cpu")
    alloc = SWATokenToKVPoolAllocator(device_tokens, device_tokens // 2, PAGE, torch.bfloat16,
                                      "cpu", kv_dev, False)
    with host_memory_budget_scope(psutil.virtual_memory().available):
        kvh, side = kv_host(kv_dev.full_kv_pool), kv_host(kv_dev.swa_kv_pool)
    group = HostPoolGroup([
        PoolEntry(PoolName.KV, kvh, kv_dev.full_kv_pool, mapper({0: 0, 2: 1}),
                  is_primary_index_anchor=True),
        PoolEntry(PoolName.SWA, side, kv_dev.swa_kv_pool, mapper({1: 0, 3: 1}))])
    return alloc, group, kvh, side


class HybridEngine:
    """One SGLang rank's hybrid HiCache with kvcellar as its L3: SGLang's HybridCacheController
    over real hybrid pools. Plays the scheduler and its tree: owns the slots, builds the side
    pool's PoolTransfers as the unified radix cache's components do."""

    def __init__(self, kind, socket, model=MODEL, device_tokens=DEVICE_TOKENS, **extra):
        self.kind = kind
        pools = mamba_pools if kind == "mamba" else swa_pools
        alloc, group, self.kv, self.side = pools(device_tokens)
        self.name = PoolName.MAMBA if kind == "mamba" else PoolName.SWA
        self.ctl = HybridCacheController(alloc, group, PAGE, dist.group.WORLD, threading.Event(),
                                         write_policy="write_through", io_backend="direct",
                                         storage_backend="dynamic", model_name=model,
                                         storage_backend_extra_config=extra_config(socket,
                                                                                   **extra),
                                         transfer_layer_id_max=4)
        self.backend = self.ctl.storage_backend
        self.rid = 0

    def close(self):
        self.ctl.detach_storage_backend()

    def active(self):
        s = self.backend._session()
        return s is not None and s.wait_active(20000)

    def _fill(self, pool, slot, g):
        flat = pool.get_dummy_flat_data_page()
        flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8)
                   .view(flat.dtype) if flat.dtype == torch.uint8 else
                   torch.randn(flat.shape, generator=g).to(flat.dtype))
        pool.set_from_flat_data_page(int(slot), flat)

    def write(self, tokens, seed):
        """A radix node's KV pages and its side pool's part, random bytes as a device->host copy
        would leave them: (KV slots, side slots). Mamba: one state slot (the state after the
        node's last page); swa: a slot page per KV page (every swa page the node holds)."""
        g = torch.Generator().manual_seed(seed)
        kv = self.kv.alloc(len(tokens))
        for p in range(0, len(tokens), PAGE):
            self._fill(self.kv, kv[p], g)
        side = self.side.alloc(1 if self.kind == "mamba" else len(tokens))
        for p in range(0, len(side), self.side.page_size):
            self._fill(self.side, side[p], g)
        return kv, side

    def kv_pages(self, slots):
        return [self.kv.get_data_page(int(slots[p]), flat=True).clone()
                for p in range(0, len(slots), PAGE)]

    def side_pages(self, slots):
        step = self.side.page_size
        return [self.side.get_data_page(int(slots[p]), flat=True).clone()
                for p in range(0, len(slots), step)]

    def backup(self, tokens, kv, side=None, prefix_keys=()):
        """write_storage of a node, with its side pool transfer (None: the node has none, as a
        Mamba node whose state was not checkpointed); returns (tokens saved, the hashes)."""
        prior = prefix_keys[-1] if prefix_keys else None
        hashes = get_hash_str(tokens, prior_hash=prior, page_size=PAGE)
        extra = None
        if side is not None:
            pages = len(side) // self.side.page_size
            extra = [PoolTransfer(name=self.name, host_indices=side, keys=hashes[-pages:],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        op_id = self.ctl.write_storage(kv, tokens, hashes, list(prefix_keys),
                                       extra_pools=extra)
        op = self.ctl.ack_backup_queue.get(timeout=30)
        assert op.id == op_id
        return op.completed_tokens, hashes

    def prefetch(self, tokens, trailing):
        """A storage prefetch of ``tokens`` from the root, as the unified radix cache runs it:
        the side pool asked for its ``trailing`` pages; returns (KV tokens completed, side pages
        the controller counts as loaded, the KV slots, the side slots)."""
        self.rid += 1
        ptr = PoolTransfer(name=self.name, keys=["__placeholder__"] * trailing,
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)
        op = self.ctl.prefetch(CacheRequestHandle(rid=f"r{self.rid}", attempt_id=0),
                               list(tokens), None, [], extra_pools=[ptr])
        assert self.ctl.prefetch_hit_queue.get(timeout=30) is op
        if op.storage_hit_count == 0:
            return 0, 0, None, None
        op.host_indices = self.ctl.alloc_prefetch_host_buffers(op, op.storage_hit_count)
        hit_pages = op.storage_hit_count // PAGE
        ptr.host_indices = self.side.alloc(min(trailing, hit_pages) * self.side.page_size)
        self.ctl.prefetch_buffer.put(op)
        completed, side_hits = 0, {}
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=30)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if ack.pool_hits is not None:
                side_hits.update(ack.pool_hits)
            if ack.completed_req:
                break
        return completed, side_hits.get(str(self.name), 0), op.host_indices, ptr.host_indices


@pytest.fixture
def engines():
    def build(kind, socket, **kw):
        if kind == "swa":
            kw.setdefault("sliding_window", WINDOW)
        return HybridEngine(kind, socket, **kw)

    yield from engine_factory(build)


def moved(daemon, direction):
    """kvcellar_moved_bytes_total{direction=...}: h2d are Loads, d2h Backups."""
    text = urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=10).read().decode()
    m = re.search(rf'^kvcellar_moved_bytes_total{{direction="{direction}"}} (\S+)$', text,
                  re.MULTILINE)
    return int(float(m.group(1))) if m else 0


def tokens_for(seed, pages):
    return np.random.default_rng(seed).integers(0, 50000, pages * PAGE).tolist()


def object_bytes(engine):
    """(bytes of a KV page object, of a side pool's object) in the daemon."""
    layout = engine.backend.layout
    per = {}
    for (k, v), g in zip(layout.layers, layout.groups):
        per[g] = per.get(g, 0) + k.bytes_per_block + (v.bytes_per_block if v else 0)
    return per[0], per[1]


def two_nodes(engine, tokens, seed, second_state):
    """Backs up ``tokens`` as two nodes of 4 pages: the first with its state, the second with its
    own (``second_state``) or none. Returns (kv1, state1, kv2, state2) slots."""
    kv1, state1 = engine.write(tokens[:4 * PAGE], seed=seed)
    saved, hashes = engine.backup(tokens[:4 * PAGE], kv1, state1)
    assert saved == 4 * PAGE
    kv2, state2 = engine.write(tokens[4 * PAGE:], seed=seed + 1)
    side = state2 if second_state else None
    assert engine.backup(tokens[4 * PAGE:], kv2, side, prefix_keys=hashes)[0] == 4 * PAGE
    return kv1, state1, kv2, state2


# ---- Mamba: the state at the boundary -----------------------------------------------------------


def test_mamba_pages_and_the_state_at_their_end_round_trip_byte_exact(daemon, engines):
    a, b = engines("mamba", daemon.socket), engines("mamba", daemon.socket)
    assert a.active() and b.active()
    kv_obj, state_obj = object_bytes(a)
    # The state slot is what SGLang's zero-copy meta names (temporal then conv, all layers).
    _, sizes = a.side.get_page_buffer_meta(torch.tensor([0]))
    assert state_obj == sum(sizes) == a.side.size_per_token
    # The Mamba pool has its own 17 slots beside 64 KV pages: a pool of its own per group.
    assert a.backend.layout.group_num_blocks == [a.kv.size // PAGE, a.side.size]
    tokens = tokens_for(1, 6)
    kv, state = a.write(tokens, seed=1)
    # The first blocks of fresh pools: the Backup names KV block 0 and state slot 0 at once,
    # which are different memory (each group's blocks are its own, KvLayout.group_num_blocks).
    assert (int(kv[0]), int(state[0])) == (0, 0)
    before = moved(daemon, "d2h")
    assert a.backup(tokens, kv, state)[0] == len(tokens)
    assert moved(daemon, "d2h") - before == 6 * kv_obj + state_obj, "6 KV pages and one state"
    before = moved(daemon, "h2d")
    completed, side_hits, kv_b, state_b = b.prefetch(tokens, trailing=1)
    assert (completed, side_hits) == (len(tokens), 1)
    assert moved(daemon, "h2d") - before == 6 * kv_obj + state_obj
    assert all(torch.equal(x, y) for x, y in zip(a.kv_pages(kv), b.kv_pages(kv_b)))
    assert torch.equal(a.side_pages(state)[0], b.side_pages(state_b)[0])


def test_mamba_pages_and_the_last_state_come_back_from_a_file_tier(daemon_factory, engines,
                                                                   tmp_path):
    """Two nodes, each stored with its state, written through to a file tier at their own sizes
    (KV pages and state slots differ) and dropped from L2: a prefetch of both restores all 8
    pages and reads only the state at their end, not node 1's."""
    from conftest import bin_path
    from kvcellar.integrations.sglang import _keys_array
    d = daemon_factory(args=("--set", f"storage.tiers=file:{tmp_path}/l3?name=disk",
                             "--set", "storage.write_policy=write_through"))
    a, b = engines("mamba", d.socket), engines("mamba", d.socket)
    assert a.active() and b.active()
    kv_obj, state_obj = object_bytes(a)
    assert kv_obj != state_obj
    tokens = tokens_for(9, 8)
    kv1, state1, kv2, state2 = two_nodes(a, tokens, seed=9, second_state=True)
    written = 8 * kv_obj + 2 * state_obj
    deadline = time.monotonic() + 20
    while moved(d, "l2_to_l3") < written:
        assert time.monotonic() < deadline, "no L3 writes:\n" + d.log()
        time.sleep(0.05)
    r = subprocess.run([bin_path("kvcellarctl"), "--addr", d.admin_socket, "evict", "--tier",
                        "l2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
    m = b.backend._session().match([_keys_array(keys)], by_keys=True, prefetch="none")
    assert (m.results[0].l2_hit_pages, m.results[0].l3_hit_pages) == (0, 8)
    before = moved(d, "l3_to_l2")
    completed, side_hits, kv_b, state_b = b.prefetch(tokens, trailing=1)
    assert (completed, side_hits) == (len(tokens), 1)
    assert moved(d, "l3_to_l2") - before == 8 * kv_obj + state_obj, "8 KV pages, one state"
    assert all(torch.equal(x, y) for x, y in zip(a.kv_pages(kv1) + a.kv_pages(kv2),
                                                 b.kv_pages(kv_b)))
    assert torch.equal(a.side_pages(state2)[0], b.side_pages(state_b)[0])


def test_a_hit_whose_trailing_state_is_missing_ends_at_the_last_state(daemon, engines):
    """Node 1 (4 pages) is stored with its state, node 2 (4 more) without one: a prefetch of all
    8 pages restores 4 (the longest boundary with a state), with node 1's state; a sequence
    whose only node has no state is a miss."""
    a, b = engines("mamba", daemon.socket), engines("mamba", daemon.socket)
    assert a.active() and b.active()
    tokens = tokens_for(2, 8)
    kv1, state1, kv2, _ = two_nodes(a, tokens, seed=2, second_state=False)
    # All 8 KV pages are in the daemon; only the boundary after page 4 has a state.
    keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
    res = b.backend.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=["x"],
                                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (4, [4])
    assert b.backend.batch_exists(keys) == 4
    completed, side_hits, kv_b, state_b = b.prefetch(tokens, trailing=1)
    assert (completed, side_hits) == (4 * PAGE, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.kv_pages(kv1), b.kv_pages(kv_b)))
    assert torch.equal(a.side_pages(state1)[0], b.side_pages(state_b)[0])
    # Without any state: no boundary is restorable.
    other = tokens_for(4, 3)
    kv3, _ = a.write(other, seed=4)
    assert a.backup(other, kv3, None)[0] == len(other)
    assert b.prefetch(other, trailing=1)[:2] == (0, 0)


# ---- sliding window: the window's pages before the boundary -------------------------------------


def test_swa_window_pages_round_trip_and_only_the_window_is_loaded(daemon, engines):
    a, b = engines("swa", daemon.socket), engines("swa", daemon.socket)
    assert a.active() and b.active()
    assert [g.window_tokens for g in a.backend.groups] == [0, WINDOW]
    kv_obj, swa_obj = object_bytes(a)
    # The swa pool has half the KV pool's pages: a pool of its own.
    assert a.backend.layout.group_num_blocks == [a.kv.size // PAGE, a.side.size // PAGE]
    tokens = tokens_for(5, 6)
    kv, swa = a.write(tokens, seed=5)
    before = moved(daemon, "d2h")
    assert a.backup(tokens, kv, swa)[0] == len(tokens)
    # Every swa page is stored: a later hit may end at any of them.
    assert moved(daemon, "d2h") - before == 6 * (kv_obj + swa_obj)
    trailing = -(-(WINDOW - 1) // PAGE)  # SGLang's swa component: 3 pages of 16
    before = moved(daemon, "h2d")
    completed, side_hits, kv_b, swa_b = b.prefetch(tokens, trailing)
    assert (completed, side_hits) == (len(tokens), trailing)
    # 6 KV pages and only the window's 3 swa pages, not 6.
    assert moved(daemon, "h2d") - before == 6 * kv_obj + trailing * swa_obj
    assert all(torch.equal(x, y) for x, y in zip(a.kv_pages(kv), b.kv_pages(kv_b)))
    assert all(torch.equal(x, y) for x, y in zip(a.side_pages(swa)[-trailing:],
                                                 b.side_pages(swa_b)))
    # A request that shares the first 4 pages only: its window (pages 1-3) was stored too.
    completed, side_hits, kv_b, swa_b = b.prefetch(tokens[:4 * PAGE] + tokens_for(6, 2),
                                                   trailing)
    assert (completed, side_hits) == (4 * PAGE, trailing)
    assert all(torch.equal(x, y) for x, y in zip(a.side_pages(swa)[1:4], b.side_pages(swa_b)))


def test_a_swa_pool_needs_the_window_from_the_option_or_the_models_config(daemon, engines,
                                                                          tmp_path):
    with pytest.raises(ValueError, match="sliding_window"):
        engines("swa", daemon.socket, sliding_window=None)
    # A model directory whose config gives it (as SGLang's model path does).
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mistral",
                                                   "sliding_window": 64}))
    e = engines("swa", daemon.socket, model=str(model), sliding_window=None)
    assert e.backend.groups[1].window_tokens == 64


def test_a_daemon_down_is_a_miss_for_every_pool(daemon_factory, engines):
    d = daemon_factory()
    a = engines("mamba", d.socket)
    assert a.active()
    tokens = tokens_for(7, 4)
    kv, state = a.write(tokens, seed=7)
    assert a.backup(tokens, kv, state)[0] == len(tokens)
    d.stop(signal.SIGKILL)
    assert a.prefetch(tokens, trailing=1)[:2] == (0, 0)
    kv2, state2 = a.write(tokens_for(8, 4), seed=8)
    assert a.backup(tokens_for(8, 4), kv2, state2)[0] == 0  # not stored, nothing raised


def test_side_pages_of_a_backup_over_two_kv_batches_are_stored_with_their_pages(daemon,
                                                                                  engines):
    """A node of 130 pages: SGLang writes its KV in batches of 128 and 2, and the window's
    pages (127, 128, 129) lie in both; each is stored with its page."""
    a = engines("swa", daemon.socket, device_tokens=144 * PAGE)
    b = engines("swa", daemon.socket, device_tokens=144 * PAGE)
    assert a.active() and b.active()
    assert STORAGE_BATCH_SIZE == 128
    tokens = tokens_for(9, 130)
    kv, swa = a.write(tokens, seed=9)
    assert a.backup(tokens, kv, swa)[0] == len(tokens)
    trailing = -(-(WINDOW - 1) // PAGE)
    completed, side_hits, kv_b, swa_b = b.prefetch(tokens, trailing)
    assert (completed, side_hits) == (len(tokens), trailing)
    assert all(torch.equal(x, y) for x, y in zip(a.side_pages(swa)[-trailing:],
                                                 b.side_pages(swa_b)))


def test_tp_ranks_hit_only_where_every_rank_stored_its_state(daemon):
    """Tensor parallel 2: each rank stores its shard of every KV page and of the state; a
    boundary hits for either rank only once both ranks' state shards are in."""
    backends, pools = [], []
    for rank in range(2):
        cfg = rank_config(daemon.socket, rank, 2, MODEL)
        _, _, kvh, side = mamba_pools()
        be = StorageBackendFactory.create_backend("dynamic", cfg, kvh)
        be.register_mem_pool_host(kvh)
        be.register_mem_host_pool_v2(kvh, PoolName.KV)
        be.register_mem_host_pool_v2(side, PoolName.MAMBA)
        be.on_host_pools_registered()
        backends.append(be)
        pools.append((kvh, side))
    try:
        for be in backends:
            assert be._session().wait_active(5000)
        tokens = tokens_for(10, 4)
        keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        query = [PoolTransfer(PoolName.MAMBA, keys=["x"], hit_policy=PoolHitPolicy.TRAILING_PAGES)]

        def hits():
            return [be.batch_exists_v2(keys, query, info).kv_hit_pages for be in backends]

        def store(rank, state):
            kvh, side = pools[rank]
            be = backends[rank]
            if state:
                v2 = be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=side.alloc(1),
                                                   keys=keys[-1:],
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
                assert v2 == {"mamba": [True]}
            assert be.batch_set_v1(keys, kvh.alloc(len(tokens)), info) == [True] * 4

        store(0, state=True)
        assert hits() == [0, 0]
        store(1, state=False)  # every KV shard, one state shard: no boundary has a state
        assert hits() == [0, 0]
        assert [be.batch_exists(keys, info) for be in backends] == [0, 0]
        store(1, state=True)  # the KV pages are stored already; the state joins them
        assert hits() == [4, 4]
    finally:
        for be in backends:
            be.close()
