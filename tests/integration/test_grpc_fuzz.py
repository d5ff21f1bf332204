"""Structured gRPC fuzzing of a live daemon built with ASan and UBSan (issue #13).

Engines (kvcellar-engine-sim, also under ASan) run random traffic and verify every byte they load,
while this test sends mutated versions of valid requests to every RPC of CacheService (engine
socket) and AdminService (admin socket), and some of each to the other socket:

  - field mutations through the protobuf descriptors: extreme integers, enums out of range, empty
    and huge strings and bytes, strings of invalid UTF-8, repeated fields blown up or cleared,
    sub-messages cleared or mutated in turn, session ids that are unknown, stale or the fuzzer's
    own sessions of either role;
  - byte mutations of the serialized request (bit flips, truncation, insertions, deletions,
    duplicated chunks, overlong varints), sent as raw bytes through a generic unary call.

The fuzzer's own sessions (a SIM worker on shared memory of its own, and a scheduler) live in a
namespace of their own and are re-registered as mutations end them; the engines' session ids are
never used, so nothing the fuzzer sends may legitimately change bytes an engine loads.

Asserted: the daemon stays up and answers throughout; every answer is a status a handler chose
(never UNKNOWN, INTERNAL or UNAVAILABLE, which is what a crash or an escaped exception gives);
every engine exits OK with its bytes verified; the daemon's log holds no ASan, LeakSanitizer or
UBSan report and no raw protobuf error line; it exits 0 on SIGTERM.

Skipped unless KVCELLAR_ASAN_BIN_DIR names the ASan build's bin/ (deploy/dev.sh test sets it).
KVCELLAR_GRPC_FUZZ_SECONDS sets the fuzzing time (default 120), KVCELLAR_GRPC_FUZZ_SEED the seed
(default: random, printed). A longer run, e.g. 30 minutes:
  KVCELLAR_ASAN_BIN_DIR=build-asan-tools/bin KVCELLAR_GRPC_FUZZ_SECONDS=1800 \
    ctest --test-dir build -R integration.test_grpc_fuzz --output-on-failure --timeout 2400
"""
import collections
import os
import random
import re
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor

from conftest import Daemon
from engine_sim import DAEMON_ARGS, EXIT_OK, EngineProcess, require_cache_service

from kvcellar.v1 import admin_service_pb2, cache_service_pb2, common_pb2

FD = pb_descriptor.FieldDescriptor
DURATION_S = float(os.environ.get("KVCELLAR_GRPC_FUZZ_SECONDS", "120"))
SEED = int(os.environ.get("KVCELLAR_GRPC_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
# Only the RPCs whose full method name matches (to narrow a finding down); default all.
METHODS = re.compile(os.environ.get("KVCELLAR_GRPC_FUZZ_METHODS", ""))
THREADS = 4
CALL_TIMEOUT_S = 3.0
# Requests are kept below the daemon's message limit most of the time (a larger one is refused by
# gRPC itself, RESOURCE_EXHAUSTED, before any of our code sees it).
MAX_REQUEST_BYTES = 2 << 20

# What a crash, an escaped exception or a dead daemon looks like to a client.
CRASH_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
SANITIZER_REPORT = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|"
                              r"\[libprotobuf (ERROR|FATAL)")

ENGINE_GEOMETRY = dict(layers=2, block_bytes=4096, blocks=64, page_size=16, model="gf-model")
# The fuzzer's own worker: 2 MHA layers of 32 blocks of 1 KiB, K and V interleaved per block.
OWN_LAYERS, OWN_BLOCKS, OWN_BLOCK_BYTES = 2, 32, 1024
OWN_REGION_BYTES = OWN_LAYERS * OWN_BLOCKS * OWN_BLOCK_BYTES * 2

INT_RANGES = {
    FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1),
    FD.TYPE_SFIXED32: (-2**31, 2**31 - 1), FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1), FD.TYPE_INT64: (-2**63, 2**63 - 1),
    FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1),
}
# Set in a string field, then swapped for bytes of the same length that are not UTF-8 in the
# serialized request (protobuf's Python API refuses to hold such a string).
BAD_UTF8_MARKER = "~~NOT-UTF8~~"
BAD_UTF8_BYTES = b"\xff\xc3\x28\xa0\xa1\xe2\x28\xa1\xf0\x28\x8c\xbc"
assert len(BAD_UTF8_MARKER) == len(BAD_UTF8_BYTES)


class Sessions:
    """The fuzzer's own sessions, re-registered when a mutation (or the lease) ends them; the ids
    of ended ones are kept as stale ids to send. Each registration is a new instance in a new
    namespace: mutated registrations join the current ones (another rank, another geometry), and
    what they fix there must not keep the next valid one out."""

    def __init__(self, stub, shm_name, pid):
        self.stub, self.shm_name, self.pid = stub, shm_name, pid
        self.lock = threading.Lock()
        self.generation = 0
        self.worker = self.scheduler = 0
        self.stale = collections.deque(maxlen=32)
        self.registrations = 0

    def registration(self, scheduler):
        g = self.generation
        r = cache_service_pb2.RegisterEngineRequest(
            instance_id=f"gf-fuzz-{'scheduler' if scheduler else 'worker'}-{g}",
            replace_existing=True, pid=self.pid, engine_name="grpc-fuzz", client_version="0")
        r.namespace_spec.CopyFrom(common_pb2.NamespaceSpec(
            tenant="fuzz", model_id=f"gf-fuzz-model-{g}", model_revision="r1", kv_dtype="bf16",
            page_size_tokens=16, layout_kind=common_pb2.LAYOUT_KIND_MHA_GQA, tp_size=1))
        if scheduler:
            r.role = common_pb2.SESSION_ROLE_SCHEDULER
            return r
        r.device.kind = common_pb2.DEVICE_KIND_SIM
        r.device.uuid = b"\x42" * 16
        r.layout.num_blocks = OWN_BLOCKS
        r.layout.regions.add(sim_shm_name=self.shm_name, size_bytes=OWN_REGION_BYTES)
        per_layer = OWN_BLOCKS * OWN_BLOCK_BYTES * 2
        for i in range(OWN_LAYERS):
            layer = r.layout.layers.add()
            for buf, off in ((layer.k, 0), (layer.v, OWN_BLOCK_BYTES)):
                buf.offset_bytes = i * per_layer + off
                buf.block_stride_bytes = 2 * OWN_BLOCK_BYTES
                buf.bytes_per_block = OWN_BLOCK_BYTES
        return r

    def alive(self):
        """Renews both leases (1 s); False when either session is gone."""
        try:
            return all(self.stub.Heartbeat(cache_service_pb2.HeartbeatRequest(session_id=sid),
                                           timeout=CALL_TIMEOUT_S).state ==
                       cache_service_pb2.SESSION_STATE_ACTIVE
                       for sid in (self.worker, self.scheduler))
        except grpc.RpcError:
            return False

    def refresh(self):
        """Registers both sessions anew."""
        self.generation += 1
        self.registrations += 1
        ids = []
        for scheduler in (False, True):
            reply = self.stub.RegisterEngine(self.registration(scheduler), timeout=CALL_TIMEOUT_S)
            ids.append(reply.session_id)
        with self.lock:
            for old in (self.worker, self.scheduler):
                if old:
                    self.stale.append(old)
            self.worker, self.scheduler = ids

    def pick(self, rng):
        with self.lock:
            choices = [self.worker, self.worker, self.scheduler, 0, 2**64 - 1,
                       rng.randrange(1, 2**64)] + list(self.stale)[-4:]
        return rng.choice(choices)


def keys(n, salt=0):
    return b"".join(bytes([(i * 7 + j + salt) % 256 for j in range(32)]) for i in range(n))


def base_requests(sessions):
    """One or more valid requests per RPC, keyed by full method name."""
    w = sessions.worker
    cs, ad = cache_service_pb2, admin_service_pb2
    match = cs.MatchRequest(session_id=w, pin=True)
    match.sequences.add(token_ids=list(range(64)), request_id="m1")
    match_keys = cs.MatchRequest(session_id=w, return_keys=True)
    match_keys.sequences.add(page_keys=keys(3))
    prefetch = cs.PrefetchRequest(session_id=w, policy=common_pb2.PREFETCH_POLICY_BEST_EFFORT)
    prefetch.sequences.add(page_keys=keys(2), request_id="p1")
    load = cs.LoadRequest(session_id=w)
    load.sequences.add(page_keys=keys(2), device_blocks=[1, 2])
    backup = cs.BackupRequest(session_id=w)
    backup.sequences.add(page_keys=keys(2, salt=9), device_blocks=[3, 4], request_id="b1")
    c = "/kvcellar.v1.CacheService/"
    a = "/kvcellar.v1.AdminService/"
    return {
        c + "RegisterEngine": [sessions.registration(False), sessions.registration(True)],
        c + "Heartbeat": [cs.HeartbeatRequest(session_id=w, renew_pin_ids=[1, 2])],
        c + "UnregisterEngine": [cs.UnregisterEngineRequest(session_id=w, drain_timeout_ms=10)],
        c + "Match": [match, match_keys],
        c + "Prefetch": [prefetch],
        c + "Load": [load],
        c + "Backup": [backup],
        c + "WaitOps": [cs.WaitOpsRequest(session_id=w, op_ids=[1, 2], timeout_ms=10)],
        c + "Release": [cs.ReleaseRequest(session_id=w, pin_ids=[1], cancel_op_ids=[2])],
        a + "GetStatus": [ad.GetStatusRequest()],
        a + "ListEngines": [ad.ListEnginesRequest(instance_id="gf-fuzz-worker")],
        a + "ListNamespaces": [ad.ListNamespacesRequest()],
        a + "GetStats": [ad.GetStatsRequest(per_namespace=True)],
        a + "Evict": [ad.EvictRequest(tiers=[ad.TIER_L2], target_bytes=4096, dry_run=True)],
        a + "Clear": [ad.ClearRequest(tiers=[ad.TIER_L2], dry_run=True)],
        a + "GetConfig": [ad.GetConfigRequest()],
    }


# ---- Mutations ---------------------------------------------------------------------------------


def extreme_int(rng, lo, hi):
    v = rng.choice([0, 1, 2, 7, 255, 256, 1023, 1024, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**63 - 1, -1, -2**31, -2**63, hi, lo, hi - 1,
                    rng.randint(lo, hi)])
    return min(max(v, lo), hi)


def new_scalar(rng, field, sessions):
    t = field.type
    if field.name == "session_id" and rng.random() < 0.7:
        return sessions.pick(rng)
    if t in INT_RANGES:
        return extreme_int(rng, *INT_RANGES[t])
    if t == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if t == FD.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return rng.choice(values + [max(values) + 1, 99, 2**31 - 1, -1, -2**31])
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice([0.0, -1.0, 1e308, float("inf"), float("nan")])
    size = rng.choice([0, 1, 31, 32, 33, 64, 255, 256, 257, 1024, 8192, 70000, 1 << 20])
    if t == FD.TYPE_STRING:
        return rng.choice(["", "\x00", "/", "/proc/self/fd/0", "../../etc/passwd", "%s%n",
                           BAD_UTF8_MARKER, "é" * (size // 2), "x" * size])
    return rng.choice([b"", b"\x00" * size, os.urandom(min(size, 4096)) * max(1, size // 4096)])


def mutate_field(rng, msg, field, sessions, depth):
    repeated = field.label == FD.LABEL_REPEATED
    is_msg = field.type == FD.TYPE_MESSAGE
    if repeated:
        container = getattr(msg, field.name)
        op = rng.random()
        if op < 0.2:
            msg.ClearField(field.name)
        elif is_msg:
            if len(container) == 0 or op < 0.5:
                mutate_message(rng, container.add(), sessions, depth + 1)
            else:
                # Blown up: many copies of an element, the odd one mutated.
                template = container[rng.randrange(len(container))]
                n = rng.choice([2, 10, 100, 1000, 5000])
                for _ in range(min(n, MAX_REQUEST_BYTES // max(1, template.ByteSize()))):
                    container.add().CopyFrom(template)
                mutate_message(rng, container[rng.randrange(len(container))], sessions, depth + 1)
        else:
            value = new_scalar(rng, field, sessions)
            each = len(value) if isinstance(value, (str, bytes)) else 8
            n = min(rng.choice([1, 2, 33, 1000, 100000]), MAX_REQUEST_BYTES // max(1, each))
            container.extend([value if rng.random() < 0.5 else new_scalar(rng, field, sessions)
                              for _ in range(min(n, 50))] + [value] * max(0, n - 50))
        return
    if is_msg:
        if rng.random() < 0.25:
            msg.ClearField(field.name)
        else:
            mutate_message(rng, getattr(msg, field.name), sessions, depth + 1)
        return
    setattr(msg, field.name, new_scalar(rng, field, sessions))


def mutate_message(rng, msg, sessions, depth=0):
    fields = msg.DESCRIPTOR.fields
    if not fields or depth > 4:
        return
    for _ in range(rng.choice([1, 1, 2, 3])):
        field = rng.choice(fields)
        try:
            mutate_field(rng, msg, field, sessions, depth)
        except (ValueError, TypeError):
            pass  # A value Python's protobuf refuses to hold (a closed enum): another draw.


def mutate_bytes(rng, data):
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(7)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[pos % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[pos:pos] = os.urandom(rng.randint(1, 16))
        elif op == 2 and b:
            del b[pos:pos + rng.randint(1, 16)]
        elif op == 3:
            del b[pos:]
        elif op == 4 and b:
            chunk = b[pos:pos + rng.randint(1, 64)]
            b[pos:pos] = chunk * rng.randint(1, 64)
        elif op == 5:
            # An overlong varint, a length far past the end, a group tag, a field number of 0.
            b[pos:pos] = rng.choice([b"\xff" * 10 + b"\x01", b"\x12\xff\xff\xff\xff\x0f",
                                     b"\x0b", b"\x00", b"\x0a\x80\x80\x80\x80\x80\x01"])
        elif op == 6 and b:
            b[pos % len(b)] = rng.choice([0x00, 0x7f, 0x80, 0xff])
    return bytes(b)


# ---- The run -----------------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, daemon, sessions, deadline):
        self.daemon, self.sessions, self.deadline = daemon, sessions, deadline
        self.channels = {"engine": grpc.insecure_channel(f"unix:{daemon.socket}"),
                         "admin": grpc.insecure_channel(f"unix:{daemon.admin_socket}")}
        self.lock = threading.Lock()
        self.sent = collections.Counter()   # (method, kind) -> requests
        self.codes = collections.Counter()  # status code name -> answers
        self.accepted = collections.Counter()  # method -> OK answers
        self.failures = []
        self.calls = {}

    def call(self, socket_name, method):
        key = (socket_name, method)
        if key not in self.calls:
            self.calls[key] = self.channels[socket_name].unary_unary(
                method, request_serializer=None, response_deserializer=None)
        return self.calls[key]

    def one(self, rng, bases):
        method = rng.choice(sorted(bases))
        request = type(bases[method][0])()
        request.CopyFrom(rng.choice(bases[method]))
        kind = rng.choice(["field", "field", "bytes", "both"])
        if kind in ("field", "both"):
            mutate_message(rng, request, self.sessions)
        if request.ByteSize() > 4 * MAX_REQUEST_BYTES:
            request.CopyFrom(rng.choice(bases[method]))  # Mutations piled up: start again.
        data = request.SerializeToString().replace(BAD_UTF8_MARKER.encode(), BAD_UTF8_BYTES)
        if kind in ("bytes", "both"):
            data = mutate_bytes(rng, data)
        socket_name = "admin" if "AdminService" in method else "engine"
        if rng.random() < 0.1:
            socket_name = "engine" if socket_name == "admin" else "admin"
        code = grpc.StatusCode.OK
        try:
            self.call(socket_name, method)(data, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            code = e.code()
            if code in CRASH_CODES:
                with self.lock:
                    self.failures.append(f"{method} ({kind}, {socket_name} socket, {len(data)} "
                                         f"bytes): {code.name}: {e.details()}")
        with self.lock:
            self.sent[(method.rsplit("/", 1)[1], kind)] += 1
            self.codes[code.name] += 1
            self.accepted[method.rsplit("/", 1)[1]] += code == grpc.StatusCode.OK

    def worker(self, seed):
        rng = random.Random(seed)
        while time.monotonic() < self.deadline and not self.failures:
            bases = {m: r for m, r in base_requests(self.sessions).items() if METHODS.search(m)}
            for _ in range(50):
                self.one(rng, bases)

    def keeper(self):
        """Keeps the fuzzer's sessions registered, and checks that the daemon is up."""
        while time.monotonic() < self.deadline and not self.failures:
            if self.daemon.proc.poll() is not None:
                self.failures.append(f"kvcellard exited ({self.daemon.proc.returncode})")
                return
            if not self.sessions.alive():
                try:
                    self.sessions.refresh()
                except grpc.RpcError as e:
                    self.failures.append(f"re-registering the fuzzer's sessions: "
                                         f"{e.code().name}: {e.details()}")
                    return
            time.sleep(0.2)


def test_grpc_fuzz_every_rpc_under_asan(tmp_path, capsys):
    asan_dir = os.environ.get("KVCELLAR_ASAN_BIN_DIR")
    if not asan_dir:
        pytest.skip("KVCELLAR_ASAN_BIN_DIR not set")
    shm_name = f"/kvc-gf-{os.getpid()}-mem"
    with open(f"/dev/shm{shm_name}", "wb") as f:
        f.truncate(OWN_REGION_BYTES)
    d = Daemon(tmp_path, args=DAEMON_ARGS, name="grpc-fuzz")
    d.args[0] = os.path.join(asan_dir, "kvcellard")
    d.start()
    engines = []
    try:
        require_cache_service(d)
        # One byte seed for all: an engine verifies the pages the others stored.
        engines = [EngineProcess(d.socket, "random", bin_dir=asan_dir, instance=f"gf-engine-{i}",
                                 seed=31, tokens_seed=30, duration_s=int(DURATION_S),
                                 docs=40, max_pages=6, rpc_timeout_ms=2000, wait_ms=20000,
                                 **ENGINE_GEOMETRY)
                   for i in range(3)]
        stub = cache_service_pb2_grpc_stub(d)
        sessions = Sessions(stub, shm_name, os.getpid())
        sessions.refresh()
        fuzzer = Fuzzer(d, sessions, time.monotonic() + DURATION_S)
        threads = [threading.Thread(target=fuzzer.worker, args=(SEED + i,)) for i in range(THREADS)]
        threads.append(threading.Thread(target=fuzzer.keeper))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        report(capsys, fuzzer, sessions)
        assert not fuzzer.failures, "\n".join(fuzzer.failures[:20]) + "\n" + d.log()[-6000:]
        assert d.proc.poll() is None, d.log()[-6000:]
        methods = {m for m, _ in fuzzer.sent}
        assert len(methods) == sum(1 for m in base_requests(sessions) if METHODS.search(m)), methods

        results = [e.finish(timeout=DURATION_S + 120) for e in engines]
        for r in results:
            assert r.rc == EXIT_OK, r.describe()
            assert r["mismatched_bytes"] == 0, r.describe()
        with capsys.disabled():
            print(f"grpc fuzz: engines verified {sum(r['verified_bytes'] for r in results)} bytes "
                  f"in {sum(r['loaded_pages'] for r in results)} loaded pages")
    finally:
        for e in engines:
            e.kill()
        rc = d.stop()
        os.unlink(f"/dev/shm{shm_name}")
    log = d.log()
    found = SANITIZER_REPORT.search(log)
    assert found is None, log[max(0, found.start() - 2000):found.start() + 6000]
    assert rc == 0, log[-6000:]


def report(capsys, fuzzer, sessions):
    """The counts, printed past pytest's capture so that ctest's log keeps them."""
    with capsys.disabled():
        print(f"\ngrpc fuzz: seed {SEED}: {sum(fuzzer.sent.values())} requests in "
              f"{DURATION_S:.0f} s, answers by code: {dict(fuzzer.codes)}; the fuzzer's sessions "
              f"registered {sessions.registrations} times")
        for method in sorted({m for m, _ in fuzzer.sent}):
            print(f"  {method}: " + ", ".join(f"{k} {fuzzer.sent[(method, k)]}"
                                              for k in ("field", "bytes", "both"))
                  + f"; {fuzzer.accepted[method]} OK")


def cache_service_pb2_grpc_stub(daemon):
    from kvcellar.v1 import cache_service_pb2_grpc
    return cache_service_pb2_grpc.CacheServiceStub(grpc.insecure_channel(f"unix:{daemon.socket}"))
