"""L3 tiers through real daemons: a file tier shared by two daemons, Redis standalone and a real
3-node Redis Cluster shared by two daemons, failures (disk full, Redis stopped or paused) seen by
engines as misses, every write and prefetch policy, and a daemon killed with SIGKILL under heavy
writes. Engines are kvcellar-engine-sim processes; every loaded byte is verified.

Runs under Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import os
import signal
import subprocess
import time

import pytest

from engine_sim import (DAEMON_ARGS, EXIT_MISMATCH, EXIT_OK, EngineProcess, metric, run_engine,
                        status, wait_until)
from redis_util import RedisCluster, RedisServer

# 2 layers x (K + V) x 4 KiB = 16 KiB page objects: O_DIRECT-sized, small enough to be quick.
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="l3-model")
PAGE_BYTES = 2 * 2 * 4096


def l3_daemon(daemon_factory, tiers, *extra, name="kvcellard", subdir=None):
    args = (*DAEMON_ARGS, "--set", f"storage.tiers={tiers}", *extra)
    return daemon_factory(args=args, name=name, subdir=subdir)


def backup(d, seed, tokens_seed, pages, **flags):
    r = run_engine(d.socket, "backup", instance=f"writer-{tokens_seed}", seed=seed,
                   tokens_seed=tokens_seed, pages=pages, **GEOMETRY, **flags)
    assert r.rc == EXIT_OK, r.describe()
    assert r["stored"] == pages
    return r


def load(d, verify_seed, tokens_seed, pages, instance="reader", **flags):
    flags.setdefault("first_block", 0)
    r = run_engine(d.socket, "load", instance=instance, verify_seed=verify_seed,
                   tokens_seed=tokens_seed, pages=pages, **GEOMETRY, **flags)
    assert r.rc in (EXIT_OK,), r.describe()
    assert r["mismatched_bytes"] == 0, r.describe()
    assert r["match_error"] == "", r.describe()
    return r


def l3_written(d, tier=None, result="ok"):
    labels = {"result": result}
    if tier:
        labels["tier"] = tier
    return metric(d, "kvcellar_l3_writes_total", **labels)


def wait_written(d, n, tier=None):
    wait_until(lambda: l3_written(d, tier) >= n, timeout=20, what=f"{n} L3 writes")


# ---- Shared file tier ---------------------------------------------------------------------------

def test_two_daemons_share_a_file_tier(daemon_factory, tmp_path):
    shared = tmp_path / "shared-l3"
    tiers = f"file:{shared}?name=shared&shared=true"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    backup(a, seed=21, tokens_seed=5, pages=12)
    wait_written(a, 12, tier="shared")

    # B's index has never heard of these pages: the lookup asks the file tier.
    r = load(b, verify_seed=21, tokens_seed=5, pages=12, l3_lookup_ms=2000,
             prefetch="wait_complete", pin=True)
    assert r["first_hits"] == 0 and r["l3_hits"] == 12, r.describe()
    assert r["prefetch_pages"] == 12 and r["prefetch_state"] == "DONE", r.describe()
    assert r["prefetch_final"].get("OK") == 12, r.describe()
    assert r["hits"] == 12 and r["loaded"] == 12
    assert r["verified_bytes"] == 12 * PAGE_BYTES

    # The check is real: other bytes expected, other bytes found.
    wrong = run_engine(b.socket, "load", instance="wrong", verify_seed=22, tokens_seed=5, pages=12,
                       **GEOMETRY)
    assert wrong.rc == EXIT_MISMATCH, wrong.describe()
    assert metric(b, "kvcellar_moved_bytes_total", direction="l3_to_l2") == 12 * PAGE_BYTES
    assert metric(b, "kvcellar_match_l3_tier_pages_total", tier="shared") >= 12
    assert metric(b, "kvcellar_prefetch_pages_total", policy="wait_complete", status="ok") == 12


def test_registration_reports_tiers_and_default_policies(daemon_factory, tmp_path):
    d = l3_daemon(daemon_factory, f"file:{tmp_path}/l3?name=nvme",
                  "--set", "storage.write_policy=write_back",
                  "--set", "storage.prefetch_policy=timeout")
    r = backup(d, seed=1, tokens_seed=1, pages=1)
    assert r["session"]["l3_tier_names"] == "nvme"
    assert r["session"]["default_write_policy"] == "WRITE_BACK"
    assert r["session"]["default_prefetch_policy"] == "TIMEOUT"


def test_bad_tier_spec_is_a_clear_startup_error(tmp_path):
    from conftest import KVCELLARD
    p = subprocess.run([KVCELLARD, "--check-config", "--set",
                        "storage.tiers=file:/x?capacity=lots"], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode != 0
    assert "storage.tiers" in p.stderr and "capacity" in p.stderr, p.stderr
    p = subprocess.run([KVCELLARD, "--check-config", "--set", "storage.tiers=s3:bucket"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "unknown kind 's3'" in p.stderr, p.stderr


# ---- Redis --------------------------------------------------------------------------------------

@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def test_redis_pages_written_through_one_daemon_are_found_through_another(daemon_factory, redis):
    tiers = f"redis:{redis.address}?name=redis&prefix=it:"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    backup(a, seed=31, tokens_seed=6, pages=10)
    wait_written(a, 10, tier="redis")
    assert redis.object_count() == 10
    assert redis.dbsize() == 11  # And the namespace's index hash.
    r = load(b, verify_seed=31, tokens_seed=6, pages=10, l3_lookup_ms=2000,
             prefetch="best_effort")
    assert r["l3_hits"] == 10 and r["prefetch_final"].get("OK") == 10, r.describe()
    assert r["hits"] == 10 and r["loaded"] == 10


def test_redis_stopped_mid_run_is_a_miss_and_counted(daemon_factory, redis):
    tiers = f"redis:{redis.address}?name=redis&timeout_ms=500"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    backup(a, seed=41, tokens_seed=7, pages=6)
    wait_written(a, 6)
    (tier,) = status(a).l3_tiers  # GetStatus reports the tier as the metrics do
    assert (tier.name, tier.kind, tier.healthy, tier.last_error) == ("redis", "redis", True, "")
    assert tier.used_bytes == 0 and tier.capacity_bytes == 0  # Redis keeps no daemon-side count
    before_ms = int(time.time() * 1000)
    redis.stop()

    # Reads: a miss, no RPC error, the engine goes on.
    r = load(b, verify_seed=41, tokens_seed=7, pages=6, l3_lookup_ms=1000,
             prefetch="wait_complete")
    assert r["l3_hits"] == 0 and r["hits"] == 0, r.describe()
    # Writes: dropped and counted.
    backup(a, seed=42, tokens_seed=8, pages=4)
    wait_until(lambda: l3_written(a, result="failed") >= 4, timeout=20, what="failed writes")
    assert metric(a, "kvcellar_l3_objects_total", tier="redis", op="put", status="retry") >= 4
    assert metric(a, "kvcellar_rpc_requests_total", code="OK") > 0
    (tier,) = status(a).l3_tiers
    assert not tier.healthy, tier
    assert tier.last_error == "put: retry" and tier.last_error_unix_ms >= before_ms, tier


def test_prefetch_policies_against_a_paused_redis(daemon_factory, redis):
    tiers = f"redis:{redis.address}?name=redis&timeout_ms=800"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    backup(a, seed=51, tokens_seed=9, pages=8)
    wait_written(a, 8)
    # B learns where the pages are (lookup only, no prefetch).
    r = load(b, verify_seed=51, tokens_seed=9, pages=8, l3_lookup_ms=2000, prefetch="none")
    assert r["l3_hits"] == 8 and r["prefetch_state"] == "NONE" and r["hits"] == 0

    redis.pause()  # Reads hang until the backend's 800 ms timeout.
    try:
        # timeout: the op is DONE at the deadline with every page TIMEOUT; the engine never
        # waits past it.
        t0 = time.monotonic()
        r = load(b, verify_seed=51, tokens_seed=9, pages=8, prefetch="timeout",
                 prefetch_timeout_ms=100, instance="t1")
        assert time.monotonic() - t0 < 0.8 + 1.5, "the engine waited past the prefetch deadline"
        assert r["prefetch_state"] == "DONE" and r["prefetch_final"].get("TIMEOUT") == 8, r.describe()
        assert r["hits"] == 0
        # wait_complete: the op ends when the reads do: L3_ERROR after the backend timeout.
        time.sleep(1.0)  # Let the timed-out reads end (their slots are freed, not committed).
        r = load(b, verify_seed=51, tokens_seed=9, pages=8, prefetch="wait_complete",
                 instance="t2")
        assert r["prefetch_state"] == "DONE" and r["prefetch_final"].get("L3_ERROR") == 8, r.describe()
        assert r["hits"] == 0
    finally:
        redis.resume()
    time.sleep(0.2)
    r = load(b, verify_seed=51, tokens_seed=9, pages=8, prefetch="best_effort", instance="t3")
    assert r["prefetch_final"].get("OK") == 8 and r["hits"] == 8, r.describe()
    assert metric(b, "kvcellar_prefetch_pages_total", policy="timeout", status="timeout") == 8
    assert metric(b, "kvcellar_prefetch_pages_total", policy="wait_complete",
                  status="l3_error") == 8


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path / "cluster").start()
    yield c
    c.stop()


def test_redis_cluster_shared_by_two_daemons_survives_moved_slots_and_a_node_restart(
        daemon_factory, cluster):
    tiers = f"redis-cluster:{cluster.seeds()}?name=cluster&timeout_ms=1000"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    backup(a, seed=61, tokens_seed=10, pages=24)
    wait_written(a, 24, tier="cluster")
    assert cluster.object_count() == 24
    assert all(n.object_count() > 0 for n in cluster.nodes), "24 keys should spread over 3 nodes"
    r = load(b, verify_seed=61, tokens_seed=10, pages=24, l3_lookup_ms=3000,
             prefetch="wait_complete")
    assert r["l3_hits"] == 24 and r["hits"] == 24 and r["loaded"] == 24, r.describe()

    # Node 0's slots move to node 1 without their keys: clients asking node 0 get MOVED, and the
    # keys that lived there are gone (misses, never errors).
    cluster.move_slots(0, RedisCluster.first_slot(1) - 1, to=1)
    r = load(b, verify_seed=61, tokens_seed=11, pages=4, l3_lookup_ms=2000, instance="other")
    assert r["hits"] == 0
    backup(a, seed=62, tokens_seed=12, pages=16)
    wait_written(a, 24 + 16, tier="cluster")
    c = l3_daemon(daemon_factory, tiers, name="c", subdir="c")
    r = load(c, verify_seed=62, tokens_seed=12, pages=16, l3_lookup_ms=3000,
             prefetch="wait_complete", instance="c-reader")
    assert r["l3_hits"] == 16 and r["hits"] == 16, r.describe()
    assert metric(a, "kvcellar_l3_redirects_total") + metric(c, "kvcellar_l3_redirects_total") > 0

    # A node restarts empty (no persistence): its keys miss, the rest still load, nothing fails.
    cluster.nodes[2].stop(signal.SIGKILL)
    cluster.nodes[2].start()
    cluster.wait_ok()
    # A pooled connection the restart broke reconnects and runs its pipeline again (storage test
    # RedisBackendTest.RestartWhileIdleLosesNoOp); a write that still fails (the node not yet
    # serving, a reconnect refused) is dropped and counted, and the next batch reconnects.
    backup(a, seed=63, tokens_seed=13, pages=8)
    wait_until(lambda: l3_written(a, "cluster") + l3_written(a, "cluster", "failed") >= 48,
               timeout=20, what="writes after the restart to end")
    time.sleep(0.3)
    ok_before = l3_written(a, "cluster")
    backup(a, seed=64, tokens_seed=14, pages=8)
    wait_written(a, ok_before + 8, tier="cluster")
    d = l3_daemon(daemon_factory, tiers, name="d", subdir="d")
    r = load(d, verify_seed=64, tokens_seed=14, pages=8, l3_lookup_ms=3000,
             prefetch="wait_complete", instance="d-reader")
    assert r["hits"] == 8, r.describe()
    # Of the pages written while node 2 was being restarted, what loads is byte-exact.
    load(d, verify_seed=63, tokens_seed=13, pages=8, l3_lookup_ms=3000, prefetch="wait_complete",
         instance="d-reader2")


# ---- Write policies and admission ---------------------------------------------------------------

def test_write_through_selective_writes_after_n_hits(daemon_factory, tmp_path):
    d = l3_daemon(daemon_factory, f"file:{tmp_path}/l3?name=nvme",
                  "--set", "storage.write_policy=write_through_selective",
                  "--set", "storage.selective_hits=2")
    backup(d, seed=71, tokens_seed=14, pages=5)
    time.sleep(0.3)
    assert l3_written(d) == 0
    load(d, verify_seed=71, tokens_seed=14, pages=5, instance="r1")
    time.sleep(0.3)
    assert l3_written(d) == 0, "one hit is below selective_hits"
    load(d, verify_seed=71, tokens_seed=14, pages=5, instance="r2")
    wait_written(d, 5)
    # The policy of one Backup may differ from the default.
    backup(d, seed=72, tokens_seed=15, pages=3, write_policy="write_through")
    wait_written(d, 8)
    backup(d, seed=73, tokens_seed=16, pages=3, write_policy="l2_only")
    load(d, verify_seed=73, tokens_seed=16, pages=3, instance="r3")
    load(d, verify_seed=73, tokens_seed=16, pages=3, instance="r4")
    time.sleep(0.3)
    assert l3_written(d) == 8


def test_admission_filter_holds_pages_back_until_reused(daemon_factory, tmp_path):
    d = l3_daemon(daemon_factory, f"file:{tmp_path}/l3?name=nvme&admit_after=1")
    backup(d, seed=81, tokens_seed=17, pages=4)
    time.sleep(0.3)
    assert l3_written(d) == 0, "admit_after=1: no write before the first reuse"
    load(d, verify_seed=81, tokens_seed=17, pages=4)
    wait_written(d, 4)


SMALL_POOL = ("--set", "pool.region_size=2MiB", "--set", "pool.capacity=64MiB")
# 2 layers x 2 x 256 KiB = 1 MiB objects: about 60 fit in the 64 MiB pool.
BIG = dict(layers=2, block_bytes=262144, blocks=50, page_size=16, model="l3-big")
BIG_PAGE = 2 * 2 * 262144


def test_write_back_writes_pages_when_l2_evicts_them(daemon_factory, tmp_path):
    # 64 one-MiB slots; above 90 % full the housekeeper evicts down to 80 %.
    d = l3_daemon(daemon_factory, f"file:{tmp_path}/l3?name=nvme",
                  "--set", "storage.write_policy=write_back", *SMALL_POOL,
                  "--set", "pool.high_watermark=0.9", "--set", "pool.low_watermark=0.8")
    r = run_engine(d.socket, "backup", instance="w1", seed=91, tokens_seed=18, pages=40, **BIG)
    assert r.rc == EXIT_OK and r["stored"] == 40, r.describe()
    time.sleep(0.3)
    assert l3_written(d) == 0, "write_back writes nothing while the pages stay in L2"
    # 22 more pages pass the high watermark: L2 evicts, and each evicted page goes to L3.
    r = run_engine(d.socket, "backup", instance="w2", seed=92, tokens_seed=19, pages=22, **BIG)
    assert r.rc == EXIT_OK and r["stored"] == 22, r.describe()
    wait_until(lambda: metric(d, "kvcellar_evicted_pages_total") >= 5, timeout=20,
               what="watermark eviction")
    evicted = metric(d, "kvcellar_evicted_pages_total")
    wait_until(lambda: l3_written(d) >= evicted, timeout=20, what="a write per evicted page")
    # Both prompts come back in full, from L2 where they stayed and from L3 where they were
    # evicted, byte-exact.
    l3_hits = 0
    for seed, tokens_seed, pages in ((91, 18, 40), (92, 19, 22)):
        # Pinned: the housekeeper, above its watermark again once the pages land, must not
        # evict them between the prefetch and the Load.
        r = run_engine(d.socket, "load", instance=f"r{seed}", verify_seed=seed,
                       tokens_seed=tokens_seed, pages=pages, prefetch="wait_complete", pin=True,
                       **BIG)
        assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
        assert r["first_hits"] + r["l3_hits"] == pages, r.describe()
        assert r["prefetch_final"].get("OK", 0) == r["l3_hits"], r.describe()
        assert r["hits"] == pages, r.describe()
        l3_hits += r["l3_hits"]
    assert l3_hits >= 1


# ---- Failures -----------------------------------------------------------------------------------

def test_full_disk_drops_writes_and_engines_see_misses(daemon_factory, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {p.stderr.strip()}")
    try:
        d = l3_daemon(daemon_factory, f"file:{mnt}?name=small&direct_io=false")
        backup(d, seed=101, tokens_seed=20, pages=40)  # 40 x 16 KiB objects > 256 KiB
        wait_until(lambda: l3_written(d, result="ok") + l3_written(d, result="failed") >= 40,
                   timeout=20, what="every write to end")
        assert l3_written(d, result="failed") > 0
        assert l3_written(d, result="ok") > 0
        r = load(d, verify_seed=101, tokens_seed=20, pages=40, instance="after-full")
        assert r["hits"] == 40  # L2 still serves them; L3 being full never fails a request.
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_daemon_killed_during_heavy_writes_serves_no_torn_object(daemon_factory, tmp_path):
    l3 = tmp_path / "l3"
    tiers = f"file:{l3}?name=nvme"
    d = l3_daemon(daemon_factory, tiers, name="victim", subdir="v1")
    writers = [EngineProcess(d.socket, "random", instance=f"w{i}", seed=111, tokens_seed=21,
                             duration_s=30, docs=40, max_pages=32, rng_seed=i, **GEOMETRY)
               for i in range(2)]
    wait_until(lambda: l3_written(d) >= 50, timeout=30, what="writes under way")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    for w in writers:
        w.kill()
    # Tear one object on purpose, as a power cut would.
    objects = [os.path.join(root, f) for root, _, files in os.walk(l3) for f in files
               if not f.startswith(".")]
    assert objects
    with open(objects[0], "r+b") as f:
        f.truncate(os.path.getsize(objects[0]) // 2)

    d2 = l3_daemon(daemon_factory, tiers, name="restarted", subdir="v2")
    hits = 0
    for doc in range(40):
        # Document `doc` of --tokens-seed 21: the prompts the writers drew from.
        r = run_engine(d2.socket, "load", instance=f"check{doc}", verify_seed=111,
                       tokens_seed=21, doc=doc, pages=32, l3_lookup_ms=2000,
                       prefetch="wait_complete", **GEOMETRY)
        assert r.rc == EXIT_OK and r["mismatched_bytes"] == 0, r.describe()
        hits += r["hits"]
    # The pages written before the crash are served (rebuilt from the files), except the torn
    # one and what follows it in its prompt.
    assert hits > 0
    assert metric(d2, "kvcellar_l3_corrupt_removed_total") >= 0


# ---- Admin over L3 --------------------------------------------------------------------------------

def test_admin_reports_and_clears_l3(daemon_factory, tmp_path):
    from conftest import KVCELLARCTL
    from engine_sim import admin
    from kvcellar.v1 import admin_service_pb2 as pb
    shared = tmp_path / "l3"
    tiers = f"file:{shared}?name=nvme&shared=true"
    a = l3_daemon(daemon_factory, tiers, name="a", subdir="a")
    backup(a, seed=121, tokens_seed=22, pages=6)
    wait_written(a, 6)
    listed = admin(a).ListNamespaces(pb.ListNamespacesRequest(), timeout=5).namespaces
    l3 = [t for n in listed for t in n.tiers if t.tier == pb.TIER_L3]
    assert [(t.l3_backend, t.objects, t.bytes) for t in l3] == [("nvme", 6, 6 * PAGE_BYTES)]
    files = [f for _, _, fs in os.walk(shared) for f in fs if not f.startswith(".")]
    assert len(files) == 6

    # Dry run: counted, nothing removed.
    p = subprocess.run([KVCELLARCTL, "--addr", a.admin_socket, "--json", "clear", "--tier", "l2",
                        "--tier", "l3", "--dry-run"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert len([f for _, _, fs in os.walk(shared) for f in fs if not f.startswith(".")]) == 6
    # Both tiers in one Clear: the L3 objects go too (found through the index before L2 drops it).
    p = subprocess.run([KVCELLARCTL, "--addr", a.admin_socket, "clear", "--tier", "l2", "--tier",
                        "l3", "--yes"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "nvme" in p.stdout
    assert [f for _, _, fs in os.walk(shared) for f in fs if not f.startswith(".")] == []
    # Another daemon on the same directory finds nothing.
    b = l3_daemon(daemon_factory, tiers, name="b", subdir="b")
    r = load(b, verify_seed=121, tokens_seed=22, pages=6, l3_lookup_ms=1000,
             prefetch="wait_complete")
    assert r["l3_hits"] == 0 and r["hits"] == 0, r.describe()
