"""The package's CUDA path against a real kvcellard on a GPU: KV caches registered from torch CUDA
tensors by IPC handle (vLLM's per-layer layouts, the unified 0.33 view, SGLang's token-major
buffers, MLA), Backup that waits on the engine's interprocess ready event instead of a host
synchronize, Load whose per-layer events the engine's stream waits on, and a second engine
process loading what the first backed up. Bytes are compared bit for bit.

Skipped where torch sees no CUDA device (CI); deploy/gpu-check.sh runs them on a GPU machine.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcellar import Client, KvLayout, Namespace

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

P = 16
LAYERS = 4
BLOCKS = 64
HEADS, DIM = 4, 64
# About 0.1-0.3 s of GPU time at H100/H200 clocks: long enough that a copy which did not wait
# for the engine's event would read the bytes from before the wait.
SLEEP_CYCLES = 300_000_000


def ns(layout="mha", dtype="bf16", model="cuda-test"):
    return Namespace(model, "rev1", dtype, P, layout=layout)


def random_fill(t, seed):
    g = torch.Generator(device=t.device).manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype))


def write_late(dst, src):
    """Writes ``src`` into ``dst`` on the current stream behind a long GPU sleep, without any
    host synchronization: only a consumer that waits on the stream sees ``src``."""
    torch.cuda._sleep(SLEEP_CYCLES)
    dst.copy_(src)


def backup_then_load(session, caches, select, src_blocks, dst_blocks, tokens, seed):
    """Backs up ``src_blocks`` written late behind a sleep (ready event), then loads them into
    ``dst_blocks`` layer by layer; returns (expected, loaded) per layer, read on the engine's
    stream right after each wait_layer."""
    truth = []
    for i, t in enumerate(caches):
        view = select(t, src_blocks)
        want = torch.empty_like(view)
        random_fill(want, seed + i)
        view.fill_(-7)
        truth.append(want)
    torch.cuda.synchronize()
    m = session.match([tokens])
    assert m.ok and m.results[0].l2_hit_pages == 0
    keys = m.results[0].keys
    for t, want in zip(caches, truth):
        write_late(select(t, src_blocks), want)
    op = session.backup(keys, np.array(src_blocks), ready=True)
    assert op.ok, op.reason
    st = op.wait(20000)
    assert st.done, st

    m = session.match([tokens], pin=True)
    r = m.results[0]
    assert r.l2_hit_pages == len(src_blocks) and r.pin_id
    for t in caches:
        select(t, dst_blocks).fill_(-9)
    torch.cuda.synchronize()
    op = session.load(r.keys, np.array(dst_blocks), pin_id=r.pin_id, release_pin=True)
    assert op.ok and op.slot is not None, op.reason
    got = []
    for layer, t in enumerate(caches):
        assert op.wait_layer(layer)  # a stream wait, no host block
        got.append(select(t, dst_blocks).clone())
    st = op.wait(20000)
    assert st.done and st.leading_ok_pages == [len(src_blocks)], st
    torch.cuda.synchronize()
    return truth, got


def test_vllm_flash_attention_layout(daemon):
    """vLLM's [2, blocks, P, heads, dim] per layer, every layer a view into one cudaMalloc (not at
    its base), bf16: one IPC region, the ready event holds the gather back, the per-layer events
    hold the engine's reads back."""
    raw = torch.empty((LAYERS, 2, BLOCKS, P, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
    caches = {f"model.layers.{i}.self_attn": raw[i] for i in range(LAYERS)}
    layout = KvLayout.from_vllm(caches)
    assert len(layout.regions) == 1 and layout.cuda_device == 0
    with Client(daemon.socket) as client:
        s = client.register("cuda-a", ns(), layout=layout)
        assert s.wait_active(10000)
        assert s.info().page_object_bytes == LAYERS * 2 * P * HEADS * DIM * 2
        tokens = np.arange(6 * P + 5, dtype=np.uint32)
        truth, got = backup_then_load(s, list(caches.values()), lambda t, b: t[:, b[0]:b[-1] + 1],
                                      list(range(2, 8)), list(range(40, 46)), tokens, seed=3)
        for layer, (want, have) in enumerate(zip(truth, got)):
            assert torch.equal(have, want), f"layer {layer}: loaded bytes differ"
        assert client.stats()["degraded_calls"] == 0


def test_vllm_unified_blocks_layout(daemon):
    """vLLM 0.33's unified [B, H, N, C] views (K and V side by side in C), float16."""
    raw = torch.empty((BLOCKS, LAYERS, HEADS, P, 2 * DIM), dtype=torch.float16, device="cuda")
    views = [raw[:, i] for i in range(LAYERS)]
    layout, index = KvLayout.from_vllm_blocks(views)
    assert index == list(range(LAYERS))
    with Client(daemon.socket) as client:
        s = client.register("cuda-u", ns(dtype="fp16", model="cuda-unified"), layout=layout)
        assert s.wait_active(10000)
        tokens = np.arange(100, 100 + 4 * P, dtype=np.uint32)
        truth, got = backup_then_load(s, views, lambda t, b: t[b[0]:b[-1] + 1],
                                      [5, 6, 7, 8], [60, 61, 62, 63], tokens, seed=11)
        for want, have in zip(truth, got):
            assert torch.equal(have, want)


def test_sglang_mla_token_major(daemon):
    """SGLang's MLA kv_buffer per layer [tokens, 1, latent], one allocation per layer (one IPC
    region each), float32."""
    latent = 576
    bufs = [torch.empty((BLOCKS * P, 1, latent), dtype=torch.float32, device="cuda")
            for _ in range(LAYERS)]
    layout = KvLayout.from_sglang(bufs, None, P)
    assert len(layout.regions) == LAYERS

    def pages(t, b):
        return t[b[0] * P:(b[-1] + 1) * P]

    with Client(daemon.socket) as client:
        s = client.register("cuda-mla", ns(layout="mla", dtype="fp32", model="cuda-mla"),
                            layout=layout)
        assert s.wait_active(10000)
        tokens = np.arange(7, 7 + 3 * P, dtype=np.uint32)
        truth, got = backup_then_load(s, bufs, pages, [0, 1, 2], [30, 31, 32], tokens, seed=5)
        for want, have in zip(truth, got):
            assert torch.equal(have, want)


OTHER_ENGINE = textwrap.dedent("""
    import sys, numpy as np, torch
    from kvcellar import Client, KvLayout, Namespace
    sock, out = sys.argv[1], sys.argv[2]
    P, L, B, H, D = 16, 4, 64, 4, 64
    raw = torch.full((L, 2, B, P, H, D), -3.0, dtype=torch.bfloat16, device="cuda")
    layout = KvLayout.from_vllm([raw[i] for i in range(L)])
    with Client(sock) as c:
        s = c.register("cuda-b", Namespace("cuda-test", "rev1", "bf16", P, layout="mha"),
                       layout=layout)
        assert s.wait_active(10000)
        r = s.match([np.arange(6 * P + 5, dtype=np.uint32)], pin=True).results[0]
        assert r.l2_hit_pages == 6, r.l2_hit_pages
        op = s.load(r.keys, np.arange(20, 26), pin_id=r.pin_id, release_pin=True)
        assert op.ok, op.reason
        for layer in range(L):
            assert op.wait_layer(layer)
        st = op.wait(20000)
        assert st.done and st.leading_ok_pages == [6], st
        torch.cuda.synchronize()
        torch.save(raw[:, :, 20:26].cpu(), out)
""")


def test_second_engine_process_loads_what_the_first_backed_up(daemon, tmp_path):
    """Engine A (this process) backs up; engine B, another process with its own cudaMalloc,
    loads the pages into its blocks through its own IPC registration."""
    raw = torch.empty((LAYERS, 2, BLOCKS, P, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
    random_fill(raw, 42)
    torch.cuda.synchronize()
    with Client(daemon.socket) as client:
        s = client.register("cuda-a", ns(), layout=KvLayout.from_vllm([raw[i] for i in
                                                                        range(LAYERS)]))
        assert s.wait_active(10000)
        keys = s.match([np.arange(6 * P + 5, dtype=np.uint32)]).results[0].keys
        op = s.backup(keys, np.arange(10, 16), ready=True)
        assert op.ok and op.wait(20000).done
        out = tmp_path / "b.pt"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1])] + sys.path))
        proc = subprocess.run([sys.executable, "-c", OTHER_ENGINE, daemon.socket, str(out)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert torch.equal(torch.load(out), raw[:, :, 10:16].cpu())


EXPANDABLE = textwrap.dedent("""
    import torch
    from kvcellar import KvLayout
    raw = torch.zeros((2, 2, 512, 16, 8, 128), device="cuda")  # 128 MiB: a large-pool segment
    try:
        KvLayout.from_vllm([raw[0], raw[1]])
    except ValueError as e:
        print("refused:", e)
    else:
        print("registered")
""")


def test_expandable_segments_are_refused_with_the_setting_to_change():
    """KV allocated under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be opened by
    CUDA IPC: the layout says so at registration, naming the setting, instead of the daemon
    failing to open a handle."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1])] + sys.path))
    proc = subprocess.run([sys.executable, "-c", EXPANDABLE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "refused: kv_caches[0]" in proc.stdout or "refused: k[0]" in proc.stdout, proc.stdout
    assert "expandable_segments:False" in proc.stdout
