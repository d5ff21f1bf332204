"""Per-call overhead of the kvcellar Python package against the C++ client, in one run.

The goal (issue text): Match, Load and Backup called from Python cost at most max(20 us, 10%)
more per call than the same calls from the C++ client, for 2048-page batches, with no per-page
Python loop on any path (tokens, keys and block lists pass as arrays).

This script starts kvcellard (sim device, temp socket), then alternates runs of the two sides
against that one daemon: kvcellar_bench_pyclient (tests/bench/pyclient: the C++ client's
Session::Match/Load/Backup) and the same calls from the package, same shapes, same iteration
counts, same request options (the package's defaults: no pin or prefetch, Loads signalled per
layer, Backups with a ready token). C++ runs first and last, so every Python run sits between two
C++ runs: C, Py, C, Py, ..., C. Each run reports a p50 per call; the table gives the median of
those p50s per side. Each side has its own engine instance and its own prompt (distinct tokens
and Backup keys), so each hits only what it backed up itself.

Calls (every one a 2048-page batch; Match: every page an L2 hit):
    match_keys      Match with precomputed keys
    match_tokens    Match with token ids (the client computes the key chain)
    load            Load of the cached pages, submit + wait until DONE
    load_submit     the Load submission alone (the wait runs untimed after it)
    backup          Backup of fresh pages (new keys every call), submit + wait until DONE
    backup_submit   the Backup submission alone

Before the first run the pool is filled past its capacity (untimed), so every run's Backups see
the same steady state: each evicts about as much as it stores.

Runs under the project's virtual environment (deploy/install-deps.sh makes .venv with numpy and
torch; the package's sim device allocates its KV tensors with torch), against the repository's
build (kvcellard, libkvcellar-client.so, kvcellar_bench_pyclient):

    .venv/bin/python client/python/bench/bench_calls.py                 # ~20 s on 2 cores
    .venv/bin/python client/python/bench/bench_calls.py --json          # machine-readable
    .venv/bin/python client/python/bench/bench_calls.py --rounds 5 --iterations 500

Binaries come from KVCELLAR_BIN_DIR (default build/bin); --bin-dir, --kvcellard and --cxx-bench
override. The native library is the package's usual one (KVCELLAR_CLIENT_LIBRARY, else
build/lib). Exit status: 0 when both sides ran every call (whether or not the goal was met; the
table says), 1 when a side failed.
"""

from __future__ import annotations

import argparse
import json
import os
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

from kvcellard_process import BIN_DIR, Daemon  # noqa: E402

import kvcellar  # noqa: E402

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
# A C++ run setting up and timing every call; generous for a loaded 2-core machine.
CXX_RUN_TIMEOUT_S = 600


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
        import torch

        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self.client = kvcellar.Client(socket, rpc_timeout_ms=5000)
        self.dev = kvcellar.SimDevice("pybench")
        if shape.bytes_per_block % 2:
            raise ValueError("bytes_per_block must be even (bf16 elements)")
        # [layer][K, V][block]: one allocation, as the C++ SimEngine arranges it (kLayerFirst).
        raw = self.dev.empty((shape.layers, 2, shape.blocks, shape.bytes_per_block // 2),
                             torch.bfloat16)
        layout = kvcellar.KvLayout.from_block_tensors(
            [raw[layer, 0] for layer in range(shape.layers)],
            [raw[layer, 1] for layer in range(shape.layers)], device=self.dev)
        ns = kvcellar.Namespace(MODEL, "rev1", "bf16", shape.page_size)
        self.session = self.client.register(f"pyclient-py-{os.getpid()}", ns, layout=layout)
        if not self.session.wait_active(10000):
            raise RuntimeError(f"session not active: {self.session.state}")
        self.tokens = self.rng.integers(0, VOCAB, shape.pages * shape.page_size, dtype=np.uint32)
        self.keys = self.session.keys(self.tokens)
        self.src = np.arange(shape.pages, dtype=np.uint32)
        self.dst = np.arange(shape.pages, 2 * shape.pages, dtype=np.uint32)

    def fresh_keys(self) -> np.ndarray:
        return self.rng.integers(0, 256, (self.shape.pages, 32), dtype=np.uint8)

    def cache_prompt(self) -> None:
        """Backs the prompt up (again: another run's Backups may have evicted it) and checks
        that a Match hits every page."""
        st = self.session.backup(self.keys, self.src).wait(OP_WAIT_MS)
        if not st.done:
            raise RuntimeError(f"caching the prompt: {st}")
        hit = self.session.match([self.tokens], prefetch="none").results[0].l2_hit_pages
        if hit != self.shape.pages:
            raise RuntimeError(f"after Backup, Match hit {hit}/{self.shape.pages}")

    def fill_pool(self, pool_bytes: int) -> None:
        """Backs up fresh pages past the pool's capacity: the steady state (untimed)."""
        for _ in range(pool_bytes // (self.shape.pages * self.shape.object_bytes) + 2):
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

    def run(self, iterations: int, warmup: int) -> dict[str, dict[str, float]]:
        """One run: every case, warm-up then timed calls; per-case quantiles in us."""
        self.cache_prompt()
        clock = time.perf_counter_ns
        out = {}
        for name, (prepare, call, finish) in self.cases().items():
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
            out[name] = quantiles(us)
        return out

    def close(self) -> None:
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


def run_cxx(binary: str, socket: str, shape: Shape, iterations: int, warmup: int, seed: int,
            workdir: Path) -> dict[str, dict[str, float]]:
    """One kvcellar_bench_pyclient run; per-case quantiles in us."""
    out_json = workdir / f"cxx-{seed}.json"
    cmd = [binary, f"--socket={socket}", f"--pyclient_iterations={iterations}",
           f"--pyclient_warmup={warmup}", f"--pyclient_pages={shape.pages}",
           f"--pyclient_layers={shape.layers}",
           f"--pyclient_bytes_per_block={shape.bytes_per_block}",
           f"--pyclient_page_size={shape.page_size}", f"--pyclient_model={MODEL}",
           f"--pyclient_seed={seed}", f"--pyclient_instance=pyclient-cxx-{seed}",
           f"--benchmark_out={out_json}", "--benchmark_out_format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CXX_RUN_TIMEOUT_S)
    if proc.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n"
                           f"{proc.stderr}")
    doc = json.loads(out_json.read_text())
    by_name = {b["name"]: b for b in doc["benchmarks"]}
    out = {}
    for name, bm in CALLS:
        b = by_name.get(bm) or by_name.get(f"{bm}/iterations:{iterations}/manual_time")
        if b is None:
            raise RuntimeError(f"C++ run has no {bm}: {sorted(by_name)}")
        if b.get("error_occurred"):
            raise RuntimeError(f"C++ {bm}: {b.get('error_message')}")
        out[name] = {k: float(b[k]) for k in ("p50_us", "p90_us", "p99_us", "mean_us", "min_us")}
    return out


# ---- the comparison ---------------------------------------------------------------------------


def compare(cxx_runs: list[dict], py_runs: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for name, _ in CALLS:
        c = [r[name]["p50_us"] for r in cxx_runs]
        p = [r[name]["p50_us"] for r in py_runs]
        c50, p50 = statistics.median(c), statistics.median(p)
        limit = max(GOAL_ABS_US, GOAL_REL * c50)
        rows.append({
            "call": name,
            "cxx_p50_us": c50,
            "py_p50_us": p50,
            "diff_us": p50 - c50,
            "ratio": p50 / c50 if c50 else float("inf"),
            "limit_us": limit,
            "meets_goal": p50 - c50 <= limit,
            "cxx_run_p50s_us": c,
            "py_run_p50s_us": p,
            "cxx_p90_us": statistics.median(r[name]["p90_us"] for r in cxx_runs),
            "py_p90_us": statistics.median(r[name]["p90_us"] for r in py_runs),
        })
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, shape: Shape) -> None:
    print(f"{shape.pages}-page batches, {shape.layers} layer(s) x 2 x {shape.bytes_per_block} B "
          f"per block; {args.rounds} Python runs between {args.rounds + 1} C++ runs of "
          f"{args.iterations} timed calls each; median of the runs' p50s")
    print(f"goal: Python - C++ <= max({GOAL_ABS_US:g} us, {GOAL_REL:.0%} of C++)")
    print()
    print("| call | C++ p50 us | Python p50 us | diff us | ratio | limit us | meets goal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['call']} | {r['cxx_p50_us']:.1f} | {r['py_p50_us']:.1f} | "
              f"{r['diff_us']:+.1f} | {r['ratio']:.3f} | {r['limit_us']:.1f} | "
              f"{'yes' if r['meets_goal'] else 'NO'} |")
    print()
    print("per-run p50s (us), C++ | Python:")
    for r in rows:
        c = " ".join(f"{v:.1f}" for v in r["cxx_run_p50s_us"])
        p = " ".join(f"{v:.1f}" for v in r["py_run_p50s_us"])
        print(f"  {r['call']:<14} {c} | {p}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300, help="timed calls per case per run")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls before them")
    ap.add_argument("--rounds", type=int, default=3,
                    help="Python runs (C++ runs: one more, before and after each)")
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--bytes-per-block", type=int, default=256, help="per layer per K/V buffer")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-mib", type=int, default=256,
                    help="kvcellard pool.capacity (a multiple of 64), filled before the runs")
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
            log(f"kvcellard on {daemon.socket}; filling the {args.pool_mib} MiB pool")
            py.fill_pool(args.pool_mib << 20)
            cxx_runs, py_runs = [], []
            for r in range(args.rounds + 1):
                log(f"C++ run {r + 1}/{args.rounds + 1}")
                cxx_runs.append(run_cxx(cxx_bench, daemon.socket, shape, args.iterations,
                                        args.warmup, CXX_SEED_BASE + r, workdir))
                if r < args.rounds:
                    log(f"Python run {r + 1}/{args.rounds}")
                    py_runs.append(py.run(args.iterations, args.warmup))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"bench_calls: {e}", file=sys.stderr)
            return 1
        finally:
            if py is not None:
                py.close()
            daemon.stop()

    rows = compare(cxx_runs, py_runs)
    if args.json:
        json.dump({"shape": {"pages": shape.pages, "layers": shape.layers,
                             "bytes_per_block": shape.bytes_per_block,
                             "page_size": shape.page_size},
                   "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds,
                   "goal": {"abs_us": GOAL_ABS_US, "rel": GOAL_REL},
                   "library": kvcellar.LIBRARY_PATH, "cxx_bench": cxx_bench, "rows": rows,
                   "cxx_runs": cxx_runs, "py_runs": py_runs}, sys.stdout, indent=2)
        print()
    else:
        print_table(rows, args, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
