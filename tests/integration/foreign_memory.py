"""The two sides of test_tenant_memory.py, each run as its own process under its own uid
(setpriv): an engine whose memory is the victim's, and an engine that names memory it does not
own when it registers.

  foreign_memory.py victim PREFIX MODE
      creates PREFIX-kv (a KV region's object), PREFIX-sig (a valid KVCSIG01 signal region),
      PREFIX-ro (mode 0644: others may open it read-only) and a memfd (SGLang's host pool),
      fills them with random bytes, prints {"pid", "memfd", "names", "inodes"} as one JSON line,
      then answers each stdin line with the SHA-256 of every object; exits at EOF.
  foreign_memory.py attack SOCKET PLAN_JSON
      for each attempt of the plan, sends one RegisterEngine naming the attempt's objects and
      prints one JSON line per attempt: {"name", "code", "reason", "field", "details"}. Before
      the attempts it creates its own KV object (and opens the files the plan names for
      /proc/self/fd paths).
Interpreter: Debian's /usr/bin/python3 (python3-grpcio); the kvcellar.v1 stubs are on
KVCELLAR_PY_DIR.
"""
import ctypes
import hashlib
import json
import mmap
import os
import struct
import sys

sys.path.insert(0, os.environ.get("KVCELLAR_PY_DIR", ""))

# One geometry for every registration: 2 layers, K and V, 16 blocks of 4 KiB.
LAYERS, BLOCKS, BLOCK_BYTES = 2, 16, 4096
KV_BYTES = LAYERS * 2 * BLOCKS * BLOCK_BYTES
# A signal region of 2 load slots, 2 layers, 2 ready slots: 64 + 2 * 64 + 2 * 64 bytes.
LOAD_SLOTS = READY_SLOTS = 2
SIG_BYTES = 4096


def create_object(name, nbytes, mode, fill=None):
    """A POSIX shm object as shm_open makes it (/dev/shm/NAME), mode set whatever the umask."""
    fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, mode)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    if fill is not None:
        m[:] = fill
    return fd, m


def file_id(st):
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino}"


def signal_header():
    return b"KVCSIG01" + struct.pack("<IIII", 1, LOAD_SLOTS, LAYERS, READY_SLOTS) + bytes(40)


def victim(prefix, mode):
    objects = {}
    for kind, nbytes, obj_mode in (("kv", KV_BYTES, mode), ("sig", SIG_BYTES, mode),
                                   ("ro", KV_BYTES, 0o644)):
        fill = os.urandom(nbytes)
        if kind == "sig":
            fill = signal_header() + fill[64:]
        objects[kind] = create_object(f"{prefix}-{kind}", nbytes, obj_mode, fill)
    memfd = os.memfd_create("kvc-victim-host-pool", 0)
    os.ftruncate(memfd, KV_BYTES)
    mm = mmap.mmap(memfd, KV_BYTES)
    mm[:] = os.urandom(KV_BYTES)
    objects["memfd"] = (memfd, mm)
    # Plain memory of the victim's process: what a CPU engine registers as /proc/<pid>/mem.
    private = mmap.mmap(-1, KV_BYTES)
    private[:] = os.urandom(KV_BYTES)
    objects["private"] = (None, private)
    print(json.dumps({
        "pid": os.getpid(), "memfd": memfd,
        "private_address": ctypes.addressof(ctypes.c_char.from_buffer(private)),
        "names": {k: f"{prefix}-{k}" for k in ("kv", "sig", "ro")},
        # As /proc/<pid>/maps spells a file: "major:minor inode" (hex device numbers).
        "files": {k: file_id(os.fstat(fd)) for k, (fd, _) in objects.items() if fd is not None},
    }), flush=True)
    for _ in sys.stdin:
        print(json.dumps({k: hashlib.sha256(m[:]).hexdigest() for k, (_, m) in objects.items()}),
              flush=True)
    for name in (f"{prefix}-{k}" for k in ("kv", "sig", "ro")):
        os.unlink("/dev/shm" + name)


def registration(cpb, common_pb2, instance, tenant, region, signals=None, offset=0):
    """A SIM WORKER registration whose one region is `region` (a name) from `offset`, with a
    completion channel on the object `signals` when given."""
    region_msg = cpb.MemoryRegion(sim_shm_name=region, offset_bytes=offset, size_bytes=KV_BYTES)
    layers = []
    for layer in range(LAYERS):
        buf = lambda i: cpb.BlockBuffer(region=0, offset_bytes=i * BLOCKS * BLOCK_BYTES,
                                        block_stride_bytes=BLOCK_BYTES, bytes_per_block=BLOCK_BYTES)
        layers.append(cpb.LayerLayout(k=buf(2 * layer), v=buf(2 * layer + 1)))
    req = cpb.RegisterEngineRequest(
        instance_id=instance, rank=0, role=common_pb2.SESSION_ROLE_WORKER,
        namespace_spec=common_pb2.NamespaceSpec(
            tenant=tenant, model_id="foreign-model", model_revision="r1", kv_dtype="bf16",
            page_size_tokens=16, layout_kind=common_pb2.LAYOUT_KIND_MHA_GQA, tp_size=1),
        device=common_pb2.DeviceSpec(kind=common_pb2.DEVICE_KIND_SIM, uuid=os.urandom(16)),
        layout=cpb.KvLayout(regions=[region_msg], layers=layers, num_blocks=BLOCKS),
        pid=os.getpid(), engine_name="foreign-memory-test")
    if signals is not None:
        req.completion.CopyFrom(cpb.CompletionChannel(
            num_load_slots=LOAD_SLOTS, num_ready_slots=READY_SLOTS,
            sim_counters=cpb.SimCounterSignals(shm_name=signals, size_bytes=SIG_BYTES)))
    return req


def attack(target, plan_json):
    import grpc
    from kvcellar.v1 import cache_service_pb2 as cpb
    from kvcellar.v1 import cache_service_pb2_grpc
    from kvcellar.v1 import common_pb2

    plan = json.loads(plan_json)
    own_prefix = f"/kvc-attacker-{os.getpid()}"
    own = f"{own_prefix}-kv"
    create_object(own, KV_BYTES, plan.get("own_mode", 0o666), bytes(KV_BYTES))
    # The attacker's own descriptors of objects it can open read-only, named through its own
    # /proc/<pid>/fd: the pid check passes, the owner check must not.
    fds = {}
    for path in plan.get("open_readonly", []):
        fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    own_memory = mmap.mmap(-1, KV_BYTES)
    own_memory_address = ctypes.addressof(ctypes.c_char.from_buffer(own_memory))
    channel = grpc.insecure_channel(target if ":" in target and not target.startswith("/")
                                    else f"unix:{target}")
    stub = cache_service_pb2_grpc.CacheServiceStub(channel)
    for i, attempt in enumerate(plan["attempts"]):
        region = attempt.get("region", "own")
        region = own if region == "own" else region
        if region.startswith("self-fd:"):
            region = f"/proc/{os.getpid()}/fd/{fds[region[len('self-fd:'):]]}"
        offset = attempt.get("offset", 0)
        if region == "self-mem":  # the attacker's own plain memory
            region, offset = f"/proc/{os.getpid()}/mem", own_memory_address
        req = registration(cpb, common_pb2, f"attacker-{os.getpid()}-{i}",
                           plan.get("tenant", ""), region, attempt.get("signals"), offset)
        out = {"name": attempt["name"], "region": region}
        try:
            resp = stub.RegisterEngine(req, timeout=10)
            out.update(code="OK", session_id=resp.session_id)
            if attempt.get("unregister", True):
                stub.UnregisterEngine(cpb.UnregisterEngineRequest(session_id=resp.session_id),
                                      timeout=10)
        except grpc.RpcError as e:
            md = dict(e.trailing_metadata() or ())
            out.update(code=e.code().name, reason=md.get("kvcellar-error-reason"),
                       field=md.get("kvcellar-error-field"), details=e.details())
        print(json.dumps(out), flush=True)
    os.unlink("/dev/shm" + own)


if __name__ == "__main__":
    if sys.argv[1] == "victim":
        victim(sys.argv[2], int(sys.argv[3], 8))
    elif sys.argv[1] == "attack":
        attack(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} victim PREFIX MODE | attack SOCKET PLAN_JSON")
