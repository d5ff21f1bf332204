#!/usr/bin/python3
"""Writes the seed corpus of the fuzz targets: tests/fuzz/corpus/<target>/seed-*.

Each seed is a valid, meaningful input in the target's format (the comment at the top of each
tests/fuzz/<target>_fuzz.cc): registrations and data requests of the kinds engines send, the
shipped config file, the tier spec examples of server/config/l3_tier_spec.h, a good L3 object, a
pipeline's worth of Redis replies, and the golden page-key cases of tests/data/keys_golden.json.
Inputs the fuzzer found interesting are merged in beside them by deploy/fuzz.sh --merge.

Run with Debian's python3 (python3-grpc-tools, python3-protobuf): tests/fuzz/make_corpus.py
"""

import json
import pathlib
import struct
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"


def proto_modules():
    """kvcellar.v1 Python messages, generated into a temporary directory."""
    out = tempfile.mkdtemp(prefix="kvcellar-fuzz-pb-")
    protos = sorted(str(p) for p in (ROOT / "proto" / "kvcellar" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                    f"--python_out={out}", *protos], check=True)
    sys.path.insert(0, out)
    from kvcellar.v1 import cache_service_pb2, common_pb2  # noqa: E402
    return cache_service_pb2, common_pb2


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data)


# ---- RegisterEngine and the data requests --------------------------------------------------


def registrations(cs, common):
    def base(kind, tp, opaque=False):
        r = cs.RegisterEngineRequest(instance_id="vllm-0", engine_name="vllm",
                                     client_version="0.1.0", pid=4242)
        r.namespace_spec.CopyFrom(common.NamespaceSpec(
            tenant="acme", model_id="meta-llama/Llama-3.1-8B-Instruct", model_revision="rev1",
            kv_dtype="bf16", page_size_tokens=16, layout_kind=kind, tp_size=tp, opaque_keys=opaque))
        return r

    def layers(layout, n, with_v, block):
        per_layer = layout.num_blocks * block * (2 if with_v else 1)
        for i in range(n):
            layer = layout.layers.add()
            stride = block * (2 if with_v else 1)
            layer.k.CopyFrom(cs.BlockBuffer(offset_bytes=i * per_layer, block_stride_bytes=stride,
                                            bytes_per_block=block))
            if with_v:
                layer.v.CopyFrom(cs.BlockBuffer(offset_bytes=i * per_layer + block,
                                                block_stride_bytes=stride, bytes_per_block=block))
        layout.regions[0].size_bytes = n * per_layer

    sim = base(common.LAYOUT_KIND_MHA_GQA, 2)
    sim.rank = 1
    sim.device.kind = common.DEVICE_KIND_SIM
    sim.device.uuid = b"\x01" * 16
    sim.layout.num_blocks = 64
    sim.layout.regions.add(sim_shm_name="/kvc-engine-0")
    layers(sim.layout, 2, True, 512)
    sim.completion.num_load_slots = 2
    sim.completion.num_ready_slots = 2
    sim.completion.sim_counters.shm_name = "/kvc-signals-0"
    sim.completion.sim_counters.size_bytes = 4096

    cuda = base(common.LAYOUT_KIND_MLA, 8)
    cuda.device.kind = common.DEVICE_KIND_CUDA
    cuda.device.uuid = bytes(range(16))
    cuda.layout.num_blocks = 32
    cuda.layout.regions.add(cuda_ipc_handle=b"\x03" * 64)
    layers(cuda.layout, 3, False, 576)
    cuda.completion.num_load_slots = 1
    cuda.completion.num_ready_slots = 1
    cuda.completion.cuda_events.load_event_handles = b"l" * (3 * 64)
    cuda.completion.cuda_events.ready_event_handles = b"r" * 64

    sched = base(common.LAYOUT_KIND_MHA_GQA, 4, opaque=True)
    sched.role = common.SESSION_ROLE_SCHEDULER

    plain = base(common.LAYOUT_KIND_MHA_GQA, 1)
    plain.device.kind = common.DEVICE_KIND_SIM
    plain.device.uuid = b"\x02" * 16
    plain.layout.num_blocks = 8
    plain.layout.regions.add(sim_shm_name="/proc/1234/fd/7")
    layers(plain.layout, 1, True, 4096)
    return {"sim-mha-worker": sim, "cuda-mla-worker": cuda, "scheduler": sched,
            "sim-no-completion": plain}


def data_requests(cs, common):
    """(name, selector, request): selector bits 0-1 are the RPC, the rest the session."""
    keys = bytes(range(32)) + bytes(range(32, 64))
    match_tokens = cs.MatchRequest(session_id=1, pin=True, prefetch_policy=common.PREFETCH_POLICY_NONE)
    match_tokens.sequences.add(token_ids=list(range(40)), request_id="req-1")
    match_tokens.sequences.add(token_ids=list(range(64)), num_computed_pages=1)
    match_keys = cs.MatchRequest(session_id=3, return_keys=True)
    match_keys.sequences.add(page_keys=keys, request_id="req-2")
    prefetch = cs.PrefetchRequest(session_id=1, policy=common.PREFETCH_POLICY_BEST_EFFORT)
    prefetch.sequences.add(parent_key=b"\x07" * 32, page_keys=keys, request_id="req-3")
    load = cs.LoadRequest(session_id=1, signal_layers=True, completion_slot=1)
    load.sequences.add(page_keys=keys, device_blocks=[3, 9], pin_id=5, release_pin=True)
    backup = cs.BackupRequest(session_id=1, write_policy=common.WRITE_POLICY_WRITE_THROUGH)
    backup.sequences.add(page_keys=keys, device_blocks=[0, 63], request_id="req-4")
    backup.ready.slot = 1
    backup.ready.sim_token = 17
    backup_mla = cs.BackupRequest(session_id=2)
    backup_mla.sequences.add(parent_key=b"\x09" * 32, page_keys=keys[:32], device_blocks=[31])
    backup_mla.ready.slot = 0
    return [("match-tokens-sim", 0 | 0 << 2, match_tokens),
            ("match-keys-scheduler", 0 | 2 << 2, match_keys),
            ("prefetch-sim", 1 | 0 << 2, prefetch),
            ("load-sim", 2 | 0 << 2, load),
            ("load-scheduler", 2 | 2 << 2, load),
            ("backup-sim", 3 | 0 << 2, backup),
            ("backup-cuda-mla", 3 | 1 << 2, backup_mla)]


# ---- L3 objects (storage/object_format.h) --------------------------------------------------


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def l3_object(ns: bytes, key: bytes, shard: int, payload: bytes, parent=None) -> bytes:
    """Format version 2 (160-byte header) with a parent link: a key, b"first", or None for
    neither; version 1 (128 bytes, no parent link) with parent="v1"."""
    if parent == "v1":
        h = bytearray(b"KVCELLAR" + struct.pack("<HHI", 1, 128, 0) + ns + key +
                      struct.pack("<IIQQ", shard, crc32c(payload), len(payload),
                                  1_700_000_000_000))
        h += bytes(20)
    else:
        flags = 0 if parent is None else (2 if parent == b"first" else 1)
        link = parent if flags == 1 else bytes(32)
        h = bytearray(b"KVCELLAR" + struct.pack("<HHI", 2, 160, flags) + ns + key +
                      struct.pack("<IIQQ", shard, crc32c(payload), len(payload),
                                  1_700_000_000_000) + link)
        h += bytes(20)
    h += struct.pack("<I", crc32c(bytes(h)))
    assert len(h) == (128 if parent == "v1" else 160)
    return bytes(h) + payload


# ---- Main ------------------------------------------------------------------------------------


def main() -> None:
    cs, common = proto_modules()
    for name, req in registrations(cs, common).items():
        write("register_engine", name, req.SerializeToString())
    for name, selector, req in data_requests(cs, common):
        write("data_requests", name, bytes([selector]) + req.SerializeToString())

    write("config_yaml", "shipped", (ROOT / "config" / "kvcellard.yaml").read_bytes())
    for f in sorted((ROOT / "tests" / "data" / "config").glob("*.yaml")):
        write("config_yaml", f.stem, f.read_bytes())
    write("config_yaml", "tenants",
          b"tenants:\n  allow:\n    - team-a=uid:1001\n    - team-b=gid:0\n    - =uid:root\n")
    write("config_yaml", "tiers-sequence",
          b"storage:\n  tiers:\n    - file:/var/lib/kvcellar/l3?capacity=1GiB\n"
          b"    - redis:127.0.0.1:6379?ttl_s=60\n")

    sets = {
        "pool": "pool.capacity=2GiB\npool.region_size=64MiB\npool.low_watermark=0.5",
        "listen": "listen.unix_socket=/run/kvcellar/kvcellard.sock\nlisten.unix_socket_mode=0660",
        "tiers": "storage.tiers=file:/var/lib/kvcellar/l3?name=nvme&capacity=500GiB;"
                 "redis:unix:/run/redis.sock?ttl_s=3600",
        "log": "log.level=debug\nsessions.lease_ms=30000",
        "tenants": "tenants.allow=team-a=uid:1001;team-a=gid:root;=uid:0\n"
                   "listen.max_connections_per_uid=64",
    }
    for name, text in sets.items():
        write("config_set", name, text.encode())

    tiers = [
        "file:/var/lib/kvcellar/l3?name=nvme&capacity=500GiB",
        "file:/mnt/shared/kv?name=shared&shared=true&io=threads&fsync=data&max_inflight=8",
        "redis:127.0.0.1:6379?name=redis&prefix=kvc:&ttl_s=3600&connections=2",
        "redis:unix:/run/redis/redis.sock?admit_after=2&timeout_ms=50",
        "redis-cluster:10.0.0.1:7000,[::1]:7001?name=cluster",
        "file:/a file:/b;redis:h:1",
    ]
    for i, text in enumerate(tiers):
        write("l3_tier_spec", str(i), text.encode())

    ns, key = bytes(range(32)), bytes(range(100, 132))
    good = l3_object(ns, key, 0, bytes(range(64)), parent=bytes(range(200, 232)))
    capacity_exact = 16 << 3  # Flag bits 3-7: reader capacity = payload size + (value - 16).
    write("object_header", "good", bytes([capacity_exact]) + good)
    write("object_header", "good-first-page",
          bytes([capacity_exact]) + l3_object(ns, key, 1, bytes(range(64)), parent=b"first"))
    write("object_header", "good-no-link",
          bytes([capacity_exact]) + l3_object(ns, key, 1, bytes(range(64))))
    write("object_header", "version-1",
          bytes([capacity_exact]) + l3_object(ns, key, 0, bytes(range(64)), parent="v1"))
    write("object_header", "good-reseal", bytes([capacity_exact | 3]) + good)
    write("object_header", "trailing-bytes", bytes([capacity_exact | 3]) + good + b"xx")
    write("object_header", "empty-payload", bytes([capacity_exact]) + l3_object(ns, key, 3, b""))
    write("object_header", "foreign-key", bytes([capacity_exact | 4]) + good)

    # Shape byte: commands = 1 + (bits 0-1) from GET SET EXISTS UNLINK GET starting at bits 5-7;
    # the GET's destination holds 64 << (bits 2-4) bytes.
    obj = l3_object(bytes(32), bytes(32), 0, bytes(range(64)))
    resp_obj = b"$%d\r\n%s\r\n" % (len(obj), obj)
    replies = {
        "get-hit": (0, resp_obj),
        "get-miss": (0, b"$-1\r\n"),
        "get-oversize": (0, b"$%d\r\n%s\r\n" % (len(obj) + 8, obj + bytes(8))),
        "pipeline": (3, resp_obj + b"+OK\r\n:1\r\n:0\r\n"),
        "moved": (0, b"-MOVED 3999 127.0.0.1:6381\r\n"),
        "ask": (1 | 1 << 5, b"-ASK 12 [::1]:7000\r\n+OK\r\n"),
        "error": (1 << 5, b"-OOM command not allowed when used memory > 'maxmemory'\r\n"),
        "array": (2 << 5, b"*2\r\n$1\r\na\r\n:1\r\n"),
        "torn": (0, resp_obj[:40]),
    }
    for name, (shape, data) in replies.items():
        write("redis_reply", name, bytes([shape]) + data)

    golden = json.loads((ROOT / "tests" / "data" / "keys_golden.json").read_text())
    for case in golden["cases"]:
        n = case["namespace"]
        lines = [n["tenant"], n["model_id"], n["model_revision"], n["kv_dtype"],
                 str(n["page_size"]), n["layout"], str(n["tp_size"]),
                 "1" if n["opaque_keys"] else "0", (case["page_keys"] or [case["ns_digest"]])[0]]
        tokens = struct.pack(f"<{len(case['tokens'])}I", *case["tokens"])
        write("key_spec", case["name"], "\n".join(lines).encode() + b"\n\x01" + tokens)


if __name__ == "__main__":
    main()
