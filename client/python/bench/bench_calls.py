"""Per-call overhead of the kvcellar Python package against the C++ client, in one run.

The goal (issue text): Match, Load and Backup called from Python cost at most max(20 us, 10%)
more per call than the same calls from the C++ client, for 2048-page batches, with no per-page
Python loop on any path (tokens, keys and block lists pass as arrays).

This script starts kvcellard (sim device, temp socket) and runs, against that one daemon, the
C++ side, kvcellar_bench_pyclient (tests/bench/pyclient: the C++ client's Session::Match, Load,
Backup), and the same calls from the package: same shapes, same iteration counts, same request
options (the package's defaults: no pin or prefetch, Loads signalled per layer, Backups with a
ready token). The two sides take turns call by call (a pipe each way, tests/bench/pyclient/
lockstep.h): Python's call i, then C++'s call i, then Python's call i + 1, ... so that both
sides' figures come from the same moments of a shared, noisy machine. Each side has its own
engine instance and its own prompt (distinct tokens and Backup keys), so each hits only what it
backed up itself. Each round is one C++ process.

The table gives per call, as medians over the rounds: each side's p50, and what Python adds:
the median of the paired differences (Python's call i minus C++'s call i, made back to back),
which a slow moment of the machine shifts far less than it shifts either p50. The goal is judged
on that figure against max(20 us, 10% of the C++ p50).

Calls (every one a 2048-page batch; Match: every page an L2 hit):
    match_keys      Match with precomputed keys
    match_tokens    Match with token ids (the client computes the key chain)
    load            Load of the cached pages, submit + wait until DONE
    load_submit     the Load submission alone (the wait runs untimed after it)
    backup          Backup of fresh pages (new keys every call), submit + wait until DONE
    backup_submit   the Backup submission alone

Before the first round the pool is filled past its capacity (untimed), so every round's Backups
see the same steady state: each evicts about as much as it stores. Each page takes a whole pool slot
(64 KiB at least, whatever its object size), so one 2048-page Backup takes 128 MiB of the pool;
the default 1 GiB pool holds the two sides' pinned prompts and a few batches.

Runs under the project's virtual environment (deploy/install-deps.sh makes .venv; this script
needs only numpy from it), against the repository's build (kvcellard, libkvcellar-client.so,
kvcellar_bench_pyclient):

    .venv/bin/python client/python/bench/bench_calls.py                 # ~30 s on 2 cores
    .venv/bin/python client/python/bench/bench_calls.py --json          # machine-readable
    .venv/bin/python client/python/bench/bench_calls.py --rounds 9 --iterations 500

Binaries come from KVCELLAR_BIN_DIR (default build/bin); --bin-dir, --kvcellard and --cxx-bench
override. The native library is the package's usual one (KVCELLAR_CLIENT_LIBRARY, else
build/lib). Exit status: 0 when both sides ran every call (whether or not the goal was met; the
table says), 1 when a side failed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "client" / "python"))

from kvcellard_process import BIN_DIR, Daemon, parse_log_line  # noqa: E402

import kvcellar  # noqa: E402
from kvcellar import _native as N  # noqa: E402
from kvcellar.layout import Buffer, Region  # noqa: E402

# (row name, the C++ benchmark's name), in the order both sides run them.
CALLS = [
    ("match_keys", "BM_MatchKeys"),
    ("match_tokens", "BM_MatchTokens"),
    ("load", "BM_Load"),
    ("load_submit", "BM_LoadSubmit"),
    ("backup", "BM_Backup"),
    ("backup_submit", "BM_BackupSubmit"),
]
# The goal: Python may add max(GOAL_ABS_US, GOAL_REL * C++) per call.
GOAL_ABS_US = 20.0
GOAL_REL = 0.10
# A tokenizer vocabulary of the usual size, as the C++ side draws its tokens from.
VOCAB = 128000
# Seeds of the C++ runs; the Python side's tokens and keys come from its own generator.
CXX_SEED_BASE = 1000
MODEL = "kvcellar-bench-pyclient"  # The C++ side's default namespace model: one namespace.
# Longest wait for one op (the package's default wait()).
OP_WAIT_MS = 5000
# Longest wait for the C++ side's turn (its slowest call, or its setup: registering and caching
# its prompt) on a loaded 2-core machine, with a wide margin; only there so a stuck peer fails.
TURN_TIMEOUT_S = 120
# The prompt's pin lasts the whole benchmark: the daemon's longest lease (server/config/cache_limits.h).
PIN_LEASE_MS = 3600 * 1000
# Backup-and-pin attempts for the prompt (see PyCalls.cache_prompt).
CACHE_ATTEMPTS = 5


@dataclass
class Shape:
    pages: int
    layers: int
    bytes_per_block: int
    page_size: int

    @property
    def blocks(self) -> int:
        return 2 * self.pages  # Backup reads [0, pages), Load writes [pages, 2 * pages).

    @property
    def object_bytes(self) -> int:
        return self.layers * 2 * self.bytes_per_block


# ---- the Python side --------------------------------------------------------------------------


class PyCalls:
    """One sim engine registered through the package, and the calls of CALLS on it. Every call
    passes whole arrays: no Python loop runs per page anywhere on these paths."""

    def __init__(self, socket: str, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.client = kvcellar.Client(socket, rpc_timeout_ms=5000)
        self.dev = kvcellar.SimDevice("pybench")
        # [layer][K, V][block] in one shared-memory object, as the C++ SimEngine arranges it
        # (kLayerFirst). The layout is described directly rather than derived from torch tensors
        # (KvLayout.from_block_tensors): the calls timed here never look at it, and this process
        # then holds no torch, like the C++ one.
        mem = self.dev.alloc(shape.layers * 2 * shape.blocks * shape.bytes_per_block)
        buf = shape.blocks * shape.bytes_per_block
        layout = kvcellar.KvLayout(
            [Region(mem.name, 0, mem.nbytes)],
            [(Buffer(0, (2 * layer) * buf, shape.bytes_per_block, shape.bytes_per_block),
              Buffer(0, (2 * layer + 1) * buf, shape.bytes_per_block, shape.bytes_per_block))
             for layer in range(shape.layers)],
            shape.blocks, N.DEVICE_SIM, device_name="sim", dtype="bfloat16",
            tokens_per_block=shape.page_size)
        ns = kvcellar.Namespace(MODEL, "rev1", "bf16", shape.page_size)
        self.session = self.client.register(f"pyclient-py-{os.getpid()}", ns, layout=layout)
        if not self.session.wait_active(10000):
            raise RuntimeError(f"session not active: {self.session.state}")
        self.tokens = self.rng.integers(0, VOCAB, shape.pages * shape.page_size, dtype=np.uint32)
        self.keys = self.session.keys(self.tokens)
        self.src = np.arange(shape.pages, dtype=np.uint32)
        self.dst = np.arange(shape.pages, 2 * shape.pages, dtype=np.uint32)
        self.pin = self.cache_prompt()

    def fresh_keys(self) -> np.ndarray:
        return self.rng.integers(0, 256, (self.shape.pages, 32), dtype=np.uint8)

    def cache_prompt(self) -> int:
        """Backs the prompt up and pins it for the whole benchmark; the pin id. Pinned because
        in a full pool the daemon evicts pages seen once first (s3fifo), and a freshly backed-up
        prompt is such pages; retried because that can happen before the pinning Match."""
        error = ""
        for _ in range(CACHE_ATTEMPTS):
            st = self.session.backup(self.keys, self.src).wait(OP_WAIT_MS)
            if not st.done:
                raise RuntimeError(f"caching the prompt: {st}")
            r = self.session.match([self.tokens], pin=True, pin_lease_ms=PIN_LEASE_MS,
                                   prefetch="none").results[0]
            if r.l2_hit_pages == self.shape.pages and r.pin_id:
                return r.pin_id
            if r.pin_id:
                self.session.release([r.pin_id])
            error = f"after Backup, Match hit {r.l2_hit_pages}/{self.shape.pages}"
        raise RuntimeError(f"caching the prompt: {error}")

    def fill_pool(self, pool_bytes: int, slot_bytes: int) -> None:
        """Backs up fresh pages past the pool's capacity: the steady state (untimed)."""
        for _ in range(pool_bytes // (self.shape.pages * slot_bytes) + 2):
            st = self.session.backup(self.fresh_keys(), self.src).wait(OP_WAIT_MS)
            if not st.done:
                raise RuntimeError(f"filling the pool: {st}")

    def cases(self) -> dict[str, tuple[Optional[Callable[[], Any]], Callable[[Any], Any],
                                       Callable[[Any], Optional[str]]]]:
        """name -> (prepare: untimed, its result given to call; call: timed; finish: untimed,
        an error or None)."""
        s, pages = self.session, self.shape.pages
        keys, tokens, src, dst = self.keys, self.tokens, self.src, self.dst

        def hits(reply: Any) -> Optional[str]:
            hit = reply.results[0].l2_hit_pages
            return None if hit == pages else f"Match hit {hit}/{pages}: {reply.reason}"

        def done(st: Any) -> Optional[str]:
            ok = st.leading_ok_pages[0] if st.leading_ok_pages else 0
            return None if st.done and ok == pages else f"op {st.state}, {ok}/{pages} pages"

        return {
            "match_keys": (None, lambda _: s.match([keys], by_keys=True, prefetch="none"), hits),
            "match_tokens": (None, lambda _: s.match([tokens], prefetch="none"), hits),
            "load": (None, lambda _: s.load(keys, dst).wait(OP_WAIT_MS), done),
            "load_submit": (None, lambda _: s.load(keys, dst),
                            lambda op: done(op.wait(OP_WAIT_MS))),
            "backup": (self.fresh_keys, lambda k: s.backup(k, src).wait(OP_WAIT_MS), done),
            "backup_submit": (self.fresh_keys, lambda k: s.backup(k, src),
                              lambda op: done(op.wait(OP_WAIT_MS))),
        }

    def run(self, iterations: int, warmup: int,
            turn: Callable[[], None]) -> dict[str, list[float]]:
        """One round: every case in CALLS order, warm-up then timed calls, handing the turn to
        the C++ side after each call (``turn`` returns once it has made its own); per case, the
        timed calls' durations in us."""
        clock = time.perf_counter_ns
        cases = self.cases()
        out = {}
        for name, _ in CALLS:
            prepare, call, finish = cases[name]
            us = []
            for i in range(warmup + iterations):
                arg = prepare() if prepare is not None else None
                t0 = clock()
                result = call(arg)
                t1 = clock()
                error = finish(result)
                if error:
                    raise RuntimeError(f"python {name}: {error}")
                if i >= warmup:
                    us.append((t1 - t0) / 1e3)
                turn()
            out[name] = us
        return out

    def close(self) -> None:
        self.session.release([self.pin])
        self.session.close()
        self.client.close()
        self.dev.close()


def quantiles(us: list[float]) -> dict[str, float]:
    """Nearest-rank quantiles, as the C++ side computes them (CallSamples::Quantile)."""
    s = sorted(us)

    def q(p: float) -> float:
        rank = int(np.ceil(p * len(s)))
        return s[min(len(s) - 1, max(rank, 1) - 1)]

    return {"p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99),
            "mean_us": float(np.mean(s)), "min_us": s[0]}


# ---- the C++ side -----------------------------------------------------------------------------


class CxxRound:
    """One kvcellar_bench_pyclient process in lockstep with this one (lockstep.h): it passes
    the turn once set up, then makes one call per turn it is given."""

    def __init__(self, binary: str, socket: str, shape: Shape, iterations: int, warmup: int,
                 seed: int, workdir: Path) -> None:
        self.iterations = iterations
        self.out_json = workdir / f"cxx-{seed}.json"
        self.samples_path = workdir / f"cxx-{seed}.samples"
        self.log_path = workdir / f"cxx-{seed}.log"
        go_r, self._go = os.pipe()  # our turn is over: C++ calls
        self._done, done_w = os.pipe()  # C++'s turn is over
        cmd = cxx_command(binary, socket, shape, iterations, warmup, seed, self.out_json)
        cmd += [f"--pyclient_lockstep={go_r},{done_w}", f"--pyclient_samples={self.samples_path}"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(go_r, done_w))
        os.close(go_r)
        os.close(done_w)
        self._open = True

    def await_turn(self) -> None:
        ready, _, _ = select.select([self._done], [], [], TURN_TIMEOUT_S)
        if not ready or os.read(self._done, 1) != b"t":
            raise RuntimeError(f"the C++ side stopped: {self.failure()}")

    def turn(self) -> None:
        """Passes the turn and waits for it to come back."""
        try:
            os.write(self._go, b"t")
        except BrokenPipeError:
            raise RuntimeError(f"the C++ side stopped: {self.failure()}") from None
        self.await_turn()

    def close(self) -> None:
        """Ends the lockstep (a C++ side still waiting stops) and waits for the process."""
        if self._open:
            self._open = False
            os.close(self._go)
            os.close(self._done)
        try:
            self.proc.wait(TURN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def failure(self) -> str:
        self.close()
        for _, bm in CALLS:
            b = self._benchmarks().get(bm, {})
            if b.get("error_occurred"):
                return f"{bm}: {b.get('error_message')}"
        return f"exit status {self.proc.returncode}; log:\n{self.log_path.read_text()}"

    def _benchmarks(self) -> dict[str, dict]:
        try:
            doc = json.loads(self.out_json.read_text())
        except (OSError, ValueError):
            return {}
        # "BM_Load/iterations:300/manual_time" -> "BM_Load"
        return {b["name"].split("/")[0]: b for b in doc.get("benchmarks", [])}

    def results(self) -> dict[str, list[float]]:
        """Per case, the timed calls' durations in us, once every turn is taken."""
        self.close()
        if self.proc.returncode != 0:
            raise RuntimeError(f"the C++ side: {self.failure()}")
        by_name = self._benchmarks()
        for _, bm in CALLS:
            if bm not in by_name:
                raise RuntimeError(f"the C++ side has no {bm}: {sorted(by_name)}")
            if by_name[bm].get("error_occurred"):
                raise RuntimeError(f"the C++ side: {bm}: {by_name[bm].get('error_message')}")
        samples = {}
        for line in self.samples_path.read_text().splitlines():
            bm, *values = line.split()
            samples[bm] = [float(v) for v in values]
        out = {}
        for name, bm in CALLS:
            if len(samples.get(bm, ())) != self.iterations:
                raise RuntimeError(f"the C++ side wrote {len(samples.get(bm, ()))} samples of "
                                   f"{bm}, not {self.iterations}")
            out[name] = samples[bm]
        return out


def cxx_command(binary: str, socket: str, shape: Shape, iterations: int, warmup: int, seed: int,
                out_json: Path) -> list[str]:
    return [binary, f"--socket={socket}", f"--pyclient_iterations={iterations}",
           f"--pyclient_warmup={warmup}", f"--pyclient_pages={shape.pages}",
           f"--pyclient_layers={shape.layers}",
           f"--pyclient_bytes_per_block={shape.bytes_per_block}",
           f"--pyclient_page_size={shape.page_size}", f"--pyclient_model={MODEL}",
           f"--pyclient_seed={seed}", f"--pyclient_instance=pyclient-cxx-{seed}",
           f"--benchmark_out={out_json}", "--benchmark_out_format=json"]


# ---- the comparison ---------------------------------------------------------------------------


def compare(rounds: list[tuple[dict[str, list[float]], dict[str, list[float]]]]
            ) -> list[dict[str, Any]]:
    """One row per call from the rounds' (C++, Python) samples; see the module docstring."""
    rows = []
    for name, _ in CALLS:
        cq = [quantiles(c[name]) for c, _ in rounds]
        pq = [quantiles(p[name]) for _, p in rounds]
        added = [statistics.median(np.subtract(p[name], c[name])) for c, p in rounds]
        c50 = statistics.median(q["p50_us"] for q in cq)
        p50 = statistics.median(q["p50_us"] for q in pq)
        add = statistics.median(added)
        limit = max(GOAL_ABS_US, GOAL_REL * c50)
        rows.append({
            "call": name,
            "cxx_p50_us": c50,
            "py_p50_us": p50,
            "added_us": add,
            "p50_diff_us": p50 - c50,
            "ratio": p50 / c50 if c50 else float("inf"),
            "limit_us": limit,
            "meets_goal": bool(add <= limit),
            "cxx_p90_us": statistics.median(q["p90_us"] for q in cq),
            "py_p90_us": statistics.median(q["p90_us"] for q in pq),
            "rounds": [{"cxx": c, "py": p, "added_us": a} for c, p, a in zip(cq, pq, added)],
        })
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, shape: Shape) -> None:
    print(f"{shape.pages}-page batches, {shape.layers} layer(s) x 2 x {shape.bytes_per_block} B "
          f"per block; {args.rounds} rounds of {args.iterations} timed calls per side and call, "
          f"the sides taking turns call by call; medians over the rounds")
    print(f"goal: Python adds <= max({GOAL_ABS_US:g} us, {GOAL_REL:.0%} of the C++ p50); added = "
          f"median of paired differences (Python call i - C++ call i)")
    print()
    print("| call | C++ p50 us | Python p50 us | added us | p50 diff us | ratio | limit us "
          "| meets goal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['call']} | {r['cxx_p50_us']:.1f} | {r['py_p50_us']:.1f} | "
              f"{r['added_us']:+.1f} | {r['p50_diff_us']:+.1f} | {r['ratio']:.3f} | "
              f"{r['limit_us']:.1f} | {'yes' if r['meets_goal'] else 'NO'} |")
    print()
    print("per round, us: C++ p50 / Python p50 / added")
    for r in rows:
        cells = "  ".join(f"{x['cxx']['p50_us']:.0f}/{x['py']['p50_us']:.0f}/{x['added_us']:+.0f}"
                          for x in r["rounds"])
        print(f"  {r['call']:<14} {cells}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300,
                    help="timed calls per side, call and round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls before them")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (a C++ process each)")
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--bytes-per-block", type=int, default=256, help="per layer per K/V buffer")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-mib", type=int, default=1024,
                    help="kvcellard pool.capacity (a multiple of 64, at least 512), filled "
                         "before the runs")
    ap.add_argument("--bin-dir", default=BIN_DIR, help="default: $KVCELLAR_BIN_DIR or build/bin")
    ap.add_argument("--kvcellard", help="default: BIN_DIR/kvcellard")
    ap.add_argument("--cxx-bench", help="default: BIN_DIR/kvcellar_bench_pyclient")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if min(args.iterations, args.rounds, args.pages) <= 0 or args.warmup < 0:
        ap.error("--iterations, --rounds and --pages must be > 0, --warmup >= 0")
    shape = Shape(args.pages, args.layers, args.bytes_per_block, args.page_size)
    kvcellard = args.kvcellard or os.path.join(args.bin_dir, "kvcellard")
    cxx_bench = args.cxx_bench or os.path.join(args.bin_dir, "kvcellar_bench_pyclient")
    for path in (kvcellard, cxx_bench):
        if not os.access(path, os.X_OK):
            print(f"bench_calls: {path} not found (build it, or give --bin-dir)", file=sys.stderr)
            return 1

    def log(msg: str) -> None:
        print(f"bench_calls: {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvcellar-pybench-") as tmp:
        workdir = Path(tmp)
        daemon = Daemon(workdir, args=["--set", "device.kind=sim",
                                       "--set", f"pool.capacity={args.pool_mib}MiB"])
        daemon.args[0] = kvcellard
        daemon.start()
        py = None
        try:
            py = PyCalls(daemon.socket, shape, seed=int.from_bytes(os.urandom(8), "little"))
            # The slot each page takes in the pool, fixed when the namespace first registered.
            geometry = parse_log_line(daemon.wait_for_line(
                f'msg="namespace geometry fixed".* model_id={MODEL} '))
            slot_bytes = int(geometry["slot_bytes"])
            log(f"kvcellard on {daemon.socket}; {slot_bytes} B slots per page; filling the "
                f"{args.pool_mib} MiB pool")
            py.fill_pool(args.pool_mib << 20, slot_bytes)
            rounds = []
            for r in range(args.rounds):
                log(f"round {r + 1}/{args.rounds}")
                cxx = CxxRound(cxx_bench, daemon.socket, shape, args.iterations, args.warmup,
                               CXX_SEED_BASE + r, workdir)
                try:
                    cxx.await_turn()  # set up
                    py_samples = py.run(args.iterations, args.warmup, cxx.turn)
                    rounds.append((cxx.results(), py_samples))
                finally:
                    cxx.close()
        except (RuntimeError, AssertionError, subprocess.TimeoutExpired) as e:
            print(f"bench_calls: {e}", file=sys.stderr)
            return 1
        finally:
            if py is not None:
                py.close()
            daemon.stop()

    rows = compare(rounds)
    if args.json:
        json.dump({"shape": {"pages": shape.pages, "layers": shape.layers,
                             "bytes_per_block": shape.bytes_per_block,
                             "page_size": shape.page_size},
                   "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds,
                   "goal": {"abs_us": GOAL_ABS_US, "rel": GOAL_REL},
                   "library": kvcellar.LIBRARY_PATH, "cxx_bench": cxx_bench, "rows": rows},
                  sys.stdout, indent=2)
        print()
    else:
        print_table(rows, args, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
