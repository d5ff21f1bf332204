"""Engines whose KV cache is plain host memory of their own process (vLLM's CPU worker allocates
it with torch.zeros): registered with no SimDevice, as "/proc/<pid>/mem" regions, and moved by the
daemon with process_vm_readv / process_vm_writev, with no copy in the engine. Bytes bit-exact,
the layer signals, what the daemon refuses, and an engine killed with pages in flight."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcellar import Client, KvLayout, Namespace
from kvcellar.layout import Region

P, LAYERS, BLOCKS, HEADS, DIM = 16, 3, 32, 2, 32


def ns():
    return Namespace("proc-mem", "rev1", "fp32", P, layout="mha")


def cpu_caches():
    """vLLM 0.32's CPU caches: [num_blocks, 2, block_size, kv_heads * head_dim] per layer, plain
    torch allocations (one each)."""
    return [torch.zeros((BLOCKS, 2, P, HEADS * DIM), dtype=torch.float32) for _ in range(LAYERS)]


def test_plain_cpu_tensors_round_trip_bit_exact(daemon):
    caches = cpu_caches()
    layout = KvLayout.from_vllm(caches, kv_first=False)
    assert [r.handle for r in layout.regions] == [f"/proc/{os.getpid()}/mem"] * LAYERS
    assert layout.regions[0].offset == caches[0].data_ptr()
    with Client(daemon.socket) as client:
        s = client.register("cpu-a", ns(), layout=layout)
        assert s.wait_active(5000)
        tokens = np.arange(5 * P + 3, dtype=np.uint32)
        keys = s.match([tokens]).results[0].keys
        g = torch.Generator().manual_seed(7)
        for t in caches:
            t[0:5].copy_(torch.randn(t[0:5].shape, generator=g))
        want = [t[0:5].clone() for t in caches]
        op = s.backup(keys, np.arange(5), ready=True)
        assert op.ok, op.reason
        assert op.wait().done
        for t in caches:
            t[0:5].fill_(-1.0)  # the daemon's pages are its own copy, not a view of ours
        r = s.match([tokens], pin=True).results[0]
        assert r.l2_hit_pages == 5
        op = s.load(r.keys, np.arange(20, 25), pin_id=r.pin_id, release_pin=True)
        assert op.ok and op.slot is not None, op.reason
        for layer in range(LAYERS):
            assert op.wait_layer(layer)
        assert op.wait().leading_ok_pages == [5]
        for t, w in zip(caches, want):
            assert torch.equal(t[20:25], w)
        assert client.stats()["degraded_calls"] == 0


def test_another_processes_memory_is_refused(daemon):
    """The daemon reaches only the registering engine's own process: naming the daemon's pid (its
    memory holds the pool) or any other is refused with a reason, and nothing is copied."""
    caches = cpu_caches()
    with Client(daemon.socket) as client:
        for pid, why in ((daemon.proc.pid, "is the daemon's own memory"),
                         (os.getppid(), "is not the registering engine's own process")):
            layout = KvLayout.from_vllm(caches, kv_first=False)
            layout.regions = [Region(f"/proc/{pid}/mem", r.offset, r.size)
                              for r in layout.regions]
            with pytest.raises(ValueError, match=f"PERMISSION_DENIED.*{why}"):
                client.register(f"cpu-{pid}", ns(), layout=layout)
        # Addresses this process has not mapped writable.
        layout = KvLayout.from_vllm(caches, kv_first=False)
        layout.regions[1] = Region(layout.regions[1].handle, 4096, layout.regions[1].size)
        with pytest.raises(ValueError, match=r"regions\[1\]: address 0x1000 .* not readable"):
            client.register("cpu-unmapped", ns(), layout=layout)


ENGINE = textwrap.dedent("""
    import sys, time, numpy as np, torch
    from kvcellar import Client, KvLayout, Namespace
    P, L, B = 16, 3, 32
    caches = [torch.full((B, 2, P, 64), float(i + 1)) for i in range(L)]
    with Client(sys.argv[1]) as c:
        s = c.register("cpu-doomed", Namespace("proc-mem", "rev1", "fp32", P, layout="mha"),
                       layout=KvLayout.from_vllm(caches, kv_first=False))
        assert s.wait_active(5000)
        keys = s.match([np.arange(9000, 9000 + 4 * P, dtype=np.uint32)]).results[0].keys
        print("ready", flush=True)
        while True:
            s.backup(keys, np.arange(4), ready=True)
""")


def test_engine_killed_mid_copy_leaves_the_daemon_serving(daemon):
    """An engine SIGKILLed while its Backups run: its copies fail (the process is gone, never a
    reused pid), the daemon keeps serving another engine bit-exact."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1])] + sys.path))
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, daemon.socket], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    test_plain_cpu_tensors_round_trip_bit_exact(daemon)


def test_benchmark_runs_and_prints_every_path():
    """Smoke run of client/python/bench/bench_process_memory.py (tiny ops: its figures are the
    benchmark's output, not this test's)."""
    from conftest import ROOT, bin_path, run_bench

    _, names = run_bench(ROOT / "client" / "python" / "bench" / "bench_process_memory.py",
                         "--kvcellard", bin_path("kvcellard"), "--pages", "8", "--layers", "4",
                         "--rounds", "1")
    assert names == ["memcpy", "backup", "load", "backup (shm)", "load (shm)"]
