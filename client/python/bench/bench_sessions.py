"""What registered sessions cost kvcellard (#29 item 3, "the cost of scale"): the daemon's memory
per session and a Match's latency with 1 and with N sessions registered, in one run against one
daemon.

It starts kvcellard (sim device, temp socket), registers one scheduler session and times a
2048-page Match by keys (the same prompt every call, half of its pages backed up once through
a sim engine so that the Match walks the index and hits), then registers N - 1 more sessions
(scheduler sessions of other instances in the same namespace, as the ranks of many engines
would be), lets their heartbeats run, and times the same Match again. The daemon's memory is
its VmRSS and RssAnon from /proc, read after each phase settles.

    .venv/bin/python client/python/bench/bench_sessions.py              # 1,000 sessions, ~20 s
    .venv/bin/python client/python/bench/bench_sessions.py --sessions 4000

Binaries come from KVCELLAR_BIN_DIR (default build/bin); the package's native library as usual.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_calls as bc  # noqa: E402
from kvcellard_process import Daemon  # noqa: E402

import kvcellar  # noqa: E402


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            out[name] = int(rest.split()[0])
    return out


def settle() -> None:
    time.sleep(2.0)  # Registrations answered, a heartbeat round or two made.


def time_match(session, keys: np.ndarray, calls: int) -> tuple[float, float]:
    us = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        m = session.match([keys], by_keys=True, prefetch="none")
        us.append((time.perf_counter_ns() - t0) / 1e3)
        if not m.ok:
            raise RuntimeError(f"Match: {m.reason}")
    us.sort()
    return statistics.median(us), us[int(len(us) * 0.99)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--pages", type=int, default=2048)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvc-sessions-") as tmp:
        daemon = Daemon(Path(tmp), args=["--set", "pool.capacity=1GiB"]).start()
        pid = daemon.proc.pid
        try:
            # One sim engine backs up half the prompt, so that the Match walks the index and hits.
            py = bc.PyCalls(daemon.socket, bc.Shape(args.pages // 2, 1, 256, 16), seed=3)
            keys = np.concatenate([py.keys, np.random.default_rng(4).integers(
                0, 256, (args.pages - len(py.keys), 32), dtype=np.uint8)])
            ns = kvcellar.Namespace(bc.MODEL, "rev1", "bf16", 16)
            client = kvcellar.Client(daemon.socket, rpc_timeout_ms=5000)
            first = client.register("sessions-0", ns, scheduler=True)
            if not first.wait_active(10000):
                raise RuntimeError("the first session did not become active")
            settle()
            mem1 = memory_kib(pid)
            p50_1, p99_1 = time_match(first, keys, args.calls)
            hit = first.match([keys], by_keys=True, prefetch="none").results[0].l2_hit_pages

            t0 = time.perf_counter()
            sessions = [client.register(f"sessions-{i}", ns, scheduler=True)
                        for i in range(1, args.sessions)]
            inactive = sum(not s.wait_active(10000) for s in sessions)
            register_s = time.perf_counter() - t0
            settle()
            mem_n = memory_kib(pid)
            p50_n, p99_n = time_match(first, keys, args.calls)
            for s in sessions:
                s.close()
            client.close()
            py.close()
        finally:
            daemon.stop()

    n = args.sessions
    per_rss = (mem_n["VmRSS"] - mem1["VmRSS"]) * 1024 / (n - 1)
    per_anon = (mem_n["RssAnon"] - mem1["RssAnon"]) * 1024 / (n - 1)
    print(f"{n} sessions ({inactive} not active), registered in {register_s:.2f} s; Match of "
          f"{args.pages} pages ({hit} L2 hits), {args.calls} calls per phase")
    print("| sessions | daemon VmRSS MiB | RssAnon MiB | Match p50 us | Match p99 us |")
    print("|---|---|---|---|---|")
    print(f"| 1 | {mem1['VmRSS'] / 1024:.1f} | {mem1['RssAnon'] / 1024:.1f} | {p50_1:.1f} | "
          f"{p99_1:.1f} |")
    print(f"| {n} | {mem_n['VmRSS'] / 1024:.1f} | {mem_n['RssAnon'] / 1024:.1f} | {p50_n:.1f} | "
          f"{p99_n:.1f} |")
    print(f"per session: {per_rss / 1024:.1f} KiB VmRSS, {per_anon / 1024:.1f} KiB RssAnon; "
          f"Match p50 with {n} sessions / with 1: {p50_n / p50_1:.2f}x")
    return 1 if inactive else 0


if __name__ == "__main__":
    sys.exit(main())
