"""Soak: one daemon, 64 engine ranks of random traffic for minutes, with a file tier and Redis
behind a small L2, and engine processes SIGKILLed and restarted at random (issue #13).

Ranks are kvcellar-engine-sim processes (`random` in lockstep: the TP ranks of an instance run
the same steps on wall-clock ticks, Match with one step_id, and MHA ranks back up their own
shards). Instances: TP 1, 2 and 8, MHA and MLA, one model, one prompt universe, so instances
share prefixes; L2 holds a fraction of it, so pages are evicted, written through to the file tier
and Redis, and prefetched back. The file tier's capacity is small too, so older pages are found
only in Redis and prefetched from there.

A rank slot runs one engine process after another: each runs for a random while and exits; a
chaos thread SIGKILLs running ones at random, and their slot restarts them after a random delay
(--replace: the new process takes over the (instance, rank) whose old session has not expired
yet; the group's pins and ops follow docs/api.md: the dead rank's holds drop with its session).
Every process that was not killed must exit OK with every loaded byte verified.

The daemon's RSS, open fds and threads are sampled every few seconds; after a warm-up they must
stay flat (bounds below). Duration: KVCELLAR_SOAK_SECONDS (default 150, the CI run); the README
gives the 10-minute command. Runs under Debian's /usr/bin/python3.
"""
import collections
import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
import zlib

from conftest import Daemon
from engine_sim import (DAEMON_ARGS, EXIT_OK, EngineProcess, metric, metrics,
                        remove_engine_shm, require_cache_service)
from redis_util import RedisServer

SOAK_SECONDS = float(os.environ.get("KVCELLAR_SOAK_SECONDS", "150"))
# The first 30% of the run: sessions, pool regions, size classes, Redis connections, metric
# series and gRPC's threads all reach their working level here; later growth is a leak.
WARMUP_FRACTION = 0.3
SAMPLE_EVERY_S = 2.0

# Small and quick: 2 layers x 4 KiB buffers, so an MHA shard object is 16 KiB and an MLA page
# 8 KiB; 8 pages at most per prompt, 32 blocks per rank (random needs 2 x max pages).
GEOMETRY = dict(layers=2, block_bytes=4096, blocks=32, page_size=16, model="soak-model")
MAX_PAGES = 8
# Prompts in the universe: 128 x 8 pages is 128 MiB for the TP-8 MHA namespace alone (8 shards
# of 16 KiB a page), about 184 MiB over the four namespaces.
DOCS = 128
KV_SEED, TOKENS_SEED = 77, 78

# (name, tp, layout, instances): 16 + 12 + 12 + 8 + 8 + 8 = 64 ranks.
FLEET = [("t1-mha", 1, "mha", 16), ("t1-mla", 1, "mla", 12), ("t2-mha", 2, "mha", 6),
         ("t2-mla", 2, "mla", 4), ("t8-mha", 8, "mha", 1), ("t8-mla", 8, "mla", 1)]
PREFETCH = ["best_effort", "wait_complete", "timeout"]

# Engine process lifetimes and the chaos between them: most processes end on their own, about
# one kill every CHAOS_EVERY_S on average, a killed rank back after up to RESTART_DELAY_S.
LIFETIME_S = (15.0, 45.0)
CHAOS_EVERY_S = (1.0, 5.0)
RESTART_DELAY_S = (0.0, 2.0)

# L2 of 64 MiB (the smallest the daemon takes) in 2 MiB regions: the universe is about three
# times larger, so eviction runs all along, and regions move between the 16 KiB and 8 KiB size
# classes. The file tier keeps 32 MiB of it, Redis everything. Pins lapse after 5 s, so that the
# holds of a killed rank cannot keep pages for long. Sessions live 3 s without a Heartbeat
# (DAEMON_ARGS' 1 s lapses under a load of 30 from other jobs on these shared machines, and every
# engine re-registers: a soak of re-registrations); killed ranks come back with --replace anyway.
SOAK_DAEMON_ARGS = (*DAEMON_ARGS,
                    "--set", "pool.region_size=2MiB",
                    "--set", "pool.capacity=64MiB",
                    "--set", "sessions.lease_ms=3000",
                    "--set", "sessions.pin_lease_ms=5000")

# Flatness bounds. Measured on the 2-core machines (3- and 10-minute runs): fds sit at 82 with
# single samples up to ~130 (connections and mappings of killed engines, until their 1 s lease
# lapses), threads wander between 56 and 143 (gRPC's executor grows under bursts and shrinks
# after), VmRSS settles within 2-3 MiB (it includes the engine shared memory the daemon has
# touched, up to 0.5 MiB per engine). A leak grows without bound instead: the 3-minute run has
# ~400 engine sessions, ~50 kills and ~1M RPCs after warm-up, so one fd or thread per session or
# kill, or ~50 bytes per RPC, breaks these bounds; the 10-minute run is 3-4 times stricter.
MIN_SECONDS_FOR_FLATNESS = 120
THREADS_SLACK = 16
FDS_SLACK = 32
RSS_SLACK_BYTES = 16 << 20
RSS_SLACK_FRACTION = 0.15
# /healthz must answer within a Kubernetes liveness probe's timeout (deploy/k8s: 5 s) at every
# sample, however loaded the machine; HEALTHZ_TIMEOUT_S only bounds the wait for a hung daemon.
HEALTHZ_BOUND_S = 5.0
HEALTHZ_TIMEOUT_S = 30.0


# One sample of the daemon: seconds since the start, VmRSS and RssAnon (the daemon's own memory:
# heap and host pool, without the engines' shared memory it maps) in bytes, open fds, threads,
# seconds /healthz took to answer (None: no answer in HEALTHZ_TIMEOUT_S), the 1-minute load.
Sample = collections.namedtuple("Sample", "t rss anon fds threads healthz_s load1")


def proc_sample(pid):
    """(VmRSS bytes, RssAnon bytes, open fds, threads) of a live process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return (int(fields["VmRSS"][0]) * 1024, int(fields["RssAnon"][0]) * 1024,
            len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"][0]))


class Sampler(threading.Thread):
    """Samples the daemon every SAMPLE_EVERY_S: its /proc figures, the time /healthz took to
    answer (is it still responsive?) and the machine's load average."""

    def __init__(self, daemon, stop):
        super().__init__(daemon=True)
        self.d, self.stop = daemon, stop
        self.samples = []
        self.t0 = time.monotonic()

    def run(self):
        while not self.stop.wait(SAMPLE_EVERY_S):
            t = time.monotonic()
            try:
                with urllib.request.urlopen(f"http://{self.d.http}/healthz",
                                            timeout=HEALTHZ_TIMEOUT_S) as r:
                    r.read()
                healthz_s = time.monotonic() - t
            except OSError:
                healthz_s = None
            if self.d.proc.poll() is not None:
                return
            self.samples.append(Sample(t - self.t0, *proc_sample(self.d.proc.pid), healthz_s,
                                       os.getloadavg()[0]))


class RankSlot(threading.Thread):
    """One engine rank: runs engine processes one after another until the deadline, checking
    each one that was not killed."""

    def __init__(self, sock, deadline, rng, instance, rank, tp, layout, step_ms, prefetch):
        super().__init__(daemon=True)
        self.sock, self.deadline, self.rng = sock, deadline, rng
        self.flags = dict(instance=instance, rank=rank, tp=tp, layout=layout, step_ms=step_ms,
                          prefetch=prefetch, rng_seed=zlib.crc32(instance.encode()),
                          seed=KV_SEED, tokens_seed=TOKENS_SEED, docs=DOCS, max_pages=MAX_PAGES,
                          rpc_timeout_ms=2000, wait_ms=10000, replace=True, **GEOMETRY)
        self.lock = threading.Lock()
        self.engine = None  # the running EngineProcess
        self.killed = False
        self.results, self.failures, self.kills, self.runs = [], [], 0, 0

    def run(self):
        try:
            self.run_engines()
        except Exception as e:  # noqa: BLE001 -- a rank that stops is a failure, not a silence
            self.failures.append(f"{self.flags['instance']} rank {self.flags['rank']}: {e!r}")

    def run_engines(self):
        while True:
            left = self.deadline - time.monotonic()
            if left < 5:
                return
            duration = min(self.rng.uniform(*LIFETIME_S), left - 2)
            with self.lock:
                self.engine = EngineProcess(self.sock, "random", duration_s=f"{duration:.1f}",
                                            **self.flags)
                self.killed = False
                self.runs += 1
            engine = self.engine
            r = engine.finish(timeout=duration + 120)
            with self.lock:
                killed, self.engine = self.killed and r.rc == -signal.SIGKILL, None
            if killed:
                remove_engine_shm(engine.proc.pid)  # a SIGKILLed engine cannot unlink them
                self.kills += 1
                time.sleep(self.rng.uniform(*RESTART_DELAY_S))
            elif r.rc != EXIT_OK or r.json is None or r["mismatched_bytes"] != 0:
                self.failures.append(r.describe())
            else:
                self.results.append(r.json)

    def kill(self):
        """SIGKILLs the running engine; False when none is running."""
        with self.lock:
            if self.engine is None or self.engine.proc.poll() is not None:
                return False
            self.killed = True
            self.engine.proc.send_signal(signal.SIGKILL)
            return True


def start_fleet(sock, deadline, rng):
    slots = []
    for i, (kind, tp, layout, instances) in enumerate(FLEET):
        for k in range(instances):
            instance = f"soak-{kind}-{k}"
            # Periods differ per instance so that ticks do not all fall together.
            step_ms = 300 + 23 * ((i * 7 + k) % 17)
            prefetch = PREFETCH[(i + k) % len(PREFETCH)]
            slots += [RankSlot(sock, deadline, random.Random(rng.random()), instance, rank, tp,
                               layout, step_ms, prefetch) for rank in range(tp)]
    assert len(slots) == 64
    for s in slots:
        s.start()
        time.sleep(0.02)  # Not 64 registrations in the same millisecond.
    return slots


def chaos(slots, deadline, rng, stop):
    kills = 0
    while not stop.wait(rng.uniform(*CHAOS_EVERY_S)):
        if time.monotonic() > deadline - 10:
            break
        if rng.choice(slots).kill():
            kills += 1
    return kills


def test_soak_64_ranks_l3_behind_l2_engines_killed_at_random(tmp_path):
    rng = random.Random(int(os.environ.get("KVCELLAR_SOAK_SEED", "1313")))
    redis = RedisServer(tmp_path / "redis").start()
    # Redis keeps about half of the universe and evicts the rest by itself (maxmemory, LRU): the
    # daemon learns of each eviction from its keyspace notifications, so the index drops the
    # page and a prefetch seldom asks for an object that is gone (`stale_l3_reads`).
    # KVCELLAR_SOAK_REDIS_WATCH=false runs the same soak without them, for the comparison.
    redis.cli("CONFIG", "SET", "maxmemory", "96mb")
    redis.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    watch = os.environ.get("KVCELLAR_SOAK_REDIS_WATCH", "true")
    l3 = tmp_path / "l3"
    tiers = (f"file:{l3}?name=file&capacity=32MiB "
             f"redis:{redis.address}?name=redis&prefix=soak:&watch={watch}")
    d = Daemon(tmp_path, args=(*SOAK_DAEMON_ARGS, "--set", f"storage.tiers={tiers}"), name="soak")
    stop = threading.Event()
    try:
        d.start()
        require_cache_service(d)
        sampler = Sampler(d, stop)
        sampler.start()
        t0 = time.monotonic()
        deadline = t0 + SOAK_SECONDS
        slots = start_fleet(d.socket, deadline, rng)
        kills = chaos(slots, deadline, rng, stop)
        for s in slots:
            s.join(timeout=max(1, deadline - time.monotonic()) + 180)
            assert not s.is_alive(), "an engine rank did not finish"
        elapsed = time.monotonic() - t0
        stop.set()
        sampler.join(timeout=60)
        assert d.proc.poll() is None, d.log()[-4000:]

        failures = [f for s in slots for f in s.failures]
        assert not failures, f"{len(failures)} engine runs failed; first:\n{failures[0]}"
        results = [r for s in slots for r in s.results]
        steps = sum(r["steps"] for r in results)
        loaded = sum(r["loaded_pages"] for r in results)
        verified = sum(r["verified_bytes"] for r in results)
        prefetched = sum(r["prefetched_pages"] for r in results)
        stored = sum(r["stored_pages"] for r in results)
        assert sum(r["mismatched_bytes"] for r in results) == 0
        assert loaded > 0 and verified > 0 and stored > 0
        assert sum(r["memoized_matches"] for r in results) > 0, "TP groups never shared a step"
        # A SIGKILL sent as an engine was exiting on its own finds it gone: that run ends well
        # and counts as a finished run, not a kill (seen once in 43 kills).
        assert 0 < sum(s.kills for s in slots) <= kills

        # Loads came from L2 (h2d copies) and from L3: pages evicted from L2, prefetched back from
        # the file tier and from Redis (older pages the file tier's capacity let go).
        evicted = metric(d, "kvcellar_evicted_pages_total")
        h2d = metric(d, "kvcellar_moved_bytes_total", direction="h2d")
        l3_to_l2 = metric(d, "kvcellar_moved_bytes_total", direction="l3_to_l2")
        file_gets = metric(d, "kvcellar_l3_bytes_total", tier="file", op="get")
        redis_gets = metric(d, "kvcellar_l3_bytes_total", tier="redis", op="get")
        assert evicted > 0, "L2 never evicted: the soak does not exercise L3"
        assert h2d > 0 and l3_to_l2 > 0 and prefetched > 0
        assert file_gets > 0, "no page was read back from the file tier"
        assert redis_gets > 0, "no page was read back from Redis"
        assert metric(d, "kvcellar_l3_corrupt_removed_total") == 0
        # Engines killed mid-call and deadlines under load are no malformed requests, and nothing
        # in the daemon is an error.
        bad_lines = [l for l in d.lines if "level=error" in l or "does not parse" in l]
        assert not bad_lines, "\n".join(bad_lines[:20])
        final = metrics(d)

        def by(name, *keys, **labels):
            """{"label/label": value} of the non-zero series of a counter, summed over the rest."""
            out = collections.Counter()
            for (n, ls), v in final.items():
                ls = dict(ls)
                if n == name and v and all(ls.get(k) == want for k, want in labels.items()):
                    out["/".join(ls[k] for k in keys)] += int(v)
            return dict(sorted(out.items()))

        l3_objects = by("kvcellar_l3_objects_total", "tier", "op", "status")
        # Reads of objects the tier no longer had (evicted for capacity, evicted or expired by
        # Redis) out of all reads, per tier: what the index still named after the tier let go.
        stale = {t: round(l3_objects.get(f"{t}/get/not_found", 0) /
                          max(1, sum(v for k, v in l3_objects.items()
                                     if k.startswith(f"{t}/get/"))), 4)
                 for t in ("file", "redis")}
        redis_evicted = int(redis.cli("INFO", "stats").split("evicted_keys:")[1].split()[0])

        # Flat after warm-up: the end level (median of the samples in the last 20% of the
        # planned run, up to 5 s before its end, while every rank still runs) against the
        # warm-up's (median of its second half; threads: its highest sample, as gRPC's executor
        # adds threads under bursts and retires them later).
        samples = sampler.samples
        warm = SOAK_SECONDS * WARMUP_FRACTION
        warm_samples = [s for s in samples if warm * 0.5 <= s.t < warm]
        end_samples = [s for s in samples if SOAK_SECONDS * 0.8 <= s.t < SOAK_SECONDS - 5]
        post = [s for s in samples if warm <= s.t < SOAK_SECONDS - 5]
        assert warm_samples and end_samples, samples
        at_warm = {k: statistics.median(getattr(s, k) for s in warm_samples)
                   for k in ("rss", "anon", "fds", "threads")}
        at_end = {k: statistics.median(getattr(s, k) for s in end_samples)
                  for k in ("rss", "anon", "fds", "threads")}
        healthz = [s.healthz_s for s in samples]
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        summary = dict(
            seconds=round(elapsed), engine_runs=sum(s.runs for s in slots), kills=kills,
            cache_rpcs=by("kvcellar_rpc_requests_total", "code",
                          service="kvcellar.v1.CacheService"),
            daemon_ops=by("kvcellar_ops_total", "kind", "outcome"),
            lease_expiries=int(metric(d, "kvcellar_session_lease_expiries_total")),
            log_warnings=sum("level=warn" in l for l in d.lines),
            steps=steps, pages_loaded_verified=loaded, verified_mib=round(verified / 2**20),
            pages_prefetched_from_l3=prefetched, pages_stored=stored, l2_evicted=int(evicted),
            file_get_mib=mib(file_gets), redis_get_mib=mib(redis_gets), l3_objects=l3_objects,
            redis_watch=watch, redis_evicted_keys=redis_evicted, stale_l3_reads=stale,
            redis_removed_seen=int(metric(d, "kvcellar_l3_server_removed_objects_total")),
            samples=len(samples),
            # (warm-up level, end level, highest after warm-up)
            rss_mib=(mib(at_warm["rss"]), mib(at_end["rss"]), mib(max(s.rss for s in post))),
            rss_anon_mib=(mib(at_warm["anon"]), mib(at_end["anon"]),
                          mib(max(s.anon for s in post))),
            fds=(at_warm["fds"], at_end["fds"], max(s.fds for s in post)),
            threads=(max(s.threads for s in warm_samples), at_end["threads"],
                     max(s.threads for s in post)),
            healthz_max_ms=None if None in healthz else round(1000 * max(healthz)),
            load1_max=round(max(s.load1 for s in samples), 1))
        print("soak samples (s: RSS MiB/fds/threads):",
              " ".join(f"{s.t:.0f}:{s.rss / 2**20:.0f}/{s.fds}/{s.threads}" for s in samples))
        line = "soak summary: " + json.dumps(summary)
        print(line)
        if os.environ.get("KVCELLAR_SOAK_SUMMARY"):
            with open(os.environ["KVCELLAR_SOAK_SUMMARY"], "w") as f:
                f.write(line + "\n")
        assert None not in healthz and max(healthz) < HEALTHZ_BOUND_S, summary
        # Redis evicted pages all along; told of each, the index named almost none of them.
        # Measured (150 s): 9878 keys evicted, 1 stale read of 29,440; without the watch, 13% of
        # Redis reads were of objects already gone (5109 of 38,852).
        assert redis_evicted > 0, summary
        if watch == "true":
            assert stale["redis"] < 0.01, summary
        if SOAK_SECONDS < MIN_SECONDS_FOR_FLATNESS:
            return  # a quick try: its warm-up window falls in the fleet's ramp-up
        assert at_end["threads"] <= max(s.threads for s in warm_samples) + THREADS_SLACK, summary
        assert at_end["fds"] <= at_warm["fds"] + FDS_SLACK, summary
        assert at_end["rss"] <= at_warm["rss"] * (1 + RSS_SLACK_FRACTION) + RSS_SLACK_BYTES, summary
    finally:
        stop.set()
        d.stop()
        redis.stop()
        (tmp_path / "kvcellard.log").write_text(d.log())
