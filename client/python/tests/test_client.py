"""The package's client against a real kvcellard on the sim device: registration from tensors,
match, layer-by-layer load, backup with a ready signal, TP groups, and a daemon that is down,
killed and restarted (every failure a miss with a reason, nothing raised)."""
import os
import signal
import time
import uuid

import numpy as np
import pytest
import torch

import kvcellar
from kvcellar import BackupSeq, Client, KvGroup, KvLayout, LoadSeq, Namespace, SimDevice
from kvcellar import _native as N

P = 16
LAYERS = 3
BLOCKS = 32
HEADS, DIM = 2, 8


# A hybrid model's groups: full attention, a window of two pages, a recurrent state.
HYBRID_GROUPS = (KvGroup("full"), KvGroup("window", 2 * P + 1), KvGroup("state"))


def make_ns(tp_size=1, layout="mha", **kw):
    return Namespace("test-model", "rev1", "fp32", P, layout=layout, tp_size=tp_size, **kw)


def vllm_cache(dev, heads=HEADS):
    """vLLM FlashAttention per-layer caches [2, blocks, P, heads, dim], in one allocation
    (views that do not start at the allocation base)."""
    raw = dev.empty((LAYERS, 2, BLOCKS, P, heads, DIM), torch.float32)
    return {f"model.layers.{i}.self_attn": raw[i] for i in range(LAYERS)}


def fill(caches, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    for t in caches.values():
        for b in blocks:
            t[:, b].copy_(torch.randn(t[:, b].shape, generator=g))


def test_register_match_load_backup(daemon):
    dev = SimDevice()
    caches = vllm_cache(dev)
    layout = KvLayout.from_vllm(caches, device=dev)
    assert layout.num_blocks == BLOCKS and layout.num_layers == LAYERS
    assert len(layout.regions) == 1  # one allocation
    assert layout.layers[1][0].offset == 2 * BLOCKS * P * HEADS * DIM * 4
    with Client(daemon.socket) as client:
        s = client.register("eng-a", make_ns(), layout=layout)
        assert s.wait_active(5000)
        info = s.info()
        assert info.page_object_bytes == layout.page_object_bytes == LAYERS * 2 * P * HEADS * DIM * 4
        tokens = np.arange(5 * P + 3, dtype=np.uint32)
        m = s.match([tokens])
        assert m.ok and m.results[0].l2_hit_pages == 0 and m.results[0].total_pages == 5
        keys = m.results[0].keys
        assert keys.shape == (5, 32)
        fill(caches, range(5), seed=1)
        expect = {n: t[:, :5].clone() for n, t in caches.items()}
        op = s.backup(keys, np.arange(5), ready=True)
        assert op.ok, op.reason
        assert op.wait().done
        # A second engine of the same instance group loads into other blocks, layer by layer.
        m = s.match([tokens], pin=True)
        r = m.results[0]
        assert r.l2_hit_pages == 5 and r.pin_id
        for t in caches.values():
            t[:, 10:15].fill_(-1.0)
        op = s.load(r.keys, np.arange(10, 15), pin_id=r.pin_id, release_pin=True)
        assert op.ok and op.slot is not None
        for layer in range(LAYERS):
            assert op.wait_layer(layer)
        st = op.wait()
        assert st.done and st.leading_ok_pages == [5]
        for n, t in caches.items():
            assert torch.equal(t[:, 10:15], expect[n])  # bit-exact
        stats = client.stats()
        assert stats["degraded_calls"] == 0
    dev.close()


def test_session_keys_come_through_its_key_cache_and_equal_the_stateless_keys(daemon):
    """Session.keys (and Match by token ids) key through the session's cache, so a conversation's
    earlier turns are not hashed again; the keys are those of kvcellar.page_keys, turn by turn,
    with a partial page left out and a parent chain still honoured."""
    ns = make_ns()
    with Client(daemon.socket) as client:
        s = client.register("keys-cache", ns, scheduler=True)
        assert s.wait_active(5000)
        rng = np.random.default_rng(11)
        conversation = np.empty(0, dtype=np.uint32)
        for turn in range(4):
            conversation = np.concatenate(
                [conversation, rng.integers(0, 128000, 3 * P + 5, dtype=np.uint32)])
            got = s.keys(conversation)
            want = kvcellar.page_keys(ns, conversation)
            assert got.shape == (len(conversation) // P, 32) and np.array_equal(got, want), turn
            m = s.match([conversation])
            assert m.ok and np.array_equal(m.results[0].keys, want)
        tail = conversation[2 * P:]
        assert np.array_equal(s.keys(tail, parent=bytes(want[1])), want[2:])
        assert s.keys(conversation[: P - 1]).shape == (0, 32)


def test_multi_sequence_batches_and_page_status(daemon):
    dev = SimDevice()
    caches = vllm_cache(dev)
    layout = KvLayout.from_vllm(caches, device=dev)
    with Client(daemon.socket) as client:
        s = client.register("eng-b", make_ns(), layout=layout)
        assert s.wait_active(5000)
        a = np.arange(3 * P, dtype=np.uint32)
        b = np.arange(1000, 1000 + 2 * P, dtype=np.uint32)
        ka, kb = s.keys(a), s.keys(b)
        op = s.backup([BackupSeq(ka, [0, 1, 2]), BackupSeq(kb, [3, 4])])
        assert op.wait().leading_ok_pages == [3, 2]
        # Extend a's chain by one page from its last key.
        a2 = np.arange(3 * P, 4 * P, dtype=np.uint32)
        k3 = s.keys(a2, parent=bytes(ka[-1]))
        assert np.array_equal(k3[0], s.keys(np.arange(4 * P, dtype=np.uint32))[3])
        op = s.backup(k3, [5], parent=bytes(ka[-1]))
        assert op.wait().done
        m = s.match([np.arange(4 * P, dtype=np.uint32), b, np.arange(7, 7 + P)])
        assert [r.l2_hit_pages for r in m.results] == [4, 2, 0]
        # Skipping computed pages.
        m = s.match([np.arange(4 * P, dtype=np.uint32)], num_computed_pages=[2])
        assert m.results[0].l2_hit_pages == 2 and len(m.results[0].keys) == 2
        # A page that is not cached: per-page statuses name it.
        unknown = s.keys(np.arange(50000, 50000 + P))
        op = s.load([LoadSeq(ka, [10, 11, 12]), LoadSeq(unknown, [13])], page_status=True)
        st = op.wait()
        assert st.leading_ok_pages == [3, 0]
        assert list(op.page_status[1]) != [1]


def test_tp_group_hits_only_when_every_shard_is_cached(daemon):
    ns = make_ns(tp_size=2)
    devs = [SimDevice(), SimDevice()]
    caches = [vllm_cache(d, heads=1) for d in devs]
    with Client(daemon.socket) as client:
        ranks = [client.register("tp-eng", ns, rank=r,
                                 layout=KvLayout.from_vllm(caches[r], device=devs[r]))
                 for r in range(2)]
        assert all(s.wait_active(5000) for s in ranks)
        tokens = np.arange(4 * P, dtype=np.uint32)
        keys = ranks[0].keys(tokens)
        assert ranks[0].backup(keys, [0, 1, 2, 3]).wait().done
        # Rank 1 has backed up nothing yet: the group has no hit.
        assert ranks[0].match([tokens]).results[0].l2_hit_pages == 0
        assert ranks[1].backup(keys[:3], [0, 1, 2]).wait().done
        hits = [s.match([tokens]).results[0].l2_hit_pages for s in ranks]
        assert hits == [3, 3]
        sched = client.register("tp-eng", ns, scheduler=True)
        assert sched.wait_active(5000)
        assert sched.match([tokens]).results[0].l2_hit_pages == 3


def test_daemon_down_killed_and_restarted_is_a_miss(tmp_path, daemon_factory):
    dev = SimDevice()
    caches = vllm_cache(dev)
    layout = KvLayout.from_vllm(caches, device=dev)
    sock = str(tmp_path / "later" / "kvcellard.sock")
    client = Client(sock, rpc_timeout_ms=200, register_timeout_ms=300, backoff_max_ms=200)
    t0 = time.monotonic()
    s = client.register("eng-down", make_ns(), layout=layout)  # no daemon yet: no error
    assert time.monotonic() - t0 < 2.0
    tokens = np.arange(2 * P, dtype=np.uint32)
    t0 = time.monotonic()
    m = s.match([tokens])
    assert not m.ok and "unavailable" in m.reason and m.results[0].l2_hit_pages == 0
    op = s.load(m.results[0].keys, [0, 1])
    assert not op.ok and not op.wait_layer(0) and not op.wait(100).done
    op = s.backup(m.results[0].keys, [0, 1])
    assert not op.ok and op.reason
    assert time.monotonic() - t0 < 2.0  # each call bounded by its deadline
    d = daemon_factory(subdir="later")
    assert s.wait_active(10000)
    assert s.backup(m.results[0].keys, [0, 1]).wait().done
    assert s.match([tokens]).results[0].l2_hit_pages == 2
    d.stop(signal.SIGKILL)
    m = s.match([tokens])
    assert not m.ok and m.results[0].l2_hit_pages == 0
    daemon_factory(subdir="later")
    assert s.wait_active(10000)
    # The restarted daemon has an empty pool: a miss, then hits once backed up again.
    assert s.match([tokens]).results[0].l2_hit_pages == 0
    assert s.backup(m.results[0].keys, [0, 1]).wait().done
    assert s.match([tokens]).results[0].l2_hit_pages == 2
    assert client.stats()["reregistrations"] >= 1
    client.close()


def test_bad_input_in_the_step_is_a_miss_not_an_exception(daemon):
    dev = SimDevice()
    layout = KvLayout.from_vllm(vllm_cache(dev), device=dev)
    with Client(daemon.socket) as client:
        s = client.register("eng-bad", make_ns(), layout=layout)
        assert s.wait_active(5000)
        keys = s.keys(np.arange(P))
        op = s.load(keys, [BLOCKS + 5])  # block out of range: the daemon refuses
        assert not op.ok and "block" in op.reason
        op = s.backup(keys, [0, 1])  # 1 key, 2 blocks
        assert not op.ok and "1 keys but 2 blocks" in op.reason
        m = s.match([np.zeros((2, 2))])
        assert not m.ok and "tokens" in m.reason
        m = s.match([np.arange(P)], prefetch="sometimes")
        assert not m.ok and "prefetch" in m.reason
        assert s.match([np.arange(P)]).ok  # nothing changed


def metric(d, name, **labels):
    """The sum of a counter or gauge's series (those with `labels`) on the daemon's /metrics."""
    import urllib.request
    with urllib.request.urlopen(f"http://{d.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name and all(w in line for w in want))


@pytest.fixture(params=["file", "redis"])
def l3_tier(request, tmp_path):
    """A file tier in the test's directory, or a real redis-server (Debian's) on a Unix socket."""
    if request.param == "file":
        yield f"file:{tmp_path}/l3?name=nvme"
        return
    from redis_util import RedisServer
    server = RedisServer(tmp_path / "redis").start()
    yield f"redis:{server.address}?name=nvme&prefix=hy:"
    server.stop()


def test_hybrid_groups_reach_an_l3_tier_at_their_own_sizes_and_come_back(
        tmp_path, daemon_factory, l3_tier):
    """A hybrid model whose groups' objects differ in size (full attention 2048 B, a window of
    two pages 1024 B, a recurrent state 3072 B) written through to a file or Redis tier. Out of
    L2, Match reports the boundary the tier serves, its prefetch reads only the objects a hit
    there needs (not the tier's other window pages and states), and the Load is bit-exact. A
    daemon restarted on an empty pool finds every group's objects (the file tier's startup scan,
    the Redis tier's index readback), at their own sizes."""
    tier = ("--set", f"storage.tiers={l3_tier}", "--set", "storage.write_policy=write_through")
    d = daemon_factory(args=tier, subdir="a")
    dev = SimDevice()
    heads = (2, 1, 3)  # per group: bytes per object 1024 x heads
    raws = [dev.empty((2, BLOCKS, P, h, DIM), torch.float32) for h in heads]
    caches = {f"model.layers.{i}.self_attn": raws[i] for i in range(LAYERS)}
    layout = KvLayout.from_vllm(caches, device=dev, groups=[0, 1, 2])
    layout.group_num_blocks = [BLOCKS] * 3  # three allocations: a block pool per group
    ns = make_ns(groups=HYBRID_GROUPS)
    NO = N.NO_BLOCK
    try:
        client = Client(d.socket, rpc_timeout_ms=2000)
        s = client.register("eng-hybrid-l3", ns, layout=layout)
        assert s.wait_active(5000)
        assert s.info().page_object_bytes == 3072  # the largest group's: a slot each
        tokens = np.arange(6 * P, dtype=np.uint32)
        keys = s.match([tokens]).results[0].keys
        for raw in raws:
            raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(5)))
        expect = [raw.clone() for raw in raws]
        # Every full page, the window on pages 1-5, states at boundaries 3 and 6 (pages 2, 5).
        stored = np.array([[0, NO, NO], [1, 1, NO], [2, 2, 2], [3, 3, NO], [4, 4, NO],
                           [5, 5, 5]], dtype=np.uint32)
        op = s.backup(keys, stored.ravel(), ready=True)
        assert op.ok, op.reason
        st = op.wait()
        assert st.done and st.leading_ok_pages == [6]
        objects = 6 + 5 + 2
        in_tier = 6 * 2048 + 5 * 1024 + 2 * 3072
        deadline = time.monotonic() + 20
        while metric(d, "kvcellar_l3_writes_total", result="ok") < objects:
            assert time.monotonic() < deadline, "no L3 writes:\n" + d.log()
            time.sleep(0.05)
        assert metric(d, "kvcellar_moved_bytes_total", direction="l2_to_l3") == in_tier

        def evict_l2(daemon):
            import subprocess
            from conftest import bin_path
            r = subprocess.run([bin_path("kvcellarctl"), "--addr", daemon.admin_socket, "evict",
                                "--tier", "l2"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr

        def from_tier(daemon, session):
            m = session.match([tokens], prefetch="none")
            assert (m.results[0].l2_hit_pages, m.results[0].l3_hit_pages) == (0, 6), daemon.log()
            # Boundary 3 alone: the tier has the window's pages 1-2 and the state at page 2.
            m = session.match([tokens[:3 * P]], prefetch="none")
            assert (m.results[0].l2_hit_pages, m.results[0].l3_hit_pages) == (0, 3)
            before = metric(daemon, "kvcellar_moved_bytes_total", direction="l3_to_l2")
            m = session.match([tokens], pin=True, prefetch="wait_complete")
            r = m.results[0]
            assert (r.l2_hit_pages, r.l3_hit_pages) == (0, 6) and m.prefetch_op is not None
            st = m.prefetch_op.wait(10000)
            assert st.done and st.leading_ok_pages == [6], st
            # What boundary 6 needs: every full page, the window's pages 4-5, the state at 5.
            read = metric(daemon, "kvcellar_moved_bytes_total", direction="l3_to_l2") - before
            assert read == 6 * 2048 + 2 * 1024 + 3072 < in_tier
            m = session.match([tokens], pin=True)
            assert m.results[0].l2_hit_pages == 6
            for raw in raws:
                raw[:, 10:20].fill_(-1.0)
            target = np.array([[10, NO, NO], [11, NO, NO], [12, NO, NO], [13, NO, NO],
                               [14, 14, NO], [15, 15, 15]], dtype=np.uint32)
            st = session.load(keys, target.ravel(), pin_id=m.results[0].pin_id,
                              release_pin=True).wait()
            assert st.done and st.leading_ok_pages == [6], st
            for src, dst in zip(stored, target):
                for g in range(3):
                    if dst[g] != NO:
                        assert torch.equal(raws[g][:, dst[g]], expect[g][:, src[g]]), (g, src, dst)
            assert torch.equal(raws[1][:, 13], torch.full_like(raws[1][:, 13], -1.0))

        evict_l2(d)
        from_tier(d, s)
        epoch = s.info().daemon_epoch
        d.stop(signal.SIGKILL)
        d = daemon_factory(args=tier, subdir="a")  # an empty pool, the same tier
        deadline = time.monotonic() + 10
        while s.info().daemon_epoch == epoch and time.monotonic() < deadline:
            s.match([tokens])  # a miss that notices the restart
            time.sleep(0.05)
        assert s.wait_active(10000) and s.info().daemon_epoch != epoch
        # Every group's objects back in the index at their own sizes: none refused as another
        # geometry's.
        while metric(d, "kvcellar_l3_scan_pages_total", result="inserted") < 6:
            assert time.monotonic() < deadline + 10, d.log()
            time.sleep(0.05)
        assert metric(d, "kvcellar_l3_scan_objects_total", result="found") == objects
        assert metric(d, "kvcellar_l3_scan_pages_total", result="mismatched") == 0
        from_tier(d, s)
        client.close()
    finally:
        dev.close()


def test_hybrid_groups_hit_at_a_boundary_every_group_serves_and_survive_a_kill(
        tmp_path, daemon_factory):
    """A hybrid model (full attention, a window of two pages, a recurrent state) as vLLM's hybrid
    allocator lays it out: the groups' layers share one tensor and a block is one group's at a
    time. Only the objects a hit can use are stored; Match finds the longest boundary every group
    serves; Load fills each group's blocks; a SIGKILLed daemon's pool keeps the groups."""
    shm = f"kvc-hyb-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    args = ("--set", f"pool.shm_name={shm}", "--set", "pool.capacity=64MiB")
    d = daemon_factory(args=args, subdir="a")
    dev = SimDevice()
    raw = dev.empty((2, BLOCKS, P, HEADS, DIM), torch.float32)
    caches = {f"model.layers.{i}.self_attn": raw for i in range(LAYERS)}
    layout = KvLayout.from_vllm(caches, device=dev, groups=[0, 1, 2])
    ns = make_ns(groups=HYBRID_GROUPS)
    NO = N.NO_BLOCK
    try:
        client = Client(d.socket, rpc_timeout_ms=2000)
        s = client.register("eng-hybrid", ns, layout=layout)
        assert s.wait_active(5000)
        assert s.info().page_object_bytes == 2 * P * HEADS * DIM * 4  # one layer per group
        tokens = np.arange(6 * P, dtype=np.uint32)
        keys = s.match([tokens]).results[0].keys
        fill(caches, range(10), seed=3)
        expect = raw.clone()
        # Every full-attention page, the window's last two pages, the state at the end.
        stored = np.array([[0, NO, NO], [1, NO, NO], [2, NO, NO], [3, NO, NO], [4, 6, NO],
                           [5, 7, 8]], dtype=np.uint32)
        op = s.backup(keys, stored.ravel(), ready=True)
        assert op.ok, op.reason
        st = op.wait()
        assert st.done and st.leading_ok_pages == [6]

        def check_load(session):
            m = session.match([tokens], pin=True)
            assert m.results[0].l2_hit_pages == 6
            # Boundary 3 has no window pages stored: no group-consistent hit there.
            assert session.match([tokens[:3 * P]]).results[0].l2_hit_pages == 0
            raw[:, 10:20].fill_(-1.0)
            target = np.array([[10, NO, NO], [11, NO, NO], [12, NO, NO], [13, NO, NO],
                               [14, 16, NO], [15, 17, 18]], dtype=np.uint32)
            op = session.load(keys, target.ravel(), pin_id=m.results[0].pin_id,
                              release_pin=True)
            assert op.ok, op.reason
            assert op.wait().done
            for src, dst in zip(stored.ravel(), target.ravel()):
                if src != NO:
                    assert torch.equal(raw[:, dst], expect[:, src]), (src, dst)
            assert torch.equal(raw[:, 19], torch.full_like(raw[:, 19], -1.0))  # not named

        check_load(s)
        # Asking for a window page that was never stored loads nothing.
        raw[:, 10:20].fill_(-1.0)
        too_much = np.array([[10, NO, NO], [11, NO, NO], [12, NO, NO], [13, 19, NO],
                             [14, 16, NO], [15, 17, 18]], dtype=np.uint32)
        st = s.load(keys, too_much.ravel()).wait()
        assert st.leading_ok_pages == [0]
        assert torch.equal(raw[:, 10:20], torch.full_like(raw[:, 10:20], -1.0))

        epoch = s.info().daemon_epoch
        d.stop(signal.SIGKILL)
        daemon_factory(args=args, subdir="a")  # the same socket
        deadline = time.monotonic() + 10
        while s.info().daemon_epoch == epoch and time.monotonic() < deadline:
            s.match([tokens])  # a miss that notices the restart
            time.sleep(0.05)
        assert s.wait_active(10000) and s.info().daemon_epoch != epoch
        check_load(s)  # the restarted daemon's pool kept every group's objects
        client.close()
    finally:
        dev.close()
        for path in (f"/dev/shm/{shm}", f"/dev/shm/{shm}.journal"):
            if os.path.exists(path):
                os.unlink(path)
