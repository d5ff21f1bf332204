"""kvcellar.integrations.sglang against SGLang 0.5.23's own HiCache classes and real kvcellards.

Runs in the repository's .venv-sglang (deploy/install-deps.sh: sglang==0.5.23 without its CUDA
serving stack, requirements-sglang.txt); skipped under an interpreter without SGLang 0.5.23
unless KVCELLAR_REQUIRE_ENGINES=1 (ctest), where a missing SGLang is a failure.

Real SGLang objects, on CPU: the device KV pools (MHATokenToKVPool, MLATokenToKVPool), the
paged allocator, the host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) in shared memory
(``"allocator": "shm"``), and SGLang's HiCacheController, which loads the backend through its
StorageBackendFactory ("dynamic": backend_name, module_path, class_name) and drives it from its
own threads exactly as in serving (sglang/srt/managers/cache_controller.py, 0.5.23):

  attach: create_backend(cfg, {}) -> register_mem_pool_host(pool) -> on_host_pools_registered;
    interface_v1 selects _page_get_zero_copy / _page_set_zero_copy (L645-667).
  backup: write_storage(host_indices, tokens, hash_value, prefix_keys) -> backup thread ->
    _page_backup: batch_set_v1 per 128 pages, prefix_keys extended per chunk (L1416-1436) ->
    ack_backup_queue with completed_tokens.
  prefetch: prefetch(rid, tokens, last_hash, prefix_keys) -> prefetch thread ->
    _storage_hit_query: get_storage_hash_str, batch_exists per 128 pages (L1308-1331) -> MIN
    all-reduce -> prefetch_hit_queue; the scheduler (this file's Engine, as
    unified_radix_cache.py does) allocates host slots and queues the op on prefetch_buffer ->
    prefetch I/O thread -> _page_transfer: batch_get_v1 per 128 pages (L1155-1206) -> acks.

Not real: the scheduler loop and radix tree (Engine plays them: it owns host slots and calls
the controller's entry points in their order), and the ranks of a TP group, which share one
process's parallel context here; the TP test builds each rank's backend through the factory
with that rank's HiCacheStorageConfig.
"""
import hashlib
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

# First: it skips this module without SGLang 0.5.23, which the imports below need.
from sglang_util import (controller_backup, controller_prefetch, engine_factory,  # noqa: E402
                         extra_config, fill_host_pages, host_pages, init_single_rank,
                         rank_config)
import psutil  # noqa: E402
import torch  # noqa: E402

import torch.distributed as dist  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

from kvcellar.integrations.sglang import _keys_array, host_pool_layout  # noqa: E402

from conftest import bin_path  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 8, 16
DEVICE_TOKENS = 4096  # host pools of 2x: 512 pages, room for sequences over one 128-page chunk
MODEL = "test-org/tiny-llama"


@pytest.fixture(scope="module", autouse=True)
def single_rank_process():
    init_single_rank()
    yield


def host_pool(layout="page_first", mla=False, allocator="shm"):
    # SGLang sizes a host pool against the host's available memory less a 10 GiB reserve for a
    # server's other use (pool_host/base.py, HICACHE_HOST_MEMORY_RESERVE_BYTES); beside the
    # rest of ctest on a 24 GiB machine that leaves nothing for these pools of a few MiB. They
    # are checked against the available memory itself, through SGLang's own budget scope.
    with host_memory_budget_scope(psutil.virtual_memory().available):
        return _host_pool(layout, mla, allocator)


def _host_pool(layout, mla, allocator):
    if mla:
        dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, 32, 16, LAYERS, "cpu", False,
                               start_layer=0, end_layer=LAYERS)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE,
                                    layout, pin_memory=False, device="cpu",
                                    allocator_type=allocator, device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS)
    else:
        dev = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS,
                               "cpu", False, start_layer=0, end_layer=LAYERS)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE,
                                    layout, pin_memory=False, device="cpu",
                                    allocator_type=allocator, device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=LAYERS)
    return dev, host


class Engine:
    """One SGLang rank's HiCache with kvcellar as its L3: SGLang's controller over real pools.
    Plays the scheduler: owns host slots, and waits for the controller's acks."""

    def __init__(self, socket, layout="page_first", mla=False, **extra):
        self.dev, self.host = host_pool(layout, mla)
        alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", self.dev,
                                            False)
        self.ctl = HiCacheController(alloc, self.host, PAGE, dist.group.WORLD, threading.Event(),
                                     write_policy="write_through", io_backend="direct",
                                     storage_backend="dynamic", model_name=MODEL,
                                     storage_backend_extra_config=extra_config(socket, **extra))
        self.backend = self.ctl.storage_backend
        self.rid = 0

    def close(self):
        self.ctl.detach_storage_backend()

    def session_active(self, timeout_s=20):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.backend._session()
            if s is not None and s.wait_active(200):
                return True
        return False

    def write(self, tokens, seed):
        """Puts KV for `tokens` (full pages) in fresh host slots, as a device->host copy
        would: random bytes per page. Returns the slots."""
        n = len(tokens) // PAGE * PAGE
        idx = self.host.alloc(n)
        assert idx is not None, "host pool full"
        fill_host_pages(self.host, idx, PAGE, seed)
        return idx

    def pages(self, idx):
        return host_pages(self.host, idx, PAGE)

    def backup(self, idx, tokens, prefix_keys=(), pass_prefix=True):
        """write_storage of a radix node's pages; returns the tokens SGLang counts as saved."""
        return controller_backup(self.ctl, idx, tokens, PAGE, prefix_keys, pass_prefix)

    def prefetch(self, tokens, last_hash=None, prefix_keys=()):
        """A storage prefetch of `tokens` as the scheduler runs it; returns (tokens the
        controller completed, the host slots they landed in)."""
        self.rid += 1
        return controller_prefetch(self.ctl, f"r{self.rid}", tokens, last_hash, prefix_keys)


def round_trip(writer, reader, tokens, seed):
    """`writer` stores fresh KV for `tokens`, `reader` prefetches it: every byte equal. Returns
    the writer's slots and page hashes."""
    idx = writer.write(tokens, seed=seed)
    saved, hashes = writer.backup(idx, tokens)
    assert saved == len(tokens)
    completed, landed = reader.prefetch(tokens)
    assert completed == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(writer.pages(idx), reader.pages(landed)))
    return idx, hashes


def l3_writes_ok(d):
    """kvcellar_l3_writes_total{result="ok"} from the daemon's /metrics."""
    with urllib.request.urlopen(f"http://{d.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvcellar_l3_writes_total{") and 'result="ok"' in line)


def tokens_for(seed, pages):
    return np.random.default_rng(seed).integers(0, 50000, pages * PAGE).tolist()


@pytest.fixture
def engines():
    yield from engine_factory(Engine)


# ---- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize("change,needle", [
    ({"sockett": "/x"}, "unknown key(s) ['sockett']"),
    ({"rpc_timeout_ms": "fast"}, "rpc_timeout_ms (expected an int"),
    ({"prefetch_policy": "eager"}, "prefetch_policy ('eager' is not one of"),
    ({"prefetch_policy": "best_effort"}, "prefetch_policy ('best_effort' is not used"),
    ({"interface_v1": 0}, "interface_v1 must be 1"),
    ({"allocator": None}, "allocator must be \"shm\""),
])
def test_a_wrong_option_fails_the_engine_start_naming_it(tmp_path, change, needle):
    extra = extra_config(str(tmp_path / "none.sock"))
    extra.update(change)
    extra = {k: v for k, v in extra.items() if v is not None}
    dev, host = host_pool()
    alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", dev, False)
    with pytest.raises(ValueError) as err:
        HiCacheController(alloc, host, PAGE, dist.group.WORLD, threading.Event(),
                          write_policy="write_through", io_backend="direct",
                          storage_backend="dynamic", model_name=MODEL,
                          storage_backend_extra_config=extra)
    assert needle in str(err.value)


def test_a_host_pool_outside_shared_memory_is_refused_at_start(tmp_path):
    dev, host = host_pool(allocator="default")
    alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", dev, False)
    with pytest.raises(ValueError, match="not in shared memory"):
        HiCacheController(alloc, host, PAGE, dist.group.WORLD, threading.Event(),
                          write_policy="write_through", io_backend="direct",
                          storage_backend="dynamic", model_name=MODEL,
                          storage_backend_extra_config=extra_config(str(tmp_path / "x.sock")))


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", False),
                                        ("page_head", False), ("layer_first", False),
                                        ("page_first", True), ("layer_first", True)])
def test_the_layout_names_exactly_the_bytes_sglangs_zero_copy_calls_name(layout, mla):
    _, host = host_pool(layout, mla)
    kv = host_pool_layout(host, mla)
    base = host.kv_buffer.data_ptr()
    assert kv.regions[0].handle == f"/proc/{os.getpid()}/fd/{host.fd}"
    assert kv.num_blocks == host.size // PAGE
    for page in (0, 1, 77, kv.num_blocks - 1):
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * PAGE, (page + 1) * PAGE))
        mine = []
        for k, v in kv.layers:
            for b in (k, v) if v is not None else (k,):
                mine.append((base + b.offset + page * b.block_stride, b.bytes_per_block))
        assert mine == list(zip(ptrs, sizes))
    # One page object holds every byte of SGLang's page: the flat page's size.
    assert kv.page_object_bytes == host.get_dummy_flat_data_page().numel() * 2


def test_keys_are_sglangs_digests_and_other_strings_are_hashed():
    digests = get_hash_str(tokens_for(15, 3), prior_hash=None, page_size=PAGE)
    assert _keys_array(digests).tobytes() == b"".join(bytes.fromhex(k) for k in digests)
    spaced = "  " + digests[0][:62]  # 64 characters, but fromhex would skip the spaces
    mixed = _keys_array([digests[0], "not-a-digest", spaced, digests[1]])
    assert mixed.shape == (4, 32)
    assert bytes(mixed[0]) == bytes.fromhex(digests[0])
    assert bytes(mixed[1]) == hashlib.sha256(b"not-a-digest").digest()
    assert bytes(mixed[2]) == hashlib.sha256(spaced.encode()).digest()
    assert bytes(mixed[3]) == bytes.fromhex(digests[1])
    assert _keys_array([]).shape == (0, 32)


# ---- the data path ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_pages_backed_up_by_one_engine_are_prefetched_byte_exact_by_another(daemon, engines,
                                                                            layout):
    a = engines(daemon.socket, layout=layout)
    b = engines(daemon.socket, layout=layout)
    assert a.session_active() and b.session_active()
    _, hashes = round_trip(a, b, tokens_for(1, 200), seed=1)  # two 128-page chunks each way
    # A continuation from a host-resident prefix: keys chained from its last hash.
    more = tokens_for(2, 10)
    idx2 = a.write(more, seed=2)
    saved, _ = a.backup(idx2, more, prefix_keys=hashes)
    assert saved == len(more)
    completed, landed = b.prefetch(more, last_hash=hashes[-1], prefix_keys=hashes)
    assert completed == len(more)
    assert all(torch.equal(x, y) for x, y in zip(a.pages(idx2), b.pages(landed)))
    # An unknown sequence is a clean miss.
    assert b.prefetch(tokens_for(3, 20)) == (0, None)


def test_engines_with_other_host_layouts_never_share_pages(daemon, engines):
    a = engines(daemon.socket, layout="page_first")
    b = engines(daemon.socket, layout="layer_first")
    assert a.session_active() and b.session_active()
    tokens = tokens_for(4, 20)
    assert a.backup(a.write(tokens, seed=4), tokens)[0] == len(tokens)
    assert b.prefetch(tokens) == (0, None)  # same tokens, another byte order: another namespace
    assert a.prefetch(tokens)[0] == len(tokens)


def test_mla_pages_round_trip(daemon, engines):
    a = engines(daemon.socket, mla=True)
    b = engines(daemon.socket, mla=True)
    assert a.session_active() and b.session_active()
    round_trip(a, b, tokens_for(5, 40), seed=5)


def test_pages_only_in_l3_are_brought_back_by_batch_exists(daemon_factory, engines, tmp_path):
    d = daemon_factory(args=("--set", f"storage.tiers=file:{tmp_path}/l3?name=disk",
                             "--set", "storage.write_policy=write_through"))
    a = engines(d.socket)
    assert a.session_active()
    tokens = tokens_for(6, 30)
    idx = a.write(tokens, seed=6)
    assert a.backup(idx, tokens)[0] == len(tokens)
    want = a.pages(idx)
    # Wait for the L3 copies, then drop the pages from the daemon's pool.
    deadline = time.monotonic() + 20
    while l3_writes_ok(d) < len(tokens) // PAGE:
        assert time.monotonic() < deadline, "no L3 writes:\n" + d.log()
        time.sleep(0.1)
    r = subprocess.run([bin_path("kvcellarctl"), "--addr", d.admin_socket, "evict", "--tier",
                        "l2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    b = engines(d.socket)
    assert b.session_active()
    keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
    m = b.backend._session().match([_keys_array(keys)], by_keys=True, prefetch="none")
    assert (m.results[0].l2_hit_pages, m.results[0].l3_hit_pages) == (0, len(keys))
    # The first 10 pages come back into the pool; then a prefetch of all 30 finds 10 in the
    # pool and 20 only in L3, and brings every one.
    head = tokens[:10 * PAGE]
    completed, landed = b.prefetch(head)
    assert completed == len(head)
    assert all(torch.equal(x, y) for x, y in zip(want[:10], b.pages(landed)))
    m = b.backend._session().match([_keys_array(keys)], by_keys=True, prefetch="none")
    assert (m.results[0].l2_hit_pages, m.results[0].l3_hit_pages) == (10, 20)
    completed, landed = b.prefetch(tokens)
    assert completed == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(want, b.pages(landed)))


def test_tp_ranks_hit_only_pages_every_rank_has_stored(daemon, tmp_path):
    """MHA with TP 2: each rank stores its heads' shard; a page hits for the group only when
    both shards are in, so ranks never disagree on what they can load."""
    backends, pools = [], []
    for rank in range(2):
        cfg = rank_config(daemon.socket, rank, 2, MODEL)
        _, host = host_pool()
        be = StorageBackendFactory.create_backend("dynamic", cfg, host)
        be.register_mem_pool_host(host)
        be.on_host_pools_registered()
        backends.append(be)
        pools.append(host)
    try:
        for be in backends:
            assert be._session().wait_active(5000)
        tokens = tokens_for(7, 8)
        keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        idx0 = pools[0].alloc(len(tokens))
        assert backends[0].batch_set_v1(keys, idx0, info) == [True] * 8
        assert [be.batch_exists(keys, info) for be in backends] == [0, 0]
        idx1 = pools[1].alloc(len(tokens))
        assert backends[1].batch_set_v1(keys, idx1, info) == [True] * 8
        assert [be.batch_exists(keys, info) for be in backends] == [8, 8]
        assert backends[1].exists(keys[0])
    finally:
        for be in backends:
            be.close()


# ---- failure ------------------------------------------------------------------------------------


def test_a_daemon_down_at_start_or_killed_later_is_a_miss_then_hits_again(daemon_factory,
                                                                         engines, tmp_path):
    socket = str(tmp_path / "later.sock")
    a = engines(socket)  # no daemon yet: the engine starts anyway
    tokens = tokens_for(8, 12)
    idx = a.write(tokens, seed=8)
    assert a.backup(idx, tokens)[0] == 0
    assert a.prefetch(tokens) == (0, None)

    def start():
        return daemon_factory(args=("--set", f"listen.unix_socket={socket}"))

    d = start()
    assert a.session_active()
    assert a.backup(idx, tokens)[0] == len(tokens)
    assert a.prefetch(tokens)[0] == len(tokens)

    d.stop(signal.SIGKILL)
    assert a.backup(idx, tokens)[0] == 0
    assert a.prefetch(tokens) == (0, None)

    start()
    assert a.session_active()
    assert a.prefetch(tokens) == (0, None)  # the restarted daemon's pool is empty
    assert a.backup(idx, tokens)[0] == len(tokens)
    completed, landed = a.prefetch(tokens)
    assert completed == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(a.pages(idx), a.pages(landed)))


def test_backups_without_prefix_keys_work_and_warn_once(daemon, engines, caplog):
    a = engines(daemon.socket)
    assert a.session_active()
    tokens = tokens_for(9, 4)
    idx = a.write(tokens, seed=9)
    with caplog.at_level(logging.WARNING, logger="kvcellar.integrations.sglang"):
        assert a.backup(idx, tokens, pass_prefix=False)[0] == len(tokens)
        assert a.backup(idx, tokens, pass_prefix=False)[0] == len(tokens)  # already stored
    warnings = [r for r in caplog.records if "hicache_storage_pass_prefix_keys" in r.getMessage()]
    assert len(warnings) == 1
    completed, landed = a.prefetch(tokens)
    assert completed == len(tokens)
    assert all(torch.equal(x, y) for x, y in zip(a.pages(idx), a.pages(landed)))


def test_clear_forgets_every_page_stored_before_it(daemon, engines):
    a = engines(daemon.socket)
    assert a.session_active()
    tokens = tokens_for(10, 6)
    idx = a.write(tokens, seed=10)
    assert a.backup(idx, tokens)[0] == len(tokens)
    assert a.prefetch(tokens)[0] == len(tokens)
    a.backend.clear()  # what HybridCacheController.clear_storage_backend calls on flush_cache
    assert a.session_active()
    assert a.prefetch(tokens) == (0, None)
    assert a.backup(idx, tokens)[0] == len(tokens)
    assert a.prefetch(tokens)[0] == len(tokens)


def test_get_stats_reports_the_pages_moved(daemon, engines):
    a = engines(daemon.socket)
    assert a.session_active()
    tokens = tokens_for(11, 5)
    idx = a.write(tokens, seed=11)
    a.backup(idx, tokens)
    a.prefetch(tokens)
    m = a.backend.get_stats()
    assert type(m).__name__ == "StorageMetrics"
    assert sum(m.backup_pgs) == 5 and sum(m.prefetch_pgs) == 5
    assert all(bw > 0 for bw in m.backup_bandwidth + m.prefetch_bandwidth)
    m = a.backend.get_stats()
    assert m.backup_pgs == [] and m.prefetch_pgs == []


def test_an_engine_that_truncates_its_host_pool_loses_only_its_own_cache(daemon, engines):
    """A buggy or hostile engine shrinks its registered memfd under the daemon's mapping: the
    daemon's copies into and out of it fault, which fails that engine's gets and sets (misses)
    while the daemon and every other engine carry on, byte-exact."""
    victim = engines(daemon.socket)
    other = engines(daemon.socket)
    assert victim.session_active() and other.session_active()
    tokens = tokens_for(12, 8)
    idx = victim.write(tokens, seed=12)
    assert victim.backup(idx, tokens)[0] == len(tokens)
    os.ftruncate(victim.host.fd, 0)  # the test touches the victim's pool no more
    keys = get_hash_str(tokens, prior_hash=None, page_size=PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert victim.backend.batch_get_v1(keys, idx, info) == [False] * len(keys)
    fresh = get_hash_str(tokens_for(13, 8), prior_hash=None, page_size=PAGE)
    assert victim.backend.batch_set_v1(fresh, idx, info) == [False] * len(fresh)
    assert daemon.proc.poll() is None, daemon.log()
    daemon.wait_for_line("engine memory fault")
    # The pages the victim stored before are intact, and another engine loads them.
    completed, _ = other.prefetch(tokens)
    assert completed == len(tokens)
    round_trip(other, other, tokens_for(14, 6), seed=14)
