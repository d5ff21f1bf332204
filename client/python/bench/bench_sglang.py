"""What SGLang's host pool -> kvcellard path costs, against a memcpy of the same bytes, in one run.

kvcellar's SGLang backend (kvcellar.integrations.sglang) keeps SGLang's host pool in shared
memory that kvcellard maps, so a ``batch_set_v1`` (backup) or ``batch_get_v1`` (prefetch) of
N pages is one gRPC call, a copy of the pages' bytes by the daemon's copy workers between the
engine's pool and its own, and a wait for the op. The floor for moving those bytes at all is a
memcpy. This script measures, call by call and interleaved so that all figures come from the
same moments of a shared machine:

    memcpy          torch copy_ of the same bytes between two host tensors (torch's own
                    threads), the floor
    batch_set_v1    a backup of N fresh pages (new keys every call: stored in the daemon's pool)
    batch_get_v1    a prefetch of N stored pages into host slots
    batch_exists    the hit query for the same N keys (no bytes move)

It starts kvcellard (sim device: the host-shared-memory mode), builds SGLang 0.5.23's real MHA
host pool with ``"allocator": "shm"`` and the backend through SGLang's StorageBackendFactory, and
prints, per call, the median time, GB/s and the ratio to the memcpy median. Runs under the
repository's .venv-sglang (deploy/install-deps.sh), against the repository's build:

    .venv-sglang/bin/python client/python/bench/bench_sglang.py            # ~20 s on 2 cores
    .venv-sglang/bin/python client/python/bench/bench_sglang.py --json

Default geometry: one TP rank of a Llama-3-8B-like model with 16 of its layers (8 KV heads of
128, bf16) and 16-token pages: 1 MiB per page, 64 pages (64 MiB) per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client" / "python"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import torch  # noqa: E402


def build(args: argparse.Namespace, socket: str) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    import psutil
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    device_tokens = args.pages * args.page_size * 2
    dev = MHATokenToKVPool(device_tokens, args.page_size, torch.bfloat16, args.heads,
                           args.head_dim, args.layers, "cpu", False, start_layer=0,
                           end_layer=args.layers)
    # Checked against the host's available memory, without SGLang's 10 GiB reserve for a
    # server's other use (pool_host/base.py), through SGLang's own budget scope.
    with host_memory_budget_scope(psutil.virtual_memory().available):
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                    args.page_size, args.layout, pin_memory=False, device="cpu",
                                    allocator_type="shm", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=args.layers)
    del dev
    extra = {"backend_name": "kvcellar", "module_path": "kvcellar.integrations.sglang",
             "class_name": "KvcellarStorage", "interface_v1": 1, "allocator": "shm",
             "socket": socket, "instance_id": "bench-sglang"}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=args.layout == "page_first",
                               model_name="bench/llama-like", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return host, backend


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvcellard_process import temp_daemons
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    with temp_daemons("kvc-bench-sgl-") as daemons:
        d = daemons.start(args=("--set", f"pool.capacity={args.pool_mib}MiB"))
        host, backend = build(args, d.socket)
        if not backend._session().wait_active(10000):
            raise RuntimeError("the backend's session did not register:\n" + d.log())
        n, page = args.pages, args.page_size
        slots = host.alloc(n * page)
        host.kv_buffer.normal_()
        page_bytes = backend.layout.page_object_bytes
        src = torch.empty(n * page_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.random_(0, 255)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        counter = [0]

        def fresh_keys() -> list[str]:
            counter[0] += 1
            return [f"{counter[0]:032x}{i:032x}" for i in range(n)]

        stored = fresh_keys()
        if backend.batch_set_v1(stored, slots, info) != [True] * n:
            raise RuntimeError("the first backup failed:\n" + d.log())

        def check(what: str, got: Any, want: Any) -> None:
            if got != want:
                raise RuntimeError(f"{what}: {got!r}, expected {want!r}\n" + d.log()[-3000:])

        cases: dict[str, Callable[[], None]] = {
            "memcpy": lambda: dst.copy_(src),
            "batch_set_v1": lambda: check("batch_set_v1",
                                          backend.batch_set_v1(fresh_keys(), slots, info),
                                          [True] * n),
            "batch_get_v1": lambda: check("batch_get_v1",
                                          backend.batch_get_v1(stored, slots, info), [True] * n),
            "batch_exists": lambda: check("batch_exists", backend.batch_exists(stored, info), n),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for i in range(args.warmup + args.iterations):
            for name, fn in cases.items():  # interleaved: one of each, then the next round
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    times[name].append(dt)
        backend.close()
        base = statistics.median(times["memcpy"])
        rows = []
        for name, ts in times.items():
            med = statistics.median(ts)
            moved = 0 if name == "batch_exists" else n * page_bytes
            rows.append({"call": name, "median_us": med * 1e6,
                         "gb_per_s": moved / med / 1e9 if moved else None,
                         "vs_memcpy": med / base})
        return {"pages": n, "page_bytes": page_bytes, "layout": args.layout,
                "iterations": args.iterations, "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per call (SGLang: <= 128)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8, help="KV heads of this rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first",
                    choices=["page_first", "page_first_direct", "layer_first"])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pool-mib", type=int, default=1024, help="kvcellard's pool")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    mib = result["page_bytes"] / 2**20
    print(f"{result['pages']} pages of {mib:.2f} MiB per call ({result['layout']}), "
          f"median of {result['iterations']}:")
    print("| call | median | GB/s | vs memcpy |")
    print("|---|---|---|---|")
    for r in result["rows"]:
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else "-"
        print(f"| {r['call']} | {r['median_us'] / 1000:.2f} ms | {gbs} | {r['vs_memcpy']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
