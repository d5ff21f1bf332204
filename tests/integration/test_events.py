"""KV events through real daemons (docs/events.md): what a router subscribed to kvcellard sees.

A WatchEvents stream and a ZMQ subscriber (python3-zmq) watch a daemon whose engines back pages up
(kvcellar-engine-sim): every page stored in L2 ("CPU") and in L3 ("STORAGE", or "STORAGE:<name>" per tier) is
announced once, every page evicted or cleared is announced removed (a file tier's own capacity
evictions too, and a Redis server's own expirations and evictions, which also leave the index at
once), sequence numbers have no gap,
the ZMQ payload is vLLM's msgpack layout (decoded here with python3-msgpack against the published
field names; client/python/tests/test_vllm_kv_events.py decodes it with vLLM's own classes), a
warm restart re-announces the recovered pages after AllBlocksCleared, an overfull queue drops
events visibly (gap, AllBlocksCleared, counter) without stalling Backups, and a port already taken
stops the daemon with an error naming events.endpoint.

Runs under Debian's /usr/bin/python3 (python3-grpcio, python3-zmq, python3-msgpack, pytest).
"""
import hashlib
import os
import re
import socket
import struct
import subprocess
import threading
import time
import uuid

import msgpack
import pytest
import zmq

from conftest import BIN_DIR
from engine_sim import (DAEMON_ARGS, EXIT_OK, admin, engine_tokens, evict_l2, metric, run_engine,
                        wait_until)
from kvcellar.v1 import admin_service_pb2
from redis_util import RedisServer

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="events-model")
PAGES = 6
STORED = admin_service_pb2.KvEvent.BLOCK_STORED
REMOVED = admin_service_pb2.KvEvent.BLOCK_REMOVED
CLEARED = admin_service_pb2.KvEvent.ALL_BLOCKS_CLEARED


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watch:
    """A WatchEvents stream read on a thread; batches collects what arrived."""

    def __init__(self, daemon, **request):
        self.batches = []
        self._call = admin(daemon).WatchEvents(admin_service_pb2.WatchEventsRequest(**request))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for b in self._call:
                self.batches.append(b)
        except Exception:  # Cancelled at close().
            pass

    def events(self):
        return [(b.seq, e) for b in list(self.batches) for e in b.events]

    def pages(self, kind, medium):
        return [k for _, e in self.events() if e.kind == kind and e.medium == medium
                for k in e.block_hashes]

    def wait_pages(self, kind, medium, n, timeout=10):
        wait_until(lambda: len(self.pages(kind, medium)) >= n, timeout=timeout,
                   what=f"{n} pages {kind} in {medium}")
        return self.pages(kind, medium)

    def close(self):
        self._call.cancel()
        self._thread.join(timeout=5)


def backup(d, tokens_seed, pages=PAGES, instance="writer"):
    r = run_engine(d.socket, "backup", instance=instance, seed=1, tokens_seed=tokens_seed,
                   pages=pages, **GEOMETRY)
    assert r.rc == EXIT_OK, r.describe()
    return r


def clear(d, tier):
    admin(d).Clear(admin_service_pb2.ClearRequest(tiers=[tier], confirm=True), timeout=10)


def test_l2_and_l3_pages_are_announced_stored_then_removed(daemon_factory, tmp_path):
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"storage.tiers=file:{tmp_path}/l3?name=nvme",
                             "--set", "storage.write_policy=write_through",
                             "--set", "events.storage_media=per_tier",
                             "--set", "events.node=node-a"))
    w = Watch(d)
    time.sleep(0.2)  # The stream is open before the first page.
    backup(d, tokens_seed=7)
    stored_l2 = w.wait_pages(STORED, "CPU", PAGES)
    stored_l3 = w.wait_pages(STORED, "STORAGE:nvme", PAGES)
    assert stored_l2 == stored_l3 and len(set(stored_l2)) == PAGES
    events = w.events()
    assert events[0][1].kind == CLEARED  # The namespace's first event.
    first = [e for _, e in events if e.kind == STORED and e.medium == "CPU"][0]
    assert first.parent_block_hash == b"" and first.block_size == GEOMETRY["page_size"]
    assert first.locality == "LOCAL"
    assert all(b.topic == "kv@node-a@events-model" for b in w.batches)

    # Backing the same pages up again stores nothing new: nothing is announced.
    backup(d, tokens_seed=7, instance="writer2")
    time.sleep(0.3)
    assert len(w.pages(STORED, "CPU")) == PAGES

    evict_l2(d)  # Eviction from L2 keeps the L3 copies (and their index marks).
    assert sorted(w.wait_pages(REMOVED, "CPU", PAGES)) == sorted(stored_l2)
    time.sleep(0.3)
    assert w.pages(REMOVED, "STORAGE:nvme") == []
    clear(d, admin_service_pb2.TIER_L3)
    assert sorted(w.wait_pages(REMOVED, "STORAGE:nvme", PAGES)) == sorted(stored_l2)
    seqs = [b.seq for b in w.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    assert all(b.missed == 0 for b in w.batches)
    w.close()


def test_zmq_subscriber_and_replay_get_vllms_format(daemon_factory):
    pub, rep = free_port(), free_port()
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"events.endpoint=tcp://*:{pub}",
                             "--set", f"events.replay_endpoint=tcp://*:{rep}",
                             "--set", "events.topic=kv@{node}@{tenant}/{model}",
                             "--set", "events.node=n1"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    time.sleep(0.3)  # ZMQ's slow joiner.
    backup(d, tokens_seed=11)
    live, stored = [], []
    while len(stored) < PAGES:
        topic, seq, payload = sub.recv_multipart()
        live.append((topic, seq, payload))
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank is None
        for e in events:
            assert set(e) >= {"type"}
            if e["type"] == "BlockStored":
                # vLLM's BlockStored fields without defaults are all present.
                assert set(e) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                                  "lora_id", "medium", "lora_name"}
                # Self-describing: every page's tokens (the engine sent them, as the daemon
                # publishes events), and vLLM's integer block hashes.
                assert e["medium"] == "CPU" and e["block_size"] == 16
                assert len(e["token_ids"]) == 16 * len(e["block_hashes"])
                assert e["parent_block_hash"] == (stored[-1] if stored else None)
                stored += e["block_hashes"]
    assert live[0][0] == b"kv@n1@/events-model"
    first = int.from_bytes(live[0][1], "big")
    assert [int.from_bytes(s, "big") for _, s, _ in live] == list(range(first, first + len(live)))
    assert all(isinstance(k, int) and 0 <= k < 2**64 for k in stored)

    # Replay, as vLLM's subscribers ask for it: [start seq] from a REQ-like DEALER.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{rep}")
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while True:
        _, topic, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert topic == b"" and payload == b""
            break
        replayed.append((topic, seq, payload))
    # (What came after the last batch read can only be heartbeats: empty batches.)
    assert replayed[:len(live)] == live
    assert all(msgpack.unpackb(p, raw=False)[1] == [] for _, _, p in replayed[len(live):])
    sub.close(0)
    dealer.close(0)
    ctx.term()


def test_stored_events_carry_each_pages_tokens_and_vllms_integer_hashes(daemon_factory,
                                                                         tmp_path):
    """With events published, engines send each page's tokens with its Backup: every BlockStored
    (L2 and L3) carries them, and they are the tokens its key hashes (docs/keys.md: k_i =
    SHA-256(tokens as uint32 LE || k_(i-1))); the integer hashes are each key's last 8 bytes,
    big-endian, as vLLM converts its own. events.block_hashes=bytes sends the 32-byte keys."""
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"events.endpoint=tcp://*:{free_port()}",
                             "--set", f"storage.tiers=file:{tmp_path}/l3?name=nvme",
                             "--set", "storage.write_policy=write_through"))
    w = Watch(d)
    time.sleep(0.2)
    backup(d, tokens_seed=51)
    w.wait_pages(STORED, "CPU", PAGES)
    w.wait_pages(STORED, "STORAGE", PAGES)
    for medium in ("CPU", "STORAGE"):
        stored = [e for _, e in w.events() if e.kind == STORED and e.medium == medium]
        parent = None
        for e in stored:
            assert len(e.token_ids) == 16 * len(e.block_hashes)
            assert e.parent_block_hash == (parent or b"")
            assert e.parent_block_hash_int == (int.from_bytes(parent[-8:], "big") if parent else 0)
            for i, key in enumerate(e.block_hashes):
                page = e.token_ids[16 * i:16 * (i + 1)]
                if parent is not None:
                    digest = hashlib.sha256(struct.pack("<16I", *page) + parent).digest()
                    assert digest == key, f"page {i} of a {medium} event: tokens not its own"
                assert e.block_hash_ints[i] == int.from_bytes(key[-8:], "big")
                parent = key
    # The index keeps each page's tokens: counted in the index's memory.
    assert metric(d, "kvcellar_namespace_event_token_bytes") > PAGES * 16 * 4
    w.close()


# ---- llm-d's keys ---------------------------------------------------------------------------
# llm-d's KV-cache indexer (llm-d/llm-d-kv-cache v0.8.1, pkg/kvcache/kvblock/token_processor.go and
# pkg/kvevents/pool.go) does not index the engine's block hashes: it recomputes its own key of each
# block from the event's token_ids, chained: key = FNV-1a-64(CBOR([parent, tokens, extra])), the
# first parent hash(FNV-1a-64(hashSeed), null, model name) with the model name from the topic
# (kv@<pod>@<model>), and maps each engine hash to its key, so that a later event's
# parent_block_hash finds its parent (an event whose parent it cannot map is dropped) and a
# BlockRemoved its keys. Nothing of llm-d installs here (a Go service), so this is its key scheme,
# written from its documentation and source, checked against a vector from its own tests.

FNV_OFFSET, FNV_PRIME, U64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def fnv1a64(data):
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & U64
    return h


def cbor(x):
    """Canonical CBOR of what llm-d hashes: unsigned ints, null, text, arrays."""
    def head(major, n):
        if n < 24:
            return bytes([major << 5 | n])
        for info, fmt, limit in ((24, ">B", 1 << 8), (25, ">H", 1 << 16), (26, ">I", 1 << 32),
                                 (27, ">Q", 1 << 64)):
            if n < limit:
                return bytes([major << 5 | info]) + struct.pack(fmt, n)
        raise ValueError(n)
    if x is None:
        return b"\xf6"
    if isinstance(x, int):
        return head(0, x)
    if isinstance(x, str):
        return head(3, len(x.encode())) + x.encode()
    return head(4, len(x)) + b"".join(cbor(v) for v in x)


def llmd_keys(tokens, block_size, model, parent=None, hash_seed=""):
    """llm-d's keys of the full blocks of `tokens` after `parent` (None: the model's root)."""
    if parent is None:
        parent = fnv1a64(cbor([fnv1a64(hash_seed.encode()), None, model]))
    keys = []
    for i in range(len(tokens) // block_size):
        parent = fnv1a64(cbor([parent, list(tokens[i * block_size:(i + 1) * block_size]), None]))
        keys.append(parent)
    return keys


class LlmdIndex:
    """What llm-d's indexer keeps from a node's events: its own keys per pod and tier, and the
    engine hash -> key map it resolves parents and removals with."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.engine_to_key = {}
        self.keys = {}  # (pod, tier) -> set of llm-d keys
        self.dropped = 0

    def apply(self, topic, payload):
        _, pod, model = topic.decode().split("@", 2)
        for e in msgpack.unpackb(payload, raw=False)[1]:
            tier = e.get("medium", "GPU").lower()
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                if parent is not None and parent not in self.engine_to_key:
                    self.dropped += 1  # llm-d skips the event
                    continue
                keys = llmd_keys(e["token_ids"], self.block_size, model,
                                 None if parent is None else self.engine_to_key[parent])
                assert len(keys) == len(e["block_hashes"]), e  # equal block sizes: 1:1
                self.engine_to_key.update(zip(e["block_hashes"], keys))
                self.keys.setdefault((pod, tier), set()).update(keys)
            elif e["type"] == "BlockRemoved":
                self.keys.get((pod, tier), set()).difference_update(
                    self.engine_to_key[h] for h in e["block_hashes"])
            elif e["type"] == "AllBlocksCleared":
                for k in [k for k in self.keys if k[0] == pod]:
                    del self.keys[k]

    def score(self, pod, tier, tokens, model):
        """Leading blocks of a prompt the pod holds in the tier, as llm-d's scorer counts them."""
        have = self.keys.get((pod, tier), set())
        n = 0
        for k in llmd_keys(tokens, self.block_size, model):
            if k not in have:
                break
            n += 1
        return n


def test_llmd_keys_from_the_events_find_every_stored_page(daemon_factory):
    # llm-d's own vector (tests/e2e/uds_tokenizer/uds_e2e_test.go: blockSizeTokens 4, hashSeed "").
    assert llmd_keys([8197, 438, 322, 18926, 432, 45600, 49], 4,
                     "ibm-granite/granite-3.1-8b-instruct") == [1334984470577408192]
    pub = free_port()
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"events.endpoint=tcp://*:{pub}",
                             "--set", "events.node=pod-a"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's topicFilter
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    time.sleep(0.3)  # ZMQ's slow joiner.
    index = LlmdIndex(block_size=16)

    def drain(until):
        deadline = time.monotonic() + 10
        while not until():
            assert time.monotonic() < deadline, index.keys
            topic, _, payload = sub.recv_multipart()
            index.apply(topic, payload)

    def stored(tier="cpu"):
        return len(index.keys.get(("pod-a", tier), ()))

    backup(d, tokens_seed=61, pages=6)
    backup(d, tokens_seed=61, pages=8, instance="writer2")  # pages 6-7 after page 5
    backup(d, tokens_seed=62, pages=3)
    drain(lambda: stored() == 11)
    assert index.dropped == 0
    model = GEOMETRY["model"]
    # Every page of each prompt is found under llm-d's own keys, as Match finds it.
    for seed, pages in ((61, 8), (62, 3)):
        r = run_engine(d.socket, "load", instance="reader", verify_seed=1, tokens_seed=seed,
                       pages=pages, first_block=0, **GEOMETRY)
        assert r.rc == EXIT_OK and r["hits"] == pages, r.describe()
        assert index.score("pod-a", "cpu", engine_tokens(seed, pages * 16), model) == pages
    evict_l2(d)  # Every BlockRemoved resolves through the engine hash -> key map.
    drain(lambda: stored() == 0)
    assert index.score("pod-a", "cpu", engine_tokens(61, 8 * 16), model) == 0
    sub.close(0)
    ctx.term()


def test_warm_restart_reannounces_recovered_pages(daemon_factory):
    shm = f"kvc-evit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    args = (*DAEMON_ARGS, "--set", f"pool.shm_name={shm}",
            "--set", f"events.endpoint=ipc:///tmp/{shm}.events")

    def tokens(watch):
        by_page = {}
        for _, e in watch.events():
            if e.kind == STORED and e.medium == "CPU":
                for i, k in enumerate(e.block_hashes):
                    by_page[k] = list(e.token_ids[i * 16:(i + 1) * 16])
        return [t for k in sorted(by_page) for t in by_page[k]]

    try:
        d = daemon_factory(args=args, name="before", subdir="a")
        w = Watch(d)
        time.sleep(0.2)
        backup(d, tokens_seed=21)
        before = w.wait_pages(STORED, "CPU", PAGES)
        before_tokens = tokens(w)
        last_seq = w.batches[-1].seq
        w.close()
        d.stop()
        d2 = daemon_factory(args=args, name="after", subdir="b")
        d2.wait_for_line("l2 recovered")
        # The recovery happened before anyone could watch: the replay buffer has it.
        w2 = Watch(d2, replay=True, from_seq=0)
        after = w2.wait_pages(STORED, "CPU", PAGES)
        assert sorted(after) == sorted(before)
        # With their tokens, as first announced: the label log (/dev/shm/<shm>.labels) kept them.
        assert tokens(w2) == before_tokens and len(before_tokens) == PAGES * 16
        assert metric(d2, "kvcellar_label_log_restored_total") == PAGES
        assert w2.batches[0].events[0].kind == CLEARED
        # Numbered above the first daemon's batches: subscribers that drop numbers at or below
        # the last they applied (Dynamo's indexer) do not ignore the restarted node.
        assert w2.batches[0].seq > last_seq
        w2.close()
    finally:
        for path in (f"/dev/shm/{shm}", f"/dev/shm/{shm}.journal", f"/dev/shm/{shm}.labels",
                     f"/tmp/{shm}.events"):
            if os.path.exists(path):
                os.unlink(path)


def test_an_overfull_queue_drops_events_visibly_and_never_stalls_backups(daemon_factory):
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", "events.max_queue_size=4",
                             "--set", "events.batch_interval_ms=1000"))
    w = Watch(d)
    time.sleep(0.2)
    backup(d, tokens_seed=30, pages=1)  # The namespace's first batch (2 events), before the loss.
    wait_until(lambda: w.batches, timeout=5, what="the first batch")
    backup(d, tokens_seed=31, pages=32)  # 32 events inside one interval (or two); 4 fit.
    wait_until(lambda: metric(d, "kvcellar_events_dropped_total") > 0, timeout=10,
               what="events dropped")
    assert metric(d, "kvcellar_events_dropped_total") >= 32 - 2 * 4
    # The batch after the loss comes one sequence number late (those events are in no batch) and
    # ends with AllBlocksCleared: subscribers start this namespace afresh.
    after = wait_until(lambda: [b for i, b in enumerate(w.batches)
                                if i and b.seq != w.batches[i - 1].seq + 1],
                       timeout=5, what="the batch after the gap")
    assert after[0].seq == w.batches[w.batches.index(after[0]) - 1].seq + 2
    assert after[0].events[-1].kind == CLEARED
    # Later events flow again.
    stored = len(w.pages(STORED, "CPU"))
    backup(d, tokens_seed=33, pages=2)
    wait_until(lambda: len(w.pages(STORED, "CPU")) >= stored + 2, timeout=10, what="new events")
    w.close()


def test_a_stream_that_never_reads_does_not_slow_the_daemon(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    stalled = admin(d).WatchEvents(admin_service_pb2.WatchEventsRequest())  # Never read.
    for seed in range(40):
        backup(d, tokens_seed=100 + seed, pages=8)
    assert metric(d, "kvcellar_events_watchers") == 1
    stalled.cancel()
    wait_until(lambda: metric(d, "kvcellar_events_watchers") == 0, timeout=10,
               what="the cancelled stream to go")


def test_kvcellarctl_events_prints_each_event(daemon_factory):
    d = daemon_factory(args=(*DAEMON_ARGS, "--set", "events.endpoint=tcp://*:" + str(free_port())))
    backup(d, tokens_seed=41)
    # AllBlocksCleared and the 6 pages stored, in one batch or more.
    wait_until(lambda: metric(d, "kvcellar_events_total") >= 1 + PAGES, timeout=10,
               what="the events of one backup")
    batches = int(metric(d, "kvcellar_events_batches_total"))
    out = subprocess.run([os.path.join(BIN_DIR, "kvcellarctl"), "--addr", d.admin_socket,
                          "events", "--from-seq", "0", "--count", str(batches)],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.match(r"seq \d+  kv@", lines[0]) and lines[0].endswith("AllBlocksCleared"), lines
    stored = [line for line in lines[1:] if "  BlockStored  CPU  " in line]
    assert sum(int(line.split("  ")[4].split()[0]) for line in stored) == PAGES, lines
    assert stored[0].endswith("parent none"), lines


def test_an_endpoint_in_use_stops_the_daemon_naming_the_key(daemon_factory):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = daemon_factory(args=(*DAEMON_ARGS, "--set", f"events.endpoint=tcp://*:{port}"),
                           wait=False)
        assert d.proc.wait(timeout=30) != 0
        log = "\n".join(d.lines)
        assert "events.endpoint" in log and str(port) in log, log


def test_file_tier_capacity_evictions_are_announced_and_leave_the_index(daemon_factory, tmp_path):
    """A file tier over its capacity evicts its coldest objects: each is announced removed on the
    tier's medium and leaves the index, so a Match after L2 eviction names as L3 hits exactly the
    pages the tier still holds, and the prefetch reads no missing object."""
    # 16 KiB objects, each a 20 KiB file (a 4 KiB header block): the tier holds 5.
    d = daemon_factory(args=(*DAEMON_ARGS,
                             "--set", f"storage.tiers=file:{tmp_path}/l3?name=nvme&capacity=100KiB",
                             "--set", "storage.write_policy=write_through"))
    w = Watch(d)
    time.sleep(0.2)
    backup(d, tokens_seed=11, pages=4)
    first = w.wait_pages(STORED, "STORAGE", 4)
    backup(d, tokens_seed=12, pages=4, instance="writer2")  # 8 objects: 3 of the first go
    stored = w.wait_pages(STORED, "STORAGE", 8)
    wait_until(lambda: metric(d, "kvcellar_l3_evicted_objects_total") >= 3, timeout=10,
               what="3 capacity evictions")
    assert metric(d, "kvcellar_l3_evicted_objects_total") == 3
    removed = w.wait_pages(REMOVED, "STORAGE", 3)
    assert len(removed) == 3 and set(removed) <= set(first), (removed, stored)
    evict_l2(d)
    r = run_engine(d.socket, "load", instance="reader", verify_seed=1, tokens_seed=11, pages=4,
                   first_block=0, prefetch="wait_complete", pin=True, **GEOMETRY)
    assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
    # The leading pages the tier still holds (none when its first page went), all read back; the
    # chain's order is the order its pages were stored in L2 (one Backup commits them in order).
    # Which 3 go depends on the order the tier's writes completed in: either way the prefetch
    # brings exactly the pages Match named.
    chain = w.pages(STORED, "CPU")[:4]
    assert set(chain) == set(first)
    held = next((i for i, k in enumerate(chain) if k in removed), len(chain))
    assert r["l3_hits"] == held, r.describe()
    assert r["prefetch_final"].get("MISS", 0) == 0 and r["hits"] == held, r.describe()
    w.close()


def test_redis_expiry_and_eviction_are_announced_and_leave_the_index(daemon_factory, tmp_path):
    """Objects the Redis server removes by itself while the daemon runs (a TTL ran out, maxmemory
    evicted them) reach the index through keyspace notifications (storage/redis_watch.h): each
    is announced removed on the tier's medium, and a Match after L2 eviction names none of them,
    so the prefetch asks Redis for no missing object."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        d = daemon_factory(args=(*DAEMON_ARGS,
                                 "--set", f"storage.tiers=redis:{redis.address}?name=redis",
                                 "--set", "storage.write_policy=write_through"))
        w = Watch(d)
        time.sleep(0.2)
        backup(d, tokens_seed=13, pages=4)
        stored = w.wait_pages(STORED, "STORAGE", 4)
        wait_until(lambda: redis.object_count() == 4, what="4 objects in Redis")
        stored_event = next(e for _, e in w.events() if e.kind == STORED and e.medium == "STORAGE")
        assert stored_event.locality == "REMOTE"  # A Redis tier is shared by the nodes.
        # The daemon turned on the notifications it needs (a stock server publishes none).
        flags = redis.cli("CONFIG", "GET", "notify-keyspace-events").split("\n")[1]
        assert {"E", "x", "e"} <= set(flags), flags

        # Two objects expire.
        objects = sorted(k for k in redis.keys() if ":idx" not in k)
        for key in objects[:2]:
            assert redis.cli("PEXPIRE", key, "1").strip() == "1"
        removed = w.wait_pages(REMOVED, "STORAGE", 2)
        assert {k.hex() for k in removed} == {key.split(":")[-2] for key in objects[:2]}
        # The rest is evicted: a maxmemory the server cannot meet empties it at the next write.
        redis.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-random")
        redis.cli("CONFIG", "SET", "maxmemory", "1")
        redis.cli("SET", "unrelated", "x", check=False)  # OOM, after evicting every key
        redis.cli("CONFIG", "SET", "maxmemory", "0")
        removed = w.wait_pages(REMOVED, "STORAGE", 4)
        assert sorted(removed) == sorted(stored)
        removed_event = next(e for _, e in w.events() if e.kind == REMOVED and
                             e.medium == "STORAGE")
        assert removed_event.locality == "REMOTE"
        assert metric(d, "kvcellar_l3_server_removed_objects_total", tier="redis") == 4

        # Out of L2 too: Match finds nothing in L3 and no read goes to Redis for a missing object.
        evict_l2(d)
        r = run_engine(d.socket, "load", instance="reader", verify_seed=1, tokens_seed=13,
                       pages=4, first_block=0, prefetch="wait_complete", pin=True, **GEOMETRY)
        assert r.rc == EXIT_OK and r["hits"] == 0 and r["l3_hits"] == 0, r.describe()
        assert metric(d, "kvcellar_l3_objects_total", tier="redis", op="get") == 0
        w.close()
    finally:
        redis.stop()
