"""Layouts derived from engine tensors (vLLM and SGLang arrangements, views that do not start at
their allocation base), proven by a real daemon moving bytes through them, and the registration
errors that name the argument before anything reaches the daemon."""
import numpy as np
import pytest
import torch

from kvcellar import Client, KvLayout, Namespace, SimDevice

P, BLOCKS, LAYERS, HEADS, DIM = 4, 8, 2, 2, 4


def ns(layout="mha", dtype="fp32", page_size=P, tp_size=1):
    return Namespace("layout-model", "r1", dtype, page_size, layout=layout, tp_size=tp_size)


def roundtrip(daemon, layout, namespace, block_view):
    """Backs up blocks 0-1 through the layout and loads them into blocks 4-5: every byte of
    block_view(4+i) must equal block_view(i), and no other byte may change."""
    with Client(daemon.socket) as client:
        s = client.register("rt", namespace, layout=layout)
        assert s.wait_active(5000)
        keys = s.keys(np.arange(2 * namespace.page_size))
        for b in range(BLOCKS):
            for t in block_view(b):
                t.copy_(torch.randn(t.shape))
        before = [[t.clone() for t in block_view(b)] for b in range(BLOCKS)]
        assert s.backup(keys, [0, 1]).wait().done
        op = s.load(keys, [4, 5])
        assert op.wait().leading_ok_pages == [2]
        for b in range(BLOCKS):
            src = 0 if b == 4 else 1 if b == 5 else b
            for got, want in zip(block_view(b), before[src]):
                assert torch.equal(got, want), f"block {b}"


def test_vllm_flash_attention_views_of_one_allocation(daemon):
    dev = SimDevice()
    raw = dev.empty((1000 + LAYERS * 2 * BLOCKS * P * HEADS * DIM,), torch.float32)
    caches = [raw[1000:].view(LAYERS, 2, BLOCKS, P, HEADS, DIM)[i] for i in range(LAYERS)]
    layout = KvLayout.from_vllm(caches, device=dev)
    assert layout.regions[0].offset == 0 and layout.layers[0][0].offset == 4000
    assert layout.tokens_per_block == P
    roundtrip(daemon, layout, ns(), lambda b: [c[:, b] for c in caches])


def test_vllm_flashinfer_interleaved_and_hnd_stride_order(daemon):
    dev = SimDevice()
    # FlashInfer: [blocks, 2, P, heads, dim]; K and V of a block side by side.
    fi = [dev.empty((BLOCKS, 2, P, HEADS, DIM), torch.float32) for _ in range(LAYERS)]
    layout = KvLayout.from_vllm(fi, kv_first=False, device=dev)
    k, v = layout.layers[0]
    assert k.block_stride == v.block_stride == 2 * k.bytes_per_block
    roundtrip(daemon, layout, ns(), lambda b: [c[b] for c in fi])
    # HND stride order: logical [2, blocks, P, heads, dim], physical [2, blocks, heads, P, dim].
    hnd = [dev.empty((2, BLOCKS, HEADS, P, DIM), torch.float32).transpose(2, 3)
           for _ in range(LAYERS)]
    layout = KvLayout.from_vllm(hnd, device=dev)
    assert layout.layers[0][0].bytes_per_block == P * HEADS * DIM * 4


def test_vllm_mla_and_sglang_layouts(daemon, daemon_factory):
    dev = SimDevice()
    mla = [dev.empty((BLOCKS, P, 24), torch.float32) for _ in range(LAYERS)]
    layout = KvLayout.from_vllm(mla, mla=True, device=dev)
    assert layout.mla and layout.page_object_bytes == LAYERS * P * 24 * 4
    roundtrip(daemon, layout, ns("mla"), lambda b: [c[b] for c in mla])
    # SGLang: token-major [tokens(+pad), heads, dim]; a page is P consecutive token slots.
    kb = [dev.empty((BLOCKS * P + 1, HEADS, DIM), torch.float32) for _ in range(LAYERS)]
    vb = [dev.empty((BLOCKS * P + 1, HEADS, DIM), torch.float32) for _ in range(LAYERS)]
    layout = KvLayout.from_sglang(kb, vb, P, device=dev)
    assert layout.num_blocks == BLOCKS and layout.tokens_per_block == P
    d2 = daemon_factory(name="second")
    roundtrip(d2, layout, ns(), lambda b: [t[b * P:(b + 1) * P] for t in kb + vb])


def bad_register(daemon, namespace, layout, **kw):
    with Client(daemon.socket) as client:
        try:
            client.register("bad", namespace, layout=layout, **kw)
        finally:
            assert client.stats()["registrations"] == 0  # nothing reached the daemon


@pytest.mark.parametrize("case,match", [
    ("mixed_dtype", "dtype"),
    ("block_count", r"v\[0\]: shape"),
    ("not_contiguous", "not contiguous"),
    ("overlap", "overlaps"),
    ("no_kv_dim", "K/V dimension"),
    ("outside_allocation", "not inside one shared-memory object"),
])
def test_bad_tensors_name_the_argument(case, match):
    dev = SimDevice()
    good = [dev.empty((2, BLOCKS, P, HEADS, DIM), torch.float32) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match=match):
        if case == "mixed_dtype":
            KvLayout.from_vllm([good[0], dev.empty((2, BLOCKS, P, HEADS, DIM), torch.float16)],
                               device=dev)
        elif case == "block_count":
            KvLayout.from_block_tensors([good[0][0]], [good[1][1][:4]], device=dev)
        elif case == "not_contiguous":
            KvLayout.from_vllm([g[:, :, :, :1] for g in good], device=dev)
        elif case == "overlap":
            KvLayout.from_block_tensors([good[0][0]], [good[0][0]], device=dev)
        elif case == "no_kv_dim":
            KvLayout.from_vllm([dev.empty((3, BLOCKS, P, HEADS, DIM), torch.float32)], device=dev)
        elif case == "outside_allocation":
            other = SimDevice()
            KvLayout.from_vllm([dev.empty((2, BLOCKS, P, HEADS, DIM), torch.float32)],
                               device=other)


def test_registration_mismatches_name_the_argument(daemon):
    dev = SimDevice()
    caches = [dev.empty((2, BLOCKS, P, HEADS, DIM), torch.float32) for _ in range(LAYERS)]
    layout = KvLayout.from_vllm(caches, device=dev)
    with pytest.raises(ValueError, match="kv_dtype"):
        bad_register(daemon, ns(dtype="bf16"), layout)
    with pytest.raises(ValueError, match="page_size"):
        bad_register(daemon, ns(page_size=2 * P), layout)
    with pytest.raises(ValueError, match="ns.layout"):
        bad_register(daemon, ns("mla"), layout)
    with pytest.raises(ValueError, match="rank"):
        bad_register(daemon, ns(tp_size=2), layout, rank=2)
    with pytest.raises(ValueError, match="layout"):
        bad_register(daemon, ns(), None)
    with Client(daemon.socket) as client:  # the same layout registers fine
        assert client.register("good", ns(), layout=layout).wait_active(5000)


def test_cuda_ipc_handle_formats_of_torch():
    """torch's _share_cuda_ handle: bare (old torch), or version (2: torch 2.5-2.12, 3: 2.13+),
    type and payload; only a cudaMalloc block ('c') can be opened by CUDA IPC."""
    from kvcellar.layout import cuda_ipc_mem_handle

    raw = bytes(range(64))
    assert cuda_ipc_mem_handle(raw) == raw
    assert cuda_ipc_mem_handle(b"\x02c" + raw) == raw
    assert cuda_ipc_mem_handle(b"\x03c" + raw) == raw
    with pytest.raises(ValueError, match="k\\[0\\]: allocated in an expandable segment.*"
                                         "expandable_segments:False"):
        cuda_ipc_mem_handle(b"\x03e" + bytes(40), "k[0]")
    with pytest.raises(ValueError, match="version byte 9"):
        cuda_ipc_mem_handle(b"\x09c" + raw)
    with pytest.raises(ValueError, match="expected type 'c'"):
        cuda_ipc_mem_handle(b"\x02c" + raw[:63])
    with pytest.raises(ValueError, match="0 bytes"):
        cuda_ipc_mem_handle(b"")
