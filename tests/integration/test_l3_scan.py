"""A file tier that knows what it holds after a restart (issue 15): engines back up pages with
known bytes through a daemon that writes them through to a file tier, the daemon is SIGKILLed and
started again with the same configuration (L2 empty), and a Match without any l3_lookup_timeout_ms
finds the pages as L3 hits, because the tier's startup scan read each object's header (its parent
key) and put the pages back in the index, prefix-closed. Objects torn on purpose (a truncated
file, a damaged header) are dropped and counted and never served; what hangs under them is
orphaned. Objects of format version 1 (no parent link) are still read through lookups.

Object headers are parsed here from the documented layout (storage/object_format.h), which also
checks that layout from outside the daemon. Engines are kvcellar-engine-sim processes; every
loaded byte is verified.

Runs under Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import os
import signal
import struct
import subprocess

import pytest

from engine_sim import DAEMON_ARGS, EXIT_OK, metric, run_engine, status, wait_until
from redis_util import RedisCluster, RedisServer

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="scan-model")
PAGE_BYTES = 2 * 2 * 4096
PAGES = 24           # Per sequence.
TOKEN_SEEDS = (7, 8, 9)
SEED = 31            # Payload bytes.

HEADER_V2 = 160
HEADER_V1 = 128
FLAG_PARENT_KEY, FLAG_FIRST_PAGE = 1, 2


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli), bitwise: headers are 156 bytes."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def read_header(path):
    with open(path, "rb") as f:
        h = f.read(HEADER_V2)
    assert h[:8] == b"KVCELLAR", path
    version, size, flags = struct.unpack_from("<HHI", h, 8)
    assert (version, size) == (2, HEADER_V2), (path, version, size)
    assert struct.unpack_from("<I", h, 156)[0] == crc32c(h[:156]), path
    key = h[48:80]
    parent = h[104:136] if flags & FLAG_PARENT_KEY else None
    assert flags in (FLAG_PARENT_KEY, FLAG_FIRST_PAGE), (path, flags)
    return key, parent


def object_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp-" not in f]


def chains(root):
    """The sequences stored under root, each as its object paths from the first page on, read
    from the headers' parent links."""
    by_key, children, roots = {}, {}, []
    for path in object_files(root):
        key, parent = read_header(path)
        by_key[key] = path
        if parent is None:
            roots.append(key)
        else:
            children.setdefault(parent, []).append(key)
    out = []
    for root_key in roots:
        chain, key = [by_key[root_key]], root_key
        while key in children:
            assert len(children[key]) == 1  # Distinct token seeds share no page.
            key = children[key][0]
            chain.append(by_key[key])
        out.append(chain)
    return out


def scan_daemon(daemon_factory, tiers, name, subdir):
    args = (*DAEMON_ARGS, "--set", f"storage.tiers={tiers}",
            "--set", "storage.write_policy=write_through")
    return daemon_factory(args=args, name=name, subdir=subdir)


def backup_all(d):
    for ts in TOKEN_SEEDS:
        r = run_engine(d.socket, "backup", instance=f"writer-{ts}", seed=SEED, tokens_seed=ts,
                       pages=PAGES, **GEOMETRY)
        assert r.rc == EXIT_OK and r["stored"] == PAGES, r.describe()
    total = PAGES * len(TOKEN_SEEDS)
    wait_until(lambda: metric(d, "kvcellar_l3_writes_total", result="ok") >= total, timeout=30,
               what=f"{total} L3 writes")


def load_no_lookup(d, ts, instance):
    """Match without l3_lookup_ms, prefetch what L3 holds, load it and verify every byte."""
    r = run_engine(d.socket, "load", instance=instance, verify_seed=SEED, tokens_seed=ts,
                   pages=PAGES, first_block=0, prefetch="wait_complete", pin=True, **GEOMETRY)
    assert r.rc == EXIT_OK, r.describe()
    assert r["mismatched_bytes"] == 0 and r["match_error"] == "", r.describe()
    assert r["first_hits"] == 0, r.describe()  # L2 is empty after the restart.
    assert r["hits"] == r["l3_hits"] == r["loaded"], r.describe()
    assert r["verified_bytes"] == r["loaded"] * PAGE_BYTES, r.describe()
    return r["l3_hits"]


def scan_metric(d, name, **labels):
    return metric(d, name, tier="nvme", **labels)


def wait_scanned(d):
    wait_until(lambda: scan_metric(d, "kvcellar_l3_index_complete") == 1, timeout=30,
               what="the startup scan")


def backed_up_then_killed(daemon_factory, tiers):
    """Every test sequence backed up to `tiers` through a daemon that is then SIGKILLed."""
    d = scan_daemon(daemon_factory, tiers, "before", "v1")
    backup_all(d)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()


def test_sigkilled_daemon_finds_its_file_tier_without_lookups(daemon_factory, tmp_path):
    l3 = tmp_path / "l3"
    tiers = f"file:{l3}?name=nvme"
    backed_up_then_killed(daemon_factory, tiers)

    seqs = chains(l3)
    assert sorted(len(c) for c in seqs) == [PAGES] * len(TOKEN_SEEDS)
    # Damage two sequences as a crash or a bad disk would: tear page 10 of one (half its file
    # gone), damage the first page's header of another. A dead writer's temp file is left too.
    torn, bad_header, whole = seqs
    with open(torn[10], "r+b") as f:
        f.truncate(os.path.getsize(torn[10]) // 2)
    with open(bad_header[0], "r+b") as f:
        f.seek(60)  # Inside the page key: only the header CRC can tell.
        b = f.read(1)
        f.seek(60)
        f.write(bytes([b[0] ^ 0x40]))
    temp = whole[0] + ".tmp-otherhost-4242-1"
    with open(temp, "wb") as f:
        f.write(b"half a write")
    os.utime(temp, (1, 1))  # Older than storage's stale_temp_age: its writer is gone.

    d2 = scan_daemon(daemon_factory, tiers, "after", "v2")
    wait_scanned(d2)
    total = PAGES * len(TOKEN_SEEDS)
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="found") == total - 2
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="dropped") == 2
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="temps_removed") == 1
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="legacy") == 0
    assert scan_metric(d2, "kvcellar_l3_scan_bytes") == (total - 2) * PAGE_BYTES
    assert not os.path.exists(torn[10]) and not os.path.exists(bad_header[0])
    assert not os.path.exists(temp)
    # Nothing is placed before a worker of the namespace registers: the objects wait.
    assert scan_metric(d2, "kvcellar_l3_scan_pending_objects") == total - 2

    hits = sorted(load_no_lookup(d2, ts, f"reader-{ts}") for ts in TOKEN_SEEDS)
    # The whole sequence; the torn one up to its tear; nothing of the one whose root is gone.
    assert hits == [0, 10, PAGES]
    assert scan_metric(d2, "kvcellar_l3_scan_pending_objects") == 0
    assert scan_metric(d2, "kvcellar_l3_scan_pages_total", result="inserted") == PAGES + 10
    assert scan_metric(d2, "kvcellar_l3_scan_pages_total", result="orphaned") == \
        (PAGES - 11) + (PAGES - 1)
    assert scan_metric(d2, "kvcellar_l3_corrupt_removed_total") == 0  # None reached a read.
    # GetStatus says as much as the metrics.
    (tier,) = status(d2).l3_tiers
    r = tier.recovery
    assert (r.source, r.done, r.partial) == ("file_scan", True, False), tier
    assert (r.objects_found, r.objects_dropped, r.pages_inserted, r.objects_pending) == \
        (total - 2, 2, PAGES + 10, 0), tier
    assert r.bytes == (total - 2) * PAGE_BYTES and r.seconds > 0, tier
    assert metric(d2, "kvcellar_moved_bytes_total", direction="l3_to_l2") == \
        (PAGES + 10) * PAGE_BYTES


def rewrite_as_v1(path):
    """Rewrites a version 2 object as a version 1 daemon wrote it: a 128-byte header without the
    parent link (the same fields up to byte 104), in the same 4 KiB header block."""
    with open(path, "r+b") as f:
        h = bytearray(f.read(HEADER_V2))
        v1 = bytearray(h[:104]) + bytes(24)
        struct.pack_into("<HHI", v1, 8, 1, HEADER_V1, 0)
        struct.pack_into("<I", v1, 124, crc32c(bytes(v1[:124])))
        f.seek(0)
        f.write(bytes(v1) + bytes(HEADER_V2 - HEADER_V1))


def test_version_1_objects_are_not_placed_but_still_read(daemon_factory, tmp_path):
    l3 = tmp_path / "l3"
    tiers = f"file:{l3}?name=nvme"
    backed_up_then_killed(daemon_factory, tiers)
    old = chains(l3)[0]
    for path in old[5:]:
        rewrite_as_v1(path)

    d2 = scan_daemon(daemon_factory, tiers, "after", "v2")
    wait_scanned(d2)
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="legacy") == PAGES - 5
    assert scan_metric(d2, "kvcellar_l3_scan_objects_total", result="dropped") == 0
    hits = sorted(load_no_lookup(d2, ts, f"reader-{ts}") for ts in TOKEN_SEEDS)
    assert hits == [5, PAGES, PAGES]
    assert scan_metric(d2, "kvcellar_l3_scan_pages_total", result="legacy") == PAGES - 5
    # A lookup at Match time still finds and reads the version 1 objects, byte-exact.
    found = 0
    for ts in TOKEN_SEEDS:
        r = run_engine(d2.socket, "load", instance=f"lookup-{ts}", verify_seed=SEED,
                       tokens_seed=ts, pages=PAGES, first_block=0, l3_lookup_ms=2000,
                       prefetch="wait_complete", pin=True, **GEOMETRY)
        assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
        found += r["hits"]
    assert found == PAGES * len(TOKEN_SEEDS)


# ---- Redis: the tier's index read back (storage/redis_index.h) ---------------------------------

@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path / "cluster").start()
    yield c
    c.stop()


def sigkill_and_read_back(daemon_factory, tiers, store):
    """Backs pages up through one daemon, SIGKILLs it, adds a malformed index entry, and starts a
    second one whose readback must put every page back: found without lookups, loaded exactly."""
    backed_up_then_killed(daemon_factory, tiers)
    total = PAGES * len(TOKEN_SEEDS)
    assert store.object_count() == total
    # Another writer's entry this build cannot read: dropped and counted, nothing else changes.
    node = store.nodes[0] if hasattr(store, "nodes") else store
    index_key = next(k for k in node.keys("*:idx*"))
    node.cli("HSET", index_key, "not-a-field", "not-an-entry")

    d2 = scan_daemon(daemon_factory, tiers, "after", "v2")
    wait_until(lambda: metric(d2, "kvcellar_l3_scan_complete", tier="redis") == 1, timeout=30,
               what="the index readback")
    m = lambda name, **kw: metric(d2, name, tier="redis", **kw)  # noqa: E731
    assert m("kvcellar_l3_scan_objects_total", result="found") == total
    assert m("kvcellar_l3_scan_objects_total", result="dropped") == 1
    assert m("kvcellar_l3_scan_partial") == 0
    assert m("kvcellar_l3_scan_bytes") == total * PAGE_BYTES
    assert m("kvcellar_l3_scan_pending_objects") == total
    (tier,) = status(d2).l3_tiers
    assert tier.recovery.source == "redis_index" and tier.recovery.done, tier
    assert (tier.recovery.objects_found, tier.recovery.objects_dropped,
            tier.recovery.objects_pending) == (total, 1, total), tier

    hits = [load_no_lookup(d2, ts, f"reader-{ts}") for ts in TOKEN_SEEDS]
    assert hits == [PAGES] * len(TOKEN_SEEDS)
    assert m("kvcellar_l3_scan_pages_total", result="inserted") == total
    assert m("kvcellar_l3_scan_pages_total", result="orphaned") == 0
    assert m("kvcellar_l3_scan_pending_objects") == 0
    (tier,) = status(d2).l3_tiers
    assert (tier.recovery.pages_inserted, tier.recovery.objects_pending) == (total, 0), tier
    return d2


def ctl(d, *args):
    from conftest import KVCELLARCTL
    p = subprocess.run([KVCELLARCTL, "--addr", d.admin_socket, *args], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_sigkilled_daemon_reads_its_redis_index_back_without_lookups(daemon_factory, redis):
    d2 = sigkill_and_read_back(daemon_factory, f"redis:{redis.address}?name=redis", redis)
    out = ctl(d2, "status")
    assert "recovery=redis_index done" in out and f"found={PAGES * len(TOKEN_SEEDS)}" in out, out


def test_sigkilled_daemon_reads_a_redis_cluster_index_back_from_every_node(daemon_factory,
                                                                            cluster):
    sigkill_and_read_back(daemon_factory,
                          f"redis-cluster:{cluster.seeds()}?name=redis&timeout_ms=1000", cluster)
    # The entries live in their objects' slots: every node holds some.
    assert all(n.keys("*:idx*") for n in cluster.nodes)
