"""What the SGLang backend's tests (test_sglang_backend.py, test_sglang_hybrid.py) share. Importing
it skips the importing test module under an interpreter without SGLang 0.5.23, unless
KVCELLAR_REQUIRE_ENGINES=1 (ctest), where a missing SGLang is a failure."""
import os
import tempfile

import pytest

if os.environ.get("KVCELLAR_REQUIRE_ENGINES") == "1":
    import sglang
    import torch  # noqa: F401
    assert sglang.__version__ == "0.5.23", f"written for SGLang 0.5.23, found {sglang.__version__}"
else:
    pytest.importorskip("torch")
    sglang = pytest.importorskip("sglang")
    if sglang.__version__ != "0.5.23":
        pytest.skip(f"written for SGLang 0.5.23, found {sglang.__version__}",
                    allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402


def init_single_rank():
    """What SGLang's launcher sets up before a scheduler builds its cache: a process group (gloo,
    one rank) and the parallel context the controller reads its ranks from."""
    if not dist.is_initialized():
        f = tempfile.mktemp(prefix="kvc-sgl-pg-")
        dist.init_process_group("gloo", init_method=f"file://{f}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)


def extra_config(socket, **more):
    """The backend's --hicache-storage-backend-extra-config; an option given as None is left
    out. A 2 s deadline per call instead of 250 ms: the tests assert hits, and beside the rest of
    ctest (ASan daemons, the soak, a vLLM engine) on 2 cores a call can take longer than 250 ms;
    a call past its deadline is a miss, by design."""
    cfg = {"backend_name": "kvcellar", "module_path": "kvcellar.integrations.sglang",
           "class_name": "KvcellarStorage", "interface_v1": 1, "allocator": "shm",
           "socket": socket, "rpc_timeout_ms": 2000}
    cfg.update(more)
    return {k: v for k, v in cfg.items() if v is not None}


def engine_factory(build):
    """The body of an ``engines`` fixture: yields ``make(*args, **kw)``, which builds an engine
    with ``build`` under an instance id of its own (engines of one process would share the
    default one), and closes every engine made at the end."""
    made = []

    def make(*args, **kw):
        kw.setdefault("instance_id", f"engine-{len(made)}")
        e = build(*args, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        try:
            e.close()
        except Exception:
            pass


def rank_config(socket, rank, tp_size, model):
    """Rank ``rank``'s HiCacheStorageConfig of an MHA model at tensor parallel ``tp_size``. One
    process per rank in SGLang: one instance each (the default instance id has the pid in it)."""
    return HiCacheStorageConfig(tp_rank=rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model,
                                extra_config=extra_config(socket, instance_id=f"rank-{rank}"))


# ---- driving SGLang's HiCacheController as its scheduler does (the backend tests and
# client/python/bench/bench_sglang_peers.py) -----------------------------------------------------


def fill_host_pages(host, idx, page_size, seed):
    """Random KV in the host slots `idx` (whole pages), as a device->host copy leaves them."""
    g = torch.Generator().manual_seed(seed)
    for p in range(0, len(idx), page_size):
        flat = host.get_dummy_flat_data_page()
        flat.copy_(torch.randn(flat.shape, generator=g).to(flat.dtype))
        host.set_from_flat_data_page(int(idx[p]), flat)


def host_pages(host, idx, page_size):
    """Copies of the pages in host slots `idx`."""
    return [host.get_data_page(int(idx[p]), flat=True).clone()
            for p in range(0, len(idx), page_size)]


def controller_backup(ctl, idx, tokens, page_size, prefix_keys=(), pass_prefix=True, timeout=30):
    """write_storage of a radix node's pages, waited for: (tokens SGLang counts as saved, the
    pages' hashes)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    prior = prefix_keys[-1] if prefix_keys else None
    hashes = get_hash_str(tokens[:len(idx)], prior_hash=prior, page_size=page_size)
    op_id = ctl.write_storage(idx, tokens[:len(idx)], hash_value=hashes,
                              prefix_keys=list(prefix_keys) if pass_prefix else None)
    op = ctl.ack_backup_queue.get(timeout=timeout)
    if op.id != op_id:
        raise AssertionError(f"backup acknowledged {op.id}, expected {op_id}")
    return op.completed_tokens, hashes


def controller_prefetch(ctl, rid, tokens, last_hash=None, prefix_keys=(), timeout=30):
    """A storage prefetch of `tokens` as the scheduler runs it (prefetch, hit query, host
    buffers, transfer): (tokens the controller completed, the host slots they landed in)."""
    op = ctl.prefetch(rid, list(tokens), last_hash, list(prefix_keys))
    hit = ctl.prefetch_hit_queue.get(timeout=timeout)
    if hit is not op:
        raise AssertionError("prefetch hit queue out of order")
    if op.storage_hit_count == 0:
        return 0, None
    op.host_indices = ctl.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    ctl.prefetch_buffer.put(op)
    completed = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=timeout)
        if ack.completed_req:
            break
        completed = max(completed, ack.completed_tokens)
    return completed, op.host_indices
