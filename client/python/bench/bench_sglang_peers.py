"""kvcellar beside SGLang's own `file` storage backend and Mooncake's store, all driven by SGLang
0.5.23's own HiCacheController as a scheduler drives it (#29 item 2), in one run, same host pools,
same prompts.

The workload is multi-turn, as kvcellar-bench's and SGLang HiCache's own benchmark: C
conversations of R rounds, each round adding P pages to its conversation, served round-robin
(every conversation's round r before any round r+1). Per backend, with fresh controllers (an
"engine" is a HiCacheController over its own host pool):
    backup      engine A write_storage()s each round's new pages as the radix node under the
                conversation so far (prefix_keys: the earlier rounds' page hashes), with the
                controller's own backup path (kvcellar's zero-copy batch_set_v1, the file
                backend's page-by-page batch_set, Mooncake's batch put), until each op is
                acknowledged; pages/s and GB/s
    second      engine B, a second engine of the same model, prefetches every conversation's
                whole history (R x P pages) through the controller (prefetch, hit query, host
                buffers, transfer): share of the pages it found, GB/s
    restart     engine A is closed and made again (an engine restart), then prefetches every
                conversation: share found
    restore     the time for engine B to prefetch a 16K-token prompt (1,024 pages of 16 tokens)
                into its host pool, from the prefetch call to the last acknowledgement
Every prefetched page is compared with what engine A wrote.

kvcellar: kvcellard (sim device, its pool in shared memory) with the backend in
`kvcellar.integrations.sglang`. file: SGLang's HiCacheFile, a file per page under a temporary
directory on this machine's disk (`file_storage_path`). mooncake: SGLang's MooncakeStore
(`storage_backend="mooncake"`) against Mooncake 0.3.13's store as a node runs it without RDMA:
`mooncake_master` with its HTTP metadata server, and one standalone `mooncake_client` holding
the node's memory segment (the size of kvcellard's pool), which the engines reach over Mooncake's
TCP transfer engine and contribute no memory to (`global_segment_size` 0): the layout in which
pages outlive the engine that wrote them, as they do in kvcellard. (An engine that contributes
its own segment takes the pages stored there with it when it stops.) The package is
`mooncake-transfer-engine-non-cuda` (the CUDA build needs libcuda and libcudart to import).

    .venv-sglang/bin/python client/python/bench/bench_sglang_peers.py          # about a minute
    .venv-sglang/bin/python client/python/bench/bench_sglang_peers.py --json

Default geometry: 4 layers of 8 KV heads of 128, bf16, 16-token pages: 256 KiB per page;
32 conversations of 4 rounds of 16 pages (2,048 pages, 512 MiB), and the 16K-token prompt
(256 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))
sys.path.insert(0, str(ROOT / "client" / "python" / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang_util import (controller_backup, controller_prefetch, extra_config,  # noqa: E402
                         fill_host_pages, host_pages, init_single_rank)
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

MODEL = "bench-org/peers-llama"
OP_TIMEOUT_S = 120


class Engine:
    """One scheduler's HiCacheController over its own host pool, with `backend` behind it."""

    def __init__(self, args: argparse.Namespace, backend: str, config: dict[str, Any]) -> None:
        self.page = args.page_size
        tokens = max(args.rounds * args.round_pages,
                     args.restore_tokens // args.page_size) * self.page * 2
        dev = MHATokenToKVPool(tokens, self.page, torch.bfloat16, args.heads, args.head_dim,
                               args.layers, "cpu", False, start_layer=0, end_layer=args.layers)
        with host_memory_budget_scope(psutil.virtual_memory().available):
            self.host = MHATokenToKVPoolHost(
                dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, self.page, "page_first",
                pin_memory=False, device="cpu", allocator_type="shm", device_capacity_tokens=dev.size,
                start_layer=0, end_layer=args.layers)
        alloc = PagedTokenToKVPoolAllocator(tokens, self.page, torch.bfloat16, "cpu", dev, False)
        self.ctl = HiCacheController(alloc, self.host, self.page, dist.group.WORLD,
                                     threading.Event(), write_policy="write_through",
                                     io_backend="direct", storage_backend=backend,
                                     model_name=MODEL, storage_backend_extra_config=config)
        self.rid = 0
        self.page_bytes = self.host.get_dummy_flat_data_page().numel() * 2

    def close(self) -> None:
        self.ctl.detach_storage_backend()

    def write(self, pages: int, seed: int) -> Any:
        """Host slots holding `pages` pages of random KV, as a device->host copy leaves them."""
        idx = self.host.alloc(pages * self.page)
        if idx is None:
            raise RuntimeError("host pool full")
        fill_host_pages(self.host, idx, self.page, seed)
        return idx

    def pages(self, idx: Any) -> list:
        return host_pages(self.host, idx, self.page)

    def backup(self, idx: Any, tokens: list[int]) -> int:
        return controller_backup(self.ctl, idx, tokens, self.page, timeout=OP_TIMEOUT_S)[0]

    def prefetch(self, tokens: list[int]) -> tuple[int, Any]:
        """(tokens the controller completed, their host slots); the slots are freed by the
        caller."""
        self.rid += 1
        return controller_prefetch(self.ctl, f"r{self.rid}", tokens, timeout=OP_TIMEOUT_S)


def measure(args: argparse.Namespace, backend: str,
            config: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """`config(engine)`: the backend's extra config for engine "a" (and its restart) or "b"."""
    rng = np.random.default_rng(args.seed)
    round_tokens = args.round_pages * args.page_size
    # Conversation c's tokens, round by round.
    convs = [rng.integers(0, 50000, args.rounds * round_tokens).tolist()
             for _ in range(args.clients)]
    restore = rng.integers(0, 50000, args.restore_tokens).tolist()
    a = Engine(args, backend, config("a"))
    # Untimed warm-up, the same for every backend: one round backed up (kvcellar's session
    # registers on first use; the file backend makes its directory).
    warm = rng.integers(0, 50000, round_tokens).tolist()
    widx = a.write(args.round_pages, seed=999)
    if a.backup(widx, warm) != len(warm):
        raise RuntimeError(f"{backend}: the warm-up backup is incomplete")
    a.host.free(widx)
    written: dict[int, list] = {c: [] for c in range(args.clients)}
    prefix: dict[int, list] = {c: [] for c in range(args.clients)}
    # Only the controller's calls are timed: filling the host slots (the engine's device->host
    # copy) and keeping the pages to compare are not.
    backup_s = 0.0
    for r in range(args.rounds):
        for c in range(args.clients):
            tokens = convs[c][r * round_tokens:(r + 1) * round_tokens]
            idx = a.write(args.round_pages, seed=r * args.clients + c)
            written[c] += a.pages(idx)
            t0 = time.perf_counter()
            saved, hashes = controller_backup(a.ctl, idx, tokens, a.page, prefix_keys=prefix[c],
                                              timeout=OP_TIMEOUT_S)
            backup_s += time.perf_counter() - t0
            if saved != len(tokens):
                raise RuntimeError(f"{backend}: backup of round {r} of conversation {c} "
                                   f"incomplete ({saved} of {len(tokens)} tokens)")
            prefix[c] += hashes
            a.host.free(idx)
    ridx = a.write(len(restore) // args.page_size, seed=77)
    restore_pages = a.pages(ridx)
    if a.backup(ridx, restore) != len(restore):
        raise RuntimeError(f"{backend}: backup of the 16K-token prompt incomplete")
    a.host.free(ridx)

    def fetch_all(engine: Engine) -> tuple[int, float, int]:
        found, mismatched, fetch_s = 0, 0, 0.0
        for c in range(args.clients):
            t = time.perf_counter()
            done, idx = engine.prefetch(convs[c])
            fetch_s += time.perf_counter() - t
            found += done // args.page_size
            if idx is not None:
                got = engine.pages(idx[:done])
                mismatched += sum(not torch.equal(x, y) for x, y in zip(got, written[c]))
                engine.host.free(idx)
        return found, fetch_s, mismatched

    b = Engine(args, backend, config("b"))
    found_b, fetch_s, bad_b = fetch_all(b)
    t = time.perf_counter()
    done, idx = b.prefetch(restore)
    restore_s = time.perf_counter() - t
    bad_r = 0
    if idx is not None:
        bad_r = sum(not torch.equal(x, y) for x, y in zip(b.pages(idx[:done]), restore_pages))
        b.host.free(idx)
    restored_pages = done // args.page_size
    b.close()
    a.close()
    a2 = Engine(args, backend, config("a"))
    found_r, _, bad_a = fetch_all(a2)
    a2.close()
    total = args.clients * args.rounds * args.round_pages
    gb = total * a.page_bytes / 1e9
    return {"backend": backend, "page_bytes": a.page_bytes, "pages": total,
            "backup_pages_per_s": total / backup_s, "backup_gb_per_s": gb / backup_s,
            "second_engine_found": found_b / total,
            "prefetch_gb_per_s": found_b * a.page_bytes / 1e9 / fetch_s,
            "after_restart_found": found_r / total,
            "restore_16k_s": restore_s, "restore_found": restored_pages / (len(restore) // args.page_size),
            "mismatched_pages": bad_b + bad_a + bad_r}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MooncakeNode:
    """mooncake_master (with its HTTP metadata server) and a standalone mooncake_client holding
    `segment_mib` of memory: Mooncake's store on one node over TCP. The binaries are the ones
    the package installed beside the interpreter."""

    def __init__(self, tmp: Path, segment_mib: int) -> None:
        bindir = Path(sys.executable).parent
        self.rpc, self.http, self.metrics, self.client = (free_port() for _ in range(4))
        self.metadata = f"http://127.0.0.1:{self.http}/metadata"
        self.procs: list[subprocess.Popen] = []
        self.logs = tmp / "mooncake"
        self.logs.mkdir()
        self._start("master", [str(bindir / "mooncake_master"), f"--rpc_port={self.rpc}",
                               "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={self.http}",
                               f"--metrics_port={self.metrics}"],
                    "HTTP metadata server started")
        self._start("client", [str(bindir / "mooncake_client"),
                               f"--master_server_address=127.0.0.1:{self.rpc}",
                               f"--metadata_server={self.metadata}",
                               f"--global_segment_size={segment_mib}MB", "--protocol=tcp",
                               "--host=127.0.0.1", f"--port={self.client}"],
                    "Starting real client service")

    def _start(self, name: str, argv: list[str], ready: str) -> None:
        log = self.logs / f"{name}.log"
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while ready not in log.read_text(errors="replace"):
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake {name} did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)

    def config(self) -> dict[str, Any]:
        """An engine's extra config: a pure client of the node's segment."""
        return {"master_server_address": f"127.0.0.1:{self.rpc}",
                "metadata_server": self.metadata, "protocol": "tcp", "device_name": "",
                "local_hostname": "127.0.0.1", "global_segment_size": 0, "check_server": False}

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def mooncake_available() -> Optional[str]:
    """Why Mooncake's store cannot run here, or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not import: {e}"
    bindir = Path(sys.executable).parent
    for b in ("mooncake_master", "mooncake_client"):
        if not os.access(bindir / b, os.X_OK):
            return f"{bindir / b} is missing"
    return None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvcellard_process import temp_daemons

    init_single_rank()
    with temp_daemons("kvc-bench-peers-") as daemons:
        tmp = daemons.root
        d = daemons.start(args=("--set", f"pool.capacity={args.pool_mib}MiB"))
        # Each engine its own instance id (the restarted one its old id), as separate engines'
        # schedulers have: engines of one process would otherwise share the default one.
        rows = [measure(args, "dynamic",
                        lambda e: extra_config(d.socket, instance_id=f"peers-{e}"))]
        rows[0]["backend"] = "kvcellar"
        files = tmp / "hicache-files"
        files.mkdir()
        row = measure(args, "file", lambda e: {"file_storage_path": str(files)})
        rows.append(row)
        if "mooncake" in args.backends.split(","):
            why = mooncake_available()
            if why is not None:
                raise RuntimeError(f"mooncake: {why} (--backends kvcellar,file leaves it out)")
            node = MooncakeNode(tmp, args.pool_mib)
            try:
                rows.append(measure(args, "mooncake", lambda e: node.config()))
            finally:
                node.close()
        return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32, help="conversations")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per conversation")
    ap.add_argument("--round-pages", type=int, default=16, help="new pages per round")
    ap.add_argument("--restore-tokens", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pool-mib", type=int, default=2048,
                    help="kvcellard's pool, and Mooncake's node segment")
    ap.add_argument("--backends", default="kvcellar,file,mooncake",
                    help="kvcellar and file always run; mooncake when listed")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = run(args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        r0 = rows[0]
        print(f"{args.clients} conversations x {args.rounds} rounds x {args.round_pages} pages of "
              f"{r0['page_bytes'] / 2**10:.0f} KiB, and a {args.restore_tokens}-token prompt; "
              "SGLang 0.5.23's HiCacheController")
        print("| backend | backup pages/s | backup GB/s | second engine found | prefetch GB/s "
              "| after restart found | restore 16K tokens | mismatched pages |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['backend']} | {r['backup_pages_per_s']:.0f} | {r['backup_gb_per_s']:.2f} "
                  f"| {r['second_engine_found']:.3f} | {r['prefetch_gb_per_s']:.2f} "
                  f"| {r['after_restart_found']:.3f} | {r['restore_16k_s'] * 1000:.0f} ms "
                  f"({r['restore_found']:.3f}) | {r['mismatched_pages']} |")
    return 0 if all(r["mismatched_pages"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
