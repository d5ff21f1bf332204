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
namespace of their own and are re-registered as mutations end them.

It also sends what belongs to others (issue #24, left open by #13):

  - other processes' session ids: the engines' sessions (listed on the admin socket) named in
    mutated requests of every session RPC. Each must be PERMISSION_DENIED (NOT_SESSION_OWNER), or
    FAILED_PRECONDITION (SESSION_UNKNOWN) once that session is gone, or an INVALID_ARGUMENT that
    the same request naming the fuzzer's own session also gets (refused for its own fields
    before any session was looked at); an OK or any other answer means the daemon acted on, or
    looked into, a session that is not the caller's. Every engine must finish without losing
    its session;
  - other users' memory: RegisterEngine naming, as a KV region or as the SIM signal region
    (completion.sim_counters), the shm objects of a victim process of another user (uid 4242,
    started with setpriv when the test runs as root), /proc/<pid>/fd/<fd> of another process
    (the memfd of that victim, and of a victim of this user: another pid's descriptor), and the
    daemon's own pool (pool.shm_name, and its /proc/<daemon pid>/fd/<fd>). A shm object of the
    caller's own user is the caller's to name (docs/security.md) and is not among them. The
    registration must be refused or fail (PERMISSION_DENIED expected), and the victim's bytes
    must be unchanged. A registration that is accepted is used as an attacker would (a Backup
    reads the victim's memory, a Load writes into it, with per-layer signals into a signal
    region) before the bytes are compared; for the pool, whose bytes change anyway, the
    acceptance alone fails the check.

    The findings are collected apart (Fuzzer.memory_failures) and fail the test; the daemon
    refuses such memory since api_revision 3 (docs/security.md).

Nothing the fuzzer sends may legitimately change bytes an engine loads.

Asserted: the daemon stays up and answers throughout; every answer is a status a handler chose
(never UNKNOWN, INTERNAL or UNAVAILABLE, which is what a crash or an escaped exception gives);
every engine exits OK with its bytes verified; the daemon's log holds no ASan, LeakSanitizer or
UBSan report and no raw protobuf error line; it exits 0 on SIGTERM.

test_grpc_fuzz_every_rpc_under_asan is skipped unless KVCELLAR_ASAN_BIN_DIR names the ASan
build's bin/ (deploy/dev.sh test sets it). test_foreign_sessions_and_memory runs only the
foreign-id and foreign-memory checks, for KVCELLAR_GRPC_FUZZ_FOREIGN_SECONDS (default 15), on the
ASan build when it is named, else on the regular one.
KVCELLAR_GRPC_FUZZ_SECONDS sets the fuzzing time (default 75, the CI run), KVCELLAR_GRPC_FUZZ_SEED the seed
(default: random, printed). A longer run, e.g. 30 minutes:
  KVCELLAR_ASAN_BIN_DIR=build-fuzz/bin KVCELLAR_GRPC_FUZZ_SECONDS=1800 \
    ctest --test-dir build -R integration.test_grpc_fuzz --output-on-failure --timeout 2400
"""
import collections
import os
import struct
import subprocess
import random
import re
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor

from conftest import BIN_DIR, Daemon
from engine_sim import DAEMON_ARGS, EXIT_OK, EngineProcess, require_cache_service

from kvcellar.v1 import admin_service_pb2, admin_service_pb2_grpc, cache_service_pb2, common_pb2

FD = pb_descriptor.FieldDescriptor
DURATION_S = float(os.environ.get("KVCELLAR_GRPC_FUZZ_SECONDS", "75"))
SEED = int(os.environ.get("KVCELLAR_GRPC_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
# Only the RPCs whose full method name matches (to narrow a finding down); default all.
METHODS = re.compile(os.environ.get("KVCELLAR_GRPC_FUZZ_METHODS", ""))
THREADS = 4
CALL_TIMEOUT_S = 3.0
# Requests are kept below the daemon's message limit most of the time (a larger one is refused by
# gRPC itself, RESOURCE_EXHAUSTED, before any of our code sees it).
MAX_REQUEST_BYTES = 2 << 20

FOREIGN_SECONDS = float(os.environ.get("KVCELLAR_GRPC_FUZZ_FOREIGN_SECONDS", "15"))
# Share of the fuzz workers' requests that name an engine's session id.
FOREIGN_SESSION_SHARE = 0.15
# RPCs whose request names a session.
SESSION_METHODS = ("Heartbeat", "UnregisterEngine", "Match", "Prefetch", "Load", "Backup",
                   "WaitOps", "Release")
ERROR_REASON_KEY = "kvcellar-error-reason"

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

    def registration(self, scheduler, instance=None, model=None, region=None):
        """A valid registration of the fuzzer's worker (or scheduler); `region` replaces the
        worker's own shm object."""
        g = self.generation
        r = cache_service_pb2.RegisterEngineRequest(
            instance_id=instance or f"gf-fuzz-{'scheduler' if scheduler else 'worker'}-{g}",
            replace_existing=True, pid=self.pid, engine_name="grpc-fuzz", client_version="0")
        r.namespace_spec.CopyFrom(common_pb2.NamespaceSpec(
            tenant="fuzz", model_id=model or f"gf-fuzz-model-{g}", model_revision="r1",
            kv_dtype="bf16", page_size_tokens=16, layout_kind=common_pb2.LAYOUT_KIND_MHA_GQA,
            tp_size=1))
        if scheduler:
            r.role = common_pb2.SESSION_ROLE_SCHEDULER
            return r
        r.device.kind = common_pb2.DEVICE_KIND_SIM
        r.device.uuid = b"\x42" * 16
        r.layout.num_blocks = OWN_BLOCKS
        r.layout.regions.add(sim_shm_name=region or self.shm_name, size_bytes=OWN_REGION_BYTES)
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


# ---- Other processes' sessions and memory -------------------------------------------------------

# Signal slots and layers of the fuzzer's worker and of the victim's signal region.
SIG_LOAD_SLOTS, SIG_READY_SLOTS = 2, 1
SIG_HEADER_BYTES, SIG_READY_SLOT_BYTES = 64, 64


def signal_region_bytes(load_slots=SIG_LOAD_SLOTS, layers=OWN_LAYERS, ready_slots=SIG_READY_SLOTS):
    """core/signal_layout.h: Bytes(load_slots, num_layers, ready_slots)."""
    stride = ((layers + 1) * 8 + 63) // 64 * 64
    return SIG_HEADER_BYTES + load_slots * stride + ready_slots * SIG_READY_SLOT_BYTES


def signal_region_image(load_slots=SIG_LOAD_SLOTS, layers=OWN_LAYERS, ready_slots=SIG_READY_SLOTS):
    """A KVCSIG01 region as an engine creates it (core::SignalLayout::WriteHeader): magic,
    version 1 and the slot counts; every word after it a pattern a daemon write would change."""
    n = signal_region_bytes(load_slots, layers, ready_slots)
    header = b"KVCSIG01" + struct.pack("<4I", 1, load_slots, layers, ready_slots)
    body = bytes((0xa5 ^ i) & 0xff for i in range(n - len(header)))
    return header + body


# Another process's memory: a KV-sized shm object, a valid signal region, and a memfd, each
# filled with a pattern and held open and mapped for as long as the victim runs (until its stdin
# closes). Prints its pid and the memfd's fd number.
VICTIM = r"""
import mmap, os, sys
kv_name, sig_name, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
sig = bytes.fromhex(sys.argv[4])
kv = bytes((i * 131 + 7) % 251 for i in range(kv_bytes))
maps = []
def hold(fd, data):
    os.write(fd, data)
    maps.append(mmap.mmap(fd, len(data)))
for path, data in ((f"/dev/shm{kv_name}", kv), (f"/dev/shm{sig_name}", sig)):
    hold(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), data)
memfd = os.memfd_create("kvc-gf-victim")
hold(memfd, kv)
print(os.getpid(), memfd, flush=True)
sys.stdin.read()
for path in (kv_name, sig_name):
    os.unlink(f"/dev/shm{path}")
"""


# The uid (and gid) the other user's victim runs as: one no account of this machine uses.
VICTIM_UID = 4242


class Victim:
    """A process whose memory the fuzzer names in its registrations; run as `uid` (this test
    must then be root) or as this process's user."""

    def __init__(self, uid=None):
        tag = f"/kvc-gf-victim-{os.getpid()}-{'u' if uid is None else uid}"
        self.uid = uid
        self.owner = "another user's" if uid is not None else "another process's (same user)"
        self.kv_name, self.sig_name = f"{tag}-kv", f"{tag}-sig"
        self.sig_image = signal_region_image()
        cmd = ["/usr/bin/python3", "-c", VICTIM, self.kv_name, self.sig_name,
               str(OWN_REGION_BYTES), self.sig_image.hex()]
        if uid is not None:
            cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        pid, fd = self.proc.stdout.readline().split()
        self.memfd_path = f"/proc/{pid}/fd/{fd}"
        self.kv_image = bytes((i * 131 + 7) % 251 for i in range(OWN_REGION_BYTES))

    def targets(self):
        """(what, shm name as registered, path to read its bytes, the bytes it must keep). An
        object of the caller's own user is the caller's to name (docs/security.md), so a
        same-user victim offers only its memfd by /proc path: another pid's descriptor."""
        out = [(f"{self.owner} memfd by /proc path", self.memfd_path, self.memfd_path,
                self.kv_image)]
        if self.uid is not None:
            out.append((f"{self.owner} shm object", self.kv_name, f"/dev/shm{self.kv_name}",
                        self.kv_image))
        return out

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


class Victims:
    """Another user's process (when this test runs as root: setpriv), and another process of
    this user."""

    def __init__(self):
        self.other_user = Victim(VICTIM_UID) if os.geteuid() == 0 else None
        self.same_user = Victim()

    def all(self):
        return [v for v in (self.other_user, self.same_user) if v is not None]

    def targets(self):
        return [t for v in self.all() for t in v.targets()]

    def close(self):
        for v in self.all():
            v.close()


def read_bytes(path, n):
    with open(path, "rb") as f:
        return f.read(n)


def daemon_pool_targets(daemon, pool_name):
    """The daemon's own pool: by name, and by /proc/<daemon pid>/fd/<fd> of its mapping."""
    out = [("the daemon's own pool", pool_name)]
    fd_dir = f"/proc/{daemon.proc.pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(f"{fd_dir}/{fd}") == f"/dev/shm{pool_name}":
                out.append(("the daemon's own pool by /proc path", f"{fd_dir}/{fd}"))
                break
        except OSError:
            continue
    return out


def reason_of(err):
    return dict(err.trailing_metadata() or ()).get(ERROR_REASON_KEY, "")


# ---- The run -----------------------------------------------------------------------------------


class Fuzzer:
    def __init__(self, daemon, sessions, deadline, victim=None, pool_name=None,
                 engine_prefix="gf-engine-"):
        self.daemon, self.sessions, self.deadline = daemon, sessions, deadline
        self.victim, self.pool_name = victim, pool_name
        # The engines' instance ids start with it. (Not their pid: a registration's pid is
        # self-reported, and the fuzzer's mutated registrations send any.)
        self.engine_prefix = engine_prefix
        self.foreign_ids = []  # Session ids of other processes (the engines').
        self.memory_failures = []  # Foreign memory not refused (see the docstring).
        self.memory_codes = collections.Counter()  # answers to foreign-memory registrations
        self.memory_rounds = 0
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

    def worker(self, seed, foreign_share=FOREIGN_SESSION_SHARE, foreign_only=False):
        rng = random.Random(seed)
        while time.monotonic() < self.deadline and not self.failures:
            bases = {m: r for m, r in base_requests(self.sessions).items() if METHODS.search(m)}
            for _ in range(50):
                if self.foreign_ids and (foreign_only or rng.random() < foreign_share):
                    self.foreign_session_one(rng, bases)
                elif not foreign_only:
                    self.one(rng, bases)

    def refresh_foreign_ids(self, admin_stub):
        """The session ids of the engines: other processes, whose ids the fuzzer never owns."""
        reply = admin_stub.ListEngines(admin_service_pb2.ListEnginesRequest(),
                                       timeout=CALL_TIMEOUT_S)
        ids = [e.session_id for e in reply.sessions
               if e.instance_id.startswith(self.engine_prefix)]
        with self.lock:
            self.foreign_ids = ids

    def foreign_session_one(self, rng, bases):
        """A mutated request of a session RPC naming an engine's session: PERMISSION_DENIED, or
        SESSION_UNKNOWN once that session is gone; never acted on."""
        candidates = [m for m in bases if m.rsplit("/", 1)[1] in SESSION_METHODS]
        if not candidates:
            return
        method = rng.choice(sorted(candidates))
        request = type(bases[method][0])()
        request.CopyFrom(rng.choice(bases[method]))
        mutate_message(rng, request, self.sessions)
        if request.ByteSize() > MAX_REQUEST_BYTES // 2:
            request.CopyFrom(rng.choice(bases[method]))
        with self.lock:
            victim_id = rng.choice(self.foreign_ids)
        request.session_id = victim_id  # Last: whatever the mutations did, it names the engine.
        name = method.rsplit("/", 1)[1]
        code, reason = self.answer(method, request)
        # A Heartbeat naming a session that is gone (the engine's lease lapsed on a loaded
        # machine, or it registered again) answers OK with state SESSION_STATE_UNKNOWN: how any
        # client learns to register again, and all it says is that the id names no session.
        ok = ((code, reason) in
              {(grpc.StatusCode.PERMISSION_DENIED, "ERROR_REASON_NOT_SESSION_OWNER"),
               (grpc.StatusCode.FAILED_PRECONDITION, "ERROR_REASON_SESSION_UNKNOWN"),
               (grpc.StatusCode.OK, "SESSION_STATE_UNKNOWN")})
        if not ok and code == grpc.StatusCode.INVALID_ARGUMENT:
            # Refused for its own fields before the session was looked at (a Heartbeat renewing
            # more pins than any session may): acceptable only if naming the fuzzer's own
            # session gets the very same answer, so that nothing about the victim's session
            # (its layout, its ops, its pins) decided it.
            request.session_id = self.sessions.worker
            ok = self.answer(method, request) == (code, reason)
        with self.lock:
            self.sent[(name, "foreign-session")] += 1
            self.codes[code.name] += 1
            if not ok:
                self.failures.append(f"{name} naming another process's session {victim_id}: "
                                     f"{code.name} {reason} (expected PERMISSION_DENIED "
                                     "NOT_SESSION_OWNER, SESSION_UNKNOWN, or the answer the "
                                     "fuzzer's own session gets)")

    def answer(self, method, request):
        """(code, kvcellar-error-reason) of `request` sent on the engine socket; for a
        Heartbeat answered OK, the session state it reports in place of the reason."""
        try:
            reply = self.call("engine", method)(request.SerializeToString(),
                                                timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            return e.code(), reason_of(e)
        if method.endswith("/Heartbeat"):
            state = cache_service_pb2.HeartbeatResponse.FromString(reply).state
            return grpc.StatusCode.OK, cache_service_pb2.SessionState.Name(state)
        return grpc.StatusCode.OK, ""

    def memory_finding(self, what):
        with self.lock:
            self.memory_failures.append(what)

    def register_foreign(self, stub, what, request):
        """Sends a registration naming foreign memory; the session id when it was accepted."""
        try:
            reply = stub.RegisterEngine(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            with self.lock:
                self.memory_codes[f"{e.code().name} {reason_of(e)}".strip()] += 1
            if e.code() != grpc.StatusCode.PERMISSION_DENIED:
                self.memory_finding(f"RegisterEngine naming {what} answered {e.code().name} "
                                    f"{reason_of(e)} (expected PERMISSION_DENIED)")
            return 0
        with self.lock:
            self.memory_codes["OK"] += 1
        self.memory_finding(f"RegisterEngine naming {what} was accepted (expected "
                            "PERMISSION_DENIED naming the field)")
        return reply.session_id

    def unregister(self, stub, session_id):
        try:
            stub.UnregisterEngine(cache_service_pb2.UnregisterEngineRequest(
                session_id=session_id, drain_timeout_ms=1000), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError:
            pass

    def use_as_attacker(self, stub, session_id, model, seed, signals):
        """What an accepted foreign registration allows: a Backup reads the victim's blocks into
        the cache; a Load of pages the fuzzer stored from its own memory writes into the
        victim's blocks (with `signals`, per-layer signals into its signal region too)."""
        own = self.sessions.registration(False, instance=f"gf-own-{seed}", model=model)
        own_id = stub.RegisterEngine(own, timeout=CALL_TIMEOUT_S).session_id
        stored = keys(4, salt=seed % 200)
        try:
            b = cache_service_pb2.BackupRequest(session_id=own_id)
            b.sequences.add(page_keys=stored, device_blocks=[20, 21, 22, 23])
            op = stub.Backup(b, timeout=CALL_TIMEOUT_S).op.op_id
            stub.WaitOps(cache_service_pb2.WaitOpsRequest(session_id=own_id, op_ids=[op],
                                                          timeout_ms=2000), timeout=5)
            ops = []
            read = cache_service_pb2.BackupRequest(session_id=session_id)
            read.sequences.add(page_keys=keys(2, salt=(seed + 101) % 200), device_blocks=[0, 1])
            ops.append(stub.Backup(read, timeout=CALL_TIMEOUT_S).op.op_id)
            write = cache_service_pb2.LoadRequest(session_id=session_id, signal_layers=signals,
                                                  completion_slot=0)
            write.sequences.add(page_keys=stored, device_blocks=[2, 3, 4, 5])
            ops.append(stub.Load(write, timeout=CALL_TIMEOUT_S).op.op_id)
            stub.WaitOps(cache_service_pb2.WaitOpsRequest(session_id=session_id, op_ids=ops,
                                                          timeout_ms=2000), timeout=5)
        except grpc.RpcError:
            pass  # The attack failed somewhere: the bytes say whether it got through.
        finally:
            self.unregister(stub, own_id)

    def foreign_memory_round(self, stub, rng):
        """One registration naming each foreign object; checks the victim's bytes after it."""
        self.memory_rounds += 1
        seed = self.memory_rounds
        model = f"gf-foreign-{seed}"
        checked = []  # (what, registration, path, image): the victim's, with bytes to compare
        blind = []    # (what, registration): objects whose bytes change anyway
        if self.victim is not None:
            for what, name, path, image in self.victim.targets():
                checked.append((what, self.sessions.registration(
                    False, instance=f"gf-foreign-{seed}-{len(checked)}", model=model,
                    region=name), path, image))
            other = self.victim.other_user
            if other is not None:
                sig = self.sessions.registration(False, instance=f"gf-foreign-{seed}-sig",
                                                 model=model)
                sig.completion.num_load_slots = SIG_LOAD_SLOTS
                sig.completion.num_ready_slots = SIG_READY_SLOTS
                sig.completion.sim_counters.shm_name = other.sig_name
                sig.completion.sim_counters.size_bytes = len(other.sig_image)
                checked.append((f"{other.owner} shm object as the signal region", sig,
                                f"/dev/shm{other.sig_name}", other.sig_image))
        others = daemon_pool_targets(self.daemon, self.pool_name) if self.pool_name else []
        for what, name in others:
            blind.append((what, self.sessions.registration(
                False, instance=f"gf-foreign-{seed}-b{len(blind)}", model=f"{model}-b",
                region=name)))
        for what, request, path, image in checked:
            session_id = self.register_foreign(stub, what, request)
            if session_id:
                self.use_as_attacker(stub, session_id, model, seed,
                                     signals=request.completion.num_load_slots > 0)
                self.unregister(stub, session_id)
            now = read_bytes(path, len(image))
            if now != image:
                changed = sum(a != b for a, b in zip(now, image)) + abs(len(now) - len(image))
                self.memory_finding(f"{what}: {changed} bytes changed after a registration "
                                    "naming it")
        for what, request in blind:
            name = request.layout.regions[0].sim_shm_name
            session_id = self.register_foreign(stub, f"{what} ({name})", request)
            if session_id:
                self.unregister(stub, session_id)  # Not used: others' bytes would be harmed.

    def foreign_keeper(self, admin_stub, stub, seed, memory_interval_s=1.0):
        """Keeps the engines' session ids current and runs a foreign-memory round now and then."""
        rng = random.Random(seed)
        next_round = time.monotonic()
        while time.monotonic() < self.deadline and not self.failures:
            try:
                self.refresh_foreign_ids(admin_stub)
                if time.monotonic() >= next_round:
                    self.foreign_memory_round(stub, rng)
                    next_round = time.monotonic() + memory_interval_s
            except grpc.RpcError as e:
                with self.lock:
                    self.failures.append(f"foreign keeper: {e.code().name}: {e.details()}")
                return
            time.sleep(0.2)

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
    pool_name = f"/kvc-gf-{os.getpid()}-pool"
    d = Daemon(tmp_path, args=(*DAEMON_ARGS, "--set", f"pool.shm_name={pool_name}"),
               name="grpc-fuzz")
    d.args[0] = os.path.join(asan_dir, "kvcellard")
    d.start()
    engines = []
    victim = Victims()
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
        fuzzer = Fuzzer(d, sessions, time.monotonic() + DURATION_S, victim, pool_name)
        threads = [threading.Thread(target=fuzzer.worker, args=(SEED + i,)) for i in range(THREADS)]
        threads.append(threading.Thread(target=fuzzer.keeper))
        threads.append(threading.Thread(target=fuzzer.foreign_keeper,
                                        args=(admin_stub(d), stub, SEED)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        report(capsys, fuzzer, sessions)
        assert not fuzzer.failures, "\n".join(fuzzer.failures[:20]) + "\n" + d.log()[-6000:]
        assert d.proc.poll() is None, d.log()[-6000:]
        methods = {m for m, _ in fuzzer.sent}
        assert len(methods) == sum(1 for m in base_requests(sessions) if METHODS.search(m)), methods
        check_foreign_memory(fuzzer)

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
        victim.close()
        rc = d.stop()
        os.unlink(f"/dev/shm{shm_name}")
        remove_shm(pool_name)
    log = d.log()
    found = SANITIZER_REPORT.search(log)
    assert found is None, log[max(0, found.start() - 2000):found.start() + 6000]
    assert rc == 0, log[-6000:]


def check_foreign_memory(fuzzer):
    """Every foreign-memory registration was refused and left the victim's bytes alone."""
    assert fuzzer.memory_rounds > 0, "no foreign-memory round ran"
    if fuzzer.memory_failures:
        raise AssertionError("other processes' memory was not refused:\n" +
                             "\n".join(sorted(set(fuzzer.memory_failures))[:20]))


def remove_shm(name):
    """Removes a shm object, and the warm-restart journal a pool object comes with."""
    for path in (f"/dev/shm{name}", f"/dev/shm{name}.journal"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def test_foreign_sessions_and_memory(tmp_path, capsys):
    """The foreign-id and foreign-memory checks alone, on the ASan build when it is named, else
    on the regular one: engines run random traffic while the fuzzer names their sessions in
    mutated requests and registers other processes' memory."""
    bin_dir = os.environ.get("KVCELLAR_ASAN_BIN_DIR") or BIN_DIR
    shm_name = f"/kvc-gf-{os.getpid()}-mem2"
    with open(f"/dev/shm{shm_name}", "wb") as f:
        f.truncate(OWN_REGION_BYTES)
    pool_name = f"/kvc-gf-{os.getpid()}-pool2"
    # A longer lease than DAEMON_ARGS': an engine's lost session must come from a request that
    # named it, not from a slow heartbeat on a loaded machine.
    d = Daemon(tmp_path, args=(*DAEMON_ARGS, "--set", f"pool.shm_name={pool_name}",
                               "--set", "sessions.lease_ms=5000"), name="grpc-foreign")
    d.args[0] = os.path.join(bin_dir, "kvcellard")
    d.start()
    engines = []
    victim = Victims()
    try:
        require_cache_service(d)
        engines = [EngineProcess(d.socket, "random", bin_dir=bin_dir, instance=f"gf-victim-{i}",
                                 seed=33, tokens_seed=32, duration_s=int(FOREIGN_SECONDS) + 3,
                                 docs=20, max_pages=6, rpc_timeout_ms=2000, wait_ms=20000,
                                 **ENGINE_GEOMETRY)
                   for i in range(2)]
        stub = cache_service_pb2_grpc_stub(d)
        sessions = Sessions(stub, shm_name, os.getpid())
        sessions.refresh()
        fuzzer = Fuzzer(d, sessions, time.monotonic() + FOREIGN_SECONDS, victim, pool_name,
                        engine_prefix="gf-victim-")
        fuzzer.refresh_foreign_ids(admin_stub(d))
        deadline = time.monotonic() + 15
        while len(fuzzer.foreign_ids) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            fuzzer.refresh_foreign_ids(admin_stub(d))
        assert len(fuzzer.foreign_ids) >= 2, "the engines did not register"
        threads = [threading.Thread(target=fuzzer.worker, args=(SEED + i,),
                                    kwargs=dict(foreign_only=True)) for i in range(2)]
        threads.append(threading.Thread(target=fuzzer.keeper))
        threads.append(threading.Thread(target=fuzzer.foreign_keeper,
                                        args=(admin_stub(d), stub, SEED, 0.5)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report(capsys, fuzzer, sessions, FOREIGN_SECONDS)
        assert not fuzzer.failures, "\n".join(fuzzer.failures[:20]) + "\n" + d.log()[-6000:]
        assert sum(n for (m, k), n in fuzzer.sent.items() if k == "foreign-session") > 100
        assert d.proc.poll() is None, d.log()[-6000:]
        results = [e.finish(timeout=FOREIGN_SECONDS + 120) for e in engines]
        for r in results:
            assert r.rc == EXIT_OK, r.describe()
            assert r["mismatched_bytes"] == 0, r.describe()
            # No request naming its session acted on it: it never lost the session.
            assert r["stats"]["sessions_lost"] == 0, r.describe()
        check_foreign_memory(fuzzer)
    finally:
        for e in engines:
            e.kill()
        victim.close()
        d.stop()
        os.unlink(f"/dev/shm{shm_name}")
        remove_shm(pool_name)


def report(capsys, fuzzer, sessions, duration_s=DURATION_S):
    """The counts, printed past pytest's capture so that ctest's log keeps them."""
    with capsys.disabled():
        print(f"\ngrpc fuzz: seed {SEED}: {sum(fuzzer.sent.values())} requests in "
              f"{duration_s:.0f} s, answers by code: {dict(fuzzer.codes)}; the fuzzer's sessions "
              f"registered {sessions.registrations} times")
        for method in sorted({m for m, _ in fuzzer.sent}):
            kinds = ("field", "bytes", "both", "foreign-session")
            print(f"  {method}: " + ", ".join(f"{k} {fuzzer.sent[(method, k)]}" for k in kinds)
                  + f"; {fuzzer.accepted[method]} OK")
        print(f"  foreign memory: {fuzzer.memory_rounds} rounds, registrations answered "
              f"{dict(fuzzer.memory_codes)}")
        for finding in sorted(set(fuzzer.memory_failures)):
            print(f"  foreign-memory finding: {finding}")


def admin_stub(daemon):
    return admin_service_pb2_grpc.AdminServiceStub(
        grpc.insecure_channel(f"unix:{daemon.admin_socket}"))


def cache_service_pb2_grpc_stub(daemon):
    from kvcellar.v1 import cache_service_pb2_grpc
    return cache_service_pb2_grpc.CacheServiceStub(grpc.insecure_channel(f"unix:{daemon.socket}"))
