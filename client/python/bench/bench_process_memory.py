"""Copy throughput of process memory (an engine's plain host memory, registered as
/proc/<pid>/mem and copied by the daemon with process_vm_readv / process_vm_writev) against
memcpy of the same bytes, in one run.

This script starts kvcellard (sim device, temp socket) and one engine (this process) with
vLLM 0.32's CPU KV layout: per layer one plain torch tensor [num_blocks, 2, block_size,
kv_heads * head_dim], K and V of a block side by side. Per round, in turns:
    memcpy         one bulk copy of the bytes of an op (numpy, this process): the baseline
    backup         Backup of fresh pages (new keys each round) from the engine's blocks into the
                   daemon's pool, submit + wait until DONE
    load           Load of those pages into other blocks, submit + wait until DONE
    backup (shm)   the same Backup from a SimDevice (shared memory the daemon maps and memcpys),
    load (shm)     the path host-memory engines had before, for comparison
and the table gives medians over the rounds in GB/s (page bytes moved per second) and each
path's ratio to the memcpy of the same round (median of the per-round ratios).

    python client/python/bench/bench_process_memory.py --kvcellard build/bin/kvcellard \
        [--pages 256] [--layers 32] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvcellar import Client, KvLayout, Namespace, SimDevice  # noqa: E402


def start_daemon(binary: str, directory: str, pool: str) -> tuple[subprocess.Popen, str]:
    sock = f"{directory}/kvcellard.sock"
    log = open(f"{directory}/kvcellard.log", "w")
    proc = subprocess.Popen([binary, "--set", f"listen.unix_socket={sock}",
                             "--set", f"listen.admin_socket={directory}/admin.sock",
                             "--set", "http.address=127.0.0.1:0", "--set", "device.kind=sim",
                             "--set", f"pool.capacity={pool}"], stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, sock


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvcellard", required=True)
    ap.add_argument("--pages", type=int, default=256, help="pages per op")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-width", type=int, default=1024, help="kv_heads * head_dim")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    P, L, n = args.page_size, args.layers, args.pages
    blocks = 2 * n
    shape = (blocks, 2, P, args.kv_width)
    page_bytes = L * 2 * P * args.kv_width * 2  # bf16
    op_bytes = n * page_bytes
    pool_mib = max(512, (2 * args.rounds + 2) * op_bytes // (1 << 20) * 2 + 512)
    pool_mib = (pool_mib + 63) // 64 * 64

    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(args.kvcellard, tmp, f"{pool_mib}MiB")
        sim = SimDevice()
        try:
            caches = [torch.randn(shape).to(torch.bfloat16) for _ in range(L)]
            shm = [sim.empty(shape, torch.bfloat16) for _ in range(L)]
            for t in shm:
                t.copy_(caches[0])
            src = np.random.default_rng(0).integers(0, 255, op_bytes, dtype=np.uint8)
            dst = np.empty_like(src)
            rows: dict[str, list[float]] = {k: [] for k in
                                            ("memcpy", "backup", "load", "backup (shm)",
                                             "load (shm)")}
            ratios: dict[str, list[float]] = {k: [] for k in rows if k != "memcpy"}
            with Client(sock, rpc_timeout_ms=10000) as client:
                sessions = {}
                for name, tensors, dev in (("proc", caches, None), ("shm", shm, sim)):
                    layout = KvLayout.from_vllm(tensors, kv_first=False, device=dev)
                    s = client.register(f"bench-{name}",
                                        Namespace(f"bench-{name}", "r", "bf16", P, layout="mha"),
                                        layout=layout)
                    if not s.wait_active(10000):
                        raise SystemExit(f"register {name}: not active")
                    sessions[name] = s
                for r in range(args.rounds + 1):  # round 0 warms up
                    out = {"memcpy": timed(lambda: np.copyto(dst, src))}
                    for name, suffix in (("proc", ""), ("shm", " (shm)")):
                        s = sessions[name]
                        tokens = np.arange(r * n * P, (r + 1) * n * P, dtype=np.uint32)
                        keys = s.match([tokens]).results[0].keys

                        def backup():
                            op = s.backup(keys, np.arange(n), ready=False)
                            assert op.ok and op.wait(60000).done, op.reason

                        def load():
                            m = s.match([tokens], pin=True).results[0]
                            assert m.l2_hit_pages == n, m.l2_hit_pages
                            op = s.load(m.keys, np.arange(n, 2 * n), pin_id=m.pin_id,
                                        release_pin=True)
                            assert op.ok and op.wait(60000).done, op.reason

                        out["backup" + suffix] = timed(backup)
                        out["load" + suffix] = timed(load)
                    if r == 0:
                        continue
                    for k, sec in out.items():
                        rows[k].append(op_bytes / sec / 1e9)
                        if k != "memcpy":
                            ratios[k].append(out["memcpy"] / sec)
            print(f"{n} pages of {page_bytes >> 10} KiB per op ({op_bytes >> 20} MiB), {L} layers, "
                  f"{args.rounds} rounds, medians")
            print("| call | GB/s | vs memcpy |")
            print("|---|---|---|")
            for k, v in rows.items():
                ratio = "1.00x" if k == "memcpy" else f"{statistics.median(ratios[k]):.2f}x"
                print(f"| {k} | {statistics.median(v):.2f} | {ratio} |")
        finally:
            proc.terminate()
            proc.wait()
            sim.close()


if __name__ == "__main__":
    main()
