"""The engine data path end to end: real kvcellard processes and real engine processes
(kvcellar-engine-sim on the sim device, linking libkvcellar-client) backing up and loading KV
blocks whose every byte is verified against a pattern of (seed, page key, shard, layer, byte).

Covers DESIGN.md "Engine data path" and "Failure semantics": TP groups, MLA, an engine killed
mid-op, the daemon killed and restarted under running engines, and 16 engines at once.
Interpreter: Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import ctypes
import glob
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import BIN_DIR, Daemon
from engine_sim import (DAEMON_ARGS, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, SHM_PREFIX,
                        EngineProcess, engine_binary, engines, evict_l2, metric, namespaces,
                        optional_admin, remove_engine_shm, require_cache_service, run_engine,
                        status, wait_until)

# A small model: 2 layers, 4 KiB per buffer per block, 16 tokens per page.
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="it-model")
PAGE_BYTES_MHA = 2 * 2 * 4096
PAGE_BYTES_MLA = 2 * 1 * 4096


@pytest.fixture
def cache_daemon(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS)
    require_cache_service(d)
    return d


def run_ranks(sock, command, ranks, **flags):
    """Runs one engine command per rank concurrently (TP ranks are separate processes)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(run_engine, sock, command, rank=r, **flags) for r in ranks]
        return [f.result() for f in futures]


def test_engine_tool_usage_errors(tmp_path):
    for argv in ([], ["frobnicate"], ["load", "--no-such-flag", "1"], ["--layout", "x", "load"]):
        p = subprocess.run([engine_binary(), "--addr", str(tmp_path / "none.sock"), *argv],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == EXIT_USAGE, (argv, p.stdout, p.stderr)


def test_missing_daemon_is_a_miss_not_a_failure(tmp_path):
    sock = str(tmp_path / "none.sock")
    t0 = time.monotonic()
    r = run_engine(sock, "load", tokens_seed=1, pages=4, verify_seed=1, register_wait_ms=200,
                   rpc_timeout_ms=200, **GEOMETRY)
    assert r.rc == EXIT_OK, r.describe()
    assert r["hits"] == 0 and r["loaded"] == 0
    assert r["stats"]["degraded_calls"] >= 1
    assert time.monotonic() - t0 < 10


def test_tp2_group_backs_up_and_another_instance_loads_byte_exact(cache_daemon):
    sock = cache_daemon.socket
    common = dict(tp=2, tokens_seed=11, pages=8, **GEOMETRY)
    backups = run_ranks(sock, "backup", [0, 1], instance="inst-a", seed=7, first_block=0,
                        **common)
    for r in backups:
        assert r.rc == EXIT_OK, r.describe()
        assert r["stored"] == 8 and r["state"] == "DONE"
    assert {r["session"]["shard_index"] for r in backups} == {0, 1}
    assert all(r["session"]["num_shards"] == 2 for r in backups)

    # Instance B: other processes, other block indices, loads every page of its own shard.
    loads = run_ranks(sock, "load", [0, 1], instance="inst-b", verify_seed=7, first_block=40,
                      pin=True, expect_hits=8, **common)
    for r in loads:
        assert r.rc == EXIT_OK, r.describe()
        assert r["hits"] == 8 and r["loaded"] == 8
        assert r["verified_bytes"] == 8 * PAGE_BYTES_MHA
        assert r["mismatched_bytes"] == 0
    # Per-layer signals fired for every layer of the Load.
    assert all(r["layers_signalled"] == GEOMETRY["layers"] for r in loads)

    # The verification is real: the same pages checked against another seed fail loudly.
    wrong = run_engine(sock, "load", rank=0, instance="inst-c", verify_seed=8, first_block=40,
                       **common)
    assert wrong.rc == EXIT_MISMATCH, wrong.describe()
    assert wrong["mismatched_bytes"] > 0


def test_tp_page_is_visible_only_with_every_shard(cache_daemon):
    sock = cache_daemon.socket
    common = dict(tp=2, tokens_seed=12, pages=4, **GEOMETRY)
    r0 = run_engine(sock, "backup", instance="half", rank=0, seed=3, **common)
    assert r0.rc == EXIT_OK, r0.describe()
    miss = run_engine(sock, "load", instance="reader", rank=0, verify_seed=3, first_block=10,
                      **common)
    assert miss.rc == EXIT_OK and miss["hits"] == 0, miss.describe()
    r1 = run_engine(sock, "backup", instance="half", rank=1, seed=3, **common)
    assert r1.rc == EXIT_OK, r1.describe()
    hit = run_engine(sock, "load", instance="reader2", rank=1, verify_seed=3, first_block=10,
                     expect_hits=4, **common)
    assert hit.rc == EXIT_OK and hit["loaded"] == 4, hit.describe()


def test_mla_group_stores_one_copy_every_rank_loads_it(cache_daemon):
    sock = cache_daemon.socket
    common = dict(layout="mla", tokens_seed=21, pages=6, **GEOMETRY)
    w = run_engine(sock, "backup", instance="mla-a", rank=0, tp=2, seed=5, **common)
    assert w.rc == EXIT_OK, w.describe()
    assert w["session"]["num_shards"] == 1 and w["session"]["is_shard_writer"]
    assert w["session"]["page_object_bytes"] == PAGE_BYTES_MLA
    used = status(cache_daemon).pool.used_bytes
    assert used > 0
    # Rank 1 holds the same latent: its Backup stores nothing new.
    dup = run_engine(sock, "backup", instance="mla-a", rank=1, tp=2, seed=5, first_block=20,
                     **common)
    assert dup["session"]["shard_index"] == 0 and not dup["session"]["is_shard_writer"]
    assert set(dup["final"]) <= {"ALREADY_PRESENT", "IN_FLIGHT"}, dup.describe()
    assert status(cache_daemon).pool.used_bytes == used  # Still one copy.

    loads = run_ranks(sock, "load", [0, 1], instance="mla-b", tp=2, verify_seed=5,
                      first_block=30, pin=True, expect_hits=6, **common)
    for r in loads:
        assert r.rc == EXIT_OK, r.describe()
        assert r["loaded"] == 6 and r["verified_bytes"] == 6 * PAGE_BYTES_MLA
        assert r["mismatched_bytes"] == 0
    # The MLA digest encodes one shard, not the TP size: a TP-4 group shares the pages.
    tp4 = run_engine(sock, "load", instance="mla-c", rank=3, tp=4, verify_seed=5, first_block=50,
                     expect_hits=6, **common)
    assert tp4.rc == EXIT_OK, tp4.describe()
    assert tp4["session"]["ns_digest"] == w["session"]["ns_digest"]
    listed = optional_admin(lambda: namespaces(cache_daemon))
    if listed is not None:
        mla_ns = [n for n in listed if n.num_shards == 1]
        assert len(mla_ns) == 1
        l2 = [t for t in mla_ns[0].tiers if t.tier == 2]
        assert l2 and l2[0].objects == 6 and l2[0].pages == 6  # One object per page.


def test_killed_engine_pins_are_released_after_the_lease(cache_daemon):
    sock = cache_daemon.socket
    common = dict(tokens_seed=31, pages=5, **GEOMETRY)
    assert run_engine(sock, "backup", instance="writer", seed=9, **common).rc == EXIT_OK
    expiries0 = metric(cache_daemon, "kvcellar_session_lease_expiries_total")

    holder = EngineProcess(sock, "hold", instance="holder", pin=True, **common)
    held = holder.first_line()
    assert held["hits"] == 5 and held["pin_id"] != 0, held
    assert metric(cache_daemon, "kvcellar_pins") >= 1
    dry = optional_admin(lambda: evict_l2(cache_daemon, dry_run=True))
    if dry is not None:
        assert dry.skipped_pinned_pages == 5

    # An engine in the middle of random work (ops in flight), killed too.
    worker = EngineProcess(sock, "random", instance="worker", seed=9, duration_s=30, docs=4,
                           max_pages=5, **{k: v for k, v in common.items() if k != "pages"})
    wait_until(lambda: status(cache_daemon).sessions >= 2, what="the worker to register")
    time.sleep(1.0)
    holder.kill(signal.SIGKILL)
    worker.kill(signal.SIGKILL)
    t_kill = time.monotonic()
    assert metric(cache_daemon, "kvcellar_pins") >= 1  # The daemon does not know yet.

    # Lease 1 s: the sessions, their pins and ops go shortly after.
    wait_until(lambda: metric(cache_daemon, "kvcellar_pins") == 0, timeout=15,
               what="pins of the killed engines to be dropped")
    wait_until(lambda: status(cache_daemon).sessions == 0, timeout=15,
               what="sessions of the killed engines to end")
    assert time.monotonic() - t_kill >= 0.5  # Not before the lease could have lapsed.
    assert metric(cache_daemon, "kvcellar_session_lease_expiries_total") >= expiries0 + 2

    # The pages are intact and loadable byte for byte ...
    r = run_engine(sock, "load", instance="after", verify_seed=9, first_block=20, expect_hits=5,
                   **common)
    assert r.rc == EXIT_OK, r.describe()
    # ... and evictable: nothing pins them any more.
    ev = optional_admin(lambda: evict_l2(cache_daemon))
    if ev is not None:
        assert ev.skipped_pinned_pages == 0
        assert sum(t.pages for t in ev.evicted) >= 5


def test_an_engine_truncating_its_shared_memory_under_traffic_harms_only_itself(daemon_factory):
    """A buggy or hostile engine shrinks its KV object and its signal region to nothing while
    the daemon copies for it and for three other engines: the daemon's copies of the victim's
    memory fault and fail the victim's ops only; the daemon stays up, and the others finish their
    random traffic with every loaded byte verified."""
    d = daemon_factory(args=DAEMON_ARGS, name="truncate")
    require_cache_service(d)
    sock = d.socket
    traffic = dict(tokens_seed=51, docs=6, max_pages=6, think_ms=0, **GEOMETRY)
    others = [EngineProcess(sock, "random", instance=f"other-{i}", seed=17, duration_s=8,
                            **traffic) for i in range(3)]
    victim = EngineProcess(sock, "random", instance="victim", seed=17, duration_s=30, **traffic)
    time.sleep(2.5)  # everyone in the middle of Match/Load/Backup
    objects = glob.glob(f"/dev/shm/{SHM_PREFIX}-{victim.proc.pid}-*")
    assert len(objects) == 2, objects  # its KV pool and its signal region
    for path in objects:
        os.truncate(path, 0)
    # The victim's own process takes SIGBUS on its memory: its problem, not the node's.
    victim.proc.wait(timeout=60)
    remove_engine_shm(victim.proc.pid)
    for r in [o.finish(timeout=60) for o in others]:
        assert r.rc == EXIT_OK, r.describe()
        assert r["mismatched_bytes"] == 0
        assert r["loaded_pages"] > 0, r.describe()
    assert d.proc.poll() is None, d.log()
    print("daemon copies that faulted on the victim's memory:",
          sum("engine memory fault" in line for line in d.lines))
    # Still serving: a fresh engine stores and loads, byte-exact.
    fresh = dict(tokens_seed=52, pages=4, **GEOMETRY)
    assert run_engine(sock, "backup", instance="after-b", seed=19, **fresh).rc == EXIT_OK
    r = run_engine(sock, "load", instance="after-l", verify_seed=19, first_block=10,
                   expect_hits=4, **fresh)
    assert r.rc == EXIT_OK, r.describe()


def test_daemon_killed_and_restarted_under_running_engines(daemon_factory):
    d = daemon_factory(args=DAEMON_ARGS, name="restart")
    require_cache_service(d)
    sock = d.socket
    # Pages of a prompt the running engines never touch (their universe has another seed).
    common = dict(tokens_seed=42, pages=6, **GEOMETRY)
    assert run_engine(sock, "backup", instance="pre", seed=13, **common).rc == EXIT_OK

    runners = [EngineProcess(sock, "random", instance=f"survivor-{i}", seed=13, duration_s=9,
                             tokens_seed=41, docs=6, max_pages=6, rpc_timeout_ms=300,
                             think_ms=1, **GEOMETRY)
               for i in range(3)]
    time.sleep(2.5)
    d.stop(signal.SIGKILL)
    time.sleep(1.0)  # Down for a while: every engine call must be a quick miss meanwhile.
    d2 = daemon_factory(args=DAEMON_ARGS, name="restart")  # Same socket path.
    assert d2.socket == sock

    results = [runner.finish(timeout=60) for runner in runners]
    for r in results:
        assert r.rc == EXIT_OK, r.describe()
        assert r["mismatched_bytes"] == 0
        assert r["stats"]["sessions_lost"] >= 1, r.describe()
        assert r["stats"]["reregistrations"] >= 1, r.describe()
        assert r["session"]["generation"] >= 2
        assert r["session"]["state"] == "active"
        # It went on caching through the same client after the restart: pages it or another
        # engine stored in the new daemon, loaded and verified.
        assert r["loaded_pages_after_reconnect"] > 0, r.describe()
    assert sum(r["stored_pages_after_reconnect"] for r in results) > 0

    # A fresh daemon has none of the old pages: a miss, not an error.
    r = run_engine(sock, "load", instance="post", verify_seed=13, first_block=20, **common)
    assert r.rc == EXIT_OK and r["hits"] == 0, r.describe()
    assert d2.proc.poll() is None


def _stress(tmp_path, bin_dir, engines_n=16, duration_s=20):
    d = Daemon(tmp_path, args=DAEMON_ARGS, name="stress")
    d.args[0] = os.path.join(bin_dir, "kvcellard")
    d.start()
    try:
        require_cache_service(d)
        # 64 KiB pages; 160 prompts of up to 12 pages (up to 120 MiB) is more than the 64 MiB
        # pool holds, so eviction runs under the engines' feet.
        geometry = dict(layers=2, block_bytes=16384, blocks=32, page_size=16, model="stress")
        procs = [EngineProcess(d.socket, "random", bin_dir=bin_dir, instance=f"stress-{i}",
                               seed=77, tokens_seed=78, duration_s=duration_s, docs=160,
                               max_pages=12, rpc_timeout_ms=2000, wait_ms=20000, **geometry)
                 for i in range(engines_n)]
        results = [p.finish(timeout=duration_s + 120) for p in procs]
        print("stress:", [(r["steps"], r["loaded_pages"], r["stored_pages"]) for r in results],
              "evicted:", metric(d, "kvcellar_evicted_pages_total"))
        for r in results:
            assert r.rc == EXIT_OK, r.describe()
            assert r["mismatched_bytes"] == 0, r.describe()
        total_loaded = sum(r["loaded_pages"] for r in results)
        total_stored = sum(r["stored_pages"] for r in results)
        assert total_stored > 0
        assert total_loaded > 0, "no engine ever loaded a page another one stored"
        assert sum(r["verified_bytes"] for r in results) == total_loaded * 2 * 2 * 16384
        assert d.proc.poll() is None, d.log()[-4000:]
    finally:
        d.stop()


def test_sixteen_engines_random_traffic_every_byte_verified(tmp_path):
    _stress(tmp_path, BIN_DIR)


def test_sixteen_engines_under_asan(tmp_path):
    asan_dir = os.environ.get("KVCELLAR_ASAN_BIN_DIR")
    if not asan_dir:
        pytest.skip("KVCELLAR_ASAN_BIN_DIR not set")
    _stress(tmp_path, asan_dir)


class _ClientOptions(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_char_p), ("rpc_timeout_ms", ctypes.c_uint32),
                ("register_timeout_ms", ctypes.c_uint32), ("backoff_min_ms", ctypes.c_uint32),
                ("backoff_max_ms", ctypes.c_uint32), ("heartbeat", ctypes.c_int),
                ("heartbeat_interval_ms", ctypes.c_uint32), ("tls_ca_file", ctypes.c_char_p),
                ("tls_cert_file", ctypes.c_char_p), ("tls_key_file", ctypes.c_char_p),
                ("tls_server_name", ctypes.c_char_p)]


class _Namespace(ctypes.Structure):
    _fields_ = [("tenant", ctypes.c_char_p), ("model_id", ctypes.c_char_p),
                ("model_revision", ctypes.c_char_p), ("kv_dtype", ctypes.c_char_p),
                ("page_size", ctypes.c_uint32), ("layout", ctypes.c_uint32),
                ("tp_size", ctypes.c_uint32), ("opaque_keys", ctypes.c_int),
                ("groups", ctypes.c_void_p), ("num_groups", ctypes.c_size_t)]


class _Registration(ctypes.Structure):
    _fields_ = [("instance_id", ctypes.c_char_p), ("rank", ctypes.c_uint32),
                ("scheduler", ctypes.c_int), ("ns", _Namespace), ("device_kind", ctypes.c_uint32),
                ("device_uuid", ctypes.c_void_p), ("device_name", ctypes.c_char_p),
                ("regions", ctypes.c_void_p), ("num_regions", ctypes.c_size_t),
                ("layers", ctypes.c_void_p), ("num_layers", ctypes.c_size_t),
                ("num_blocks", ctypes.c_uint32), ("num_load_slots", ctypes.c_uint32),
                ("num_ready_slots", ctypes.c_uint32), ("sim_signal_shm_name", ctypes.c_char_p),
                ("sim_signal_size", ctypes.c_uint64), ("cuda_load_event_handles", ctypes.c_void_p),
                ("cuda_ready_event_handles", ctypes.c_void_p), ("replace_existing", ctypes.c_int),
                ("engine_name", ctypes.c_char_p), ("group_num_blocks", ctypes.c_void_p),
                ("num_group_num_blocks", ctypes.c_size_t)]


class _MatchSeq(ctypes.Structure):
    _fields_ = [("tokens", ctypes.POINTER(ctypes.c_uint32)), ("num_tokens", ctypes.c_size_t),
                ("keys", ctypes.c_void_p), ("num_keys", ctypes.c_size_t),
                ("num_computed_pages", ctypes.c_uint32), ("l2_hit_pages", ctypes.c_uint32),
                ("l3_hit_pages", ctypes.c_uint32), ("total_pages", ctypes.c_uint32),
                ("pin_id", ctypes.c_uint64)]


def test_c_abi_from_c_and_python(cache_daemon, tmp_path):
    # A C program linking libkvcellar-client.so.
    smoke = os.path.join(BIN_DIR, "kvcellar-c-abi-smoke")
    for sock in (cache_daemon.socket, str(tmp_path / "none.sock")):
        p = subprocess.run([smoke, sock], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, (p.stdout, p.stderr)

    # Python through ctypes: a scheduler session on the real daemon, keys as in docs/keys.md.
    lib = ctypes.CDLL(os.path.join(BIN_DIR, "..", "lib", "libkvcellar-client.so"))
    lib.kvc_version.restype = ctypes.c_char_p
    lib.kvc_last_error.restype = ctypes.c_char_p
    lib.kvc_compute_keys.restype = ctypes.c_size_t
    assert lib.kvc_version().startswith(b"libkvcellar-client")
    assert lib.kvc_client_connect(None, None) == 1  # KVC_ERR_INVALID_ARGUMENT
    assert lib.kvc_last_error()

    opts = _ClientOptions()
    lib.kvc_client_options_init(ctypes.byref(opts))
    opts.addr = cache_daemon.socket.encode()
    client = ctypes.c_void_p()
    assert lib.kvc_client_connect(ctypes.byref(opts), ctypes.byref(client)) == 0, lib.kvc_last_error()
    reg = _Registration(instance_id=b"ctypes", scheduler=1,
                        ns=_Namespace(b"acme", b"tiny-llm", b"rev1", b"bf16", 4, 0, 1, 0))
    session = ctypes.c_void_p()
    assert lib.kvc_register(client, ctypes.byref(reg), ctypes.byref(session)) == 0, lib.kvc_last_error()
    assert lib.kvc_session_wait_active(session, 5000) == 0, lib.kvc_last_error()
    tokens = (ctypes.c_uint32 * 10)(*range(1, 11))
    keys = ctypes.create_string_buffer(64)
    assert lib.kvc_compute_keys(session, tokens, 10, keys, 2) == 2
    assert keys.raw[:32].hex() == "534bdcdf6b10c50653fb787a2d12602ca43a75cdc5f603a403cfac745ae379a3"
    assert keys.raw[32:].hex() == "851048f8af9a397f4ee6cbe6ffaba5b89e4af4f8a6a70ee3f9cb6ad4308dcd81"
    seq = _MatchSeq(tokens=tokens, num_tokens=10)
    assert lib.kvc_match(session, ctypes.byref(seq), 1, None, None) == 0, lib.kvc_last_error()
    assert seq.total_pages == 2 and seq.l2_hit_pages == 0
    lib.kvc_session_close(session, 0)
    lib.kvc_client_close(client)
