"""L2 survives the daemon (issue 15): with pool.shm_name, a daemon that is SIGKILLed in the middle
of heavy Backup and L3 write traffic, or stopped with SIGTERM, and started again with the same
configuration re-attaches its pool and journal (core/slot_journal.h) and rebuilds its index
(server/l2/l2_recovery.h). Engines that register again find, as L2 hits and byte-exact, every
page whose Backup completed before a SIGTERM, and before a SIGKILL every page the journal's
sealer had checksummed (kvcellar_l2_journal_pending_seals says how far behind it is); nothing
that was being written or not yet checksummed is served; what was recovered is exactly what the
engines then find. A configuration with another pool geometry starts empty and says why; damaged
bytes in the pool are dropped, counted and never served.

Engines are kvcellar-engine-sim processes; every loaded byte is verified. The pool's journal is
read here from its documented layout (core/slot_journal.h) to damage one page on purpose.

Runs under Debian's /usr/bin/python3 (python3-grpcio, python3-pytest).
"""
import os
import signal
import struct
import subprocess
import threading
import time

import pytest

from engine_sim import DAEMON_ARGS, EXIT_OK, metric, run_engine, status, wait_until

GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="restart-model")
PAGE_BYTES = 2 * 2 * 4096  # One 64 KiB slot each (the smallest default class).
SLOT_BYTES = 64 << 10
PAGES = 24
SEED = 41

# core/slot_journal.h
JOURNAL_HEADER, JOURNAL_LOG, RECORD = 4096, 1 << 20, 96
STATE_COMMITTED = 2


@pytest.fixture
def shm_name(pool_shm_name):
    return pool_shm_name


def daemon_args(shm, tier_dir=None, capacity="64MiB"):
    args = [*DAEMON_ARGS, "--set", f"pool.shm_name={shm}", "--set", f"pool.capacity={capacity}"]
    if tier_dir is not None:
        args += ["--set", f"storage.tiers=file:{tier_dir}?name=nvme",
                 "--set", "storage.write_policy=write_through"]
    return args


def backup(d, tokens_seed, instance):
    return run_engine(d.socket, "backup", instance=instance, seed=SEED, tokens_seed=tokens_seed,
                      pages=PAGES, **GEOMETRY)


def load(d, tokens_seed, instance):
    """Match (no prefetch, no lookup: only L2 counts), load the L2 hit, verify every byte."""
    r = run_engine(d.socket, "load", instance=instance, verify_seed=SEED, tokens_seed=tokens_seed,
                   pages=PAGES, first_block=0, prefetch="none", pin=True, **GEOMETRY)
    assert r.rc in (EXIT_OK,), r.describe()
    assert r["mismatched_bytes"] == 0 and r["match_error"] == "", r.describe()
    assert r["verified_bytes"] == r["hits"] * PAGE_BYTES, r.describe()
    return r["hits"]


def recovery(d):
    return status(d).pool.recovery


class BackupTraffic:
    """`workers` threads, each backing up new sequences back to back (a new tokens seed each
    time) until stopped or the daemon dies. Which seeds completed and which were cut off is
    known per seed."""

    def __init__(self, d, workers, first_seed):
        self.d = d
        self.completed, self.attempted = [], []
        self._lock = threading.Lock()
        self._next = first_seed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,)) for w in range(workers)]

    def _seed(self):
        with self._lock:
            s = self._next
            self._next += 1
            self.attempted.append(s)
            return s

    def _run(self, w):
        while not self._stop.is_set():
            s = self._seed()
            r = backup(self.d, s, f"traffic-{w}-{s}")
            if r.rc == EXIT_OK and r["stored"] == PAGES:
                with self._lock:
                    self.completed.append(s)
            elif self.d.proc.poll() is not None:
                return

    def start(self):
        for t in self._threads:
            t.start()
        return self

    def join(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def test_sigkill_mid_backup_and_l3_writes_keeps_every_completed_page(daemon_factory, shm_name,
                                                                     tmp_path):
    tier = tmp_path / "l3"
    d = daemon_factory(args=daemon_args(shm_name, tier), name="before", subdir="a")
    before = recovery(d)
    assert before.enabled and not before.warm and "created" in before.cold_reason, before
    for s in range(100, 106):
        r = backup(d, s, f"first-{s}")
        assert r.rc == EXIT_OK and r["stored"] == PAGES, r.describe()
    # The sealer checksums in the background; these are all sealed once it has caught up.
    wait_until(lambda: metric(d, "kvcellar_l2_journal_pending_seals") == 0 and
               metric(d, "kvcellar_l2_journal_sealed_total") >= 6 * PAGES, timeout=30,
               what="the sealer")
    traffic = BackupTraffic(d, workers=6, first_seed=1000).start()
    # Let the traffic (Backups, and their write-through L3 writes) run, then kill mid-flight.
    deadline = time.monotonic() + 30
    while len(traffic.completed) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(d, "kvcellar_l3_writes_total", result="ok") > 0
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    traffic.join()
    sealed = list(range(100, 106))
    during = sorted(traffic.attempted)  # Completed, cut off, or completed but not yet sealed.
    assert len(traffic.completed) >= 12

    d2 = daemon_factory(args=daemon_args(shm_name, tier), name="after", subdir="b")
    r = recovery(d2)
    assert r.enabled and r.warm and r.cold_reason == "", r
    assert r.namespaces == 1 and r.dropped_checksum == 0 and r.dropped_torn == 0, r
    assert r.dropped_mismatch == 0, r
    line = d2.wait_for_line(r"l2 recovered")
    assert "warm=true" in line, line
    # Every sealed page is a whole L2 hit, byte-exact, for engines registering anew.
    for s in sealed:
        assert load(d2, s, f"reader-{s}") == PAGES, s
    # The traffic at the kill: whatever survived is whole and exact (a prefix of its sequence),
    # and nothing else is served.
    hits = [load(d2, s, f"reader-{s}") for s in during]
    full = sum(1 for s, h in zip(during, hits) if h == PAGES)
    print(f"l2 restart after SIGKILL: traffic {len(during)} sequences, {len(traffic.completed)} "
          f"completed, {full} whole after the restart; {r}")
    # The recovered pages are exactly those the engines find.
    assert r.pages == len(sealed) * PAGES + sum(hits), (r, hits)
    assert r.objects == r.pages and r.bytes == r.pages * PAGE_BYTES, r
    assert r.dropped_in_flight + r.dropped_unsealed + r.dropped_orphan <= \
        (len(during) - full) * PAGES, r
    assert metric(d2, "kvcellar_l2_recovery_pages") == r.pages
    assert metric(d2, "kvcellar_l2_recovery_warm") == 1
    # The file tier was scanned too; its pages are the ones L2 already holds, so no L3 read ran.
    assert metric(d2, "kvcellar_moved_bytes_total", direction="l3_to_l2") == 0
    from test_l3_scan import ctl
    out = ctl(d2, "status")
    assert f"l2 start:       warm: {r.pages} pages" in out, out


def test_sigterm_keeps_every_page_and_a_second_restart_too(daemon_factory, shm_name):
    d = daemon_factory(args=daemon_args(shm_name), name="first", subdir="a")
    for s in range(1, 5):
        assert backup(d, s, f"w-{s}")["stored"] == PAGES
    assert d.stop() == 0
    for n, sub in enumerate(("b", "c")):
        d = daemon_factory(args=daemon_args(shm_name), name=f"again{n}", subdir=sub)
        r = recovery(d)
        assert r.warm and r.pages == 4 * PAGES, r
        assert (r.dropped_in_flight, r.dropped_unsealed, r.dropped_torn, r.dropped_checksum,
                r.dropped_mismatch, r.dropped_orphan) == (0, 0, 0, 0, 0, 0), r
        for s in range(1, 5):
            assert load(d, s, f"r{n}-{s}") == PAGES
        assert d.stop() == 0


def test_another_pool_geometry_starts_empty_and_says_why(daemon_factory, shm_name):
    d = daemon_factory(args=daemon_args(shm_name), name="first", subdir="a")
    assert backup(d, 1, "w")["stored"] == PAGES
    assert d.stop() == 0
    d = daemon_factory(args=daemon_args(shm_name, capacity="128MiB"), name="bigger", subdir="b")
    r = recovery(d)
    assert r.enabled and not r.warm and r.pages == 0, r
    assert "pool.capacity changed" in r.cold_reason, r
    line = d.wait_for_line(r"l2 started empty")
    assert "pool.capacity changed" in line, line
    assert metric(d, "kvcellar_l2_recovery_warm") == 0
    assert load(d, 1, "r") == 0
    # The new geometry is what the next restart keeps.
    assert backup(d, 2, "w2")["stored"] == PAGES
    assert d.stop() == 0
    d = daemon_factory(args=daemon_args(shm_name, capacity="128MiB"), name="again", subdir="c")
    assert recovery(d).warm and recovery(d).pages == PAGES
    assert load(d, 2, "r2") == PAGES


def committed_records(shm):
    """(record index, has_parent) of every COMMITTED record in the one-region pool's journal."""
    with open(f"/dev/shm/{shm}.journal", "rb") as f:
        f.seek(JOURNAL_HEADER + JOURNAL_LOG)
        data = f.read()
    out = []
    for i in range(len(data) // RECORD):
        rec = data[i * RECORD:(i + 1) * RECORD]
        if rec[4] == STATE_COMMITTED:
            out.append((i, rec[5] == 1))
    return out


def test_damaged_pool_bytes_are_dropped_never_served(daemon_factory, shm_name):
    d = daemon_factory(args=daemon_args(shm_name), name="first", subdir="a")
    for s in range(1, 4):
        assert backup(d, s, f"w-{s}")["stored"] == PAGES
    assert d.stop() == 0
    records = committed_records(shm_name)
    assert len(records) == 3 * PAGES
    # A page in the middle of some sequence: its slot is index * 64 KiB of the one region.
    victim = [i for i, has_parent in records if has_parent][PAGES // 2]
    with open(f"/dev/shm/{shm_name}", "r+b") as f:
        f.seek(victim * SLOT_BYTES + 1000)
        b = f.read(1)
        f.seek(victim * SLOT_BYTES + 1000)
        f.write(bytes([b[0] ^ 0x5a]))
    d = daemon_factory(args=daemon_args(shm_name), name="after", subdir="b")
    r = recovery(d)
    assert r.warm and r.dropped_checksum == 1, r
    hits = sorted(load(d, s, f"r-{s}") for s in range(1, 4))
    assert hits[1:] == [PAGES, PAGES] and hits[0] < PAGES, hits
    # The damaged page and the rest of its sequence (orphans) are gone; nothing else is.
    assert r.dropped_orphan == PAGES - 1 - hits[0], (r, hits)
    assert r.pages == sum(hits), (r, hits)
    assert metric(d, "kvcellar_l2_recovery_dropped_objects", reason="checksum") == 1
